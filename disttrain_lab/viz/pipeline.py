"""Pipeline schedules: F/B boxes per micro-batch, idle time visible (each rank's regions read
from a traced run, its idle fraction measured, the schedule drawn as a Gantt chart)."""

from __future__ import annotations

from ..events import Run

# A pipeline stage marks each forward and backward of a micro-batch with a region:
#     with dl.region("F", microbatch=i): ...        with dl.region("B", microbatch=i): ...
# Optionally the whole training step with dl.region("step", step=k), so one step can be picked.
PIPELINE_COLORS = {"F": "#6baed6", "B": "#fd8d3c"}


def pipeline_regions(run: Run, rank: int, step: int | None = None) -> list:
    """``rank``'s F and B regions in the order it ran them; with ``step``, only those inside
    its ``dl.region("step", step=step)``."""
    regions = [e for e in run.by_rank(rank) if e.kind == "region" and e.name in PIPELINE_COLORS]
    if step is None:
        return regions
    windows = [
        (e.start, e.end)
        for e in run.by_rank(rank)
        if e.kind == "region" and e.name == "step" and e.meta.get("step") == step
    ]
    if not windows:
        raise ValueError(
            f'rank {rank} has no region "step" with step={step}; mark each training step with '
            f'`with dl.region("step", step=k):`'
        )
    return [e for e in regions if any(start <= e.start <= end for start, end in windows)]


def pipeline_idle(run: Run, step: int | None = None) -> list[float]:
    """Per rank, the fraction of the step it spent not computing: 1 − busy / span, where busy is
    the total time of its F and B regions and span runs from the first F of any rank to the last
    B of any rank.  For GPipe with equal stages this is the bubble, (p − 1)/(m + p − 1)."""
    per_rank = [pipeline_regions(run, r, step) for r in range(run.world_size)]
    everything = [e for regions in per_rank for e in regions]
    if not everything:
        raise ValueError(
            "the run has no F or B regions: run each micro-batch's forward and backward inside "
            'dl.region("F", microbatch=i) and dl.region("B", microbatch=i), with trace=True'
        )
    span = max(e.end for e in everything) - min(e.start for e in everything)
    return [1.0 - sum(e.duration for e in regions) / span for regions in per_rank]


def pipeline_schedule(run: Run, ax=None, title: str | None = None, step: int | None = None, unit: str = "ms"):
    """Per-rank Gantt chart of a traced pipeline step; returns the matplotlib Axes.

    Each rank is a row: blue boxes are forwards (``F3`` = micro-batch 3), orange ones backwards,
    and the hatched grey between them is where the stage sat idle (the bubble).  Time starts
    at the first forward of the step; the title gives the measured idle fraction.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not isinstance(run, Run):
        raise TypeError(
            f"pipeline_schedule needs the Run that dl.launch(..., trace=True) returns, got {type(run).__name__}"
        )
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    per_rank = [pipeline_regions(run, r, step) for r in range(run.world_size)]
    everything = [e for regions in per_rank for e in regions]
    idle = pipeline_idle(run, step)
    t0, t1 = min(e.start for e in everything), max(e.end for e in everything)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.7 + 0.55 * run.world_size))
    for rank, regions in enumerate(per_rank):
        ax.broken_barh(
            [(0, (t1 - t0) * scale)], (rank - 0.35, 0.7), facecolors="#f0f0f0", edgecolors="none", hatch="///", zorder=0
        )
        for e in regions:
            start, width = (e.start - t0) * scale, e.duration * scale
            ax.broken_barh(
                [(start, width)],
                (rank - 0.35, 0.7),
                facecolors=PIPELINE_COLORS[e.name],
                edgecolors="black",
                linewidth=0.5,
                zorder=1,
            )
            if width > (t1 - t0) * scale / 60:
                ax.text(
                    start + width / 2,
                    rank,
                    f"{e.name}{e.meta.get('microbatch', '')}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    zorder=2,
                    clip_on=True,
                )
    ax.set_yticks(range(run.world_size))
    ax.set_yticklabels([f"rank {r} ({idle[r]:.0%} idle)" for r in range(run.world_size)])
    ax.set_ylim(run.world_size - 0.5, -0.5)
    ax.set_xlim(0, (t1 - t0) * scale)
    ax.set_xlabel(f"time since the step's first forward ({unit})")
    ax.set_title(title or f"{run.world_size} stages: idle {sum(idle) / len(idle):.0%} of the step (measured)")
    ax.legend(
        handles=[
            Patch(color=PIPELINE_COLORS["F"], label="forward"),
            Patch(color=PIPELINE_COLORS["B"], label="backward"),
            Patch(facecolor="#f0f0f0", hatch="///", label="idle"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
    )
    return ax
