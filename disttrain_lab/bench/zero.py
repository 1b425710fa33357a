"""``disttrain-lab bench zero``: steps per second, bytes sent per step and bytes held per rank of the
lab's ZeRO classes, side by side with torch's ZeroRedundancyOptimizer and FSDP (``fully_shard``)."""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import memory
from ..devices import device as rank_device
from ..events import format_bytes
from ..launcher import launch
from ..models import MLP, regression_data
from .command import Measured, add_world_size_argument, over_world_sizes
from .notebook import add_notebook_argument, functions_from_lab
from .stats import below_in_noise, slowest_median, slowest_samples, spread
from .tables import Chart, chart, mlp_parameters, version_width
from .timing import sent_bytes

TORCH_ZERO_REDUNDANCY = "torch DDP + ZeroRedundancyOptimizer"
TORCH_FSDP = "torch FSDP (fully_shard)"
ZERO_MODEL = (1024, 2048, 2048, 1024)  # the DDP bench's MLP: 8.4 M parameters, 134 MB of fp32 Adam training state


def _torch_zero_redundancy(model, lr: float):
    """ZeRO-1 as torch ships it: DDP all-reduces gradients, ZeroRedundancyOptimizer keeps Adam
    state for this rank's parameters only and broadcasts the updated parameters."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # (heavy: loaded by this benchmark only)

    wrapped = DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=lr)
    return wrapped, optimizer


def _torch_fsdp(model, lr: float):
    """ZeRO-3 as torch ships it: FSDP2's fully_shard on every parameterised layer, then the root."""
    from torch.distributed.fsdp import fully_shard  # (heavy: loaded by this benchmark only)

    for layer in memory.layers_with_parameters(model).values():
        if layer is not model:
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def _lab_zero(stage: int, cls, model, lr: float):
    """A lab's ZeRO class as its users build it: stages 1-2 wrap an optimizer like ZeroRedundancyOptimizer,
    ``cls(model.parameters(), torch.optim.Adam, lr=lr)``; stage 3 wraps the model like ``fully_shard``,
    with Adam on the wrapper's parameters (the shards).  Returns (forward, optimizer)."""
    if stage == 3:
        wrapped = cls(model)
        return wrapped, torch.optim.Adam(wrapped.parameters(), lr=lr)
    return model, cls(model.parameters(), torch.optim.Adam, lr=lr)


def _zero_step_times(versions: dict, sizes, batch: int, steps: int, repeats: int, warmup: int, lr: float) -> dict:
    """In each rank: seconds per ``steps`` Adam steps of every version, interleaved, the bytes each
    holds after the last backward (``memory.held``; gradients present), and the bytes this rank sends in
    one more step of each (``sent_bytes``)."""
    rank, world_size, device = dist.get_rank(), dist.get_world_size(), rank_device()
    data = regression_data(batch * world_size, sizes[0], sizes[-1], seed=1)
    x, y = data.x.tensor_split(world_size)[rank].to(device), data.y.tensor_split(world_size)[rank].to(device)
    runners = {}
    for name, make in versions.items():
        model = MLP(list(sizes), seed=0).to(device)
        forward, optimizer = make(model, lr)
        runners[name] = (model, forward, optimizer)
    names, seconds, held = list(runners), {}, {}
    for i in range(warmup + repeats):
        shift = i % len(names)  # rotate the order so no version always goes first
        for name in names[shift:] + names[:shift]:
            model, forward, optimizer = runners[name]
            dist.barrier()
            start = time.perf_counter()
            for step in range(steps):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(forward(x), y).backward()
                if step == steps - 1 and i == warmup + repeats - 1:
                    pause = time.perf_counter()  # measuring is not training: leave it out of the time
                    held[name] = memory.held(model, optimizer).as_dict()
                    start += time.perf_counter() - pause
                optimizer.step()
            if i >= warmup:
                seconds.setdefault(name, []).append(time.perf_counter() - start)

    def one_step(name):
        model, forward, optimizer = runners[name]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(forward(x), y).backward()
        optimizer.step()

    sent, counted = sent_bytes({name: functools.partial(one_step, name) for name in names})  # one more step each
    return {"seconds": seconds, "held": held, "sent": sent, "counted": counted}


def bench_zero(
    versions: dict,
    world_size: int = 2,
    sizes=ZERO_MODEL,
    batch: int = 16,
    steps: int = 2,
    repeats: int = 5,
    warmup: int = 1,
    lr: float = 1e-3,
    predict=None,
    timeout: float = 600.0,
    device: str = "cpu",
) -> list[dict]:
    """Adam training steps per second and bytes held per rank of each ZeRO version, side by
    side with torch's ZeroRedundancyOptimizer (under DDP) and FSDP (``fully_shard``), in one launch.

    ``versions`` maps a name to ``(stage, cls)``: the lab's ``Zero1Optimizer`` / ``Zero2Optimizer``
    (built as ``cls(model.parameters(), torch.optim.Adam, lr=lr)``, like ZeroRedundancyOptimizer) or
    ``Zero3Module`` (built as ``cls(model)``, like ``fully_shard``, with Adam on its shards).  Same model, same data
    (``batch`` samples per rank), versions taking
    turns; a sample is ``steps`` steps on the slowest rank, a row the median of ``repeats``.
    ``ratio`` compares steps/s with torch's version of the same stage (stages 1-2:
    ZeroRedundancyOptimizer, stage 3: FSDP).  ``held`` is the largest rank's
    ``memory.held(...)`` after the last backward.  ``predict``, if given, is the lab's
    calculator ``predict(num_parameters, stage, world_size, param_bytes=4, grad_bytes=4,
    optimizer_bytes=8) -> {"total": ...}`` (fp32 Adam): rows then carry ``predicted``.

        >>> rows = bench_zero({"ZeRO-1": (1, Zero1Optimizer), "ZeRO-3": (3, Zero3Module)}, predict=zero_memory_per_rank)
        >>> print(format_zero_table(rows))
    """
    if world_size < 2:
        raise ValueError(f"a ZeRO benchmark needs world_size >= 2, got {world_size}")
    stages = {name: stage for name, (stage, _) in versions.items()}
    stages.update({TORCH_ZERO_REDUNDANCY: 1, TORCH_FSDP: 3})
    makers = {name: functools.partial(_lab_zero, stage, cls) for name, (stage, cls) in versions.items()}
    makers.update({TORCH_ZERO_REDUNDANCY: _torch_zero_redundancy, TORCH_FSDP: _torch_fsdp})
    per_rank = launch(
        _zero_step_times,
        world_size,
        makers,
        tuple(sizes),
        batch,
        steps,
        repeats,
        warmup,
        lr,
        timeout=timeout,
        device=device,
    )
    parameters = mlp_parameters(sizes)
    rows = []
    for name in makers:
        worst = max((rank["held"][name] for rank in per_rank), key=lambda h: h["total"])
        row = {
            "version": name,
            "stage": stages[name],
            "world_size": world_size,
            "parameters": parameters,
            "steps_per_s": steps / slowest_median([rank["seconds"][name] for rank in per_rank]),
            "spread": spread(slowest_samples([rank["seconds"][name] for rank in per_rank])),
            "repeats": repeats,
            "held": worst,
            "sent": per_rank[0]["sent"][name],
            "counted": per_rank[0]["counted"],
        }
        if predict is not None:
            row["predicted"] = int(
                predict(parameters, stages[name], world_size, param_bytes=4, grad_bytes=4, optimizer_bytes=8)["total"]
            )
        rows.append(row)
    by_name = {r["version"]: r for r in rows}
    for row in rows:
        reference = by_name[TORCH_FSDP if row["stage"] == 3 else TORCH_ZERO_REDUNDANCY]
        row["reference"] = reference["version"]
        row["ratio"] = row["steps_per_s"] / reference["steps_per_s"]
    return rows


def format_zero_table(rows: list[dict]) -> str:
    """Steps/s (and / torch's same stage), bytes held per rank (and / the formula, if predicted)."""
    first = rows[0]
    width = version_width(rows, 20)
    predicted = all("predicted" in r for r in rows)
    lines = [
        f"Adam steps/s and bytes held per rank (the largest rank, after backward) on {first['world_size']} "
        f"ranks, MLP of {first['parameters'] / 1e6:.1f} M parameters (fp32), median of {first['repeats']}; "
        f"sent: what rank 0 sent in a step ({first['counted']})",
        f"{'version':<{width}} {'stage':>5} {'steps/s':>8} {'vs torch':>9} {'sent':>9}   {'held':>9} "
        f"{'params':>9} {'grads':>9} {'optim':>9} {'other':>9}"
        + (f" {'formula':>9} {'held/formula':>12}" if predicted else ""),
    ]
    for r in rows:
        h = r["held"]
        line = (
            f"{r['version']:<{width}} {r['stage']:>5} {r['steps_per_s']:>8.2f} {r['ratio']:>8.2f}x "
            f"{format_bytes(r['sent']):>9}   "
            f"{format_bytes(h['total']):>9} {format_bytes(h['parameters']):>9} {format_bytes(h['gradients']):>9} "
            f"{format_bytes(h['optimizer_state']):>9} {format_bytes(h['other']):>9}"
        )
        if predicted:
            line += f" {format_bytes(r['predicted']):>9} {h['total'] / r['predicted']:>11.3f}x"
        lines.append(line)
    lines.append(f"(vs torch: stages 1-2 against {TORCH_ZERO_REDUNDANCY}, stage 3 against {TORCH_FSDP})")
    by_name = {r["version"]: r for r in rows}
    return "\n".join(lines + below_in_noise(rows, lambda r: by_name[r["reference"]]))


NAME = "zero"
HELP = "lab 4's ZeRO classes against ZeroRedundancyOptimizer and FSDP (steps/s, bytes per rank)"
LAB = os.path.join("04_zero", "04_zero.ipynb")
CLASSES = {"Zero1Optimizer": 1, "Zero2Optimizer": 2, "Zero3Module": 3}


def add_arguments(parser) -> None:
    add_notebook_argument(parser, LAB)
    add_world_size_argument(parser, (2,))


QUICK: list[str] = []  # bench all --quick (its model as it is)


def measure(args) -> Measured:
    found = functions_from_lab(args, LAB, [*CLASSES, "zero_memory_per_rank"], "ZeRO classes")
    return over_world_sizes(args, functools.partial(_measure, found))


def _measure(found: dict, args) -> Measured:
    versions = {name: (stage, found[name]) for name, stage in CLASSES.items() if name in found}
    rows = bench_zero(
        versions, world_size=args.world_size, repeats=args.repeats, predict=found.get("zero_memory_per_rank")
    )
    held = [r for r in rows if isinstance(r.get("held"), dict)]
    memory = {"held (the worst rank)": [(r["version"], r["held"]["total"] / 2**20) for r in held]}
    if any("predicted" in r for r in held):
        memory["the lab's formula"] = [(r["version"], r["predicted"] / 2**20) for r in held if "predicted" in r]
    pictures = [
        chart(rows, f"ZeRO on {args.world_size} ranks", "steps_per_s", "steps/s"),
        Chart("Memory per rank: parameters, gradients and optimizer state", "MiB", memory),
    ]
    return Measured(rows, format_zero_table(rows), pictures)
