"""Lab 5's timing checks: a step's idle fraction on the simulated accelerator against the bubble
(p − 1)/(m + p − 1), in a graded cell of its own per exercise."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ... import viz
from .stages import _DRIVERS, _launch, _schedule

BUBBLE_COST = 0.03  # bubble tests: 30 ms of simulated forward per micro-batch (60 ms backward)
BUBBLE_BELOW, BUBBLE_ABOVE = 0.08, 0.15  # measured idle within −0.08 … +0.15 of (p − 1)/(m + p − 1):
# messages and Python between the boxes only add idle time
BUBBLE_TRIES = 3  # a run over the range runs again, 3 runs in all; the least idle counts


def _check_bubble(
    name: str, p: int, micro_batches: Sequence[int | None], rows: int = 4, driver: Callable | None = None
) -> list[float]:
    """Measured idle of the last of 2 steps (F: BUBBLE_COST per micro-batch), against the formula.  A run idle
    more than BUBBLE_ABOVE over the formula runs again, BUBBLE_TRIES runs in all, and the least idle one counts:
    a busy machine only adds idle time (a schedule that serialises the stages is as idle in every run)."""
    measured = []
    for m in micro_batches:
        kwargs = {} if m is None else {"micro_batches": m}  # None: naive_step, one micro-batch
        m = m or 1
        case = f"{name} on {p} stages, {m} micro-batches of {rows} rows"
        formula, runs = (p - 1) / (m + p - 1), []
        while len(runs) < BUBBLE_TRIES and (not runs or min(runs)[0] - formula > BUBBLE_ABOVE):
            run = _launch(case, p, driver or _DRIVERS[name], rows * m, 2, kwargs, BUBBLE_COST / rows)
            idle = viz.pipeline_idle(_schedule(run), step=1)
            runs.append((sum(idle) / p, idle))
        mean, idle = min(runs)
        measured.append(mean)
        assert -BUBBLE_BELOW <= mean - formula <= BUBBLE_ABOVE, (
            f"{case}: the stages were idle {mean:.0%} of the step (per rank {', '.join(f'{i:.0%}' for i in idle)}"
            f"{f'; the least idle of {len(runs)} runs' if len(runs) > 1 else ''}); the schedule's bubble is "
            f"(p − 1)/(m + p − 1) = {formula:.0%}, accepted {formula - BUBBLE_BELOW:.0%} … "
            f"{formula + BUBBLE_ABOVE:.0%}. "
            f"Does every stage start micro-batch i + 1 as soon as it has sent micro-batch i (isend, not a blocking "
            f"send)?"
        )
    assert all(a > b for a, b in zip(measured, measured[1:])), (
        f"{name} on {p} stages: idle fraction {[f'{v:.0%}' for v in measured]} for m = {list(micro_batches)} "
        f"should fall as m grows"
    )
    return measured


def check_naive_bubble(p: int) -> list[float]:
    """Exercise 2's timing: naive_step on p stages idles (p − 1)/p of a step on the simulated accelerator,
    within −BUBBLE_BELOW … +BUBBLE_ABOVE (the least idle of up to BUBBLE_TRIES runs).  Returns the idle
    fraction measured."""
    return _check_bubble("naive_step", p, [None])


def check_gpipe_bubble(p: int, micro_batches: Sequence[int]) -> list[float]:
    """Exercise 3's timing: gpipe_step on p stages idles (p − 1)/(m + p − 1) of a step for each m of
    ``micro_batches``, within −BUBBLE_BELOW … +BUBBLE_ABOVE, falling as m grows.  Returns the idle fractions."""
    return _check_bubble("gpipe_step", p, micro_batches)


def check_1f1b_bubble(p: int, micro_batches: Sequence[int], driver: Callable | None = None) -> list[float]:
    """Exercise 4's timing, as :func:`check_gpipe_bubble` (1F1B's bubble is GPipe's).  ``driver``:
    :func:`driver_for_1f1b`'s."""
    return _check_bubble("one_f_one_b_step", p, micro_batches, driver=driver)
