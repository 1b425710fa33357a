"""The student's end of a graded run: carry out a :class:`~disttrain_lab.protocol.Request` in the
notebook's own kernel and describe the run as a :class:`~disttrain_lab.protocol.Record`.

``run(request)`` launches the notebook's function (or the test's driver, defined in a copy of the
notebook's names) on the ranks with ``dl.launch`` and returns what happened as data.  The same
function serves the student's own self-checks (``dl.exercise.run`` in the notebook) and the
grader's requests, which arrive as a Jupyter comm on ``protocol.COMM_TARGET``: importing this
module in an IPython kernel registers that target (:func:`register`); each comm carries one
request as its buffer and is answered with one message whose buffer is the record's bytes.
A comm whose data asks to ``prepare`` forks the ranks first; the request after it may not fork
(``pool.prepared_only``), and each rank is sent its own inputs alone (``launcher.PerRank``): no
rank of a graded run holds another rank's inputs.  A graded run's ranks confine themselves once set up
(``pool.confined``, ``confine.py``): no file written, no signal or abstract unix socket outside the rank.

Under grading the student's functions that hung in an earlier test are not run again
(``hangs.py``): the grader's list (``Request.timed_out``) and this kernel's own.
"""

from __future__ import annotations

import linecache
import os
import sys
from contextlib import nullcontext
from dataclasses import replace

import torch

from . import gate, osmemory, pool
from .devices import plan, resolve_device
from .hangs import SkippedAfterHang, hung_before, stub_only, stubbed
from .launcher import CollectiveMismatch, LaunchError, LaunchTimeout, PerRank, RankError, launch
from .network import Network
from .protocol import COMM_TARGET, PREPARE, WRITABLE, Driver, ProtocolError, Record, Request
from .trace import region

__all__ = ["register", "run", "as_data"]


class _NotRunnable(Exception):
    """The request names no function of the notebook (or not a function)."""


def _call(fn, mine: tuple, gate_port: int | None = None):
    """What every rank runs: the student's function on this rank's inputs (sent to it alone),
    marked; its result and the inputs as the call left them (an in-place exercise changes them).
    ``gate_port``: the grader's gate for this run (``gate.PORT``, which a test's driver connects to)."""
    gate.PORT[0] = gate_port
    try:
        with region("student"):
            result = fn(*mine)
    finally:
        gate.PORT[0] = None
    return as_data(result), mine


def as_data(value, depth: int = 0):
    """``value`` with numpy's numbers as Python's and numpy's arrays as tensors, inside lists, tuples
    and dicts too: a result of ``[np.float64(0.5), ...]`` is data a test reads (numpy itself is not
    imported: its values are known by their type's module).  Anything else is left as it is."""
    if depth > 16:
        return value
    if type(value).__module__ == "numpy":
        if hasattr(value, "shape") and getattr(value, "ndim", 0) > 0:  # an array
            return torch.as_tensor(value.copy())
        return value.item() if hasattr(value, "item") else value  # a scalar (np.float64, np.int64, a 0-d array)
    if type(value) in (list, tuple):  # (exactly: a torch.Size or a named tuple stays what it is)
        converted = [as_data(v, depth + 1) for v in value]
        return converted if type(value) is list else tuple(converted)
    if type(value) is dict:
        return {as_data(k, depth + 1): as_data(v, depth + 1) for k, v in value.items()}
    return value


def _student_function(target: str | Driver):
    """The notebook's function ``target``, or the driver ``target`` defined among the
    notebook's names (so that it calls the notebook's code)."""
    namespace = vars(sys.modules["__main__"])
    if isinstance(target, Driver):
        # defined in a namespace of its own that starts as the notebook's (so it calls the
        # notebook's code), leaving the notebook's own definition of it alone; its source is
        # kept in linecache, so tracebacks quote it and inspect reads it
        filename = f"<test driver {target.name}>"
        linecache.cache[filename] = (len(target.source), None, target.source.splitlines(True), filename)
        namespace = dict(namespace)
        exec(compile(target.source, filename, "exec"), namespace)  # noqa: S102  (the test's own code)
        target = target.name
    fn = namespace.get(target)
    if fn is None:
        raise _NotRunnable(f"there is no function named {target!r} in the notebook: run the cell that defines it")
    if not callable(fn):
        raise _NotRunnable(f"{target} should be a function, but in the notebook it is {type(fn).__name__} {fn!r:.60}")
    return fn


def _network(fields: dict | None) -> Network | None:
    if fields is None:
        return None
    inter = fields.get("inter")
    return Network(**{**fields, "inter": Network(**inter) if inter else None})


def run(request: Request) -> Record:
    """Launch the notebook's function (or the driver) that ``request`` names and describe the run."""
    # under grading: the notebook's functions that timed out in an earlier test are not run again
    # (the grader's list; and those that hung in this kernel, of the student's own functions)
    # (before a driver is defined in its copy of the notebook's names: it calls the stand-ins)
    only = request.student_functions
    try:
        with stub_only(only) if only is not None else nullcontext():
            with stubbed({**hung_before(), **request.timed_out}):
                return _run(request)
    finally:
        if request.memory:  # (prepare froze the kernel's collector for the ranks' sake)
            osmemory.unsettle()


def _run(request: Request) -> Record:
    name, timeout = request.name, request.timeout
    writable_folder(request.writable)  # (the student's own kernel: its ranks are not confined)
    within = f"{timeout:g} s" + (f" ({request.why})" if request.why else "")
    try:
        fn = _student_function(request.target)
        result = launch(
            _call,
            request.world_size,
            fn,
            PerRank(request.inputs),
            request.gate,
            trace=True,
            timeout=timeout,
            device=request.device,
            network=_network(request.network),
        )
        pids = pool.worker_pids()[: request.world_size]
    except _NotRunnable as exc:
        return Record.failed("ExerciseError", str(exc))
    except pool.NotPrepared as exc:
        return Record.failed("NotPrepared", str(exc))
    except CollectiveMismatch as exc:  # seen at once: not a hang (nothing to remember, nothing to skip)
        return Record.failed("ExerciseError", f"{name} failed on the ranks:\n{exc}")
    except LaunchTimeout as exc:
        # the functions the stuck ranks were in, innermost first, those of ranks stuck outside torch's
        # calls (a loop) before those waiting in one: the grader's fail-fast keys on them
        blocked = exc.blocked
        ranks = sorted(exc.stacks, key=lambda r: not str(blocked.get(r, "")).startswith("running Python"))
        running = list(dict.fromkeys(f for r in ranks for f, _ in reversed(exc.stacks[r])))
        return Record.failed(
            "ExerciseTimeout", f"{name} did not finish within {within} on every rank:\n{exc}", running=running
        )
    except RankError as exc:
        if exc.exc_type == SkippedAfterHang.__name__:  # a function that hung before, stopped at once
            return Record.failed("ExerciseTimeout", f"{name} was stopped at once: {exc.exc_message}", skipped=True)
        return Record.failed(
            "ExerciseError", f"{name} failed on a rank:\n{exc}", exc_type=exc.exc_type, exc_message=exc.exc_message
        )
    except LaunchError as exc:
        return Record.failed("ExerciseError", f"{name} failed on a rank:\n{exc}")
    # the student's own regions (dl.region) stay, named, without their meta (which need not be data);
    # the "student" region that marks the call itself is the runner's
    events = tuple(
        e if e.kind != "region" else _without_meta(e)
        for e in result.events
        if not (e.kind == "region" and e.name == "student")
    )
    return Record(
        results=[r for r, _ in result.results],
        inputs_after=[tuple(after) for _, after in result.results],
        events=events,
        pids=tuple(pids),
        backend=result.backend,
    )


def _without_meta(e):
    return replace(e, name=e.name[:200], meta={})


# --------------------------------------------------------------------------------------
# The grader's requests, over a comm
# --------------------------------------------------------------------------------------
def _answer(comm, msg) -> None:
    """One comm from the grader: its buffer is a request; the reply's buffer the record."""
    data = (msg.get("content") or {}).get("data") or {}
    if PREPARE in data:
        comm.send(prepare(data[PREPARE], confined=True))  # (the grader's: its request's ranks confine themselves)
        comm.close()
        return
    try:
        buffers = msg.get("buffers") or []
        if len(buffers) != 1:
            raise ProtocolError(f"a request comes as one buffer, {len(buffers)} came")
        # (its ranks were forked before it arrived; they confine themselves before running anything of it)
        request = Request.from_bytes(bytes(buffers[0]))
        with pool.prepared_only(), pool.confined(), pool.writable(writable_folder(request.writable)):
            data = run(request).to_bytes()
    except ProtocolError as exc:
        data = Record.failed("ExerciseError", f"the request could not be read: {exc}").to_bytes()
    except BaseException as exc:  # noqa: BLE001  (an interrupt, or a bug here: the grader must hear back)
        data = Record.failed("ExerciseError", f"the run stopped: {type(exc).__name__}: {exc}"[:2000]).to_bytes()
    comm.send({"record": len(data)}, buffers=[data])
    comm.close()


def writable_folder(name: str | None) -> str | None:
    """The folder a request's ranks may write in: ``name`` (checked by the protocol: one plain name) in
    this kernel's working directory, made if missing; None for none."""
    if name is None:
        return None
    path = os.path.abspath(name)
    os.makedirs(path, exist_ok=True)
    return path


def prepare(fields, confined: bool = False) -> dict:
    """Fork (or keep; ``fields["fresh"]``: fork anew) the warm ranks for a run of ``fields["world_size"]``
    ranks on ``fields["device"]`` (``confined``: ranks that confine themselves, for the grader's request);
    the answer names their process ids."""
    try:
        world_size, device, fresh = fields["world_size"], fields.get("device"), fields.get("fresh", False)
        if type(world_size) is not int or not (device is None or isinstance(device, str)) or type(fresh) is not bool:
            raise ValueError(f"prepare needs an int world_size, a device (str or None), a bool fresh: {fields!r:.100}")
        writable = fields.get("writable")
        if writable is not None and not (isinstance(writable, str) and WRITABLE.fullmatch(writable)):
            raise ValueError(f"prepare's writable must be None or a plain folder name: {writable!r:.80}")
        chosen = plan(world_size, resolve_device(device, None))
        pids = pool.prepare(world_size, chosen, fresh=fresh, confined=confined, writable=writable_folder(writable))
    except Exception as exc:  # noqa: BLE001  (the grader must hear back; its request then fails closed)
        return {"prepared": False, "why": f"{type(exc).__name__}: {exc}"[:2000]}
    return {"prepared": True, "pids": pids}


def register() -> bool:
    """In an IPython kernel (the notebook's), serve the grader's requests on ``COMM_TARGET``;
    elsewhere (a rank, a script) nothing.  Whether the target is registered."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    manager = getattr(getattr(shell, "kernel", None), "comm_manager", None)
    if manager is None:
        return False
    manager.register_target(COMM_TARGET, _answer)
    return True


register()
