"""Lab 12's part 1: the merged profiler traces its checks hand the student's functions, and the checks.

The traces are built here by construction.  Each rank's
timeline is laid out as consecutive segments (compute, an asynchronous collective's call, compute
that hides its transfer, its wait, a blocking collective, a message's send and receive), their
lengths drawn from a seeded generator; the trace's slices are then cut from the segments: torch's
ops nested inside, a wait split across two threads whose slices overlap, a second copy of a slice
inside another, other ranks' slices, metadata, flows and instants around them.  So each answer is
a sum of segment lengths, or the rank with the latest start, known before any slice is written, and
not the output of the algorithm an exercise asks for.  The traces have the merged format of
``dl.merge_traces`` (times in µs, one ``pid`` per rank).

This module is installed with the kit, so a student's function could call :func:`built_trace` itself
and look its input up among the traces of many seeds.  The hidden cases therefore pass ``seed=None``:
the check draws a 64-bit seed in the grader kernel at grading time (``secrets``), which never crosses
to the student.  A right answer passes every trace; each wrong reading the tests know of fails every
trace, because every trace holds what catches it (a wait split across two threads, a region named
``dl loader``, a gloo slice inside another, ranks entering each collective at different times).
"""

from __future__ import annotations

import math
import random
import secrets

from ... import exercise

__all__ = [
    "COLLECTIVES",
    "built_trace",
    "check_exposed_communication",
    "check_stragglers",
    "check_overlap_fraction",
]

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")
MAIN, HELPER, GLOO = 1000, 1001, 1002  # thread ids: the program's, a second of the program's, gloo's
TOLERANCE = 1e-6  # relative, on sums of a few dozen lengths kept to the µs's thousandth


def _exposed_of(trace, ranks):
    """Driver: your exposed_communication(trace, rank) for each of ``ranks``, as floats."""
    return [float(exposed_communication(trace, rank)) for rank in ranks]  # noqa: F821  (the notebook's)


def _stragglers_of(trace):
    """Driver: your stragglers(trace), as a list of ints."""
    return [int(rank) for rank in stragglers(trace)]  # noqa: F821  (the notebook's)


def _overlap_of(trace, ranks):
    """Driver: your overlap_fraction(trace, rank) for each of ``ranks``, as floats."""
    return [float(overlap_fraction(trace, rank)) for rank in ranks]  # noqa: F821  (the notebook's)


class _Rank:
    """One rank's slices as they are laid out, and the sums the answers are made of."""

    def __init__(self, rank: int, rng: random.Random, start: float) -> None:
        self.rank, self.rng, self.t = rank, rng, start
        self.slices: list[dict] = []
        self.exposed = 0.0  # µs inside the kit's calls (the union, by construction)
        self.moving = 0.0  # µs gloo moved data (the union of the gloo slices)
        self.hidden = 0.0  # of which, µs outside every kit call
        self.entered: list[float] = []  # when each collective's call began

    def length(self, low: float, high: float) -> float:
        return round(self.rng.uniform(low, high), 3)

    def add(self, name: str, start: float, end: float, tid: int = MAIN, cat: str = "user_annotation") -> None:
        where = {"pid": self.rank, "tid": tid, "ts": start, "dur": round(end - start, 3)}
        self.slices.append({"ph": "X", "cat": cat, "name": name, **where})

    def compute(self, name: str) -> None:
        start, self.t = self.t, round(self.t + self.length(300, 3000), 3)
        self.add(name, start, self.t)
        inner = round(start + (self.t - start) * 0.2, 3)
        self.add("aten::mm", inner, round(inner + (self.t - start) * 0.5, 3), cat="cpu_op")

    def blocking(self, op: str) -> None:
        """A blocking collective: the program waits the whole time gloo moves the data."""
        start = self.t
        self.entered.append(start)
        self.t = round(start + self.length(200, 4000), 3)
        self.add(f"dl:{op}", start, self.t)
        self.add(f"c10d::{op}_", round(start + 1, 3), round(start + 30, 3), cat="cpu_op")
        moved = round(start + 40, 3)
        self.add(f"gloo:{op}", moved, self.t, tid=GLOO)
        self.exposed += self.t - start
        self.moving += self.t - moved

    def asynchronous(self, op: str, split: bool) -> None:
        """An async collective: its call, compute that hides the transfer, its wait (``split``: the
        wait's slices on two threads, overlapping, and a copy of one inside the other)."""
        call = self.t
        self.entered.append(call)
        called = round(call + self.length(20, 200), 3)
        self.add(f"dl:{op}", call, called)
        hidden_end = round(called + self.length(300, 3000), 3)
        self.add("backward", called, hidden_end)
        wait_end = round(hidden_end + self.length(100, 2000), 3)
        if split:  # main thread waits [hidden_end, c], the helper [d, wait_end], d < c: the union is one span
            c = round(hidden_end + (wait_end - hidden_end) * 0.6, 3)
            d = round(hidden_end + (wait_end - hidden_end) * 0.3, 3)
            self.add(f"dl:wait({op})", hidden_end, c)
            self.add(f"dl:wait({op})", d, wait_end, tid=HELPER)
            self.add("dl:wait(irecv)", round(d + 1, 3), round(c - 1, 3), tid=HELPER)  # inside both
        else:
            self.add(f"dl:wait({op})", hidden_end, wait_end)
        # gloo moves the data from just after the call to somewhere in the wait
        moved, done = round(call + 5, 3), round(hidden_end + (wait_end - hidden_end) * 0.5, 3)
        self.add(f"gloo:{op}", moved, done, tid=GLOO)
        self.add("gloo:recv", round(moved + 2, 3), round(done - 2, 3))  # a copy inside: the union unchanged
        self.exposed += (called - call) + (wait_end - hidden_end)
        self.moving += done - moved
        self.hidden += hidden_end - max(called, moved)
        self.t = wait_end

    def message(self, peer: int) -> None:
        """A send and a receive: kit calls the program waits in (no gloo slice of their own here)."""
        start = self.t
        sent = round(start + self.length(20, 400), 3)
        self.add("dl:isend", start, sent)
        self.t = round(sent + self.length(50, 800), 3)
        self.add("dl:recv", sent, self.t)
        self.exposed += self.t - start
        self.add(f"rank {self.rank} → rank {peer}", sent, sent, cat="message")  # a zero-length marker, not "dl:"


def built_trace(seed: int | None, world_size: int, collectives: int = 4) -> tuple[dict, dict]:
    """A merged trace of ``world_size`` ranks and ``collectives`` collective calls, and its answers:
    ``{"exposed": [µs per rank], "stragglers": [rank per collective], "overlap": [fraction per rank]}``.
    ``seed=None``: a seed drawn now, in this process (a hidden case's)."""
    rng = random.Random(secrets.randbits(64) if seed is None else seed)
    ops = [rng.choice(COLLECTIVES) for _ in range(collectives)]
    ranks = [_Rank(r, rng, round(rng.uniform(0, 500), 3)) for r in range(world_size)]
    for r in ranks:
        r.compute("forward")
        for k, op in enumerate(ops):
            r.compute("dl loader" if k == 1 else "forward")  # "dl" without a colon is not the kit's
            if k % 2 == 0:
                r.asynchronous(op, split=(k + r.rank) % 2 == 0)
            else:
                r.blocking(op)
            if k == 1:
                r.message((r.rank + 1) % world_size)
        r.compute("optimizer")
    events: list[dict] = []
    for r in ranks:
        where = {"pid": r.rank, "ts": 0}
        events += [
            {"ph": "M", "name": "process_name", "tid": 0, "args": {"name": f"rank {r.rank}"}, **where},
            {"ph": "M", "name": "thread_name", "tid": GLOO, "args": {"name": "pt_gloo_runloop"}, **where},
            {"ph": "i", "s": "t", "name": "dl:instant", "pid": r.rank, "tid": MAIN, "ts": r.t},  # no "dur"
            {"ph": "s", "cat": "message", "name": "flow", "id": r.rank + 1, "pid": r.rank, "tid": MAIN, "ts": 1},
            *r.slices,
        ]
    rng.shuffle(events)  # a merged file is in no particular order
    first = min(e["ts"] for e in events if e["ph"] == "X")
    for e in events:
        if e["ph"] != "M":
            e["ts"] = round(e["ts"] - first, 3)
    trace = {"displayTimeUnit": "ms", "traceEvents": events, "disttrain_lab": {"world_size": world_size}}
    entered = [[r.entered[k] for r in ranks] for k in range(collectives)]
    answers = {
        "exposed": [r.exposed for r in ranks],
        "stragglers": [max(range(world_size), key=lambda i, row=row: (row[i], -i)) for row in entered],
        "overlap": [r.hidden / r.moving for r in ranks],
    }
    return trace, answers


def _describe(trace: dict) -> str:
    n = trace["disttrain_lab"]["world_size"]
    slices = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    return f"{n} ranks, {slices} slices"


def check_exposed_communication(seed: int | None, world_size: int, case: str) -> None:
    """``exposed_communication(trace, rank)`` on the grader's trace is each rank's time inside the
    kit's calls (the union of its ``dl:`` slices, on all its threads), within 1e-6 relative."""
    trace, answers = built_trace(seed, world_size)
    got = exercise.run(_exposed_of, 1, (trace, list(range(world_size))), timeout=60).results[0]
    for rank, (g, want) in enumerate(zip(got, answers["exposed"])):
        assert math.isclose(g, want, rel_tol=TOLERANCE), (
            f"exposed_communication on {case} ({_describe(trace)}), rank {rank}: expected {want:.3f} µs, got "
            f"{g:.3f}: the union of the rank's slices whose name begins with 'dl:', on every thread of its pid"
        )


def check_stragglers(seed: int | None, world_size: int, case: str) -> None:
    """``stragglers(trace)`` names, for each collective in order, the rank that entered it last."""
    trace, answers = built_trace(seed, world_size)
    got = exercise.run(_stragglers_of, 1, (trace,), timeout=60).results[0]
    assert got == answers["stragglers"], (
        f"stragglers on {case} ({_describe(trace)}): expected {answers['stragglers']}, got {got}: for each "
        "collective (a 'dl:' slice but dl:send, dl:recv, dl:isend, dl:irecv and dl:wait(...)), in order, the "
        "rank whose slice of it starts last"
    )


def check_overlap_fraction(seed: int | None, world_size: int, case: str) -> None:
    """``overlap_fraction(trace, rank)``: the share of the union of the rank's ``gloo:`` slices outside
    the union of its ``dl:`` slices, within 1e-6 relative."""
    trace, answers = built_trace(seed, world_size)
    got = exercise.run(_overlap_of, 1, (trace, list(range(world_size))), timeout=60).results[0]
    for rank, (g, want) in enumerate(zip(got, answers["overlap"])):
        assert math.isclose(g, want, rel_tol=TOLERANCE), (
            f"overlap_fraction on {case} ({_describe(trace)}), rank {rank}: expected {want:.6f}, got {g:.6f}: "
            "the time gloo moved the rank's data (its 'gloo:' slices, overlaps once) outside every 'dl:' "
            "slice of the rank, over all the time gloo moved its data"
        )
