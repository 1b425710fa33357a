"""Lab 14's exercise 3: zero bubble's split backward (Qi et al. 2024 §2), graded against torch's own
``loss.backward()`` on the grader's copy of each stage.

The student writes two functions of one signature, ``(stage, x, out, grad_out)``: the stage (an nn.Module),
the input it ran on (``x``, which requires grad), the output it gave (``out = stage(x)``, its graph kept) and
the gradient of the loss with respect to that output (``grad_out``, from the next stage):

- ``backward_input(stage, x, out, grad_out) -> Tensor`` (I): the gradient of the stage's input only, sent at
  once to the previous stage; it computes no parameter's gradient (every ``.grad`` is left as it was) and
  keeps the graph, which W needs (``torch.autograd.grad(out, x, grad_out, retain_graph=True)``);
- ``backward_weight(stage, x, out, grad_out) -> None`` (W): the parameters' gradients, added into ``.grad``
  as ``out.backward(grad_out)`` would (``out.backward(grad_out, inputs=list(stage.parameters()))``).

The same four arguments to both because a zero-bubble schedule keeps, per micro-batch, exactly what its F
saved (x and out) and what its I received (grad_out), and runs W later from those alone: after other
micro-batches' forwards and I's, in any order.  torch's counterparts are ``stage_backward_input`` and
``stage_backward_weight`` in ``torch.distributed.pipelining._backward``.

The graded check builds each case's stage from weights it draws (Linear, Tanh, ..., Linear, float64), runs the
student's functions where the notebook's code runs through a driver (F0, I0, W0 on a fresh stage; then F0, F1,
I0, I1, W0, W1 on another: W of micro-batch 0 after micro-batch 1's I, as ZB-H1 runs it), gets back as data
the input gradients, every ``.grad`` after each I and after each W, and compares them here with torch's
``out.backward(grad_out)`` on the grader's own copy, to 1e-6 of the largest entry.  The rules, in the order
they are checked: I returns a tensor like x equal to torch's ``x.grad``; after I every ``.grad`` is None or
zero (the weights' gradients are W's); after W each ``.grad`` is torch's, and after two W's the sum of both
micro-batches' (W adds, as ``backward()`` does).  How W gets its values is free (recomputing the forward from
``x`` is fine).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .. import common
from .common import seen
from .model import stage_module

RTOL = 1e-6  # of the largest entry of torch's gradient (float64: torch's own order of sums differs by ~1e-16)
TIMEOUT = 60.0  # seconds for all cases: a few tiny MLPs
LONGEST_ERROR = 300  # characters of a student's exception that cross back

SHOWN_SPLIT = ((5, 7, 3), 4)  # (widths, batch): the case the self-check shows; the graded cases are others

_VALID_I = "the gradient of the stage's input: a plain torch.Tensor of x's shape and dtype"


# What crosses: the driver (dl.exercise.run defines it where the notebook's code runs) -----------------------------


def _split_backward_in_rank(cases):
    """A driver: for each case (the stage's layers as (weight, bias) pairs, two inputs, two output gradients),
    the notebook's backward_input and backward_weight on a stage built from those weights, twice: micro-batch 0
    alone (F0, I0, W0), then both (F0, F1, I0, I1, W0, W1) on a fresh stage.  Per run, as data: what each I
    returned, every .grad after each I and after each W, and the first exception a call raised (as text)."""
    import torch
    from torch import nn

    def stage_of(layers):
        modules = []
        for i, (w, b) in enumerate(layers):
            linear = nn.Linear(w.shape[1], w.shape[0], dtype=w.dtype)
            with torch.no_grad():
                linear.weight.copy_(w)
                linear.bias.copy_(b)
            modules += [linear] if i == len(layers) - 1 else [linear, nn.Tanh()]
        return nn.Sequential(*modules)

    def grads(stage):
        return [None if q.grad is None else q.grad.detach().clone() for q in stage.parameters()]

    def plain(value):  # a tensor as data (detached); anything else as it came, for the grader to refuse
        return value.detach().clone() if isinstance(value, torch.Tensor) else value

    found = []
    for layers, xs, grads_out in cases:
        runs = []
        for m in (1, 2):
            stage = stage_of(layers)
            run = {"grad_x": [], "after_i": [], "after_w": [], "raised": None}
            inputs = [x.clone().requires_grad_(True) for x in xs[:m]]
            outs = [stage(x) for x in inputs]
            try:
                for j in range(m):
                    run["grad_x"].append(plain(backward_input(stage, inputs[j], outs[j], grads_out[j])))  # noqa: F821
                    run["after_i"].append(grads(stage))
                for j in range(m):
                    backward_weight(stage, inputs[j], outs[j], grads_out[j])  # noqa: F821
                    run["after_w"].append(grads(stage))
            except Exception as e:  # the grader says which rule came first, then this
                run["raised"] = f"{type(e).__name__}: {e}"[:300]  # LONGEST_ERROR (a driver sees no module names)
            runs.append(run)
        found.append(runs)
    return found


# The grader's reference: torch's own backward on its own copy ------------------------------------------------------


def _stage(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> nn.Sequential:
    """Linear, Tanh, ..., Linear from (weight, bias) pairs, as the driver builds it."""
    return stage_module((w, b, i < len(layers) - 1) for i, (w, b) in enumerate(layers))


def _draw(widths: Sequence[int], batch: int, seed: int) -> tuple[list, list, list]:
    """A case's data: the layers' (weight, bias), two inputs (batch, widths[0]) and two output gradients
    (batch, widths[-1]), float64, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    layers = [
        (
            torch.randn(d_out, d_in, generator=g, dtype=torch.float64) / d_in**0.5,
            torch.randn(d_out, generator=g, dtype=torch.float64),
        )
        for d_in, d_out in zip(widths[:-1], widths[1:])
    ]
    xs = [torch.randn(batch, widths[0], generator=g, dtype=torch.float64) for _ in range(2)]
    grads_out = [torch.randn(batch, widths[-1], generator=g, dtype=torch.float64) for _ in range(2)]
    return layers, xs, grads_out


def _reference(layers, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """torch's gradients of one micro-batch: x.grad and every parameter's .grad after out.backward(grad_out)."""
    stage = _stage(layers)
    x = x.clone().requires_grad_(True)
    stage(x).backward(grad_out)
    return x.grad, [q.grad for q in stage.parameters()]


# Comparing ---------------------------------------------------------------------------------------------------------


def _difference(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """The largest absolute difference, or None where it is within RTOL of ``want``'s largest entry."""
    if not want.numel():
        return None
    diff = (got - want).abs().max().item()
    return None if diff <= RTOL * want.abs().max().item() else diff  # NaN is never within


def _is_like(value, want: torch.Tensor) -> bool:
    return type(value) is torch.Tensor and value.shape == want.shape and value.dtype == want.dtype


def _check_run(run, layers, xs, grads_out, names: list[str], case: str) -> None:
    """One run of the driver on ``len(xs)`` micro-batches, against torch's gradients of each, rule by rule in the
    order the run met them: each I's result and the .grad it left, then an exception if one came, then each W."""
    if type(run) is not dict or not {"grad_x", "after_i", "after_w", "raised"} <= set(run):
        raise AssertionError(f"{case}: expected the driver's record of the run, got {seen(run)}")
    refs = [_reference(layers, x, g) for x, g in zip(xs, grads_out)]
    m = len(refs)
    order = "F0, I0, W0" if m == 1 else "F0, F1, I0, I1, W0, W1"
    if type(run["grad_x"]) is not list or type(run["after_i"]) is not list or type(run["after_w"]) is not list:
        raise AssertionError(f"{case}: expected the driver's record of the run, got {seen(run)}")
    for j, (got, after_i) in enumerate(zip(run["grad_x"][:m], run["after_i"][:m])):
        want = refs[j][0]
        where = f"{case}, {order}: backward_input on micro-batch {j}"
        if not _is_like(got, want):
            raise AssertionError(
                f"{where} returned {seen(got)}; expected {_VALID_I}: shape {tuple(want.shape)}, {want.dtype}"
            )
        diff = _difference(got, want)
        if diff is not None:
            raise AssertionError(
                f"{where} returned a gradient that differs from torch's x.grad (after out.backward(grad_out)) by "
                f"{diff:.3g} at most (allowed: {RTOL:g} of its largest entry, {want.abs().max().item():.3g}); I is "
                "the gradient of the loss with respect to the stage's input x, given grad_out, that of its output"
            )
        if type(after_i) is not list or len(after_i) != len(names):
            raise AssertionError(
                f"{where}: expected the stage's {len(names)} gradients from the driver, got {seen(after_i)}"
            )
        for name, grad in zip(names, after_i):
            if grad is None:
                continue
            if type(grad) is not torch.Tensor:
                raise AssertionError(f"{where}: {name}.grad is {seen(grad)}; expected None or a tensor")
            if grad.numel() and grad.abs().max().item() != 0:
                raise AssertionError(
                    f"{where}: afterwards {name}.grad is set (largest entry {grad.abs().max().item():.3g}); "
                    "backward_input must leave the weights' gradients to backward_weight: every parameter's .grad "
                    "None (or zero) after I.  I computes only x's gradient (and keeps the graph, which W needs)"
                )
    if run["raised"] is not None:
        said = run["raised"] if type(run["raised"]) is str else seen(run["raised"])
        hint = (
            " (backward_weight runs on the out that backward_input saw: I must keep the graph, which W needs)"
            if "second time" in said
            else ""
        )
        raise AssertionError(f"{case}, {order}: your function raised {said[:LONGEST_ERROR]}{hint}")
    if len(run["grad_x"]) != m or len(run["after_i"]) != m or len(run["after_w"]) != m:
        raise AssertionError(f"{case}, {order}: the driver's record holds {len(run['after_w'])} W's, not {m}")
    total = [torch.zeros_like(q) for q in refs[0][1]]
    for j, after_w in enumerate(run["after_w"][:m]):
        total = [t + q for t, q in zip(total, refs[j][1])]
        where = f"{case}, {order}: after backward_weight on micro-batch {j}"
        if type(after_w) is not list or len(after_w) != len(names):
            raise AssertionError(
                f"{where}: expected the stage's {len(names)} gradients from the driver, got {seen(after_w)}"
            )
        for name, grad, want, alone in zip(names, after_w, total, refs[j][1]):
            if grad is None:
                raise AssertionError(
                    f"{where}: {name}.grad is None; backward_weight must put the parameters' gradients in .grad, "
                    "as out.backward(grad_out) does"
                )
            if not _is_like(grad, want):
                raise AssertionError(
                    f"{where}: {name}.grad is {seen(grad)}; expected a tensor of shape {tuple(want.shape)}"
                )
            diff = _difference(grad, want)
            if diff is None:
                continue
            what = "torch's (out.backward(grad_out))" if j == 0 else "the sum of both micro-batches' gradients"
            message = (
                f"{where}: {name}.grad differs from {what} by {diff:.3g} at most (allowed: {RTOL:g} of its largest "
                f"entry, {want.abs().max().item():.3g})"
            )
            if j > 0 and _difference(grad, alone) is None:
                message += (
                    f"; it is micro-batch {j}'s gradient alone: backward_weight must add into .grad, as "
                    "loss.backward() does, not overwrite it (W of each micro-batch accumulates)"
                )
            raise AssertionError(message)


def _check_case(widths, batch, seed, found_runs) -> None:
    layers, xs, grads_out = _draw(widths, batch, seed)
    names = [name for name, _ in _stage(layers).named_parameters()]
    case = f"stage Linear/Tanh widths {tuple(widths)}, batch {batch}"
    if type(found_runs) is not list or len(found_runs) != 2:
        raise AssertionError(f"{case}: expected two runs from the driver, got {seen(found_runs)}")
    _check_run(found_runs[0], layers, xs[:1], grads_out[:1], names, case)
    _check_run(found_runs[1], layers, xs, grads_out, names, case)


def _cases(cases) -> list[tuple[tuple[int, ...], int]]:
    out = []
    for widths, batch in cases:
        widths = tuple(int(w) for w in widths)
        if len(widths) < 2 or min(widths) < 1 or batch < 1:
            raise ValueError(f"case ({widths}, {batch}): needs at least two widths ≥ 1 and a batch ≥ 1")
        out.append((widths, int(batch)))
    return out


# The graded check ----------------------------------------------------------------------------------------------------


def check_split_backward(cases: Sequence[tuple[Sequence[int], int]]) -> None:
    """Exercise 3, ``backward_input`` and ``backward_weight``, for each ``(widths, batch)`` of ``cases``: on a
    Linear/Tanh stage of those widths with weights the grader draws, I's result is torch's ``x.grad``, I leaves
    every ``.grad`` None or zero, and W's ``.grad`` is torch's, summed over two micro-batches (F0, F1, I0, I1,
    W0, W1).  One run on one rank; the comparison here, to 1e-6 of the largest entry."""
    cases = _cases(cases)
    seeds = [secrets.randbits(31) for _ in cases]  # weights nobody sees before the run
    data = [_draw(widths, batch, seed) for (widths, batch), seed in zip(cases, seeds)]
    calls = "backward_input and backward_weight on " + ", ".join(f"widths {w}, batch {b}" for w, b in cases)
    found = common.run_or_fail(_split_backward_in_rank, 1, (data,), calls, "an endless loop?", timeout=TIMEOUT).results[
        0
    ]
    if type(found) is not list or len(found) != len(cases):
        raise AssertionError(f"expected one result per case ({len(cases)}) from the driver, got {seen(found)}")
    for (widths, batch), seed, runs in zip(cases, seeds, found):
        _check_case(widths, batch, seed, runs)


# The self-check (the notebook's visible cell: its own functions, in its own kernel, on the case it shows) ---------


def self_check_split_backward(
    backward_input: Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    backward_weight: Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], None],
) -> None:
    """The two functions on ``SHOWN_SPLIT`` (widths (5, 7, 3), batch 4), called here, checked as the graded test
    checks (other cases, weights it draws)."""
    widths, batch = SHOWN_SPLIT
    layers, xs, grads_out = _draw(widths, batch, 0)
    runs = []
    for m in (1, 2):
        stage = _stage(layers)
        run = {"grad_x": [], "after_i": [], "after_w": [], "raised": None}
        inputs = [x.clone().requires_grad_(True) for x in xs[:m]]
        outs = [stage(x) for x in inputs]
        for j in range(m):
            got = backward_input(stage, inputs[j], outs[j], grads_out[j])
            run["grad_x"].append(got.detach() if isinstance(got, torch.Tensor) else got)
            run["after_i"].append([None if q.grad is None else q.grad.detach().clone() for q in stage.parameters()])
        for j in range(m):
            backward_weight(stage, inputs[j], outs[j], grads_out[j])
            run["after_w"].append([None if q.grad is None else q.grad.detach().clone() for q in stage.parameters()])
        runs.append(run)
    _check_case(widths, batch, 0, runs)
    print(
        f"\N{WHITE HEAVY CHECK MARK} backward_input and backward_weight on widths {widths}, batch {batch}: I gives "
        "torch's x.grad and leaves the weights' gradients alone, W gives torch's .grad and adds over micro-batches "
        "(the graded test tries other stages)"
    )
