"""Run a function on N ranks from a notebook cell (or a script), and never hang.

    >>> def hello():
    ...     import torch.distributed as dist
    ...     print("hi from", dist.get_rank())
    ...     return dist.get_rank() * 10
    >>> dl.launch(hello, world_size=4)          # prints "[rank k] hi from k"
    [0, 10, 20, 30]

How it works (see docs/architecture.md, "Launching ranks from a notebook"):

- One policy (see :func:`plan`): ``device="cpu"`` (the default) runs gloo on the CPU and
  never touches a GPU; ``device="cuda"`` gives rank k the k-th visible GPU and NCCL.
- Ranks are worker processes kept warm between calls.  On the CPU they are forked
  from the notebook's kernel (0.1 s for 4 ranks; children run with one OpenMP thread,
  which avoids the OpenMP-after-fork hang).  For GPUs they are fresh interpreters
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
import os
import pickle
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Callable

import cloudpickle

from . import codemap, integrity, network, trace
from .integrity import TamperingError
from .network import Network
from .reports import LaunchError, LaunchTimeout, RankDied, RankError, rank_error, timeout_error
from .worker import STARTUP_TIMEOUT, worker_main

DEFAULT_TIMEOUT = 60.0      # seconds a launch may take before it is stopped
MAX_WORLD_SIZE = 32         # gloo ranks on one machine; NCCL: one per GPU
MAX_OUTPUT_LINES = 2000     # per rank and launch; more is counted, not shown

__all__ = ["launch", "device", "shutdown", "plan", "Plan", "LaunchError", "RankError", "RankDied",
           "LaunchTimeout", "TamperingError"]


# --------------------------------------------------------------------------------------
# Choosing backend and start method: one policy, in the notebook and in grading alike
# --------------------------------------------------------------------------------------
DEVICES = ("cpu", "cuda")
# backend= is the old spelling of device=: gloo meant the CPU, nccl meant one GPU per rank
_DEVICE_OF_BACKEND = {"gloo": "cpu", "nccl": "cuda"}


@dataclass
class Plan:
    device: str           # "cpu" or "cuda": what dl.device() gives a rank
    backend: str          # "gloo", or "nccl": then CPU tensors still travel over gloo
    start_method: str     # "fork" or "spawn"
    reason: str

    @property
    def group_backend(self) -> str:
        # with NCCL, CPU tensors (every p2p lab uses them) go over gloo: one group serves both
        return "cpu:gloo,cuda:nccl" if self.backend == "nccl" else "gloo"


def _gpu_count() -> int:
    """GPUs visible to this process (CUDA_VISIBLE_DEVICES respected)."""
    try:
        import torch
        # device_count asks NVML and leaves CUDA uninitialised, so forked ranks can still
        # use the GPU; torch.cuda.is_available() would initialise it in this process
        return torch.cuda.device_count()
    except Exception:
        return 0


def _check_device(device) -> str:
    """"cpu" or "cuda" from a string or a torch.device; anything else is refused."""
    if isinstance(device, str):
        kind, index = device, None
    else:  # torch.device("cuda") works too
        kind, index = getattr(device, "type", device), getattr(device, "index", None)
    if kind not in DEVICES or index is not None:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}: \"cpu\" runs every rank on the "
                         f"CPU with gloo; \"cuda\" gives rank k the k-th visible GPU (NCCL). A rank asks "
                         f"dl.device() which GPU is its own, so no index is given here")
    return kind


def plan(world_size: int | None = None, device: str = "cpu", *, local_world_size: int | None = None) -> Plan:
    """Which backend and start method ``launch(..., device=device)`` uses for ``world_size`` ranks.

    The policy (the same in a notebook, under the grader and under torchrun):

    - ``device="cpu"`` (the default): gloo on the CPU, ranks forked from this process.
      No rank touches a GPU (no CUDA context, no ``set_device``), however many there are.
    - ``device="cuda"``: NCCL for CUDA tensors in a ``cpu:gloo,cuda:nccl`` group (so CPU
      tensors still work), ranks are fresh interpreters (a forked child cannot use CUDA),
      and rank k uses the k-th GPU visible to this process (``CUDA_VISIBLE_DEVICES``
      respected).  More ranks than visible GPUs, or no GPU, is a ``ValueError``.

    ``local_world_size``: the ranks on this machine when it differs from ``world_size``
    (torchrun on several nodes).  The environment does not change the policy (the old
    ``DISTTRAIN_LAB_BACKEND`` variable is no longer read).
    """
    device = _check_device(device)
    local = world_size if local_world_size is None else local_world_size
    spawn_only = sys.platform not in ("linux", "darwin")  # no fork() there
    if device == "cpu":
        method = "spawn" if spawn_only else "fork"
        return Plan("cpu", "gloo", method, "device='cpu': gloo on the CPU; " + (
            "ranks are fresh interpreters" if spawn_only else "ranks are forked from this process (fast)"))
    gpus = _gpu_count()
    if gpus == 0:
        import torch
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build (torch.version.cuda is None)"
        raise ValueError(f"device='cuda' needs a GPU, but this process sees none (torch.cuda.device_count() == 0; "
                         f"torch {torch.__version__} is {build}; CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!s}). Use device='cpu' "
                         f"(gloo on the CPU runs every lab), or run on a machine with GPUs")
    if local is not None and local > gpus:
        raise ValueError(f"device='cuda' gives each rank its own GPU: {local} ranks need {local} GPUs, but "
                         f"{gpus} GPU(s) are visible to this server (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). Use world_size <= {gpus}, "
                         f"or device='cpu' for up to {MAX_WORLD_SIZE} ranks")
    import torch.distributed as dist
    if not dist.is_nccl_available():
        raise ValueError("device='cuda' needs NCCL, and this torch was built without it "
                         "(torch.distributed.is_nccl_available() is False); use device='cpu'")
    return Plan("cuda", "nccl", "spawn", f"device='cuda': NCCL, rank k on the k-th of {gpus} visible GPU(s); "
                "ranks are fresh interpreters (CUDA-safe)")


def _resolve_device(device, backend) -> str:
    """device= (None: "cpu"), or the deprecated backend= ("gloo" -> "cpu", "nccl" -> "cuda")."""
    if backend is None:
        return _check_device("cpu" if device is None else device)
    if backend not in _DEVICE_OF_BACKEND:
        raise ValueError(f"backend must be one of {tuple(_DEVICE_OF_BACKEND)} or None, got {backend!r}; "
                         f"backend= is deprecated: say device='cpu' (gloo) or device='cuda' (NCCL)")
    implied = _DEVICE_OF_BACKEND[backend]
    if device is not None and _check_device(device) != implied:
        # gloo runs on the CPU; NCCL moves only CUDA tensors, so it needs device='cuda'
        raise ValueError(f"device={device!r} and backend={backend!r} disagree: backend={backend!r} needs "
                         f"device={implied!r} ({'NCCL moves only CUDA tensors' if backend == 'nccl' else 'gloo runs on the CPU'}). "
                         f"backend= is deprecated: give only device= (device='cpu' for gloo, device='cuda' for NCCL)")
    import warnings
    warnings.warn(f"dl.launch(backend={backend!r}) is deprecated; use device={implied!r}",
                  DeprecationWarning, stacklevel=3)
    return implied


def _validate(fn, world_size, timeout, network=None) -> None:
    if not callable(fn):
        raise ValueError(f"launch needs a function to run on every rank, got {type(fn).__name__} "
                         f"{fn!r}; pass the function itself: dl.launch(my_fn, 4), not dl.launch(my_fn(), 4)")
    limit = MAX_WORLD_SIZE
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= limit:
        raise ValueError(f"world_size must be an int from 1 to {limit}, got {world_size!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if network is not None and not isinstance(network, Network):
        raise ValueError(f"network must be a dl.Network (e.g. dl.Network.preset('1 Gbit Ethernet')) or None "
                         f"(the real links), got {type(network).__name__} {network!r}")


# --------------------------------------------------------------------------------------
# The public entry point
# --------------------------------------------------------------------------------------
def launch(fn: Callable, world_size: int, *args, device: str | None = None, timeout: float = DEFAULT_TIMEOUT,
           trace: bool = False, backend: str | None = None, network: Network | None = None, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result.

    Every rank starts with ``torch.distributed`` initialised (``dist.get_rank()``,
    ``dist.send(...)`` just work).  Returns ``[result of rank 0, result of rank 1, ...]``,
    or a :class:`disttrain_lab.Run` with the results and every rank's communication
    events when ``trace=True``.

    ``device``: ``"cpu"`` (the default, also when None) runs the ranks on the CPU with gloo and never touches a
    GPU; ``"cuda"`` gives rank k the k-th visible GPU and NCCL for CUDA tensors (CPU tensors
    still go over gloo).  Inside a rank, ``dl.device()`` is the device to put tensors on.
    See :func:`plan` for the whole policy.  ``backend="gloo"/"nccl"`` is the deprecated
    spelling of ``device="cpu"/"cuda"`` (it warns; with a device= that disagrees, e.g.
    ``device="cpu", backend="nccl"``, it is a ValueError).

    Raises RankError (a rank raised), RankDied (a rank's process ended), LaunchTimeout
    (not done within ``timeout`` seconds; says what each rank was blocked in).  In all
    three cases every rank has been stopped.

    ``network=dl.Network(...)`` slows every transfer of CPU tensors down to at least what
    that link would take (see ``disttrain_lab.network``); None (default): the real links.

        >>> dl.launch(lambda x: x + dist.get_rank(), 2, 10)
        [10, 11]
        >>> dl.launch(lambda: str(dl.device()), 2, device="cuda")   # on 2 GPUs
        ['cuda:0', 'cuda:1']
    """
    __tracebackhide__ = True  # IPython: show the student's frames, not the launcher's
    _validate(fn, world_size, timeout, network)
    device = _resolve_device(device, backend)
    if _under_torchrun():
        return _launch_in_process(fn, world_size, args, kwargs, trace, device, timeout, network)
    integrity.verify()
    chosen = plan(world_size, device)
    payload, where = codemap.dumps((fn, args, kwargs))   # where: each code's real cell, for tracebacks
    with _POOL_LOCK:
        pool = _pool_for(world_size, chosen)
        results, events, wall = pool.run(payload, world_size, timeout, trace, network, where)
    if trace:
        run = trace_module.Run(results=results, events=events, world_size=world_size,
                               backend=chosen.backend, wall_time=wall, network=network)
        for observe in tuple(trace_module._RUN_OBSERVERS):
            observe(run)
        return run
    return results


trace_module = trace  # `trace` is also launch's keyword; keep the module reachable


def device():
    """The torch.device this rank computes on: ``cuda:k`` for rank k of a ``device="cuda"``
    launch (the k-th visible GPU; under torchrun, ``cuda:LOCAL_RANK``), else the CPU.

        >>> dl.launch(lambda: dl.device(), 2)                 # [device('cpu'), device('cpu')]
        >>> x = torch.ones(4, device=dl.device())             # inside a rank: on its own GPU
    """
    import torch
    asked = os.environ.get("DISTTRAIN_LAB_RANK_DEVICE")
    if asked is None:  # not in a launch's rank: a torchrun script that set up NCCL itself?
        import torch.distributed as dist
        asked = "cuda" if dist.is_initialized() and "nccl" in str(dist.get_backend()) else "cpu"
    if asked == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
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


def _in_process_timeout(rank: int, timeout: float, status) -> None:
    blocked = trace.read_status(status, rank)
    what = f"{blocked.text} for {time.perf_counter() - blocked.since:.1f} s" if blocked else \
        "running Python code (not in a torch.distributed call)"
    sys.stderr.write(f"[disttrain-lab] rank {rank}: not finished within the timeout of {timeout:g} s; "
                     f"it was in {what}. Stopping this rank (torchrun stops the others).\n")
    sys.stderr.flush()
    os._exit(124)


def _destroy_own_group() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def _launch_in_process(fn, world_size, args, kwargs, want_trace, device, timeout, net=None):
    import torch.distributed as dist
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise ValueError(f"launch(world_size={world_size}) runs under torchrun with WORLD_SIZE={env_world}: "
                         f"under torchrun every launch uses all of torchrun's ranks, so a script must use one "
                         f"world size; start torchrun with --nproc-per-node {world_size} (times nodes), or "
                         f"launch with world_size={env_world}")
    # the same policy as in a notebook; only this node's ranks need a GPU each
    chosen = plan(world_size, device, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if not dist.is_initialized():
        if chosen.device == "cuda":
            import torch
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(chosen.group_backend)
        # we made the group, so we end it: left to interpreter shutdown, gloo's threads are
        # torn down mid-call and the process can die of SIGABRT ("terminate called without
        # an active exception") after the script succeeded
        atexit.register(_destroy_own_group)
    os.environ["DISTTRAIN_LAB_RANK_DEVICE"] = chosen.device
    integrity.verify()
    rank = dist.get_rank()
    dist.barrier()
    t0 = time.perf_counter()
    trace.install()
    status = bytearray(trace.SLOT_BYTES * (rank + 1))
    trace._REC.begin(rank, t0, want_trace, status)
    # no launcher watches this process: a watchdog turns a hang into an error that
    # torchrun sees (it then stops the other ranks)
    watchdog = threading.Timer(timeout, _in_process_timeout, args=(rank, timeout, status))
    watchdog.daemon = True
    watchdog.start()
    network.begin(net, world_size, shared=False)   # ranks may be on several hosts
    try:
        result = fn(*args, **kwargs)
    finally:
        watchdog.cancel()
        network.end(net)
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
                     backend=dist.get_backend(), wall_time=wall, network=net)


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
        # the store listens on every interface; an unguessable key prefix keeps others on a
        # shared host from writing into this pool's process groups
        self.secret = secrets.token_hex(16)
        try:
            for rank in range(size):
                self.workers.append(self._start_worker(rank))
            self._wait_ready()
            # One store per pool, created after the forks (so no child inherits its socket),
            # on port 0: the OS picks a free port, so launches on a shared host never clash.
            # Workers keep one connection to it; each launch uses its own key prefix.
            import torch.distributed as dist
            self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=STARTUP_TIMEOUT))
        except BaseException:
            self.close()
            raise

    def usable_for(self, world_size: int, chosen: Plan) -> bool:
        return (not self.broken and self.owner_pid == os.getpid() and world_size <= self.size
                and (self.plan.backend, self.plan.start_method) == (chosen.backend, chosen.start_method)
                and self._all_alive())

    def _all_alive(self) -> bool:
        """False if any idle worker died since the last launch (killed, out of memory, or
        its parent-death signal fired because the thread that forked it ended)."""
        for w in self.workers:
            try:
                pid, _ = os.waitpid(w.pid, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid:
                return False
        return True

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
                    worker_main(child_sock.detach(), out_w, self.status, forked=True, parent=self.owner_pid)
                    code = 0
                finally:
                    os._exit(code)
            popen = None
        else:
            fds = (child_sock.fileno(), out_w, self.status_fd)
            popen = subprocess.Popen(
                [sys.executable, "-c", "from disttrain_lab.worker import spawned_main; spawned_main()",
                 *map(str, fds), str(self.owner_pid), str(trace.SLOT_BYTES * self.size)],
                pass_fds=fds, stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w, close_fds=True)
            pid = popen.pid
        child_sock.close()
        os.close(out_w)
        os.set_blocking(out_r, False)
        return _Worker(rank, pid, Connection(parent_sock.detach()), out_r, popen)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        waiting = {w.conn.fileno(): w for w in self.workers}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(f"ranks {sorted(w.rank for w in waiting.values())} did not start "
                                  f"within {STARTUP_TIMEOUT:.0f} s")
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
    def run(self, payload: bytes, world_size: int, timeout: float, want_trace: bool, net=None,
            where: dict[str, str] | None = None):
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
                job = {"rank": w.rank, "world_size": world_size, "device": self.plan.device,
                       "group_backend": self.plan.group_backend,
                       "port": self.store.port, "prefix": f"{self.secret}/{self.calls}/", "payload": payload,
                       "trace": want_trace, "timeout": timeout, "t0": t0, "rng": rng, "network": net}
                w.conn.send_bytes(pickle.dumps(job))
            replies = self._collect(workers, t0 + timeout, timeout, where or {})
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

    def _collect(self, workers: list[_Worker], deadline_pc: float, timeout: float, where: dict[str, str]) -> dict:
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
                        reply = None      # raised below, not in here: the EOFError is not the student's news
                    if reply is None:
                        self._rank_died(w, workers)
                    if reply[0] == "error":
                        self._relay_all()
                        self.close()
                        if reply[1]["type"] == "TamperingError":
                            raise TamperingError(f"rank {w.rank}: {reply[1]['message']}")
                        info = {**reply[1], "frames": codemap.relocate(reply[1]["frames"], where)}
                        raise rank_error(w.rank, info, [o.rank for o in workers if o is not w])
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
            how = f"exited with code {code}" + (" (os._exit or sys.exit inside the rank?)" if code else
                                                  " before returning a value (os._exit(0) inside the rank?)")
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
        raise timeout_error(states, now, timeout)

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
    def _relay(self, w: _Worker) -> bool:
        """Show the complete lines a rank has written so far; False when nothing was read."""
        try:
            chunk = os.read(w.out_fd, 1 << 16)
        except (BlockingIOError, OSError):
            return False
        if not chunk:
            return False
        lines = (w.partial + chunk).split(b"\n")
        w.partial = lines.pop()
        self._show(w, lines)
        return True

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
        """Drain every rank's pipe, including a last line without a newline."""
        for w in self.workers:
            for _ in range(64):
                if not self._relay(w):
                    break
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
