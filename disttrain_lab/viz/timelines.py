"""A traced run as a per-rank timeline: each rank a row, its compute regions above, its
communication below, each message an arrow from its send to its receive.

run = dl.launch(step, 4, trace=True)
dl.viz.timeline(run)
"""

from __future__ import annotations

from ..events import Run, format_bytes
from .colors import COLORS


def _color(event) -> str:
    if event.kind == "region":
        return COLORS["region"]
    if event.kind == "wait":
        return COLORS["wait"]
    return COLORS.get(event.op, COLORS["collective"])


def timeline(
    run: Run, ax=None, title: str | None = None, arrows: bool = True, min_width: float | None = None, unit: str = "ms"
):
    """Per-rank timeline of a traced run; returns the matplotlib Axes.

    Each rank is a row: its marked regions (``dl.region``) on the upper half, its
    communication calls on the lower half (blue = send, orange = recv, grey = waiting on
    an async op, purple = a collective).  With ``arrows``, a line joins each message's
    send to its receive.  Calls shorter than ``min_width`` are widened so they stay visible.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not isinstance(run, Run):
        raise TypeError(f"timeline needs the Run that dl.launch(..., trace=True) returns, got {type(run).__name__}")
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.7 + 0.6 * run.world_size))
    events = run.events
    span = max((e.end for e in events), default=1e-3) * scale
    min_width = span / 400 if min_width is None else min_width * scale

    for e in events:
        top = e.kind == "region"
        y = e.rank + (-0.4 if top else 0.02)
        width = max(e.duration * scale, min_width)
        ax.broken_barh(
            [(e.start * scale, width)],
            (y, 0.38),
            facecolors=_color(e),
            edgecolors="black" if top else "none",
            linewidth=0.5,
        )
        if top and e.name and width > span / 40:
            values = list(e.meta.values())
            # "F3" for one value (a micro-batch), "reduce-scatter step=0" style otherwise
            label = (
                e.name + str(values[0])
                if len(values) == 1
                else " ".join([e.name] + [f"{k}={v}" for k, v in list(e.meta.items())[:1]])
            )
            ax.text(e.start * scale + width / 2, y + 0.19, label, ha="center", va="center", fontsize=7)
    if arrows:
        for send, recv in run.messages():
            ax.annotate(
                "",
                xy=(recv.end * scale, recv.rank + 0.2),
                xytext=(send.start * scale, send.rank + 0.2),
                arrowprops=dict(arrowstyle="->", color="black", alpha=0.35, lw=0.8),
            )
    ax.set_yticks(range(run.world_size))
    ax.set_yticklabels([f"rank {r}" for r in range(run.world_size)])
    ax.set_ylim(run.world_size - 0.5, -0.5)
    ax.set_xlabel(f"time since launch ({unit})")
    ax.set_title(
        title
        or f"{run.world_size} ranks, {run.backend}: {len(run.messages())} messages, "
        f"{format_bytes(sum(run.bytes_sent(r) for r in range(run.world_size)))} sent"
    )
    ops = {e.op if e.kind != "collective" else "collective" for e in events if e.kind != "region"}
    legend = [
        Patch(color=COLORS[k], label=k)
        for k in ("send", "recv", "wait", "collective")
        if k in ops or (k == "send" and "isend" in ops) or (k == "recv" and "irecv" in ops)
    ]
    if any(e.kind == "region" for e in events):
        legend.append(Patch(color=COLORS["region"], label="compute (dl.region)"))
    if legend:
        ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return ax
