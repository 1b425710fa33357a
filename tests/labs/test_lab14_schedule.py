"""Lab 14's exercises 1 and 4 (under construction): ``interleaved_order(p, v, m)`` and ``zb_h1_order(p, m)``,
graded action by action against torch's ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble (v = 1).

- The right answers here are rule-based, written from the schedules' rules as the lab would state them
  (Narayanan et al. 2021 §2.2.2 with torch's rounds; Qi et al. 2024's ZB-H1 as torch orders it), not read
  from ``torch_order``: they equal torch's orders on every case torch accepts (p ≤ 5, v ≤ 3, m ≤ 12), and
  the checks refuse none of those cases.
- The graded cases (here until the notebook's hidden blocks hold them) are not the one the self-checks show,
  and include m not a multiple of p where torch accepts it.
- Wrong orders fail with a message naming the rank, the position, the student's action and torch's, with a
  window of both: GPipe's order, 1F1B's with v ignored, the interleaved warm-up of ZB (p − 1 − r instead of
  2(p − 1 − r)), ZB-H1 with each W right after its I (1F1B with a split backward).
- What is not an order (a dict, strings with junk, too many actions, a rank too few) is refused by
  ``parse_order`` with the rule, the value seen and what would be valid.
- End to end: the graded checks run the notebook's function through ``dl.exercise.run`` on one rank in this
  process, the function stood in as ``__main__``'s (as test_lab05 does): one run per check, a second or so.
"""

from __future__ import annotations

import pytest

from disttrain_lab import exercise
from disttrain_lab.labtests import lab14
from disttrain_lab.labtests.lab14 import (
    SHOWN_INTERLEAVED,
    SHOWN_ZB_H1,
    compare_order,
    one_f_one_b_order,
    parse_order,
    torch_order,
)
from tests.helpers import notebook_names

# The graded cases, as the graded cells' hidden blocks will pass them (lab 14's notebook is not written yet): odd p,
# v = 3, and m not a multiple of p where torch accepts it (4, 10: two rounds of 5; 4, 3 and 4, 6: one round of m)
INTERLEAVED_CASES = [(3, 2, 6), (4, 2, 8), (2, 3, 6), (4, 2, 10), (4, 2, 3)]  # (p, v, m)
ZB_H1_CASES = [(3, 6), (4, 8), (4, 6), (4, 3), (5, 10)]  # (p, m)


# The right answers, from the rules ----------------------------------------------------------------------------


def _interleaved(p: int, v: int, m: int, warmup_hops: int = 2) -> list[list[str]]:
    """Interleaved 1F1B, rank r holding stages r, r + p, ... (its chunks).  The micro-batches go in rounds of
    ``per`` = m // max(1, m // p) (p when p divides m, as in the paper; torch needs m to fill whole rounds);
    the k-th forward of a rank runs chunk (k // per) % v on micro-batch (k // (per·v))·per + k % per, its k-th
    backward the same micro-batch on chunk v − 1 − (k // per) % v.  Rank r warms up with (v − 1)·per forwards
    for the chunks before the last, and 2 more per rank after it (``warmup_hops``: a forward there and its
    backward back), at most v·m; then one forward and one backward in turn; then the backwards left."""
    per = m // max(1, m // p)
    order = []
    for r in range(p):
        forwards = [_nth(k, "F", r, p, v, per) for k in range(v * m)]
        backwards = [_nth(k, "B", r, p, v, per) for k in range(v * m)]
        warmup = min((v - 1) * per + warmup_hops * (p - 1 - r), v * m)
        steady = [a for k in range(v * m - warmup) for a in (forwards[warmup + k], backwards[k])]
        order.append(forwards[:warmup] + steady + backwards[v * m - warmup :])
    return order


def _nth(k: int, kind: str, r: int, p: int, v: int, per: int) -> str:
    """Rank r's k-th forward (``kind`` "F") or backward ("B") of interleaved 1F1B, in rounds of ``per``."""
    chunk = (k // per) % v
    chunk = chunk if kind == "F" else v - 1 - chunk
    return f"{chunk * p + r}{kind}{(k // (per * v)) * per + k % per}"


def _zb_h1(p: int, m: int, w_after: int | None = None) -> list[list[str]]:
    """ZB-H1: 1F1B's warm-up (p − 1 − r forwards on rank r) and its F, I pairs, but rank r runs each W r
    backwards late (``w_after``: that many on every rank instead), the W's left at the end: the later ranks,
    which wait longest for their first gradient, fill the bubble with weight gradients."""
    order = []
    for r in range(p):
        late = r if w_after is None else w_after
        warmup = min(p - 1 - r, m)
        actions, done = [f"{r}F{j}" for j in range(warmup)], 0
        for b in range(m):
            actions += [f"{r}F{warmup + b}"] if warmup + b < m else []
            actions.append(f"{r}I{b}")
            if b >= late:
                actions.append(f"{r}W{done}")
                done += 1
        order.append(actions + [f"{r}W{j}" for j in range(done, m)])
    return order


def _gpipe(p: int, v: int, m: int) -> list[list[str]]:
    """Every forward of every chunk, then every backward, last chunk first."""
    stages = [[c * p + r for c in range(v)] for r in range(p)]
    return [
        [f"{s}F{j}" for s in mine for j in range(m)] + [f"{s}B{j}" for s in reversed(mine) for j in range(m)]
        for mine in stages
    ]


def _accepted(schedule: str, p: int, v: int, m: int) -> bool:
    try:
        torch_order(schedule, p, v, m)
    except ValueError as e:
        assert "multiple of the number of rounds" in str(e), e
        return False
    return True


def test_the_rules_are_torch_s_orders_on_every_case_torch_accepts():
    accepted = refused = 0
    for p in range(1, 6):
        for m in range(1, 13):
            for v in (1, 2, 3):
                if _accepted("Interleaved1F1B", p, v, m):
                    accepted += 1
                    call = f"interleaved_order({p}, {v}, {m})"
                    compare_order(
                        parse_order(_interleaved(p, v, m), p, v, m, call=call), "interleaved_order", (p, v, m), v
                    )
                else:
                    refused += 1
            if _accepted("InterleavedZeroBubble", p, 1, m):
                compare_order(parse_order(_zb_h1(p, m), p, 1, m, call="zb_h1_order"), "zb_h1_order", (p, m), 1)
    # torch refuses only m that does not fill whole rounds (m % max(1, m // p) != 0): 2, 5 and 3, 7 among them
    assert (accepted, refused) == (150, 30)
    assert not _accepted("Interleaved1F1B", 2, 2, 5) and not _accepted("Interleaved1F1B", 3, 2, 7)


def test_graded_cases_are_not_the_shown_ones_and_torch_accepts_them():
    assert {(3, 2, 6), (4, 2, 8)} <= set(INTERLEAVED_CASES) and SHOWN_INTERLEAVED not in INTERLEAVED_CASES
    assert SHOWN_ZB_H1 not in ZB_H1_CASES and SHOWN_INTERLEAVED == (2, 2, 4) and SHOWN_ZB_H1 == (2, 4)
    assert any(m % p for p, _, m in INTERLEAVED_CASES) and any(m % p for p, m in ZB_H1_CASES)
    assert any(v > 2 for _, v, _ in INTERLEAVED_CASES) and any(p % 2 for p, _, _ in INTERLEAVED_CASES)
    assert all(_accepted("Interleaved1F1B", *case) for case in INTERLEAVED_CASES)
    assert all(_accepted("InterleavedZeroBubble", p, 1, m) for p, m in ZB_H1_CASES)


# Wrong orders ---------------------------------------------------------------------------------------------------


def _verdict(name: str, got, case: tuple) -> str:
    """The message the graded check gives for ``got`` at ``case`` (it must fail)."""
    v = case[1] if name == "interleaved_order" else 1
    call = f"{name}({', '.join(map(str, case))})"
    with pytest.raises(AssertionError) as caught:
        compare_order(parse_order(got, case[0], v, case[-1], call=call), name, case, v)
    return str(caught.value)


def test_gpipe_s_order_fails_at_the_first_forward_of_the_second_chunk():
    said = _verdict("interleaved_order", _gpipe(3, 2, 6), (3, 2, 6))
    assert said == (
        "interleaved_order(3, 2, 6): rank 0's action 3 (counting from 0) is 0F3; torch's ScheduleInterleaved1F1B "
        "runs 3F0 there.\n"
        "  yours: 0F0 0F1 0F2 [0F3] 0F4 0F5 3F0 3F1 …\n"
        "  torch: 0F0 0F1 0F2 [3F0] 3F1 3F2 0F3 0F4 …\n"
        "Rank 0 runs 12 forwards before its first backward (B or I); torch's runs 8.\n"
        "Ranks 1, 2 differ from torch's too."
    ), said


def test_1f1b_with_v_ignored_fails_and_says_which_stage_it_never_runs():
    one_f_one_b = [[str(a) for a in rank] for rank in one_f_one_b_order(3, 6)]
    said = _verdict("interleaved_order", one_f_one_b, (3, 2, 6))
    assert said.startswith(
        "interleaved_order(3, 2, 6): rank 0's action 3 (counting from 0) is 0B0; torch's ScheduleInterleaved1F1B "
        "runs 3F0 there.\n"
        "  yours: 0F0 0F1 0F2 [0B0] 0F3 0B1 0F4 0B2 …\n"
        "  torch: 0F0 0F1 0F2 [3F0] 3F1 3F2 0F3 0F4 …\n"
        "Rank 0 runs 3 forwards before its first backward (B or I); torch's runs 8.\n"
        "Ranks 1, 2 differ from torch's too.\n"
    ), said
    assert said.endswith(
        "Your order also misses or repeats work: rank 0, stage 3, micro-batch 0: runs nothing; needs F and B, "
        "or F, I and W."
    ), said


def test_the_zero_bubble_warm_up_in_interleaved_1f1b_fails_on_rank_0():
    # p − 1 − r more forwards than the last rank, where interleaved 1F1B needs 2(p − 1 − r): a forward there and
    # its backward back; the last rank's warm-up is right
    said = _verdict("interleaved_order", _interleaved(4, 2, 8, warmup_hops=1), (4, 2, 8))
    assert said.startswith(
        "interleaved_order(4, 2, 8): rank 0's action 8 (counting from 0) is 4B0; torch's ScheduleInterleaved1F1B "
        "runs 0F4 there.\n"
        "  yours: … 4F0 4F1 4F2 4F3 [4B0] 0F4 4B1 0F5 4B2 …\n"
        "  torch: … 4F0 4F1 4F2 4F3 [0F4] 0F5 0F6 4B0 0F7 …\n"
        "Rank 0 runs 8 forwards before its first backward (B or I); torch's runs 11.\n"
        "Ranks 1, 2 differ from torch's too."
    ), said
    assert "misses or repeats" not in said  # every piece of work once: only the order is wrong


def test_zb_h1_with_each_w_right_after_its_i_is_1f1b_and_fails_on_rank_1():
    said = _verdict("zb_h1_order", _zb_h1(4, 8, w_after=0), (4, 8))
    assert said == (
        "zb_h1_order(4, 8): rank 1's action 4 (counting from 0) is 1W0; torch's ScheduleInterleavedZeroBubble (v = 1) "
        "runs 1F3 there.\n"
        "  yours: 1F0 1F1 1F2 1I0 [1W0] 1F3 1I1 1W1 1F4 …\n"
        "  torch: 1F0 1F1 1F2 1I0 [1F3] 1I1 1W0 1F4 1I2 …\n"
        "Ranks 2, 3 differ from torch's too."
    ), said
    # ZB-H1 with a full backward (no I and W): wrong from rank 0's first backward
    plain = [[str(a) for a in rank] for rank in one_f_one_b_order(4, 8)]
    assert "rank 0's action 4 (counting from 0) is 0B0; torch's ScheduleInterleavedZeroBubble (v = 1) runs 0I0" in (
        _verdict("zb_h1_order", plain, (4, 8))
    )


def test_an_order_too_short_says_where_it_ends():
    short = _zb_h1(2, 4)
    short[1] = short[1][:-1]
    said = _verdict("zb_h1_order", short, (2, 4))
    assert said.startswith(
        "zb_h1_order(2, 4): rank 1's action 11 (counting from 0) is past the end of your list (11 actions); torch's "
        "ScheduleInterleavedZeroBubble (v = 1) runs 1W3 there.\n"
        "  yours: … 1W1 1F3 1I3 1W2 [end]\n"
        "  torch: … 1W1 1F3 1I3 1W2 [1W3]\n"
    ), said
    assert said.endswith("rank 1, stage 1, micro-batch 3: runs ['F', 'I']; needs F and B, or F, I and W."), said


# What is not an order ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "got, words",
    [
        (
            {0: ["0F0", "0B0"], 1: ["1F0", "1B0"]},
            "zb_h1_order(2, 1) returned dict {0: ['0F0', '0B0'], 1: ['1F0', '1B0']}; expected a list of p lists (one "
            'per rank, rank 0 first), each of that rank\'s actions in order as strings like "4B0": the stage, the '
            "kind (F, B, I or W) and the micro-batch",
        ),
        ("0F0 0B0", "zb_h1_order(2, 1) returned str '0F0 0B0'; expected a list of p lists"),
        ([["0F0", "0B0"]], "zb_h1_order(2, 1) returned a list of 1; expected p = 2 lists, one per rank"),
        ([["0F0", "0B0"], "1F0 1B0"], "rank 1's entry is str '1F0 1B0'; expected a list of strings like \"1F0\""),
        ([["0F0", "0B0"], {"1F0", "1B0"}], "rank 1's entry is set {"),  # sets cross as data, but have no order
        (
            [["0F0", "0B0"], ["1F0", "1B0 "]],
            "zb_h1_order(2, 1): rank 1's action 1 is str '1B0 '; expected a string \"<stage><kind><micro-batch>\" "
            'such as "1F0" or "1B0": digits, one of F, B, I, W, digits, nothing else',
        ),
        ([["0F0", "F0"], ["1F0", "1B0"]], "rank 0's action 1 is str 'F0'; expected"),
        ([["0F0", "0X0"], ["1F0", "1B0"]], "rank 0's action 1 is str '0X0'; expected"),
        ([["0F0", "0b0"], ["1F0", "1B0"]], "rank 0's action 1 is str '0b0'; expected"),
        ([["0F0", "0B0\n"], ["1F0", "1B0"]], "rank 0's action 1 is str '0B0\\n'; expected"),
        ([["0F0", "0B٣"], ["1F0", "1B0"]], "rank 0's action 1 is str '0B٣'; expected"),  # a digit, but not 0-9
        ([["0F0", ("0", "B", "0")], ["1F0", "1B0"]], "rank 0's action 1 is tuple ('0', 'B', '0'); expected"),
        ([["0F0", 3], ["1F0", "1B0"]], "rank 0's action 1 is int 3; expected"),
        ([["0F0", "0B" + "0" * 100], ["1F0", "1B0"]], "rank 0's action 1 is str '0B000000"),
        (
            [["0F0"] * 10_000, ["1F0", "1B0"]],
            "zb_h1_order(2, 1): rank 0 has 10000 actions; at most 3·v·m = 3 are valid (each of its v = 1 stages "
            "runs, for each of m = 1 micro-batches, an F and a B, or an F, an I and a W)",
        ),
    ],
)
def test_parse_order_refuses_what_is_not_an_order(got, words):
    with pytest.raises(AssertionError) as caught:
        parse_order(got, 2, 1, 1, call="zb_h1_order(2, 1)")
    assert words in str(caught.value), str(caught.value)


def test_parse_order_reads_lists_or_tuples_of_torch_s_spelling():
    parsed = parse_order((["0F0", "0I0", "0W0"], ("1F0", "12B10")), 2, 1, 1, call="zb_h1_order(2, 1)")
    assert [[str(a) for a in rank] for rank in parsed] == [["0F0", "0I0", "0W0"], ["1F0", "12B10"]]
    assert parsed[1][1] == lab14.Action("B", 12, 10)


# The self-checks -------------------------------------------------------------------------------------------------


def test_self_checks_pass_the_rules_on_the_shown_case_and_fail_wrong_ones(capsys):
    lab14.self_check_interleaved_order(_interleaved)
    lab14.self_check_zb_h1_order(_zb_h1)
    shown = capsys.readouterr().out
    assert "\N{WHITE HEAVY CHECK MARK} interleaved_order(2, 2, 4) is torch's ScheduleInterleaved1F1B order" in shown
    assert "\N{WHITE HEAVY CHECK MARK} zb_h1_order(2, 4) is torch's ZB-H1 order" in shown
    with pytest.raises(AssertionError, match=r"^interleaved_order\(2, 2, 4\): rank 0's action 2 .* is 0F2"):
        lab14.self_check_interleaved_order(_gpipe)
    with pytest.raises(AssertionError, match=r"^zb_h1_order\(2, 4\): rank 1's action 2 .* is 1W0"):
        lab14.self_check_zb_h1_order(lambda p, m: _zb_h1(p, m, w_after=0))
    with pytest.raises(AssertionError, match=r"returned dict"):
        lab14.self_check_zb_h1_order(lambda p, m: dict(enumerate(_zb_h1(p, m))))


# End to end: the graded checks run the notebook's function where the notebook's code runs ------------------------


@pytest.fixture
def notebook(monkeypatch):
    """Set the notebook's functions (``__main__``'s, where ``dl.exercise.run`` looks them up)."""
    return lambda **functions: notebook_names(monkeypatch, functions)


def test_check_interleaved_order_runs_the_notebook_s_function_on_the_graded_cases(notebook):
    notebook(interleaved_order=_interleaved)
    lab14.check_interleaved_order(INTERLEAVED_CASES)
    notebook(interleaved_order=_gpipe)
    with pytest.raises(AssertionError, match=r"^interleaved_order\(3, 2, 6\): rank 0's action 3 .* is 0F3; torch's"):
        lab14.check_interleaved_order(INTERLEAVED_CASES)


def test_check_zb_h1_order_runs_the_notebook_s_function_on_the_graded_cases(notebook):
    notebook(zb_h1_order=_zb_h1)
    lab14.check_zb_h1_order(ZB_H1_CASES)
    notebook(zb_h1_order=lambda p, m: dict(enumerate(_zb_h1(p, m))))  # data, but not an order
    with pytest.raises(AssertionError, match=r"^zb_h1_order\(3, 6\) returned dict \{0: \['0F0'"):
        lab14.check_zb_h1_order(ZB_H1_CASES)


def test_what_the_notebook_s_function_raises_or_returns_that_is_not_data_fails_the_check(notebook):
    def raises(p, m):
        raise ValueError(f"no schedule for p = {p}")

    notebook(zb_h1_order=raises)
    with pytest.raises(exercise.ExerciseError, match="rank 0 raised ValueError: no schedule for p = 3"):
        lab14.check_zb_h1_order(ZB_H1_CASES)
    notebook(zb_h1_order=lambda p, m: [(a for a in rank) for rank in _zb_h1(p, m)])  # generators: not data
    with pytest.raises(exercise.ExerciseError, match="cannot be sent back to the notebook"):
        lab14.check_zb_h1_order(ZB_H1_CASES)


def test_a_case_torch_refuses_is_the_grader_s_mistake(notebook):
    notebook(interleaved_order=lambda p, v, m: pytest.fail("the student's function ran"))
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        lab14.check_interleaved_order([(2, 2, 5)])
