"""What each rank holds in memory, read from the OS while the ranks pause: evidence, not a claim.

A rank's own account of its memory (``memory.held``, ``memory.ParameterWatch``) is the student's
process speaking; a submission can rewrite it.  This module reads what the kernel of the OS says
instead, from outside the ranks:

- **What is read**: each rank's private memory, ``Private_Clean + Private_Dirty + Private_Hugetlb + Swap`` of
  ``/proc/<pid>/smaps_rollup``: the pages mapped by that process alone (what it allocated and
  wrote, and what it copied of the kernel it was forked from), whatever holds them (tensors,
  Python objects, a tmpfs file it mapped by itself).  Pages it still shares with the kernel it was
  forked from (the imported libraries) do not count, so a rank forked fresh for the run starts
  near zero (measured: 10 MB).  Added to it, what a rank keeps where that count misses it (its shared
  mappings, memfds, files open for writing, bytes queued in its TCP sockets), and refused where it cannot
  be counted (a process a rank started, pipes or local sockets beyond a rank's own): ``pauses.held_bytes``,
  ``pauses.strangers``.
- **When**: once, while every rank pauses in ``time.sleep`` (the syscall ``clock_nanosleep``,
  read from ``/proc/<pid>/syscall``), where a test's driver pauses them: between training steps,
  when what a rank keeps from one step to the next is all it holds (a transient's peak is the
  allocator's and gloo's as much as the student's).  The reading is kept only if every rank is
  still in the same pause after it was taken (its main thread's count of voluntary context
  switches unchanged, ``/proc/<pid>/status``).  Then the watch ends the pause: it sends each rank
  ``WAKE_SIGNAL``, which the driver's ``pause(longest)`` turns into the end of its sleep (and which a
  rank ignores at any other moment, ``worker.py``), so a pause lasts as long as the reading needs,
  up to ``longest``: on a loaded host a fixed second was once too short for the last rank to arrive
  and the reading (a run of ``ss``) to be done.
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
``watch.extras`` what ``at_pause`` returned at each reading); ``observed`` makes it the run's evidence.  What
cannot be read (another user's process without the right to read it, no ``smaps_rollup``, a
pause never seen) leaves ``Held`` unobserved, with why: a test that reads it fails
(``Unobserved``), it never falls back on the ranks' account.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import pauses, wire
from .pauses import PAUSE_SYSCALL, WAKE_SIGNAL
from .wire import Unobserved

__all__ = [
    "Held",
    "Watch",
    "observed",
    "pause",
    "returning",
    "settle",
    "unsettle",
]

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
# where a pause can be seen and a process's private memory read (Linux's /proc); elsewhere nobody can watch
WATCHABLE = PAUSE_SYSCALL is not None and os.path.exists("/proc/self/smaps_rollup")
RETURNED_FROM = 128 * 1024  # glibc's default mmap threshold, kept fixed for a run whose memory is read
KEPT_BELOW = 32 * 2**20  # where glibc's dynamic mmap threshold stops growing (64-bit): after such a run


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:  # (no C library to load by that name: nothing to set)
        return None


_LIBC = _libc()


def trim() -> None:
    """In a rank, just before the grader reads its memory (``pause``; ``gate.Gate.wait``, a hold): glibc gives the OS
    back the whole pages of every block it keeps free, in every arena (``malloc_trim(0)``), so that the reading counts
    what the rank holds, not what its allocator kept of what it freed.  A rank forked from a kernel inherits that
    kernel's allocator: the threads it starts (gloo's) reuse the arenas of the kernel's ended threads and carve their
    blocks out of those arenas' free blocks, which glibc keeps when they are freed again, whatever its thresholds (lab
    14's honest ``sharded_step`` read 4.05 layers for 1.05 where the kernel's threads had left 20 MiB free blocks:
    ``tests/labs/test_lab14_prefetch.py``; 4.08 once in a full suite).  Only free blocks go: nothing a rank holds
    reads smaller, so a submission gains nothing by it (or by calling it itself)."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def _allocator(mmap_threshold: int) -> None:
    """glibc's mmap threshold fixed at ``mmap_threshold`` (blocks from that size up are mapped alone and
    returned to the OS when freed), its trim threshold at twice it, as its dynamic threshold sets them."""
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):  # (not glibc: its allocator is what it is)
        _LIBC.mallopt(M_MMAP_THRESHOLD, mmap_threshold)
        _LIBC.mallopt(M_TRIM_THRESHOLD, 2 * mmap_threshold)


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
    others by then (``sent``, None where they were not counted); or unobserved, with why.  ``later``:
    the same at each pause after the first, in order (a driver that pauses the ranks more than once)."""

    bytes: tuple[int, ...] | None = None
    sent: tuple[int, ...] | None = None
    why: str | None = None
    source: str = "os"
    later: tuple[Held, ...] = ()

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
    at_pauses: list[tuple[dict | None, dict[int, list[int]] | None]],
    prepared: list[int] | None,
    ran: list[int],
    owner=None,
    source: str = "os",
) -> Held:
    """``held`` (a ``Watch``'s readings) as evidence of the run whose ranks were ``ran``: kept only if
    they are the ranks ``prepared`` for it (forked fresh, and watched), with the bytes each had sent
    by each pause (``wire.traffic`` from the sockets ``before`` the run to those at the pause; None
    where either is missing).  ``at_pauses``: for each reading, the sockets then (``wire.snapshot``)
    and which of the student's processes held each open (``wire.holders``, or None); a connection
    between two ranks that another process held too makes the whole reading unobserved (a process
    named as a rank that shares a real rank's connections would have its memory read for that rank's)."""
    if held.bytes is None:
        return held
    if prepared != ran:
        return Held.unobserved("the ranks that ran were not the ones started fresh for the run and watched")
    readings = [held, *held.later]
    if len(at_pauses) != len(readings):
        return Held.unobserved(f"{len(readings)} readings of memory, but the wire was read at {len(at_pauses)}")
    made = []
    for reading, (at_pause, held_by) in zip(readings, at_pauses):
        shared = wire.shared_connections(at_pause, held_by, ran) if at_pause is not None and held_by else []
        if shared:
            return Held.unobserved(
                "a process named as a rank shared its connections with another process at the pause, so its "
                f"memory is not the rank's: {'; '.join(shared[:4])}"
            )
        sent = None
        if before is not None and at_pause is not None:
            counted = wire.traffic(before, at_pause, ran, owner=owner)
            # (between ranks: what they sent round the wire is for the run's own count, read by the tests)
            sent = tuple(map(sum, counted.matrix))
        made.append(dataclasses.replace(reading, sent=sent, source=source, later=()))
    return dataclasses.replace(made[0], later=tuple(made[1:]))


class _Woken(Exception):
    """Raised in a pausing rank by ``WAKE_SIGNAL``: the watch has read it."""


def _woken(signum, frame):
    raise _Woken


def pause(longest: float) -> float:
    """In a rank (a test's driver): sleep in ``time.sleep`` until the watch, having read this rank's memory,
    wakes it with ``WAKE_SIGNAL``, or ``longest`` seconds have passed (nobody watching, or a reading that
    failed).  Returns the seconds paused.  After it ``WAKE_SIGNAL`` is ignored, as a rank starts (``worker.py``):
    a late one ends nothing."""
    started = time.monotonic()
    if not WATCHABLE:  # (no watch can read this machine's ranks: no pause to wait in)
        return 0.0
    trim()
    try:
        signal.signal(WAKE_SIGNAL, _woken)
    except ValueError:  # not the main thread: the whole pause
        time.sleep(longest)
        return time.monotonic() - started
    try:
        time.sleep(longest)
    except _Woken:
        pass
    finally:
        signal.signal(WAKE_SIGNAL, signal.SIG_IGN)
    return time.monotonic() - started


class Watch:
    """Watches ``pids`` and reads their memory at each pause of them all (see the module docstring), through
    ``pauses.py`` run as its own process: as ``user`` where given (``wire.as_user``), for a grader that may
    not read that uid's ``/proc/<pid>/smaps_rollup`` itself.  ``stores``: each rank's reading also counts the
    bytes in files of every tmpfs the ranks may write (``stored.stored_bytes``), for ranks in a sandbox whose
    writable folders are the student's own (a rank could keep its state there across the pause)."""

    def __init__(
        self,
        pids: list[int],
        at_pause: Callable[[], object] | None = None,
        user: int | None = None,
        stores: bool = False,
    ):
        self.pids, self.at_pause, self.user, self.stores = list(pids), at_pause, user, stores
        self.extras: list = []  # what ``at_pause`` returned at each reading kept, in order
        self._held = Held.unobserved("the ranks never all paused in time.sleep where the test's driver pauses them")
        self._thread = threading.Thread(target=self._watch, name="osmemory-watch", daemon=True)
        self._proc: subprocess.Popen | None = None
        self._stopped = False

    def start(self) -> Watch:
        if not WATCHABLE:
            self._held = Held.unobserved(
                f"no pause can be seen nor memory read on this machine ({platform.system()}, {platform.machine()})"
            )
            return self
        cmd = [sys.executable, "-I", pauses.__file__, *(["--stores"] if self.stores else []), *map(str, self.pids)]
        if self.user is not None:
            cmd = wire.as_user(self.user, cmd)
        try:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        except OSError as exc:
            self._held = Held.unobserved(f"the ranks' memory could not be watched: {exc}"[:300])
            return self
        self._thread.start()
        return self

    def stop(self) -> Held:
        self._stopped = True
        if self._proc is not None:
            self._proc.kill()  # (its stdout ends: the thread's wait for a line with it)
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if self._proc is not None:
            self._proc.wait()
        return self._held

    def _watch(self) -> None:
        proc, readings = self._proc, []
        while True:
            said = self._said()
            if said is None and not self._stopped:  # (it ended by itself: say why)
                lines = proc.stderr.read(1 << 16).strip().splitlines()
                said = {"error": f"the watch ended: {lines[-1] if lines else 'no reason given'}"}
            if said is None or "ended" in said:  # (the run is over)
                break
            if "error" in said:
                self._held = Held.unobserved(f"the ranks' memory could not be read: {said['error']}"[:300])
                return
            held = said.get("held")
            if not (isinstance(held, list) and len(held) == len(self.pids) and all(type(b) is int for b in held)):
                self._held = Held.unobserved(f"the watch said {str(said)[:200]}, not each rank's memory")
                return
            started = time.monotonic()
            try:
                extra, why = (self.at_pause() if self.at_pause is not None else None), None
                others = pauses.strangers(self.pids)  # (a process a rank forked shares its pages: not private)
                if others:
                    why = pauses.STRANGERS.format(others[:4])
            except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
                extra, why = None, f"what else is read at the pause could not be: {exc}"[:300]
            try:
                proc.stdin.write("read\n")
                proc.stdin.flush()
            except OSError:
                break
            said = self._said()
            if said not in ({"kept": True}, {"kept": False}) or why is not None:
                self._held = Held.unobserved(why or f"the watch said {str(said)[:200]} after the reading")
                return
            if said == {"kept": True}:
                readings.append(Held(bytes=tuple(held)))
                self.extras.append(extra)
            elif not readings:
                self._held = Held.unobserved(
                    "the ranks all paused, but a rank had woken before the reading was done "
                    f"({time.monotonic() - started:.2f} s)"
                )
        if readings:
            self._held = dataclasses.replace(readings[0], later=tuple(readings[1:]))

    def _said(self) -> dict | None:
        """The watch's next line, as JSON (None where it has ended: what it said before it was stopped is read)."""
        line = self._proc.stdout.readline()
        if not line:
            return None
        try:
            said = json.loads(line)
        except ValueError:
            return {"error": f"it printed {line[:100]!r}"}
        return said if isinstance(said, dict) else {"error": f"it printed {line[:100]!r}"}
