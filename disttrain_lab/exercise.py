"""Running a student's exercise for a test, the same way in a notebook and under grading.

A graded test asks for the student's function by name, with the inputs of every rank, and
gets back only data::

    run = dl.exercise.run("ping_pong", 2, [(data, 3), (torch.zeros(4), 3)], timeout=30)
    run.results    # each rank's return value: tensors, numbers, strings, None, lists, tuples, dicts
    run.traffic    # bytes each rank sent each other, counted by the operating system (wire.Traffic)
    run.trace      # the ranks' own account of the call (a dl.Run): what they say they did
    run.inputs_after   # each rank's arguments as the call left them (in-place exercises)

``run`` makes a :class:`~disttrain_lab.protocol.Request` and hands it to the runner, which
gives back the student kernel's :class:`~disttrain_lab.protocol.Record` and the
:class:`~disttrain_lab.protocol.Evidence` observed around it.  In a notebook (self-checks, and
the graded cells a student runs) the runner is this kernel's own (``serving.run``, the record
through the same bytes as under grading, and the kit's own count of the bytes).  Under grading
the test runs in a *grader kernel* that holds no student code: ``use_runner`` there makes
``run`` ask the student's kernel over a comm (``grading/remote.py``), and the evidence is the
grader's, observed from outside.  So what passes in the notebook passes when graded.
See docs/architecture.md, "Where a grade is decided".
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import osmemory, serving, wire, wiretimeline
from .gate import Seen
from .network import Network
from .protocol import Driver, Evidence, Record, Request
from .trace import Run

__all__ = ["ExerciseRun", "ExerciseError", "ExerciseTimeout", "Runner", "graded", "run", "use_runner"]


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
    timeline: wiretimeline.Timeline = dataclasses.field(
        default_factory=lambda: wiretimeline.Timeline.unobserved("not asked for")
    )
    memory: osmemory.Held = dataclasses.field(default_factory=lambda: osmemory.Held.unobserved("not asked for"))
    gate: Seen = dataclasses.field(default_factory=Seen.none)  # when the grader held the backward (gate.py)

    def __repr__(self) -> str:
        return f"ExerciseRun({self.name!r} on {self.world_size} ranks; {self.traffic.describe()})"


# a runner: (request, the answers of a gate the grader holds in the ranks' backward, or None) -> what came back
Runner = Callable[[Request, "Sequence | None"], tuple[Record, Evidence]]
OWN_MEMORY = "os, read by the student's kernel"  # run.memory's source in the student's own notebook


def _snapshot() -> dict | None:
    """This namespace's sockets for the student's own count, or None where ``ss`` cannot tell."""
    try:
        return wire.snapshot() if wire.available() is None else None
    except (RuntimeError, OSError, subprocess.TimeoutExpired):
        return None


def _own_evidence(record: Record, before, world_size: int) -> Evidence:
    """The kit's own account in the student's notebook (no grader observes there): the OS's count
    of the bytes where ``ss`` can make it, else the ranks' traced sends; their traced messages as
    the timeline.  Each says so in its ``source``."""
    traced = Run(results=[], events=list(record.events), world_size=world_size).messages()
    traffic = None
    if before is not None and record.failure is None:
        try:
            traffic = wire.traffic(before, wire.snapshot(), list(record.pids))
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired):
            traffic = None
    if traffic is None:  # the traced messages as gloo's protocol would count them
        sizes: dict[tuple[int, int], list[int]] = {}
        for send, recv in traced:
            if 0 <= send.rank < world_size and 0 <= recv.rank < world_size:
                sizes.setdefault((send.rank, recv.rank), []).append(send.bytes)
        traffic = wire.Traffic(matrix=wire.protocol_bytes(sizes, world_size), source="trace")
    return Evidence(traffic=traffic, timeline=_traced_timeline(traced))


def _traced_timeline(traced) -> wiretimeline.Timeline:
    """The ranks' matched sends and receives as gloo would put them on the wire (``wiretimeline.Timeline``
    reads both alike): the sender's note when it posts the send, the receiver's note when it posts
    the receive, and the data (preamble and payload) once both are posted."""
    segments = []
    for send, recv in traced:
        segments += [
            (send.start, send.rank, recv.rank, wire.GLOO_PREAMBLE),
            (recv.start, recv.rank, send.rank, wire.GLOO_PREAMBLE),
            (max(send.start, recv.start), send.rank, recv.rank, wire.GLOO_PREAMBLE + send.bytes),
        ]
    segments.sort()
    start = segments[0][0] if segments else 0.0
    return wiretimeline.Timeline(segments=[(t - start, a, b, n) for t, a, b, n in segments], source="trace")


def _run_here(request: Request, gate: Sequence | None = None) -> tuple[Record, Evidence]:
    """One run in this kernel (the notebook's own): the record as the grader would read it.  No grader
    holds a ``gate`` here: the ranks run without one (``run.gate.source == "none"``)."""
    before, watch, prepared = _snapshot(), None, []
    if request.memory:  # fresh ranks, their memory read at the driver's pause, as the grader does
        answer = serving.prepare({"world_size": request.world_size, "device": request.device, "fresh": True})
        if answer.get("prepared"):
            prepared = answer["pids"]
            watch = osmemory.Watch(prepared, _snapshot).start()
    record = Record.from_bytes(serving.run(request).to_bytes(), request.world_size)
    held = (
        watch.stop()
        if watch is not None
        else osmemory.Held.unobserved("the ranks could not be started fresh" if request.memory else "not asked for")
    )
    evidence = _own_evidence(record, before, request.world_size)
    if record.failure is not None:
        return record, evidence
    try:
        at_pauses = [(snapshot, None) for snapshot in watch.extras] if watch is not None else []
        memory = osmemory.observed(held, before, at_pauses, prepared, list(record.pids), source=OWN_MEMORY)
    except (RuntimeError, OSError, ValueError):  # (the bytes could not be counted: the memory stands alone)
        at_pauses = [(None, None)] * len(watch.extras) if watch is not None else []
        memory = osmemory.observed(held, None, at_pauses, prepared, list(record.pids), source=OWN_MEMORY)
    return record, dataclasses.replace(evidence, memory=memory)


_RUNNER: Runner = _run_here


def graded() -> bool:
    """Whether ``run`` hands its requests to a grader (``use_runner``) rather than this kernel's own ranks: a check
    then grades on what the grader observes alone, and the ranks' own counts are the student's self-check."""
    return _RUNNER is not _run_here


def use_runner(runner: Runner | None) -> None:
    """Make ``run`` hand its requests to ``runner(request) -> (record, evidence)`` (the grader's);
    None: run in this kernel again."""
    global _RUNNER
    _RUNNER = runner or _run_here


def run(
    target: str | Callable | Driver | dict,
    world_size: int,
    inputs: Sequence | None = None,
    *,
    timeout: float = 30.0,
    device: str | None = None,
    network: Network | None = None,
    timeline: bool = False,
    content: bool | None = None,
    memory: bool = False,
    writable: str | None = None,
    gate: Sequence | None = None,
) -> ExerciseRun:
    """Run ``target`` on ``world_size`` ranks; rank r calls it with ``inputs[r]`` (a tuple of
    arguments; one tuple for all ranks when ``inputs`` is a tuple).

    ``target``: the name of a function of the notebook (``"ping_pong"``), or a *driver*: a
    function defined at the top of a test cell that calls the notebook's code by name
    (``def _train(steps): opt = Zero1Optimizer(...); ...``).  A driver runs where the student's
    code runs, next to it: under grading its source is sent to the student's kernel and
    defined there, so what it returns is data like any result, and its references belong in
    the test, outside it.  A driver may also come as data: a ``protocol.Driver`` or
    ``{"name": ..., "source": ...}`` (a test that joins several functions' source).

    ``device`` and ``network`` are ``dl.launch``'s.  ``timeline``: ``run.timeline`` holds when
    each segment of data crossed between which ranks, captured from the wire under grading
    (``wiretimeline.Timeline``; in the student's own kernel, the ranks' traced sends).  ``content``: it also
    holds what each connection carried (``Timeline.carries``, ``carried.assert_carried``), captured
    under grading; the student's own kernel has no capture, and there nothing is checked.
    ``memory``: the run's ranks are forked fresh and ``run.memory`` holds each rank's private
    memory as the OS counts it while the ranks pause in ``time.sleep`` (the driver pauses them:
    ``osmemory.py``), and the bytes each had sent by then; the student's kernel reads its own.
    ``writable``: a folder name; the ranks may write beneath that folder of the kernel's working
    directory (made if missing), where a graded run's ranks otherwise write nothing (``confine.py``):
    files that outlive the run, for the next (lab 12's checkpoints, across a rank the grader kills).
    ``gate``: one float32 tensor per rank; under grading the grader holds a gate in the ranks' backward
    (``gate.py``: the driver places it) and answers rank r with ``gate[r]``, after it has seen what crossed
    the wire by then (``run.gate``, with ``content`` unless it is False: a test that reads only when the gate's
    answers left, not what crossed, keeps no payloads); one None per rank: the grader answers zeros once every
    rank is held, or after a while those that are (``run.gate.held``), and a driver that holds nothing only
    marks its steps (``run.gate.marks``); a list of such lists: one per hold, in the order the ranks are
    held (``grading/gatekeeper.py``); in the student's own kernel there is no gate.

    Raises ExerciseError when a rank raised or returned something that is not data, and
    ExerciseTimeout when the ranks did not finish within ``timeout`` seconds."""
    if callable(target):
        target = _driver(target)
    elif isinstance(target, dict):  # a driver as data (a test that joins several functions' source)
        target = Driver(name=target.get("name"), source=target.get("source"))
    elif not isinstance(target, Driver) and not (isinstance(target, str) and target.isidentifier()):
        raise ValueError(f"target must be the name of a function in the notebook, or a function, got {target!r}")
    if inputs is None:
        inputs = ()
    per_rank = [tuple(inputs)] * world_size if isinstance(inputs, tuple) else [tuple(x) for x in inputs]
    if len(per_rank) != world_size:
        raise ValueError(f"inputs must hold one tuple of arguments per rank: {world_size} ranks, {len(per_rank)} given")
    request = Request(
        target=target,
        world_size=world_size,
        inputs=per_rank,
        timeout=float(timeout),
        device=device,
        network=dataclasses.asdict(network) if network is not None else None,
        timeline=bool(timeline or content or gate is not None),
        content=bool(content) if content is not None else gate is not None,
        memory=memory,
        writable=writable,
    )
    record, evidence = _RUNNER(request, None if gate is None else list(gate))
    return from_record(request.name, world_size, record, evidence)


def _driver(fn: Callable) -> Driver:
    """A test's driver function as what crosses to the student's kernel: its name and source."""
    if fn.__name__ == "<lambda>" or "<locals>" in fn.__qualname__:
        raise ValueError(f"a driver must be a function defined at the top level of a cell, not {fn.__qualname__}")
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise ValueError(f"the source of {fn.__name__} cannot be read ({exc}): define it in a cell") from None
    return Driver(name=fn.__name__, source=source)


def from_record(name: str, world_size: int, record: Record, evidence: Evidence) -> ExerciseRun:
    """The ExerciseRun a (checked) record and the evidence around it describe; raises
    ExerciseError/ExerciseTimeout for a failed run."""
    failure = record.failure
    if failure is not None:
        if failure.kind == "ExerciseTimeout":
            raise ExerciseTimeout(failure.message)
        raise ExerciseError(failure.message, failure.exc_type, failure.exc_message)
    if len(record.results) != world_size:  # (Record.from_bytes checked it; a runner's own record too)
        raise ExerciseError(f"{name}: expected one result per rank ({world_size}), got {len(record.results)}")
    events = sorted(record.events, key=lambda e: e.start)
    return ExerciseRun(
        name=name,
        world_size=world_size,
        results=list(record.results),
        traffic=evidence.traffic,
        timeline=evidence.timeline,
        memory=evidence.memory,
        gate=evidence.gate,
        trace=Run(results=list(record.results), events=events, world_size=world_size, backend=record.backend),
        inputs_after=list(record.inputs_after),
        backend=record.backend,
    )
