"""Reading one of lab 6's runs: what each rank holds against the dense layers' slices, and the
collectives it made."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ... import checks, exercise, wirecalls
from ...exercise import ExerciseRun
from .. import common
from .common import _DEADLOCK_HINT, TIMEOUT
from .ranks import chunk


# --------------------------------------------------------------------------------------
# Reading a run
# --------------------------------------------------------------------------------------
def _run(driver: Callable, n: int, args: tuple, case: str) -> ExerciseRun:
    """``driver`` on n ranks; a run that did not finish in time fails saying what to look for.  Under grading the
    grader keeps what crossed the wire (``content``): the calls are read from it (``_wire_calls``)."""
    return common.run_or_fail(driver, n, args, case, _DEADLOCK_HINT, timeout=TIMEOUT, content=True)


def _group_of(rank: int, tp_size: int) -> tuple:
    start = rank - rank % tp_size
    return tuple(range(start, start + tp_size))


def _communication(run: ExerciseRun, rank: int) -> list:
    """``rank``'s calls that communicate, in the order it made them (the trace holds the driver's call only)."""
    return sorted((e for e in run.trace.by_rank(rank) if e.kind in ("collective", "p2p")), key=lambda e: e.start)


def _describe(events, world_size) -> str:
    return (
        ", ".join(f"{e.op} of {e.bytes} B over ranks {e.group or tuple(range(world_size))}" for e in events)
        or "nothing"
    )


def _phases(run: ExerciseRun, rank: int, names: tuple, case: str) -> dict:
    """``rank``'s communication in each phase of the driver (phase name -> calls), split at the
    barriers of all ranks that ``next_phase`` made between them."""
    calls = _communication(run, rank)
    marks = [i for i, e in enumerate(calls) if e.op == "barrier" and e.group is None]
    assert len(marks) == len(names) - 1, (
        f"{case}: the test separates {', '.join(names)} by {len(names) - 1} barriers of all ranks, but rank {rank} "
        f"made {len(marks)}: make no dist.barrier() of your own here. Its calls: {_describe(calls, run.world_size)}"
    )
    bounds = [-1, *marks, len(calls)]
    return {name: calls[bounds[k] + 1 : bounds[k + 1]] for k, name in enumerate(names)}


def _assert_all_reduces(
    run: ExerciseRun, calls: list, rank: int, count: int, nbytes: int | None, group: tuple, what: str, op="all_reduce"
):
    """``calls`` (``rank``'s, in one phase) are exactly ``count`` calls of ``op`` (an all-reduce) of ``nbytes``
    (None: any size) over ``group``, nothing else."""
    ok = len(calls) == count and all(
        e.op == op and nbytes in (None, e.bytes) and (e.group or tuple(range(run.world_size))) == group for e in calls
    )
    size = f" of {nbytes} B" if nbytes is not None else ""
    assert ok, (
        f"{what}: rank {rank} should make exactly {count} {op.replace('_', '-')}(s){size} over ranks {group} "
        f"{'(nothing else)' if count else '(no communication at all)'}; it made: "
        f"{_describe(calls, run.world_size)}"
    )


def _assert_wire_calls_of_groups(run: ExerciseRun, tp_size: int, expected: list, what: str, case: str) -> None:
    """``wirecalls.assert_group_calls`` for each group of ``tp_size`` consecutive ranks (one alone sends nothing)."""
    for group in sorted({_group_of(rank, tp_size) for rank in range(run.world_size)}):
        if len(group) > 1:
            wirecalls.assert_group_calls(run, group, expected, what, case)


def _assert_group_inputs_carried(run: ExerciseRun, tp_size: int, inputs: list[Callable], whats: list[str], case: str):
    """``wirecalls.assert_all_reduces_carried`` for each group of ``tp_size`` consecutive ranks."""
    for group in sorted({_group_of(rank, tp_size) for rank in range(run.world_size)}):
        wirecalls.assert_all_reduces_carried(run, group, inputs, whats, case)


def _compare_parameters(got: dict, expected: dict, what: str):
    """``got``/``expected``: name -> (value, gradient).  Same names, values and gradients."""
    assert set(got) == set(expected), (
        f"{what}: expected the parameters {sorted(expected) or 'none'}, got {sorted(got) or 'none'} "
        f"(register slices as nn.Parameter; the row-parallel bias lives on group rank 0 only)"
    )
    for name, (value, grad) in expected.items():
        checks.assert_close(got[name][0], value, what=f"{what}: {name}")
        assert got[name][1] is not None, (
            f"{what}: no gradient reached {name}: make it a leaf nn.Parameter "
            f"(a fresh copy of the slice) and compute the output from it"
        )
        checks.assert_close(got[name][1], grad, what=f"{what}: the gradient of {name}", rtol=1e-4, atol=1e-5)


def _expected_slices(dense: nn.Module, tp_size: int, position: int, grads: bool = True) -> dict:
    """What TensorParallelMLP's parameters must be on the rank at ``position`` in its TP group."""
    first, second = dense[0], dense[2]
    rows, cols = chunk(first.out_features, tp_size, position), chunk(second.in_features, tp_size, position)
    pick = lambda p, index: (p.detach()[index], p.grad[index] if grads else None)
    expected = {
        "column.weight": pick(first.weight, rows),
        "column.bias": pick(first.bias, rows),
        "row.weight": pick(second.weight, (slice(None), cols)),
    }
    if position == 0:
        expected["row.bias"] = pick(second.bias, slice(None))
    return expected


def _expect_value_error(target: Callable, n: int, args: tuple, case: str) -> None:
    """``target`` (a driver) on n ranks must stop with the student's ValueError saying "divisible", as
    the exercise asks (only that word: an error torch raises by accident does not pass)."""
    try:
        exercise.run(target, n, args, timeout=TIMEOUT)
    except exercise.ExerciseError as e:
        if common.rank_raised(e, "ValueError", "divisible", loose=True):
            return
        got = f"{e.exc_type}: {e.exc_message}" if e.exc_type is not None else str(e)
        raise AssertionError(
            f"{case}: expected your ValueError saying the size is not divisible by the number "
            f'of ranks (the exercise asks for the word "divisible"); got {got}'
        ) from None
    raise AssertionError(
        f"{case}: expected a ValueError (the size is not divisible by the number of ranks), but it ran without one"
    )
