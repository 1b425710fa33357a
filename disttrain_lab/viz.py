"""Pictures drawn from real runs (never drawings of what should have happened).

run = dl.launch(step, 4, trace=True)
dl.viz.timeline(run)            # one row per rank: compute regions above, communication below
"""

from __future__ import annotations

from .events import Run, format_bytes
from .profiling import messages

# One colour per kind of thing, so the same op looks the same in every lab.
COLORS = {
    "send": "#1f77b4",
    "isend": "#1f77b4",
    "recv": "#ff7f0e",
    "irecv": "#ff7f0e",
    "wait": "#c7c7c7",
    "region": "#2ca02c",
    "collective": "#9467bd",
}


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


# --------------------------------------------------------------------------------------
# Ring steps: which chunk travels where, replayed from a traced run
# --------------------------------------------------------------------------------------
# A ring algorithm marks each step with a region whose meta names the chunks it moved:
#     with dl.region("reduce-scatter", step=s, send=i, recv=j): ...
# In a "sum" phase the receiver adds the chunk it got to its own; in a "copy" phase it
# overwrites its own with it.
RING_PHASES = {"reduce-scatter": "sum", "all-gather": "copy"}


def ring_transfers(run: Run, phases: dict | None = None) -> list[list[dict]]:
    """The steps of a ring run, in order: for each step, the chunks that moved
    ``{"phase", "src", "dst", "chunk", "into", "bytes"}``, read from the trace.

    ``chunk`` is the sender's chunk (its region's ``send``), ``into`` the receiver's (its
    region's ``recv``), ``dst`` the rank the sender's message went to.
    """
    phases = RING_PHASES if phases is None else phases
    regions = [e for e in run.events if e.kind == "region" and e.name in phases]
    if not regions:
        raise ValueError(
            f"the run has no regions named {' or '.join(repr(p) for p in phases)}, so there is nothing to "
            f'replay. Mark each step of your ring with `with dl.region("reduce-scatter", step=step, '
            f'send=send_chunk, recv=recv_chunk):` (and "all-gather" likewise) and launch with trace=True'
        )
    sends = [e for e in run.events if e.op in ("send", "isend")]
    steps: dict[tuple, list[dict]] = {}
    for region in regions:
        for key in ("step", "send", "recv"):
            if key not in region.meta:
                raise ValueError(
                    f"a {region.name!r} region of rank {region.rank} has no {key!r}: write "
                    f"dl.region({region.name!r}, step=..., send=..., recv=...)"
                )
        mine = [e for e in sends if e.rank == region.rank and region.start <= e.start <= region.end]
        for message in mine:
            into = next(
                (
                    r.meta["recv"]
                    for r in regions
                    if r.rank == message.peer and r.name == region.name and r.meta["step"] == region.meta["step"]
                ),
                None,
            )
            steps.setdefault((list(phases).index(region.name), region.meta["step"]), []).append(
                {
                    "phase": region.name,
                    "src": region.rank,
                    "dst": message.peer,
                    "chunk": region.meta["send"],
                    "into": into,
                    "bytes": message.bytes,
                }
            )
    return [steps[key] for key in sorted(steps)]


def ring_steps(run: Run, step: int, ax=None, phases: dict | None = None):
    """The chunks of every rank after ``step`` steps of a traced ring run; returns the Axes.

    Rows are ranks, columns chunks.  A cell says whose contributions the chunk holds
    (``0+2+3``) and is darker the more it holds; the arrows are the messages of this step.
    Step 0 is the start.  The contents are replayed from the trace's regions and messages,
    so the picture shows what the code did, mistakes included.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    phases = RING_PHASES if phases is None else phases
    steps = ring_transfers(run, phases)
    if not 0 <= step <= len(steps):
        raise ValueError(f"step must be in 0..{len(steps)} (this run has {len(steps)} steps), got {step}")
    n = run.world_size
    held = [[{r} for _ in range(n)] for r in range(n)]  # held[rank][chunk]: whose data it sums
    for transfers in steps[:step]:
        before = [[set(c) for c in row] for row in held]  # a step's messages travel at once
        for t in transfers:
            if t["into"] is None or not 0 <= t["chunk"] < n or not 0 <= t["into"] < n:
                continue
            if phases[t["phase"]] == "sum":
                held[t["dst"]][t["into"]] |= before[t["src"]][t["chunk"]]
            else:
                held[t["dst"]][t["into"]] = set(before[t["src"]][t["chunk"]])
    if ax is None:
        _, ax = plt.subplots(figsize=(1.3 * n + 2, 0.8 * n + 1))
    cmap = plt.get_cmap("Blues")
    for rank in range(n):
        for chunk in range(n):
            share = len(held[rank][chunk]) / n
            ax.add_patch(
                Rectangle(
                    (chunk, rank),
                    0.9,
                    0.8,
                    facecolor=cmap(0.15 + 0.7 * share),
                    edgecolor="black",
                    linewidth=1.5 if share == 1 else 0.5,
                )
            )
            label = "all" if share == 1 and n > 4 else "+".join(map(str, sorted(held[rank][chunk])))
            ax.text(
                chunk + 0.45,
                rank + 0.4,
                label,
                ha="center",
                va="center",
                fontsize=8,
                color="white" if share > 0.6 else "black",
            )
    current = steps[step - 1] if step else []
    for t in current:
        if t["into"] is None:
            continue
        wraps = abs(t["dst"] - t["src"]) > 1
        ax.add_patch(
            FancyArrowPatch(
                (t["chunk"] + 0.75, t["src"] + 0.4),
                (t["into"] + 0.75, t["dst"] + 0.4),
                connectionstyle=f"arc3,rad={0.5 if wraps else 0.3}",
                arrowstyle="-|>",
                mutation_scale=12,
                color="tab:red",
                lw=1.5,
            )
        )
    ax.set_xlim(-0.1, n)
    ax.set_ylim(n, -0.2)
    ax.set_xticks([c + 0.45 for c in range(n)])
    ax.set_xticklabels([f"chunk {c}" for c in range(n)])
    ax.set_yticks([r + 0.4 for r in range(n)])
    ax.set_yticklabels([f"rank {r}" for r in range(n)])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    if step == 0:
        title = f"start: every rank holds only its own data ({len(steps)} steps follow)"
    else:
        phase = current[0]["phase"] if current else "?"
        index = sum(1 for s in steps[:step] if s and s[0]["phase"] == phase)
        total = sum(1 for s in steps if s and s[0]["phase"] == phase)
        moved = format_bytes(max((t["bytes"] for t in current), default=0))
        title = f"step {step}/{len(steps)}: {phase} {index}/{total}, each rank sends one chunk ({moved})"
    ax.set_title(title, fontsize=10)
    return ax


def ring_steps_slider(run: Run, phases: dict | None = None):
    """An ipywidgets slider over the steps of ``ring_steps`` (needs a live notebook front end)."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    last = len(ring_transfers(run, phases))

    def show(step: int) -> None:
        ring_steps(run, step, phases=phases)
        plt.show()

    return widgets.interact(show, step=widgets.IntSlider(value=0, min=0, max=last, step=1, description="step"))


# --------------------------------------------------------------------------------------
# Pipeline schedules: F/B boxes per micro-batch, idle time visible
# --------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------
# Tensor parallelism: which slice of each weight lives on which rank
# --------------------------------------------------------------------------------------
def _find_slice(full, part) -> tuple[int, int] | None:
    """(dimension, offset) where ``part`` sits in ``full`` as a contiguous block; dimension -1 = all of it."""
    import torch

    if part.shape == full.shape:
        return (-1, 0) if torch.equal(part, full) else None
    for dim in range(full.dim()):
        others = [s for d, s in enumerate(full.shape) if d != dim]
        if list(part.shape[:dim]) + list(part.shape[dim + 1 :]) != others or part.shape[dim] > full.shape[dim]:
            continue
        for offset in range(full.shape[dim] - part.shape[dim] + 1):
            if torch.equal(full.narrow(dim, offset, part.shape[dim]), part):
                return dim, offset
    return None


def weight_slices(full: dict, per_rank: list[dict], axes=None, title: str | None = None):
    """Which slice of each full weight the ranks hold: one panel per weight, each entry coloured
    by the rank holding it (grey where several ranks hold a copy, white where none does).

    ``full``: name -> the full tensor (1-D or 2-D); ``per_rank``: per rank, name -> the tensor that
    rank really holds (e.g. its parameters, returned by ``dl.launch``).  A held tensor is located
    in the full one by value, so the picture shows what the ranks hold, not what they should.

        >>> dl.viz.weight_slices({"w": w}, dl.launch(lambda: {"w": my_slice_of(w)}, 2))
    """
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    cmap = plt.get_cmap("tab10")
    names = list(full)
    if axes is None:
        _, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2), squeeze=False)
        axes = axes[0]
    for ax, name in zip(axes, names):
        weight = full[name].detach().cpu()
        owners = np.full(tuple(weight.shape) if weight.dim() == 2 else (1, weight.numel()), -1.0)
        for rank, held in enumerate(per_rank):
            if name not in held or held[name] is None:
                continue
            where = _find_slice(weight, held[name].detach().cpu())
            if where is None:
                raise ValueError(
                    f"rank {rank}'s {name} (shape {tuple(held[name].shape)}) is not a contiguous "
                    f"block of the full {name} (shape {tuple(weight.shape)})"
                )
            dim, offset = where
            block = [slice(None)] * 2
            if dim >= 0:
                block[dim if weight.dim() == 2 else 1] = slice(offset, offset + held[name].shape[dim])
            region = owners[tuple(block)]
            owners[tuple(block)] = np.where(region == -1, rank, -2)  # -2: held by several ranks
        colors = ["white", "#dddddd"] + [cmap(r % 10) for r in range(len(per_rank))]
        ax.imshow(
            owners + 2,
            cmap=ListedColormap(colors),
            vmin=0,
            vmax=len(colors) - 1,
            aspect="auto",
            interpolation="nearest",
        )
        shape = " × ".join(map(str, weight.shape))
        ax.set_title(f"{name} ({shape})", fontsize=9)
        ax.set_xlabel("in features" if weight.dim() == 2 else "features", fontsize=8)
        ax.set_ylabel("out features" if weight.dim() == 2 else "", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    legend = [Patch(color=cmap(r % 10), label=f"rank {r}") for r in range(len(per_rank))]
    legend += [
        Patch(color="#dddddd", label="several ranks"),
        Patch(facecolor="white", edgecolor="black", label="no rank"),
    ]
    axes[-1].legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    axes[0].figure.suptitle(title or f"which slice of each weight lives on which of {len(per_rank)} ranks", fontsize=10)
    axes[0].figure.tight_layout()
    return axes


def predicted_vs_measured(rows: list[tuple[str, float, float]], unit: str = "", ax=None, title: str | None = None):
    """Your prediction beside the measurement of a real run, one pair of bars per row
    ``(label, predicted, measured)``; the measured value is written on its bar.

    >>> dl.viz.predicted_vs_measured([("naive", 3 * 2**20, 3.1e6), ("ring", 1.5 * 2**20, 1.6e6)], unit="bytes")
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(1.6 * len(rows) + 3, 3))
    xs = range(len(rows))
    width = 0.38
    predicted = [float(p) if p is not None else 0.0 for _, p, _ in rows]
    measured = [float(m) for _, _, m in rows]
    ax.bar([x - width / 2 for x in xs], predicted, width, label="your prediction", color="#c7c7c7", edgecolor="#555")
    bars = ax.bar([x + width / 2 for x in xs], measured, width, label="measured", color=COLORS["collective"])
    for bar, value in zip(bars, measured):
        text = format_bytes(value) if unit == "bytes" else f"{value:.3g}{(' ' + unit) if unit else ''}"
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [label for label, _, _ in rows])
    ax.set_ylabel(unit or "value")
    ax.legend(fontsize=8)
    ax.set_title(title or "prediction vs measurement", fontsize=10)
    return ax


# --------------------------------------------------------------------------------------
# A merged profiler trace (dl.profiled, dl.merge_traces)
# --------------------------------------------------------------------------------------
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
