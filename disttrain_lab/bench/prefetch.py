"""``disttrain-lab bench prefetch``: lab 14's ``sharded_step`` (an FSDP-style step, each layer's parameters
all-gathered just in time) with the next layer's gather prefetched and without, side by side with torch's FSDP2
(``fully_shard`` on each layer) on the same model and the same emulated link.

One model for every version: ``layers`` layers ``Linear(width, width)`` + Tanh, each standing in for an accelerator's
work: its forward sleeps ``unit`` and its backward ``2 · unit`` (``_StandIn``), so that a layer's compute is known
whatever runs it; on 2 ranks or more over an emulated link (``Network``, in the ranks: ``network.py``), where a
layer's all-gather takes about ``t_g`` = the ring's (N − 1)(α + β·k/N) for its k parameters.  The versions:

- the lab's ``sharded_step(shards, layer, x, y, prefetch=True)`` and ``prefetch=False``;
- torch's ``fully_shard`` on each layer, then the root, as it comes (its backward prefetches one layer ahead; its
  forward's prefetch comes from CUDA streams: on a CPU a gloo all-gather holds the thread that calls it);
- the same with ``set_modules_to_forward_prefetch`` (each layer names the next) and
  ``set_modules_to_backward_prefetch`` (the one before).

Each row: ms per step (median of the slowest rank, the versions taking turns), the ratio of the lab's
no-prefetch step's time to this one's, the compute alone (3·layers·unit) and what is left, the exposed
communication; and the cost model's step (``model_ms``: gathers and compute in sequence without prefetch, each
layer's gather under the previous layer's compute with it; a layer's reduce-scatter and the next gather share the
link in backward): the measured steps add the sleeps' overshoot, Python and gloo's copies.
"""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..labtests.lab14.prefetch import shard_layers
from ..launcher import launch
from ..network import Network
from .command import Measured, NotMeasured, add_world_size_argument, over_world_sizes
from .notebook import add_notebook_argument, functions_from_lab
from .stats import slowest_median
from .tables import chart, ratio_cell, version_width
from .timing import take_turns

LAB_NO_PREFETCH = "lab sharded_step, prefetch=False"
LAB_PREFETCH = "lab sharded_step, prefetch=True"
TORCH_FULLY_SHARD = "torch fully_shard"
TORCH_FULLY_SHARD_PREFETCH = "torch fully_shard, explicit prefetch"
VERSIONS = (LAB_NO_PREFETCH, LAB_PREFETCH, TORCH_FULLY_SHARD, TORCH_FULLY_SHARD_PREFETCH)
PREFETCH_SIZE = {"layers": 8, "width": 512, "rows": 4, "unit": 0.005, "gbit": 1.0}  # unit: a layer's forward, s


class _StandIn(torch.autograd.Function):
    """The stand-in accelerator: the identity, its forward sleeping ``unit`` seconds and its backward twice that."""

    @staticmethod
    def forward(ctx, h, unit):
        ctx.unit = unit
        time.sleep(unit)
        return h.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.unit)
        return grad, None


class _Layer(nn.Module):
    """A ``Linear(width, width)``, Tanh, then the stand-in's compute (torch's FSDP shards the Linear)."""

    def __init__(self, width: int, unit: float):
        super().__init__()
        self.linear, self.unit = nn.Linear(width, width), unit

    def forward(self, h):
        return _StandIn.apply(torch.tanh(self.linear(h)), self.unit)


def _model(size: dict) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_Layer(size["width"], size["unit"]) for _ in range(size["layers"])])


def _batch(size: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows (data parallelism)."""
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    return torch.randn(size["rows"], size["width"], generator=g), torch.zeros(size["rows"], size["width"])


def _lab_runner(sharded_step, prefetch: bool, size: dict):
    """One step of the notebook's sharded_step on this rank's shards of the model's layers."""
    rank, n, width, unit = dist.get_rank(), dist.get_world_size(), size["width"], size["unit"]
    weights = [(layer.linear.weight.detach(), layer.linear.bias.detach()) for layer in _model(size)]
    shards = [nn.Parameter(shard) for shard in shard_layers(weights, n)[rank]]  # (the grader's padding and cut)

    def layer(i, flat, h):
        w, b = flat[: width * width].view(width, width), flat[width * width : width * width + width]
        return _StandIn.apply(torch.tanh(F.linear(h, w, b)), unit)

    x, y = _batch(size)
    return lambda: sharded_step(shards, layer, x, y, prefetch=prefetch)


def _torch_runner(size: dict, explicit: bool):
    """One step (forward, loss, backward) of torch's FSDP2: ``fully_shard`` on each layer, then the root; with
    ``explicit``, each layer prefetches the next in forward and the one before in backward."""
    from torch.distributed.fsdp import fully_shard  # (heavy: loaded by this benchmark only)

    model = _model(size)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    if explicit:
        layers = list(model)
        for before, after in zip(layers, layers[1:]):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    x, y = _batch(size)

    def step():
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()

    return step


def _prefetch_times(versions: list[str], sharded_step, size: dict, repeats: int, warmup: int) -> dict:
    """In each rank: name -> seconds per step, the versions taking turns."""
    runners = {}
    for name in versions:
        if name in (LAB_NO_PREFETCH, LAB_PREFETCH):
            runners[name] = _lab_runner(sharded_step, name == LAB_PREFETCH, size)
        else:
            runners[name] = _torch_runner(size, name == TORCH_FULLY_SHARD_PREFETCH)
    return take_turns(runners, repeats, warmup)


def model_seconds(size: dict, link: Network, world_size: int, prefetch: bool) -> float:
    """The cost model's step: L layers, a gather of t_g (the link's ring all-gather of a layer's parameters), a
    forward of ``unit``, a backward of twice that; a reduce-scatter costs a gather and shares the link with it."""
    layers, unit = size["layers"], size["unit"]
    t_g = link.collective_time("all_gather", 4 * (size["width"] ** 2 + size["width"]), world_size)
    if not prefetch:
        return layers * (t_g + unit) + layers * (2 * t_g + 2 * unit)
    return t_g + layers * max(unit, t_g) + layers * max(2 * unit, 2 * t_g) + t_g


def bench_prefetch(
    functions: dict,
    world_size: int = 2,
    layers: int = PREFETCH_SIZE["layers"],
    width: int = PREFETCH_SIZE["width"],
    rows: int = PREFETCH_SIZE["rows"],
    unit: float = PREFETCH_SIZE["unit"],
    gbit: float = PREFETCH_SIZE["gbit"],
    repeats: int = 5,
    warmup: int = 1,
    timeout: float = 600.0,
) -> list[dict]:
    """Steps of each version of :data:`VERSIONS` (the lab's where ``functions`` has the notebook's
    ``sharded_step``; torch's always) in one launch of ``world_size`` ranks over an emulated ``gbit`` Gbit/s link:
    ``layers`` layers of ``width`` on the stand-in accelerator (``unit``: seconds of a layer's forward), ``rows``
    rows a rank.  A row per version: its ``ms`` (median of the slowest rank), ``ratio`` (the lab's no-prefetch
    step's time / this one's), ``compute_ms`` (3·layers·unit), ``exposed_ms`` (ms − compute_ms) and ``model_ms``
    (the cost model's step, :func:`model_seconds`), or its ``error`` (the notebook defines no sharded_step).

        >>> print(format_prefetch_table(bench_prefetch({"sharded_step": f}, world_size=2)))
    """
    size = {"layers": layers, "width": width, "rows": rows, "unit": unit, "gbit": gbit}
    link = Network.gbit(gbit)
    base = {"part": "prefetch", "world_size": world_size, "size": size, "repeats": repeats, "device": "cpu"}
    rows_of, measured = {}, []
    for name in VERSIONS:
        if name in (LAB_NO_PREFETCH, LAB_PREFETCH) and "sharded_step" not in functions:
            rows_of[name] = {**base, "version": name, "error": "LookupError: the notebook defines no sharded_step"}
            continue
        measured.append(name)
        rows_of[name] = {**base, "version": name, "compute_ms": 1e3 * 3 * layers * unit}
        if name in (LAB_NO_PREFETCH, LAB_PREFETCH):
            rows_of[name]["model_ms"] = 1e3 * model_seconds(size, link, world_size, name == LAB_PREFETCH)
    per_rank = launch(
        _prefetch_times,
        world_size,
        measured,
        functions.get("sharded_step"),
        size,
        repeats,
        warmup,
        network=link,
        timeout=timeout,
    )
    for name in measured:
        row = rows_of[name]
        row["ms"] = 1e3 * slowest_median([rank[name] for rank in per_rank])
        row["exposed_ms"] = row["ms"] - row["compute_ms"]
    rows_out = list(rows_of.values())
    baseline = rows_of[LAB_NO_PREFETCH] if "ms" in rows_of[LAB_NO_PREFETCH] else None
    for r in rows_out:
        if baseline is not None and "ms" in r:
            r["baseline"], r["ratio"] = LAB_NO_PREFETCH, baseline["ms"] / r["ms"]
    return rows_out


def format_prefetch_table(rows: list[dict]) -> str:
    """One line per version: ms per step, the ratio to the lab's no-prefetch step, compute, exposed, the model's."""
    first, width = rows[0], version_width(rows, 36)
    size = first["size"]
    lines = [
        f"prefetch on {first['world_size']} ranks, cpu, an emulated {size['gbit']:g} Gbit/s link ({size['layers']} "
        f"layers of {size['width']} x {size['width']}, {size['rows']} rows a rank; a stand-in accelerator: a layer's "
        f"forward {size['unit'] * 1e3:g} ms, its backward twice that); ms per step, median of {first['repeats']}, "
        f"slowest rank; ratio: {LAB_NO_PREFETCH}'s time / this one's; exposed: the step less its compute; model: "
        "the cost model's step (link and compute only)",
        f"  {'version':<{width}} {'ms':>9} {'ratio':>7} {'compute':>8} {'exposed':>8} {'model':>7}",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['version']:<{width}} not measured: {r['error']}")
        else:
            model = f"{r['model_ms']:>7.1f}" if "model_ms" in r else f"{'—':>7}"
            lines.append(
                f"  {r['version']:<{width}} {r['ms']:>9.1f} {ratio_cell(r, 7)} {r['compute_ms']:>8.1f} "
                f"{r['exposed_ms']:>8.1f} {model}"
            )
    return "\n".join(lines)


NAME = "prefetch"
HELP = "lab 14's sharded_step with and without prefetching the next layer's all-gather, against torch's fully_shard"
LAB = os.path.join("14_schedules", "14_schedules.ipynb")
QUICK = ["--world-size", "2", "--layers", "3", "--width", "64", "--unit", "0.002"]  # bench all --quick


def add_arguments(parser) -> None:
    add_notebook_argument(parser, LAB)
    add_world_size_argument(parser, (2,))
    parser.add_argument("--layers", type=int, default=PREFETCH_SIZE["layers"], help="(default %(default)s)")
    parser.add_argument(
        "--width", type=int, default=PREFETCH_SIZE["width"], help="each layer's width (default %(default)s)"
    )
    parser.add_argument("--rows", type=int, default=PREFETCH_SIZE["rows"], help="per rank (default %(default)s)")
    parser.add_argument(
        "--unit",
        type=float,
        default=PREFETCH_SIZE["unit"],
        help="the stand-in accelerator: seconds of a layer's forward (default %(default)s)",
    )
    parser.add_argument(
        "--gbit", type=float, default=PREFETCH_SIZE["gbit"], help="the emulated link, Gbit/s (default %(default)s)"
    )


def measure(args) -> Measured:
    found = functions_from_lab(args, LAB, ["sharded_step"], "prefetch")
    if not found:
        raise NotMeasured(f"{LAB} defines no sharded_step")
    return over_world_sizes(args, functools.partial(_measure, found))


def _measure(found: dict, args) -> Measured:
    rows = bench_prefetch(
        found,
        world_size=args.world_size,
        layers=args.layers,
        width=args.width,
        rows=args.rows,
        unit=args.unit,
        gbit=args.gbit,
        repeats=args.repeats,
    )
    pictures = [chart(rows, f"Prefetching all-gathers on {args.world_size} ranks", "ms", "ms per step")]
    return Measured(rows, format_prefetch_table(rows), pictures)


__all__ = [
    "LAB_NO_PREFETCH",
    "LAB_PREFETCH",
    "PREFETCH_SIZE",
    "TORCH_FULLY_SHARD",
    "TORCH_FULLY_SHARD_PREFETCH",
    "VERSIONS",
    "bench_prefetch",
    "format_prefetch_table",
    "model_seconds",
]
