"""``disttrain-lab bench allreduce``: all-reduce implementations measured the way nccl-tests does
(algbw and busbw against message size), side by side with ``dist.all_reduce``, and the CPU time
each call costs a rank (all its threads: the adds, and the copies through the sockets that gloo's
threads make).  The implementations come from a lab notebook (this package holds no solutions).
"""

from __future__ import annotations

import functools
import os
import statistics
import time

from ..events import format_bytes
from .command import Measured, NotMeasured, add_world_size_argument, over_world_sizes, progress
from .notebook import add_notebook_argument, functions_from_lab
from .stats import slowest_median
from .tables import chart

TORCH_ALL_REDUCE = "dist.all_reduce"
ALLREDUCE_SIZES = tuple(4 << (2 * k) << 10 for k in range(8))  # 4 KiB, 16 KiB, ..., 64 MiB


def busbw_factor(world_size: int) -> float:
    """busbw / algbw for all-reduce: 2(N-1)/N, the share of S that crosses each rank's link
    in an optimal algorithm, so busbw can be compared with the link's bandwidth at any N."""
    return 2 * (world_size - 1) / world_size


def _torch_all_reduce(x):
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def _probe_allreduce(fn, numel: int):
    """One call of ``fn`` on a small uneven tensor, compared with dist.all_reduce on the same ranks."""
    import torch
    import torch.distributed as dist

    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=torch.float64)
    expected = x.clone()
    dist.all_reduce(expected)
    fn(x)  # in place, like dist.all_reduce
    return float((x - expected).abs().max())


def _time_allreduce(algorithms: dict, sizes, repeats: int, warmup: int, dtype_name: str) -> dict:
    """In each rank: seconds per call of every algorithm at every size, interleaved, and the CPU
    seconds the call cost this rank (``time.process_time``: every thread of the process)."""
    import torch
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    names = list(algorithms)
    seconds: dict = {}
    cpu: dict = {}
    for nbytes in sizes:
        numel = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
        source = torch.ones(numel, dtype=dtype)
        x = torch.empty(numel, dtype=dtype)  # preallocated: time the algorithm, not malloc
        for i in range(warmup + repeats):
            shift = i % len(names)  # rotate the order so no algorithm always goes first
            for name in names[shift:] + names[:shift]:
                x.copy_(source)  # an in-place all-reduce overwrote it
                dist.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                algorithms[name](x)
                elapsed, cpu_spent = time.perf_counter() - start, time.process_time() - cpu_start
                if i >= warmup:
                    seconds.setdefault((name, nbytes), []).append(elapsed)
                    cpu.setdefault((name, nbytes), []).append(cpu_spent)
    return {"seconds": seconds, "cpu": cpu}


def bench_allreduce(
    algorithms: dict,
    world_size: int = 4,
    sizes=ALLREDUCE_SIZES,
    repeats: int = 5,
    warmup: int = 1,
    dtype: str = "float32",
    timeout: float = 600.0,
) -> list[dict]:
    """busbw of each all-reduce in ``algorithms`` (name -> fn(x), in place, SUM) and of
    ``dist.all_reduce``, side by side in one launch on ``world_size`` ranks.

    For every size, the algorithms take turns (order rotated each repeat); each call's time
    is the slowest rank's, and a row reports the median over ``repeats``:
    algbw = S / t and busbw = algbw * 2(N-1)/N (nccl-tests' definitions); ``cpu_s``: the CPU
    seconds one call costs a rank (the median over the ranks of each rank's median).  Each algorithm is
    first checked once against dist.all_reduce; one that raises or is wrong gets a row with
    ``error`` instead of being timed.

        >>> rows = bench_allreduce({"ring": ring_all_reduce}, world_size=4, sizes=[1 << 20])
        >>> print(format_allreduce_table(rows))
    """
    from ..launcher import LaunchError, launch

    if world_size < 2:
        raise ValueError(f"an all-reduce benchmark needs world_size >= 2, got {world_size}")
    rows, working = [], {}
    for name, fn in progress(
        algorithms.items(), total=len(algorithms), desc="bench allreduce: checking", unit="algorithm"
    ):
        try:
            errors = launch(_probe_allreduce, world_size, fn, 1000 + world_size - 1, timeout=60)
            problem = None if max(errors) < 1e-9 else f"wrong result (max abs error {max(errors):.3g})"
        except LaunchError as exc:
            problem = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if problem:
            rows.append({"algorithm": name, "world_size": world_size, "error": problem})
        else:
            working[name] = fn
    working[TORCH_ALL_REDUCE] = _torch_all_reduce
    per_rank = launch(_time_allreduce, world_size, working, list(sizes), repeats, warmup, dtype, timeout=timeout)
    for name, nbytes in sorted(per_rank[0]["seconds"], key=lambda key: (key[1], list(working).index(key[0]))):
        median = slowest_median([rank["seconds"][(name, nbytes)] for rank in per_rank])
        rows.append(
            {
                "algorithm": name,
                "world_size": world_size,
                "bytes": nbytes,
                "median_s": median,
                "algbw": nbytes / median,
                "busbw": nbytes / median * busbw_factor(world_size),
                "cpu_s": statistics.median(statistics.median(rank["cpu"][(name, nbytes)]) for rank in per_rank),
                "repeats": repeats,
            }
        )
    torch_busbw = {r["bytes"]: r["busbw"] for r in rows if r["algorithm"] == TORCH_ALL_REDUCE and "busbw" in r}
    for row in rows:
        if "busbw" in row and row["bytes"] in torch_busbw:
            row["ratio"] = row["busbw"] / torch_busbw[row["bytes"]]
    return rows


def format_allreduce_table(rows: list[dict]) -> str:
    """busbw (GB/s) per message size, one column per algorithm, each / dist.all_reduce's; then,
    where the rows have it, the CPU time per call and rank (ms), each / dist.all_reduce's."""
    timed = [r for r in rows if "error" not in r]
    names = list(dict.fromkeys(r["algorithm"] for r in timed))
    if not timed:
        return "\n".join(f"{r['algorithm']}: not measured: {r['error']}" for r in rows)
    by = {(r["algorithm"], r["bytes"]): r for r in timed}
    world_size = timed[0]["world_size"]
    width = max(12, *(len(n) for n in names)) + 2
    header = f"{'size':>9}" + "".join(f"{n:>{width + 8}}" for n in names)
    busbw = f"busbw in GB/s on {world_size} ranks, median of {timed[0]['repeats']}"
    cpu = "CPU ms per call and rank (all its threads: the adds, and gloo's copies through the sockets), median"
    tables = [(busbw, "busbw", 1e-9, ".3f")] + (
        [(cpu, "cpu_s", 1e3, ".1f")] if all("cpu_s" in r for r in timed) else []
    )
    lines = []
    for title, key, scale, fmt in tables:
        lines += [f"{title} (in brackets: / {TORCH_ALL_REDUCE})", header]
        for nbytes in sorted({r["bytes"] for r in timed}):
            torch_row = by.get((TORCH_ALL_REDUCE, nbytes))
            cells = []
            for n in names:
                row = by.get((n, nbytes))
                ratio = f"({row[key] / torch_row[key]:.2f}x)" if row and torch_row else ""
                cells.append(f"{row[key] * scale:>{width}{fmt}} {ratio:>7}" if row else f"{'-':>{width + 8}}")
            lines.append(f"{format_bytes(nbytes):>9}" + "".join(cells))
    lines += _below_gloo(timed, by) + _below_gloo_small(timed, by)
    lines += [f"{r['algorithm']}: not measured: {r['error']}" for r in rows if "error" in r]
    return "\n".join(lines)


BANDWIDTH_BOUND = 16 << 20  # from this size on a row is the algorithm's bandwidth, not its latency


def _below_gloo(timed: list[dict], by: dict) -> list[str]:
    """Where a ring-family row of a bandwidth-bound size is below dist.all_reduce: its busbw and CPU ratios
    side by side, and why they go together on one host."""
    below = [
        r
        for r in timed
        if r["algorithm"] in RINGS and r["bytes"] >= BANDWIDTH_BOUND and r.get("ratio", 1.0) < 1.0 and "cpu_s" in r
    ]
    if not below:
        return []
    lines = [
        "below dist.all_reduce's busbw (bandwidth-bound sizes), with the CPU time per call against its: on one host "
        "the link is a CPU core (every byte is copied through the loopback sockets), so where a ring is slower it "
        "spends more CPU per call; from launch to launch these ratios move by about 15 % (lab 2, section 9)"
    ]
    for r in below:
        cpu = r["cpu_s"] / by[(TORCH_ALL_REDUCE, r["bytes"])]["cpu_s"]
        lines.append(
            f"  {r['algorithm']} at {format_bytes(r['bytes'])}: busbw {r['ratio']:.2f}x, CPU per call {cpu:.2f}x"
        )
    return lines


def _below_gloo_small(timed: list[dict], by: dict) -> list[str]:
    """Where a ring-family row of a latency-bound size (below ``BANDWIDTH_BOUND``) is below dist.all_reduce: per
    algorithm, each such size's busbw and CPU ratios, and why: a Python loop of many messages against one C++ call."""
    below: dict[str, list[str]] = {}
    for r in timed:
        if r["algorithm"] in RINGS and r["bytes"] < BANDWIDTH_BOUND and r.get("ratio", 1.0) < 1.0 and "cpu_s" in r:
            cpu = r["cpu_s"] / by[(TORCH_ALL_REDUCE, r["bytes"])]["cpu_s"]
            cell = f"{r['ratio']:.2f}x at {format_bytes(r['bytes'])} (CPU {cpu:.2f}x)"
            below.setdefault(r["algorithm"], []).append(cell)
    if not below:
        return []
    lines = [
        "below dist.all_reduce's busbw at latency-bound sizes (under 16 MiB), with the CPU per call against its: a "
        "call there is its messages' fixed costs, and the lab's algorithms are Python loops of 2·(N − 1) messages "
        "a rank (the ring), 2·log2 N (halving-doubling) or 2·(N − 1) a chunk (the pipelined ring, which pays most), "
        "each a send, a receive and an add from Python, where dist.all_reduce is one call into gloo's C++ (lab 2's "
        "α-β model: the α term)"
    ]
    lines += [f"  {name}: {', '.join(cells)}" for name, cells in below.items()]
    return lines


NAME = "allreduce"
HELP = "lab 2's all-reduces against dist.all_reduce (busbw per message size)"
LAB = os.path.join("02_all_reduce", "02_all_reduce.ipynb")
RINGS = ("ring_all_reduce", "halving_doubling_all_reduce", "pipelined_ring_all_reduce")  # gloo's peers in bytes
FUNCTIONS = (
    "naive_all_reduce",
    "parallel_all_reduce",
    "ring_all_reduce",
    "halving_doubling_all_reduce",
    "pipelined_ring_all_reduce",  # the optional stretch: a notebook without it leaves it out
)


def add_arguments(parser) -> None:
    add_notebook_argument(parser, LAB)
    add_world_size_argument(parser, (4,))
    parser.add_argument(
        "--min-bytes",
        type=int,
        default=0,
        help="smallest message (e.g. 67108864: 64 MiB only, for many repeats of one size)",
    )
    parser.add_argument("--max-bytes", type=int, default=64 << 20, help="largest message")


QUICK = ["--world-size", "2", "--max-bytes", str(64 << 10)]  # bench all --quick


def measure(args) -> Measured:
    functions = functions_from_lab(args, LAB, FUNCTIONS, "all-reduce functions")
    return over_world_sizes(args, functools.partial(_measure, functions), keys=("algorithm", "bytes"), scaled=_largest)


def _largest(rows: list[dict]) -> list[dict]:
    """The rows of the two largest messages measured (the bandwidth-bound ones) for the scaling table."""
    largest = sorted({r["bytes"] for r in rows if "bytes" in r})[-2:]
    return [r for r in rows if r.get("bytes") in largest]


def _measure(functions: dict, args) -> Measured:
    sizes = [s for s in ALLREDUCE_SIZES if args.min_bytes <= s <= args.max_bytes]
    if not sizes:
        raise NotMeasured(
            f"bench allreduce: no size between --min-bytes {args.min_bytes} and --max-bytes {args.max_bytes}; "
            f"the sizes are {', '.join(str(s) for s in ALLREDUCE_SIZES)}"
        )
    rows = bench_allreduce(functions, world_size=args.world_size, sizes=sizes, repeats=args.repeats)
    pictures = [
        chart(
            rows,
            f"All-reduce on {args.world_size} ranks",
            "busbw",
            "bus bandwidth (GB/s)",
            x="bytes",
            series="algorithm",
            scale=1e-9,
            xlabel="message (bytes)",
            log_x=True,
        )
    ]
    return Measured(rows, format_allreduce_table(rows), pictures)
