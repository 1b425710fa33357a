"""An order run on real ranks, checked on the wire: each message named by its value, then placed in time.

``run_order`` has p ranks run a pipeline order (``orders``: ``Action(kind, stage, microbatch)`` lists),
sending stage s's output forward, ``dist.send`` from the rank holding s to the rank holding s + 1, and
stage s + 1's input gradient back the same way.  The grader draws the inputs at random and computes, in
one process, every activation and input gradient a correct run sends (:func:`reference_messages`), so a
payload on the wire names itself: its bytes equal exactly one of them (:func:`named_messages`).  The
ranks' tags and trace are never read: a rank could write anything there.

What crossed, per direction (sender, receiver), in the order TCP kept it::

    rank a -> rank b:  [note][preamble|act(s, j)] ... [note][preamble|grad(s', j')] ...
    rank b -> rank a:  [note] ...                      (gloo: 48 B each, the payload's preamble 48 B)

``Timeline.operations`` places each of gloo's operations in time by its byte positions (``passed``), the
first byte and the last; ``Timeline.messages`` gives the sends' payloads in the same order, so the sends
among the operations, zipped with the payloads, give each payload with its two times.

:func:`check_order_on_wire` then asks (a) that every message crossed once, on its own direction, and
nothing else; (b) that each rank ran the order given: a rank cannot send for its k-th action before the
messages its actions up to k wait for have arrived (F of s, j needs act(s − 1, j); B or I of s, j needs
grad(s + 1, j)).  That is necessary, not sufficient: a message that arrives early proves nothing, one sent
before what the order needed first had arrived proves the rank ran another order (GPipe's forwards all
first, say, or interleaved 1F1B with a wrong warm-up).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from ... import gloo_ops
from ...wiretimeline import Timeline
from .common import ms
from .orders import Action, Order, check_order, rank_and_chunk

__all__ = [
    "Name",
    "Expected",
    "Seen",
    "Junk",
    "reference_messages",
    "sent_by",
    "needed_by",
    "named_messages",
    "timed_payloads",
    "check_order_on_wire",
]

_NOTES = (gloo_ops.NOTIFY_SEND_READY, gloo_ops.NOTIFY_RECV_READY)


class Name(NamedTuple):
    """A message of a correct run: ``kind`` "act" (stage ``stage``'s output, sent to stage + 1's rank) or
    "grad" (stage ``stage``'s input gradient, sent back to stage − 1's rank), of ``microbatch``."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        if self.kind == "act":
            return f"stage {self.stage}'s activation of micro-batch {self.microbatch}"
        elif self.kind == "grad":
            return f"stage {self.stage}'s input gradient of micro-batch {self.microbatch}"
        else:
            raise ValueError(f"message kind {self.kind!r}: valid kinds are 'act' and 'grad'")


class Expected(NamedTuple):
    """Where a reference message goes and what it carries (a float32 tensor's bytes, as gloo sends them)."""

    src: int
    dst: int
    payload: bytes


class Seen(NamedTuple):
    """A payload on the wire that equals reference message ``name``: its direction, and when its first and last
    bytes crossed (seconds of the timeline's segments)."""

    name: Name
    src: int
    dst: int
    first: float
    last: float


class Junk(NamedTuple):
    """A payload on the wire that equals no reference message."""

    src: int
    dst: int
    first: float
    last: float
    nbytes: int


# The messages of a correct run ----------------------------------------------------------------------------------


def _bytes(t: torch.Tensor, what: str) -> bytes:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() == 0:
        got = f"a {t.dtype} tensor of {t.numel()} elements" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what}: needs a non-empty float32 tensor (an empty one cannot be told apart), got {got}")
    return t.detach().cpu().contiguous().numpy().tobytes()  # gloo sends the tensor's memory, native order


def reference_messages(
    acts: Mapping[tuple[int, int], torch.Tensor],
    grads: Mapping[tuple[int, int], torch.Tensor],
    p: int,
    v: int,
    m: int,
    placement: str = "loop",
) -> dict[Name, Expected]:
    """The messages a correct run sends, keyed by name: ``acts[(s, j)]`` (stage s's output for micro-batch j,
    s = 0 .. p·v − 2) goes from the rank holding s to the one holding s + 1, ``grads[(s, j)]`` (stage s's input
    gradient, s = 1 .. p·v − 1) back from the rank holding s to the one holding s − 1; where both stages are on
    one rank nothing crosses, and there is no message.  Raises ValueError where a tensor is missing, extra, not
    float32, or two messages carry the same bytes (then a payload would not name one message).

    >>> ref = reference_messages({(0, 0): a}, {(1, 0): g}, p=2, v=1, m=1)
    >>> ref[Name("act", 0, 0)].src, ref[Name("grad", 1, 0)].dst
    (0, 0)
    """
    last = p * v - 1
    rank = {s: rank_and_chunk(s, p, placement)[0] for s in range(last + 1)}  # validates the placement too
    found: dict[Name, Expected] = {}
    for kind, given, stages, step in (("act", acts, range(last), 1), ("grad", grads, range(1, last + 1), -1)):
        want = {(s, j) for s in stages for j in range(m)}
        if set(given) != want:
            missing, extra = sorted(want - set(given)), sorted(set(given) - want)
            raise ValueError(
                f"{kind}s: needs one tensor per (stage, micro-batch) of stages {stages.start} .. {stages.stop - 1} "
                f"and micro-batches 0 .. {m - 1}; missing {missing or 'none'}, not expected {extra or 'none'}"
            )
        for s, j in sorted(want):
            if rank[s] != rank[s + step]:
                found[Name(kind, s, j)] = Expected(rank[s], rank[s + step], _bytes(given[s, j], f"{kind}s[{s, j}]"))
    by_value: dict[bytes, Name] = {}
    for name, e in found.items():
        if e.payload in by_value:
            raise ValueError(f"{name} and {by_value[e.payload]} carry the same bytes: draw the inputs again")
        by_value[e.payload] = name
    return found


def sent_by(a: Action, p: int, v: int, placement: str = "loop") -> Name | None:
    """The message action ``a`` sends, if any: F of s, j sends act(s, j) where stage s + 1 is on another rank; B
    or I of s, j sends grad(s, j) where s > 0 and stage s − 1 is on another rank; W sends nothing."""
    return _crossing(a, p, v, placement, own=True)


def needed_by(a: Action, p: int, v: int, placement: str = "loop") -> Name | None:
    """The message action ``a`` waits for, if any: F of s, j needs act(s − 1, j), B or I of s, j needs
    grad(s + 1, j), where that stage is on another rank; W needs nothing that crosses."""
    return _crossing(a, p, v, placement, own=False)


def _crossing(a: Action, p: int, v: int, placement: str, own: bool) -> Name | None:
    if a.kind == "F":
        kind, step = "act", 1
    elif a.kind in ("B", "I"):
        kind, step = "grad", -1
    elif a.kind == "W":
        return None
    else:
        raise ValueError(f"action {a!r}: kind must be one of F, B, I, W")
    # sending, the message is this stage's own; receiving, it is the neighbour's that the order's data comes from
    there = a.stage + step if own else a.stage - step
    if not 0 <= there < p * v:
        return None
    if rank_and_chunk(there, p, placement)[0] == rank_and_chunk(a.stage, p, placement)[0]:
        return None
    return Name(kind, a.stage if own else there, a.microbatch)


# What the wire shows, named ----------------------------------------------------------------------------------


def timed_payloads(timeline: Timeline, src: int, dst: int) -> list[tuple[float, float, int, bytes]]:
    """(first byte's time, last byte's time, gloo's slot, payload) of each send from ``src`` to ``dst``, in the order
    they crossed: the sends among gloo's operations (``operations``, placed by byte position) zipped with their
    payloads (``messages``, from the same bytes); the slot names the collective call or tag a send belongs to.
    Raises ``gloo_ops.NotGloo`` where the bytes are not gloo's, ``wire.Unobserved`` where they were not captured or
    crossed on more than one connection."""
    sends = [
        (first, last, slot, length)
        for first, last, opcode, slot, length in timeline.operations(src, dst)
        if opcode not in _NOTES
    ]
    payloads = timeline.messages(src, dst)
    if len(sends) != len(payloads) or any(n != len(b) for (_, _, _, n), b in zip(sends, payloads)):
        raise RuntimeError(f"rank {src} -> rank {dst}: gloo's sends and their payloads disagree (a bug of the kit)")
    return [(first, last, slot, payload) for (first, last, slot, _), payload in zip(sends, payloads)]


def named_messages(timeline: Timeline, reference: Mapping[Name, Expected]) -> tuple[list[Seen], list[Junk]] | None:
    """Every payload the grader's capture shows between two ranks, named by its value: the reference message
    whose bytes it equals exactly (on whichever direction it crossed: :func:`check_order_on_wire` checks that),
    in the order of their first bytes; and the payloads that equal none (junk).  None in the student's own
    kernel (``source="trace"``), where no wire is seen.  Raises ``gloo_ops.NotGloo`` where a direction's
    bytes are not gloo's operations, ``wire.Unobserved`` where the wire was not captured."""
    if timeline.source == "trace":
        return None
    by_value = {e.payload: name for name, e in reference.items()}
    directions = {(e.src, e.dst) for e in reference.values()} | set(timeline.data or {})
    seen, junk = [], []
    for src, dst in sorted(directions):
        for first, last, _, payload in timed_payloads(timeline, src, dst):
            name = by_value.get(payload)
            if name is None:
                junk.append(Junk(src, dst, first, last, len(payload)))
            else:
                seen.append(Seen(name, src, dst, first, last))
    seen.sort(key=lambda s: (s.first, s.last))
    junk.sort(key=lambda j: (j.first, j.last))
    return seen, junk


# The check -------------------------------------------------------------------------------------------------


def _what_crossed(case: str, seen: list[Seen], junk: list[Junk], reference: Mapping[Name, Expected]) -> None:
    """(a): each reference message once, on its own direction, and nothing else."""
    times: dict[Name, list[Seen]] = {}
    for s in seen:
        times.setdefault(s.name, []).append(s)
    problems = [
        f"{len(junk)} payload(s) equal to no activation or input gradient of a correct run: "
        + ", ".join(f"rank {j.src} -> rank {j.dst}, {j.nbytes} bytes, at {ms(j.first)}" for j in junk[:5])
        + (" ..." if len(junk) > 5 else "")
    ] * bool(junk)
    for name, e in reference.items():
        got = times.get(name, [])
        wrong = [s for s in got if (s.src, s.dst) != (e.src, e.dst)]
        if not got:
            problems.append(f"{name} (rank {e.src} -> rank {e.dst}) never crossed")
        elif wrong:
            where = ", ".join(f"rank {s.src} -> rank {s.dst} at {ms(s.first)}" for s in wrong)
            problems.append(f"{name} crossed {where}, where it goes from rank {e.src} to rank {e.dst}")
        elif len(got) > 1:
            problems.append(
                f"{name} (rank {e.src} -> rank {e.dst}) crossed {len(got)} times, at "
                + ", ".join(ms(s.first) for s in got)
            )
    if problems:
        raise AssertionError(
            f"{case}: the grader's capture of the wire does not show each activation and input gradient crossing once: "
            + "; ".join(problems)
            + ". Send each stage's output once to the rank holding the next stage (dist.send / dist.recv), each input "
            "gradient once back, and nothing else between the ranks."
        )


def check_order_on_wire(
    case: str,
    timeline: Timeline,
    order: Order,
    p: int,
    v: int,
    m: int,
    placement: str,
    reference: Mapping[Name, Expected],
) -> None:
    """Fail unless the grader's capture shows the ranks ran ``order`` (checked by ``orders.check_order``): (a)
    every message of ``reference`` (:func:`reference_messages`) crossed exactly once, on its own direction, and
    no other payload crossed; (b) for each rank and each action k of its list, the message k sends left (its
    first byte) after the last byte of every message that the rank's actions up to k wait for had arrived.
    Equal times pass (the capture's clock has microseconds), so a run that keeps the order never fails (b).
    In the student's own kernel (``source="trace"``) nothing is checked: only grading sees the wire.  An
    unobserved wire raises ``wire.Unobserved``, never a pass."""
    check_order(order, p, v, m, placement)
    try:
        named = named_messages(timeline, reference)
    except gloo_ops.NotGloo as e:
        raise AssertionError(
            f"{case}: the bytes between the ranks are not gloo's messages ({e}); the ranks must talk through "
            "torch.distributed alone"
        ) from None
    if named is None:
        return
    seen, junk = named
    _what_crossed(case, seen, junk, reference)
    at = {s.name: s for s in seen}  # once each now
    early = []
    for r, actions in enumerate(order):
        waited: tuple[float, Name, Action] | None = None  # the latest arrival the actions so far wait for
        for k, a in enumerate(actions):
            need = needed_by(a, p, v, placement)
            if need is not None and (waited is None or at[need].last > waited[0]):
                waited = (at[need].last, need, a)
            sent = sent_by(a, p, v, placement)
            if sent is not None and waited is not None and at[sent].first < waited[0]:
                early.append((at[sent].first, r, k, a, sent, waited))
    if early:
        early.sort()
        lines = [
            f"rank {r} sent {sent} (its action {k + 1}, {a}) at {ms(t)}, before {need} had arrived "
            f"({ms(arrived)}), which its action {by}{' itself' if by == a else ', earlier in its list,'} waits for"
            for t, r, k, a, sent, (arrived, need, by) in early[:3]
        ]
        raise AssertionError(
            f"{case}: the ranks did not run the order given ({len(early)} message(s) sent too early): "
            + "; ".join(lines)
            + f". Rank {early[0][1]}'s order is {' '.join(map(str, order[early[0][1]]))}: each rank runs its "
            "actions one after another in that order, so it sends nothing for an action before it has received "
            "what the actions before it wait for."
        )
