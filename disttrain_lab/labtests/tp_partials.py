"""What each rank of a tensor-parallel group hands its all-reduces, computed in one process from the dense layers
(labs 6 and 8): the grader holds the wire's all-reduces to sums of these (``wirecalls.assert_all_reduces_carried``).

Megatron's two pieces, each a column-parallel layer then a row-parallel one, with f before and g after:

- the MLP ``Linear(d, h) → GeLU → Linear(h, d_out)``: position p of t keeps hidden features p of t equal chunks;
  g sums its partial output ``GeLU(x W1[p]ᵀ + b1[p]) W2[:, p]ᵀ``, f's backward its partial input gradient
  ``∂L/∂hidden[:, p] · W1[p]``;
- attention: position p keeps heads p of t (their features side by side), g sums those heads' output through its
  columns of ``proj``, f's backward the input gradient through its heads alone.

Position 0's partial output may carry the row-parallel bias (added before the sum, once) or not (added after it):
each is a list of the alternatives.
"""

from __future__ import annotations

import torch

from .. import models

__all__ = ["mlp_partials", "attention_partials"]


def mlp_partials(dense, x: torch.Tensor, dy: torch.Tensor | None, tp: int) -> tuple[list, list]:
    """Per position of ``tp``: forward, its partial output (a list of alternatives); backward (empty lists without
    ``dy``, the output's gradient), its partial input gradient.  ``dense``: ``dense[0]``, ``dense[1]``,
    ``dense[2]`` the two linears and the activation between them."""
    first, activation, second = dense[0], dense[1], dense[2]
    hidden = first(x.detach()).detach().requires_grad_()
    active = activation(hidden)
    grad_hidden = None
    if dy is not None:  # (the dense layers' own gradients untouched)
        (grad_hidden,) = torch.autograd.grad(second(active), hidden, dy)
    weight, bias = second.weight.detach(), None if second.bias is None else second.bias.detach()
    forward, backward = [], []
    for position, rows in enumerate(torch.arange(first.out_features).tensor_split(tp)):
        partial = active.detach()[..., rows] @ weight[:, rows].T
        forward.append([partial + bias, partial] if position == 0 and bias is not None else [partial])
        backward.append([] if grad_hidden is None else [grad_hidden[..., rows] @ first.weight.detach()[rows]])
    return forward, backward


def attention_partials(attn, x: torch.Tensor, dy: torch.Tensor | None, tp: int) -> tuple[list, list]:
    """The same for a ``models.CausalSelfAttention``: forward, each position's heads through its columns of
    ``proj``; backward (without ``dy``, empty lists), the input gradient through its heads alone."""
    x = x.detach().requires_grad_()
    heads = models.attend(attn.query(x), attn.key(x), attn.value(x), attn.n_heads)  # (B, T, d): side by side
    weight, bias = attn.proj.weight.detach(), attn.proj.bias.detach()
    forward, backward = [], []
    for position, cols in enumerate(torch.arange(weight.shape[1]).tensor_split(tp)):
        partial = heads.detach()[..., cols] @ weight[:, cols].T
        forward.append([partial + bias, partial] if position == 0 else [partial])
        if dy is None:
            backward.append([])
            continue
        mine = torch.zeros_like(heads)
        mine[..., cols] = (dy @ weight)[..., cols]
        (grad_x,) = torch.autograd.grad(heads, x, mine, retain_graph=True)
        backward.append([grad_x])
    return forward, backward
