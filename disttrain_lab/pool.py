"""The warm pool of rank processes behind ``dl.launch`` (see docs/architecture.md,
"Launching ranks from a notebook").

A pool of ``size`` worker processes is kept between launches; a launch with
``world_size <= size`` and the same plan uses its first ranks.  On the CPU the workers are
forked from the notebook's kernel (0.1 s for 4 ranks); for GPUs they are fresh interpreters.
One ``TCPStore`` per pool, on port 0 with a secret key prefix, carries every launch's fresh
process group.  Each worker's stdout/stderr is relayed into the cell as ``[rank k] ...`` (``ranks.py``).
The pool waits on every rank with a deadline; an exception, a rank that dies, a timeout or
Ctrl-C stops every rank (SIGKILL) and raises here; the pool is rebuilt on the next launch.

    results, events, wall = pool.run(payload, world_size, chosen_plan, timeout, want_trace, network, where)
    pool.shutdown()

``payload`` is one pickled job for every rank, or a list of one per rank (``launcher.PerRank``: a
rank receives only its own arguments).  A forked worker holds a copy of the kernel's memory as
it was when forked; a run whose data other ranks must not see (a graded run: each rank's inputs
are its own) finds its workers forked *before* the data arrived: ``prepare`` forks them, and
inside ``prepared_only()`` a run that would have to fork new ones raises ``NotPrepared``
instead (the grader prepares again and resends: grading/remote.py).
"""

from __future__ import annotations

import atexit
import linecache
import mmap
import os
import pickle
import random
import secrets
import select
import signal
import sys
import threading
import time
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from . import codemap, matching, osmemory, ranks, trace
from .devices import Plan
from .integrity import TamperingError
from .network import Network
from .ranks import MAX_OUTPUT_LINES
from .reports import LaunchError, died_error, mismatch_error, rank_doing, rank_error, stack_frames, timeout_error
from .worker import STARTUP_TIMEOUT

__all__ = ["run", "prepare", "prepared_only", "NotPrepared", "shutdown", "worker_pids", "MAX_OUTPUT_LINES"]

# seconds a timed-out launch watches its stuck ranks for calls they still make (an endless loop of
# sends and receives makes dozens even on a busy machine, thousands on a quiet one; a deadlocked rank none)
PROGRESS_WINDOW = 0.25
PROGRESS_WINDOW_MAX = 2.0  # the window's length at most, while a rank that made no call waits for a CPU
STARTED_LATE = 0.5  # seconds a run still gets when starting its pool took all of its deadline
# a rank inside a collective this long has its call compared with the other ranks' (matching.py)
MISMATCH_AFTER = 1.0

_POOL: _Pool | None = None
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


def _pool_for(world_size: int, chosen: Plan, confined: bool | None = None, writable: str | None = None) -> _Pool:
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
        _POOL = _Pool(world_size, chosen, confined, writable)
    return _POOL


class _Pool:
    """``size`` warm workers; a call with world_size <= size uses the first ones."""

    def __init__(self, size: int, chosen: Plan, confined: bool = False, writable: str | None = None):
        self.size, self.plan = size, chosen
        if confined and chosen.start_method != "fork":  # (fail closed: a graded run's ranks are never unconfined)
            raise RuntimeError(
                f"a graded run's ranks confine themselves as they are forked, but this kernel's ranks cannot be "
                f"forked ({chosen.reason}); grade where the student's kernel sees no GPU (the sandbox gives it none)"
            )
        self.confined = confined  # (see ``confined``: the CPU's ranks)
        self.writable = writable if self.confined else None  # (see ``writable``)
        if chosen.start_method == "fork":  # (every pool: the first launch pays it, not a graded test's time)
            _write_before_confining()
        self.owner_pid = os.getpid()
        self.workers: list[ranks.Rank] = []
        self.calls = 0
        self.broken = False
        # one status mapping per rank, shared with the kernel only (a rank's child unmaps the others'
        # as it starts): the ranks cannot pass each other data through them (#42's side channels)
        slot_bytes = trace.SLOT_BYTES * size  # (a rank writes at its own offset of a mapping of its own)
        if chosen.start_method == "spawn":
            self.status_fds = [os.memfd_create(f"disttrain-lab-status-{r}") for r in range(size)]
            for fd in self.status_fds:
                os.ftruncate(fd, slot_bytes)
            self.slots = [mmap.mmap(fd, slot_bytes) for fd in self.status_fds]
        else:
            self.status_fds = []
            self.slots = [mmap.mmap(-1, slot_bytes) for _ in range(size)]
        self.store = None
        # the store listens on every interface; an unguessable key prefix keeps others on a
        # shared host from writing into this pool's process groups
        self.secret = secrets.token_hex(16)
        try:
            for rank in range(size):
                self.workers.append(
                    ranks.start(rank, chosen.start_method == "fork", self.slots, self.status_fds, size, self.owner_pid)
                )
            self._wait_ready()
            # One store per pool, created after the forks (so no child inherits its socket),
            # on port 0: the OS picks a free port, so launches on a shared host never clash.
            # Workers keep one connection to it; each launch uses its own key prefix.
            self.store = dist.TCPStore(
                "127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=STARTUP_TIMEOUT)
            )
        except BaseException:
            self.close()
            raise

    def usable_for(self, world_size: int, chosen: Plan, confined: bool = False, writable: str | None = None) -> bool:
        return (
            not self.broken
            and self.confined == confined
            and self.writable == (writable if confined else None)
            and self.owner_pid == os.getpid()
            and world_size <= self.size
            and (self.plan.backend, self.plan.start_method) == (chosen.backend, chosen.start_method)
            and self._all_alive()
        )

    def _all_alive(self) -> bool:
        """False if any idle worker died since the last launch (killed, out of memory, or
        its parent-death signal fired because the thread that forked it ended)."""
        for w in self.workers:
            try:
                pid, _ = os.waitpid(w.pid, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid or _dying(w.pid):
                return False
        return True

    # ---- starting workers ---------------------------------------------------------
    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        waiting = {w.conn.fileno(): w for w in self.workers}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(
                    f"ranks {sorted(w.rank for w in waiting.values())} did not start within {STARTUP_TIMEOUT:.0f} s"
                )
            ready, _, _ = select.select(list(waiting) + [w.out_fd for w in self.workers], [], [], left)
            for fd in ready:
                if fd in waiting:
                    w = waiting.pop(fd)
                    try:
                        w.conn.recv_bytes()
                    except (EOFError, OSError):
                        self._relay_all()
                        raise LaunchError(f"rank {w.rank} failed to start (exit code {w.reap()})") from None
                else:
                    next(w for w in self.workers if w.out_fd == fd).relay()

    # ---- one launch -------------------------------------------------------------------
    def run(
        self,
        payload: bytes,
        world_size: int,
        timeout: float,
        want_trace: bool,
        network: Network | None,
        where: dict[str, str],
    ):
        __tracebackhide__ = True
        if self.confined and network is not None:
            raise LaunchError(
                "a graded run's ranks are confined (pool.confined) and cannot share the emulated network's board "
                "(each opens it through another rank's /proc, which confinement refuses): grade without network="
            )
        self.calls += 1
        t0 = time.perf_counter()
        workers = self.workers[:world_size]
        rng = _rng_states()
        for w in workers:
            w.shown = w.hidden = 0
            trace.write_status(self.slots[w.rank], w.rank, None)
        try:
            for w in workers:
                job = {
                    "rank": w.rank,
                    "world_size": world_size,
                    "device": self.plan.device,
                    "group_backend": self.plan.group_backend,
                    "port": self.store.port,
                    "prefix": f"{self.secret}/{self.calls}/",
                    "payload": payload[w.rank] if isinstance(payload, list) else payload,
                    "trace": want_trace,
                    "timeout": timeout,
                    "t0": t0,
                    "rng": rng,
                    "network": network,
                    "confine": self.confined,
                    "writable": self.writable,
                }
                w.conn.send_bytes(pickle.dumps(job))
            replies = self._collect(workers, t0 + timeout, timeout, where)
        except BaseException:
            self.close()  # ranks that already got the job must not run on (Ctrl-C while sending)
            raise
        wall = time.perf_counter() - t0
        results, events = [], []
        for w in workers:
            _, result, raw = replies[w.rank]
            results.append(result)
            events.extend(trace.to_events(raw))
        events.sort(key=lambda e: (e.start, e.rank))
        return results, events, wall

    def _collect(self, workers: list[ranks.Rank], deadline_pc: float, timeout: float, where: dict[str, str]) -> dict:
        __tracebackhide__ = True
        replies: dict[int, tuple] = {}
        by_conn = {w.conn.fileno(): w for w in workers}
        by_out = {w.out_fd: w for w in workers}
        next_look = 0.0
        try:
            while len(replies) < len(workers):
                now = time.perf_counter()
                left = deadline_pc - now
                if left <= 0:
                    self._relay_all()
                    self._timeout(workers, replies, timeout)
                if now >= next_look:
                    next_look = now + MISMATCH_AFTER / 4
                    self._compare_calls(workers, replies, now)
                pending = [fd for fd, w in by_conn.items() if w.rank not in replies]
                ready, _, _ = select.select(pending + list(by_out), [], [], min(left, MISMATCH_AFTER / 4))
                for fd in ready:
                    if fd in by_out:
                        by_out[fd].relay()
                        continue
                    w = by_conn[fd]
                    try:
                        reply = cloudpickle.loads(w.conn.recv_bytes())
                    except (EOFError, OSError, ConnectionError):
                        reply = None  # raised below, not in here: the EOFError is not the student's news
                    if reply is None:
                        self._rank_died(w, workers, replies)
                    if reply[0] == "error":
                        self._relay_all()
                        self._died_first(w, workers, replies, str(reply[1].get("message", "")))
                        self.close()
                        if reply[1]["type"] == "TamperingError":
                            raise TamperingError(f"rank {w.rank}: {reply[1]['message']}")
                        info = {**reply[1], "frames": codemap.relocate(reply[1]["frames"], where)}
                        raise rank_error(w.rank, info, [o.rank for o in workers if o is not w])
                    replies[w.rank] = reply
            self._relay_all()
        except KeyboardInterrupt as exc:
            # where each unfinished rank was: said in the cell, and kept on the exception (a launch
            # under grading is interrupted at the cell's limit; hangs.py remembers the function)
            stuck = [w for w in workers if w.rank not in replies]
            stacks = ranks.stacks(stuck)
            exc.stacks = stacks
            now = time.perf_counter()
            status = {w.rank: trace.read_status(self.slots[w.rank], w.rank) for w in stuck}
            exc.blocked = {w.rank: rank_doing(status[w.rank], now, stacks[w.rank]) for w in stuck}
            self.close()
            where = "".join(f"\n  rank {w.rank}: {exc.blocked[w.rank]}" for w in stuck)
            print(f"[disttrain-lab] interrupted: stopped all {len(workers)} ranks{where}", file=sys.stderr)
            raise
        finally:
            for w in workers:
                w.flush_hidden()
        return replies

    # ---- failures ---------------------------------------------------------------------
    def _states(self, workers: list[ranks.Rank], replies: dict) -> dict:
        """What each rank is in: "finished", the call it is blocked in, or None (running Python)."""
        return {
            w.rank: "finished" if w.rank in replies else trace.read_status(self.slots[w.rank], w.rank) for w in workers
        }

    def _compare_calls(self, workers: list[ranks.Rank], replies: dict, now: float, dead: tuple = ()) -> None:
        """Stop the launch with the ranks' calls if a rank inside a collective for MISMATCH_AFTER
        seconds entered it unlike the others (matching.py).  ``dead``: (rank, what happened to it)
        of a rank that died inside a collective: then it and every rank inside one are compared."""
        __tracebackhide__ = True
        states = self._states(workers, replies)
        stuck = [
            r
            for r, s in states.items()
            if isinstance(s, trace.Blocked)
            and s.op.split(":")[-1] in trace.COLLECTIVE_OPS
            and (dead or now - s.since >= MISMATCH_AFTER)
        ]
        if not stuck:
            return
        found = matching.find_mismatch(self.slots, [w.rank for w in workers], stuck, sorted(replies))
        if found is None:
            return
        self._relay_all()
        # (after a death the others are ending too: their stacks would say where they went next)
        stacks = {} if dead else ranks.stacks([w for w in workers if w.rank not in replies])
        self.close()
        if dead:
            states[dead[0]] = f"{dead[1]} inside {states[dead[0]].text}"
        raise mismatch_error(found, states, now, stacks)

    def _died_first(self, w: ranks.Rank, workers: list[ranks.Rank], replies: dict, message: str) -> None:
        """A rank's error that only says its connection to another rank broke (gloo's "Connection reset
        by peer") is the news of that rank's death: when another rank's process ends within a second,
        report its death instead (which names a mismatch of collectives where there is one)."""
        __tracebackhide__ = True
        if not any(words in message for words in ("Connection reset by peer", "Connection closed by peer")):
            return
        others = {o.conn.fileno(): o for o in workers if o is not w and o.rank not in replies}
        deadline = time.perf_counter() + 1.0
        while others and time.perf_counter() < deadline:
            ready, _, _ = select.select(list(others), [], [], max(0.0, deadline - time.perf_counter()))
            for fd in ready:
                o = others.pop(fd)
                try:
                    o.conn.recv_bytes()  # (a reply: that rank finished or failed on its own; not a death)
                except (EOFError, OSError, ConnectionError):
                    self._rank_died(o, workers, replies)  # (raises)

    def _rank_died(self, w: ranks.Rank, workers: list[ranks.Rank], replies: dict):
        __tracebackhide__ = True
        self._relay_all()
        code = w.reap()
        blocked = trace.read_status(self.slots[w.rank], w.rank)  # the call it died in, if any
        frames = stack_frames(w.crash_report())  # faulthandler's report of a fatal signal
        if code is not None and code < 0 and signal.Signals(-code).name == "SIGABRT" and blocked is not None:
            # gloo aborts a rank whose collective receives a message of another size than it expects
            self._compare_calls(workers, replies, time.perf_counter(), (w.rank, "its process was aborted (SIGABRT)"))
        self.close()
        raise died_error(w.rank, code, blocked, frames, [o.rank for o in workers if o is not w])

    def _timeout(self, workers: list[ranks.Rank], replies: dict, timeout: float):
        __tracebackhide__ = True
        now = time.perf_counter()
        states: dict[int, trace.Blocked | str | None] = {}
        for w in workers:
            if w.rank in replies:
                states[w.rank] = "finished"
            else:
                states[w.rank] = trace.read_status(self.slots[w.rank], w.rank)
        stuck = [w for w in workers if w.rank not in replies]
        # calls entered while we look: a rank still making them loops, however its last call looked
        calls = {w.rank: trace.read_calls(self.slots[w.rank], w.rank) for w in stuck}
        stacks = ranks.stacks(stuck)
        time.sleep(max(0.0, now + PROGRESS_WINDOW - time.perf_counter()))
        before, longest = calls, now + PROGRESS_WINDOW_MAX
        while True:
            calls = {w.rank: trace.read_calls(self.slots[w.rank], w.rank) - before[w.rank] for w in stuck}
            # a rank that made no call but is waiting for a CPU (a loaded host) has not shown what it does yet
            waiting = [w for w in stuck if not calls[w.rank] and _runnable(w.pid)]
            if not waiting or time.perf_counter() >= longest:
                break
            time.sleep(0.02)
        window = time.perf_counter() - now
        self.close()
        raise timeout_error(states, now, timeout, stacks, calls, window)

    def _relay_all(self) -> None:
        for w in self.workers:
            w.drain()

    # ---- stopping -------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every worker (SIGKILL: a rank blocked in C++ ignores anything gentler)."""
        self.broken = True
        if os.getpid() != self.owner_pid:
            return
        ranks.kill(self.workers)
        self.workers = []
        self.store = None
        for fd in self.status_fds:
            os.close(fd)
        self.status_fds = []
        for slot in self.slots:  # (unmapped: a later pool's ranks, forked from here, must not share them)
            slot.close()


def _write_before_confining() -> None:
    """What torch writes the first time a rank uses it, done in the kernel before confined ranks are forked
    (they may write nothing): an optimizer's first step imports ``torch._dynamo``, which makes its cache
    folder (``/tmp/torchinductor_<user>``) as it is imported.  Imported here once, as the kernel's first pool
    is forked, every later pool's ranks have it (2 s a rank otherwise, at each pool; a graded request's
    pool is forked anew after the student's own launches), and no graded test pays for it; the sources it
    leaves in ``linecache`` (1 MB) are dropped, so that the notebook's kernel holds what it held."""
    kept = set(linecache.cache)
    import torch._dynamo  # noqa: F401

    for name in set(linecache.cache) - kept:
        linecache.cache.pop(name, None)


def _runnable(pid: int) -> bool:
    """True for a process whose main thread is running or waiting for a CPU (state R), not asleep in a call."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"R"
    except (OSError, IndexError):
        return False


def _dying(pid: int) -> bool:
    """True for a process that a SIGKILL is pending for, or that is exiting: its main thread
    is a zombie while its other threads (gloo's) still end, when waitpid cannot reap it yet."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
    except OSError:
        return False  # no /proc (macOS): waitpid alone
    state = fields.get(b"State", b"").strip()[:1]
    pending = 0
    for key in (b"SigPnd", b"ShdPnd"):
        try:
            pending |= int(fields.get(key, b"0").strip() or b"0", 16)
        except ValueError:
            pass
    return state in (b"Z", b"X") or bool(pending & (1 << (signal.SIGKILL - 1)))


@atexit.register
def _stop_pool_at_exit() -> None:
    if _POOL is not None:
        _POOL.close()


def _rng_states() -> dict:
    """The notebook's random states now: warm ranks start every launch from them, as a
    rank forked at this moment would (no hidden state carried over from earlier launches)."""
    # torch's as plain bytes: its tensor pickles through torch.save (0.11 ms against 0.02, per rank per launch)
    states = {"torch": torch.random.get_rng_state().numpy().tobytes(), "python": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    return states
