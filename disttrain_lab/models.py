"""Small deterministic models and synthetic data for the labs.

The models know nothing about parallelism (a strategy wraps or transforms them).  Every
constructor takes a ``seed`` and builds the same weights on every rank and every run, so
a distributed run can be compared with a single-process one parameter by parameter.

    model = dl.models.MLP([8, 32, 32, 4], seed=0)
    x, y = dl.models.regression_data(64, 8, 4, seed=1)
    reference = dl.models.train_single_process(model, [(x, y)] * 3, lr=0.1)
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _init_(module: nn.Module, seed: int) -> nn.Module:
    """Re-initialise every parameter from ``seed`` (independent of the global RNG)."""
    gen = _seeded(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else p.numel()
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / fan_in ** 0.5)
    return module


class MLP(nn.Sequential):
    """Linear → GELU → ... → Linear, e.g. ``MLP([8, 32, 4])``: (B, 8) -> (B, 4)."""

    def __init__(self, sizes: Sequence[int], seed: int = 0, bias: bool = True):
        if len(sizes) < 2 or any(int(s) < 1 for s in sizes):
            raise ValueError(f"sizes must list at least an input and an output width, all >= 1; got {list(sizes)}")
        layers: list[nn.Module] = []
        for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(d_in, d_out, bias=bias))
            if i < len(sizes) - 2:
                layers.append(nn.GELU())
        super().__init__(*layers)
        _init_(self, seed)


class TiedAutoencoder(nn.Module):
    """x -> tanh(x Wᵀ + b) -> h W: the decoder *shares* the encoder's weight (tied weights).

    Its weight gets gradient from two uses; data parallelism must still average it once.
    (B, d) -> (B, d).
    """

    def __init__(self, d: int = 8, hidden: int = 16, seed: int = 0):
        super().__init__()
        self.encoder = nn.Linear(d, hidden)
        self.decoder_bias = nn.Parameter(torch.zeros(d))
        _init_(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))                          # (B, hidden)
        return h @ self.encoder.weight + self.decoder_bias        # (B, d), weight reused


class PartlyFrozenMLP(MLP):
    """An MLP whose first layer is frozen (``requires_grad=False``), as in fine-tuning:
    frozen parameters get no gradient and must not be communicated."""

    def __init__(self, sizes: Sequence[int], seed: int = 0):
        super().__init__(sizes, seed)
        for p in self[0].parameters():
            p.requires_grad_(False)


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor

    def __iter__(self):
        return iter((self.x, self.y))

    def __len__(self) -> int:
        return len(self.x)


def regression_data(n: int, d_in: int, d_out: int, seed: int = 0, dtype=torch.float32) -> Batch:
    """``n`` samples of y = tanh(x A) + noise: x (n, d_in), y (n, d_out), same for a given seed."""
    gen = _seeded(seed)
    x = torch.randn(n, d_in, generator=gen, dtype=dtype)
    a = torch.randn(d_in, d_out, generator=gen, dtype=dtype) / d_in ** 0.5
    y = torch.tanh(x @ a) + 0.05 * torch.randn(n, d_out, generator=gen, dtype=dtype)
    return Batch(x, y)


def classification_data(n: int, d_in: int, classes: int, seed: int = 0) -> Batch:
    """``n`` samples of a random linear classification problem: x (n, d_in), y (n,) int64."""
    gen = _seeded(seed)
    x = torch.randn(n, d_in, generator=gen)
    w = torch.randn(d_in, classes, generator=gen)
    return Batch(x, (x @ w).argmax(dim=1))


def train_single_process(model: nn.Module, batches: Iterable, lr: float = 0.1, optimizer: str = "sgd",
                         loss: str = "mse") -> nn.Module:
    """The reference: a copy of ``model`` trained in this one process, one step per batch.

    ``optimizer`` is "sgd" or "adam" (torch.optim, default settings but ``lr``); ``loss`` is
    "mse" or "cross_entropy", averaged over the batch.  The input model is not changed.
    """
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr)
    elif optimizer == "adam":
        opt = torch.optim.Adam(params, lr=lr)
    else:
        raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}")
    loss_fn = loss_function(loss)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return model


def loss_function(name: str):
    if name == "mse":
        return nn.functional.mse_loss
    if name == "cross_entropy":
        return nn.functional.cross_entropy
    raise ValueError(f"loss must be 'mse' or 'cross_entropy', got {name!r}")


def parameters_equal(a: nn.Module, b: nn.Module, rtol: float = 1e-5, atol: float = 1e-6) -> list[str]:
    """Names of the parameters that differ between two models (empty when all match)."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    if pa.keys() != pb.keys():
        return sorted(pa.keys() ^ pb.keys())
    return [n for n in pa if not torch.allclose(pa[n].detach(), pb[n].detach(), rtol=rtol, atol=atol)]
