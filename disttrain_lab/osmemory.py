"""What each rank holds in memory, read from the OS while the ranks pause: evidence, not a claim.

A rank's own account of its memory (``memory.held``, ``memory.ParameterWatch``) is the student's
process speaking; a submission can rewrite it.  This module reads what the kernel of the OS says
instead, from outside the ranks:

- **What is read**: each rank's private memory, ``Private_Clean + Private_Dirty + Swap`` of
  ``/proc/<pid>/smaps_rollup``: the pages mapped by that process alone (what it allocated and
  wrote, and what it copied of the kernel it was forked from), whatever holds them (tensors,
  Python objects, a tmpfs file it mapped by itself).  Pages it still shares with the kernel it was
  forked from (the imported libraries) do not count, so a rank forked fresh for the run starts
  near zero (measured: 10 MB).
- **When**: once, while every rank pauses in ``time.sleep`` (the syscall ``clock_nanosleep``,
  read from ``/proc/<pid>/syscall``), where a test's driver pauses them: between training steps,
  when what a rank keeps from one step to the next is all it holds (a transient's peak is the
  allocator's and gloo's as much as the student's).  The reading is kept only if every rank is
  still paused after it was taken.
- **What else at that moment**: the caller's ``at_pause`` (the grader reads the bytes the ranks had
  sent by then from the wire: a pause before any training does not pass for one after it).

Ranks whose memory is read are forked fresh for the run (``pool.prepare(..., fresh=True)``), after
``settle()`` in the kernel: glibc's allocator set to return freed blocks of 128 KiB and more to
the OS at once (else its dynamic threshold keeps them, and a rank reads as holding what it freed),
the kernel's garbage collector frozen for the run, and the optimizers' lazy imports done once in the
kernel (else every fresh rank makes its own copy of them: measured 150 MB, 4.5 bytes per parameter
of the lab's 33.6 M-parameter model); ``unsettle()`` after it.  What the kernel itself allocated
before (with glibc's dynamic threshold) can still show in a fresh rank's count: a 33.6 M-parameter
model trained in the kernel just before added 1.4 to 2.3 bytes per parameter, and 9 when the kernel
had trained it between two such runs; none with the threshold fixed before that training
(``returning()``, around the references the lab's check computes in the kernel).  The grader's
kernel for the student runs the notebook's cells alone, which allocate little in the kernel; fixing
the threshold for good as the kit is imported would remove it all, at the cost of every launch's
speed (page faults at every allocation of 128 KiB and more: 1.2-1.5 times slower training of 256-
and 1024-wide layers, side by side), so the kit does not.

``Watch(pids, at_pause).start()`` polls in a thread; ``stop()`` returns a :class:`Held` (and
``watch.extra`` what ``at_pause`` returned); ``observed`` makes it the run's evidence.  What
cannot be read (another user's process without the right to read it, no ``smaps_rollup``, a
pause never seen) leaves ``Held`` unobserved, with why: a test that reads it fails
(``Unobserved``), it never falls back on the ranks' account.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import wire
from .wire import Unobserved

__all__ = ["Held", "Watch", "observed", "paused", "private_bytes", "returning", "settle", "unsettle"]

# clock_nanosleep, what time.sleep calls on Linux (Python >= 3.11)
PAUSE_SYSCALL = {"x86_64": 230, "aarch64": 115, "arm64": 115}.get(platform.machine())
POLL_S = 0.005
PRIVATE_FIELDS = (b"Private_Clean:", b"Private_Dirty:", b"Swap:")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
RETURNED_FROM = 128 * 1024  # glibc's default mmap threshold, kept fixed for a run whose memory is read
KEPT_BELOW = 32 * 2**20  # where glibc's dynamic mmap threshold stops growing (64-bit): after such a run


def _allocator(mmap_threshold: int) -> None:
    """glibc's mmap threshold fixed at ``mmap_threshold`` (blocks from that size up are mapped alone and
    returned to the OS when freed), its trim threshold at twice it, as its dynamic threshold sets them."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)
        libc.mallopt(M_TRIM_THRESHOLD, 2 * mmap_threshold)
    except (OSError, AttributeError):  # not glibc: its allocator is what it is
        pass


def settle() -> None:
    """In the kernel, before forking ranks whose memory will be read (see the module docstring), until
    ``unsettle()``: the allocator returns blocks of 128 KiB and more, the optimizers' lazy imports are
    done, the kernel's collector is frozen (its writes to the objects' pages would copy them into every
    rank)."""
    _allocator(RETURNED_FROM)
    for optimizer in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        layer = torch.nn.Linear(2, 2)
        step = optimizer(layer.parameters(), lr=0.1)
        layer(torch.ones(1, 2)).sum().backward()
        step.step()
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def returning():
    """Within it, the kernel's freed blocks of 128 KiB and more go back to the OS (then glibc's thresholds
    are set where its dynamic threshold ends): for large work in a kernel that will fork ranks whose memory
    is read (a reference computed there), which would otherwise leave freed memory those ranks count."""
    _allocator(RETURNED_FROM)
    try:
        yield
    finally:
        _allocator(KEPT_BELOW)


def unsettle() -> None:
    """After the run whose ranks' memory was read: the kernel's objects collected again as usual, and
    glibc's thresholds where its dynamic threshold ends (32 MiB: freed blocks below it are kept for
    reuse).  Mapping every block of 128 KiB and more anew costs page faults at every allocation: the
    layers 256 and 1024 wide trained 1.2-1.5 times slower with it, side by side."""
    gc.unfreeze()
    _allocator(KEPT_BELOW)


@dataclass(frozen=True)
class Held:
    """Each rank's private memory at the ranks' pause (``bytes``) and the bytes each had sent the
    others by then (``sent``, None where they were not counted); or unobserved, with why."""

    bytes: tuple[int, ...] | None = None
    sent: tuple[int, ...] | None = None
    why: str | None = None
    source: str = "os"

    @classmethod
    def unobserved(cls, why: str) -> Held:
        return cls(why=why)

    def of(self, rank: int) -> int:
        """Rank ``rank``'s private memory at the pause, in bytes; ``Unobserved`` where none was read."""
        if self.bytes is None:
            raise Unobserved(f"the ranks' memory was not observed from the OS: {self.why}")
        return self.bytes[rank]


def observed(
    held: Held,
    before,
    at_pause,
    prepared: list[int] | None,
    ran: list[int],
    owner=None,
    source: str = "os",
    held_by: dict[int, list[int]] | None = None,
) -> Held:
    """``held`` (a ``Watch``'s reading) as evidence of the run whose ranks were ``ran``: kept only if
    they are the ranks ``prepared`` for it (forked fresh, and watched), with the bytes each had sent
    by the pause (``wire.traffic`` from the sockets ``before`` the run to those ``at_pause``; None
    where either is missing).  ``held_by``: at the pause, which of the student's processes held each
    socket open (``wire.holders``); a connection between two ranks that another process held too
    makes the reading unobserved (a process named as a rank that shares a real rank's connections
    would have its memory read for that rank's)."""
    if held.bytes is None:
        return held
    if prepared != ran:
        return Held.unobserved("the ranks that ran were not the ones started fresh for the run and watched")
    shared = wire.shared_connections(at_pause, held_by, ran) if at_pause is not None and held_by is not None else []
    if shared:
        return Held.unobserved(
            "a process named as a rank shared its connections with another process at the pause, so its memory "
            f"is not the rank's: {'; '.join(shared[:4])}"
        )
    sent = None
    if before is not None and at_pause is not None:
        counted = wire.traffic(before, at_pause, ran, owner=owner)
        sent = tuple(counted.sent(r) for r in range(len(ran)))
    return dataclasses.replace(held, sent=sent, source=source)


def private_bytes(pid: int) -> int:
    """Process ``pid``'s private memory from ``/proc/<pid>/smaps_rollup`` (read as bytes; every
    field it needs must be there, in kB)."""
    with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
        text = f.read(1 << 16)
    found = {}
    for line in text.splitlines():
        for name in PRIVATE_FIELDS:
            if line.startswith(name):
                parts = line[len(name) :].split()
                if len(parts) != 2 or parts[1] != b"kB" or not parts[0].isdigit():
                    raise ValueError(f"/proc/{pid}/smaps_rollup: {line[:80]!r} is not '<n> kB'")
                found[name] = int(parts[0]) * 1024
    missing = [n.decode() for n in PRIVATE_FIELDS if n not in found]
    if missing:
        raise ValueError(f"/proc/{pid}/smaps_rollup has no {', '.join(missing)}")
    return sum(found.values())


def paused(pid: int) -> bool:
    """Whether process ``pid`` is blocked in ``clock_nanosleep`` (``time.sleep``) now."""
    with open(f"/proc/{pid}/syscall", "rb") as f:
        first = f.read(64).split(b" ", 1)[0]
    return first.isdigit() and int(first) == PAUSE_SYSCALL


class Watch:
    """Polls ``pids`` until all pause, then reads their memory once (see the module docstring)."""

    def __init__(self, pids: list[int], at_pause: Callable[[], object] | None = None):
        self.pids, self.at_pause = list(pids), at_pause
        self.extra = None  # what ``at_pause`` returned, at the reading's moment
        self._done = threading.Event()
        self._held = Held.unobserved("the ranks never all paused in time.sleep where the test's driver pauses them")
        self._thread = threading.Thread(target=self._poll, name="osmemory-watch", daemon=True)

    def start(self) -> Watch:
        if PAUSE_SYSCALL is None:
            self._held = Held.unobserved(f"no pause can be seen on this machine ({platform.machine()})")
            self._done.set()
        else:
            self._thread.start()
        return self

    def stop(self) -> Held:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        return self._held

    def _poll(self) -> None:
        while not self._done.is_set():
            try:
                if self.pids and all(paused(p) for p in self.pids):
                    held = tuple(private_bytes(p) for p in self.pids)
                    extra = self.at_pause() if self.at_pause is not None else None
                    if all(paused(p) for p in self.pids):  # (still the same pause: the reading stands)
                        self._held, self.extra = Held(bytes=held), extra
                        return
            except (OSError, ValueError, RuntimeError) as exc:
                self._held = Held.unobserved(f"the ranks' memory could not be read: {exc}"[:300])
                if not all(os.path.exists(f"/proc/{p}") for p in self.pids):
                    return  # (a rank ended: the run is over)
                if isinstance(exc, PermissionError):
                    return
            time.sleep(POLL_S)
