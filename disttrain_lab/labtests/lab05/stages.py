"""Lab 5's pipeline in the grader's hands: the MLP its tests train (two Linear layers per stage), how a
rank trains its stage with the notebook's step function (``train``, run by the drivers where the
notebook's code runs), the schedules' F/B orders, and a run's F/B regions as a ``dl.Run``."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ... import models
from ...events import Event, Run
from ...exercise import ExerciseRun
from .. import common

TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # float32: micro-batch gradients add up in another order
WIDTH = 16


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


def _rows(batch: int, m: int) -> list[int]:
    """Rows of each micro-batch: ``x.tensor_split(m)``, as the exercise asks."""
    return [len(c) for c in torch.empty(batch).tensor_split(m)]


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
    from disttrain_lab.labtests.lab05.stages import train

    return train(naive_step, Stage, batch, steps, kwargs, cost)  # noqa: F821  (the notebook's)


def _train_gpipe(batch, steps, kwargs, cost=0.0):
    from disttrain_lab.labtests.lab05.stages import train

    return train(gpipe_step, Stage, batch, steps, kwargs, cost)  # noqa: F821  (the notebook's)


def _train_1f1b(batch, steps, kwargs, cost=0.0):
    from disttrain_lab.labtests.lab05.stages import train

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


def _launch(case: str, p: int, driver: Callable, *args, timeline: bool = True, content: bool = False) -> ExerciseRun:
    """``driver(*args)`` on p ranks, where the notebook's code runs; only data comes back (a dl.exercise run),
    and, with ``timeline``, when the data crossed (the grader's capture, about 0.1 s a run); with ``content``,
    what it carried too (for ``content.check_wire_content``; not where the wire is timed: copying payloads
    lags the capture's clock)."""
    hint = (
        "does every recv have a matching send, in the same order on both sides (and sends that cannot block "
        "each other)?"
    )
    return common.run_or_fail(driver, p, args, case, hint, timeout=60, timeline=timeline, content=content)


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
