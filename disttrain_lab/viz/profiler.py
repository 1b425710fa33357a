"""A merged profiler trace (dl.profiled, dl.merge_traces) drawn as one row per rank: the
regions the code marked, the time spent waiting in the kit's calls, the time gloo moved data."""

from __future__ import annotations

from ..profiling import messages
from .colors import COLORS

PROFILE_LANES = ("your regions", "waiting in a call (dl:*)", "gloo moving data (gloo:*)")


def profile_lane(event: dict) -> int | None:
    """Which lane of :func:`profile` a slice of a merged trace is drawn in, or None (torch's ops)."""
    name = event.get("name", "")
    if event.get("ph") != "X" or event.get("cat") != "user_annotation":
        return None
    if name.startswith("dl:"):
        return 1
    if name.startswith("gloo:"):
        return 2
    return 0


def profile(merged: dict, ax=None, title: str | None = None, unit: str = "ms"):
    """A merged trace (the dict in ``dl.merge_traces``'s file) as one row per rank; returns the Axes.

    Each row has three lanes: the regions the code marked (``dl.region``, ``record_function``),
    the time the program spent inside the kit's communication calls (``dl:send``,
    ``dl:wait(all_reduce)``, ...: red), and the time gloo's threads moved data (``gloo:*``: purple).
    Purple with no red above it is communication hidden behind compute; red is exposed.  Each
    message is an arrow from its send to the end of its receive."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    scale = {"s": 1e-6, "ms": 1e-3, "us": 1.0}[unit]
    slices = [(e, lane) for e in merged["traceEvents"] if (lane := profile_lane(e)) is not None]
    ranks = merged.get("disttrain_lab", {}).get("world_size") or 1 + max((e["pid"] for e, _ in slices), default=0)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.7 + 0.9 * ranks))
    span = max((e["ts"] + e["dur"] for e, _ in slices), default=1.0) * scale
    colors = (COLORS["region"], "#d62728", COLORS["collective"])
    regions = [e for e, lane in slices if lane == 0]
    depth = {  # a region inside another (forward inside step) is drawn below it, in the same lane
        id(e): sum(
            1
            for o in regions
            if o is not e and o["pid"] == e["pid"] and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"]
        )
        for e in regions
    }
    levels = 1 + max(depth.values(), default=0)
    for e, lane in slices:
        y, height = e["pid"] - 0.42 + lane * 0.28, 0.26
        if lane == 0:
            height = 0.26 / levels
            y += depth[id(e)] * height
        width = max(e["dur"] * scale, span / 600)
        ax.broken_barh(
            [(e["ts"] * scale, width)],
            (y, height),
            facecolors=colors[lane],
            edgecolors="black" if lane == 0 else "none",
            linewidth=0.4,
        )
        if lane == 0 and width > span / 30:
            ax.text(e["ts"] * scale + width / 2, y + height / 2, e["name"], ha="center", va="center", fontsize=6)
    for m in messages(merged):
        ax.annotate(
            "",
            xy=(m["received"] * scale, m["dst"] - 0.02),
            xytext=(m["sent"] * scale, m["src"] - 0.02),
            arrowprops=dict(arrowstyle="->", color="black", alpha=0.35, lw=0.8),
        )
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlabel(f"time since the run's first event ({unit}), on rank 0's clock")
    ax.set_title(title or f"torch.profiler, {ranks} ranks merged")
    ax.legend(
        handles=[Patch(color=c, label=label) for c, label in zip(colors, PROFILE_LANES)],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
    )
    ax.grid(axis="x", alpha=0.3)
    return ax
