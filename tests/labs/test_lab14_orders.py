"""Lab 14's reference (under construction): pipeline schedules as per-rank orders, and the simulator that times them.

- Placements: ``stage_of`` and ``rank_and_chunk`` invert each other, "loop" and "v".
- The simulator against the textbook (Narayanan et al. 2021): 1F1B's bubble (p − 1)/m and interleaved
  1F1B's (p − 1)/(v·m) exactly, on torch's own interleaved order; the activations rank 0 holds (p, and
  p + (p − 1)/v).
- torch's zero-bubble orders (ZB-H1, ZB-V, DualPipeV) simulated with F = I = W = 1: the bubble and memory
  they reach, each value derived in its test's docstring.
- Every order torch gives does each piece of work once and runs without deadlock; torch's own 1F1B IR is
  wrong on the last rank (so ``torch_order("1F1B")`` is the textbook's).
- Wrong orders are refused with a message that names the rank, the action and what it waits for; GPipe,
  which runs, holds m micro-batches where 1F1B holds p.

All pure Python beside torch's schedule classes (no process group): each test well under a second.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest

from disttrain_lab.labtests.lab14 import (
    SCHEDULES,
    Action,
    bubble_formula,
    check_order,
    gpipe_order,
    held,
    one_f_one_b_order,
    rank_and_chunk,
    simulate,
    stage_of,
    torch_order,
    torch_pipeline_order,
)

UNIT = {"F": 1, "I": 1, "W": 1}  # the zero-bubble papers' balanced case: F = I = W (so B = I + W = 2)


def _bubble(sim) -> Fraction:
    """The simulator's bubble as an exact fraction, from its (integer) times."""
    return Fraction(sim.makespan - max(sim.busy), max(sim.busy))


# Placements


@pytest.mark.parametrize("placement, vs", [("loop", (1, 2, 3)), ("v", (2,))])
def test_stage_of_and_rank_and_chunk_invert_each_other(placement, vs):
    for p in (1, 2, 3, 4, 5):
        for v in vs:
            stages = [stage_of(r, c, p, placement) for r in range(p) for c in range(v)]
            assert sorted(stages) == list(range(p * v)), "each stage on one rank, as one chunk"
            for r in range(p):
                for c in range(v):
                    assert rank_and_chunk(stage_of(r, c, p, placement), p, placement) == (r, c)
    assert [stage_of(1, c, 4, "loop") for c in range(2)] == [1, 5]
    assert [stage_of(1, c, 4, "v") for c in range(2)] == [1, 6]  # the V comes back down: rank 1 holds 1 and 2p − 2
    with pytest.raises(ValueError, match="valid placements"):
        stage_of(0, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="chunks 0 and 1"):
        stage_of(0, 2, 4, "v")


# The textbook


def test_one_f_one_b_bubble_and_memory_are_the_textbook_ones():
    """p = 4, m = 8, F = 1, B = 2: each rank computes 8·3 = 24; the last micro-batch's backward reaches
    rank 0 (p − 1)(F + B) = 9 later than if there were no pipeline, so the makespan is 33 and the bubble
    9/24 = 3/8 = (p − 1)/m.  Rank r holds p − r micro-batches at most (its warm-up and one more)."""
    sim = simulate(one_f_one_b_order(4, 8), p=4, v=1, m=8)
    assert (sim.makespan, sim.busy) == (33, [24, 24, 24, 24])
    assert sim.bubble == 0.375 == bubble_formula("1F1B", 4, 1, 8)
    assert [held(order) for order in one_f_one_b_order(4, 8)] == [4, 3, 2, 1]
    # a backward as cheap as a forward leaves the fraction as it is: (p − 1)(F + B) over m(F + B)
    cheap = simulate(one_f_one_b_order(4, 8), p=4, v=1, m=8, costs={"B": 1})
    assert (cheap.makespan, cheap.busy[0], _bubble(cheap)) == (22, 16, Fraction(3, 8))
    assert simulate(one_f_one_b_order(4, 8), 4, 1, 8, costs=lambda rank, a: 1).makespan == 22


def test_torch_interleaved_1f1b_has_the_textbook_bubble_and_holds_p_plus_p_minus_1_over_v():
    """torch's Interleaved1F1B, p = 4, v = 2, F = 1, B = 2 per chunk: each rank computes 2m·3, and idles
    (p − 1)(F + B) = 9 (Narayanan §2.2.2: the bubble of one chunk's F and B, not a whole stage's), so
    9/48 = 3/16 at m = 8 and 9/72 = 1/8 at m = 12, both (p − 1)/(v·m).  Rank 0 runs (v − 1)·p + 2(p − 1) = 10
    warm-up forwards and one more before its first backward: 11 chunks of 1/2, 5.5 = p + (p − 1)/v; rank r
    holds r less (its warm-up is 2r chunks shorter)."""
    for m, makespan, busy, bubble in ((8, 57, 48, Fraction(3, 16)), (12, 81, 72, Fraction(1, 8))):
        orders = torch_order("Interleaved1F1B", 4, 2, m)
        sim = simulate(orders, p=4, v=2, m=m)
        assert (sim.makespan, sim.busy) == (makespan, [busy] * 4)
        assert _bubble(sim) == bubble == bubble_formula("Interleaved1F1B", 4, 2, m)
        assert [held(order) for order in orders] == [5.5, 4.5, 3.5, 2.5]


# torch's zero-bubble orders


def test_torch_zb_h1_removes_two_thirds_of_the_bubble_and_holds_as_much_as_1f1b():
    """ZB-H1 (Qi et al. 2024 §3: torch's InterleavedZeroBubble with v = 1), p = 4, m = 8, F = I = W = 1: each
    rank computes 24 as in 1F1B; rank r waits r for its first forward and p − 1 − r for its first I, W
    filling the rest, so every rank idles p − 1 = 3 where 1F1B idles 9 (the paper's (p − 1)(F + I − W)):
    makespan 27, bubble 3/24 = 1/8.  Rank r puts W off by r micro-batches (rank 3 runs I0 .. I3 before W0),
    and W frees the activations, so every rank holds p = 4: the same peak as 1F1B's rank 0."""
    orders = torch_order("InterleavedZeroBubble", 4, 1, 8)
    sim = simulate(orders, p=4, v=1, m=8, costs=UNIT)
    assert (sim.makespan, sim.busy) == (27, [24] * 4)
    assert _bubble(sim) == Fraction(1, 8) and sim.bubble == 0.125
    assert [held(order) for order in orders] == [4, 4, 4, 4]


def test_torch_zb_v_idles_only_p_minus_1_forwards_and_holds_as_much_as_1f1b():
    """ZB-V (Qi et al. 2024 §6: torch's ZBVZeroBubble, "v" placement), p = 4, m = 8, F = I = W = 1 per chunk:
    each rank computes 2 chunks × 8 × 3 = 48 and idles p − 1 = 3 in all (rank r: r before its first forward
    arrives, p − 1 − r at the end), a bubble that does not grow with m: 3/48 = 1/16.  Rank 0 runs 2p − 1 = 7
    forwards of stage 0 and one of stage 7 before its first W: 8 chunks of 1/2, 4 = p, on every rank."""
    orders = torch_order("ZBVZeroBubble", 4, 2, 8)
    sim = simulate(orders, p=4, v=2, m=8, costs=UNIT, placement="v")
    assert (sim.makespan, sim.busy) == (51, [48] * 4)
    assert _bubble(sim) == Fraction(1, 16) and sim.bubble == 0.0625
    assert [held(order) for order in orders] == [4, 4, 4, 4]
    sim16 = simulate(torch_order("ZBVZeroBubble", 4, 2, 16), p=4, v=2, m=16, costs=UNIT, placement="v")
    assert (sim16.makespan - max(sim16.busy), _bubble(sim16)) == (3, Fraction(1, 32))


def test_torch_dualpipev_matches_zb_v_here_and_holds_half_a_stage_more():
    """DualPipeV (torch's, "v" placement), p = 4, m = 8, F = I = W = 1 and B = 2 per chunk: its overlapped
    F-and-B pairs run one after the other here (the simulator has no compute-communication overlap), and it
    still idles p − 1 = 3 a rank (rank 0: three 1-long waits for a gradient mid-step; rank 3: 3 at the
    start): 3/48 = 1/16, as ZB-V.  When rank 0 runs stage 0's last forward (paired with 7B3) it holds stage
    0's first seven and stage 7's micro-batch 3 (0 .. 2 freed by their W): 9 chunks, 4.5 = p + 1/2."""
    orders = torch_order("DualPipeV", 4, 2, 8)
    sim = simulate(orders, p=4, v=2, m=8, costs=UNIT, placement="v")
    assert (sim.makespan, sim.busy) == (51, [48] * 4)
    assert _bubble(sim) == Fraction(1, 16)
    assert [held(order) for order in orders] == [4.5] * 4


# Every order torch gives


CASES = [(name, v) for name, vs in {
    "GPipe": (1,),
    "1F1B": (1,),
    "Interleaved1F1B": (2, 3),
    "InterleavedZeroBubble": (1, 2),
    "ZBVZeroBubble": (2,),
    "DualPipeV": (2,),
}.items() for v in vs]  # fmt: skip


@pytest.mark.parametrize("name, v", CASES)
@pytest.mark.parametrize("p, m", [(2, 4), (3, 6), (4, 8), (4, 12)])
def test_every_torch_order_does_each_piece_of_work_once_without_deadlock(name, v, p, m):
    placement = SCHEDULES[name]
    orders = torch_order(name, p, v, m)
    assert len(orders) == p
    for r, actions in enumerate(orders):
        counts = Counter(actions)
        assert max(counts.values()) == 1, f"rank {r} repeats an action"
        stages = {stage_of(r, c, p, placement) for c in range(v)}
        assert {a.stage for a in actions} == stages, f"rank {r} runs another rank's stage"
        for s in stages:
            for j in range(m):
                kinds = {k for k in "FBIW" if Action(k, s, j) in counts}
                assert kinds in ({"F", "B"}, {"F", "I", "W"}), (r, s, j, kinds)
        assert len(actions) == sum(2 if Action("B", s, j) in counts else 3 for s in stages for j in range(m))
    check_order(orders, p, v, m, placement)
    sim = simulate(orders, p, v, m, costs=UNIT, placement=placement)  # raises where it deadlocks
    assert len(sim.end) == sum(map(len, orders)) and sim.bubble >= 0


def test_torch_1f1b_ir_is_wrong_on_the_last_rank_so_torch_order_uses_the_textbook():
    """Schedule1F1B.pipeline_order (torch 2.13): right on ranks 0 .. p − 2, but the last rank runs F1, B0,
    F2, B1, ... F8 (micro-batch 0's forward never, micro-batch m's, which does not exist, instead).  Should
    torch fix it, its last rank becomes the textbook's and this test says so by passing either way."""
    textbook, ir = one_f_one_b_order(4, 8), torch_pipeline_order("1F1B", 4, 1, 8)
    assert torch_order("1F1B", 4, 1, 8) == textbook
    assert ir[:3] == textbook[:3]
    shifted = [a for j in range(8) for a in (Action("F", 3, j + 1), Action("B", 3, j))]
    assert ir[3] in (textbook[3], shifted)
    if ir[3] == shifted:
        with pytest.raises(ValueError, match=r"rank 3's action .*microbatch=8.*micro-batch < m = 8"):
            check_order(ir, 4, 1, 8)


# Wrong orders


def test_a_backward_before_its_own_forward_deadlocks_with_a_message_naming_the_cause():
    orders = one_f_one_b_order(4, 8)
    orders[0][0], orders[0][4] = orders[0][4], orders[0][0]  # rank 0: B0 first, its F0 fifth
    with pytest.raises(ValueError) as caught:
        simulate(orders, 4, 1, 8)
    message = str(caught.value)
    assert message.startswith("deadlock: no rank can run its next action")
    assert "rank 0 is stuck at 0B0: it waits for 0F0, which comes later in its own order" in message
    assert "rank 1 is stuck at 1F0: it waits for 0F0, which rank 0 has not run (it is stuck at 0B0)" in message


def test_warm_ups_the_wrong_way_round_deadlock_across_ranks():
    """Rank r warming up r forwards instead of p − r − 1: rank 0 turns to its first backward at once, which
    waits for rank 1's, which waits for a forward that rank 0 has not run: a cycle between two ranks."""

    def with_warmup(r: int, warmup: int, m: int) -> list[Action]:
        steady = [a for j in range(warmup, m) for a in (Action("F", r, j), Action("B", r, j - warmup))]
        return [Action("F", r, j) for j in range(warmup)] + steady + [Action("B", r, j) for j in range(m - warmup, m)]

    orders = [with_warmup(r, r, 8) for r in range(4)]
    check_order(orders, 4, 1, 8)  # every piece of work once: only the order is wrong
    with pytest.raises(ValueError) as caught:
        simulate(orders, 4, 1, 8)
    assert "rank 0 is stuck at 0B0: it waits for 1B0, which rank 1 has not run (it is stuck at 1F1)" in str(
        caught.value
    )
    assert "rank 1 is stuck at 1F1: it waits for 0F1, which rank 0 has not run (it is stuck at 0B0)" in str(
        caught.value
    )


def test_a_w_before_its_i_deadlocks():
    orders = torch_order("InterleavedZeroBubble", 2, 1, 4)
    at = orders[0].index(Action("W", 0, 0))
    orders[0].insert(orders[0].index(Action("I", 0, 0)), orders[0].pop(at))
    with pytest.raises(
        ValueError, match="rank 0 is stuck at 0W0: it waits for 0I0, which comes later in its own order"
    ):
        simulate(orders, 2, 1, 4, costs=UNIT)


def test_gpipe_runs_with_1f1b_s_bubble_but_holds_m_micro_batches():
    """GPipe in 1F1B's place is no deadlock: the same makespan (33) and bubble (3/8), but rank 0 holds all m = 8
    micro-batches where 1F1B holds p = 4: the order is wrong for 1F1B only by its memory."""
    sim = simulate(gpipe_order(4, 8), 4, 1, 8)
    assert (sim.makespan, _bubble(sim)) == (33, Fraction(3, 8)) == (33, bubble_formula("GPipe", 4, 1, 8))
    assert held(gpipe_order(4, 8)[0]) == 8 and held(one_f_one_b_order(4, 8)[0]) == 4
    assert held(gpipe_order(4, 8)[0], until=3) == 3  # the first three actions only


def test_check_order_refuses_work_missing_repeated_or_on_the_wrong_rank():
    orders = one_f_one_b_order(2, 2)
    with pytest.raises(ValueError, match=r"rank 0's action 1F0: stage 1 is on rank 1"):
        check_order([[*orders[0], Action("F", 1, 0)], orders[1]], 2, 1, 2)
    with pytest.raises(ValueError, match="rank 1 runs 1B1 more than once"):
        check_order([orders[0], [*orders[1], Action("B", 1, 1)]], 2, 1, 2)
    with pytest.raises(ValueError, match=r"rank 0, stage 0, micro-batch 1: runs \['F'\]; needs F and B, or F, I and W"):
        check_order([orders[0][:-1], orders[1]], 2, 1, 2)
    with pytest.raises(ValueError, match="not p = 2"):
        check_order(orders[:1], 2, 1, 2)
    with pytest.raises(ValueError, match="costs for"):
        simulate(orders, 2, 1, 2, costs={"X": 1})
    with pytest.raises(ValueError, match="for a zero-bubble schedule, simulate"):
        bubble_formula("ZBVZeroBubble", 4, 2, 8)
