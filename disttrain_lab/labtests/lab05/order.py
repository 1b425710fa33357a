"""A pipeline schedule's order read from the wire: when each activation and gradient crossed a link.

TCP keeps each direction of a connection in order, so a byte's position in it says which of gloo's
operations it belongs to, however the segments were cut or packed (``wire.protocol_bytes``: 96 bytes
with each message, 48 the other way).  The bounds below only ever err towards "in order", so a
schedule that keeps its order is never taken for one that breaks it; a schedule that breaks it is
caught where its messages are large beside gloo's notes (the tests' cases are)."""

from __future__ import annotations

from collections.abc import Sequence

from ... import wire
from ...exercise import ExerciseRun
from .stages import _rows, _sizes


def _payloads(p: int, s: int, batch: int, m: int, steps: int) -> list[int]:
    """Payload bytes of every activation stage s sends stage s + 1, micro-batch by micro-batch and step
    by step (float32); each gradient stage s + 1 sends back has its activation's shape, so the same."""
    return [r * _sizes(p)[2 * s + 2] * 4 for r in _rows(batch, m) * steps]


def _messages(p: int, batch: int, m: int, steps: int) -> dict[tuple[int, int], tuple[int, int]]:
    """The schedule's messages for ``checks.assert_messages``: on every link, one activation forward and
    one gradient back per micro-batch and step."""
    found = {}
    for s in range(p - 1):
        sizes = _payloads(p, s, batch, m, steps)
        found[(s, s + 1)] = found[(s + 1, s)] = (m * steps, sum(sizes))
    return found


def _surely_past(sizes: Sequence[int], k: int, notes: int) -> int:
    """The most bytes a sender can have written on a direction of a link before it computes message
    ``k`` (of the ``sizes`` payloads in order): gloo's handshake, every earlier message with its 96
    bytes, message k's own note and preamble, and ``notes`` 48-byte notes of its receives (the most it
    can have posted by then).  A byte past this position was written after message k was computed;
    which message it belongs to does not matter (a later note may go before k's data)."""
    return sum(sizes[:k]) + 2 * wire.GLOO_PREAMBLE * (k + 1) + wire.GLOO_PREAMBLE * notes + wire.HANDSHAKE_BYTES


def _at_least_to(sizes: Sequence[int], k: int) -> int:
    """The least byte position at which message ``k`` (of the ``sizes`` payloads in order) has ended."""
    return sum(sizes[: k + 1]) + 2 * wire.GLOO_PREAMBLE * (k + 1)


def _before(timeline, ahead: tuple[int, int], k: int, ahead_sizes, behind_sizes, j: int, notes: int) -> bool:
    """Whether message ``k`` on ``ahead`` (a direction of a link) was surely computed before message ``j``
    the other way had surely arrived: when ``ahead``'s data passed the most its sender can write before
    computing k, the other direction had not yet carried the least bytes with which j ends.  TCP keeps each direction in
    order, so byte positions hold however the segments were cut; the bounds only ever err towards
    "no", so a schedule that keeps the order is never taken for one that breaks it."""
    at = timeline.passed(*ahead, _surely_past(ahead_sizes, k, notes))
    return at is not None and timeline.crossed(ahead[1], ahead[0], at) < _at_least_to(behind_sizes, j)


def _check_wire_order(case: str, run: ExerciseRun, p: int, batch: int, m: int, steps: int, name: str) -> None:
    """The schedule's order on every link, from when the data crossed (the grader's packet capture;
    the ranks' trace as gloo would send it, in a student's own notebook).  GPipe: the last
    stage's first gradient of a step leaves only after the step's last activation has arrived (all
    forwards before any backward).  1F1B: stage s sends activation p − s + j only after gradient j has
    arrived (at most p − s micro-batches in flight, the point of 1F1B)."""
    timeline = run.timeline
    for s in range(p - 1):
        acts = grads = _payloads(p, s, batch, m, steps)
        for t in range(steps):
            if name == "gpipe_step" and s == p - 2 and m > 1:
                first, last = t * m, t * m + m - 1
                assert not _before(timeline, (s + 1, s), first, grads, acts, last, (t + 1) * m), (
                    f"{case}: in step {t}, stage {s + 1} (the last) sent a gradient back before micro-batch "
                    f"{m - 1}'s activations had reached it (the data's times on the link between ranks {s} and "
                    f"{s + 1}); GPipe runs every forward before any backward"
                )
            if name == "one_f_one_b_step":
                for j in range(m - (p - s)):
                    k = p - s + j
                    assert not _before(timeline, (s, s + 1), t * m + k, acts, grads, t * m + j, (t + 1) * m), (
                        f"{case}: in step {t}, stage {s} sent micro-batch {k}'s activations before micro-batch "
                        f"{j}'s gradient had come back (the data's times on the link between ranks {s} and "
                        f"{s + 1}); in 1F1B stage {s} holds at most p − s = {p - s} micro-batches: after "
                        f"{p - s - 1} warm-up forwards, each forward follows a backward"
                    )
