"""Run a function on N ranks from a notebook cell (or a script), and never hang.

    >>> def hello():
    ...     import torch.distributed as dist
    ...     print("hi from", dist.get_rank())
    ...     return dist.get_rank() * 10
    >>> dl.launch(hello, world_size=4)          # prints "[rank k] hi from k"
    [0, 10, 20, 30]

How it works (see docs/architecture.md, "Launching ranks from a notebook"); this module
holds ``launch`` (checking its arguments) and the torchrun path, ``devices`` the device
policy, ``pool`` the warm ranks, ``worker`` a rank's side.  It knows nothing of grading:
what composes around every launch (under autograding, ``hangs.py``: what is left of the
cell's limit, and functions that hung before) registers itself with :func:`add_hook`:

- One policy (see :func:`plan`): ``device="cpu"`` (the default) runs gloo on the CPU and
  never touches a GPU; ``device="cuda"`` gives rank k the k-th visible GPU and NCCL.
- Ranks are worker processes kept warm between calls.  On the CPU they are forked
  from the notebook's kernel (0.1 s for 4 ranks; children run with one OpenMP thread,
  which avoids the OpenMP-after-fork hang).  For GPUs they are fresh interpreters
  (``python -c``), because a forked child cannot use CUDA once the parent touched it.
- The function travels by value with cloudpickle, so functions defined in a notebook
  cell work; return values (tensors included) come back the same way.  An argument wrapped in
  :class:`PerRank` (one value per rank) reaches rank k as its k-th value alone: no rank is sent
  another's.
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
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from types import ModuleType

import cloudpickle
import torch
import torch.distributed as dist

# `trace` and `network` are also launch's keywords: the modules go by other names here
from . import codemap, emulation, integrity, pool
from . import trace as tracer
from .devices import MAX_WORLD_SIZE, Plan, backend_name, device, plan, resolve_device
from .integrity import TamperingError
from .network import Network
from .pool import shutdown
from .reports import CollectiveMismatch, LaunchError, LaunchTimeout, RankDied, RankError

DEFAULT_TIMEOUT = 60.0  # seconds a launch may take before it is stopped

__all__ = [
    "launch",
    "device",
    "shutdown",
    "plan",
    "Plan",
    "LaunchError",
    "RankError",
    "RankDied",
    "LaunchTimeout",
    "CollectiveMismatch",
    "TamperingError",
    "PerRank",
]


class PerRank(tuple):
    """One value per rank, as a positional argument of :func:`launch`: rank k is called with
    the k-th value in its place, and only that value is sent to its process (the others never
    reach it).  ``launch(f, 2, PerRank([a, b]))`` runs ``f(a)`` on rank 0 and ``f(b)`` on rank 1."""

    __slots__ = ()


def _own_args(args: tuple, rank: int) -> tuple:
    return tuple(a[rank] if isinstance(a, PerRank) else a for a in args)


# --------------------------------------------------------------------------------------
# What composes around a launch
# --------------------------------------------------------------------------------------
@dataclass
class Pending:
    """A launch about to start, as a hook sees it: a hook may replace the function, its
    arguments or the timeout (saying why, in ``timeout_why``), before they are sent to the ranks."""

    fn: Callable
    args: tuple
    kwargs: dict
    timeout: float
    timeout_why: str | None = None
    deadline: float | None = None  # (time.monotonic) when set, the ranks' start counts against the timeout


Hook = Callable[[Pending], AbstractContextManager]
_HOOKS: list[Hook] = []


def add_hook(hook: Hook) -> None:
    """Run every later launch inside ``hook(pending)``, a context manager entered before the
    function is sent to the ranks and left when the launch ends (an exception the launch raises
    passes through it; it may raise another instead).  None are set unless something installs one
    (under autograding, ``hangs.py``)."""
    if hook not in _HOOKS:
        _HOOKS.append(hook)


# --------------------------------------------------------------------------------------
# Checking the arguments
# --------------------------------------------------------------------------------------
def _validate(fn, world_size, timeout, network=None) -> None:
    if not callable(fn):
        raise ValueError(
            f"launch needs a function to run on every rank, got {type(fn).__name__} "
            f"{fn!r}; pass the function itself: dl.launch(my_fn, 4), not dl.launch(my_fn(), 4)"
        )
    limit = MAX_WORLD_SIZE
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= limit:
        raise ValueError(f"world_size must be an int from 1 to {limit}, got {world_size!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if network is not None and not isinstance(network, Network):
        raise ValueError(
            f"network must be a dl.Network (e.g. dl.Network.preset('1 Gbit Ethernet')) or None "
            f"(the real links), got {type(network).__name__} {network!r}"
        )


def _pickled(fn, args: tuple, kwargs: dict) -> tuple[bytes, dict[str, str]]:
    """``codemap.dumps((fn, args, kwargs))``; what cannot be pickled is named, with the rule."""
    __tracebackhide__ = True
    try:
        return codemap.dumps((fn, args, kwargs))
    except Exception as exc:  # cloudpickle raises TypeError, PicklingError, AttributeError, ...
        error = exc

    def fails(obj) -> bool:
        try:
            cloudpickle.dumps(obj)
        except Exception:
            return True
        return False

    name = getattr(fn, "__name__", type(fn).__name__)
    culprits = [f"argument {i + 1} ({type(a).__name__})" for i, a in enumerate(args) if fails(a)]
    culprits += [f"the argument {k}= ({type(v).__name__})" for k, v in kwargs.items() if fails(v)]
    code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    if not culprits and code is not None:
        used = [n for n in code.co_names if n in scope and not isinstance(scope[n], ModuleType)]
        culprits = [f"the variable {n} ({type(scope[n]).__name__}) that {name} uses" for n in used if fails(scope[n])]
    what = " and ".join(culprits) if culprits else f"the function {name} (or something it uses)"
    raise TypeError(
        f"dl.launch cannot send {what} to the ranks: {type(error).__name__}: {error}.  dl.launch sends the "
        "function and its arguments to every rank's process by pickling them (cloudpickle); locks, open "
        "files, sockets, threads and generators cannot be pickled.  Pass the data they hold, or create "
        "them inside the function."
    ) from None


# --------------------------------------------------------------------------------------
# The public entry point
# --------------------------------------------------------------------------------------
def launch(
    fn: Callable,
    world_size: int,
    *args,
    device: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    trace: bool = False,
    backend: str | None = None,
    network: Network | None = None,
    **kwargs,
):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result.

    Every rank starts with ``torch.distributed`` initialised (``dist.get_rank()``,
    ``dist.send(...)`` just work).  Returns ``[result of rank 0, result of rank 1, ...]``,
    or a :class:`disttrain_lab.Run` with the results and every rank's communication
    events when ``trace=True``.

    ``device``: ``"cpu"`` (the default, also when None) runs the ranks on the CPU with gloo and never touches a
    GPU; ``"cuda"`` gives rank k the k-th visible GPU and NCCL for CUDA tensors (CPU tensors
    still go over gloo).  Inside a rank, ``dl.device()`` is the device to put tensors on.
    See :func:`disttrain_lab.devices.plan` for the whole policy.  ``backend="gloo"/"nccl"`` is the deprecated
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
    for i, a in enumerate(args):
        if isinstance(a, PerRank) and len(a) != world_size:
            raise ValueError(
                f"argument {i + 1} is a PerRank of {len(a)} values; a launch of {world_size} ranks needs one per rank"
            )
    device = resolve_device(device, backend)
    if _under_torchrun():
        return _launch_in_process(fn, world_size, args, kwargs, trace, device, timeout, network)
    integrity.verify()
    chosen = plan(world_size, device)
    pending = Pending(fn, args, kwargs, timeout)
    with ExitStack() as hooks:
        for hook in tuple(_HOOKS):
            hooks.enter_context(hook(pending))
        if any(isinstance(a, PerRank) for a in pending.args):  # each rank's job holds its own values alone
            pickled = [_pickled(pending.fn, _own_args(pending.args, r), pending.kwargs) for r in range(world_size)]
            payload, where = [p for p, _ in pickled], {k: v for _, w in pickled for k, v in w.items()}
        else:
            payload, where = _pickled(pending.fn, pending.args, pending.kwargs)  # where: each code's real cell
        try:
            results, events, wall = pool.run(
                payload, world_size, chosen, pending.timeout, trace, network, where, pending.deadline
            )
        except LaunchTimeout as exc:  # (not the cell's interrupt: a slow but right function in a heavy cell)
            if pending.timeout_why is None or isinstance(exc, CollectiveMismatch):
                raise
            raise LaunchTimeout(
                f"{exc}\n(the timeout of {pending.timeout:g} s: {pending.timeout_why})", exc.blocked, exc.stacks
            ) from None
    if trace:
        return tracer.Run(
            results=results,
            events=events,
            world_size=world_size,
            backend=chosen.backend,
            wall_time=wall,
            network=network,
        )
    return results


# --------------------------------------------------------------------------------------
# Under torchrun: run in this process
# --------------------------------------------------------------------------------------
def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _in_process_timeout(rank: int, timeout: float, status) -> None:
    blocked = tracer.read_status(status, rank)
    what = (
        f"{blocked.text} for {time.perf_counter() - blocked.since:.1f} s"
        if blocked
        else "running Python code (not in a torch.distributed call)"
    )
    sys.stderr.write(
        f"[disttrain-lab] rank {rank}: not finished within the timeout of {timeout:g} s; "
        f"it was in {what}. Stopping this rank (torchrun stops the others).\n"
    )
    sys.stderr.flush()
    os._exit(124)


def _destroy_own_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _launch_in_process(fn, world_size, args, kwargs, want_trace, device, timeout, network=None):
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise ValueError(
            f"launch(world_size={world_size}) runs under torchrun with WORLD_SIZE={env_world}: "
            f"under torchrun every launch uses all of torchrun's ranks, so a script must use one "
            f"world size; start torchrun with --nproc-per-node {world_size} (times nodes), or "
            f"launch with world_size={env_world}"
        )
    # the same policy as in a notebook; only this node's ranks need a GPU each
    chosen = plan(world_size, device, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if not dist.is_initialized():
        if chosen.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(chosen.group_backend)
        # we made the group, so we end it: left to interpreter shutdown, gloo's threads are
        # torn down mid-call and the process can die of SIGABRT ("terminate called without
        # an active exception") after the script succeeded
        atexit.register(_destroy_own_group)
    os.environ["DISTTRAIN_LAB_RANK_DEVICE"] = chosen.device
    integrity.verify()
    rank = dist.get_rank()
    args = _own_args(args, rank)
    dist.barrier()
    t0 = time.perf_counter()
    tracer.install()
    status = bytearray(tracer.SLOT_BYTES * (rank + 1))
    tracer.begin_recording(rank, t0, want_trace, status)
    # no launcher watches this process: a watchdog turns a hang into an error that
    # torchrun sees (it then stops the other ranks)
    watchdog = threading.Timer(timeout, _in_process_timeout, args=(rank, timeout, status))
    watchdog.daemon = True
    watchdog.start()
    emulation.begin(network, world_size, shared=False)  # ranks may be on several hosts
    try:
        result = fn(*args, **kwargs)
    finally:
        watchdog.cancel()
        emulation.end(network)
        raw = tracer.end_recording()
        tracer.uninstall()
    wall = time.perf_counter() - t0
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (result, raw))
    results = [r for r, _ in gathered]
    if not want_trace:
        return results
    events = sorted((e for _, evs in gathered for e in tracer.to_events(evs)), key=lambda e: e.start)
    return tracer.Run(
        results=results,
        events=events,
        world_size=world_size,
        backend=backend_name(),
        wall_time=wall,
        network=network,
    )
