"""Lab 14's order checked on the wire (``wireorder``), on synthetic captures framed as gloo frames them.

- The reference: which activations and input gradients cross, and between which ranks ("loop" and "v").
- A run timed by torch's Interleaved1F1B order (p = 2, v = 2, m = 4; ``orders.simulate``, 10 ms a unit, each
  message leaving at its action's end and arriving 1 ms later) passes; ZBVZeroBubble's on "v" too.
- The same messages timed by GPipe's order, or by interleaved 1F1B with one warm-up forward more on rank 0,
  fail the order check, naming the rank, the action and both messages.
- Junk, a missing message, a duplicate and one of the right size but other values each fail, saying so.

Pure Python beside the schedules' constructors: each test well under a second.
"""

from __future__ import annotations

import struct

import pytest
import torch

from disttrain_lab import wire, wiretimeline
from disttrain_lab.labtests.lab14.orders import Action, simulate, torch_order
from disttrain_lab.labtests.lab14.wireorder import (
    Name,
    check_order_on_wire,
    named_messages,
    reference_messages,
)

UNIT, LATENCY = 0.010, 0.001  # seconds per unit of the simulator's costs; a message's first to last byte
P, V, M = 2, 2, 4


def _op(opcode: int, payload: bytes = b"", length: int = 0) -> bytes:
    """One of gloo's operations: its 48-byte preamble (nbytes, opcode, slot, offset, length, roffset), a send's payload."""
    nbytes = wire.GLOO_PREAMBLE + len(payload)
    return struct.pack("<6Q", nbytes, opcode, 0, 0, len(payload) or length, 0) + payload


def _timeline(sends: list[tuple[int, int, float, float, bytes]]) -> wiretimeline.Timeline:
    """A capture of point-to-point messages (src, dst, first byte's time, last byte's time, payload) as gloo puts
    them on the wire: the sender's note and then its preamble with the first half of the payload at the first
    time, the rest at the last; the receiver's note the other way half a millisecond before; rank 0's handshake
    to rank 1 first.  A direction's messages must not overlap in time (TCP keeps its bytes in order)."""
    pieces = [(0.0, 0, 1, struct.pack("<Q", 1))]
    for src, dst, first, last, payload in sends:
        half = wire.GLOO_PREAMBLE + len(payload) // 2
        pieces += [
            (first - LATENCY / 2, dst, src, _op(3, length=len(payload))),  # NOTIFY_RECV_READY
            (first, src, dst, _op(2, length=len(payload)) + _op(1, payload)[:half]),  # NOTIFY_SEND_READY, SEND
            (last, src, dst, _op(1, payload)[half:]),
        ]
    pieces.sort(key=lambda piece: piece[0])  # (stable: a message's pieces of one time stay in order)
    data: dict[tuple[int, int], list[bytes]] = {}
    for _, a, b, chunk in pieces:
        data.setdefault((a, b), [b""])[0] += chunk
    return wiretimeline.Timeline(segments=[(t, a, b, len(chunk)) for t, a, b, chunk in pieces], data=data)


def _reference(p=P, v=V, m=M, placement="loop", seed=0):
    """Random float32 activations and input gradients of uneven sizes (stage s's output: (j + 1, s + 3))."""
    g = torch.Generator().manual_seed(seed)
    acts = {(s, j): torch.randn(j + 1, s + 3, generator=g) for s in range(p * v - 1) for j in range(m)}
    grads = {(s, j): torch.randn(j + 1, s + 2, generator=g) for s in range(1, p * v) for j in range(m)}
    return acts, grads, reference_messages(acts, grads, p, v, m, placement)


def _run(order, reference, p=P, v=V, m=M, placement="loop", costs=None):
    """The sends of a run that executes ``order``: F of s, j sends stage s's output at its end, B or I of s, j
    its input gradient, where the next (previous) stage is on another rank; written out here, not with the
    module's own ``sent_by``."""
    end = simulate(order, p, v, m, costs, placement).end
    sends = []
    for a, t in end.items():
        name = Name("act", a.stage, a.microbatch) if a.kind == "F" else Name("grad", a.stage, a.microbatch)
        if a.kind != "W" and name in reference:
            e = reference[name]
            sends.append((e.src, e.dst, t * UNIT, t * UNIT + LATENCY, e.payload))
    return sends


def _gpipe_loop(p, v, m):
    """GPipe on the "loop" placement: every forward of each chunk in turn, then every backward, last chunk first."""
    return [
        [Action("F", c * p + r, j) for c in range(v) for j in range(m)]
        + [Action("B", c * p + r, j) for c in reversed(range(v)) for j in range(m)]
        for r in range(p)
    ]


def _check(sends, order=None, reference=None, **kw):
    reference = reference if reference is not None else _reference()[2]
    order = order if order is not None else torch_order("Interleaved1F1B", P, V, M)
    args = dict(p=P, v=V, m=M, placement="loop") | kw
    check_order_on_wire("run_order", _timeline(sends), order, reference=reference, **args)


def test_the_reference_names_the_messages_that_cross():
    acts, grads, ref = _reference()
    # "loop", p = 2: every stage boundary crosses, rank s % 2 -> (s ± 1) % 2
    assert {(n.kind, n.stage) for n in ref} == {("act", s) for s in range(3)} | {("grad", s) for s in (1, 2, 3)}
    assert ref[Name("act", 1, 2)][:2] == (1, 0) and ref[Name("grad", 1, 2)][:2] == (1, 0)
    assert ref[Name("act", 2, 0)].payload == acts[2, 0].numpy().tobytes()
    # "v", p = 2: stages 1 and 2 are both on rank 1, so nothing crosses between them
    vee = _reference(placement="v")[2]
    assert Name("act", 1, 0) not in vee and Name("grad", 2, 0) not in vee
    assert vee[Name("act", 2, 3)][:2] == (1, 0) and vee[Name("grad", 3, 3)][:2] == (0, 1)
    with pytest.raises(ValueError, match=r"missing \[\(0, 3\)\]"):
        reference_messages({k: t for k, t in acts.items() if k != (0, 3)}, grads, P, V, M)
    with pytest.raises(ValueError, match="carry the same bytes"):
        reference_messages({**acts, (1, 1): acts[0, 1]}, grads, P, V, M)  # (0, 1) and (1, 1) alike: not told apart
    with pytest.raises(ValueError, match="float32"):
        reference_messages({**acts, (0, 0): acts[0, 0].double()}, grads, P, V, M)


@pytest.mark.parametrize(
    "schedule, placement, costs",
    [("Interleaved1F1B", "loop", None), ("ZBVZeroBubble", "v", {"F": 1, "I": 1, "W": 1})],
)
def test_a_run_of_the_order_passes(schedule, placement, costs):
    ref = _reference(placement=placement)[2]
    order = torch_order(schedule, P, V, M)
    sends = _run(order, ref, placement=placement, costs=costs)
    assert len(sends) == len(ref)
    _check(sends, order, ref, placement=placement)
    seen, junk = named_messages(_timeline(sends), ref)
    assert not junk and sorted(s.name for s in seen) == sorted(ref)
    first = min(seen, key=lambda s: s.first)  # 0F0's output, at the end of the first unit
    assert first.name == Name("act", 0, 0) and (first.first, first.last) == (UNIT, UNIT + LATENCY)


def test_gpipes_run_fails_the_interleaved_order():
    ref = _reference()[2]
    sends = _run(_gpipe_loop(P, V, M), ref)
    _check(sends, _gpipe_loop(P, V, M), ref)  # it is a run of GPipe's order
    with pytest.raises(AssertionError) as said:
        _check(sends, reference=ref)
    message = str(said.value)
    print(message)
    # rank 0 runs 0F0 0F1 2F0 2F1 0F2: 0F2 sends only after 2F1's input (stage 1's activation of 1) is in
    assert "run_order: the ranks did not run the order given" in message
    assert (
        "rank 0 sent stage 0's activation of micro-batch 2 (its action 5, 0F2) at 30.000 ms, before stage 1's "
        "activation of micro-batch 1 had arrived (31.000 ms), which its action 2F1, earlier in its list, waits for"
    ) in message
    # and the other way round: interleaved 1F1B's run sends rank 1's first gradient before GPipe had run 3F3
    with pytest.raises(
        AssertionError, match=r"rank 1 sent stage 3's input gradient of micro-batch 0 \(its action 9, 3B0\)"
    ):
        _check(_run(torch_order("Interleaved1F1B", P, V, M), ref), _gpipe_loop(P, V, M), ref)


def test_a_wrong_warm_up_fails():
    # rank 0 runs one more forward of its first chunk before its second chunk starts
    ref = _reference()[2]
    good = torch_order("Interleaved1F1B", P, V, M)
    wrong = [list(actions) for actions in good]
    wrong[0].remove(Action("F", 0, 2))
    wrong[0].insert(2, Action("F", 0, 2))
    with pytest.raises(
        AssertionError, match=r"rank 0 sent stage 0's activation of micro-batch 2 \(its action 5, 0F2\)"
    ):
        _check(_run(wrong, ref), good, ref)
    # the other way round passes: a run that waits for more than its order needs is not caught (the check is a
    # necessary condition: nothing sent before what the order had waited for had arrived)
    _check(_run(good, ref), wrong, ref)


def _good():
    ref = _reference()[2]
    return ref, _run(torch_order("Interleaved1F1B", P, V, M), ref)


def test_junk_fails():
    ref, sends = _good()
    extra = torch.randn(7, generator=torch.Generator().manual_seed(9)).numpy().tobytes()
    with pytest.raises(AssertionError) as said:
        _check([*sends, (1, 0, 0.2, 0.2 + LATENCY, extra)], reference=ref)
    print(said.value)
    assert (
        "1 payload(s) equal to no activation or input gradient of a correct run: rank 1 -> rank 0, 28 bytes, at 200.000 ms"
        in str(said.value)
    )


def test_a_missing_message_fails():
    ref, sends = _good()
    gone = ref[Name("grad", 3, 1)].payload
    with pytest.raises(AssertionError) as said:
        _check([s for s in sends if s[4] != gone], reference=ref)
    print(said.value)
    assert "stage 3's input gradient of micro-batch 1 (rank 1 -> rank 0) never crossed" in str(said.value)


def test_a_duplicate_fails():
    ref, sends = _good()
    again = next(s for s in sends if s[4] == ref[Name("act", 0, 1)].payload)
    with pytest.raises(AssertionError) as said:
        _check([*sends, (*again[:2], 0.5, 0.5 + LATENCY, again[4])], reference=ref)
    print(said.value)
    assert "stage 0's activation of micro-batch 1 (rank 0 -> rank 1) crossed 2 times, at 20.000 ms, 500.000 ms" in str(
        said.value
    )


def test_the_right_size_with_other_values_is_junk():
    ref, sends = _good()
    name = Name("act", 2, 3)
    forged = (
        torch.zeros(4, 5).numpy().tobytes()
    )  # stage 2's output of micro-batch 3 is (4, 5): its size, not its values
    assert len(forged) == len(ref[name].payload)
    with pytest.raises(AssertionError) as said:
        _check([s if s[4] != ref[name].payload else (*s[:4], forged) for s in sends], reference=ref)
    message = str(said.value)
    print(message)
    assert "1 payload(s) equal to no activation or input gradient" in message and f"{len(forged)} bytes" in message
    assert "stage 2's activation of micro-batch 3 (rank 0 -> rank 1) never crossed" in message


def test_a_message_on_the_wrong_direction_fails():
    # rank 1 sends stage 1's activation back to rank 0 ... of the wrong pair: with p = 3 it goes 1 -> 2
    g = torch.Generator().manual_seed(3)
    acts = {(s, 0): torch.randn(2, generator=g) for s in range(2)}
    grads = {(s, 0): torch.randn(2, generator=g) for s in (1, 2)}
    ref = reference_messages(acts, grads, 3, 1, 1)
    order = [[Action("F", r, 0), Action("B", r, 0)] for r in range(3)]
    sends = [(e.src, e.dst, 0.01 * i, 0.01 * i + LATENCY, e.payload) for i, e in enumerate(ref.values(), 1)]
    sends[1] = (1, 0, *sends[1][2:])
    with pytest.raises(
        AssertionError,
        match=r"stage 1's activation of micro-batch 0 crossed rank 1 -> rank 0 at 20\.000 ms, where it goes from rank 1 to rank 2",
    ):
        check_order_on_wire("run_order", _timeline(sends), order, 3, 1, 1, "loop", ref)


def test_bytes_that_are_not_gloos_fail_and_an_unobserved_wire_raises():
    ref, sends = _good()
    timeline = _timeline(sends)
    timeline.data[0, 1][0] += b"\0" * 5
    order = torch_order("Interleaved1F1B", P, V, M)
    with pytest.raises(AssertionError, match="not gloo's messages"):
        check_order_on_wire("run_order", timeline, order, P, V, M, "loop", ref)
    with pytest.raises(wire.Unobserved):
        check_order_on_wire("run_order", wiretimeline.Timeline.unobserved("no capture"), order, P, V, M, "loop", ref)
