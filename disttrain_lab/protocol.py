"""What crosses between a graded test and the student's kernel: one typed request, one record.

A graded test runs in a grader kernel that holds no student code; it asks the student's kernel
to run one of the student's functions on ranks (``dl.exercise.run``).  Three types say all that
this involves, each a frozen dataclass checked when it is made:

- :class:`Request`, the grader's: what to run (a function's name, or a test's :class:`Driver`),
  on how many ranks, with which inputs, within which timeout, on which device and network;
- :class:`Record`, the student's kernel's answer: each rank's result and arguments after the
  call, the ranks' events (named :class:`~disttrain_lab.events.Event` fields), the ranks'
  process ids, or a :class:`Failure`.  Everything in it is the student's claim: it is read as
  data only (``torch.load(weights_only=True)``), within ``MAX_RECORD_BYTES``, and every field is
  checked for type, length and range (:meth:`Record.from_bytes`) before anything reads it;
- :class:`Evidence`, the grader's own: the bytes between the ranks and when they crossed, as the
  grader observed them from outside the student's processes (``wire.py``, ``capture.py``, ``wiretimeline.py``).  It
  never crosses to the student's kernel; in the student's own notebook, where no grader
  observes, it holds the student's own count and says so (``source``).

The request travels as data over the student kernel's own Jupyter channels: a comm opened on
the target ``COMM_TARGET`` with the request's bytes as its buffer, answered by one comm message
with the record's bytes (``serving.py`` is the student's end, ``grading/remote.py`` the grader's).
No source text is evaluated to carry it.  Before each request the grader opens one comm whose
data is ``{"prepare": {"world_size": n, "device": d, "fresh": f, "writable": w}}`` (``PREPARE``), no
buffer: the kernel forks the ranks the run will use (``fresh``: new ones, whose memory the grader reads;
``writable``: ranks whose confinement lets them write beneath that folder of the kernel's working
directory, and nowhere else: a job that must outlive a rank it loses, lab 12's restart),
answers ``{"prepared": true, "pids": [...]}`` (or ``false`` and why), and the request
that follows runs on those ranks without forking (a rank forked after it arrived would hold a
copy of every rank's inputs); each rank is sent its own inputs only (``launcher.PerRank``).
"""

from __future__ import annotations

import dataclasses
import io
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from . import osmemory, wire, wiretimeline
from .events import Event
from .gate import Seen

__all__ = [
    "COMM_TARGET",
    "MAX_RECORD_BYTES",
    "Driver",
    "Evidence",
    "Failure",
    "ProtocolError",
    "Record",
    "Request",
]

COMM_TARGET = "disttrain_lab.exercise"  # the comm target the student's kernel serves requests on
PREPARE = "prepare"  # a comm's data key: fork the ranks for the next request (no buffer)
VERSION = 1
MAX_RECORD_BYTES = 64 * 2**20  # what one run may send back
MAX_REQUEST_BYTES = 1024 * 2**20  # what a test may send (the grader's own inputs)
MAX_MESSAGE_CHARS = 20_000
MAX_NAME_CHARS = 200
WRITABLE = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a request's writable folder: one plain name, no path
MAX_EVENTS = 200_000
# NotPrepared: the kernel had no ranks forked before the request arrived (``pool.prepared_only``):
# the grader prepares them again and resends, once
FAILURES = ("ExerciseError", "ExerciseTimeout", "NotPrepared")
EVENT_FIELDS = tuple(f.name for f in dataclasses.fields(Event))


class ProtocolError(ValueError):
    """A request or record that is not what the protocol says (wrong type, size or field)."""


def _dumps(fields: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(fields, buffer)
    return buffer.getvalue()


def _loads(data: bytes, cap: int, what: str) -> dict:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"the {what} is {type(data).__name__}, not bytes")
    if len(data) > cap:
        raise ProtocolError(f"the {what} is {len(data):,} bytes, more than {cap:,}")
    try:
        found = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    except Exception as exc:  # noqa: BLE001  (anything else is not data)
        raise ProtocolError(f"the {what} could not be read as plain data ({type(exc).__name__})") from None
    if not isinstance(found, dict):
        raise ProtocolError(f"the {what} is {type(found).__name__}, not a dict")
    if found.get("version") != VERSION:
        raise ProtocolError(f"the {what} is of protocol version {found.get('version')!r}, not {VERSION}")
    return found


def _text(value, cap: int = MAX_MESSAGE_CHARS) -> str:
    return str(value)[:cap]


def _fields(cls, found: dict, what: str) -> dict:
    """``found``'s keys, checked to be exactly ``cls``'s fields (and ``version``)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in set(found) - names - {"version"})
    if unknown:
        raise ProtocolError(f"the {what} holds fields a {cls.__name__} does not have: {', '.join(unknown)[:200]}")
    return {k: v for k, v in found.items() if k in names}


# --------------------------------------------------------------------------------------
# The grader's request
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Driver:
    """A function a test defines at the top of its cell to call the student's code by name; it
    runs where the student's code runs (its source is defined in a copy of the notebook's names)."""

    name: str
    source: str

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ProtocolError(f"a driver's name must be an identifier, got {self.name!r:.80}")
        if not isinstance(self.source, str):
            raise ProtocolError(f"a driver's source must be text, got {type(self.source).__name__}")


@dataclass(frozen=True)
class Request:
    """One run of a student's function that a test asks for (see the module docstring)."""

    target: str | Driver  # the notebook function's name, or a test's driver
    world_size: int
    inputs: list  # one tuple of arguments per rank
    timeout: float
    device: str | None = None
    network: dict | None = None  # a dl.Network's fields (dataclasses.asdict)
    timeline: bool = False  # the test reads when the data crossed (the grader captures it)
    content: bool = False  # ... and what it carried (the grader keeps the captured payloads too)
    memory: bool = False  # the grader reads each rank's memory from the OS at the driver's pause (fresh ranks)
    writable: str | None = None  # a folder of the kernel's working directory the ranks may write in (nothing else)
    gate: int | None = None  # the port of the grader's gate in the ranks' backward (gate.py), set by the grader
    why: str | None = None  # why the timeout is what it is (the rest of the test's limit)
    timed_out: dict[str, str] = field(default_factory=dict)  # the student's functions not run again, and why
    student_functions: tuple[str, ...] | None = None  # the functions the submission's solution cells define

    def __post_init__(self):
        if not (isinstance(self.target, Driver) or (isinstance(self.target, str) and self.target.isidentifier())):
            raise ProtocolError(f"target must be a function's name or a Driver, got {self.target!r:.80}")
        if type(self.world_size) is not int or self.world_size < 1:
            raise ProtocolError(f"world_size must be an int >= 1, got {self.world_size!r:.40}")
        if not isinstance(self.inputs, list) or len(self.inputs) != self.world_size:
            raise ProtocolError(
                f"inputs must be a list of one tuple per rank ({self.world_size}), got {self.inputs!r:.80}"
            )
        if not all(isinstance(args, tuple) for args in self.inputs):
            raise ProtocolError("inputs must hold one tuple of arguments per rank")
        if not isinstance(self.timeout, (int, float)) or not math.isfinite(self.timeout) or self.timeout <= 0:
            raise ProtocolError(f"timeout must be a positive number of seconds, got {self.timeout!r:.40}")
        if self.device is not None and not isinstance(self.device, str):
            raise ProtocolError(f"device must be None or a str, got {self.device!r:.40}")
        if self.writable is not None and not (
            isinstance(self.writable, str) and WRITABLE.fullmatch(self.writable) and self.writable not in (".", "..")
        ):
            raise ProtocolError(f"writable must be None or a plain folder name, got {self.writable!r:.80}")
        if self.gate is not None and not (type(self.gate) is int and 0 < self.gate < 65536):
            raise ProtocolError(f"gate must be None or a port, got {self.gate!r:.40}")
        if self.network is not None and not isinstance(self.network, dict):
            raise ProtocolError(f"network must be None or a dl.Network's fields, got {self.network!r:.80}")
        if not isinstance(self.timed_out, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.timed_out.items()
        ):
            raise ProtocolError("timed_out must map function names to why they are not run again")
        if self.student_functions is not None:
            object.__setattr__(self, "student_functions", tuple(str(f) for f in self.student_functions))

    @property
    def name(self) -> str:
        return self.target.name if isinstance(self.target, Driver) else self.target

    def replace(self, **changes) -> Request:
        return dataclasses.replace(self, **changes)

    def to_bytes(self) -> bytes:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if isinstance(self.target, Driver):
            fields["target"] = {"name": self.target.name, "source": self.target.source}
        if self.student_functions is not None:
            fields["student_functions"] = list(self.student_functions)
        return _dumps({"version": VERSION, **fields})

    @classmethod
    def from_bytes(cls, data: bytes) -> Request:
        found = _fields(cls, _loads(data, MAX_REQUEST_BYTES, "request"), "request")
        target = found.get("target")
        if isinstance(target, dict):
            found["target"] = Driver(name=target.get("name"), source=target.get("source"))
        try:
            return cls(**found)
        except TypeError as exc:
            raise ProtocolError(f"the request is missing a field ({exc})") from None


# --------------------------------------------------------------------------------------
# The student's kernel's record
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Failure:
    """The run failed: ``kind`` is ``ExerciseError`` or ``ExerciseTimeout``; ``exc_type`` and
    ``exc_message`` what a rank raised, when one did; ``running`` the functions the stuck ranks
    were in (a timeout), innermost first; ``skipped``: a function that hung before, not run again."""

    kind: str
    message: str
    exc_type: str | None = None
    exc_message: str | None = None
    running: tuple[str, ...] = ()
    skipped: bool = False

    def __post_init__(self):
        if self.kind not in FAILURES:
            raise ProtocolError(f"a failure's kind must be one of {FAILURES}, got {self.kind!r:.40}")
        object.__setattr__(self, "message", _text(self.message))
        if self.exc_type is not None:
            object.__setattr__(self, "exc_type", _text(self.exc_type, MAX_NAME_CHARS))
        if self.exc_message is not None:
            object.__setattr__(self, "exc_message", _text(self.exc_message))
        if not isinstance(self.running, (list, tuple)):
            raise ProtocolError("a failure's running must be a list of function names")
        object.__setattr__(self, "running", tuple(_text(f, MAX_NAME_CHARS) for f in self.running[:50]))
        object.__setattr__(self, "skipped", self.skipped is True)


def _event(found, world_size: int) -> Event:
    """One event of a record, every field checked (the student's claim of what a rank did)."""
    if not isinstance(found, dict) or set(found) != set(EVENT_FIELDS):
        raise ProtocolError(f"an event must hold exactly the fields {', '.join(EVENT_FIELDS)}")
    e = found
    ok = (
        type(e["rank"]) is int
        and 0 <= e["rank"] < world_size
        and all(isinstance(e[k], str) for k in ("op", "kind", "name"))
        and all(type(e[k]) in (int, float) and math.isfinite(e[k]) for k in ("start", "end"))
        and type(e["bytes"]) is int
        and e["bytes"] >= 0
        and (e["peer"] is None or type(e["peer"]) is int)
        and (e["tag"] is None or type(e["tag"]) is int)
        and (e["group"] is None or (isinstance(e["group"], tuple) and all(type(r) is int for r in e["group"])))
        and isinstance(e["meta"], dict)
    )
    if not ok:
        raise ProtocolError(f"an event's fields have the wrong types: {e!r:.200}")
    return Event(**{**e, "op": e["op"][:MAX_NAME_CHARS], "name": e["name"][:MAX_NAME_CHARS]})


def _event_fields(e: Event) -> dict:
    return {name: getattr(e, name) for name in EVENT_FIELDS}


@dataclass(frozen=True)
class Record:
    """What the student's kernel gives back for one request: data only (see the module docstring).
    Either ``failure`` is set, or every other field describes the run."""

    results: list = field(default_factory=list)  # each rank's return value
    inputs_after: list = field(default_factory=list)  # each rank's arguments as the call left them
    events: tuple[Event, ...] = ()  # the ranks' own account of the call
    pids: tuple[int, ...] = ()  # the ranks' process ids, as the student's kernel sees them
    backend: str = "gloo"
    failure: Failure | None = None

    @classmethod
    def failed(cls, kind: str, message: str, **details) -> Record:
        return cls(failure=Failure(kind, message, **details))

    def to_bytes(self) -> bytes:
        """As bytes ``from_bytes`` reads without running code; a result that is not data (a module,
        a function, a class of the notebook) becomes a failure that says which rank's it is; so
        does a record over ``MAX_RECORD_BYTES``."""
        fields = {
            "results": self.results,
            "inputs_after": [list(args) for args in self.inputs_after],
            "events": [_event_fields(e) for e in self.events],
            "pids": list(self.pids),
            "backend": self.backend,
            "failure": dataclasses.asdict(self.failure) if self.failure else None,
        }
        try:
            data = _dumps({"version": VERSION, **fields})
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception:  # noqa: BLE001  (which result is the culprit is said below)
            for rank, value in enumerate(self.results):
                try:
                    torch.load(io.BytesIO(_dumps({"value": value})), weights_only=True)
                except Exception:  # noqa: BLE001
                    return Record.failed(
                        "ExerciseError",
                        f"rank {rank} returned {type(value).__name__} {value!r:.80}: a test can only read "
                        "back tensors, numbers, strings, None, and lists, tuples or dicts of them",
                    ).to_bytes()
            return Record.failed("ExerciseError", "the run's record could not be written as plain data").to_bytes()
        if len(data) > MAX_RECORD_BYTES:
            return Record.failed(
                "ExerciseError",
                f"the ranks returned {len(data):,} bytes; a test reads back at most {MAX_RECORD_BYTES:,}",
            ).to_bytes()
        return data

    @classmethod
    def from_bytes(cls, data: bytes, world_size: int) -> Record:
        """The record in ``data`` (untrusted: the student's kernel wrote it), every field checked;
        anything that is not a record of a run on ``world_size`` ranks becomes a failure that says why."""
        try:
            return cls._checked(
                _fields(cls, _loads(data, MAX_RECORD_BYTES, "run's record"), "run's record"), world_size
            )
        except ProtocolError as exc:
            return cls.failed("ExerciseError", f"the student's kernel gave back no valid record: {exc}")

    @classmethod
    def _checked(cls, found: dict, world_size: int) -> Record:
        failure = found.get("failure")
        if failure is not None:
            if not isinstance(failure, dict) or set(failure) - {f.name for f in dataclasses.fields(Failure)}:
                raise ProtocolError("its failure is not a Failure's fields")
            try:
                return cls(failure=Failure(**failure))
            except TypeError as exc:
                raise ProtocolError(f"its failure is missing a field ({exc})") from None
        results, inputs_after = found.get("results"), found.get("inputs_after")
        if not isinstance(results, list) or len(results) != world_size:
            raise ProtocolError(f"expected one result per rank ({world_size}), got {type(results).__name__}")
        if not (
            isinstance(inputs_after, list)
            and len(inputs_after) == world_size
            and all(isinstance(x, list) for x in inputs_after)
        ):
            raise ProtocolError(f"expected each of the {world_size} ranks' arguments after the call")
        events = found.get("events")
        if not isinstance(events, list) or len(events) > MAX_EVENTS:
            raise ProtocolError(f"expected a list of at most {MAX_EVENTS:,} events")
        pids = found.get("pids")
        if not isinstance(pids, list) or not all(type(p) is int and p > 0 for p in pids):
            raise ProtocolError("expected the ranks' process ids, as positive ints")
        backend = found.get("backend")
        if not isinstance(backend, str):
            raise ProtocolError("expected the backend's name")
        return cls(
            results=results,
            inputs_after=[tuple(x) for x in inputs_after],
            events=tuple(_event(e, world_size) for e in events),
            pids=tuple(pids),
            backend=backend[:20],
        )


# --------------------------------------------------------------------------------------
# The grader's own observations
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Evidence:
    """What was observed from outside the student's processes during one run: the bytes each rank
    sent each other (``traffic``, the OS's count), when the data crossed (``timeline``, a
    packet capture) and, for a run that asks, what each rank held in memory while the ranks
    paused (``memory``, ``osmemory.Held``: the OS's count) and when a graded step's backward was held at
    the grader's gate (``gate``, ``gate.Seen``: the capture's clock).  Made by the grader and never sent
    to the student's kernel; each may be *unobserved*, with why (a test that reads it then fails).
    In the student's own notebook (no grader) the kit's own count stands in for it, marked by its
    ``source``."""

    traffic: wire.Traffic
    timeline: wiretimeline.Timeline
    memory: osmemory.Held = field(default_factory=lambda: osmemory.Held.unobserved("not asked for"))
    gate: Seen = field(default_factory=Seen.none)  # when a graded step's backward was held (gate.py)

    @classmethod
    def unobserved(cls, why: str, by_submission: bool = False) -> Evidence:
        """Nothing observed, with why; ``by_submission``: because of what the submission did (its
        messages then tell the student so, not the instructor to change the host)."""
        return cls(
            traffic=wire.Traffic.unobserved(why, by_submission),
            timeline=wiretimeline.Timeline.unobserved(why, by_submission),
            memory=osmemory.Held.unobserved(why),
            gate=Seen.unobserved(why),
        )


def plain(value: Any) -> bool:
    """Whether ``value`` is data a record may hold (what ``torch.load(weights_only=True)`` reads)."""
    try:
        torch.load(io.BytesIO(_dumps({"value": value})), weights_only=True)
    except Exception:  # noqa: BLE001
        return False
    return True
