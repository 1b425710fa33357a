"""The pieces of the benchmarks' printed tables and pictures: a chart of their rows (Chart, chart), the
width of the version column, a ratio cell, an MLP's parameter count; the scaling table and chart of
``--world-size 2,4,8`` (how each version's ratio to its baseline moves as ranks grow); and labs 10 and
11's rows and tables (each version's forward and backward, side by side: step_rows, step_table)."""

from __future__ import annotations

from dataclasses import dataclass

from ..events import format_bytes
from .stats import slowest_median


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


def mlp_parameters(sizes) -> int:
    """Weights and biases of an MLP whose layers have these widths (``sizes[0]`` inputs)."""
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))


def version_width(rows: list[dict], least: int) -> int:
    """The width of a table's version column: its longest version, at least ``least``, plus 2."""
    return max(least, *(len(r["version"]) for r in rows)) + 2


def ratio_cell(row: dict, width: int) -> str:
    """``row["ratio"]`` as "1.23x" right-aligned in ``width`` characters, "-" where there is none."""
    return f"{row['ratio']:>{width - 1}.2f}x" if "ratio" in row else f"{'-':>{width}}"


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


# --------------------------------------------------------------------------------------
# Labs 10 and 11: each version's forward and backward, side by side, on the CPU or the GPUs
# --------------------------------------------------------------------------------------
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
