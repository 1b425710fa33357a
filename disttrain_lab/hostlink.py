"""An emulated host link (PCIe between an accelerator and its host): copies that take a ``dl.Network``'s time.

ZeRO-Offload keeps the optimizer on the host: every step, the 16-bit gradients go down the link
(device → host) and the updated 16-bit parameters come back up (host → device).  On this machine
host and "device" are the same memory and a copy is nearly free, so ``HostLink`` makes each copy
take the α–β model's time, ``latency + nbytes / bandwidth``, one copy at a time in each direction
(PCIe is full duplex: a copy down and a copy up run at once), in the background, as
``tensor.to(device, non_blocking=True)`` does on a CUDA stream::

    link = HostLink(dl.Network.preset("PCIe 4.0 x16"))
    future = link.copy(param.grad, "down")        # returns at once: a concurrent.futures.Future
    on_host = future.result()                     # waits until the modelled transfer is over
    link.bytes("down"), link.log                  # what crossed, and when

The copy is taken when ``copy`` is called (the source may change afterwards), converted to
``dtype`` if one is given (what crosses is counted in that dtype).  ``link.log`` lists every
transfer as ``Transfer(direction, nbytes, start, end)``, times from ``time.perf_counter``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .network import Network

__all__ = ["HostLink", "Transfer", "DIRECTIONS"]

DIRECTIONS = ("down", "up")  # down: device -> host (gradients); up: host -> device (parameters)


@dataclass(frozen=True)
class Transfer:
    """One copy over the link."""

    direction: str  # "down" or "up"
    nbytes: int
    start: float  # time.perf_counter() when the link began carrying it
    end: float  # ... and when it was through


class HostLink:
    """An emulated device <-> host link with the α–β time of ``network`` (default: "PCIe 4.0 x16")."""

    def __init__(self, network: Network | None = None):
        self.network = network if network is not None else Network.preset("PCIe 4.0 x16")
        self.log: list[Transfer] = []
        self._lock = threading.Lock()
        self._lanes = {d: ThreadPoolExecutor(1, thread_name_prefix=f"hostlink-{d}") for d in DIRECTIONS}

    def copy(self, tensor: torch.Tensor, direction: str, dtype: torch.dtype | None = None) -> Future:
        """Start copying ``tensor`` (as ``dtype``) ``direction`` ("down" or "up"); a Future of the copy."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS} (down: device -> host), got {direction!r}")
        data = tensor.detach().to(dtype or tensor.dtype, copy=True)
        nbytes = data.numel() * data.element_size()
        return self._lanes[direction].submit(self._carry, data, direction, nbytes)

    def _carry(self, data: torch.Tensor, direction: str, nbytes: int) -> torch.Tensor:
        start = time.perf_counter()
        deadline = start + self.network.time(nbytes)
        while (left := deadline - time.perf_counter()) > 0:
            time.sleep(left)
        with self._lock:
            self.log.append(Transfer(direction, nbytes, start, time.perf_counter()))
        return data

    def bytes(self, direction: str | None = None) -> int:
        """Bytes carried so far (in ``direction``, or both)."""
        with self._lock:
            return sum(t.nbytes for t in self.log if direction in (None, t.direction))

    def busy(self, direction: str) -> float:
        """Seconds the link carried something in ``direction``."""
        with self._lock:
            return sum(t.end - t.start for t in self.log if t.direction == direction)

    def reset(self) -> None:
        """Forget the log (wait for transfers in flight first)."""
        with self._lock:
            self.log.clear()

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.shutdown(wait=True)

    def __enter__(self) -> HostLink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
