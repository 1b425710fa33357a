"""Labs 10 and 11's all-gather baselines' collectives, which autograd goes through: GatherRows
(every rank's rows stacked, its backward a reduce-scatter) and ScatterRows (this rank's rows of the
sum, its backward an all-gather)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gather_rows(x):
    out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
    # torch 2.13's name; before it (a Hub's or Colab's torch) all_gather_into_tensor.  Looked up at each call:
    # the kit's tracer and emulated network wrap the module's attribute
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, x.contiguous())
    return out


def _scatter_rows(x):
    out = x.new_empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]))
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, x.contiguous())  # (before torch 2.13)
    return out


class GatherRows(torch.autograd.Function):
    """``GatherRows.apply(x)``: every rank's ``x`` stacked over the first dimension, in rank order
    (all_gather_single); its backward reduce-scatters the gradient (:class:`ScatterRows`)."""

    forward = staticmethod(lambda ctx, x: _gather_rows(x))
    backward = staticmethod(lambda ctx, grad: _scatter_rows(grad))


class ScatterRows(torch.autograd.Function):
    """``ScatterRows.apply(x)``: this rank's slice of the first dimension of the sum of every rank's ``x``
    (reduce_scatter_single); its backward all-gathers the gradient (:class:`GatherRows`)."""

    forward = staticmethod(lambda ctx, x: _scatter_rows(x))
    backward = staticmethod(lambda ctx, grad: _gather_rows(grad))
