"""Lab 13's exercises 1 and 2: ``quantize`` / ``dequantize`` (current scaling, per tensor and per block) and
``DelayedScaler`` (Transformer Engine's delayed scaling), against torchao's casts of the same data
(``common.reference_cast``)."""

from __future__ import annotations

import torch

from ... import checks
from .. import common as shared
from .common import E4M3, assert_bits, reference_blocks, reference_cast, run, saturated_cast, scale_of
from .ranks import _delayed_steps, _quantize_case


def sample(shape: tuple, seed: int, spread: float = 3.0) -> torch.Tensor:
    """Float32 test data whose magnitudes span ``10**±spread`` (both signs), some exact zeros, and rows of
    very different sizes: what a cast with one scale per tensor serves badly and one per block well."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 10.0 ** ((torch.rand(shape, generator=gen) * 2 - 1) * spread)
    x[torch.rand(shape, generator=gen) < 0.02] = 0.0
    if x.dim() == 2:
        x *= 10.0 ** torch.randint(-4, 5, (x.shape[0], 1), generator=gen).float()
    return x


def check_quantize(shape: tuple, dtype: torch.dtype, seed: int = 0, *, block: tuple | None = None, x=None) -> None:
    """Exercise 1: ``quantize(x, dtype, block)`` returns torchao's cast of x bit for bit (scale = the format's
    max / amax, amax of the whole tensor or of each block; x · scale saturated to ±max, cast) and its scale(s),
    float32 (a 0-d tensor, or one per block); ``dequantize`` gives back q / scale."""
    x = sample(shape, seed) if x is None else x
    where = "per tensor" if block is None else f"in blocks of {block[0]}×{block[1]}"
    case = f"quantize of a {tuple(x.shape)} tensor to {dtype}, {where}"
    result = run(_quantize_case, 1, (x.clone(), dtype, block), case).results[0]
    q, scale, back = result
    want_q, want_scale = reference_cast(x, dtype) if block is None else reference_blocks(x, dtype, block)
    assert isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.shape == want_scale.shape, (
        f"{case}: the scale must be a float32 tensor of shape {tuple(want_scale.shape)} (one per "
        f"{'tensor' if block is None else 'block'}), got "
        + (f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale).__name__)
    )
    checks.assert_close(scale, want_scale, rtol=1e-6, atol=0, what=f"{case}: scale (max / amax, torchao's)")
    per_entry = want_scale
    if block is not None:
        per_entry = want_scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    assert_bits(q, want_q, f"{case}: q", source=(x, per_entry))
    checks.assert_close(back, want_q.float() / per_entry, rtol=1e-6, atol=0, what=f"{case}: dequantize(q, scale)")


def check_block_error(shape: tuple, block: tuple) -> None:
    """Exercise 1: blocks that do not tile x raise the student's ValueError saying "divisible"."""
    shared.expect_divisible_error(
        "quantize", 1, torch.ones(shape), E4M3, block, case=f"quantize of a {shape} tensor in blocks of {block}"
    )


def _reference_delayed(xs: list[torch.Tensor], dtype: torch.dtype, history_len: int) -> list[tuple]:
    """Transformer Engine's delayed scaling (amax_compute_algo="max", margin 0), kept here: each cast uses the
    scale made from the amaxes of the casts before it (the last ``history_len``); the scale starts at 1 and
    stays as it was while the history's max is 0; torchao's saturated cast.  Per cast: (q, scale, saturated)."""
    fmax = torch.finfo(dtype).max
    history: list[torch.Tensor] = []
    scale = torch.tensor(1.0)
    out = []
    for x in xs:
        scaled = x.float() * scale
        out.append((saturated_cast(scaled, dtype), scale.clone(), int((scaled.abs() > fmax).sum())))
        history = (history + [x.abs().max().float()])[-history_len:]
        amax = torch.stack(history).max()
        if float(amax) > 0:
            scale = scale_of(amax, dtype)
    return out


def check_delayed(dtype: torch.dtype, history_len: int, amaxes: list[float], shape: tuple = (64,), seed: int = 0):
    """Exercise 2: ``DelayedScaler(dtype, history_len)`` casting tensors whose amax follows ``amaxes`` uses,
    at each cast, the scale of the recorded history (not the tensor's own amax), returns it, and counts the
    entries it saturated; its casts equal the reference's bit for bit."""
    case = f"DelayedScaler({dtype}, history_len={history_len}) over amaxes {amaxes}"
    gen = torch.Generator().manual_seed(seed)
    xs = []
    for amax in amaxes:
        x = torch.randn(shape, generator=gen)
        xs.append(x / x.abs().max() * amax if amax else torch.zeros(shape))
    steps = run(_delayed_steps, 1, (dtype, history_len, [x.clone() for x in xs]), case).results[0]
    wants = list(_reference_delayed(xs, dtype, history_len))
    for step, ((q, scale, saturated), (want_q, want_scale, want_saturated)) in enumerate(zip(steps, wants)):
        at = f"{case}, cast {step} (amax {amaxes[step]:g})"
        said = f"{at}: the scale it used (from the amaxes before it, not this tensor's own)"
        after = wants[step + 1][1].reshape(()) if step + 1 < len(wants) else None
        moved = after is not None and not torch.allclose(after, want_scale.reshape(()), rtol=1e-6, atol=0)
        # (only where the cast itself was right: a scale taken from this tensor's own amax equals the next one too)
        cast_right = isinstance(q, torch.Tensor) and q.shape == want_q.shape and torch.equal(q.float(), want_q.float())
        if moved and cast_right and torch.allclose(scale.reshape(()).float(), after, rtol=1e-6, atol=0):
            said += (
                ": the one returned equals the scale after this cast's update, as a scale returned as self.scale "
                "and then updated in place does; return the tensor the cast used"
            )
        checks.assert_close(scale.reshape(()), want_scale.reshape(()), rtol=1e-6, atol=0, what=said)
        assert_bits(q, want_q, f"{at}: q", source=(xs[step], want_scale))
        assert saturated == want_saturated, (
            f"{at}: saturated should count the entries whose |x| · scale exceeded {torch.finfo(dtype).max:g}: "
            f"{want_saturated}, got {saturated}"
        )
