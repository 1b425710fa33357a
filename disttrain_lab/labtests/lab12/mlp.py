"""Lab 12's part 2: the training its checkpoint tests (and the notebook's demonstrations) run.

A small MLP in float64, so that a run resumed on another grid matches one process to 1e-13 (float32's
reduction order alone gives 5e-5), Adam, whose moments a checkpoint must carry (without them the
parameters differ by 1e-2 in one step), and a loader drawing each global batch from a generator,
whose state is the loader's position.  Laid out on a launch's ranks in one of :data:`LAYOUTS`, or in
one process with no process group (:func:`reference`, the grader's own run).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "HIDDEN",
    "LAYOUTS",
    "WIDE",
    "RANKS",
    "Training",
    "full_parameters",
    "mlp_model",
    "reference",
    "reference_parameters",
    "train_step",
    "training",
]

WIDTH, HIDDEN, BATCH, LR = 16, 32, 8, 1e-2
WIDE = 1024  # part 3's hidden width: a step's 0.4 MB between 2 FSDP ranks outweighs a checkpoint's few KB of plans
DATA_SEED = 1234
RANKS = {"dp2xtp2": 4, "fsdp": 2, "tp": 2, "plain": 1}  # the graded cases' ranks for each layout
LAYOUTS = tuple(RANKS)


@dataclass
class Training:
    """One rank's share of the training: its model and optimizer in their layout, the data loader's
    generator (its state is the loader's position), and which part of each batch the rank trains on."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    dp_rank: int
    dp_size: int


def mlp_model(seed: int, hidden: int = HIDDEN) -> nn.Module:
    """The MLP whole, in float64, initialised from ``seed``: what every layout shards, and torchft's replicas train."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, hidden), nn.ReLU(), nn.Linear(hidden, WIDTH)).double()


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed((DATA_SEED + seed) % 2**63)


def training(layout: str, seed: int = 0, hidden: int = HIDDEN) -> Training:
    """The MLP (initialised from ``seed``, ``hidden`` wide) laid out on this launch's ranks, Adam, and a
    fresh loader.

    ``"dp2xtp2"``: 4 ranks, a 2 × 2 mesh, tensor parallel over ``tp`` (the first layer column-wise,
    the second row-wise) and FSDP2 (``fully_shard``) over ``dp``; ``"fsdp"``: FSDP2 over every rank;
    ``"tp"``: tensor parallel over every rank; ``"plain"``: one rank, no sharding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    model, world = mlp_model(seed, hidden), dist.get_world_size()
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    dp_rank, dp_size = 0, 1
    if layout == "dp2xtp2":
        if world != 4:
            raise ValueError(f"the dp2xtp2 layout needs 4 ranks, this launch has {world}")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
        dp_rank, dp_size = mesh["dp"].get_local_rank(), 2
    elif layout == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        dp_rank, dp_size = dist.get_rank(), world
    elif layout == "tp":
        parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
    elif world != 1:
        raise ValueError(f"the plain layout is one rank's, this launch has {world}")
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    return Training(model, optimizer, _generator(seed), dp_rank, dp_size)


def reference(steps: int, seed: int = 0, hidden: int = HIDDEN) -> Training:
    """The training of ``seed`` in this process (no process group: the grader's own run) after ``steps``
    steps on whole batches, never interrupted."""
    model = mlp_model(seed, hidden)
    t = Training(model, torch.optim.Adam(model.parameters(), lr=LR), _generator(seed), 0, 1)
    for _ in range(steps):
        train_step(t)
    return t


def train_step(t: Training) -> None:
    """One step: the loader's next global batch, this rank's rows of it, a mean squared error, Adam."""
    x = torch.randn(BATCH, WIDTH, generator=t.generator, dtype=torch.float64)
    y = torch.randn(BATCH, WIDTH, generator=t.generator, dtype=torch.float64)
    rows = slice(t.dp_rank * BATCH // t.dp_size, (t.dp_rank + 1) * BATCH // t.dp_size)
    t.optimizer.zero_grad()
    with warnings.catch_warnings():  # (torch 2.13's FSDP2 warns of any view it returns; none is changed in place)
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        out = t.model(x[rows])
    ((out - y[rows]) ** 2).mean().backward()  # FSDP averages the ranks' means over dp
    t.optimizer.step()


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a DTensor's ``full_tensor()``: a collective, so every rank calls it)."""
    quiet = logging.getLogger("torch.distributed.tensor._redistribute")  # (its note on a 2-D shard's 2 all-gathers)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return {
            name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()
        }
    finally:
        quiet.setLevel(level)


def reference_parameters(steps: int, seed: int = 0, hidden: int = HIDDEN) -> dict[str, torch.Tensor]:
    """The parameters after ``steps`` steps of one process training on whole batches, never interrupted."""
    return {name: p.detach().clone() for name, p in reference(steps, seed, hidden).model.named_parameters()}
