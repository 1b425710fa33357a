"""One warm pool: ``size`` rank processes started together and kept for the launches that fit
them (which pool a run gets, and when one is rebuilt, is ``pool.py``'s).

On the CPU the workers are forked from the notebook's kernel (0.1 s for 4 ranks); for GPUs they
are fresh interpreters.  One ``TCPStore`` per pool, on port 0 with a secret key prefix, carries
every launch's fresh process group.  Each worker's stdout/stderr is relayed into the cell as
``[rank k] ...`` (``ranks.py``).  A launch sends each rank its job and waits on every rank with a
deadline; an exception, a rank that dies, a timeout or Ctrl-C stops every rank (SIGKILL) and
raises here, with what each rank was doing (``reports.py``); the pool is then closed for good.
"""

from __future__ import annotations

import mmap
import os
import pickle
import random
import secrets
import select
import signal
import sys
import time
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from . import codemap, confine, matching, ranks, trace
from .devices import Plan
from .integrity import TamperingError
from .network import Network
from .reports import LaunchError, died_error, mismatch_error, rank_doing, rank_error, stack_frames, timeout_error
from .worker import STARTUP_TIMEOUT

__all__ = ["Pool"]

# seconds a timed-out launch watches its stuck ranks for calls they still make (an endless loop of
# sends and receives makes dozens even on a busy machine, thousands on a quiet one; a deadlocked rank none)
PROGRESS_WINDOW = 0.25
PROGRESS_WINDOW_MAX = 2.0  # the window's length at most, while a rank that made no call waits for a CPU
# a rank inside a collective this long has its call compared with the other ranks' (matching.py)
MISMATCH_AFTER = 1.0


class Pool:
    """``size`` warm workers; a call with world_size <= size uses the first ones."""

    def __init__(self, size: int, chosen: Plan, confined: bool = False, writable: str | None = None):
        self.size, self.plan = size, chosen
        if confined and chosen.start_method != "fork":  # (fail closed: a graded run's ranks are never unconfined)
            raise RuntimeError(
                f"a graded run's ranks confine themselves as they are forked, but this kernel's ranks cannot be "
                f"forked ({chosen.reason}); grade where the student's kernel sees no GPU (the sandbox gives it none)"
            )
        self.confined = confined  # (see ``pool.confined``: the CPU's ranks)
        self.writable = writable if self.confined else None  # (see ``pool.writable``)
        if chosen.start_method == "fork":  # (every pool: the first launch pays it, not a graded test's time)
            confine.write_before_confining()
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
            if pid or ranks.dying(w.pid):
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
            waiting = [w for w in stuck if not calls[w.rank] and ranks.runnable(w.pid)]
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


def _rng_states() -> dict:
    """The notebook's random states now: warm ranks start every launch from them, as a
    rank forked at this moment would (no hidden state carried over from earlier launches)."""
    # torch's as plain bytes: its tensor pickles through torch.save (0.11 ms against 0.02, per rank per launch)
    states = {"torch": torch.random.get_rng_state().numpy().tobytes(), "python": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    return states
