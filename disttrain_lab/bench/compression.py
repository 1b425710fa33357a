"""``disttrain-lab bench compression``: gradient compression hooks in torch DDP, on an emulated link.

The lab's hooks (top-k with error feedback, INT8) and torch's own (``allreduce_hook``, the dense
baseline; ``fp16_compress_hook``; ``powerSGD_hook``) train the same model on the same data in
one launch, over the same emulated link (``dl.Network``), taking turns so a busy moment of the
machine hurts them alike.  Per version: training steps per second (the slowest rank, median),
the bytes rank 0 sends per step (``timing.sent_bytes``: as the OS counted them on its connections,
payload and gloo's headers), the CPU time a rank spends per step (all its threads: the hook's
compression and decompression, gloo's copies, the model), and the loss after the same number of steps.

Like with like: every hook gets the same DDP buckets (``BUCKET_MB``; torch's PowerSGD hook one
bucket, see ``_compression_step_times``) and the same emulated link, whose α–β model charges an
all-gather on 2 ranks what it charges an all-reduce of the same bytes per rank; torch's hooks and
the lab's make one collective per bucket (fp16: an all-reduce of half the bytes; the lab's: an
all-gather of each rank's packed piece).  The link's time is a wait, the same on a busy machine;
the compression's time is CPU time on the step's critical path, which a loaded machine stretches:
fp16's cast is cheap and its step mostly the link's, top-k and INT8 trade link time for CPU time,
so their ratios to fp16 fall as the load rises (compare the CPU column, which the load barely moves).

    >>> found = bench.functions_from_notebook("solutions/07_compression/07_compression.ipynb",
    ...                                       ["TopKState", "topk_hook", "int8_hook"])
    >>> rows = bench_compression(lab_versions(found), network=Network.preset("1 Gbit Ethernet"))
    >>> print(format_compression_table(rows))
"""

from __future__ import annotations

import functools
import os
import statistics
import time

from ..network import Network
from .command import Measured, add_world_size_argument, over_world_sizes
from .notebook import add_notebook_argument, functions_from_lab
from .stats import slowest_median
from .tables import chart, mlp_parameters
from .timing import sent_bytes, take_turns

TORCH_DENSE = "torch allreduce_hook (dense)"
TORCH_FP16 = "torch fp16_compress_hook"
TORCH_POWERSGD = "torch powerSGD_hook, rank 2"
COMPRESSION_MODEL = (512, 1024, 1024, 512)  # an MLP of 2.1 M parameters: 8.4 MB of fp32 gradients
# DDP's bucket cap: the model's three layers in three buckets (2, 4, 2 MiB), one collective each, so a hook
# overlaps them.  (torch's default, 25 MiB with a first bucket of 1 MiB, gives this model two.)
BUCKET_MB = 2.0
ONE_BUCKET_MB = 64.0  # torch's powerSGD_hook: one bucket (below)


def lab_versions(found: dict, density: float = 0.01, chunk_size: int = 1024) -> dict:
    """The lab's hooks as ``name -> (make_state, hook)``, from what its notebook defines."""
    versions = {}
    if "TopKState" in found and "topk_hook" in found:
        make, hook = found["TopKState"], found["topk_hook"]
        versions[f"top-k {density:.0%} + error feedback"] = (lambda: make(density), hook)
    if "int8_hook" in found:
        versions["INT8"] = (lambda: chunk_size, found["int8_hook"])
    return versions


def _torch_versions() -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    def powersgd_state():
        # start_powerSGD_iter > 1: torch needs a few dense steps before error feedback and warm start
        return powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=2,
            start_powerSGD_iter=2,
            min_compression_rate=0.1,
            use_error_feedback=True,
            warm_start=True,
        )

    return {
        TORCH_DENSE: (lambda: None, default_hooks.allreduce_hook),
        TORCH_FP16: (lambda: None, default_hooks.fp16_compress_hook),
        TORCH_POWERSGD: (powersgd_state, powerSGD_hook.powerSGD_hook),
    }


def _compression_step_times(
    versions: dict, sizes, batch: int, steps: int, repeats: int, warmup: int, lr: float, bucket_mb: float = BUCKET_MB
) -> dict:
    """In each rank: seconds per ``steps`` DDP steps of every version (taking turns), and its last loss."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ..models import MLP, regression_data

    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = regression_data(batch * world_size, sizes[0], sizes[-1], seed=1)
    x, y = data.x.tensor_split(world_size)[rank], data.y.tensor_split(world_size)[rank]
    losses, runners, calls, cpu, steps_of = {}, {}, {}, {}, {}
    for name, (make_state, hook) in versions.items():
        # every hook gets the same buckets (bucket_cap_mb given: the first bucket is not capped at
        # 1 MiB), so an asynchronous hook overlaps one bucket's compression with the previous one's
        # transfer; except torch's PowerSGD hook, which gets one bucket: it waits for its own
        # all-reduces inside future callbacks, on gloo's two worker threads, and with several
        # buckets in flight that deadlocks (seen here, no emulation involved)
        cap = ONE_BUCKET_MB if name == TORCH_POWERSGD else bucket_mb
        model = DistributedDataParallel(MLP(list(sizes), seed=0), bucket_cap_mb=cap)
        model.register_comm_hook(make_state(), hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)

        def one_step(model=model, optimizer=optimizer):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            return loss

        steps_of[name] = one_step

        def run(name=name, one_step=one_step):
            calls[name] = calls.get(name, 0) + 1
            started = time.process_time()  # this rank's CPU time, all its threads
            for _ in range(steps):
                losses[name] = one_step().item()
            if calls[name] > warmup:
                cpu.setdefault(name, []).append((time.process_time() - started) / steps)

        runners[name] = run
    seconds = take_turns(runners, repeats, warmup)
    sent, counted = sent_bytes(steps_of)  # one more step each, after the timed ones (PowerSGD compresses by then)
    return {"seconds": seconds, "loss": losses, "cpu": cpu, "bytes": sent, "counted": counted}


def bench_compression(
    versions: dict,
    world_size: int = 2,
    network: Network | None = None,
    sizes=COMPRESSION_MODEL,
    batch: int = 32,
    steps: int = 2,
    repeats: int = 5,
    warmup: int = 1,
    lr: float = 0.01,
    bucket_mb: float = BUCKET_MB,
    timeout: float = 600.0,
) -> list[dict]:
    """Steps/s, bytes per step and final loss of each hook in ``versions`` (name -> ``(make_state,
    hook)``) and of torch's allreduce, fp16 and PowerSGD hooks, side by side in one launch over
    ``network`` (default: 1 Gbit Ethernet), DDP buckets of ``bucket_mb`` MiB (torch's PowerSGD:
    one bucket).  ``ratio`` is steps/s ÷ the dense all-reduce's."""
    from ..launcher import launch

    if world_size < 2:
        raise ValueError(f"a data-parallel benchmark needs world_size >= 2, got {world_size}")
    network = network or Network.preset("1 Gbit Ethernet")
    everything = {**_torch_versions(), **versions}
    run = launch(
        _compression_step_times,
        world_size,
        everything,
        tuple(sizes),
        batch,
        steps,
        repeats,
        warmup,
        lr,
        bucket_mb,
        timeout=timeout,
        network=network,
    )
    total_steps = (warmup + repeats) * steps  # for the loss (its bytes: one more step, counted after)
    rows = []
    for name in everything:
        rows.append(
            {
                "version": name,
                "world_size": world_size,
                "network": str(network),
                "repeats": repeats,
                "steps_per_s": steps / slowest_median([r["seconds"][name] for r in run]),
                "bytes_per_step": run[0]["bytes"][name],
                "counted": run[0]["counted"],
                "loss": run[0]["loss"][name],
                "cpu_s_per_step": statistics.mean(statistics.median(r["cpu"][name]) for r in run),
                "steps": total_steps,
                "parameters": mlp_parameters(sizes),
                "sizes": tuple(sizes),
            }
        )
    dense = next(r["steps_per_s"] for r in rows if r["version"] == TORCH_DENSE)
    for row in rows:
        row["ratio"] = row["steps_per_s"] / dense
    return rows


def format_compression_table(rows: list[dict]) -> str:
    from ..trace import format_bytes

    first = rows[0]
    lines = [
        f"compression hooks in torch DDP: MLP {' -> '.join(map(str, first['sizes']))} "
        f"({first['parameters'] / 1e6:.1f} M parameters), {first['world_size']} ranks, {first['network']}; "
        f"median of {first['repeats']}; bytes: what rank 0 sent per step ({first['counted']})",
        f"{'version':<34} {'steps/s':>8} {'bytes/step/rank':>16} {'CPU ms/step/rank':>17} "
        f"{'loss after ' + str(first['steps']):>15} {'vs dense':>9}",
    ]
    for r in rows:
        cpu = f"{r['cpu_s_per_step'] * 1e3:.1f}" if "cpu_s_per_step" in r else "-"
        lines.append(
            f"{r['version']:<34} {r['steps_per_s']:8.2f} {format_bytes(r['bytes_per_step']):>16} {cpu:>17} "
            f"{r['loss']:15.4f} {r['ratio']:8.2f}x"
        )
    return "\n".join(lines + _below_torch(rows))


def _below_torch(rows: list[dict]) -> list[str]:
    """Where a lab's hook is slower than torch's fastest compression hook (fp16 or PowerSGD): the two side by
    side in bytes and CPU per step, and why they go together on one host."""
    peers = [r for r in rows if r["version"] in (TORCH_FP16, TORCH_POWERSGD)]
    if not peers:
        return []
    peer = max(peers, key=lambda r: r["steps_per_s"])
    below = [r for r in rows if not r["version"].startswith("torch") and r["steps_per_s"] < peer["steps_per_s"]]
    if not below:
        return []
    from ..trace import format_bytes

    lines = [
        f"below {peer['version']}, the fastest of torch's compression hooks here, with what each sends and spends "
        f"per step: on one host the link is a CPU core, so a hook is slower where it sends more or computes more. "
        f"The lab's INT8 all-gathers every rank's int8 gradient, (N - 1)·S/4 bytes per rank, where fp16 "
        f"all-reduces half of it, 2(N - 1)/N·S/2: the same on 4 ranks, twice as much on 8; top-k sends far less "
        f"but selects its values and keeps its error on the CPU every step, with N ranks sharing the cores"
    ]
    for r in below:
        cpu = (
            f", CPU {r['cpu_s_per_step'] * 1e3:.1f} ms against {peer['cpu_s_per_step'] * 1e3:.1f}"
            if "cpu_s_per_step" in r and "cpu_s_per_step" in peer
            else ""
        )
        lines.append(
            f"  {r['version']}: {r['steps_per_s'] / peer['steps_per_s']:.2f}x its steps/s; sends "
            f"{format_bytes(r['bytes_per_step'])} against {format_bytes(peer['bytes_per_step'])}{cpu}"
        )
    return lines


NAME = "compression"
HELP = "lab 7's compression hooks against torch's allreduce, fp16 and PowerSGD hooks on an emulated link"
LAB = COMPRESSION_LAB = os.path.join("07_compression", "07_compression.ipynb")


def add_arguments(parser) -> None:
    add_notebook_argument(parser, LAB)
    add_world_size_argument(parser, (2,))


QUICK: list[str] = []  # bench all --quick (its model as it is: ~10 s on 2 cores)


def measure(args) -> Measured:
    found = functions_from_lab(args, LAB, ("TopKState", "topk_hook", "int8_hook"), "compression hooks")
    return over_world_sizes(args, functools.partial(_measure, found))


def _measure(found: dict, args) -> Measured:
    rows = bench_compression(lab_versions(found), world_size=args.world_size, repeats=args.repeats)
    pictures = [
        chart(rows, f"Compression hooks on an emulated link, {args.world_size} ranks", "steps_per_s", "steps/s"),
        chart(
            rows, f"Bytes each rank sends per step, {args.world_size} ranks", "bytes_per_step", "MiB", scale=1 / 2**20
        ),
    ]
    return Measured(rows, format_compression_table(rows), pictures)
