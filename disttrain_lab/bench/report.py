"""``disttrain-lab bench all``: every benchmark in one run (registry.py), each with its own defaults, or
with its tiny settings (``--quick``, each module's ``QUICK``: a look at the report, not a measurement).
``--report DIR`` writes what they measured as ``report.json`` (the machine, the versions, each
benchmark's options, rows and table) and as one page, ``report.html``, with its pictures (bus bandwidth
against message size, steps/s against torch's, the pipeline's speedup against its ideal, the planner's
step times against the measured ones): an instructor can show the class the curves, and compare two
machines or two versions of a lab from their JSON.  A benchmark that cannot run (no notebook, a lab not
written yet) or fails is said so in its place; the others still run, and the command exits 1."""

from __future__ import annotations

import argparse
import base64
import datetime
import html
import io
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch
from matplotlib.figure import Figure

from .. import __version__
from .command import NotMeasured, add_common_arguments, world_sizes
from .registry import MEASUREMENTS
from .tables import Chart

NAME = "all"
HELP = "every benchmark in one run; --report DIR writes report.json and report.html with plots"


def add_arguments(parser) -> None:
    parser.add_argument("--report", metavar="DIR", help="write DIR/report.json and DIR/report.html")
    parser.add_argument(
        "--quick", action="store_true", help="each benchmark's tiny settings: a look at the report, not measurements"
    )
    parser.add_argument(
        "--only",
        metavar="NAMES",
        help=f"comma-separated benchmarks to run (default: all of {', '.join(m.NAME for m in MEASUREMENTS)})",
    )
    parser.add_argument(
        "--world-size",
        type=world_sizes,
        metavar="N[,N...]",
        help="the numbers of ranks of each benchmark that takes --world-size, e.g. 2,4,8: each reports how its "
        "ratio to torch moves as ranks grow (default: each benchmark's own)",
    )
    parser.set_defaults(repeats=None)  # (each benchmark's own default; 1 with --quick)


def options_of(
    module, quick: bool, repeats: int | None, world_sizes: tuple[int, ...] | None = None
) -> tuple[list[str], argparse.Namespace]:
    """The options ``bench all`` runs ``module`` with, and them parsed as ``bench NAME`` parses them
    (``world_sizes``: its ``--world-size``, where it takes one)."""
    parser = argparse.ArgumentParser(prog=f"disttrain-lab bench {module.NAME}")
    add_common_arguments(parser)
    module.add_arguments(parser)
    argv = list(module.QUICK) if quick else []
    if repeats is not None or quick:
        argv += ["--repeats", str(repeats if repeats is not None else 1)]
    if world_sizes and "--world-size" in parser._option_string_actions:
        argv += ["--world-size", ",".join(map(str, world_sizes))]
    return argv, parser.parse_args(argv)


def measure_all(
    modules, quick: bool = False, repeats: int | None = None, world_sizes: tuple[int, ...] | None = None
) -> dict:
    """Each benchmark of ``modules`` measured in turn (``world_sizes``: on these numbers of ranks, each that
    takes ``--world-size``): the report's content (what ``report.json`` holds)."""
    report = {
        "kit": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, {torch.cuda.device_count()} GPUs",
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "benchmarks": [],
    }
    for module in modules:
        argv, args = options_of(module, quick, repeats, world_sizes)
        entry = {"name": module.NAME, "about": module.HELP, "options": argv}
        print(f"bench {module.NAME} {' '.join(argv)}".rstrip(), flush=True)
        started = time.monotonic()
        try:
            measured = module.measure(args)
        except NotMeasured as exc:
            entry.update(status="not measured", why=str(exc))
        except Exception as exc:  # one benchmark's failure is reported in its place; the others still run
            entry.update(status="failed", why=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:])
        else:
            entry.update(
                status="measured",
                rows=measured.rows,
                table=measured.table,
                details=measured.about,
                charts=[vars(c) for c in measured.charts],
            )
            print(measured.table, flush=True)
        entry["seconds"] = round(time.monotonic() - started, 2)
        if entry["status"] != "measured":
            print(f"bench {module.NAME}: {entry['status']}: {entry['why']}", file=sys.stderr, flush=True)
        report["benchmarks"].append(entry)
    return report


def plain(value):
    """``value`` as strict JSON holds it: tuples as lists, NaN and infinities as null, anything else as text."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def picture(chart: Chart) -> bytes:
    """``chart`` drawn as a PNG: lines where every x is a number, else grouped bars."""
    figure = Figure(figsize=(7.5, 3.8), dpi=100)
    ax = figure.subplots()
    points = [x for series in chart.series.values() for x, _ in series]
    if points and all(isinstance(x, (int, float)) for x in points):
        for label, series in chart.series.items():
            xs, ys = zip(*sorted(series))
            ax.plot(xs, ys, marker="o", label=label)
    else:
        names = list(dict.fromkeys(str(x) for x in points))
        width = 0.8 / max(1, len(chart.series))
        for i, (label, series) in enumerate(chart.series.items()):
            at = {str(x): y for x, y in series}
            xs = [k - 0.4 + (i + 0.5) * width for k, name in enumerate(names) if name in at]
            ax.bar(xs, [at[name] for name in names if name in at], width=width, label=label)
        ax.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
    if chart.log_x:
        ax.set_xscale("log", base=2)
    if chart.log_y:
        ax.set_yscale("log")
    ax.set_title(chart.title, fontsize=10)
    ax.set_ylabel(chart.ylabel)
    if chart.xlabel:
        ax.set_xlabel(chart.xlabel)
    if len(chart.series) > 1:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    figure.tight_layout()
    out = io.BytesIO()
    figure.savefig(out, format="png")
    return out.getvalue()


def page(report: dict) -> str:
    """The report as one HTML page: the machine, then each benchmark's table and pictures (inline PNGs)."""
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>disttrain-lab benchmarks</title>',
        "<style>body{font-family:sans-serif;max-width:60em;margin:auto}pre{background:#f4f4f4;padding:.5em;"
        "overflow-x:auto}.failed{color:#a00}</style></head><body>",
        "<h1>disttrain-lab benchmarks</h1>",
        f"<p>kit {e(report['kit'])}, torch {e(report['torch'])}, Python {e(report['python'])}; "
        f"{e(report['machine'])}; {e(report['started'])}"
        + (" (<b>--quick</b>: tiny settings, not measurements)" if report["quick"] else "")
        + "</p>",
    ]
    for entry in report["benchmarks"]:
        name = e(entry["name"])
        parts.append(
            f'<h2 id="{name}">bench {name}</h2><p>{e(entry["about"])}; options: '
            f"<code>{e(' '.join(entry['options']) or '(defaults)')}</code>; {entry['seconds']:g} s</p>"
        )
        if entry["status"] != "measured":
            parts.append(f'<p class="failed">{e(entry["status"])}: {e(entry["why"])}</p>')
            continue
        parts.append(f"<pre>{e(entry['table'])}</pre>")
        for chart in entry["charts"]:
            png = base64.b64encode(picture(Chart(**chart))).decode()
            parts.append(f'<img alt="{e(chart["title"])}" src="data:image/png;base64,{png}">')
    parts.append("</body></html>")
    return "\n".join(parts)


def write(report: dict, folder: Path) -> tuple[Path, Path]:
    """``folder``/report.json and ``folder``/report.html."""
    folder.mkdir(parents=True, exist_ok=True)
    content = plain(report)
    data, shown = folder / "report.json", folder / "report.html"
    data.write_text(json.dumps(content, indent=1, allow_nan=False) + "\n")
    shown.write_text(page(content))
    return data, shown


def run(args) -> int:
    names = {m.NAME: m for m in MEASUREMENTS}
    chosen = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else list(names)
    unknown = [n for n in chosen if n not in names]
    if unknown:
        print(
            f"bench all --only: no benchmark named {', '.join(unknown)}; the benchmarks: {', '.join(names)}",
            file=sys.stderr,
        )
        return 2
    modules = [names[n] for n in chosen]
    report = measure_all(modules, quick=args.quick, repeats=args.repeats, world_sizes=args.world_size)
    if args.report:
        data, shown = write(report, Path(args.report))
        print(f"wrote {data} and {shown}")
    return 0 if all(b["status"] == "measured" for b in report["benchmarks"]) else 1
