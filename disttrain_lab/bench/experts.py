"""``disttrain-lab bench experts``: lab 11's expert-parallel MoE, side by side with the all-gather
dispatch it replaces and with the lab's dense MoE in one process.

Forward and backward of one MoE layer on each rank's tokens: the lab's ``ExpertParallelMoE``;
**all-gather dispatch**, every rank gathering every rank's tokens, running its experts on those
routed to them and reduce-scattering the outputs; and the lab's dense ``MoE`` on one rank's tokens
in one process (all experts on one device).  On ``device``: ``"cpu"`` (gloo) or ``"cuda"`` (rank k
on the k-th GPU, NCCL).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from ..devices import device as rank_device
from ..launcher import launch
from .collectives import GatherRows, ScatterRows
from .command import Measured, add_device_argument, add_world_size_argument, chosen_device, over_world_sizes
from .notebook import add_notebook_argument, functions_from_lab
from .tables import chart, step_rows, step_table, version_width
from .timing import step_times

ALL_GATHER_DISPATCH = "all-gather dispatch"
ONE_PROCESS_MOE = "MoE, one process"
EXPERTS = {"tokens": 2048, "d": 256, "n_experts": 8, "k": 2, "capacity_factor": 1.25}  # tokens per rank


def _expert_runners(versions: dict, tokens: int, d: int, n_experts: int, k: int, capacity_factor: float) -> dict:
    """In a rank: name -> a forward+backward of one MoE layer on this rank's tokens."""
    moe, parallel, route = versions["MoE"], versions.get("ExpertParallelMoE"), versions.get("top_k_route")
    n, rank, dev = dist.get_world_size(), dist.get_rank(), rank_device()
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(rank)).to(dev)
    dense = moe(d, 2 * d, n_experts, k, capacity_factor).to(dev)
    runners = {}

    def step(layer):
        def run():
            y, aux = layer(x.clone().requires_grad_())
            (y.sum() + aux).backward()

        return run

    if parallel is not None:
        runners["ExpertParallelMoE"] = step(parallel(dense))
    runners[ONE_PROCESS_MOE] = step(dense)
    if route is not None:
        per = n_experts // n
        mine = range(rank * per, (rank + 1) * per)

        def all_gather_dispatch():
            xs = x.clone().requires_grad_()
            every = GatherRows.apply(xs)  # (N*T, d): every rank's tokens
            y = torch.zeros_like(every)
            for source in range(n):  # each rank routes its own tokens, capacity per rank
                rows = slice(source * tokens, (source + 1) * tokens)
                experts, gates, kept = route(dense.router(every[rows]), k, capacity_factor)
                for e in mine:
                    token, choice = ((experts == e) & kept).nonzero(as_tuple=True)
                    out = gates[token, choice, None] * dense.experts[e](every[rows][token])
                    y = y.index_add(0, token + source * tokens, out)
            ScatterRows.apply(y).sum().backward()  # this rank's tokens: the sum of every rank's experts' outputs

        runners[ALL_GATHER_DISPATCH] = all_gather_dispatch
    return runners


def _expert_times(versions: dict, experts: dict, repeats: int, warmup: int) -> dict:
    """In each rank: per version, seconds per step (interleaved) and rank 0's bytes per step."""
    return step_times(_expert_runners(versions, **experts), repeats, warmup)


def bench_experts(
    versions: dict,
    world_size: int = 4,
    tokens: int = EXPERTS["tokens"],
    d: int = EXPERTS["d"],
    n_experts: int = EXPERTS["n_experts"],
    k: int = EXPERTS["k"],
    capacity_factor: float = EXPERTS["capacity_factor"],
    repeats: int = 5,
    warmup: int = 1,
    timeout: float = 600.0,
    device: str = "cpu",
) -> list[dict]:
    """Forward+backward time of one MoE layer (median of the slowest rank) and rank 0's bytes per step
    of the lab's ``ExpertParallelMoE`` beside the all-gather dispatch and the dense ``MoE`` in one
    process, in one launch (``versions``: the notebook's ``MoE``, which every version runs, and
    ``ExpertParallelMoE`` and ``top_k_route``, the all-gather dispatch's router; either of those two
    may be missing).  ``tokens``: per rank.  ``ratio``: the all-gather dispatch's time / this one's
    (above 1: faster).  ``device``: ``"cpu"`` (gloo) or ``"cuda"`` (rank k on the k-th GPU, NCCL).

        >>> print(format_experts_table(bench_experts({"ExpertParallelMoE": ExpertParallelMoE, "MoE": MoE})))
    """
    if "MoE" not in versions:
        raise ValueError("versions has no MoE: the lab's dense layer, whose router and experts every version runs")
    if n_experts % world_size:
        raise ValueError(f"n_experts={n_experts} is not divisible by world_size={world_size}")
    experts = {"tokens": tokens, "d": d, "n_experts": n_experts, "k": k, "capacity_factor": capacity_factor}
    per_rank = launch(_expert_times, world_size, versions, experts, repeats, warmup, timeout=timeout, device=device)
    row = {"part": "experts", "world_size": world_size, "size": experts, "repeats": repeats, "device": device}
    return step_rows(per_rank, row, (ALL_GATHER_DISPATCH,))


def format_experts_table(rows: list[dict]) -> str:
    """One line per version: ms per forward+backward, rank 0's bytes, the ratio to the all-gather dispatch."""
    return "\n".join(step_table(rows, version_width(rows, 24)))


NAME = "experts"
HELP = "lab 11's expert-parallel MoE against all-gather dispatch and the dense MoE in one process"
LAB = os.path.join("11_expert_parallel", "11_expert_parallel.ipynb")


def add_arguments(parser) -> None:
    add_notebook_argument(parser, LAB)
    add_world_size_argument(parser, (4,))
    parser.add_argument("--tokens", type=int, default=EXPERTS["tokens"], help="tokens per rank (default %(default)s)")
    parser.add_argument("--d", type=int, default=EXPERTS["d"], help="model width (default %(default)s)")
    parser.add_argument(
        "--experts", type=int, default=EXPERTS["n_experts"], help="number of experts (default %(default)s)"
    )
    parser.add_argument("--k", type=int, default=EXPERTS["k"], help="experts per token (default %(default)s)")
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=EXPERTS["capacity_factor"],
        help="each expert's capacity, in multiples of its even share of the choices (default %(default)s)",
    )
    add_device_argument(parser, "the MoE layers run")


QUICK = ["--world-size", "2", "--tokens", "16", "--d", "8", "--experts", "2"]  # bench all --quick


def measure(args) -> Measured:
    names = ["ExpertParallelMoE", "MoE", "top_k_route"]
    found = functions_from_lab(args, LAB, names, "MoE layers", given=True)  # MoE: given
    return over_world_sizes(args, functools.partial(_measure, found))


def _measure(found: dict, args) -> Measured:
    rows = bench_experts(
        found,
        world_size=args.world_size,
        tokens=args.tokens,
        d=args.d,
        n_experts=args.experts,
        k=args.k,
        capacity_factor=args.capacity_factor,
        repeats=args.repeats,
        device=chosen_device(args),
    )
    pictures = [chart(rows, f"Mixture of experts on {args.world_size} ranks", "ms", "ms per forward+backward")]
    return Measured(rows, format_experts_table(rows), pictures)
