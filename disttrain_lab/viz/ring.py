"""Ring steps: which chunk travels where, replayed from a traced run (``ring_transfers`` reads
them, ``ring_steps`` draws the ranks' chunks after one step, ``ring_steps_slider`` steps through them)."""

from __future__ import annotations

from ..events import Run, format_bytes

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
