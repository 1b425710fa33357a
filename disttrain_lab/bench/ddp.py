"""``disttrain-lab bench ddp``: training steps per second of the lab's data-parallel wrappers,
side by side with torch's DistributedDataParallel."""

from __future__ import annotations

import functools
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..devices import device as rank_device
from ..launcher import launch
from ..models import MLP, regression_data
from .command import Measured, add_world_size_argument, over_world_sizes
from .notebook import add_notebook_argument, functions_from_lab
from .stats import slowest_median
from .tables import chart, mlp_parameters, version_width
from .timing import take_turns

TORCH_DDP = "torch DDP"
DDP_MODEL = (1024, 2048, 2048, 1024)  # an MLP of 8.4 M parameters: 32 MiB of gradients per step


def _ddp_step_times(versions: dict, sizes, batch: int, steps: int, repeats: int, warmup: int, bucket_mb: float) -> dict:
    """In each rank: seconds per ``steps`` training steps of every version, interleaved.

    Each version trains its own copy of the same model on the same data; ``versions`` maps
    a name to ``wrap(model)``, which returns a DDP-like module (``ddp(x)`` runs the model) whose
    ``finish_gradient_synchronization()`` runs after ``loss.backward()`` and before
    ``optimizer.step()``.  torch DDP (``bucket_cap_mb=bucket_mb``) runs beside them as the reference.
    """
    rank, world_size, device = dist.get_rank(), dist.get_world_size(), rank_device()
    data = regression_data(batch * world_size, sizes[0], sizes[-1], seed=1)
    x, y = data.x.tensor_split(world_size)[rank].to(device), data.y.tensor_split(world_size)[rank].to(device)
    runners = {}
    for name, wrap in {**versions, TORCH_DDP: None}.items():
        model = MLP(list(sizes), seed=0).to(device)
        if wrap is None:
            forward, finish = DistributedDataParallel(model, bucket_cap_mb=bucket_mb), (lambda: None)
        else:
            ddp = wrap(model)
            forward, finish = ddp, ddp.finish_gradient_synchronization
        runners[name] = (forward, finish, torch.optim.SGD(model.parameters(), lr=1e-3))

    cpu: dict[str, list[float]] = {}
    calls: dict[str, int] = {}

    def train(name, forward, finish, optimizer):
        def run():
            calls[name] = calls.get(name, 0) + 1
            started = time.process_time()  # this rank's CPU time, all its threads (gloo's copies too)
            for _ in range(steps):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(forward(x), y).backward()
                finish()
                optimizer.step()
            if calls[name] > warmup:
                cpu.setdefault(name, []).append((time.process_time() - started) / steps)

        return run

    seconds = take_turns({name: train(name, *parts) for name, parts in runners.items()}, repeats, warmup)
    return {"seconds": seconds, "cpu": cpu}


def bench_ddp(
    versions: dict,
    world_size: int = 2,
    sizes=DDP_MODEL,
    batch: int = 32,
    steps: int = 3,
    repeats: int = 7,
    warmup: int = 2,
    bucket_mb: float = 25.0,
    timeout: float = 600.0,
    device: str = "cpu",
) -> list[dict]:
    """Training steps per second of each data-parallel version in ``versions`` (name ->
    ``wrap(model)``, see :func:`_ddp_step_times`) and of torch's DistributedDataParallel,
    side by side in one launch: same model (``MLP(sizes)``), same data (``batch`` samples per
    rank), one CPU thread per rank (``device="cuda"``: one GPU per rank).  The versions take turns
    (order rotated each repeat);
    a sample is ``steps`` steps on the slowest rank; a row reports the median of ``repeats``
    samples after ``warmup`` ones, and ``ratio`` = steps/s ÷ torch DDP's.

        >>> rows = bench_ddp({"bucketed": BucketedDDP}, world_size=2)
        >>> print(format_ddp_table(rows))
    """
    if world_size < 2:
        raise ValueError(f"a data-parallel benchmark needs world_size >= 2, got {world_size}")
    per_rank = launch(
        _ddp_step_times,
        world_size,
        versions,
        tuple(sizes),
        batch,
        steps,
        repeats,
        warmup,
        bucket_mb,
        timeout=timeout,
        device=device,
    )
    rows = []
    for name in [*versions, TORCH_DDP]:
        rows.append(
            {
                "version": name,
                "world_size": world_size,
                "steps_per_s": steps / slowest_median([rank["seconds"][name] for rank in per_rank]),
                "cpu_s_per_step": statistics.mean(statistics.median(rank["cpu"][name]) for rank in per_rank),
                "repeats": repeats,
                "parameters": mlp_parameters(sizes),
            }
        )
    reference = next(r["steps_per_s"] for r in rows if r["version"] == TORCH_DDP)
    for row in rows:
        row["ratio"] = row["steps_per_s"] / reference
    return rows


def format_ddp_table(rows: list[dict]) -> str:
    """Steps/s per version, the ratio to torch DDP's and the CPU each rank spent per step; where a version is
    below torch DDP, the two side by side (``_below_torch``)."""
    first = rows[0]
    width = version_width(rows, 16)
    lines = [
        f"training steps/s on {first['world_size']} ranks, MLP of {first['parameters'] / 1e6:.1f} M "
        f"parameters, median of {first['repeats']}; CPU: each rank's, all its threads (gloo's copies too), mean of "
        f"the ranks' medians",
        f"{'version':<{width}} {'steps/s':>8} {'vs ' + TORCH_DDP:>14} {'CPU ms/step/rank':>17}",
    ]
    for r in rows:
        cpu = f"{r['cpu_s_per_step'] * 1e3:.1f}" if "cpu_s_per_step" in r else "-"
        lines.append(f"{r['version']:<{width}} {r['steps_per_s']:>8.2f} {r['ratio']:>13.2f}x {cpu:>17}")
    return "\n".join(lines + _below_torch(rows))


def _below_torch(rows: list[dict]) -> list[str]:
    """Where a wrapper is slower than torch DDP: its CPU per step against torch's, and why they go together when
    the ranks outnumber the cores."""
    torch_row = next((r for r in rows if r["version"] == TORCH_DDP), None)
    below = [r for r in rows if r is not torch_row and r.get("ratio", 1.0) < 1.0 and "cpu_s_per_step" in r]
    if torch_row is None or "cpu_s_per_step" not in torch_row or not below:
        return []
    lines = [
        f"below {TORCH_DDP}, with the CPU per step against its: every version sends the same bytes (each gradient "
        f"all-reduced once).  naive all-reduces after backward, nothing overlapped: the baseline the other wrappers "
        f"improve on, below by design.  The others run their hooks and buckets in Python where torch's reducer is "
        f"C++, and with more ranks than cores (this machine has {os.cpu_count()}) a step's time is the CPU the ranks "
        f"share.  From launch to launch these ratios move by about 10 % here (overlapped on 8 ranks: 0.97x, then "
        f"1.05x, in two quiet runs of 4 Dec)"
    ]
    cpu = torch_row["cpu_s_per_step"]
    for r in below:
        lines.append(
            f"  {r['version']}: {r['ratio']:.2f}x its steps/s; CPU {r['cpu_s_per_step'] * 1e3:.1f} ms per step "
            f"against {cpu * 1e3:.1f} ({r['cpu_s_per_step'] / cpu:.2f}x)"
        )
    return lines


NAME = "ddp"
HELP = "lab 3's data-parallel wrappers against torch DDP (steps/s)"
LAB = os.path.join("03_data_parallel", "03_data_parallel.ipynb")
CLASSES = {"naive": "NaiveDDP", "overlapped": "OverlappedDDP", "bucketed": "BucketedDDP"}


def add_arguments(parser) -> None:
    add_notebook_argument(parser, LAB)
    add_world_size_argument(parser, (2,))
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size of BucketedDDP and torch DDP")


QUICK = ["--bucket-mb", "4"]  # bench all --quick


def measure(args) -> Measured:
    classes = functions_from_lab(args, LAB, list(CLASSES.values()), "data-parallel wrappers")
    return over_world_sizes(args, functools.partial(_measure, classes))


def _measure(classes: dict, args) -> Measured:
    versions = {name: classes[cls] for name, cls in CLASSES.items() if cls in classes}
    if "bucketed" in versions:
        versions[f"bucketed ({args.bucket_mb:g} MiB)"] = functools.partial(
            versions.pop("bucketed"), bucket_mb=args.bucket_mb
        )
    rows = bench_ddp(versions, world_size=args.world_size, repeats=args.repeats, bucket_mb=args.bucket_mb)
    pictures = [chart(rows, f"Data parallel on {args.world_size} ranks", "steps_per_s", "steps/s")]
    return Measured(rows, format_ddp_table(rows), pictures)
