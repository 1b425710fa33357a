"""What lab 14's checks share: a value from the student's side, and a time on the capture's clock, as a message
shows them."""

from __future__ import annotations

import torch

__all__ = ["ms", "seen"]


def seen(value) -> str:
    """A value from the student's side, for a message: a tensor's type, shape and dtype (its values say nothing about
    the rule broken); anything else its type and repr, cut short."""
    if isinstance(value, torch.Tensor):
        return f"{type(value).__name__} of shape {tuple(value.shape)}, {value.dtype}"
    shown = repr(value)
    return f"{type(value).__name__} {shown if len(shown) <= 80 else shown[:79] + '…'}"


def ms(t: float) -> str:
    """Seconds on the capture's clock, in milliseconds to the microsecond."""
    return f"{t * 1000:.3f} ms"
