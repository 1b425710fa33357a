"""Lab 14's exercises 1 and 4: ``interleaved_order(p, v, m)`` and ``zb_h1_order(p, m)``, graded action by
action against torch's own schedules (``orders.torch_order``: ScheduleInterleaved1F1B, and
ScheduleInterleavedZeroBubble with v = 1, which is ZB-H1).

Each exercise returns, for each of the p ranks, its actions in order as torch spells them: "4B0" is stage 4's
backward of micro-batch 0 (kind F, B, I for the input's gradient or W for the weights'; stage s on rank s % p).
The graded check runs the notebook's function on every case in one run where the notebook's code runs
(``exercise.run``, a driver), gets back what it returned as data, reads that as untrusted
(:func:`parse_order`: p lists of such strings, bounded) and compares it with torch's order here, in the
grader's process; a difference names the rank, the position, your action and torch's, with a window of
both lists around it.  The self-checks call the function in the notebook's kernel on the one case the
notebook shows (``SHOWN_INTERLEAVED``, ``SHOWN_ZB_H1``); the graded cases are others, in the graded cells'
hidden blocks, and any case torch accepts may be one: torch needs m to fill whole rounds of
m // max(1, m // p) micro-batches (p when p divides m), so m = 10 on p = 4 (two rounds of 5) and m < p are
cases, m = 7 on p = 3 is not.

    >>> parse_order([["0F0", "0B0"], ["1F0", "1B0"]], p=2, v=1, m=1, call="zb_h1_order(2, 1)")[1]
    [Action(kind='F', stage=1, microbatch=0), Action(kind='B', stage=1, microbatch=0)]
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from .. import common
from .common import seen
from .orders import Action, check_order, torch_order

ACTION = re.compile(r"([0-9]+)([FBIW])([0-9]+)")  # torch's spelling: stage, kind, micro-batch ("4B0")
LONGEST = 24  # characters in one action's string at most (a stage and a micro-batch of ten digits each)
WINDOW = 4  # actions shown on each side of the first difference
TIMEOUT = 60.0  # seconds for all of one exercise's cases: pure Python, well under a second each

# the one case each self-check shows (the graded cases are others, in the graded cells' hidden blocks)
SHOWN_INTERLEAVED = (2, 2, 4)  # (p, v, m)
SHOWN_ZB_H1 = (2, 4)  # (p, m)

# exercise -> (torch's schedule as orders.torch_order names it, its class as a message names it)
_EXERCISES = {
    "interleaved_order": ("Interleaved1F1B", "ScheduleInterleaved1F1B"),
    "zb_h1_order": ("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble (v = 1)"),
}
_VALID = (
    'a list of p lists (one per rank, rank 0 first), each of that rank\'s actions in order as strings like "4B0": '
    "the stage, the kind (F, B, I or W) and the micro-batch"
)


# What crosses: the drivers (dl.exercise.run defines them where the notebook's code runs) ---------------------


def _interleaved_in_rank(cases):
    """A driver: the notebook's interleaved_order(p, v, m) for each (p, v, m) of ``cases``, as it returned it
    (the grader reads it as untrusted data; something that is not data fails the run and says so)."""
    return [interleaved_order(p, v, m) for p, v, m in cases]  # noqa: F821  (the notebook's)


def _zb_h1_in_rank(cases):
    """A driver: the notebook's zb_h1_order(p, m) for each (p, m) of ``cases``, as it returned it."""
    return [zb_h1_order(p, m) for p, m in cases]  # noqa: F821  (the notebook's)


# Reading it ----------------------------------------------------------------------------------------------------


def parse_order(got, p: int, v: int, m: int, *, call: str) -> list[list[Action]]:
    """What the student's function returned (``call``: how it was called, for the messages), read as untrusted
    data: a list (or tuple) of p lists, rank r's holding at most 3·v·m strings "<stage><kind><micro-batch>"
    (kind F, B, I or W; each of its v stages runs, per micro-batch, an F and a B, or an F, an I and a W).  Raises
    AssertionError naming the rule broken, the value seen and what would be valid."""
    if type(got) not in (list, tuple):
        raise AssertionError(f"{call} returned {seen(got)}; expected {_VALID}")
    if len(got) != p:
        raise AssertionError(f"{call} returned a list of {len(got)}; expected p = {p} lists, one per rank: {_VALID}")
    most = 3 * v * m
    for r, actions in enumerate(got):
        if type(actions) not in (list, tuple):
            raise AssertionError(
                f'{call}: rank {r}\'s entry is {seen(actions)}; expected a list of strings like "{r}F0"'
            )
        if len(actions) > most:
            raise AssertionError(
                f"{call}: rank {r} has {len(actions)} actions; at most 3·v·m = {most} are valid (each of its v = {v} "
                f"stages runs, for each of m = {m} micro-batches, an F and a B, or an F, an I and a W)"
            )
    order = []
    for r, actions in enumerate(got):
        parsed = []
        for i, a in enumerate(actions):
            found = ACTION.fullmatch(a) if type(a) is str and len(a) <= LONGEST else None
            if found is None:
                raise AssertionError(
                    f'{call}: rank {r}\'s action {i} is {seen(a)}; expected a string "<stage><kind><micro-batch>" '
                    f'such as "{r}F0" or "{r}B0": digits, one of F, B, I, W, digits, nothing else'
                )
            parsed.append(Action(found[2], int(found[1]), int(found[3])))
        order.append(parsed)
    return order


# Comparing with torch --------------------------------------------------------------------------------------------


def _window(actions: Sequence[Action], at: int) -> str:
    """``actions`` around position ``at``, that one in brackets ("[end]" where the list has ended)."""
    lo, hi = max(0, at - WINDOW), min(len(actions), at + WINDOW + 1)
    shown = [f"[{a}]" if i == at else str(a) for i, a in enumerate(actions[lo:hi], lo)]
    if at >= len(actions):
        shown.append("[end]")
    return ("… " if lo else "") + " ".join(shown) + (" …" if hi < len(actions) else "")


def _first_difference(mine: Sequence[Action], theirs: Sequence[Action]) -> int | None:
    """The first position where the two lists differ (where the shorter one ends, if it is a prefix), or None."""
    at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
    if at is None and len(mine) != len(theirs):
        at = min(len(mine), len(theirs))
    return at


def _warmup(actions: Sequence[Action]) -> int:
    """Forwards before the first backward (B or I)."""
    return next((i for i, a in enumerate(actions) if a.kind != "F"), len(actions))


def compare_order(mine: Sequence[Sequence[Action]], name: str, case: tuple, v: int) -> None:
    """``mine`` (parsed by :func:`parse_order`) is torch's order for exercise ``name`` ("interleaved_order" or
    "zb_h1_order") at ``case``, action by action; else AssertionError at the first rank that differs: the
    position, your action and torch's, a window of both lists, the forwards each runs before its first backward
    where they differ, and the first piece of work yours does not do once (``orders.check_order``)."""
    if name not in _EXERCISES:
        raise ValueError(f"exercise {name!r}: valid exercises are {list(_EXERCISES)}")
    schedule, cls = _EXERCISES[name]
    p, m = case[0], case[-1]
    theirs = torch_order(schedule, p, v, m)
    call = f"{name}({', '.join(map(str, case))})"
    differ = [r for r in range(p) if _first_difference(mine[r], theirs[r]) is not None]
    if not differ:
        return
    r = differ[0]
    at = _first_difference(mine[r], theirs[r])
    yours = str(mine[r][at]) if at < len(mine[r]) else f"past the end of your list ({len(mine[r])} actions)"
    torchs = f"runs {theirs[r][at]}" if at < len(theirs[r]) else f"has ended ({len(theirs[r])} actions)"
    message = (
        f"{call}: rank {r}'s action {at} (counting from 0) is {yours}; torch's {cls} {torchs} there.\n"
        f"  yours: {_window(mine[r], at)}\n"
        f"  torch: {_window(theirs[r], at)}"
    )
    if _warmup(mine[r]) != _warmup(theirs[r]):
        message += (
            f"\nRank {r} runs {_warmup(mine[r])} forwards before its first backward (B or I); torch's runs "
            f"{_warmup(theirs[r])}."
        )
    if len(differ) > 1:
        message += f"\nRanks {', '.join(map(str, differ[1:]))} differ from torch's too."
    try:
        check_order(mine, p, v, m)
    except ValueError as e:
        message += f"\nYour order also misses or repeats work: {e}."
    raise AssertionError(message)


# The graded checks ----------------------------------------------------------------------------------------------


def _check(name: str, driver: Callable, cases: Sequence[tuple], v_of: Callable[[tuple], int]) -> None:
    """``name``'s function on every case in one run where the notebook's code runs, each result parsed and
    compared with torch's order here.  torch's orders are built first: a case torch refuses is the grader's
    mistake (ValueError, torch's message), never the student's."""
    cases = [tuple(case) for case in cases]
    for case in cases:
        torch_order(_EXERCISES[name][0], case[0], v_of(case), case[-1])
    calls = ", ".join(f"{name}({', '.join(map(str, case))})" for case in cases)
    found = common.run_or_fail(driver, 1, (cases,), calls, "an endless loop?", timeout=TIMEOUT).results[0]
    if type(found) is not list or len(found) != len(cases):
        raise AssertionError(f"expected one result per case ({len(cases)}) from the driver, got {seen(found)}")
    for case, got in zip(cases, found):
        p, v, m = case[0], v_of(case), case[-1]
        call = f"{name}({', '.join(map(str, case))})"
        compare_order(parse_order(got, p, v, m, call=call), name, case, v)


def check_interleaved_order(cases: Sequence[tuple[int, int, int]]) -> None:
    """Exercise 1, ``interleaved_order(p, v, m)``, for each ``(p, v, m)`` of ``cases``: each rank's actions are
    torch's ScheduleInterleaved1F1B's, action by action (stage s on rank s % p).  One run on one rank."""
    _check("interleaved_order", _interleaved_in_rank, cases, lambda case: case[1])


def check_zb_h1_order(cases: Sequence[tuple[int, int]]) -> None:
    """Exercise 4, ``zb_h1_order(p, m)``, for each ``(p, m)`` of ``cases``: each rank's actions (F, I and W) are
    torch's ScheduleInterleavedZeroBubble's with one stage per rank, action by action.  One run on one rank."""
    _check("zb_h1_order", _zb_h1_in_rank, cases, lambda case: 1)


# The self-checks (the notebook's visible cells: its own function, in its own kernel, on the case it shows) ------


def self_check_interleaved_order(fn: Callable[[int, int, int], list[list[str]]]) -> None:
    """``fn(2, 2, 4)`` against torch's ScheduleInterleaved1F1B, as the graded test compares (other cases)."""
    p, v, m = SHOWN_INTERLEAVED
    call = f"interleaved_order{SHOWN_INTERLEAVED}"
    compare_order(parse_order(fn(p, v, m), p, v, m, call=call), "interleaved_order", SHOWN_INTERLEAVED, v)
    print(f"\N{WHITE HEAVY CHECK MARK} {call} is torch's ScheduleInterleaved1F1B order (the graded test tries others)")


def self_check_zb_h1_order(fn: Callable[[int, int], list[list[str]]]) -> None:
    """``fn(2, 4)`` against torch's ScheduleInterleavedZeroBubble with v = 1, as the graded test compares."""
    p, m = SHOWN_ZB_H1
    call = f"zb_h1_order{SHOWN_ZB_H1}"
    compare_order(parse_order(fn(p, m), p, 1, m, call=call), "zb_h1_order", SHOWN_ZB_H1, 1)
    print(f"\N{WHITE HEAVY CHECK MARK} {call} is torch's ZB-H1 order (the graded test tries others)")
