"""Lab 13's exercise 3: ``Fp8Linear``, against torchao's ``Float8Linear`` (its tensorwise recipe) made from
the same weights: output, input gradient and parameter gradients."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ... import checks, exercise
from .common import GRADED_PASSED, quiet, run, torchao
from .ranks import _linear_case


def linear_driver(graders: Callable | None = None) -> Callable:
    """The driver ``check_linear`` runs, decided once per graded cell: Fp8Linear on the notebook's quantize
    where that passed its graded test, else on ``graders`` (the grader's own cast, in the cell's hidden tests)."""
    if "quantize" in GRADED_PASSED:
        return _linear_case
    print("(quantize has not passed its graded test yet: the grader checks Fp8Linear with its own cast)")
    return graders or _linear_case


def _reference(made: dict, in_features: int, out_features: int, bias: bool, x, grad) -> dict:
    """torchao's Float8Linear (``Float8LinearConfig()``: e4m3 input and weight, e5m2 output gradient, each
    scaled per tensor as it is cast) with the student's layer's weights: what Fp8Linear must give."""
    ao = torchao()
    plain = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(made[name])
    with quiet():
        layer = ao.Float8Linear.from_float(plain, config=ao.Float8LinearConfig())
        x = x.clone().requires_grad_(True)
        y = layer(x)
        y.backward(grad)
    return {"y": y.detach(), "dx": x.grad, "grads": {n: p.grad for n, p in layer.named_parameters()}}


def check_linear(driver: Callable, in_features: int, out_features: int, bias: bool, lead: tuple, seed: int = 0) -> None:
    """Exercise 3: ``Fp8Linear(in_features, out_features, bias)`` is an ``nn.Linear`` whose output on x (of
    shape ``lead + (in_features,)``) and gradients (of x, the weight, the bias) after ``backward(grad)`` are
    torchao's ``Float8Linear``'s with the same weights, to float32 rounding (within 1e-5 of the largest
    entry); without the FP8 casts (or with e4m3 gradients) they differ by percents.  torch alone: a kernel
    that imported torchao earns nothing here."""
    case = f"Fp8Linear({in_features}, {out_features}, bias={bias}) on x of shape {lead + (in_features,)}"
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(lead + (in_features,), generator=gen) * 2
    grad = torch.randn(lead + (out_features,), generator=gen) * 1e-3
    got = run(driver, 1, (in_features, out_features, bias, x.clone(), grad.clone()), case).results[0]
    assert isinstance(got, dict) and got.get("linear") is True, (
        f"{case}: Fp8Linear must subclass nn.Linear (name nn.Linear as its base class); the layer made is a "
        + " -> ".join(map(str, (got.get("type") or ["?"]) if isinstance(got, dict) else ["?"]))
    )
    assert got.get("torchao") is False or not exercise.graded(), (
        f"{case}: torchao is imported in your kernel; this exercise is graded on your own FP8 code, written with "
        "torch alone (the grader compares it with torchao's). Restart the kernel without importing torchao"
    )
    made = got.get("made")
    names = ["weight", "bias"] if bias else ["weight"]
    assert isinstance(made, dict) and sorted(made) == sorted(names), (
        f"{case}: the layer's parameters must be nn.Linear's ({names}), got {sorted(made or {})}: keep "
        "nn.Linear's constructor (in_features, out_features, bias=True) and its parameters; register no others"
    )
    for name in names:
        shape = (out_features, in_features) if name == "weight" else (out_features,)
        p = made[name]
        assert isinstance(p, torch.Tensor) and p.shape == shape and p.dtype == torch.float32, (
            f"{case}: {name} must be a float32 tensor of shape {shape}, got "
            + (f"{p.dtype} {tuple(p.shape)}" if isinstance(p, torch.Tensor) else type(p).__name__)
        )
    want = _reference(made, in_features, out_features, bias, x, grad)

    def close(a, b, what):
        assert a is not None, (
            f"{case}: {what} is None: no gradient reached it. Your Function's backward must return one gradient "
            "per input of its forward, in order (for forward(ctx, x, weight): dX, dW), and forward must use the "
            "parameters it is given"
        )
        checks.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()), what=f"{case}: {what}")

    close(got["y"], want["y"], "output (forward: x and weight cast to e4m3, each with its own scale)")
    close(got["dx"], want["dx"], "gradient of x (grad_output cast to e5m2, times the e4m3 weight)")
    for name in names:
        close((got.get("grads") or {}).get(name), want["grads"][name], f"gradient of {name}")
