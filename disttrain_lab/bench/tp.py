"""``disttrain-lab bench tp``: step time and bytes per step of a Megatron-style MLP, side by side
with ``torch.distributed.tensor.parallel`` (ColwiseParallel / RowwiseParallel on a DeviceMesh)."""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from ..devices import device as rank_device
from ..events import format_bytes
from ..launcher import launch
from ..models import MLP, regression_data
from .command import Measured, add_world_size_argument, progress
from .notebook import add_notebook_argument, functions_from_lab
from .stats import slowest_median
from .tables import chart, mlp_parameters, ratio_cell, scaling_chart, scaling_table, version_width
from .timing import collective_bytes_counter, sent_bytes, take_turns

TORCH_TP = "torch Colwise/RowwiseParallel"
TP_MODEL = (1024, 4096, 1024)  # a transformer block's MLP, d -> 4d -> d: 8.4 M parameters


def _torch_tensor_parallel(dense, device):
    # here, not at the top: a torch that cannot import tensor parallelism is a row's error
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return parallelize_module(dense, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _tp_step_times(versions: dict, sizes, batch: int, steps: int, repeats: int, warmup: int) -> dict:
    """In each rank: per version, seconds per ``steps`` training steps (interleaved, order
    rotated), collective bytes and calls of one step, or why it could not run.

    ``versions`` maps a name to ``make(dense_mlp)`` returning the tensor-parallel module over all
    ranks; torch's ``parallelize_module`` with ColwiseParallel/RowwiseParallel runs beside them.
    The input requires a gradient, as inside a network, so backward all-reduces it too.
    """
    device = rank_device()
    data = regression_data(batch, sizes[0], sizes[-1], seed=1)
    x, y = data.x.to(device), data.y.to(device)
    runners, unavailable = {}, {}
    for name, make in {**versions, TORCH_TP: None}.items():
        dense = MLP(list(sizes), seed=0).to(device)
        if make is not None:
            model = make(dense)  # an error in the lab's class surfaces as it is
        else:
            try:
                model = _torch_tensor_parallel(dense, device)
            except Exception as exc:  # torch's version may not run on this backend: say why, measure ours
                unavailable[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
                continue
        runners[name] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))

    def step(model, optimizer):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x.clone().requires_grad_()), y).backward()
        optimizer.step()

    calls = {}
    for name, (model, optimizer) in runners.items():
        counter = collective_bytes_counter()
        with counter:
            step(model, optimizer)
        calls[name] = counter.calls
    sent, counted = sent_bytes({name: functools.partial(step, *parts) for name, parts in runners.items()})
    communicated = {name: (sent[name], calls[name]) for name in runners}

    def steps_of(parts):
        def run():
            for _ in range(steps):
                step(*parts)

        return run

    seconds = take_turns({name: steps_of(parts) for name, parts in runners.items()}, repeats, warmup)
    return {"seconds": seconds, "communicated": communicated, "counted": counted, "unavailable": unavailable}


def bench_tp(
    versions: dict,
    world_sizes=(1, 2, 4),
    sizes=TP_MODEL,
    batch: int = 64,
    steps: int = 2,
    repeats: int = 5,
    warmup: int = 1,
    timeout: float = 600.0,
) -> list[dict]:
    """Training step time and bytes communicated per step of each tensor-parallel MLP in
    ``versions`` (name -> ``make(dense)``, see :func:`_tp_step_times`) and of torch's
    ``parallelize_module(ColwiseParallel, RowwiseParallel)``, side by side in one launch per
    world size: same ``MLP(sizes)``, same batch.  A sample is ``steps`` steps on the slowest
    rank; rows report the median of ``repeats`` samples after ``warmup``, the bytes rank 0 sent per
    step (``timing.sent_bytes``: over gloo, as the OS counted them) and its collective calls, and
    ``ratio`` = torch's step time ÷ this one's (above 1: faster than torch).

        >>> print(format_tp_table(bench_tp({"TensorParallelMLP": TensorParallelMLP})))
    """
    for n in world_sizes:
        if sizes[1] % n:
            raise ValueError(f"the hidden width {sizes[1]} must be divisible by every world size; {n} is not a divisor")
    rows = []
    for n in progress(world_sizes, desc="bench tp", unit="world size"):
        per_rank = launch(_tp_step_times, n, versions, tuple(sizes), batch, steps, repeats, warmup, timeout=timeout)
        first = per_rank[0]
        for name in [*versions, TORCH_TP]:
            row = {"version": name, "world_size": n, "batch": batch, "sizes": tuple(sizes), "repeats": repeats}
            row["counted"] = first["counted"]
            if name in first["unavailable"]:
                row["error"] = first["unavailable"][name]
            else:
                row["ms_per_step"] = 1e3 * slowest_median([rank["seconds"][name] for rank in per_rank]) / steps
                row["bytes_per_step"], row["calls_per_step"] = first["communicated"][name]
            rows.append(row)
        reference = next((r for r in rows[-len(versions) - 1 :] if r["version"] == TORCH_TP and "error" not in r), None)
        for row in rows[-len(versions) - 1 :]:
            if reference is not None and "error" not in row:
                row["ratio"] = reference["ms_per_step"] / row["ms_per_step"]
    return rows


def format_tp_table(rows: list[dict]) -> str:
    """One line per (world size, version): ms per step, collective bytes and calls per step, vs torch."""
    first = rows[0]
    sizes = first["sizes"]
    parameters = mlp_parameters(sizes)
    width = version_width(rows, 20)
    lines = [
        f"training step of an MLP {' -> '.join(map(str, sizes))} ({parameters / 1e6:.1f} M parameters), "
        f"batch {first['batch']}, median of {first['repeats']}; bytes: what rank 0 sent per step ({first['counted']}); "
        "calls: its collectives per step",
        f"{'N':>2} {'version':<{width}} {'ms/step':>8} {'bytes/step':>11} {'calls':>5} {'vs torch':>9}",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['world_size']:>2} {r['version']:<{width}} not measured: {r['error']}")
        else:
            ratio = ratio_cell(r, 9)
            lines.append(
                f"{r['world_size']:>2} {r['version']:<{width}} {r['ms_per_step']:>8.1f} "
                f"{format_bytes(r['bytes_per_step']):>11} {r['calls_per_step']:>5} {ratio}"
            )
    if any(r["world_size"] == 1 and "error" not in r for r in rows):
        lines.append(
            "(N = 1: both are the MLP's two matrix products on one rank, nothing communicated; their ratio there is "
            "the machine's noise, 0.97-1.08x in the runs measured)"
        )
    return "\n".join(lines)


NAME = "tp"
HELP = "lab 6's TensorParallelMLP against torch's ColwiseParallel/RowwiseParallel at N = 1, 2, 4"
LAB = os.path.join("06_tensor_parallel", "06_tensor_parallel.ipynb")


def add_arguments(parser) -> None:
    add_notebook_argument(parser, LAB)
    add_world_size_argument(parser, (1, 2, 4))


QUICK = ["--world-size", "2"]  # bench all --quick


def measure(args) -> Measured:
    found = functions_from_lab(args, LAB, ["TensorParallelMLP"], "tensor-parallel MLP")
    rows = bench_tp(found, world_sizes=args.world_size, repeats=args.repeats)
    pictures = [chart(rows, "Tensor-parallel MLP", "ms_per_step", "ms per step", series="world_size", named="{} ranks")]
    table = format_tp_table(rows)
    if len(args.world_size) > 1:
        table += "\n\n" + scaling_table(rows)
        pictures.append(scaling_chart(rows))
    return Measured(rows, table, pictures)
