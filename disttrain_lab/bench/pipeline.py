"""``disttrain-lab bench pipeline``: training steps per second of naive, GPipe and 1F1B against
``torch.distributed.pipelining``'s ScheduleGPipe, on a simulated accelerator."""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.distributed as dist

from ..launcher import launch
from ..models import MLP, regression_data
from .command import Measured, NotMeasured, add_world_size_argument, over_world_sizes
from .notebook import add_notebook_argument, functions_from_lab
from .stats import slowest_median
from .tables import Chart, version_width
from .timing import take_turns

TORCH_PIPELINE = "torch ScheduleGPipe"
PIPELINE_MODEL = (64,) * 9  # 8 Linear layers of 64 × 64: two per stage on 4 ranks
PIPELINE_COST = 0.5e-3  # simulated accelerator: seconds per sample for one stage's forward (backward: 2×)


def _simulated_module(module, cost: float):
    """``module`` on the lab's simulated accelerator, as the lab's ``Stage`` models it: forward
    takes ``cost`` s per sample, backward twice that, the layers' real CPU work included (it
    sleeps for what is left), so a stage's time is fixed and needs no CPU core (2 cores, 4 ranks)."""

    class Done(torch.autograd.Function):
        """Applied to the module's output: its backward runs first and sets the deadline."""

        @staticmethod
        def forward(ctx, x, box):
            ctx.rows, ctx.box = len(x), box
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            ctx.box[0] = time.perf_counter() + 2 * cost * ctx.rows
            return grad, None

    class Until(torch.autograd.Function):
        """Applied to the module's input: its backward runs last and waits for the deadline."""

        @staticmethod
        def forward(ctx, x, box):
            ctx.box = box
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            time.sleep(max(0.0, ctx.box[0] - time.perf_counter()))
            return grad, None

    class Simulated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, x):
            busy_until = time.perf_counter() + cost * len(x)
            box = [0.0]
            if not x.requires_grad:  # the first stage: its backward must reach Until too
                x = x.detach().requires_grad_()
            out = Done.apply(self.inner(Until.apply(x, box)), box)
            time.sleep(max(0.0, busy_until - time.perf_counter()))
            return out

    return Simulated()


def _torch_gpipe_runner(module, micro_batches: int, cost: float, x, y):
    """One ScheduleGPipe training step of this rank's stage (``module``), as a callable."""
    # here, not at the top: a torch without pipelining (or that cannot import it) is a row's error
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank, p = dist.get_rank(), dist.get_world_size()
    stage = PipelineStage(_simulated_module(module, cost), rank, p, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=micro_batches, loss_fn=torch.nn.functional.mse_loss)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == p - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        optimizer.step()

    return step


def _pipeline_step_times(
    versions: dict,
    split_stages,
    make_stage,
    sizes,
    batch: int,
    repeats: int,
    warmup: int,
    cost: float,
    torch_micro_batches,
) -> tuple[dict, dict]:
    """In each rank: seconds per training step of every version, taking turns (order rotated).

    ``versions`` maps a name to ``(step, m)``: ``step(stage, x, y)`` runs one pipeline step on
    ``make_stage(module, rank, p, cost)``, this rank's part of ``split_stages(MLP(sizes), p)``.
    ScheduleGPipe at each of ``torch_micro_batches`` runs beside them on the same split.
    Returns (seconds per name, errors per name).
    """
    rank, p = dist.get_rank(), dist.get_world_size()
    x, y = regression_data(batch, sizes[0], sizes[-1], seed=1)
    runners, errors = {}, {}
    for name, (step_fn, _) in versions.items():
        stage = make_stage(split_stages(MLP(list(sizes), seed=0), p)[rank], rank, p, cost)
        optimizer = torch.optim.SGD(stage.module.parameters(), lr=1e-3)

        def run(stage=stage, optimizer=optimizer, step_fn=step_fn):
            optimizer.zero_grad()
            step_fn(stage, x, y)
            optimizer.step()

        runners[name] = run
    for m in torch_micro_batches:
        name = f"{TORCH_PIPELINE} m={m}"
        try:
            runners[name] = _torch_gpipe_runner(split_stages(MLP(list(sizes), seed=0), p)[rank], m, cost, x, y)
        except Exception as exc:  # e.g. a torch without pipelining: say so in the table
            errors[name] = f"{type(exc).__name__}: {exc}"
    return take_turns(runners, repeats, warmup), errors


def bench_pipeline(
    versions: dict,
    split_stages,
    make_stage,
    world_size: int = 4,
    sizes=PIPELINE_MODEL,
    batch: int = 64,
    cost: float = PIPELINE_COST,
    repeats: int = 5,
    warmup: int = 1,
    torch_micro_batches=(1, 2, 4, 8),
    timeout: float = 600.0,
) -> list[dict]:
    """Training steps per second of each pipeline version and of torch's ScheduleGPipe, side by
    side in one launch on ``world_size`` stages of ``MLP(sizes)``, ``batch`` samples per step.

    ``versions`` maps a name to ``(step, m)`` (see :func:`_pipeline_step_times`); ``split_stages``
    and ``make_stage`` come from the lab notebook.  Every stage runs on the simulated accelerator:
    ``cost`` s per sample forward, twice that backward, so the schedule, not the 2 CPU cores,
    decides the time.  A row: the median over ``repeats`` of the slowest rank, ``speedup`` over
    the first version (naive), and ``ideal`` = p·m/(m + p − 1), the speedup without communication.

        >>> rows = bench_pipeline({"naive": (naive_step, 1), "GPipe m=4": (gpipe_m4, 4)}, split_stages, Stage)
        >>> print(format_pipeline_table(rows))
    """
    if world_size < 2:
        raise ValueError(f"a pipeline needs world_size >= 2 stages, got {world_size}")
    per_rank = launch(
        _pipeline_step_times,
        world_size,
        versions,
        split_stages,
        make_stage,
        tuple(sizes),
        batch,
        repeats,
        warmup,
        cost,
        tuple(torch_micro_batches),
        timeout=timeout,
    )
    errors = {name: why for _, errs in per_rank for name, why in errs.items()}
    micro = {
        **{name: m for name, (_, m) in versions.items()},
        **{f"{TORCH_PIPELINE} m={m}": m for m in torch_micro_batches},
    }
    rows = []
    for name, m in micro.items():
        row = {
            "version": name,
            "micro_batches": m,
            "world_size": world_size,
            "batch": batch,
            "repeats": repeats,
            "cost": cost,
            "ideal": world_size * m / (m + world_size - 1),
        }
        if name in errors:
            row["error"] = errors[name]
        else:
            row["steps_per_s"] = 1 / slowest_median([seconds[name] for seconds, _ in per_rank])
        rows.append(row)
    base = next((r["steps_per_s"] for r in rows if "steps_per_s" in r), 1.0)
    torch_at = {r["micro_batches"]: r for r in rows if r["version"].startswith(TORCH_PIPELINE) and "steps_per_s" in r}
    for row in rows:
        if "steps_per_s" in row:
            row["speedup"] = row["steps_per_s"] / base
            peer = torch_at.get(row["micro_batches"])
            if peer is not None and row["version"].startswith("GPipe"):  # the same schedule, torch's
                row["reference"], row["ratio"] = peer["version"], row["steps_per_s"] / peer["steps_per_s"]
    return rows


def format_pipeline_table(rows: list[dict]) -> str:
    """Steps/s, samples/s, speedup over the first row (naive) and the ideal p·m/(m + p − 1)."""
    first = rows[0]
    width = version_width(rows, 16)
    lines = [
        f"training steps/s, {first['world_size']} stages, batch {first['batch']}, simulated accelerator "
        f"{first['cost'] * 1e3:g} ms/sample forward (2x backward), median of {first['repeats']}",
        f"{'version':<{width}} {'m':>3} {'steps/s':>8} {'samples/s':>10} {'speedup':>8} {'ideal':>6}",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['version']:<{width}} {r['micro_batches']:>3} not measured: {r['error']}")
        else:
            lines.append(
                f"{r['version']:<{width}} {r['micro_batches']:>3} {r['steps_per_s']:>8.2f} "
                f"{r['steps_per_s'] * r['batch']:>10.0f} {r['speedup']:>7.2f}x {r['ideal']:>5.2f}x"
            )
    return "\n".join(lines)


NAME = "pipeline"
HELP = "lab 5's naive, GPipe (m = 1, 2, 4, 8) and 1F1B against torch's ScheduleGPipe"
LAB = os.path.join("05_pipeline", "05_pipeline.ipynb")
FUNCTIONS = ("split_stages", "Stage", "naive_step", "gpipe_step", "one_f_one_b_step")


def add_arguments(parser) -> None:
    add_notebook_argument(parser, LAB)
    add_world_size_argument(parser, (4,), what="stages")


QUICK = ["--world-size", "2"]  # bench all --quick


def measure(args) -> Measured:
    found = functions_from_lab(args, LAB, FUNCTIONS, "pipeline functions")
    if not {"split_stages", "Stage"} <= found.keys():
        raise NotMeasured("the notebook must define split_stages and Stage")
    return over_world_sizes(args, functools.partial(_measure, found))


def _measure(found: dict, args) -> Measured:
    versions = {"naive": (found["naive_step"], 1)} if "naive_step" in found else {}
    for m in (1, 2, 4, 8):
        if "gpipe_step" in found:
            versions[f"GPipe m={m}"] = (functools.partial(found["gpipe_step"], micro_batches=m), m)
    if "one_f_one_b_step" in found:
        versions["1F1B m=8"] = (functools.partial(found["one_f_one_b_step"], micro_batches=8), 8)
    rows = bench_pipeline(
        versions, found["split_stages"], found["Stage"], world_size=args.world_size, repeats=args.repeats
    )
    measured = [r for r in rows if "speedup" in r]
    picture = Chart(
        f"Pipeline on {args.world_size} stages: speedup over the naive pipeline against micro-batches",
        "speedup",
        {
            "measured": [(r["version"], r["speedup"]) for r in measured],
            "ideal, N·m / (m + N − 1)": [(r["version"], r["ideal"]) for r in measured],
        },
    )
    return Measured(rows, format_pipeline_table(rows), [picture])
