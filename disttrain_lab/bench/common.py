"""The timing machinery every benchmark shares: turns, medians, the lab's own functions, ports,
the command line's common options and the progress bar of a sweep; and the pieces of their
printed tables (the width of the version column, a ratio cell, an MLP's parameter count).  Labs 10
and 11's benchmarks (forward and backward of each version, side by side, on the CPU or one GPU
per rank) share their ``--device``, their rows and tables, and the all-gather baselines' collectives."""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from .. import wire
from ..devices import device as rank_device
from ..events import format_bytes


def slowest_median(per_rank: list[list[float]]) -> float:
    """Median over repeats of the slowest rank's seconds: a step of several ranks ends
    when its last rank does.  ``per_rank[r][i]`` is rank r's time in repeat i."""
    return statistics.median(max(times) for times in zip(*per_rank))


def slowest_samples(per_rank: list[list[float]]) -> list[float]:
    """Each repeat's time on its slowest rank (``per_rank[r][i]``: rank r's time in repeat i)."""
    return [max(times) for times in zip(*per_rank)]


def spread(samples: list[float]) -> float:
    """How much one repeat's time moves in this run: the samples' median absolute deviation over their
    median (0.05: a repeat is typically 5 % off the median; 0 for a single sample)."""
    middle = statistics.median(samples)
    return statistics.median(abs(s - middle) for s in samples) / middle if middle else 0.0


def below_in_noise(rows: list[dict], baseline_of, label: str = "version") -> list[str]:
    """Lines for the rows whose ``ratio`` is below 1 (slower than their baseline): each with its own and its
    baseline's ``spread`` in this run, and whether the gap is within their sum (the machine's noise: the same
    two rows measured again can swap) or beyond it.  ``baseline_of(row)``: the baseline's row."""
    below = [r for r in rows if r.get("ratio", 1.0) < 1.0 and "spread" in r and "spread" in baseline_of(r)]
    if not below:
        return []
    lines = [
        f"below its baseline in this run (spread: a repeat's typical distance from the median, over "
        f"{below[0].get('repeats', '?')} repeats; a gap within the two rows' spreads is this machine's noise)"
    ]
    for r in below:
        base = baseline_of(r)
        noise = r["spread"] + base["spread"]
        verdict = "within the noise" if 1.0 - r["ratio"] <= noise else "beyond the noise"
        lines.append(
            f"  {r[label]}: {r['ratio']:.2f}x {base[label]}; spreads {100 * r['spread']:.1f} % and "
            f"{100 * base['spread']:.1f} %: {verdict} (±{100 * noise:.1f} %)"
        )
    return lines


def free_port() -> int:
    """A port the OS says is free now (port 0), for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def functions_from_notebook(path, names, given: bool = False) -> dict:
    """The functions ``names`` as a lab notebook defines them: runs its setup cell and every
    code cell made only of imports, ``def``s, ``class``es and constant assignments (solution
    cells, given helpers), never test cells (graded or read-only), benchmarks or plots.  Names the notebook does
    not define are left out of the result.  ``given=True`` also runs read-only definitions the
    lab gives (locked cells whose grade id does not name a test, e.g. Lab 8's ``Plan``)."""
    import nbformat  # not a dependency of the kit (Jupyter brings it): only reading a notebook needs it

    nb = nbformat.read(str(path), as_version=4)
    namespace = {"__name__": "__lab_notebook__"}  # not importable: cloudpickle sends the functions by value

    def definitions_only(source: str) -> bool:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return False
        allowed = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)
        return bool(tree.body) and all(
            isinstance(node, allowed)
            or (
                isinstance(node, (ast.Assign, ast.AnnAssign))
                and node.value is not None
                and isinstance(node.value, (ast.Constant, ast.Dict, ast.Tuple, ast.List))
            )
            for node in tree.body
        )

    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        setup = meta.get("grade_id") == "setup"
        given_definition = given and "test" not in meta.get("grade_id", "test")
        if cell.cell_type != "code" or meta.get("grade") or (meta.get("locked") and not (setup or given_definition)):
            continue  # graded tests and read-only test helpers
        if setup or definitions_only(cell.source):
            with contextlib.redirect_stdout(io.StringIO()):  # the setup cell's doctor line
                exec(
                    compile(cell.source, f"{path}:{meta.get('grade_id', 'cell')}", "exec", dont_inherit=True), namespace
                )  # not this module's __future__ imports
    return {name: namespace[name] for name in names if callable(namespace.get(name))}


_NOT_COMMUNICATION = ("wait", "wrap", "recv")  # c10d ops that move no data here (waits, wrappers, receives)


def collective_bytes_counter():
    """A dispatch mode adding up the bytes of every c10d collective called under it.

    torch's tensor parallelism calls the functional collectives (``_c10d_functional``), which
    the kit's trace does not see; this counts both kinds the same way, at the dispatcher (point-to-point
    sends too: ``c10d.send``).  ``with counter: ...``, then ``counter.bytes``, ``counter.calls``.
    """
    from torch.utils._python_dispatch import TorchDispatchMode  # torch's private module: only this counter needs it

    class CollectiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes, self.calls = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional") and not any(
                word in func.__name__ for word in _NOT_COMMUNICATION
            ):
                tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                self.bytes += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
                self.calls += 1
            return func(*args, **(kwargs or {}))

    return CollectiveBytes()


def take_turns(runners: dict, repeats: int, warmup: int) -> dict:
    """In each rank: seconds of each ``runners[name]()`` call, the names taking turns (the order
    rotated every round, so none always goes first), a barrier before each; ``warmup`` rounds
    are left out.  Returns name -> list of ``repeats`` seconds.  Call it on all ranks."""
    names, seconds = list(runners), {}
    for i in range(warmup + repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            runners[name]()
            if i >= warmup:
                seconds.setdefault(name, []).append(time.perf_counter() - start)
    return seconds


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
# The command line: each benchmark module has NAME, HELP, QUICK, add_arguments(parser) and
# measure(args) -> Measured, which ``bench NAME`` prints (``run_measured``) and ``bench all`` (report.py) reports
# --------------------------------------------------------------------------------------
@dataclass
class Chart:
    """A picture of a benchmark's rows, for ``bench all --report``: ``series``, label -> points (x, y);
    bars where the x are names, lines where they are numbers."""

    title: str
    ylabel: str
    series: dict[str, list[tuple]]
    xlabel: str = ""
    log_x: bool = False
    log_y: bool = False


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


def _scaled(rows: list[dict], keys, value: str) -> dict[tuple, dict[int, dict]]:
    """key -> world size -> row, for the rows that have ``value``."""
    out: dict[tuple, dict[int, dict]] = {}
    for row in rows:
        if isinstance(row.get(value), (int, float)) and "error" not in row:
            out.setdefault(tuple(row[k] for k in keys), {})[row["world_size"]] = row
    return out


def _key_name(key: tuple) -> str:
    return ", ".join(format_bytes(k) if isinstance(k, int) and k >= 1024 else str(k) for k in key)


def scaling_table(rows: list[dict], keys=("version",), value: str = "ratio") -> str:
    """How each version's ``value`` (its ratio to its baseline, as in the tables above) moves with the
    number of ranks: a line per ``keys`` of the rows, a column per world size, and the change from the
    fewest ranks to the most."""
    scaled = _scaled(rows, keys, value)
    sizes = sorted({n for by in scaled.values() for n in by})
    width = max(12, *(len(_key_name(k)) for k in scaled)) + 2 if scaled else 12
    lines = [
        f"scaling: each {value} (as in the tables above) on {', '.join(map(str, sizes))} ranks, and how it "
        f"moves from {sizes[0]} to {sizes[-1]}"
        if sizes
        else f"scaling: no {value} measured",
        f"{' / '.join(keys):<{width}}" + "".join(f"{f'{n} ranks':>10}" for n in sizes) + f"{'change':>10}",
    ]
    for key, by in scaled.items():
        cells = "".join(f"{by[n][value]:>9.2f}x" if n in by else f"{'-':>10}" for n in sizes)
        ends = [n for n in sizes if n in by]
        change = f"{by[ends[-1]][value] - by[ends[0]][value]:>+10.2f}" if len(ends) > 1 else f"{'-':>10}"
        lines.append(f"{_key_name(key):<{width}}{cells}{change}")
    return "\n".join(lines)


def scaling_chart(rows: list[dict], keys=("version",), value: str = "ratio") -> Chart:
    """:func:`scaling_table` as lines: ``value`` against the number of ranks, one line per key."""
    scaled = _scaled(rows, keys, value)
    series = {_key_name(key): sorted((n, row[value]) for n, row in by.items()) for key, by in scaled.items()}
    return Chart(f"How each {value} moves with the number of ranks", value, series, xlabel="ranks")


def chart(
    rows: list[dict],
    title: str,
    value: str,
    ylabel: str,
    *,
    x: str = "version",
    series: str | None = None,
    named="{}",
    scale: float = 1.0,
    **kwargs,
) -> Chart:
    """``rows`` measured (no ``error``, ``value`` a number) as points (row[x], row[value] × scale), one series per
    ``named.format(row[series])`` (or ``named(row[series])``; else one, named ``ylabel``)."""
    points: dict[str, list[tuple]] = {}
    for row in rows:
        got = row.get(value)
        if "error" in row or isinstance(got, bool) or not isinstance(got, (int, float)) or got != got:
            continue
        label = (named(row[series]) if callable(named) else named.format(row[series])) if series else ylabel
        at = row[x] if isinstance(row[x], (int, float)) and not isinstance(row[x], bool) else str(row[x])
        points.setdefault(label, []).append((at, got * scale))
    return Chart(title=title, ylabel=ylabel, series=points, **kwargs)


def add_notebook_argument(parser, lab: str) -> None:
    """``--notebook``: the lab notebook whose functions a benchmark measures."""
    parser.add_argument(
        "--notebook",
        help=f"the lab notebook whose functions to measure (default: "
        f"{os.path.join('solutions', lab)}, else the same under labs/)",
    )


def functions_from_lab(args, lab: str, names, what: str, given: bool = False) -> dict:
    """``names`` as the lab notebook (``--notebook``, else solutions/``lab``, else labs/``lab``) defines them
    (``given``: also its read-only definitions, see :func:`functions_from_notebook`); :class:`NotMeasured`
    (saying why) if there is no notebook."""
    path = args.notebook or next(
        (p for p in (os.path.join("solutions", lab), os.path.join("labs", lab)) if os.path.exists(p)), None
    )
    if path is None or not os.path.exists(path):
        raise NotMeasured(
            f"no notebook to take the {what} from: pass --notebook PATH (looked for "
            f"{path or 'solutions/' + lab + ' and labs/' + lab})"
        )
    functions = functions_from_notebook(path, names, given=given)
    missing = [name for name in names if name not in functions]
    print(f"{what} from {path}" + (f" (not defined there: {', '.join(missing)})" if missing else ""))
    return functions


def mlp_parameters(sizes) -> int:
    """Weights and biases of an MLP whose layers have these widths (``sizes[0]`` inputs)."""
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))


def version_width(rows: list[dict], least: int) -> int:
    """The width of a table's version column: its longest version, at least ``least``, plus 2."""
    return max(least, *(len(r["version"]) for r in rows)) + 2


def ratio_cell(row: dict, width: int) -> str:
    """``row["ratio"]`` as "1.23x" right-aligned in ``width`` characters, "-" where there is none."""
    return f"{row['ratio']:>{width - 1}.2f}x" if "ratio" in row else f"{'-':>{width}}"


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


def _gather_rows(x):
    out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
    # torch 2.13's name; before it (a Hub's or Colab's torch) all_gather_into_tensor.  Looked up at each call:
    # the kit's tracer and emulated network wrap the module's attribute
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, x.contiguous())
    return out


def _scatter_rows(x):
    out = x.new_empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]))
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, x.contiguous())  # (before torch 2.13)
    return out


class GatherRows(torch.autograd.Function):
    """``GatherRows.apply(x)``: every rank's ``x`` stacked over the first dimension, in rank order
    (all_gather_single); its backward reduce-scatters the gradient (:class:`ScatterRows`)."""

    forward = staticmethod(lambda ctx, x: _gather_rows(x))
    backward = staticmethod(lambda ctx, grad: _scatter_rows(grad))


class ScatterRows(torch.autograd.Function):
    """``ScatterRows.apply(x)``: this rank's slice of the first dimension of the sum of every rank's ``x``
    (reduce_scatter_single); its backward all-gathers the gradient (:class:`GatherRows`)."""

    forward = staticmethod(lambda ctx, x: _scatter_rows(x))
    backward = staticmethod(lambda ctx, grad: _gather_rows(grad))


def _finished(run):
    """``run``, returning only when the rank's GPU has finished its work (kernels are asynchronous)."""
    dev = rank_device()
    if dev.type != "cuda":
        return run

    def synchronized():
        run()
        torch.cuda.synchronize(dev)

    return synchronized


# what a bench's byte column counts: the bytes a rank sent the other ranks, as the OS counted them on its TCP
# connections (payload and gloo's headers: what crossed the wire; the grader's count, ``wire.traffic``), over
# gloo; the ops' tensor sizes (``collective_bytes_counter``) where the links are not the OS's (NCCL on GPUs)
SENT_ON_THE_WIRE = "counted by the OS on its connections: payload and gloo's headers"
OPS_SIZES = "the sizes of its communication ops' tensors: NCCL's links are not the OS's"


def sent_bytes(runners: dict) -> tuple[dict[str, int], str]:
    """In each rank: (name -> the bytes this rank sends the others in one call of ``runners[name]``, what was
    counted): over gloo, what the OS counted on the ranks' connections (``wire.snapshot`` before and after
    each call, a barrier after it, less what that barrier sends alone), ``SENT_ON_THE_WIRE``; else the
    sizes of the communication ops' tensors, ``OPS_SIZES``.  Call it on all ranks; each call runs once more."""
    if dist.get_backend() != "gloo" or wire.available() is not None:
        counted = {}
        for name, run in runners.items():
            counter = collective_bytes_counter()
            with counter:
                run()
            counted[name] = counter.bytes
        return counted, OPS_SIZES
    pids: list = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    me = dist.get_rank()

    def sent(run) -> int:
        dist.barrier()
        before = wire.snapshot()
        run()
        dist.barrier()  # (every rank done: what this one sent has arrived)
        return wire.traffic(before, wire.snapshot(), pids).sent(me)

    alone = min(sent(lambda: None) for _ in range(2))  # a barrier's own bytes
    return {name: max(0, sent(run) - alone) for name, run in runners.items()}, SENT_ON_THE_WIRE


def step_times(runners: dict, repeats: int, warmup: int) -> dict:
    """In each rank: ``{"seconds": name -> seconds per step (see take_turns), "bytes": name -> the
    bytes the rank sends in one step, "counted": what they are}`` (``sent_bytes``) of ``runners``
    (name -> a step), each step ending when the rank's GPU has finished it.  Call it on all ranks."""
    runners = {name: _finished(run) for name, run in runners.items()}
    communicated, counted = sent_bytes(runners)
    seconds = take_turns(runners, repeats, warmup) if runners else {}
    return {"seconds": seconds, "bytes": communicated, "counted": counted}


def step_rows(per_rank: list[dict], row: dict, baselines) -> list[dict]:
    """A row per version in ``per_rank`` (every rank's :func:`step_times`, with ``"unavailable"``:
    name -> why it did not run, if any): ``row``'s fields and the version, its ``ms`` (median of the
    slowest rank) and rank 0's ``bytes`` (``counted``: what they are), or its ``error``; ``baseline``
    and ``ratio`` (the baseline's time / this one's): the first of ``baselines`` that was measured."""
    first = per_rank[0]
    unavailable = first.get("unavailable", {})
    rows = []
    for name in [*first["bytes"], *unavailable]:  # the runners' order (take_turns' rotates)
        version = {**row, "version": name, "size": dict(row["size"]), "counted": first["counted"]}
        if name in unavailable:
            version["error"] = unavailable[name]
        else:
            version["ms"] = 1e3 * slowest_median([rank["seconds"][name] for rank in per_rank])
            version["bytes"] = first["bytes"][name]
        rows.append(version)
    measured = {r["version"]: r for r in rows if "error" not in r}
    baseline = next((measured[name] for name in baselines if name in measured), None)
    for r in measured.values():
        if baseline is not None:
            r["baseline"], r["ratio"] = baseline["version"], baseline["ms"] / r["ms"]
    return rows


def step_table(rows: list[dict], width: int) -> list[str]:
    """The lines of one part's table (``rows``: one part's, as :func:`step_rows` makes them): what ran
    where, then a line per version: ms per forward+backward, rank 0's bytes, the ratio to the baseline
    (or why it was not measured); ``width``: the version column's."""
    first = rows[0]
    size = ", ".join(f"{key} {value}" for key, value in first["size"].items())
    base = next((r["baseline"] for r in rows if "baseline" in r), "-")
    lines = [
        f"{first['part']} on {first['world_size']} ranks, {first.get('device', 'cpu')} ({size}); forward + backward, "
        f"median of {first['repeats']}, slowest rank; bytes: what rank 0 sent per step ({first['counted']}); "
        f"ratio: {base}'s time / this one's",
        f"  {'version':<{width}} {'ms':>9} {'bytes':>11} {'ratio':>7}",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['version']:<{width}} not measured: {r['error']}")
        else:
            lines.append(f"  {r['version']:<{width}} {r['ms']:>9.1f} {format_bytes(r['bytes']):>11} {ratio_cell(r, 7)}")
    return lines
