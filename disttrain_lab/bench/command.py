"""A benchmark as a command (``disttrain-lab bench NAME``): what it measured (Measured, NotMeasured) and
how ``bench NAME`` prints it (run_measured); the options every benchmark shares (``--repeats``,
``--world-size`` and the run once per number of ranks, over_world_sizes; labs 10 and 11's ``--device``
and the device it picks); the progress bar of a sweep."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .tables import Chart, scaling_chart, scaling_table


# --------------------------------------------------------------------------------------
# The command line: each benchmark module has NAME, HELP, QUICK, add_arguments(parser) and
# measure(args) -> Measured, which ``bench NAME`` prints (``run_measured``) and ``bench all`` (report.py) reports
# --------------------------------------------------------------------------------------
@dataclass
class Measured:
    """What one benchmark measured: its rows (each a dict of plain values), the table ``bench NAME``
    prints from them, its pictures, and what else a reader needs (the notebook measured, the model)."""

    rows: list[dict]
    table: str
    charts: list[Chart] = field(default_factory=list)
    about: dict = field(default_factory=dict)


class NotMeasured(Exception):
    """A benchmark that could not run: no notebook, or the notebook lacks what it measures (said on stderr)."""


def run_measured(measure, args) -> int:
    """``bench NAME``: ``measure(args)``'s table on stdout, exit 0; 2 where it could not run (why on stderr)."""
    try:
        measured = measure(args)
    except NotMeasured as exc:
        if str(exc):
            print(str(exc), file=sys.stderr)
        return 2
    print(measured.table)
    return 0


def add_common_arguments(parser) -> None:
    """The options every benchmark takes (``bench NAME`` and ``bench all``)."""
    parser.add_argument("--repeats", type=int, default=5, help="samples per median (default %(default)s)")


def world_sizes(text: str) -> tuple[int, ...]:
    """``--world-size``'s value: one number of ranks ("4") or several, comma-separated ("2,4,8")."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of ranks or several, comma-separated, got {text!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"numbers of ranks must be at least 1, got {text!r}")
    return tuple(dict.fromkeys(sizes))


def add_world_size_argument(parser, default: tuple[int, ...] | None, what: str = "ranks") -> None:
    """``--world-size N`` or ``--world-size 2,4,8`` (:func:`world_sizes`): the benchmark once per number of
    ``what``, then how each version's ratio to its baseline moves as they grow (:func:`over_world_sizes`)."""
    shown = ", ".join(map(str, default)) if default else ""
    parser.add_argument(
        "--world-size",
        type=world_sizes,
        default=default,
        metavar="N[,N...]",
        help=f"number of {what}, or several, comma-separated, for how each ratio moves as they grow (default {shown})",
    )


def over_world_sizes(args, measure_one, keys=("version",), value: str = "ratio", scaled=None) -> Measured:
    """``measure_one(args)`` once per ``args.world_size`` (each call sees one number), as one
    :class:`Measured`: the rows of all, each run's table, and with two or more numbers of ranks the
    scaling table (:func:`scaling_table`) and its picture, of the rows ``scaled(rows)`` keeps (all by
    default).  A number of ranks that cannot be measured is said in its place; if none can, its error
    is raised."""
    parts, failed = [], []
    for n in args.world_size:
        one = argparse.Namespace(**{**vars(args), "world_size": n})
        try:
            parts.append(measure_one(one))
        except (ValueError, NotMeasured) as exc:
            if len(args.world_size) == 1:
                raise
            failed.append(f"on {n} ranks: not measured: {exc}")
    if not parts:
        raise NotMeasured("; ".join(failed))
    if len(parts) == 1 and not failed:
        return parts[0]
    rows = [row for part in parts for row in part.rows]
    tables = [part.table for part in parts] + ["\n".join(failed)] * bool(failed)
    charts = [c for part in parts for c in part.charts]
    sizes = sorted({row["world_size"] for row in rows})
    if len(sizes) > 1:
        kept = scaled(rows) if scaled else rows
        tables.append(scaling_table(kept, keys, value))
        charts.append(scaling_chart(kept, keys, value))
    return Measured(rows, "\n\n".join(tables), charts, parts[0].about)


def progress(iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it"):
    """A progress bar over a benchmark sweep, on stderr: ``tqdm.auto``, so a notebook shows a
    widget and a terminal a text bar.  ``DISTTRAIN_LAB_PROGRESS=0`` turns it off."""
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        leave=False,
        file=sys.stderr,
        disable=os.environ.get("DISTTRAIN_LAB_PROGRESS", "1") == "0",
    )


# --------------------------------------------------------------------------------------
# Labs 10 and 11: each version's forward and backward, side by side, on the CPU or the GPUs
# --------------------------------------------------------------------------------------
DEVICES = ("auto", "cpu", "cuda")  # the command line's --device; auto: cuda when every rank has a GPU


def add_device_argument(parser, what: str) -> None:
    """``--device`` (:data:`DEVICES`, default auto; see :func:`pick_device`): where ``what``, e.g.
    "the MoE layers run"."""
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help=f"where {what}: cpu (gloo), cuda (one GPU per rank, NCCL), auto (cuda when every rank has a GPU; default)",
    )


def pick_device(asked: str, world_size: int) -> tuple[str, str]:
    """(``"cpu"`` or ``"cuda"``, why) for ``--device asked`` on ``world_size`` ranks."""
    gpus = torch.cuda.device_count()  # asks NVML: CUDA stays uninitialised for the ranks
    if asked == "auto":
        chosen = "cuda" if gpus >= world_size else "cpu"
        return chosen, f"auto: {gpus} GPU(s) visible for {world_size} ranks"
    if asked in ("cpu", "cuda"):
        return asked, "asked"
    raise ValueError(f"device must be one of {DEVICES}, got {asked!r}")


def chosen_device(args) -> str:
    """The device for ``--device`` on ``--world-size`` ranks (:func:`pick_device`), said on stdout with why."""
    ranks = args.world_size if isinstance(args.world_size, int) else max(args.world_size)
    device, why = pick_device(args.device, ranks)
    print(f"device: {device} ({why})")
    return device
