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
transfer as ``Transfer(direction, nbytes, requested, start, end)``, times from ``time.perf_counter``
on the link's schedule: a copy starts when it is asked for or when the copy before it in its
direction is through, and ends the model's time later; ``result()`` returns no earlier than that.

Under grading the link is also a wire the grader reads: made with ``gate`` (a graded run's ``gate.Gate``,
lab 9's drivers), each copy's bytes go to the grader as the copy is asked for (``Gate.link``), so what crossed, and
whether a backward the grader held was still running, is the grader's evidence (``labtests/lab09/offload.py``),
not this log.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .network import Network

if TYPE_CHECKING:
    from .gate import Gate

__all__ = ["HostLink", "Transfer", "DIRECTIONS"]

DIRECTIONS = ("down", "up")  # down: device -> host (gradients); up: host -> device (parameters)


@dataclass(frozen=True)
class Transfer:
    """One copy over the link."""

    direction: str  # "down" or "up"
    nbytes: int
    requested: float  # time.perf_counter() when copy() was called
    start: float  # ... when the link began carrying it (after the copies before it in its direction)
    end: float  # ... and when it was through


class HostLink:
    """An emulated device <-> host link with the α–β time of ``network`` (default: "PCIe 4.0 x16")."""

    def __init__(self, network: Network | None = None, gate: Gate | None = None):
        self.network = network if network is not None else Network.preset("PCIe 4.0 x16")
        self.gate = gate  # under grading: the grader's gate, where each copy's bytes also go (see above)
        self.log: list[Transfer] = []
        self._lock = threading.Lock()
        self._lanes = {d: ThreadPoolExecutor(1, thread_name_prefix=f"hostlink-{d}") for d in DIRECTIONS}
        self._free_at = dict.fromkeys(DIRECTIONS, 0.0)  # when each direction's lane finishes what it carries

    def copy(self, tensor: torch.Tensor, direction: str, dtype: torch.dtype | None = None) -> Future:
        """Start copying ``tensor`` (as ``dtype``) ``direction`` ("down" or "up"); a Future of the copy."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS} (down: device -> host), got {direction!r}")
        data = tensor.detach().to(dtype or tensor.dtype, copy=True)
        nbytes = data.numel() * data.element_size()
        if self.gate is not None:  # (as it is asked for, from the caller's thread: a hook's, in a backward)
            self.gate.link(direction, data.contiguous().view(torch.uint8).numpy().tobytes())
        return self._lanes[direction].submit(self._carry, data, direction, nbytes, time.perf_counter())

    def _carry(self, data: torch.Tensor, direction: str, nbytes: int, requested: float) -> torch.Tensor:
        # the link's own schedule: a copy starts when it was asked for or when the one before it is
        # through, whichever is later, so a late wake-up of this thread does not add up copy after copy
        start = max(requested, self._free_at[direction])
        end = self._free_at[direction] = start + self.network.time(nbytes)
        while (left := end - time.perf_counter()) > 0:
            time.sleep(left)
        with self._lock:
            self.log.append(Transfer(direction, nbytes, requested, start, end))
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
        """Wait for the transfers in flight, then forget the log and the schedule (an idle link, as new)."""
        for lane in self._lanes.values():  # one thread per lane, first in first out: a no-op queued last runs last
            lane.submit(lambda: None).result()
        with self._lock:
            self.log.clear()
            self._free_at = dict.fromkeys(DIRECTIONS, 0.0)

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.shutdown(wait=True)

    def __enter__(self) -> HostLink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
