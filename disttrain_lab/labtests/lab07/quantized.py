"""Lab 7's exercise 4: ``quantize_int8``, ``dequantize_int8`` and ``quantized_all_reduce``,
against the quantisation bounds and sums in rank order."""

from __future__ import annotations

import math

import torch

from ... import checks
from .common import _assert_pieces_sent, _run
from .ranks import _quantize_case


# --------------------------------------------------------------------------------------
# Exercise 4: quantize_int8, dequantize_int8, quantized_all_reduce
# --------------------------------------------------------------------------------------
def _scales_of(flat, chunk_size):
    """The reference scales, max|x| / 127 per chunk."""
    if not flat.numel():
        return torch.zeros(0)
    return torch.tensor([float(c.abs().max()) / 127 for c in flat.split(chunk_size)])


def check_quantize(numel: int, chunk_size: int) -> None:
    """Exercise 4: ``quantize_int8`` of ``numel`` entries in chunks of ``chunk_size`` (a chunk of zeros among
    them when there are several) gives int8 q and scales max|x| / 127 per chunk; ``dequantize_int8`` of it
    is within scale / 2 of every entry; stochastic rounding is within one scale and unbiased (the mean of
    400 roundings within 0.2 scales)."""
    case = f"quantize_int8 of {numel} entries, chunks of {chunk_size}"
    flat = checks.sample_tensor(numel, seed=numel) * 3
    flat[: min(numel, chunk_size)] *= 0 if numel > chunk_size else 1  # a chunk of zeros when there are several
    run = _run(_quantize_case, 1, (flat.clone(), chunk_size), case)
    q, scales, dequantized, runs = run.results[0]
    assert q.dtype == torch.int8 and q.shape == (numel,), (
        f"{case}: q must be int8 of shape ({numel},), got {q.dtype} {tuple(q.shape)}"
    )
    checks.assert_close(scales, _scales_of(flat, chunk_size), what=f"{case}: scales (max|x| / 127 per chunk)")
    per_entry = _scales_of(flat, chunk_size).repeat_interleave(chunk_size)[:numel]
    error = (dequantized - flat).abs()
    assert bool((error <= per_entry / 2 * (1 + 1e-5) + 1e-7).all()), (
        f"{case}: rounding to nearest must be within scale / 2 of every entry; the worst is "
        f"{float((error - per_entry / 2).max()):g} beyond it"
    )
    assert bool(((runs - flat).abs() < per_entry + 1e-6).all()), f"{case}: stochastic rounding must be within one scale"
    if numel:
        bias = float((runs.mean(0) - flat).abs().max() / max(float(per_entry.max()), 1e-12))
        assert bias < 0.2, (
            f"{case}: stochastic rounding must be unbiased (up with probability = the fraction); "
            f"the mean of 400 is off by {bias:.2f} scales"
        )


def check_quantized_all_reduce(n: int, numel: int, chunk_size: int) -> None:
    """Exercise 4: ``quantized_all_reduce`` on n ranks returns on every rank the same float32 sum, within
    sum_r scale_r / 2 of the exact fp32 sum at every entry, and each rank sends numel int8 entries + 4
    bytes of scale per chunk."""
    case = f"quantized_all_reduce of {numel} entries, chunks of {chunk_size}, on {n} ranks"
    flats = [checks.sample_tensor(numel, seed=200 + r) for r in range(n)]
    run = _run("quantized_all_reduce", n, [(f.clone(), chunk_size) for f in flats], case, content=True)
    exact = torch.stack(flats).sum(0) if numel else torch.zeros(0)
    bound = sum(_scales_of(f, chunk_size).repeat_interleave(chunk_size)[:numel] / 2 for f in flats)
    for rank, total in enumerate(run.results):
        assert isinstance(total, torch.Tensor) and total.shape == (numel,) and total.dtype == torch.float32, (
            f"{case}: rank {rank} must return a float32 tensor of {numel} entries"
        )
        worst = (total - exact).abs() - bound * (1 + 1e-5) - 1e-6
        assert bool((worst <= 0).all()), (
            f"{case}: rank {rank}'s sum is {float(worst.max()):g} beyond the bound "
            f"sum_r scale_r / 2 from the exact fp32 sum"
        )
        checks.assert_close(
            total, run.results[0], what=f"{case}: rank {rank}'s result, against rank 0's (add in rank order)"
        )
        expected_bytes = numel + 4 * math.ceil(numel / chunk_size)
        _assert_pieces_sent(run, rank, expected_bytes, "int8 entries + fp32 scales", numel, case)
