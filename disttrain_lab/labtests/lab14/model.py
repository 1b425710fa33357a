"""Lab 14's model on the grader's side: a stage (or a rank's chunk) as Linear layers, each with a Tanh after it or
not, made from ``(weight, bias, tanh)`` triples, exactly as the drivers build it where the notebook's code runs (a
driver carries its own copy: its source is sent there, and it sees no module of the package)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def stage_module(layers: Iterable[tuple[torch.Tensor, torch.Tensor, bool]]) -> nn.Sequential:
    """``nn.Sequential`` of ``nn.Linear`` layers holding copies of each ``(weight, bias)``, an ``nn.Tanh`` after
    those whose ``tanh`` is true (the dtype is the weights')."""
    modules: list[nn.Module] = []
    for w, b, tanh in layers:
        linear = nn.Linear(w.shape[1], w.shape[0], dtype=w.dtype)
        with torch.no_grad():
            linear.weight.copy_(w)
            linear.bias.copy_(b)
        modules += [linear, nn.Tanh()] if tanh else [linear]
    return nn.Sequential(*modules)
