"""Your prediction beside the measurement of a real run, as pairs of bars."""

from __future__ import annotations

from ..events import format_bytes
from .colors import COLORS


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
