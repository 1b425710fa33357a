"""Lab 13's drivers: each runs in the student's kernel, among the notebook's names (its source is sent
there and defined beside the student's code), and returns data only; their references are in the checks."""

from __future__ import annotations

import torch


def _quantize_case(x, dtype, block):
    """Driver (runs in your kernel): quantize(x, dtype, block), and dequantize of what it gave."""
    result = quantize(x, dtype, block)  # noqa: F821  (the notebook's)
    if not (isinstance(result, tuple) and len(result) == 2):
        got = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
        raise TypeError(f"quantize must return a tuple (q, scale); it returned {got}")
    q, scale = result
    return q, scale, dequantize(q, scale, block)  # noqa: F821  (the notebook's)


def _delayed_steps(dtype, history_len, xs):
    """Driver (runs in your kernel): one DelayedScaler(dtype, history_len) casting each tensor of xs in
    turn; per cast, (the FP8 tensor, the scale it used, the entries it saturated)."""
    scaler = DelayedScaler(dtype, history_len)  # noqa: F821  (the notebook's)
    steps = []
    for x in xs:
        q, scale = scaler(x)
        steps.append((q, torch.as_tensor(scale, dtype=torch.float32).clone(), int(scaler.saturated)))
    return steps


def linear_case(layer_class, in_features, out_features, bias, x, grad):
    """In the rank: a ``layer_class(in_features, out_features, bias)`` as made; its output on x and, after
    ``backward(grad)``, the gradients of x, the weight and the bias.  Also whether it is an ``nn.Linear``,
    and whether torchao is imported in this kernel (the exercise asks for torch alone)."""
    import sys

    torch.manual_seed(0)
    layer = layer_class(in_features, out_features, bias=bias)
    made = {name: p.detach().clone() for name, p in layer.named_parameters()}
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(grad)
    grads = {name: None if p.grad is None else p.grad.detach().clone() for name, p in layer.named_parameters()}
    # torchao, anywhere in this kernel: its modules, the ops it registers with torch's dispatcher on import (which
    # stay when sys.modules is cleaned), or a class of its in the layer or its output
    ops = torch._C._dispatch_get_all_op_names()
    classes = [type(m) for m in layer.modules()] + [type(y)]
    return {
        "linear": isinstance(layer, torch.nn.Linear),
        "type": [c.__qualname__ for c in type(layer).__mro__][:6],
        "torchao": any(name == "torchao" or name.startswith("torchao.") for name in sys.modules)
        or any(op.startswith("torchao::") for op in ops)
        or any(any(c.__module__.startswith("torchao") for c in cls.__mro__) for cls in classes),
        "made": made,
        "y": y.detach(),
        "dx": None if x.grad is None else x.grad.detach(),
        "grads": grads,
    }


def _linear_case(in_features, out_features, bias, x, grad):
    """Driver (runs in your kernel): ``linear_case`` of the notebook's Fp8Linear."""
    from disttrain_lab.labtests.lab13.ranks import linear_case

    return linear_case(Fp8Linear, in_features, out_features, bias, x, grad)  # noqa: F821  (the notebook's)
