"""Lab 5's graded tests (pipeline parallelism): each check runs the student's step function on p
ranks with ``dl.exercise.run``, through a driver that trains this rank's stage of an MLP and
returns data only (its parameters, the losses, the F/B regions it timed), then checks, outside
the ranks, the messages (neighbours only, one activation and one gradient per micro-batch, their
bytes as the ranks traced them and as the operating system counted them), each stage's F/B order,
and the parameters and loss against one process; the bubble checks measure the idle fraction of a
step on a simulated accelerator against (p − 1)/(m + p − 1).

Not here: the grader's own forward_microbatch / backward_microbatch, on which 1F1B is graded when
the student's GPipe fails (the graded cell's hidden tests hold them and hand them to
:func:`driver_for_1f1b`), the best split of a hidden case, and the predictions' cost models.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import checks, exercise, models, viz
from ..events import Event, Run
from ..exercise import ExerciseRun
from . import common

__all__ = [
    "BUBBLE_ABOVE",
    "BUBBLE_BELOW",
    "BUBBLE_COST",
    "BUBBLE_TRIES",
    "TOLERANCE",
    "check_1f1b",
    "check_1f1b_bubble",
    "check_gpipe",
    "check_gpipe_bubble",
    "check_naive",
    "check_naive_bubble",
    "check_split",
    "check_split_refused",
    "driver_for_1f1b",
    "gpipe_order",
    "one_f_one_b_order",
    "train",
]

TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # float32: micro-batch gradients add up in another order
BUBBLE_COST = 0.03  # bubble tests: 30 ms of simulated forward per micro-batch (60 ms backward)
BUBBLE_BELOW, BUBBLE_ABOVE = 0.08, 0.15  # measured idle within −0.08 … +0.15 of (p − 1)/(m + p − 1):
# messages and Python between the boxes only add idle time
BUBBLE_TRIES = 3  # a run over the range runs again, 3 runs in all; the least idle counts
WIDTH = 16


# --------------------------------------------------------------------------------------
# Exercise 1: split_stages
# --------------------------------------------------------------------------------------
def _split_in_rank(cases):
    """A driver (dl.exercise.run defines it where the notebook's code runs): the notebook's split_stages on
    models.MLP(sizes, seed=0) for each (sizes, p) of ``cases``.  Per case, as data: each stage's layers as
    (name, whether it is the model's own layer object), or the repr of what came back if that is not p modules."""
    found = []
    for sizes, p in cases:
        model = models.MLP(sizes, seed=0)
        own = dict(model.named_children())
        stages = split_stages(model, p)  # noqa: F821  (the notebook's)
        if isinstance(stages, (list, tuple)) and len(stages) == p and all(isinstance(s, nn.Module) for s in stages):
            found.append([[(name, layer is own.get(name)) for name, layer in s.named_children()] for s in stages])
        else:
            found.append(repr(stages)[:300])
    return found


def _split(cases: list) -> list:
    """What split_stages returned for each (MLP sizes, p) of ``cases``, in one run where the notebook's code runs."""
    try:
        found = exercise.run(_split_in_rank, 1, (cases,), timeout=60).results[0]
    except exercise.ExerciseTimeout as e:
        raise AssertionError(f"split_stages did not finish within 60 s (an endless loop?)\n{e}") from None
    assert isinstance(found, list) and len(found) == len(cases), f"expected one split per case, got {found!r:.200}"
    return found


def _check_split(sizes: Sequence[int], p: int, found, largest: int | None = None) -> list[int]:
    """What split_stages returned for MLP(sizes) and p stages, against the grader's own copy of the model."""
    model = models.MLP(sizes, seed=0)
    case = f"split_stages({type(model).__name__} with {len(model)} layers, {p})"
    assert isinstance(found, list) and len(found) == p, f"{case}: expected a list of {p} stages, got {found}"
    layers = dict(model.named_children())
    assert [name for stage in found for name, _ in stage] == list(layers) and all(
        own for stage in found for _, own in stage
    ), (
        f"{case}: the stages must hold the model's own layers, in order, each once, under their names; got "
        f"{[[name for name, _ in stage] for stage in found]}"
    )
    for s, stage in enumerate(found):
        assert len(stage) > 0, f"{case}: stage {s} is empty"
        first = layers[stage[0][0]]
        assert s == 0 or any(True for _ in first.parameters()), (
            f"{case}: stage {s} starts with {type(first).__name__}, which has no parameters; cut only before a "
            f"layer with parameters"
        )
    per_stage = [sum(q.numel() for name, _ in stage for q in layers[name].parameters()) for stage in found]
    if largest is not None:
        assert max(per_stage) == largest, (
            f"{case}: parameters per stage {per_stage}; the most balanced split has at most {largest} in its "
            f"largest stage"
        )
    return per_stage


def check_split(cases: Sequence[tuple[Sequence[int], int, int | None]]) -> None:
    """Exercise 1, ``split_stages(model, num_stages)``, on ``models.MLP(sizes)`` for each case ``(sizes, p,
    largest)``: p stages (nn.Modules) holding the model's own layers, in order, each once, under their names;
    no stage empty; each stage but the first starts with a layer that has parameters; and, where ``largest``
    is given, the largest stage holds that many parameters (the most balanced split).  One run on one rank."""
    for (sizes, p, largest), found in zip(cases, _split([(sizes, p) for sizes, p, _ in cases])):
        _check_split(sizes, p, found, largest)


def check_split_refused(sizes: Sequence[int], p: int) -> None:
    """Exercise 1: ``split_stages(MLP(sizes), p)`` with fewer layers with parameters than p stages raises
    ValueError."""
    case = f"split_stages(MLP({sizes}), {p})"
    try:
        _split([(sizes, p)])
    except exercise.ExerciseError as e:
        if e.exc_type == "ValueError":
            return
        if e.exc_type is None:  # not the student's own exception
            raise
        raise AssertionError(
            f"{case}: the model has {len(sizes) - 1} layers with parameters, so {p} stages are "
            f"impossible: raise ValueError, not {e.exc_type}.\n{e}"
        ) from None
    raise AssertionError(
        f"{case}: the model has {len(sizes) - 1} layers with parameters, so {p} stages are impossible: raise ValueError"
    )


# --------------------------------------------------------------------------------------
# Exercises 2-4: a training step on p stages
# --------------------------------------------------------------------------------------
def _sizes(p: int) -> list[int]:
    """An MLP with two equal Linear layers per stage: 6 -> 16 -> ... -> 3."""
    return [6] + [WIDTH] * (2 * p - 1) + [3]


def _even_stages(model: nn.Sequential, p: int) -> list[nn.Sequential]:
    """Two (Linear, GELU) blocks per stage, names kept: the split the pipeline tests use."""
    children = list(model.named_children())
    return [nn.Sequential(OrderedDict(children[4 * s : 4 * s + 4])) for s in range(p)]


def _batches(p: int, batch: int, steps: int) -> list:
    data = models.regression_data(batch * steps, _sizes(p)[0], _sizes(p)[-1], seed=7)
    return list(zip(data.x.split(batch), data.y.split(batch)))


def train(step_fn: Callable, stage_cls: type, batch: int, steps: int, kwargs: dict, cost: float = 0.0, lr: float = 0.1):
    """In a rank (the drivers call it: public, as what a driver imports): train this rank's stage, a
    ``stage_cls`` (the notebook's Stage), for ``steps`` steps with ``step_fn(stage, x, y, **kwargs)`` (simulated
    compute ``cost`` in the last step only).  Returns (parameters, losses, regions), all data: regions are
    (name, step, micro-batch, start, end) of each step and of each stage.forward ("F") and stage.backward ("B")
    call, as this rank timed them (dl.exercise.run reads back no dl.region marks)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    model = models.MLP(_sizes(p), seed=0)
    stage = stage_cls(_even_stages(model, p)[rank], rank, p)
    regions, step = [], 0

    def timed(name, method):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                i = kwargs.get("microbatch", args[-1] if args else None)
                regions.append((name, step, i if isinstance(i, int) else str(i), start, time.perf_counter()))

        return call

    stage.forward, stage.backward = timed("F", stage.forward), timed("B", stage.backward)
    optimizer = torch.optim.SGD(stage.module.parameters(), lr=lr)
    losses = []
    for step, (x, y) in enumerate(_batches(p, batch, steps)):
        stage.cost = cost if step == steps - 1 else 0.0
        optimizer.zero_grad()
        start = time.perf_counter()
        losses.append(step_fn(stage, x, y, **kwargs))
        regions.append(("step", step, None, start, time.perf_counter()))
        optimizer.step()
    return {name: q.detach().clone() for name, q in stage.module.named_parameters()}, losses, regions


# Drivers: dl.exercise.run defines one in the kernel that holds the notebook's code and runs it on every rank
# (each names one exercise, so that one exercise's code never stands in the way of another's test)
def _train_naive(batch, steps, kwargs, cost=0.0):
    from disttrain_lab.labtests.lab05 import train

    return train(naive_step, Stage, batch, steps, kwargs, cost)  # noqa: F821  (the notebook's)


def _train_gpipe(batch, steps, kwargs, cost=0.0):
    from disttrain_lab.labtests.lab05 import train

    return train(gpipe_step, Stage, batch, steps, kwargs, cost)  # noqa: F821  (the notebook's)


def _train_1f1b(batch, steps, kwargs, cost=0.0):
    from disttrain_lab.labtests.lab05 import train

    return train(one_f_one_b_step, Stage, batch, steps, kwargs, cost)  # noqa: F821  (the notebook's)


_DRIVERS = {"naive_step": _train_naive, "gpipe_step": _train_gpipe, "one_f_one_b_step": _train_1f1b}


def _naive_order(stage: int, p: int, m: int) -> list[str]:
    """The naive schedule on every stage: the whole batch's forward, then its backward."""
    return ["F0", "B0"]


def gpipe_order(stage: int, p: int, m: int) -> list[list[str]]:
    """GPipe on every stage: all forwards in micro-batch order, then all backwards, in the same order
    or in reverse (both are GPipe; every stage must use the same one)."""
    forwards = [f"F{i}" for i in range(m)]
    return [forwards + [f"B{i}" for i in range(m)], forwards + [f"B{i}" for i in reversed(range(m))]]


def one_f_one_b_order(stage: int, p: int, m: int) -> list[str]:
    """1F1B: p − stage − 1 warm-up forwards, then one forward and one backward in turn, then the rest."""
    warmup = min(p - stage - 1, m)
    order = [f"F{i}" for i in range(warmup)]
    for i in range(warmup, m):
        order += [f"F{i}", f"B{i - warmup}"]
    return order + [f"B{i}" for i in range(m - warmup, m)]


def _launch(case: str, p: int, driver: Callable, *args) -> ExerciseRun:
    """``driver(*args)`` on p ranks, where the notebook's code runs; only data comes back (a dl.exercise run)."""
    hint = (
        "does every recv have a matching send, in the same order on both sides (and sends that cannot block "
        "each other)?"
    )
    return common.run_or_fail(driver, p, args, case, hint, timeout=60)


def _schedule(run: ExerciseRun) -> Run:
    """The F, B and step regions the ranks timed, as the dl.Run that dl.viz.pipeline_regions and pipeline_idle read."""
    events = [
        Event(
            rank=rank,
            op="region",
            kind="region",
            start=start,
            end=end,
            name=name,
            meta={"step": step} if name == "step" else {"microbatch": microbatch},
        )
        for rank, (_, _, regions) in enumerate(run.results)
        for name, step, microbatch, start, end in regions
    ]
    return Run(results=run.results, events=events, world_size=run.world_size)


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
    """Train on p stages with the notebook's ``name`` (run by its driver, or ``driver``); check messages
    (neighbours only, one activation and one gradient per micro-batch, their bytes as the ranks traced them
    and as the operating system counted them), the F/B order of every stage, and the parameters and loss
    against one process."""
    case = f"{name} on {p} stages (batch {batch}, {m} micro-batches, {steps} steps)"
    run = _launch(case, p, driver or _DRIVERS[name], batch, steps, kwargs)
    student = run.trace  # the ranks' own account of the call
    checks.assert_only_p2p(student, name)
    out_width = {s: (_sizes(p)[2 * s + 2]) for s in range(p)}
    schedule = _schedule(run)  # the F and B regions the ranks timed
    payload = {}  # (src, dst) -> bytes the step must send
    for rank in range(p):
        peers = {e.peer for e in checks.sends(student, rank)} - {rank - 1, rank + 1}
        assert not peers, (
            f"{case}: rank {rank} sent messages to rank(s) {sorted(peers)}; a stage sends activations "
            f"only to the next stage (rank {rank + 1}) and gradients only to the previous one "
            f"(rank {rank - 1})"
        )
        for peer, what, expected in (
            (rank + 1, "activations", out_width[rank]),
            (rank - 1, "gradients", _sizes(p)[2 * rank]),
        ):
            if not 0 <= peer < p:
                continue
            sent = checks.sends(student, rank, peer)
            assert len(sent) == m * steps, (
                f"{case}: rank {rank} sent {len(sent)} {what} to rank {peer} in {steps} steps, expected one per "
                f"micro-batch per step ({m * steps})"
            )
            nbytes = sum(e.bytes for e in sent)
            payload[(rank, peer)] = steps * batch * expected * 4
            assert nbytes == payload[(rank, peer)], (
                f"{case}: rank {rank} sent {nbytes} bytes of {what} to rank {peer}; every row of every micro-batch "
                f"once is {steps * batch * expected * 4} bytes ({batch} rows × {expected} float32 per step)"
            )
        got = [f"{e.name}{e.meta.get('microbatch')}" for e in viz.pipeline_regions(schedule, rank, step=steps - 1)]
        wants = order(rank, p, m)
        wants = [wants] if isinstance(wants[0], str) else wants  # one schedule, or several accepted ones
        assert got in wants, (
            f"{case}: stage {rank} ran {' '.join(got) or 'no F/B regions'}; the schedule is "
            f"{' or '.join(' '.join(w) for w in wants)} (use stage.forward and stage.backward for "
            f"every micro-batch)"
        )
    checks.assert_traffic(run, payload, case)  # the same bytes, as the OS counted them
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
