"""Running a student's exercise for a test, the same way in a notebook and under grading.

A graded test asks for the student's function by name, with the inputs of every rank, and
gets back only data::

    run = dl.exercise.run("ping_pong", 2, [(data, 3), (torch.zeros(4), 3)], timeout=30)
    run.results    # each rank's return value: tensors, numbers, strings, None, lists, tuples, dicts
    run.traffic    # bytes each rank sent each other, counted by the operating system (wire.Traffic)
    run.trace      # the ranks' own account of the call (a dl.Run): what they say they did
    run.inputs_after   # each rank's arguments as the call left them (in-place exercises)

In a notebook (self-checks, and the graded cells a student runs) ``run`` launches the function
of that name defined in the notebook, with ``dl.launch``.  Under grading the test runs in a
*grader kernel* that holds no student code: ``use_runner`` there makes ``run`` ask the
student's kernel to do the same (``serve``), count the bytes from outside, and read back only
data (``torch.load(..., weights_only=True)``), checked for type and size.  Either way the
record crosses the same serialisation, so what passes in the notebook passes when graded.
See docs/architecture.md, "Where a grade is decided".
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import linecache
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from . import pool, wire
from .hangs import SkippedAfterHang, hung_before, stub_only, stubbed
from .launcher import CollectiveMismatch, LaunchError, LaunchTimeout, RankError, launch
from .network import Network
from .trace import Run, region, to_events

__all__ = ["ExerciseRun", "ExerciseError", "ExerciseTimeout", "run", "serve", "use_runner", "MAX_RECORD_BYTES"]

MAX_RECORD_BYTES = 64 * 2**20  # what one run may send back
MAX_MESSAGE_CHARS = 20_000
EVENT_FIELDS = 11  # trace.to_events' tuple


class ExerciseError(AssertionError):
    """The student's function failed on the ranks (the message says where), or returned
    something that is not data.  ``exc_type`` and ``exc_message``: what a rank raised, when
    one did (e.g. "ValueError"), else None."""

    def __init__(self, message: str, exc_type: str | None = None, exc_message: str | None = None):
        super().__init__(message)
        self.exc_type, self.exc_message = exc_type, exc_message


class ExerciseTimeout(ExerciseError):
    """The student's function did not finish in time on every rank (a deadlock?)."""


@dataclass
class ExerciseRun:
    """What one run of a student's function gave back, as data (see the module docstring)."""

    name: str
    world_size: int
    results: list
    traffic: wire.Traffic
    trace: Run
    inputs_after: list  # rank r's arguments as the call left them (in-place work shows here)
    backend: str = "gloo"  # the process group's backend the ranks ran on
    timeline: wire.Timeline = dataclasses.field(default_factory=lambda: wire.Timeline.unobserved("not asked for"))

    def __repr__(self) -> str:
        return f"ExerciseRun({self.name!r} on {self.world_size} ranks; {self.traffic.describe()})"


Runner = Callable[[str | dict, int, list, dict], dict]


def _run_here(target: str | dict, world_size: int, inputs: list, options: dict) -> dict:
    """The record of one run in this kernel (the notebook's own), as the grader would get it."""
    return loads(dumps(record(target, world_size, inputs, options)))


_RUNNER: Runner = _run_here


def use_runner(runner: Runner | None) -> None:
    """Make ``run`` use ``runner(target, world_size, inputs, options) -> record`` (the grader's;
    options: timeout, device, network as plain data);
    None: run in this kernel again.  ``target``: a function's name, or a driver
    ``{"name": ..., "source": ...}`` (see ``run``)."""
    global _RUNNER
    _RUNNER = runner or _run_here


def run(
    target: str | Callable | dict,
    world_size: int,
    inputs: Sequence | None = None,
    *,
    timeout: float = 30.0,
    device: str | None = None,
    network: Network | None = None,
    timeline: bool = False,
) -> ExerciseRun:
    """Run ``target`` on ``world_size`` ranks; rank r calls it with ``inputs[r]`` (a tuple of
    arguments; one tuple for all ranks when ``inputs`` is a tuple).

    ``target``: the name of a function of the notebook (``"ping_pong"``), or a *driver*: a
    function defined at the top of a test cell that calls the notebook's code by name
    (``def _train(steps): opt = Zero1Optimizer(...); ...``).  A driver runs where the student's
    code runs, next to it: under grading its source is sent to the student's kernel and
    defined there, so what it returns is data like any result, and its references belong in
    the test, outside it.

    ``device`` and ``network`` are ``dl.launch``'s.  ``timeline``: ``run.timeline`` holds when
    each segment of data crossed between which ranks, captured from the wire under grading
    (``wire.Timeline``; in the student's own kernel, the ranks' traced sends).

    Raises ExerciseError when a rank raised or returned something that is not data, and
    ExerciseTimeout when the ranks did not finish within ``timeout`` seconds."""
    if callable(target):
        name, target = target.__name__, _driver(target)
    elif isinstance(target, dict) and str(target.get("name", "")).isidentifier():
        name = target["name"]  # a driver already as data: {"name": ..., "source": ...}
    elif isinstance(target, str) and target.isidentifier():
        name = target
    else:
        raise ValueError(f"target must be the name of a function in the notebook, or a function, got {target!r}")
    if inputs is None:
        inputs = ()
    per_rank = [tuple(inputs)] * world_size if isinstance(inputs, tuple) else [tuple(x) for x in inputs]
    if len(per_rank) != world_size:
        raise ValueError(f"inputs must hold one tuple of arguments per rank: {world_size} ranks, {len(per_rank)} given")
    options = {"timeout": float(timeout), "device": device, "network": _network_fields(network), "timeline": timeline}
    got = _RUNNER(target, world_size, per_rank, options)
    return from_record(name, world_size, got)


def _network_fields(network: Network | None) -> dict | None:
    """A dl.Network as plain data (it crosses to the student's kernel with the request)."""
    if network is None:
        return None
    return dataclasses.asdict(network)


def _network(fields: dict | None) -> Network | None:
    if fields is None:
        return None
    inter = fields.get("inter")
    return Network(**{**fields, "inter": Network(**inter) if inter else None})


def _driver(fn: Callable) -> dict:
    """A test's driver function as what crosses to the student's kernel: its name and source."""
    if fn.__name__ == "<lambda>" or "<locals>" in fn.__qualname__:
        raise ValueError(f"a driver must be a function defined at the top level of a cell, not {fn.__qualname__}")
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise ValueError(f"the source of {fn.__name__} cannot be read ({exc}): define it in a cell") from None
    return {"name": fn.__name__, "source": source}


# --------------------------------------------------------------------------------------
# The student's side: one run, and the grader's requests
# --------------------------------------------------------------------------------------
def _call(fn, inputs: list):
    """What every rank runs: the student's function on this rank's inputs, marked; its result
    and the inputs as the call left them (an in-place exercise changes them)."""
    import torch.distributed as dist

    mine = inputs[dist.get_rank()]
    with region("student"):
        result = fn(*mine)
    return result, mine


def _student_function(target: str | dict):
    """The notebook's function ``target``, or the driver ``target`` defined among the
    notebook's names (so that it calls the notebook's code)."""
    namespace = vars(sys.modules["__main__"])
    if isinstance(target, dict):
        # defined in a namespace of its own that starts as the notebook's (so it calls the
        # notebook's code), leaving the notebook's own definition of it alone; its source is
        # kept in linecache, so tracebacks quote it and inspect reads it
        name, source = str(target.get("name")), str(target.get("source"))
        filename = f"<test driver {name}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace = dict(namespace)
        exec(compile(source, filename, "exec"), namespace)  # noqa: S102  (the grader's own code)
        target = name
    name = target
    fn = namespace.get(name)
    if fn is None:
        raise ExerciseError(f"there is no function named {name!r} in the notebook: run the cell that defines it")
    if not callable(fn):
        raise ExerciseError(f"{name} should be a function, but in the notebook it is {type(fn).__name__} {fn!r:.60}")
    return fn


def _error(kind: str, message: str, exc_type: str | None = None, exc_message: str | None = None) -> dict:
    error = {"type": kind, "message": message[:MAX_MESSAGE_CHARS]}
    if exc_type is not None:
        error.update(exc_type=str(exc_type)[:200], exc_message=str(exc_message)[:MAX_MESSAGE_CHARS])
    return {"error": error}


def record(target: str | dict, world_size: int, inputs: list, options: dict, count: bool = True) -> dict:
    """Launch the notebook's ``target`` (a name, or a driver) and describe the run as data:
    results, the ranks' events inside the call, the ranks' process ids, and (``count``) the
    bytes the OS counted (the grader counts them itself, from outside)."""
    name = target if isinstance(target, str) else str(target.get("name"))
    # under grading: the notebook's functions that timed out in an earlier test are not run again
    # (the grader's list; and those that hung in this kernel, of the student's own functions)
    # (before a driver is defined in its copy of the notebook's names: it calls the stand-ins)
    only = options.get("student_functions")
    with stub_only(only) if only is not None else nullcontext():
        with stubbed({**hung_before(), **(options.get("timed_out") or {})}):
            return _record(name, target, world_size, inputs, options, count)


def _record(name: str, target: str | dict, world_size: int, inputs: list, options: dict, count: bool) -> dict:
    timeout = options["timeout"]
    within = f"{timeout:g} s" + (f" ({options['why']})" if options.get("why") else "")
    try:
        fn = _student_function(target)
        before = _snapshot() if count else None
        result = launch(
            _call,
            world_size,
            fn,
            inputs,
            trace=True,
            timeout=timeout,
            device=options.get("device"),
            network=_network(options.get("network")),
        )
        pids = pool.worker_pids()[:world_size]
        after = _snapshot() if before is not None else None
    except CollectiveMismatch as exc:  # seen at once: not a hang (nothing to remember, nothing to skip)
        return _error("ExerciseError", f"{name} failed on the ranks:\n{exc}")
    except LaunchTimeout as exc:
        error = _error("ExerciseTimeout", f"{name} did not finish within {within} on every rank:\n{exc}")
        # the functions the stuck ranks were in, innermost first, those of ranks stuck outside torch's
        # calls (a loop) before those waiting in one: the grader's fail-fast keys on them
        blocked = exc.blocked
        ranks = sorted(exc.stacks, key=lambda r: not str(blocked.get(r, "")).startswith("running Python"))
        running = [f for r in ranks for f, _ in reversed(exc.stacks[r])]
        error["error"]["running"] = list(dict.fromkeys(running))[:50]
        return error
    except RankError as exc:
        if exc.exc_type == SkippedAfterHang.__name__:  # a function that hung before, stopped at once
            return _error("ExerciseTimeout", f"{name} was stopped at once: {exc.exc_message}")
        return _error("ExerciseError", f"{name} failed on a rank:\n{exc}", exc.exc_type, exc.exc_message)
    except LaunchError as exc:
        return _error("ExerciseError", f"{name} failed on a rank:\n{exc}")
    except ExerciseError as exc:
        return _error("ExerciseError", str(exc))
    # the student's own regions (dl.region) stay, named, without their meta (which need not be data);
    # the "student" region that marks the call itself is the runner's
    events = [e for e in result.events if not (e.kind == "region" and e.name == "student")]
    return {
        "results": [r for r, _ in result.results],
        "inputs_after": [list(after) for _, after in result.results],
        "events": [
            (
                e.rank,
                e.op,
                e.kind,
                e.start,
                e.end,
                e.peer,
                e.group,
                e.bytes,
                e.tag,
                e.name[:200],
                {} if e.kind == "region" else dict(e.meta),
            )
            for e in events
        ],
        "pids": pids,
        "backend": result.backend,
        "matrix": _counted(before, after, pids),
    }


def _snapshot() -> dict | None:
    """This namespace's sockets for the student's own count, or None where ``ss`` cannot tell."""
    try:
        return wire.snapshot() if wire.available() is None else None
    except (RuntimeError, OSError, subprocess.TimeoutExpired):
        return None


def _counted(before, after, pids: list[int]) -> list[list[int]] | None:
    """The OS's count of what the ranks sent each other, or None where it could not be made (the
    student's own run then shows the trace's account: ``from_record``; under grading the grader
    counts for itself, and a count it cannot make fails the tests that read it)."""
    if after is None:
        return None
    try:
        return wire.traffic(before, after, pids).matrix
    except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired):
        return None


def dumps(rec: dict) -> bytes:
    """``rec`` as bytes that ``loads`` reads without running code; a result that is not data
    (a module, a function, a class of the notebook) becomes an error saying which rank."""
    buffer = io.BytesIO()
    try:
        torch.save(rec, buffer)
        data = buffer.getvalue()
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception:  # noqa: BLE001  (which result is the culprit is said below)
        for rank, value in enumerate(rec.get("results") or []):
            try:
                probe = io.BytesIO()
                torch.save(value, probe)
                torch.load(io.BytesIO(probe.getvalue()), weights_only=True)
            except Exception:  # noqa: BLE001
                return dumps(
                    _error(
                        "ExerciseError",
                        f"rank {rank} returned {type(value).__name__} {value!r:.80}: a test can only read "
                        "back tensors, numbers, strings, None, and lists, tuples or dicts of them",
                    )
                )
        return dumps(_error("ExerciseError", "the run's record could not be written as plain data"))
    if len(data) > MAX_RECORD_BYTES:
        return dumps(
            _error(
                "ExerciseError",
                f"the ranks returned {len(data):,} bytes; a test reads back at most {MAX_RECORD_BYTES:,}",
            )
        )
    return data


def loads(data: bytes) -> dict:
    """Read what ``dumps`` wrote (or anything claiming to be it) as data only."""
    if len(data) > MAX_RECORD_BYTES:
        return _error("ExerciseError", f"the record is {len(data):,} bytes, more than {MAX_RECORD_BYTES:,}")
    try:
        rec = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001  (anything else is not a record)
        return _error("ExerciseError", f"the run's record could not be read as plain data ({type(exc).__name__})")
    return rec if isinstance(rec, dict) else _error("ExerciseError", "the run's record is not a dict")


def serve(request_path: str, record_path: str) -> None:
    """Carry out one request of the grader in this (the student's) kernel: read the request
    (target, world size, inputs, options) and write the run's record."""
    with open(request_path, "rb") as f:
        request = torch.load(f, weights_only=True)
    data = dumps(record(request["target"], request["world_size"], request["inputs"], request["options"], count=False))
    partial = record_path + ".partial"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, record_path)


# --------------------------------------------------------------------------------------
# Reading a record (untrusted under grading: every field is checked)
# --------------------------------------------------------------------------------------
def from_record(name: str, world_size: int, rec: dict) -> ExerciseRun:
    """The ExerciseRun a record describes; raises ExerciseError/ExerciseTimeout for an error
    record or one that does not hold what a run gives back."""
    error = rec.get("error")
    if error is not None:
        error = error if isinstance(error, dict) else {"message": error}
        message = str(error.get("message"))[:MAX_MESSAGE_CHARS]
        if error.get("type") == "ExerciseTimeout":
            raise ExerciseTimeout(message)
        exc_type, exc_message = error.get("exc_type"), error.get("exc_message")
        raise ExerciseError(
            message,
            str(exc_type)[:200] if exc_type is not None else None,
            str(exc_message)[:MAX_MESSAGE_CHARS] if exc_message is not None else None,
        )
    results = rec.get("results")
    if not isinstance(results, list) or len(results) != world_size:
        raise ExerciseError(f"{name}: expected one result per rank ({world_size}), got {type(results).__name__}")
    inputs_after = rec.get("inputs_after")
    if not isinstance(inputs_after, list) or len(inputs_after) != world_size:
        raise ExerciseError(f"{name}: expected each rank's inputs after the call, got {type(inputs_after).__name__}")
    events = [e for e in rec.get("events") or [] if _plain_event(e, world_size)]
    matrix, unobserved = rec.get("matrix"), rec.get("unobserved")
    if isinstance(unobserved, str):  # under grading, the grader could not count: no count at all
        traffic = wire.Traffic.unobserved(unobserved[:MAX_MESSAGE_CHARS])
    elif _plain_matrix(matrix, world_size):
        traffic = wire.Traffic(matrix=matrix)
    else:  # the student's own run, not counted (no `ss` here): what the ranks' own sends say
        traffic = wire.Traffic(matrix=[[0] * world_size for _ in range(world_size)], source="trace")
        for e in to_events(events):
            if e.kind == "p2p" and e.op in ("send", "isend") and e.peer is not None:
                traffic.matrix[e.rank][e.peer] += e.bytes
    return ExerciseRun(
        name=name,
        world_size=world_size,
        results=results,
        traffic=traffic,
        timeline=_timeline(rec, to_events(events), world_size),
        trace=Run(
            results=results,
            events=to_events(events),
            world_size=world_size,
            backend=str(rec.get("backend", "gloo"))[:20],
        ),
        inputs_after=[tuple(x) if isinstance(x, list) else () for x in inputs_after],
        backend=str(rec.get("backend", "gloo"))[:20],
    )


def _timeline(rec: dict, events, world_size: int) -> wire.Timeline:
    """The grader's capture (``timeline``), or why there is none (``timeline_unobserved``); in the
    student's own kernel (neither: no grader), the ranks' traced sends, for a self-check."""
    segments, unobserved = rec.get("timeline"), rec.get("timeline_unobserved")
    if isinstance(unobserved, str):
        return wire.Timeline.unobserved(unobserved[:MAX_MESSAGE_CHARS])
    if segments is not None:
        plain = isinstance(segments, list) and all(
            isinstance(s, (list, tuple))
            and len(s) == 4
            and isinstance(s[0], float)
            and all(type(x) is int and 0 <= x < world_size for x in s[1:3])
            and type(s[3]) is int
            for s in segments
        )
        if not plain:
            return wire.Timeline.unobserved("the capture's segments were not plain data")
        return wire.Timeline(segments=[tuple(s) for s in segments])
    sends = sorted((e.start, e.rank, e.peer, e.bytes) for e in events if e.kind == "p2p" and e.op in ("send", "isend"))
    start = sends[0][0] if sends else 0.0
    segments = [(t - start, a, b, wire.GLOO_PREAMBLE + n) for t, a, b, n in sends if b is not None]  # (as on the wire)
    return wire.Timeline(segments=segments, source="trace")


def _plain_event(e, world_size: int) -> bool:
    return (
        isinstance(e, tuple)
        and len(e) == EVENT_FIELDS
        and isinstance(e[0], int)
        and 0 <= e[0] < world_size
        and all(isinstance(e[i], str) for i in (1, 2, 9))
        and all(isinstance(e[i], (int, float)) for i in (3, 4, 7))
        and (e[5] is None or isinstance(e[5], int))
        and (e[6] is None or (isinstance(e[6], tuple) and all(isinstance(r, int) for r in e[6])))
        and (e[8] is None or isinstance(e[8], int))
        and isinstance(e[10], dict)
    )


def _plain_matrix(matrix, world_size: int) -> bool:
    return (
        isinstance(matrix, list)
        and len(matrix) == world_size
        and all(
            isinstance(row, list) and len(row) == world_size and all(type(n) is int and n >= 0 for n in row)
            for row in matrix
        )
    )
