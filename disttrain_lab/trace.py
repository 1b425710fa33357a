"""Record every torch.distributed call a rank makes, and the compute regions a lab marks.

Inside a launched rank every communication function in ``torch.distributed`` is wrapped
(both ``torch.distributed.X`` and ``torch.distributed.distributed_c10d.X``, so ``from
torch.distributed import send`` is seen too).  A wrapper does two things:

1. always: writes "what am I blocked in" into this rank's status slot, a few bytes of
   memory shared with the launcher, so a timeout can say ``rank 0: recv(src=1) for 30 s``;
2. with ``trace=True``: appends an :class:`Event` (op, peer, group, bytes, tag, start, end).

Nested calls (``all_gather_object`` calling ``all_gather``) record only the outermost
one that was wrapped; the ``*_object`` helpers are not wrapped, so their inner tensor
calls are what you see, with real byte counts.  What a call is (its kind, peer, group,
bytes and tag) is read from its arguments by ``disttrain_lab.callargs``; this module holds
the rank's recorder and the wrappers that fill it.

The records come back to the notebook as a :class:`Run`, which answers the questions the
labs grade: bytes sent per rank, calls per op, which collectives ran, and how many
communication rounds a point-to-point algorithm took.

What other modules of the kit use (all public; nothing here imports them back):

- the launcher and the worker start and stop a rank's recorder with
  :func:`begin_recording` / :func:`end_recording` and install the wrappers with :func:`install`;
- the emulated network (``disttrain_lab.emulation``) passes its wrappers and its cost hook to
  :func:`install` and reads a call's tensors with :data:`IN_ARGS` and :data:`OUT_ARGS` (their
  bytes with ``callargs.payload_bytes``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from . import matching
from .callargs import call_info, check_peer, payload_bytes

# what a run recorded (events.py) and the status slot (status.py) live beside this module;
# their names are kept here too, where the rest of the kit and the labs have always found them
from .events import (  # noqa: E402, F401
    COLLECTIVE_OPS,
    IN_ARGS,
    OUT_ARGS,
    P2P_OPS,
    SETUP_OPS,
    TRACED_OPS,
    Event,
    Run,
    Summary,
    ceil_log2,
    describe_call,
    format_bytes,
    to_events,
)
from .status import SLOT_BYTES, Blocked, read_calls, read_status, status_text, write_status  # noqa: E402, F401


# --------------------------------------------------------------------------------------
# Recording inside a rank
# --------------------------------------------------------------------------------------
class _Recorder:
    """Per-process state of the tracer (one rank per process)."""

    def __init__(self) -> None:
        self.rank = 0
        self.t0 = 0.0
        self.recording = False
        self.events: list[tuple] = []
        self.depth = 0
        self.requests = 0
        self.status_buf = None
        self.collectives = 0  # entered in this launch (the call log's n)
        self.per_group: dict[tuple | None, int] = {}  # of each group (its k)
        # an emulated network's hook (install(last_cost=...)): the model's seconds of the call
        # that just ended, stored in its event; None when no network is emulated
        self.last_cost: Callable[[], float | None] | None = None

    def begin(self, rank: int, t0: float, recording: bool, status_buf) -> None:
        self.rank, self.t0, self.recording, self.status_buf = rank, t0, recording, status_buf
        self.events = []
        self.depth = 0
        self.requests = 0
        self.collectives = 0
        self.per_group = {}
        if status_buf is not None:
            matching.clear(status_buf, rank)

    def end(self) -> list[tuple]:
        events, self.events, self.recording = self.events, [], False
        if self.status_buf is not None:
            write_status(self.status_buf, self.rank, None)
        return events

    def status(self, text: str | None) -> None:
        if self.status_buf is not None:
            write_status(self.status_buf, self.rank, text)

    def note_collective(self, op: str, group, bound: dict, root) -> None:
        """Note the collective this rank enters in its call log (the launcher compares the ranks')."""
        if self.status_buf is None:
            return
        self.collectives += 1
        # two groups of the same ranks are told apart by their names (the same in every rank)
        key = group if group is None else (group, getattr(bound.get("group"), "group_name", ""))
        k = self.per_group[key] = self.per_group.get(key, 0) + 1
        matching.note(self.status_buf, self.rank, self.collectives, k, key, op, bound, root)


_REC = _Recorder()
_ORIGINALS: dict[str, Any] = {}  # op name -> genuine torch function, filled by install()


def begin_recording(rank: int, t0: float, recording: bool, status_buf) -> None:
    """Start this process's recorder for one launch of ``rank`` (one rank per process).

    ``t0``: the launch's start (``perf_counter``); event times are seconds since then.
    ``recording``: append an event per call (``trace=True``); without it only the status
    slot is written.  ``status_buf``: the memory the launcher reads the slots from."""
    _REC.begin(rank, t0, recording, status_buf)


def end_recording() -> list[tuple]:
    """Stop recording; return the raw events (see :func:`to_events`) and clear the status slot."""
    return _REC.end()


def set_recording(on: bool) -> list[tuple]:
    """Switch event recording on or off in the middle of a launch (the status slot is
    written either way); return the events recorded so far, which are forgotten.
    ``disttrain-lab bench trace`` measures the wrappers with and without it."""
    events, _REC.events, _REC.recording = _REC.events, [], on
    return events


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Calls made inside are not recorded (the status slot is written as always): the kit's own
    messages, such as ``dl.profiled``'s clock pings, stay out of the student's ``Run``."""
    was = _REC.recording
    _REC.recording = False
    try:
        yield
    finally:
        _REC.recording = was


class TracedWork:
    """Stands in for the ``Work`` an async call returns, so its ``wait()`` is traced too."""

    def __init__(self, work, op: str, info: tuple) -> None:
        self._work, self._op, self._info = work, op, info

    def wait(self, *args, **kwargs):
        rec = _REC
        kind, peer, group, nbytes, tag, meta = self._info
        rec.status(status_text("wait:" + self._op, peer, tag, nbytes, group))
        start = time.perf_counter()
        try:
            with _profiled("dl:wait(" + self._op + ")"):
                return self._work.wait(*args, **kwargs)
        finally:
            end = time.perf_counter()
            rec.status(None)
            if rec.recording:
                rec.events.append(
                    (rec.rank, "wait", "wait", start - rec.t0, end - rec.t0, peer, group, nbytes, tag, self._op, meta)
                )

    def __getattr__(self, name):
        return getattr(self._work, name)


_GENUINE: dict[int, tuple] = {}  # id(wrapper) -> (wrapper, the torch function it traces)


def genuine_of(obj):
    """The torch function behind a tracing wrapper (``obj`` itself if it is none)."""
    entry = _GENUINE.get(id(obj))
    return entry[1] if entry is not None and entry[0] is obj else obj


def _wrap(op: str, fn, genuine=None):
    # fn is torch's function, or the network emulation around it (then genuine is torch's)
    genuine = fn if genuine is None else genuine
    params = inspect.signature(genuine).parameters
    names = list(params)
    defaults = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        rec = _REC
        if rec.depth:
            return fn(*args, **kwargs)
        bound = dict(defaults)
        bound.update(zip(names, args))
        bound.update(kwargs)
        info = call_info(op, bound, rec.recording)
        kind, peer, group, nbytes, tag, meta = info
        if kind == "p2p" and peer is not None:
            check_peer(op, peer, group)
        elif kind == "collective":
            rec.note_collective(op, group, bound, peer)
        rec.depth += 1
        rec.status(status_text(op, peer, tag, nbytes, group))
        start = time.perf_counter()
        try:
            with _profiled("dl:" + op):
                out = fn(*args, **kwargs)
        finally:
            end = time.perf_counter()
            rec.depth -= 1
            rec.status(None)
        if op in ("recv",) and peer is None and isinstance(out, int):
            peer = out  # recv from any source returns the sender
        if rec.recording:
            modelled = rec.last_cost() if rec.last_cost is not None else None
            if modelled is not None:
                meta["network_s"] = modelled
            rec.events.append((rec.rank, op, kind, start - rec.t0, end - rec.t0, peer, group, nbytes, tag, "", meta))
        if out is not None and hasattr(out, "wait") and not isinstance(out, TracedWork):
            rec.requests += 1
            meta["request"] = rec.requests  # the wait event carries the same id
            return TracedWork(out, op, (kind, peer, group, nbytes, tag, meta))
        return out

    _GENUINE[id(traced)] = (traced, genuine)
    traced.__signature__ = inspect.signature(genuine)  # help(dist.send) still shows torch's arguments
    del traced.__wrapped__  # no back door to the untraced function
    return traced


def install(emulate: Callable | None = None, last_cost: Callable[[], float | None] | None = None) -> None:
    """Wrap torch.distributed's communication functions in this process (idempotent).

    ``emulate(op, fn)``, if given, slows torch's ``fn`` down to an emulated network's time
    (``emulation.wrap``); the tracer wraps the result, so traced times include the wait.
    ``last_cost()``, given with it, returns the model's seconds of the call that just ended
    (or None); a traced event keeps it as ``meta["network_s"]``.  ``install()`` without
    them puts back the tracer's wrappers around torch's own functions."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _REC.last_cost = last_cost if emulate is not None else None
    for op in TRACED_OPS:
        current = getattr(c10d, op, None)
        if current is None:
            continue
        genuine = _ORIGINALS.setdefault(op, genuine_of(current))
        wrapped = _wrap(op, emulate(op, genuine) if emulate else genuine, genuine)
        setattr(c10d, op, wrapped)
        if hasattr(dist, op):
            setattr(dist, op, wrapped)
    _install_process_group_methods()


def uninstall() -> None:
    """Put the genuine functions back (used after an in-process run under torchrun)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for op, genuine in _ORIGINALS.items():
        setattr(c10d, op, genuine)
        if hasattr(dist, op):
            setattr(dist, op, genuine)
    for (cls, name), genuine in _METHOD_ORIGINALS.items():
        setattr(cls, name, genuine)


# ProcessGroup / Backend methods a rank can call directly (``group.allreduce([t], opts)``),
# bypassing torch.distributed's functions: each such call is recorded too, as the op it is
# (torch's own functions call these inside a traced call, where depth > 0 skips them).
_PG_METHODS = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "allgather": "all_gather",
    "allgather_coalesced": "all_gather_coalesced",
    "_allgather_base": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor",
    "all_gather_single": "all_gather_single",
    "gather": "gather",
    "scatter": "scatter",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "all_to_all_single": "all_to_all_single",
    "barrier": "barrier",
    "monitored_barrier": "monitored_barrier",
    "send": "send",
    "recv": "recv",
    "recv_anysource": "recv",
}
_METHOD_ORIGINALS: dict[tuple, Any] = {}


def _wrap_method(name: str, op: str, genuine):
    kind = "p2p" if op in P2P_OPS else "collective"

    def direct(self, *args, **kwargs):
        rec = _REC
        if rec.depth:
            return genuine(self, *args, **kwargs)
        rec.depth += 1
        start = time.perf_counter()
        try:
            out = genuine(self, *args, **kwargs)
        finally:
            end = time.perf_counter()
            rec.depth -= 1
        if rec.recording:
            peer = args[1] if kind == "p2p" and len(args) > 1 and isinstance(args[1], int) else None
            rec.events.append(
                (
                    rec.rank,
                    op,
                    kind,
                    start - rec.t0,
                    end - rec.t0,
                    peer,
                    None,
                    payload_bytes(args[0] if args else None),
                    None,
                    "",
                    {"called": f"ProcessGroup.{name}"},
                )
            )
        return out

    direct.__name__ = direct.__qualname__ = name
    return direct


def _install_process_group_methods() -> None:
    from torch._C import _distributed_c10d as c10d_ext

    classes = [
        getattr(c10d_ext, n)
        for n in dir(c10d_ext)
        if isinstance(getattr(c10d_ext, n), type)
        and n in ("ProcessGroup", "Backend", "ProcessGroupGloo", "ProcessGroupNCCL", "ProcessGroupMPI")
    ]
    for cls in classes:
        for name, op in _PG_METHODS.items():
            if name in vars(cls) and (cls, name) not in _METHOD_ORIGINALS:
                _METHOD_ORIGINALS[(cls, name)] = vars(cls)[name]
                setattr(cls, name, _wrap_method(name, op, vars(cls)[name]))


def _profiled(name: str):
    """``torch.profiler.record_function(name)`` while a profiler runs (``dl.profiled``), else nothing:
    the kit's calls, the emulated network's time in them, and ``dl.region`` blocks are slices of
    torch's trace (``dl:send``, ``dl:wait(irecv)``, a region's own name)."""
    profiler = sys.modules.get("torch.autograd.profiler")  # torch is loaded by then, or no profiler runs
    if profiler is not None and profiler._is_profiler_enabled:
        return profiler.record_function(name)
    return contextlib.nullcontext()


@contextlib.contextmanager
def region(name: str, **meta) -> Iterator[None]:
    """Mark a stretch of compute in the trace, e.g. ``with dl.region("F", microbatch=3):``.

    It costs nothing outside a traced launch.  Regions appear in ``Run.events`` with
    ``kind == "region"`` and in ``dl.viz.timeline`` as labelled boxes; under ``torch.profiler``
    (``dl.profiled``) they are also ``record_function`` ranges of the same name.
    """
    with _profiled(name), _recorded_region(name, meta):
        yield


@contextlib.contextmanager
def _recorded_region(name: str, meta: dict) -> Iterator[None]:
    rec = _REC
    if not rec.recording:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        end = time.perf_counter()
        rec.events.append(
            (rec.rank, "region", "region", start - rec.t0, end - rec.t0, None, None, 0, None, name, dict(meta))
        )
