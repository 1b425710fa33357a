"""What every check of lab 3 shares: its constants, the models and batches a case trains on."""

from __future__ import annotations

import os
import sys

from torch import nn

from ... import models

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # float32: the ranks add their gradients in another order
GRADED_PASSED: set[str] = set()  # the exercises whose graded cell passed, for the exercises built on them
_COLLECTIVES_IN_ORDER = "do all ranks issue the same collectives in the same order?"


def _device(device: str | None) -> str:
    """Where the graded runs compute: ``device`` when given; else the CPU under the grader
    (NBGRADER_EXECUTION), which always grades there, and otherwise the notebook's ``DEVICE``."""
    if device is not None:
        return device
    if os.environ.get("NBGRADER_EXECUTION"):
        return "cpu"
    return getattr(sys.modules.get("__main__"), "DEVICE", "cpu")


def graded_model(kind: str, seed: int) -> nn.Module:
    """The graded models: a plain MLP, one with tied weights, one with a frozen first layer."""
    if kind == "mlp":
        return models.MLP([6, 16, 16, 3], seed=seed)
    if kind == "tied":
        return models.TiedAutoencoder(d=6, hidden=8, seed=seed)
    if kind == "frozen":
        return models.PartlyFrozenMLP([6, 16, 16, 3], seed=seed)
    raise ValueError(f"kind must be 'mlp', 'tied' or 'frozen', got {kind!r}")


def batches(kind: str, batch: int, steps: int) -> list:
    """``steps`` batches of ``batch`` rows of regression data for the model ``kind``: (x, y) pairs."""
    data = models.regression_data(batch * steps, 6, 6 if kind == "tied" else 3, seed=7)
    return list(zip(data.x.split(batch), data.y.split(batch)))


def per_parameter(kind: str) -> int:
    """All-reduces per step with one per parameter: each trainable parameter once (tied ones too)."""
    return sum(1 for p in graded_model(kind, 0).parameters() if p.requires_grad)


def bucket_names(model: nn.Module, bucket_mb: float | None) -> list[list[str]]:
    """The bucket rule's buckets of parameter names (trainable ones in reverse order, a new bucket when the next
    would pass ``bucket_mb`` MiB); ``bucket_mb`` None: one bucket per parameter (exercise 4)."""
    cap, buckets, used = (bucket_mb or 0) * 2**20, [], 0
    for name, p in reversed(list(model.named_parameters())):
        if not p.requires_grad:
            continue
        size = p.numel() * p.element_size()
        if bucket_mb is None or not buckets or used + size > cap:
            buckets.append([])
            used = 0
        buckets[-1].append(name)
        used += size
    return buckets


def bucket_sizes(model: nn.Module, bucket_mb: float) -> list[int]:
    """The bucket rule of exercise 5's text, in bytes per bucket (``bucket_names``'s buckets)."""
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    return [sum(sizes[name] for name in bucket) for bucket in bucket_names(model, bucket_mb)]
