"""``disttrain-lab bench schedules``: lab 14's pipeline schedules on a stand-in accelerator, the lab's orders and
runner side by side with torch's schedules of the same names.

One model for every version: 2·p layers ``Linear(d, d)`` + Tanh, each standing in for an accelerator's work
(``_busy_layer``): its forward sleeps ``unit / 2`` (a forward pre-hook), the gradient of its input ``unit / 2`` (a
backward pre-hook) and the gradient of its weight ``unit / 2`` (a hook on that gradient), so that a rank's share of
a micro-batch costs F = ``unit``, I = W = ``unit``, B = I + W, the costs of the lab's simulator
(``labtests.lab14.orders``), whatever the schedule.  One stage a rank holds two layers, two stages a rank one each.

The versions, on p ranks and m micro-batches:

- torch's ``Schedule1F1B`` (the baseline of the ratios), ``ScheduleInterleaved1F1B`` (v = 2),
  ``ScheduleInterleavedZeroBubble`` (v = 1: ZB-H1), ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (v = 2, the
  "v" placement), each run by torch's runtime (``PipelineStage``, ``step``);
- the lab's ``interleaved_order`` and ``zb_h1_order`` run by torch's runtime (the schedule's list replaced by the
  lab's and lowered to sends and receives by torch: ``_prepare_schedule_with_comms``);
- the lab's ``run_order`` running the lab's ``interleaved_order`` (its own sends and receives).

Each row: ms per step (median of the slowest rank, the versions taking turns), the ratio to torch's 1F1B, and the
order's simulated bubble and rank 0's peak of held micro-batches (the same model of time, messages free): what
the measured times add to the simulator is the messages' time and the runtime's own.
"""

from __future__ import annotations

import functools
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..labtests.lab14.orders import DEFAULT_COSTS, SCHEDULES, held, simulate, stage_of, torch_order
from ..labtests.lab14.schedule import parse_order
from ..launcher import launch
from .command import Measured, NotMeasured, add_world_size_argument, over_world_sizes
from .notebook import add_notebook_argument, functions_from_lab
from .stats import slowest_median
from .tables import chart, ratio_cell, version_width
from .timing import take_turns

TORCH_1F1B = "torch Schedule1F1B"
SCHEDULES_SIZE = {"micro_batches": 8, "rows": 4, "d": 32, "unit": 0.01}  # unit: seconds of a rank's forward
# version -> (the schedule torch builds, v, where the order comes from: torch's, or the lab's function)
VERSIONS = {
    TORCH_1F1B: ("1F1B", 1, None),
    "torch ScheduleInterleaved1F1B": ("Interleaved1F1B", 2, None),
    "lab interleaved_order, torch's runtime": ("Interleaved1F1B", 2, "interleaved_order"),
    "lab interleaved_order, lab run_order": ("Interleaved1F1B", 2, "run_order"),
    "torch ScheduleInterleavedZeroBubble (ZB-H1)": ("InterleavedZeroBubble", 1, None),
    "lab zb_h1_order, torch's runtime": ("InterleavedZeroBubble", 1, "zb_h1_order"),
    "torch ScheduleZBVZeroBubble": ("ZBVZeroBubble", 2, None),
    "torch ScheduleDualPipeV": ("DualPipeV", 2, None),
}


def _busy_layer(d: int, seconds: float, seed: int) -> nn.Linear:
    """A ``Linear(d, d)`` whose forward, input gradient and weight gradient each sleep ``seconds`` first."""
    layer = nn.Linear(d, d)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(d, d, generator=torch.Generator().manual_seed(seed)) / d**0.5)
    layer.register_forward_pre_hook(lambda module, args: time.sleep(seconds))
    layer.register_full_backward_pre_hook(lambda module, grad: time.sleep(seconds))
    layer.weight.register_hook(lambda grad: time.sleep(seconds))
    return layer


def _chunks(rank: int, p: int, v: int, placement: str, d: int, unit: float) -> list[tuple[int, nn.Sequential]]:
    """This rank's (stage, chunk) pairs: stage s is layers s·(2/v) .. of the 2·p-layer model, on the stand-in."""
    per_stage = 2 // v
    pairs = []
    for c in range(v):
        s = stage_of(rank, c, p, placement)
        layers = []
        for i in range(per_stage):
            layers += [_busy_layer(d, unit / 2, s * per_stage + i), nn.Tanh()]
        pairs.append((s, nn.Sequential(*layers)))
    return pairs


def _torch_runner(schedule: str, v: int, order, m: int, size: dict):
    """In a rank: one step of torch's ``schedule`` on its runtime, its list replaced by ``order`` (p lists of
    action strings) unless None."""
    from torch.distributed.pipelining import PipelineStage, schedules  # (only this benchmark needs them)

    rank, p = dist.get_rank(), dist.get_world_size()
    pairs = _chunks(rank, p, v, SCHEDULES[schedule], size["d"], size["unit"])
    stages = [PipelineStage(chunk, s, p * v, torch.device("cpu")) for s, chunk in pairs]
    cls = {
        "1F1B": schedules.Schedule1F1B,
        "Interleaved1F1B": schedules.ScheduleInterleaved1F1B,
        "InterleavedZeroBubble": schedules.ScheduleInterleavedZeroBubble,
        "ZBVZeroBubble": schedules.ScheduleZBVZeroBubble,
        "DualPipeV": schedules.ScheduleDualPipeV,
    }[schedule]
    step = cls(stages[0] if schedule == "1F1B" else stages, m, loss_fn=F.mse_loss)
    if order is not None:
        step.pipeline_order = {r: [schedules._Action.from_str(a) for a in actions] for r, actions in enumerate(order)}
        step._prepare_schedule_with_comms(step.pipeline_order)
    x, y = _batch(m, size)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

    def run():
        step.step(*((x,) if first else ()), **({"target": y, "losses": []} if last else {}))

    return run


def _lab_runner(run_order, order, v: int, m: int, size: dict):
    """In a rank: one step of the lab's ``run_order`` on this rank's chunks (placement "loop") and ``order``."""
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = [chunk for _, chunk in _chunks(rank, p, v, "loop", size["d"], size["unit"])]
    x, y = _batch(m, size)
    return lambda: run_order(chunks, list(order[rank]), x, y, m)


def _batch(m: int, size: dict) -> tuple[torch.Tensor, torch.Tensor]:
    rows, d = m * size["rows"], size["d"]
    return torch.randn(rows, d, generator=torch.Generator().manual_seed(0)), torch.zeros(rows, d)


def _schedule_times(versions: dict, functions: dict, orders: dict, m: int, size: dict, repeats: int, warmup: int):
    """In each rank: name -> seconds per step, the versions taking turns."""
    # the first stage's input needs no gradient, and torch says that its full-backward hook fires anyway: it should
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
    runners = {}
    for name, (schedule, v, source) in versions.items():
        if source == "run_order":
            runners[name] = _lab_runner(functions["run_order"], orders[name], v, m, size)
        else:
            runners[name] = _torch_runner(schedule, v, orders[name] if source else None, m, size)
    return take_turns(runners, repeats, warmup)


def bench_schedules(
    functions: dict,
    world_size: int = 4,
    micro_batches: int = SCHEDULES_SIZE["micro_batches"],
    rows: int = SCHEDULES_SIZE["rows"],
    d: int = SCHEDULES_SIZE["d"],
    unit: float = SCHEDULES_SIZE["unit"],
    repeats: int = 5,
    warmup: int = 1,
    timeout: float = 600.0,
) -> list[dict]:
    """Steps of each version of :data:`VERSIONS` (those whose lab functions ``functions`` has: the notebook's
    ``interleaved_order``, ``zb_h1_order`` and ``run_order``; torch's always), in one launch of ``world_size``
    ranks, each step ``micro_batches`` micro-batches of ``rows`` rows through 2·world_size layers of width ``d``
    on the stand-in accelerator (``unit``: seconds of a rank's forward of one micro-batch).  A row per version:
    its ``ms`` (median of the slowest rank), ``ratio`` (torch's 1F1B's time / this one's), the order's simulated
    ``bubble``, its step's ``simulated_ms`` and rank 0's ``held`` peak, or its ``error`` (a lab function
    missing, or its order refused).

        >>> print(format_schedules_table(bench_schedules({"interleaved_order": f, "run_order": g}, world_size=2)))
    """
    p, m = world_size, micro_batches
    size = {"micro_batches": m, "rows": rows, "d": d, "unit": unit}
    base = {"part": "schedules", "world_size": p, "size": size, "repeats": repeats, "device": "cpu"}
    orders, measured, rows_of = {}, {}, {}
    for name, (schedule, v, source) in VERSIONS.items():
        lab_function = "interleaved_order" if source == "run_order" else source
        try:
            if lab_function is None:
                order = [[str(a) for a in actions] for actions in torch_order(schedule, p, v, m)]
            elif lab_function not in functions or (source == "run_order" and "run_order" not in functions):
                missing = "run_order" if lab_function in functions else lab_function
                raise LookupError(f"the notebook defines no {missing}")
            else:
                args = (p, v, m) if lab_function == "interleaved_order" else (p, m)
                order = [[str(a) for a in actions] for actions in functions[lab_function](*args)]
            parsed = parse_order(order, p, v, m, call=f"{lab_function or schedule}({p}, {v}, {m})")
            costs = {kind: cost / v for kind, cost in DEFAULT_COSTS.items()}  # a chunk: a v-th of a rank's share
            sim = simulate(parsed, p, v, m, costs=costs, placement=SCHEDULES[schedule])
        except Exception as exc:  # a lab function missing, raising, or giving an order that is not one
            rows_of[name] = {**base, "version": name, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            continue
        orders[name], measured[name] = order, (schedule, v, source)
        rows_of[name] = {**base, "version": name, "bubble": sim.bubble, "held": held(parsed[0], v=v)}
        rows_of[name]["simulated_ms"] = 1e3 * unit * sim.makespan
    per_rank = launch(_schedule_times, p, measured, functions, orders, m, size, repeats, warmup, timeout=timeout)
    for name in measured:
        rows_of[name]["ms"] = 1e3 * slowest_median([rank[name] for rank in per_rank])
    rows_out = list(rows_of.values())
    baseline = next((r for r in rows_out if r["version"] == TORCH_1F1B and "ms" in r), None)
    for r in rows_out:
        if baseline is not None and "ms" in r:
            r["baseline"], r["ratio"] = TORCH_1F1B, baseline["ms"] / r["ms"]
    return rows_out


def format_schedules_table(rows: list[dict]) -> str:
    """One line per version: ms per step, the ratio to torch's 1F1B, the simulated bubble, rank 0's held peak."""
    first, width = rows[0], version_width(rows, 30)
    size = first["size"]
    lines = [
        f"schedules on {first['world_size']} ranks, cpu ({size['micro_batches']} micro-batches of {size['rows']} rows, "
        f"{2 * first['world_size']} layers of width {size['d']}; a stand-in accelerator: a rank's forward "
        f"{size['unit'] * 1e3:g} ms a micro-batch, I and W as much); ms per step, median of {first['repeats']}, "
        f"slowest rank; ratio: {TORCH_1F1B}'s time / this one's; bubble and held (rank 0's peak, micro-batches): "
        f"the order simulated with F = I = W = 1, B = 2, messages free (simulated ms: its step)",
        f"  {'version':<{width}} {'ms':>9} {'ratio':>7} {'simulated ms':>13} {'bubble':>8} {'held':>6}",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['version']:<{width}} not measured: {r['error']}")
        else:
            lines.append(
                f"  {r['version']:<{width}} {r['ms']:>9.1f} {ratio_cell(r, 7)} {r['simulated_ms']:>13.1f} "
                f"{r['bubble']:>8.3f} {r['held']:>6.2f}"
            )
    return "\n".join(lines)


NAME = "schedules"
HELP = "lab 14's interleaved and zero-bubble orders, run by the lab's run_order and by torch's runtime, against torch's"
LAB = os.path.join("14_schedules", "14_schedules.ipynb")
QUICK = ["--world-size", "2", "--micro-batches", "4", "--unit", "0.002", "--d", "8"]  # bench all --quick


def add_arguments(parser) -> None:
    add_notebook_argument(parser, LAB)
    add_world_size_argument(parser, (4,))
    parser.add_argument(
        "--micro-batches", type=int, default=SCHEDULES_SIZE["micro_batches"], help="per step (default %(default)s)"
    )
    parser.add_argument(
        "--rows", type=int, default=SCHEDULES_SIZE["rows"], help="per micro-batch (default %(default)s)"
    )
    parser.add_argument("--d", type=int, default=SCHEDULES_SIZE["d"], help="the layers' width (default %(default)s)")
    parser.add_argument(
        "--unit",
        type=float,
        default=SCHEDULES_SIZE["unit"],
        help="the stand-in accelerator: seconds of a rank's forward of one micro-batch (default %(default)s)",
    )


def measure(args) -> Measured:
    found = functions_from_lab(args, LAB, ["interleaved_order", "zb_h1_order", "run_order"], "schedules")
    if not found:
        raise NotMeasured(f"{LAB} defines none of interleaved_order, zb_h1_order, run_order")
    return over_world_sizes(args, functools.partial(_measure, found))


def _measure(found: dict, args) -> Measured:
    rows = bench_schedules(
        found,
        world_size=args.world_size,
        micro_batches=args.micro_batches,
        rows=args.rows,
        d=args.d,
        unit=args.unit,
        repeats=args.repeats,
    )
    pictures = [chart(rows, f"Pipeline schedules on {args.world_size} ranks", "ms", "ms per step")]
    return Measured(rows, format_schedules_table(rows), pictures)


__all__ = ["SCHEDULES_SIZE", "TORCH_1F1B", "VERSIONS", "bench_schedules", "format_schedules_table"]
