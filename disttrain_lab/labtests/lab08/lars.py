"""Lab 8's section 4 checks: LARS (on one rank), against the reference the notebook hands in."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ... import checks, exercise


# --------------------------------------------------------------------------------------
# Section 4: LARS (on one rank)
# --------------------------------------------------------------------------------------
def _lars_in_rank(ws, grads, groups, lrs, options):
    """Driver: your LARS on parameters ``ws`` (``groups``: the options of 2 parameter groups, the first
    holding ws[0]), one step per gradient in each ``grads[i]``, the rate ``lrs[k]`` set before step k;
    the parameters after."""
    params = [nn.Parameter(w.clone()) for w in ws]
    if groups:
        optimizer = LARS([{"params": params[:1], **groups[0]}, {"params": params[1:], **groups[1]}], **options)  # noqa: F821
    else:
        optimizer = LARS(params, **options)  # noqa: F821  (the notebook's)
    for k in range(len(grads[0])):
        if lrs:
            for group in optimizer.param_groups:
                group["lr"] = lrs[k]
        optimizer.zero_grad()
        for p, g in zip(params, grads):
            p.grad = g[k].clone()
        optimizer.step()
    return [p.detach().clone() for p in params]


def _lars_without_grad():
    """Driver: your LARS stepping two parameters of ones, the second without a gradient: that one after
    the step, and whether the optimizer keeps state for it."""
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    optimizer = LARS([p, q], lr=1.0)  # noqa: F821  (the notebook's)
    p.grad = torch.ones(3)
    optimizer.step()
    return {"q": q.detach().clone(), "state": bool(q in optimizer.state and optimizer.state[q])}


def check_lars_without_grad() -> None:
    """LARS leaves a parameter whose .grad is None alone and keeps no state for it."""
    got = exercise.run(_lars_without_grad, 1, timeout=60).results[0]
    assert torch.equal(got["q"], torch.ones(2)), (
        f"LARS: a parameter whose .grad is None must be left alone; it changed from ones(2) to {got['q']}"
    )
    assert not got["state"], (
        "LARS: a parameter whose .grad is None gets no state: optimizer.state[p] should stay empty "
        "(create the momentum buffer at the first step that has a gradient)"
    )


def check_lars(
    shapes: Sequence,
    steps: int,
    groups: list | None = None,
    lrs: list | None = None,
    seed: int = 0,
    *,
    reference: Callable,
    **options,
) -> None:
    """LARS(**options) on tensors of ``shapes`` (``zero_weight=i``: tensor i all zeros; ``zero_grad=i``: its
    gradients zero), ``steps`` steps, equals ``reference`` (the text's formulas, step by step in float64, held by
    the notebook): trust = η‖w‖ / (‖∇‖ + λ‖w‖ + ε), 1 for a zero weight or gradient; v = μv + lr · trust ·
    (∇ + λw); w = w − v.  ``groups``: per-tensor options of 2 parameter groups; ``lrs``: the rate of each step."""
    zero_grad, zero_weight = options.pop("zero_grad", None), options.get("zero_weight")
    ws = [torch.zeros(s) if seed < 0 else checks.sample_tensor(s, seed=seed + i) for i, s in enumerate(shapes)]
    ws = [w * 0 if i == options.get("zero_weight") else w for i, w in enumerate(ws)]
    options.pop("zero_weight", None)
    grads = [
        [checks.sample_tensor(s, seed=100 * (k + 1) + i) * (0 if i == zero_grad else 1) for k in range(steps)]
        for i, s in enumerate(shapes)
    ]
    params = exercise.run(_lars_in_rank, 1, (ws, grads, groups, lrs, options), timeout=60).results[0]
    for i, (p, w) in enumerate(zip(params, ws)):
        mine = {**options, **(groups[0] if groups and i == 0 else groups[1] if groups else {})}
        expected = reference(w, grads[i], lrs=lrs, **mine)
        rule = (
            " — a zero weight: ‖w‖ = 0, so its trust ratio is 1 and its first step is lr · (∇ + λw)"
            if i == zero_weight
            else " — a zero gradient: ‖∇‖ = 0, so its trust ratio is 1 (weight decay still moves it)"
            if i == zero_grad
            else " — trust = η‖w‖ / (‖∇‖ + λ‖w‖ + ε), v = μv + lr · trust · (∇ + λw), w = w − v"
        )
        checks.assert_close(
            p,
            expected,
            what=f"LARS({mine}) after {steps} step(s): tensor {i} of shape {tuple(shapes[i])}{rule}",
            rtol=1e-5,
            atol=1e-6,
        )
