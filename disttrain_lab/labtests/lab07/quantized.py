"""Lab 7's exercise 4: ``quantize_int8``, ``dequantize_int8`` and ``quantized_all_reduce``,
against the quantisation bounds and sums in rank order."""

from __future__ import annotations

import math

import numpy as np
import torch

from ... import carried, checks
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
    bytes of scale per chunk; under grading, each rank's q and scales reach every other rank on the wire
    (``_check_pieces_carried``)."""
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
    _check_pieces_carried(run, flats, chunk_size, case)


def _int8_found(streams: list[bytes], want: np.ndarray) -> bool:
    """Whether one of ``streams`` holds ``want`` (int8) as consecutive bytes, each within 1 of its entry (a
    quotient x / scale computed another way may round the other way where it lies near a half): placed by
    anchors, 16 entries of it found exactly at one of five places, then compared whole."""
    if not want.size:
        return True
    k = min(16, want.size)
    for stream in streams:
        for start in sorted({0, want.size // 4, want.size // 2, 3 * want.size // 4, want.size - k}):
            anchor, at, tries = want[start : start + k].tobytes(), stream.find(want[start : start + k].tobytes()), 0
            while at >= 0 and tries < 64:
                offset, tries = at - start, tries + 1
                if 0 <= offset and offset + want.size <= len(stream):
                    there = np.frombuffer(stream, dtype=np.int8, count=want.size, offset=offset).astype(np.int16)
                    if bool((np.abs(there - want.astype(np.int16)) <= 1).all()):
                        return True
                at = stream.find(anchor, at + 1)
    return False


def _words_at_any_alignment(streams: list[bytes]) -> np.ndarray:
    """Every fp32 word of ``streams`` read at each of the 4 alignments (scales packed after an odd number of int8
    entries are not at a multiple of 4), the finite ones, sorted: for ``carried.words_found``."""
    words = [
        np.frombuffer(s, dtype=np.float32, count=(len(s) - o) // 4, offset=o)
        for s in streams
        for o in range(4)
        if len(s) >= o + 4
    ]
    pool = np.sort(np.concatenate(words)) if words else np.empty(0, dtype=np.float32)
    return pool[np.isfinite(pool)]


def _check_pieces_carried(run, flats: list[torch.Tensor], chunk_size: int, case: str) -> None:
    """Under grading (nothing in the student's own kernel, where there is no capture): every rank's piece reached
    every other rank, as the grader's capture of the wire saw it, from one rank or another (an all-gather relays):
    its int8 q, the grader's quantization of its input (``round(x / scale)``, each entry within 1), as consecutive
    bytes, and each of its fp32 scales (``max|x| / 127``, within 1e-5 relative) among the 4-byte words received at
    any alignment.  Inputs every rank could make itself, summed without sending them (or sent through the
    launcher's store with zeros on the wire), fail."""
    n = run.world_size
    if run.timeline.source == "trace" or not flats[0].numel():
        return
    pieces = []
    for flat in flats:
        scales = _scales_of(flat, chunk_size).float()
        per_entry = scales.repeat_interleave(chunk_size)[: flat.numel()]
        inverse = torch.where(per_entry > 0, 1 / per_entry, torch.zeros_like(per_entry))
        q = torch.round(flat * inverse).clamp(-127, 127).to(torch.int8)
        pieces.append((q.numpy(), scales.numpy()))
    for dst in range(n):
        streams = [b"".join(carried.messages(run, src, dst, case) or []) for src in range(n) if src != dst]
        pool = _words_at_any_alignment(streams)
        for src, (q, scales) in enumerate(pieces):
            if src == dst:
                continue
            assert _int8_found(streams, q), (
                f"{case}: rank {src}'s int8 q ({q.size} entries, round(x / scale) of its input, as the grader "
                f"quantized it) should reach rank {dst}; the grader's capture of the wire found it in nothing rank "
                f"{dst} received (consecutive bytes, each within 1). What a rank sends must be the data itself: "
                "values that arrive some other way, with other bytes sent in their place, do not count"
            )
            found = carried.words_found(pool, scales, rtol=1e-5, atol=0.0)
            assert found == scales.size, (
                f"{case}: rank {src}'s {scales.size} fp32 scales (max|x| / 127 per chunk of its input) should reach "
                f"rank {dst}; the grader's capture of the wire found {found} of them in what rank {dst} received. "
                "What a rank sends must be the data itself"
            )
