#!/usr/bin/env python
# Usage: .venv/bin/python scripts/ring_gap.py [--notebook PATH] [--mib 64] [--world-size 4] [--repeats 9]
"""What the ring all-reduce's gap to gloo's is made of (issue 15 asks: profile, don't guess).

Lab 2's ``ring_reduce_scatter``, ``ring_all_gather`` and ``ring_all_reduce`` (from the lab
notebook, solutions by default) are timed phase by phase beside ``dist.all_reduce``, plus the
N-1 chunk additions alone (no communication), in one launch, taking turns; each row is the
median over the repeats of the slowest rank.  The additions are on the ring's critical path:
a reduce-scatter step sends the chunk the previous step's addition produced.  gloo's ring
(gloo/allreduce.cc) splits every chunk into segments and adds one segment while the next is
in flight; the lab's algorithm sends one message per step (its tests count N-1 rounds per
phase), so its additions cannot hide behind the transfers."""

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _phases(fns, nbytes, repeats):
    import time

    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    x, source = torch.empty(nbytes // 4), torch.ones(nbytes // 4)
    a, b = torch.ones(x.tensor_split(n)[0].numel()), torch.ones(x.tensor_split(n)[0].numel())
    tasks = {
        "ring_all_reduce": lambda: fns["ring_all_reduce"](x),
        "dist.all_reduce (gloo)": lambda: dist.all_reduce(x),
        "ring_reduce_scatter alone": lambda: fns["ring_reduce_scatter"](x),
        "ring_all_gather alone": lambda: fns["ring_all_gather"](x),
        f"{n - 1} chunk additions alone": lambda: [a.add_(b) for _ in range(n - 1)],
    }
    seconds = {name: [] for name in tasks}
    for i in range(repeats + 1):  # the first round warms up
        names = list(tasks)[i % len(tasks) :] + list(tasks)[: i % len(tasks)]
        for name in names:
            x.copy_(source)
            dist.barrier()
            start = time.perf_counter()
            tasks[name]()
            if i:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--notebook",
        default=str(REPO / "solutions" / "02_all_reduce" / "02_all_reduce.ipynb"),
        help="the notebook to take lab 2's ring functions from (default: the solution)",
    )
    parser.add_argument("--mib", type=int, default=64, help="MiB all-reduced (default %(default)s)")
    parser.add_argument("--world-size", type=int, default=4, help="ranks (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=9, help="samples per median (default %(default)s)")
    args = parser.parse_args()
    # after the arguments: --help answers at once, without loading torch
    from disttrain_lab import launch
    from disttrain_lab.bench.notebook import functions_from_notebook

    fns = functions_from_notebook(args.notebook, ["ring_all_reduce", "ring_reduce_scatter", "ring_all_gather"])
    per_rank = launch(_phases, args.world_size, fns, args.mib << 20, args.repeats, timeout=900)
    slowest = {
        name: statistics.median(max(r[name][i] for r in per_rank) for i in range(args.repeats)) for name in per_rank[0]
    }
    gloo = slowest["dist.all_reduce (gloo)"]
    print(f"{args.mib} MiB float32 on {args.world_size} ranks, median of {args.repeats} (slowest rank)")
    for name, s in slowest.items():
        print(f"  {name:<28} {s * 1e3:8.1f} ms   {s / gloo:5.2f} x gloo's time")
    adds = slowest[f"{args.world_size - 1} chunk additions alone"]
    print(
        f"ring / gloo = {slowest['ring_all_reduce'] / gloo:.2f} in time; the additions the ring cannot overlap "
        f"are {adds / gloo:.0%} of gloo's time"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
