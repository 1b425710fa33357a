"""The warm pool of rank processes behind ``dl.launch`` (see docs/architecture.md,
"Launching ranks from a notebook"): the kernel's one pool, kept between launches, and which
ranks each run gets.

A launch with ``world_size <= size`` and the same plan uses the first ranks of the pool kept
from before; otherwise a new pool is started (``warmpool.py``: one pool's ranks started, sent
a launch, waited on with a deadline, all stopped on a failure).  A pool a failure stopped is
rebuilt on the next launch.

    results, events, wall = pool.run(payload, world_size, chosen_plan, timeout, want_trace, network, where)
    pool.shutdown()

``payload`` is one pickled job for every rank, or a list of one per rank (``launcher.PerRank``: a
rank receives only its own arguments).  A forked worker holds a copy of the kernel's memory as
it was when forked; a run whose data other ranks must not see (a graded run: each rank's inputs
are its own) finds its workers forked *before* the data arrived: ``prepare`` forks them, and
inside ``prepared_only()`` a run that would have to fork new ones raises ``NotPrepared``
instead (the grader prepares again and resends: grading/remote.py).  Inside ``confined()`` (and
``writable(path)``) a run gets a pool of confined workers of its own (``confine.py``).
"""

from __future__ import annotations

import atexit
import threading
import time

from . import osmemory, trace
from .devices import Plan
from .network import Network
from .ranks import MAX_OUTPUT_LINES
from .reports import LaunchError
from .warmpool import Pool

__all__ = ["run", "prepare", "prepared_only", "NotPrepared", "shutdown", "worker_pids", "MAX_OUTPUT_LINES"]

STARTED_LATE = 0.5  # seconds a run still gets when starting its pool took all of its deadline

_POOL: Pool | None = None
_POOL_LOCK = threading.RLock()
_FORK_REFUSED = [0]  # > 0 inside prepared_only(): a run may not fork workers
_CONFINED = [0]  # > 0 inside confined(): a run's workers are confined (confine.py), a pool of their own
_WRITABLE: list[str | None] = [None]  # inside writable(path): a run's confined workers may write beneath path


class NotPrepared(LaunchError):
    """A run inside ``prepared_only()`` found no warm workers for it: forking them now would copy
    the data of the request being served into every rank."""


def run(
    payload: bytes | list[bytes],
    world_size: int,
    chosen: Plan,
    timeout: float,
    want_trace: bool,
    network: Network | None,
    where: dict[str, str],
    deadline: float | None = None,
) -> tuple[list, list[trace.Event], float]:
    """Run the pickled ``(fn, args, kwargs)`` on the first ``world_size`` ranks of a warm pool
    for ``chosen`` (started, or rebuilt, when none fits); return (results, events, wall seconds).

    ``network``: the emulated ``dl.Network`` the ranks run on, or None.  ``where``: each code
    object's real cell (``codemap.dumps``), so a rank's traceback names the student's line.
    ``deadline`` (``time.monotonic``): where set, the run ends by then, the pool's start included
    (a capped launch under grading, ``hangs.capped``); otherwise ``timeout`` counts from the job's sending."""
    __tracebackhide__ = True
    with _POOL_LOCK:
        warm = _pool_for(world_size, chosen)
        if deadline is not None:
            timeout = min(timeout, max(deadline - time.monotonic(), STARTED_LATE))
        return warm.run(payload, world_size, timeout, want_trace, network, where)


def prepare(
    world_size: int, chosen: Plan, fresh: bool = False, confined: bool = False, writable: str | None = None
) -> list[int]:
    """Warm workers for a run of ``world_size`` ranks under ``chosen``, forked now if there are none
    (``fresh``: forked now in any case, after ``osmemory.settle()``: ranks whose memory the grader
    reads; ``confined``: workers that confine themselves, for a graded run, see :class:`confined`;
    ``writable``: confined workers that may write beneath that folder, see :class:`writable`);
    returns their process ids, rank order."""
    global _POOL
    with _POOL_LOCK:
        if fresh:
            osmemory.settle()
            if _POOL is not None:
                _POOL.close()
                _POOL = None
        return [w.pid for w in _pool_for(world_size, chosen, confined, writable).workers[:world_size]]


class prepared_only:
    """Within it, a run uses the warm workers ``prepare`` left, or raises ``NotPrepared``; it never forks."""

    def __enter__(self):
        with _POOL_LOCK:
            _FORK_REFUSED[0] += 1
        return self

    def __exit__(self, *exc) -> None:
        with _POOL_LOCK:
            _FORK_REFUSED[0] -= 1


class confined:
    """Within it, a run's ranks are confined (``confine.confine``: no file written, no signal or abstract
    unix socket outside the rank) before the function runs: a graded run's, so that they talk to each
    other only over the wire the grader observes.  They come from a pool of confined workers, which
    ``prepare(..., confined=True)`` forks (Landlock lasts a process's life: the student's own runs get
    unconfined workers again).  On the CPU only (NCCL's ranks share /dev/shm and abstract sockets)."""

    def __enter__(self):
        with _POOL_LOCK:
            _CONFINED[0] += 1
        return self

    def __exit__(self, *exc) -> None:
        with _POOL_LOCK:
            _CONFINED[0] -= 1


class writable:
    """Within it, a confined run's workers may write beneath ``path`` (an absolute folder), and only there: a
    pool of their own, forked confined that way (Landlock grants no right after it is applied).  For a run
    that must leave files for the next one (lab 12: checkpoints that outlive a rank the grader kills);
    every other graded run's ranks write nothing, so that no file carries what the wire should."""

    def __init__(self, path: str | None):
        self.path = path

    def __enter__(self):
        with _POOL_LOCK:
            self.before, _WRITABLE[0] = _WRITABLE[0], self.path
        return self

    def __exit__(self, *exc) -> None:
        with _POOL_LOCK:
            _WRITABLE[0] = self.before


def shutdown() -> None:
    """Stop the warm worker processes (they are also stopped when Python exits)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close()
            _POOL = None


def worker_pids() -> list[int]:
    """The process ids of the warm pool's ranks (rank k is the k-th), [] when there is none:
    the ranks of the last launch, whose process group (and its sockets) is still up."""
    with _POOL_LOCK:
        return [w.pid for w in _POOL.workers] if _POOL is not None else []


def _pool_for(world_size: int, chosen: Plan, confined: bool | None = None, writable: str | None = None) -> Pool:
    global _POOL
    if confined is None:
        confined = bool(_CONFINED[0])
    writable = (writable or _WRITABLE[0]) if confined else None
    if _POOL is not None and not _POOL.usable_for(world_size, chosen, confined, writable):
        _POOL.close()
        _POOL = None
    if _POOL is None:
        if _FORK_REFUSED[0]:
            raise NotPrepared(
                f"no warm ranks for a run of {world_size} ({chosen.backend}, {chosen.start_method}) were started "
                "before its request arrived"
            )
        _POOL = Pool(world_size, chosen, confined, writable)
    return _POOL


@atexit.register
def _stop_pool_at_exit() -> None:
    if _POOL is not None:
        _POOL.close()
