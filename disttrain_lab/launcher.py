"""Run a function on N ranks from a notebook cell (or a script), and never hang.

    >>> def hello():
    ...     import torch.distributed as dist
    ...     print("hi from", dist.get_rank())
    ...     return dist.get_rank() * 10
    >>> dl.launch(hello, world_size=4)          # prints "[rank k] hi from k"
    [0, 10, 20, 30]

How it works (see DESIGN.md, "Launching ranks from a notebook"):

- Ranks are worker processes kept warm between calls.  Where it is safe they are forked
  from the notebook's kernel (0.1 s for 4 ranks; children run with one OpenMP thread,
  which avoids the OpenMP-after-fork hang).  For NCCL they are fresh interpreters
  (``python -c``), because a forked child cannot use CUDA once the parent touched it.
- The function travels by value with cloudpickle, so functions defined in a notebook
  cell work; return values (tensors included) come back the same way.
- Each call gets a fresh process group on a fresh ``TCPStore`` bound to port 0: the OS
  picks a free port, so classmates on one Hub never clash, and nothing is left in /tmp.
- Every rank's stdout/stderr is relayed into the cell as ``[rank k] ...``.
- The launcher waits on all ranks with a deadline.  An exception in a rank, a rank that
  dies, a timeout or Ctrl-C stops *all* ranks (SIGKILL) and raises here with what each
  rank was doing; the pool is rebuilt on the next call.
- Under ``torchrun`` (RANK and WORLD_SIZE set) ``launch`` just calls the function on the
  current rank, so the same notebook code runs as a script on a cluster.
"""
from __future__ import annotations

import atexit
import io
import linecache
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable

import cloudpickle

from . import integrity, trace
from .integrity import TamperingError

DEFAULT_TIMEOUT = 60.0      # seconds a launch may take before it is stopped
MAX_WORLD_SIZE = 32         # gloo ranks on one machine; NCCL: one per GPU
BACKENDS = ("gloo", "nccl")
MAX_OUTPUT_LINES = 2000     # per rank and launch; more is counted, not shown
_STARTUP_TIMEOUT = 180.0    # a fresh interpreter importing torch on a busy machine
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

__all__ = ["launch", "device", "shutdown", "plan", "LaunchError", "RankError", "RankDied",
           "LaunchTimeout", "TamperingError"]


# --------------------------------------------------------------------------------------
# Errors the notebook sees
# --------------------------------------------------------------------------------------
class LaunchError(RuntimeError):
    """Something went wrong on the ranks of a ``dl.launch``; all ranks were stopped."""


class RankError(LaunchError):
    """A rank raised an exception.  ``str(e)`` shows the rank's traceback, ending at your line."""

    def __init__(self, message: str, rank: int, exc_type: str, exc_message: str, remote_traceback: str):
        super().__init__(message)
        self.rank, self.exc_type, self.exc_message = rank, exc_type, exc_message
        self.remote_traceback = remote_traceback


class RankDied(LaunchError):
    """A rank's process ended without returning (``os._exit``, ``abort``, a crash, out of memory)."""

    def __init__(self, message: str, rank: int, exitcode: int | None):
        super().__init__(message)
        self.rank, self.exitcode = rank, exitcode


class LaunchTimeout(LaunchError):
    """Not every rank finished within the timeout.  ``blocked`` says what each rank was doing."""

    def __init__(self, message: str, blocked: dict[int, str]):
        super().__init__(message)
        self.blocked = blocked


# --------------------------------------------------------------------------------------
# Choosing backend and start method
# --------------------------------------------------------------------------------------
@dataclass
class Plan:
    backend: str          # "gloo" or "nccl"
    start_method: str     # "fork" or "spawn"
    reason: str


def _gpu_count() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def plan(world_size: int | None = None, backend: str | None = None) -> Plan:
    """Which backend and start method ``launch`` will use for ``world_size`` ranks.

    Default: NCCL with one GPU per rank when there are enough GPUs, otherwise gloo on
    CPU.  ``DISTTRAIN_LAB_BACKEND=gloo`` in the environment forces gloo.
    """
    backend = backend or os.environ.get("DISTTRAIN_LAB_BACKEND") or None
    if backend is None:
        gpus = _gpu_count()
        import torch.distributed as dist
        if gpus and world_size is not None and gpus >= world_size and dist.is_nccl_available():
            backend, reason = "nccl", f"{gpus} GPUs, one per rank"
        elif gpus:
            backend, reason = "gloo", f"{gpus} GPU(s) for {world_size} ranks: gloo on CPU"
        else:
            backend, reason = "gloo", "no GPU: gloo on CPU"
    else:
        reason = "asked for"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (or None to choose), got {backend!r}")
    if backend == "nccl" or sys.platform != "linux" and sys.platform != "darwin":
        # a forked child cannot use CUDA once the parent touched it; fresh interpreters can
        return Plan(backend, "spawn", reason + "; ranks are fresh interpreters (CUDA-safe)")
    return Plan(backend, "fork", reason + "; ranks are forked from this process (fast)")


def _validate(fn, world_size, timeout, backend) -> None:
    if not callable(fn):
        raise ValueError(f"launch needs a function to run on every rank, got {type(fn).__name__} "
                         f"{fn!r}; pass the function itself: dl.launch(my_fn, 4), not dl.launch(my_fn(), 4)")
    limit = MAX_WORLD_SIZE
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= limit:
        raise ValueError(f"world_size must be an int from 1 to {limit}, got {world_size!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None (choose automatically), got {backend!r}")


# --------------------------------------------------------------------------------------
# The public entry point
# --------------------------------------------------------------------------------------
def launch(fn: Callable, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT,
           trace: bool = False, backend: str | None = None, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result.

    Every rank starts with ``torch.distributed`` initialised (``dist.get_rank()``,
    ``dist.send(...)`` just work).  Returns ``[result of rank 0, result of rank 1, ...]``,
    or a :class:`disttrain_lab.Run` with the results and every rank's communication
    events when ``trace=True``.

    Raises RankError (a rank raised), RankDied (a rank's process ended), LaunchTimeout
    (not done within ``timeout`` seconds; says what each rank was blocked in).  In all
    three cases every rank has been stopped.

        >>> dl.launch(lambda x: x + dist.get_rank(), 2, 10)
        [10, 11]
    """
    __tracebackhide__ = True  # IPython: show the student's frames, not the launcher's
    _validate(fn, world_size, timeout, backend)
    if _under_torchrun():
        return _launch_in_process(fn, world_size, args, kwargs, trace, backend)
    integrity.verify()
    chosen = plan(world_size, backend)
    if chosen.backend == "nccl" and _gpu_count() < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: {world_size} ranks but "
                         f"{_gpu_count()} GPU(s); use backend='gloo' or world_size <= {_gpu_count()}")
    payload = cloudpickle.dumps((fn, args, kwargs))
    with _POOL_LOCK:
        pool = _pool_for(world_size, chosen)
        results, events, wall = pool.run(payload, world_size, timeout, trace)
    if trace:
        return trace_module.Run(results=results, events=events, world_size=world_size,
                                backend=chosen.backend, wall_time=wall)
    return results


trace_module = trace  # `trace` is also launch's keyword; keep the module reachable


def device():
    """The torch.device this rank computes on: ``cuda:<local rank>`` under NCCL, else CPU."""
    import torch
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return torch.device("cpu")


def shutdown() -> None:
    """Stop the warm worker processes (they are also stopped when Python exits)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close()
            _POOL = None


# --------------------------------------------------------------------------------------
# Under torchrun: run in this process
# --------------------------------------------------------------------------------------
def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _launch_in_process(fn, world_size, args, kwargs, want_trace, backend):
    import torch.distributed as dist
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise ValueError(f"launch(world_size={world_size}) runs under torchrun with WORLD_SIZE={env_world}: "
                         f"start torchrun with --nproc-per-node {world_size} (times nodes), or launch "
                         f"with world_size={env_world}")
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if _gpu_count() else "gloo"))
    integrity.verify()
    rank = dist.get_rank()
    dist.barrier()
    t0 = time.perf_counter()
    trace.install()
    trace._REC.begin(rank, t0, want_trace, None)
    try:
        result = fn(*args, **kwargs)
    finally:
        raw = trace._REC.end()
        trace.uninstall()
    wall = time.perf_counter() - t0
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (result, raw))
    results = [r for r, _ in gathered]
    if not want_trace:
        return results
    events = sorted((e for _, evs in gathered for e in trace.to_events(evs)), key=lambda e: e.start)
    return trace.Run(results=results, events=events, world_size=world_size,
                     backend=dist.get_backend(), wall_time=wall)


# --------------------------------------------------------------------------------------
# The warm pool of worker processes
# --------------------------------------------------------------------------------------
_POOL = None
_POOL_LOCK = threading.RLock()


def _pool_for(world_size: int, chosen: Plan) -> "_Pool":
    global _POOL
    if _POOL is not None and not _POOL.usable_for(world_size, chosen):
        _POOL.close()
        _POOL = None
    if _POOL is None:
        _POOL = _Pool(world_size, chosen)
    return _POOL


class _Worker:
    def __init__(self, rank: int, pid: int, conn: Connection, out_fd: int, popen=None):
        self.rank, self.pid, self.conn, self.out_fd, self.popen = rank, pid, conn, out_fd, popen
        self.partial = b""
        self.shown = 0
        self.hidden = 0


class _Pool:
    """``size`` warm workers; a call with world_size <= size uses the first ones."""

    def __init__(self, size: int, chosen: Plan):
        import mmap
        self.size, self.plan = size, chosen
        self.owner_pid = os.getpid()
        self.workers: list[_Worker] = []
        self.calls = 0
        self.broken = False
        if chosen.start_method == "spawn":
            self.status_fd = os.memfd_create("disttrain-lab-status")
            os.ftruncate(self.status_fd, trace.SLOT_BYTES * size)
            self.status = mmap.mmap(self.status_fd, trace.SLOT_BYTES * size)
        else:
            self.status_fd = None
            self.status = mmap.mmap(-1, trace.SLOT_BYTES * size)
        self.store = None
        try:
            for rank in range(size):
                self.workers.append(self._start_worker(rank))
            self._wait_ready()
            # One store per pool, created after the forks (so no child inherits its socket),
            # on port 0: the OS picks a free port, so launches on a shared host never clash.
            # Workers keep one connection to it; each launch uses its own key prefix.
            import torch.distributed as dist
            self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=_STARTUP_TIMEOUT))
        except BaseException:
            self.close()
            raise

    def usable_for(self, world_size: int, chosen: Plan) -> bool:
        return (not self.broken and self.owner_pid == os.getpid() and world_size <= self.size
                and (self.plan.backend, self.plan.start_method) == (chosen.backend, chosen.start_method))

    # ---- starting workers ---------------------------------------------------------
    def _start_worker(self, rank: int) -> _Worker:
        parent_sock, child_sock = socket.socketpair()
        out_r, out_w = os.pipe()
        if self.plan.start_method == "fork":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # child: never return into the caller's stack
                code = 1
                try:
                    parent_sock.close()
                    os.close(out_r)
                    _worker_main(child_sock.detach(), out_w, self.status, forked=True, parent=self.owner_pid)
                    code = 0
                finally:
                    os._exit(code)
            popen = None
        else:
            fds = (child_sock.fileno(), out_w, self.status_fd)
            popen = subprocess.Popen(
                [sys.executable, "-c", "from disttrain_lab.launcher import _spawned_main; _spawned_main()",
                 *map(str, fds), str(self.owner_pid), str(trace.SLOT_BYTES * self.size)],
                pass_fds=fds, stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w, close_fds=True)
            pid = popen.pid
        child_sock.close()
        os.close(out_w)
        os.set_blocking(out_r, False)
        return _Worker(rank, pid, Connection(parent_sock.detach()), out_r, popen)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        waiting = {w.conn.fileno(): w for w in self.workers}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(f"ranks {sorted(w.rank for w in waiting.values())} did not start "
                                  f"within {_STARTUP_TIMEOUT:.0f} s")
            ready, _, _ = select.select(list(waiting) + [w.out_fd for w in self.workers], [], [], left)
            for fd in ready:
                if fd in waiting:
                    w = waiting.pop(fd)
                    try:
                        w.conn.recv_bytes()
                    except (EOFError, OSError):
                        self._relay_all()
                        raise LaunchError(f"rank {w.rank} failed to start (exit code {self._reap(w)})")
                else:
                    self._relay(next(w for w in self.workers if w.out_fd == fd))

    # ---- one launch -------------------------------------------------------------------
    def run(self, payload: bytes, world_size: int, timeout: float, want_trace: bool):
        __tracebackhide__ = True
        self.calls += 1
        t0 = time.perf_counter()
        workers = self.workers[:world_size]
        rng = _rng_states()
        for w in workers:
            w.shown = w.hidden = 0
            trace.write_status(self.status, w.rank, None)
        try:
            for w in workers:
                job = {"rank": w.rank, "world_size": world_size, "backend": self.plan.backend,
                       "port": self.store.port, "prefix": f"launch{self.calls}/", "payload": payload,
                       "trace": want_trace, "timeout": timeout, "t0": t0, "rng": rng}
                w.conn.send_bytes(pickle.dumps(job))
            replies = self._collect(workers, t0 + timeout, timeout)
        except BaseException:
            self.broken = True
            raise
        wall = time.perf_counter() - t0
        results, events = [], []
        for w in workers:
            _, result, raw = replies[w.rank]
            results.append(result)
            events.extend(trace.to_events(raw))
        events.sort(key=lambda e: (e.start, e.rank))
        return results, events, wall

    def _collect(self, workers: list[_Worker], deadline_pc: float, timeout: float) -> dict:
        __tracebackhide__ = True
        replies: dict[int, tuple] = {}
        by_conn = {w.conn.fileno(): w for w in workers}
        by_out = {w.out_fd: w for w in workers}
        try:
            while len(replies) < len(workers):
                left = deadline_pc - time.perf_counter()
                if left <= 0:
                    self._relay_all()
                    self._timeout(workers, replies, timeout)
                pending = [fd for fd, w in by_conn.items() if w.rank not in replies]
                ready, _, _ = select.select(pending + list(by_out), [], [], min(left, 1.0))
                for fd in ready:
                    if fd in by_out:
                        self._relay(by_out[fd])
                        continue
                    w = by_conn[fd]
                    try:
                        reply = cloudpickle.loads(w.conn.recv_bytes())
                    except (EOFError, OSError, ConnectionError):
                        self._rank_died(w, workers)
                    if reply[0] == "error":
                        self._relay_all()
                        self.close()
                        if reply[1]["type"] == "TamperingError":
                            raise TamperingError(f"rank {w.rank}: {reply[1]['message']}")
                        raise _rank_error(w.rank, reply[1], workers)
                    replies[w.rank] = reply
            self._relay_all()
        except KeyboardInterrupt:
            self.close()
            print(f"[disttrain-lab] interrupted: stopped all {len(workers)} ranks", file=sys.stderr)
            raise
        finally:
            self._flush_hidden(workers)
        return replies

    # ---- failures ---------------------------------------------------------------------
    def _rank_died(self, w: _Worker, workers: list[_Worker]):
        __tracebackhide__ = True
        self._relay_all()
        code = self._reap(w)
        self.close()
        if code is not None and code < 0:
            sig = signal.Signals(-code).name
            hint = {"SIGABRT": "abort() was called (os.abort, or a C++ assertion)",
                    "SIGSEGV": "it crashed (segmentation fault)",
                    "SIGKILL": "it was killed, often for using too much memory"}.get(sig, "")
            how = f"was killed by {sig}" + (f": {hint}" if hint else "")
        else:
            how = f"exited with code {code}" + (" (os._exit or sys.exit inside the rank?)" if code else "")
        others = ", ".join(str(o.rank) for o in workers if o is not w)
        raise RankDied(f"rank {w.rank} ended without returning: its process {how}. "
                       f"The other ranks ({others}) were stopped.", w.rank, code)

    def _timeout(self, workers: list[_Worker], replies: dict, timeout: float):
        __tracebackhide__ = True
        now = time.perf_counter()
        states: dict[int, trace.Blocked | str | None] = {}
        for w in workers:
            if w.rank in replies:
                states[w.rank] = "finished"
            else:
                states[w.rank] = trace.read_status(self.status, w.rank)
        self.close()
        raise _timeout_error(states, now, timeout)

    def _reap(self, w: _Worker) -> int | None:
        """Exit code of a worker (negative: killed by that signal); waits briefly."""
        for _ in range(50):
            try:
                pid, status = os.waitpid(w.pid, os.WNOHANG)
            except ChildProcessError:
                return w.popen.returncode if w.popen else None
            if pid:
                if w.popen is not None:
                    w.popen.returncode = os.waitstatus_to_exitcode(status)
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        return None

    # ---- output relay -------------------------------------------------------------------
    def _relay(self, w: _Worker) -> None:
        try:
            chunk = os.read(w.out_fd, 1 << 16)
        except (BlockingIOError, OSError):
            return
        if not chunk:
            return
        lines = (w.partial + chunk).split(b"\n")
        w.partial = lines.pop()
        self._show(w, lines)

    def _show(self, w: _Worker, lines: list[bytes]) -> None:
        out = []
        for line in lines:
            if w.shown < MAX_OUTPUT_LINES:
                out.append(f"[rank {w.rank}] {line.decode(errors='replace')}\n")
                w.shown += 1
            else:
                w.hidden += 1
        if out:
            sys.stdout.write("".join(out))
            sys.stdout.flush()

    def _relay_all(self) -> None:
        for w in self.workers:
            for _ in range(64):
                try:
                    chunk = os.read(w.out_fd, 1 << 16)
                except (BlockingIOError, OSError):
                    break
                if not chunk:
                    break
                lines = (w.partial + chunk).split(b"\n")
                w.partial = lines.pop()
                self._show(w, lines)
            if w.partial:
                self._show(w, [w.partial])
                w.partial = b""

    def _flush_hidden(self, workers: list[_Worker]) -> None:
        for w in workers:
            if w.hidden:
                sys.stdout.write(f"[rank {w.rank}] ... {w.hidden} more lines not shown "
                                 f"(at most {MAX_OUTPUT_LINES} per rank)\n")
                w.hidden = 0

    # ---- stopping -------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every worker (SIGKILL: a rank blocked in C++ ignores anything gentler)."""
        self.broken = True
        if os.getpid() != self.owner_pid:
            return
        for w in self.workers:
            try:
                os.kill(w.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for w in self.workers:
            try:
                os.waitpid(w.pid, 0)
            except ChildProcessError:
                pass
            if w.popen is not None:
                w.popen.returncode = w.popen.returncode if w.popen.returncode is not None else -9
            for closer in (w.conn.close, lambda: os.close(w.out_fd)):
                try:
                    closer()
                except OSError:
                    pass
        self.workers = []
        self.store = None
        if self.status_fd is not None:
            os.close(self.status_fd)
            self.status_fd = None


@atexit.register
def _stop_pool_at_exit() -> None:
    if _POOL is not None:
        _POOL.close()


# --------------------------------------------------------------------------------------
# Turning what a rank reported into the error the notebook sees
# --------------------------------------------------------------------------------------
def _is_internal(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIR) or "cloudpickle" in filename


def _is_library(filename: str) -> bool:
    f = os.path.abspath(filename)
    return _is_internal(f) or f"{os.sep}torch{os.sep}" in f or f"{os.sep}site-packages{os.sep}" in f


def _cell_name(filename: str) -> str:
    """'Cell In[5]' for code typed in a notebook cell, else the file name."""
    try:
        ip = get_ipython()  # type: ignore[name-defined]  # noqa: F821
        count = ip.compile._filename_map.get(filename)
        if count is not None:
            return f"Cell In[{count}]"
    except Exception:
        pass
    return f'File "{filename}"'


def _format_frames(frames: list[tuple]) -> str:
    lines = []
    for filename, lineno, name, text in frames:
        text = text or linecache.getline(filename, lineno).strip()
        lines.append(f"  {_cell_name(filename)}, line {lineno}, in {name}")
        if text:
            lines.append(f"    {text}")
    return "\n".join(lines)


def _rank_error(rank: int, info: dict, workers: list[_Worker]) -> RankError:
    frames = [f for f in info["frames"] if not _is_internal(f[0])]
    # end at the student's own line: drop trailing frames inside torch / site-packages
    while len(frames) > 1 and _is_library(frames[-1][0]) and not all(_is_library(f[0]) for f in frames):
        frames.pop()
    shown = _format_frames(frames)
    others = [str(w.rank) for w in workers if w.rank != rank]
    message = (f"rank {rank} raised {info['type']}: {info['message']}\n\n"
               f"Traceback of rank {rank} (most recent call last):\n{shown}\n"
               f"{info['type']}: {info['message']}")
    if others:
        message += f"\n\n(The other ranks, {', '.join(others)}, were stopped.)"
    full = _format_frames([f for f in info["frames"] if not _is_internal(f[0])])
    return RankError(message, rank, info["type"], info["message"], full)


def _timeout_error(states: dict, now: float, timeout: float) -> LaunchTimeout:
    blocked: dict[int, str] = {}
    for rank, s in states.items():
        if s == "finished":
            blocked[rank] = "finished"
        elif s is None:
            blocked[rank] = "running Python code (not in a torch.distributed call)"
        else:
            blocked[rank] = f"{s.text} for {now - s.since:.1f} s"
    lines = [f"not every rank finished within the timeout of {timeout:g} s; all ranks were stopped."]
    lines += [f"  rank {r}: {what}" for r, what in sorted(blocked.items())]
    lines.append(_diagnose(states))
    return LaunchTimeout("\n".join(lines), blocked)


def _diagnose(states: dict) -> str:
    """One sentence on the likely cause, from what each rank is blocked in."""
    waiting = {r: s for r, s in states.items() if isinstance(s, trace.Blocked)}
    finished = [r for r, s in states.items() if s == "finished"]
    running = [r for r, s in states.items() if s is None]
    if running:
        return (f"Rank(s) {running} never reached a communication call before the deadline: an infinite "
                f"loop or a very long computation?  (Raise timeout= if the work is just slow.)")

    def kind(s: trace.Blocked) -> str:
        op = s.op.split(":")[-1]
        return "recv" if op in ("recv", "irecv") else "send" if op in ("send", "isend") else op

    for r, s in waiting.items():
        if kind(s) in ("recv", "send") and s.peer in finished:
            verb = "a message from" if kind(s) == "recv" else "to send to"
            return (f"Rank {r} waits {verb} rank {s.peer}, but rank {s.peer} already returned: a matching "
                    f"{'send' if kind(s) == 'recv' else 'recv'} is missing (or uses another rank or tag).")
    for r, s in waiting.items():
        other = waiting.get(s.peer) if s.peer is not None else None
        if other is not None and other.peer == r and {kind(s), kind(other)} == {"send", "recv"} and s.tag != other.tag:
            return (f"Ranks {r} and {s.peer} talk to each other with different tags ({s.tag} and {other.tag}): "
                    f"a recv only matches a send with the same tag.")
    joining = [r for r, s in waiting.items() if s.op == "init_process_group"]
    if joining:
        return (f"Rank(s) {joining} were still joining the process group: the machine may be overloaded; "
                f"try again, or raise timeout=.")
    kinds = {kind(s) for s in waiting.values()}
    if kinds == {"recv"}:
        return ("Every rank is waiting to receive and no rank is sending: a deadlock.  Let one side send "
                "first (e.g. even ranks send then receive, odd ranks receive then send), or post the "
                "sends with isend before receiving.")
    if kinds == {"send"}:
        return ("Every rank is sending and no rank is receiving: a deadlock (a blocking send waits for the "
                "matching receive).  Order the calls so that each send meets a receive, or use isend/irecv.")
    collectives = {kind(s) for s in waiting.values()} - {"recv", "send"}
    if collectives and (finished or len(kinds) > 1):
        return ("Some ranks are inside a collective that other ranks did not call (or called in another "
                "order): every rank of the group must call the same collectives in the same order.")
    return "The ranks are waiting on each other in a cycle: a deadlock."


# --------------------------------------------------------------------------------------
# The worker side
# --------------------------------------------------------------------------------------
def _set_parent_death_signal(parent: int) -> None:
    """Die with the notebook kernel, even if it is killed with SIGKILL (Linux)."""
    if sys.platform == "linux":
        try:
            import ctypes
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:
            pass
    if os.getppid() != parent:
        os._exit(0)


def _spawned_main() -> None:
    import mmap
    conn_fd, out_fd, status_fd, parent, nbytes = map(int, sys.argv[1:6])
    status = mmap.mmap(status_fd, nbytes)
    _worker_main(conn_fd, out_fd, status, forked=False, parent=parent)


_FORKED = False
_RETIRED_GROUPS: list = []


def _worker_main(conn_fd: int, out_fd: int, status, forked: bool, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the launcher, which stops us
    _set_parent_death_signal(parent)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    if out_fd > 2:
        os.close(out_fd)
    # the kernel's sys.stdout talks to Jupyter through a thread that a fork does not copy
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True,
                                  errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True,
                                  errors="backslashreplace")
    import torch
    global _FORKED
    _FORKED = forked
    if forked:
        torch.set_num_threads(1)  # OpenMP's thread pool does not survive fork
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo" if sys.platform == "linux" else "lo0")
    trace.install()
    conn = Connection(conn_fd)
    conn.send_bytes(b"ready")
    while True:
        # Destroying a gloo group's C++ object takes ~40 ms; do it while idle, not in a call.
        while _RETIRED_GROUPS and (len(_RETIRED_GROUPS) > 16 or not conn.poll(0.005)):
            _RETIRED_GROUPS.pop(0)
        try:
            job = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        reply = _run_job(job, status)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            data = cloudpickle.dumps(reply)
        except Exception as exc:
            data = cloudpickle.dumps(("error", _error_info(TypeError(
                f"the return value of rank {job['rank']} cannot be sent back to the notebook "
                f"({type(exc).__name__}: {exc}); return tensors, numbers, lists or dicts"))))
        conn.send_bytes(data)


def _run_job(job: dict, status) -> tuple:
    import torch
    import torch.distributed as dist
    rank, world_size = job["rank"], job["world_size"]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]))
    if not _FORKED:  # a fresh interpreter may use several threads; share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    pg_timeout = timedelta(seconds=job["timeout"] + 30)
    trace.write_status(status, rank, trace.status_text("init_process_group", None, 0, 0, None))
    try:
        _retire_group()
        store = _store_client(job["port"])
        if job["backend"] == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(job["backend"], store=dist.PrefixStore(job["prefix"], store),
                                rank=rank, world_size=world_size, timeout=pg_timeout)
    except Exception as exc:
        return ("error", _error_info(exc))
    trace.write_status(status, rank, None)
    _set_rng_states(job["rng"])
    trace._REC.begin(rank, job["t0"], job["trace"], status)
    try:
        fn, args, kwargs = cloudpickle.loads(job["payload"])
        result = fn(*args, **kwargs)
        integrity.verify()  # did the function replace torch.distributed while it ran?
        reply = ("ok", result, None)
    except BaseException as exc:  # noqa: BLE001  (SystemExit too: report it, don't die)
        reply = ("error", _error_info(exc))
    finally:
        raw = trace._REC.end()
    if reply[0] == "ok":
        # The group stays up until the next launch: a rank that returns early must not
        # break a peer still inside a collective (that peer should time out and say so).
        reply = ("ok", reply[1], raw)
    return reply


def _rng_states() -> dict:
    """The notebook's random states now: warm ranks start every launch from them, as a
    rank forked at this moment would (no hidden state carried over from earlier launches)."""
    import random
    import torch
    states = {"torch": torch.random.get_rng_state(), "python": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    return states


def _set_rng_states(states: dict) -> None:
    import random
    import torch
    torch.random.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "numpy" in states:
        import numpy
        numpy.random.set_state(states["numpy"])


def _store_client(port: int):
    """This worker's one connection to the pool's TCPStore (a new connection per launch
    sometimes stalls for 5 s in connect; one kept open never does)."""
    global _STORE
    if _STORE is None or _STORE[0] != port:
        import torch.distributed as dist
        _STORE = (port, dist.TCPStore("127.0.0.1", port, is_master=False,
                                      timeout=timedelta(seconds=_STARTUP_TIMEOUT)))
    return _STORE[1]


_STORE = None


def _retire_group() -> None:
    """Destroy the previous launch's process group, keeping its C++ object for later."""
    import torch.distributed as dist
    if dist.is_initialized():
        _RETIRED_GROUPS.append(dist.group.WORLD)  # its destructor takes ~40 ms: run it when idle
        dist.destroy_process_group()


def _error_info(exc: BaseException) -> dict:
    frames = [(f.filename, f.lineno, f.name, f.line) for f in traceback.extract_tb(exc.__traceback__)]
    message = str(exc)
    if isinstance(exc, SystemExit):
        message = f"sys.exit({exc.code!r}) was called inside the rank"
    return {"type": type(exc).__name__, "message": message, "frames": frames}
