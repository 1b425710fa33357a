"""``disttrain-lab bench checkpoint``: lab 12's checkpoints, what a save costs and what a failure costs.

**Saving** (FSDP2 on ``world_size`` ranks, a two-layer MLP of ``width`` in fp32 with Adam's state): the
lab's ``save_checkpoint`` beside torch's own ``dcp.save`` of the same state and ``dcp.async_save`` (its
own gloo group: on the training's, its background collectives collide with the step's), timed as the
step is blocked (the asynchronous save also to when its writing ends); the bytes each rank's file
holds, against 12·Ψ/N.

**Recovering** (the lab's ``train_with_checkpoints``, ``save_checkpoint`` and ``load_checkpoint`` on 2
ranks of FSDP, the lab's wide MLP, a checkpoint every ``every`` steps, rank 1 killed with ``SIGKILL`` as
it begins step ``kill_at + 1``): started again by the kit's launcher (``dl.launch`` reports the dead
rank, the job is launched again), and by torchrun's elastic agent (``--max-restarts 1``, which stops
the survivor and starts both again), each from the kill to the first step the new attempt finished:
the failure's report, the restart and the load.  torchrun runs with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torch 2.13 a restart's workers otherwise find the old
workers' addresses in the store the agent shares with them and fail to connect (pytorch#135712); the
row ``torchrun, shared store`` tries torch's default and says what happened (the restarted workers fail to
connect, or hang: a job not ended in ``TORCHRUN_TIMEOUT_S`` is stopped, the agent and its workers).

**Per-step fault tolerance** (torchft, where it is installed: ``pip install torchft==0.2.0`` installs beside
torch 2.13 and runs on gloo): the same MLP in two replica groups of one rank each, torchft's
``DistributedDataParallel`` and ``Manager`` with a lighthouse in this process (a heartbeat timeout of
``FT_HEARTBEAT_MS``); replica 1 is killed as it begins step ``kill_at + 1`` and started again at once.
Nothing is saved to disk: the survivor goes on alone once the lighthouse has given up the dead
replica (row ``torchft, survivor``: from the kill to its next step, no step run again), and the new
replica takes the survivor's state over the network at the next quorum and joins at that step (row
``torchft, replacement``: from the kill to its first step); the two must end with equal parameters.

The saves, the table and the command are here; the recovery rows are measured in recovery.py, the
script that torchrun's workers and torchft's replicas run.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

from ..launcher import launch
from .command import Measured, NotMeasured, add_world_size_argument
from .notebook import add_notebook_argument, functions_from_lab
from .recovery import FT_HEARTBEAT_MS, FT_REPLACEMENT, FT_SURVIVOR, NAMES, bench_recovery
from .stats import below_in_noise, slowest_samples, spread
from .tables import chart

NAME = "checkpoint"
HELP = "lab 12's save against dcp.save and async_save; a killed rank's recovery by dl.launch, torchrun and torchft"
LAB = os.path.join("12_running_jobs", "12_running_jobs.ipynb")
LAB_SAVE, DCP_SAVE, ASYNC_BLOCKED, ASYNC_WRITTEN = (
    "save_checkpoint (the lab's)",
    "dcp.save",
    "dcp.async_save, blocked",
    "dcp.async_save, written",
)
QUICK = ["--width", "256", "--repeats", "1", "--steps", "6", "--every", "2", "--kill-at", "3"]  # --quick


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What torch's saves write: the model's and the optimizer's state dicts (``get_state_dict``)."""
    return dict(zip(("model", "optim"), get_state_dict(model, optimizer)))


def _save_times(versions: dict, width: int, repeats: int, folder: str) -> dict:
    """In each rank: seconds the step is blocked by each save (and the asynchronous one's end), and the
    bytes of this rank's file of the last ``dcp.save``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, width)).sum().backward()
    optimizer.step()
    generator = torch.Generator().manual_seed(0)
    saver = dist.new_group(backend="gloo")  # the asynchronous save's own group
    rank, seconds, size = dist.get_rank(), {}, 0

    def timed(name, i, save, asynchronous=False):
        path = os.path.join(folder, f"{name.split()[0].rstrip(',')}-{i}")
        dist.barrier()
        start = time.perf_counter()
        pending = save(path)
        seconds.setdefault(name, []).append(time.perf_counter() - start)
        if asynchronous:
            pending.result()
            seconds.setdefault(ASYNC_WRITTEN, []).append(time.perf_counter() - start)
        return path

    dcp.save(_state(model, optimizer), checkpoint_id=os.path.join(folder, "warm"))
    for i in range(repeats):  # (after a first save, untimed: DCP's first call sets itself up)
        if "save_checkpoint" in versions:
            timed(LAB_SAVE, i, lambda p: versions["save_checkpoint"](p, model, optimizer, 1, generator))
        # (each save gathers its state dict inside its timing, as the lab's does: the same work in every row)
        last = timed(DCP_SAVE, i, lambda p: dcp.save(_state(model, optimizer), checkpoint_id=p))
        size = os.path.getsize(os.path.join(last, f"__{rank}_0.distcp"))
        timed(
            ASYNC_BLOCKED,
            i,
            lambda p: dcp.async_save(_state(model, optimizer), checkpoint_id=p, process_group=saver),
            asynchronous=True,
        )
    dist.barrier()
    return {"seconds": seconds, "bytes": size, "params": sum(p.numel() for p in model.parameters())}


def bench_saves(versions: dict, world_size: int = 2, width: int = 1024, repeats: int = 5) -> list[dict]:
    """A row per save: ``ms`` (median of the slowest rank) and rank 0's file ``bytes``; ``ratio``: dcp.save's
    time / this one's.  ``versions``: the notebook's ``save_checkpoint`` (may be missing)."""
    folder = tempfile.mkdtemp(prefix="disttrain-bench-checkpoint-")
    try:
        per_rank = launch(_save_times, world_size, versions, width, repeats, folder, timeout=600)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    first, rows = per_rank[0], []
    params = first["params"]
    for name in (LAB_SAVE, DCP_SAVE, ASYNC_BLOCKED, ASYNC_WRITTEN):
        row = {"part": "save", "version": name, "world_size": world_size, "size": {"width": width, "params": params}}
        if name not in first["seconds"]:
            rows.append({**row, "error": "the notebook defines no save_checkpoint"})
            continue
        ms = 1e3 * max(statistics.median(rank["seconds"][name]) for rank in per_rank)
        moves = spread(slowest_samples([rank["seconds"][name] for rank in per_rank]))
        row.update(ms=ms, spread=moves, repeats=repeats, bytes=first["bytes"], rule=12 * params / world_size)
        rows.append(row)
    base = next(r for r in rows if r["version"] == DCP_SAVE)
    for r in rows:
        if "ms" in r:
            r["baseline"], r["ratio"] = DCP_SAVE, base["ms"] / r["ms"]
    return rows


def format_checkpoint_table(rows: list[dict]) -> str:
    lines = []
    all_saves = [r for r in rows if r["part"] == "save"]
    for world_size in dict.fromkeys(r["world_size"] for r in all_saves):  # (a table per --world-size, in order)
        saves = [r for r in all_saves if r["world_size"] == world_size]
        first = saves[0]
        lines += [
            f"save on {world_size} ranks (FSDP2, a 2-layer MLP of width {first['size']['width']}, "
            f"{first['size']['params']:,} parameters, fp32 + Adam); ms the step is blocked, slowest rank's median; "
            "bytes: rank 0's file, against 12·Ψ/N; ratio: dcp.save's time / this one's",
            f"  {'version':<28} {'ms':>9} {'bytes':>13} {'12·Ψ/N':>13} {'ratio':>7}",
        ]
        for r in saves:
            if "error" in r:
                lines.append(f"  {r['version']:<28} not measured: {r['error']}")
            else:
                lines.append(
                    f"  {r['version']:<28} {r['ms']:>9.1f} {r['bytes']:>13,} {r['rule']:>13,.0f} {r['ratio']:>6.2f}x"
                )
        dcp_save = next((r for r in saves if r["version"] == DCP_SAVE and "ms" in r), None)
        if dcp_save is not None:  # (the asynchronous save's end is not a save blocking the step: not compared)
            blocking = [r for r in saves if r["version"] != ASYNC_WRITTEN]
            lines += ["  " + line for line in below_in_noise(blocking, lambda r, base=dcp_save: base)]
    recovery = [r for r in rows if r["part"] == "recovery"]
    if recovery:
        size = recovery[0].get("size", {})
        lines += [
            f"recovery on 2 ranks (the lab's wide MLP, FSDP2; {size.get('steps')} steps, a checkpoint every "
            f"{size.get('every')}, rank 1 killed after step {size.get('killed after')}): seconds from the kill to "
            "the first step of the new attempt (the failure's report, the restart, the load)",
            f"  {'version':<28} {'seconds':>9} {'resumed at':>11} {'steps lost':>11}",
        ]
        for r in recovery:
            if "error" in r:
                lines.append(f"  {r['version']:<28} not measured: {r['error']}")
            else:
                lines.append(f"  {r['version']:<28} {r['recovered_s']:>9.2f} {r['resumed']:>11} {r['lost_steps']:>11}")
        if any(r["version"] in (FT_SURVIVOR, FT_REPLACEMENT) and "error" not in r for r in recovery):
            lines.append(
                "  torchft: two replica groups of one rank, nothing saved and no step run again: the survivor waits "
                f"out the lighthouse's heartbeat timeout ({FT_HEARTBEAT_MS / 1000:g} s) and goes on alone; the "
                "replacement takes the survivor's state over the network and joins at the step shown "
                "(both end with equal parameters)"
            )
    return "\n".join(lines)


def add_arguments(parser) -> None:
    add_notebook_argument(parser, LAB)
    add_world_size_argument(parser, (2,), "ranks of the saves")
    parser.add_argument("--width", type=int, default=1024, help="the saved MLP's width (default %(default)s)")
    parser.add_argument("--steps", type=int, default=16, help="the recovered job's steps (default %(default)s)")
    parser.add_argument("--every", type=int, default=4, help="its checkpoint interval, steps (default %(default)s)")
    parser.add_argument("--kill-at", type=int, default=10, help="rank 1 dies after this step (default %(default)s)")


def measure(args) -> Measured:
    if not 0 < args.kill_at < args.steps:
        raise NotMeasured(f"--kill-at must lie between 0 and --steps: {args.kill_at} of {args.steps}")
    found = functions_from_lab(args, LAB, NAMES, "checkpointing functions")
    rows = []
    for world_size in args.world_size:
        rows += bench_saves(found, world_size, args.width, args.repeats)
    rows += bench_recovery(found, args.steps, args.every, args.kill_at)
    saves = [r for r in rows if r["part"] == "save" and "ms" in r]
    picture = chart(saves, "A checkpoint's save", "ms", "ms blocked", series="world_size", named="{} ranks")
    return Measured(rows, format_checkpoint_table(rows), [picture])
