"""Lab 5's exercises 2-4: ``naive_step``, ``gpipe_step`` and ``one_f_one_b_step`` trained on p stages and
checked outside the ranks: the messages as the operating system counted them, the schedule's order
on the wire, the parameters and the loss against one process."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F

from ... import checks, models, viz
from ...exercise import ExerciseRun
from .content import check_wire_content
from .order import _check_wire_order, _messages
from .stages import (
    _DRIVERS,
    TOLERANCE,
    _batches,
    _launch,
    _naive_order,
    _schedule,
    _sizes,
    gpipe_order,
    one_f_one_b_order,
)


def _check_pipeline(
    name: str,
    p: int,
    batch: int,
    m: int = 1,
    steps: int = 3,
    order: Callable = gpipe_order,
    driver: Callable | None = None,
    **kwargs,
) -> ExerciseRun:
    """Train on p stages with the notebook's ``name`` (run by its driver, or ``driver``); check the messages
    (one activation to the next stage and one gradient to the previous per micro-batch, every row once, and
    nothing else, as the operating system counted the bytes), the schedule's order on every link (from when
    the data crossed: :func:`_check_wire_order`), and the parameters and loss against one process.  In a
    student's own notebook, also every stage's F/B order as its trace has it (a finer hint; the grade reads
    the wire)."""
    case = f"{name} on {p} stages (batch {batch}, {m} micro-batches, {steps} steps)"
    run = _launch(case, p, driver or _DRIVERS[name], batch, steps, kwargs, content=True)
    checks.assert_point_to_point(run, name)
    checks.assert_messages(
        run,
        _messages(p, batch, m, steps),
        case,
        "Each micro-batch sends its activations (every row, once) to the next stage only, and its input's gradient "
        "to the previous stage only, one message each.",
    )
    _check_wire_order(case, run, p, batch, m, steps, name)
    check_wire_content(case, run, p, batch, m, steps)
    if run.timeline.source == "trace":  # the student's own run: the stages' own F/B order, as a finer hint
        schedule = _schedule(run)
        for rank in range(p):
            got = [f"{e.name}{e.meta.get('microbatch')}" for e in viz.pipeline_regions(schedule, rank, step=steps - 1)]
            wants = order(rank, p, m)
            wants = [wants] if isinstance(wants[0], str) else wants  # one schedule, or several accepted ones
            assert got in wants, (
                f"{case}: stage {rank} ran {' '.join(got) or 'no F/B regions'}; the schedule is "
                f"{' or '.join(' '.join(w) for w in wants)} (use stage.forward and stage.backward for "
                f"every micro-batch)"
            )
    batches = _batches(p, batch, steps)
    reference = models.train_single_process(models.MLP(_sizes(p), seed=0), batches, lr=0.1)
    params = {name: q for rank_params, _, _ in run.results for name, q in rank_params.items()}
    for pname, q in reference.named_parameters():
        checks.assert_close(
            params.get(pname),
            q.detach(),
            what=(
                f"{case}: {pname} after {steps} steps, against one process training on the whole batch (scale each "
                f"micro-batch's loss by rows / batch; gradients accumulate over micro-batches)"
            ),
            **TOLERANCE,
        )
    model = models.MLP(_sizes(p), seed=0)
    x, y = batches[0]
    first_loss = F.mse_loss(model(x), y).item()
    losses = run.results[-1][1]
    assert isinstance(losses[0], float) and abs(losses[0] - first_loss) < 1e-4, (
        f"{case}: the last stage returned loss {losses[0]!r} in step 0; the mean squared error of the whole batch "
        f"is {first_loss:.6f} (a float: the sum of the micro-batch losses, each scaled by rows / batch)"
    )
    return run


def check_naive(p: int, batch: int, steps: int = 3) -> ExerciseRun:
    """Exercise 2, ``naive_step(stage, x, y)`` on p stages, ``steps`` steps of ``batch`` rows: only send/recv,
    to the neighbouring stages only; one activation forward and one gradient back per step, every row once
    (as traced and as the OS counted); each stage runs F0 then B0; the parameters after the steps and the
    last stage's loss (a float) are one process's on the whole batch."""
    return _check_pipeline("naive_step", p, batch=batch, steps=steps, order=_naive_order)


def check_gpipe(p: int, batch: int, m: int) -> ExerciseRun:
    """Exercise 3, ``gpipe_step(stage, x, y, micro_batches=m)`` on p stages, 3 steps of ``batch`` rows (uneven
    micro-batches where m does not divide it): as :func:`check_naive`, with one activation and one gradient per
    micro-batch, and each stage running all forwards then all backwards (in order or in reverse); the loss is
    the sum of the micro-batch losses scaled by rows / batch."""
    return _check_pipeline("gpipe_step", p, batch=batch, m=m, micro_batches=m)


_DRIVER_FOR_1F1B: list[Callable] = []  # the driver 1F1B is graded with, once decided


def driver_for_1f1b(graders: Callable | None = None, *, afresh: bool = False) -> Callable:
    """The driver one_f_one_b_step is graded with: the lab's own (exercise 3's forward_microbatch and
    backward_microbatch) where gpipe_step passes its check (2 stages, 4 micro-batches), else ``graders`` (the
    grader's helpers, from the graded cell's hidden tests; None in a student's notebook, where a failing GPipe
    then fails this check saying so), so that 1F1B is graded on its own.  Decided once (``afresh``: again)."""
    if afresh:
        _DRIVER_FOR_1F1B.clear()
    if not _DRIVER_FOR_1F1B:
        try:
            check_gpipe(2, 12, 4)
            _DRIVER_FOR_1F1B.append(_DRIVERS["one_f_one_b_step"])
        except Exception as e:  # an AssertionError, or the student's code raised in a rank
            if graders is None:
                raise AssertionError(
                    f"one_f_one_b_step reuses forward_microbatch and backward_microbatch, and "
                    f"gpipe_step does not pass exercise 3's check yet: fix exercise 3 first (the "
                    f"grader grades 1F1B with its own helpers).\n{e}"
                ) from None
            _DRIVER_FOR_1F1B.append(graders)
    return _DRIVER_FOR_1F1B[0]


def check_1f1b(p: int, batch: int, m: int, driver: Callable | None = None) -> ExerciseRun:
    """Exercise 4, ``one_f_one_b_step(stage, x, y, micro_batches=m)``, as :func:`check_gpipe` checks GPipe but
    for the order: stage s runs p − s − 1 warm-up forwards, then one forward and one backward in turn, then the
    remaining backwards (:func:`one_f_one_b_order`).  ``driver``: :func:`driver_for_1f1b`'s (default: on the
    student's own helpers)."""
    return _check_pipeline(
        "one_f_one_b_step", p, batch=batch, m=m, order=one_f_one_b_order, driver=driver, micro_batches=m
    )
