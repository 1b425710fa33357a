"""Lab 5's timing checks: a step's idle fraction on the simulated accelerator against the bubble
(p − 1)/(m + p − 1), in a graded cell of its own per exercise.

Under grading the step's length comes from the wire, not from the ranks' clocks: from gloo's
handshake as the launch opens the ranks' connections (the only segments under 48 bytes; the ranks
then set up and call the step function, a few milliseconds that count as idle) to the last
gradient reaching stage 0, plus stage 0's last backward, which follows it.  The run's bytes must be
the schedule's messages (``checks.assert_messages``), so no other traffic moves either end.  Every
stage computes 3 · BUBBLE_COST per micro-batch (a forward, a backward twice as long: the grader's
own setting), so the idle fraction is 1 − m · 3 · BUBBLE_COST / that length, the same on every
stage.  A stage that holds its work back past the last gradient only hides its own slowness, and
never beats the schedule's dependencies.  In a student's own notebook the ranks' F/B boxes give it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ... import checks, viz, wire
from ...exercise import ExerciseRun
from .order import _messages
from .stages import _DRIVERS, _launch, _schedule

BUBBLE_COST = 0.03  # bubble tests: 30 ms of simulated forward per micro-batch (60 ms backward)
BUBBLE_BELOW, BUBBLE_ABOVE = 0.08, 0.15  # measured idle within −0.08 … +0.15 of (p − 1)/(m + p − 1):
# messages and Python between the boxes only add idle time
BUBBLE_TRIES = 5  # a run over the range runs again, 5 runs in all; the least idle counts (3 were too few
# for the solution once, in a suite beside other test runs at load 10 on 2 cores: a launch's set-up counts as idle)


def _idle(run: ExerciseRun, case: str, p: int, m: int, rows: int) -> list[float]:
    """Each stage's idle fraction of the step: from the wire under grading (never the ranks' boxes: where
    the wire was not captured, reading it raises ``wire.Unobserved``), from the boxes in a student's own
    notebook."""
    if run.timeline.source == "trace":
        return viz.pipeline_idle(_schedule(run), step=0)
    checks.assert_messages(
        run, _messages(p, rows * m, m, 1), case, "The timed step sends the same messages as the graded one."
    )
    segments = run.timeline.segments or []
    data = [t for t, _, _, n in segments if n >= wire.GLOO_PREAMBLE]
    handshake = [t for t, _, _, n in segments if n < wire.GLOO_PREAMBLE and data and t <= data[0]]
    back = [t for t, a, b, n in segments if (a, b) == (1, 0) and n > wire.GLOO_PREAMBLE]
    if not handshake or not back:
        raise wire.Unobserved(
            "the step's start (gloo's handshake as the launch opens the connections) or its last gradient was "
            "not seen on the wire, so its idle time cannot be measured from outside the ranks"
        )
    length = back[-1] - handshake[-1] + 2 * BUBBLE_COST
    return [1.0 - m * 3 * BUBBLE_COST / length] * p


def _check_bubble(
    name: str, p: int, micro_batches: Sequence[int | None], rows: int = 4, driver: Callable | None = None
) -> list[float]:
    """Measured idle of one step (F: BUBBLE_COST per micro-batch), after an untimed step that warms the ranks up,
    against the formula.  A run idle more than BUBBLE_ABOVE over the formula runs again, BUBBLE_TRIES runs in all,
    and the least idle one counts: a busy machine only adds idle time (a schedule that serialises the stages is as
    idle in every run)."""
    measured = []
    for m in micro_batches:
        kwargs = {} if m is None else {"micro_batches": m}  # None: naive_step, one micro-batch
        m = m or 1
        case = f"{name} on {p} stages, {m} micro-batches of {rows} rows"
        formula, runs = (p - 1) / (m + p - 1), []
        _launch(case, p, driver or _DRIVERS[name], rows * m, 1, kwargs, 0.0, timeline=False)  # warm-up: untimed
        while len(runs) < BUBBLE_TRIES and (not runs or min(runs)[0] - formula > BUBBLE_ABOVE):
            run = _launch(case, p, driver or _DRIVERS[name], rows * m, 1, kwargs, BUBBLE_COST / rows)
            idle = _idle(run, case, p, m, rows)
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
