"""The rank side of dl.launch: a worker process that runs jobs until its launcher goes.

A worker is forked from the notebook (or started as a fresh interpreter for NCCL), relays
its output through a pipe, dies with its parent (PR_SET_PDEATHSIG), and for each job:
joins a fresh process group, runs the student's function with torch.distributed traced,
and sends back the result or the exception.
"""

from __future__ import annotations

import faulthandler
import io
import os
import pickle
import signal
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import cloudpickle

from . import codemap, confine, emulation, integrity, pickling, trace
from .pauses import WAKE_SIGNAL

STARTUP_TIMEOUT = 180.0  # seconds: a fresh interpreter importing torch on a busy machine
STACK_SIGNAL = signal.SIGUSR1  # the launcher asks a stuck rank for its Python stack (faulthandler)


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


def spawned_main() -> None:
    import mmap

    conn_fd, out_fd, status_fd, parent, nbytes, stack_fd = map(int, sys.argv[1:7])
    status = mmap.mmap(status_fd, nbytes)
    worker_main(conn_fd, out_fd, status, forked=False, parent=parent, stack_fd=stack_fd)


_FORKED = False
_RETIRED_GROUPS: list = []
_MAX_RETIRED = 32


def worker_main(conn_fd: int, out_fd: int, status, forked: bool, parent: int, stack_fd: int | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the launcher, which stops us
    # (ignored but inside osmemory.pause: a watch that reads the ranks in another sleep ends neither it nor the rank)
    signal.signal(WAKE_SIGNAL, signal.SIG_IGN)
    _set_parent_death_signal(parent)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    if out_fd > 2:
        os.close(out_fd)
    # the kernel's sys.stdout talks to Jupyter through a thread that a fork does not copy
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, errors="backslashreplace")
    if stack_fd is not None:
        # asked (timeout), the stack goes to the launcher, also from inside C++; and so does it
        # when a fatal signal kills the rank (a C++ abort, a crash): the launcher names the line
        faulthandler.register(STACK_SIGNAL, file=stack_fd, all_threads=False)
        faulthandler.enable(file=stack_fd, all_threads=True)
    elif faulthandler.is_enabled():
        # inherited from the parent (pytest enables it on its own copy of the terminal): a
        # rank's crash report goes to the rank's relayed stderr, like everything it prints
        faulthandler.enable(file=sys.stderr)
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
        # Only when idle for a moment (between notebook cells), so a burst of launches never
        # waits for it; at most _MAX_RETIRED groups (their sockets and threads) pile up.
        while _RETIRED_GROUPS and (len(_RETIRED_GROUPS) > _MAX_RETIRED or not conn.poll(0.25)):
            _RETIRED_GROUPS.pop(0)
        try:
            job = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        reply = _run_job(job, status)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            data = pickling.dumps(reply)
        except Exception as exc:
            data = cloudpickle.dumps(
                (
                    "error",
                    _error_info(
                        TypeError(
                            f"the return value of rank {job['rank']} cannot be sent back to the notebook "
                            f"({type(exc).__name__}: {exc}); return tensors, numbers, lists or dicts"
                        )
                    ),
                )
            )
        conn.send_bytes(data)


def _run_job(job: dict, status) -> tuple:
    import torch
    import torch.distributed as dist

    rank, world_size = job["rank"], job["world_size"]
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        DISTTRAIN_LAB_RANK_DEVICE=job["device"],
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job["port"]),
    )
    if not _FORKED:  # a fresh interpreter may use several threads; share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    pg_timeout = timedelta(seconds=job["timeout"] + 30)
    trace.write_status(status, rank, trace.status_text("init_process_group", None, 0, 0, None))
    try:
        _retire_group()
        store = _store_client(job["port"])
        if job.get("confine"):  # a graded run's rank (pool.confined): before gloo's threads start
            confine.unmap_shared(status)  # (shared with the other ranks, by the kernel: all but its own slot)
            done = confine.confine(writable=job.get("writable"))
            if done.failed:
                raise RuntimeError(f"rank {rank} could not be confined for a graded run: {done.failed}")
        if job["device"] == "cuda":
            # rank k takes the k-th GPU visible to the server (CUDA_VISIBLE_DEVICES is
            # inherited); a device="cpu" launch never gets here, so it opens no CUDA context
            torch.cuda.set_device(rank)
        dist.init_process_group(
            job["group_backend"],
            store=dist.PrefixStore(job["prefix"], store),
            rank=rank,
            world_size=world_size,
            timeout=pg_timeout,
        )
    except Exception as exc:
        return ("error", _error_info(exc))
    trace.write_status(status, rank, None)
    _set_rng_states(job["rng"])
    trace.begin_recording(rank, job["t0"], job["trace"], status)
    try:
        emulation.begin(job["network"], world_size)  # None: nothing is installed
        _forget_classes()
        fn, args, kwargs = cloudpickle.loads(job["payload"])
        result = fn(*args, **kwargs)
        integrity.verify()  # did the function replace torch.distributed while it ran?
        reply = ("ok", result, None)
    except BaseException as exc:  # noqa: BLE001  (SystemExit too: report it, don't die)
        reply = ("error", _error_info(exc))
    finally:
        emulation.end(job["network"])
        raw = trace.end_recording()
    if reply[0] == "ok":
        # The group stays up until the next launch: a rank that returns early must not
        # break a peer still inside a collective (that peer should time out and say so).
        reply = ("ok", reply[1], raw)
    return reply


def _forget_classes() -> None:
    """Forget every class cloudpickle rebuilt here (or this fork inherited from the kernel),
    so that the launch about to be unpickled builds each notebook class afresh from the
    kernel's class as it is now.  cloudpickle keeps a class it has seen under an id and, when
    the same class arrives again, reuses its old copy and sets the attributes it was sent:
    bases stay those of the first launch (``B.__bases__ = (A2,)`` in the kernel never reaches
    a warm rank), and an attribute deleted in the kernel stays.  Within one launch the
    payload is one pickle, so a class still has one identity on a rank."""
    pickler = cloudpickle.cloudpickle  # the module that keeps the tables
    lock = getattr(pickler, "_DYNAMIC_CLASS_TRACKER_LOCK", None)
    names = ("_DYNAMIC_CLASS_TRACKER_BY_ID", "_DYNAMIC_CLASS_TRACKER_BY_CLASS")
    tracked = [getattr(pickler, name, None) for name in names]
    if lock is None or None in tracked:  # another cloudpickle: tests/kit/test_launcher.py says whether it is stale
        return
    with lock:
        for table in tracked:
            table.clear()


def _set_rng_states(states: dict) -> None:
    import random

    import torch

    torch.random.set_rng_state(torch.frombuffer(bytearray(states["torch"]), dtype=torch.uint8))
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

        _STORE = (port, dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT)))
    return _STORE[1]


_STORE = None


def _retire_group() -> None:
    """Destroy the previous launch's process group, keeping its C++ object for later."""
    import torch.distributed as dist

    if dist.is_initialized():
        _RETIRED_GROUPS.append(dist.group.WORLD)  # its destructor takes ~40 ms: run it when idle
        dist.destroy_process_group()


def _error_info(exc: BaseException) -> dict:
    frames = codemap.frames_of(exc.__traceback__)  # with each code's key: the parent knows its cell
    message = str(exc)
    if isinstance(exc, SystemExit):
        message = f"sys.exit({exc.code!r}) was called inside the rank"
    # the qualified name of the innermost function of the student's ("Zero2Optimizer.__init__"),
    # which a traceback's frames do not carry: a stub's message names the class too
    codes = [frame.f_code for frame, _ in traceback.walk_tb(exc.__traceback__)]
    code = next((c for c in reversed(codes) if not codemap.is_library(c.co_filename)), None)
    qualname = getattr(code, "co_qualname", code.co_name) if code is not None else None
    return {"type": type(exc).__name__, "message": message, "frames": frames, "qualname": qualname}
