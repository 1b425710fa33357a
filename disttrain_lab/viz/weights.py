"""Tensor parallelism: which slice of each weight lives on which rank, each held tensor
located in the full one by value."""

from __future__ import annotations


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
