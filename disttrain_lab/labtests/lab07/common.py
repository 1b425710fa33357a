"""What every check of lab 7 shares: its constants, which earlier exercises passed their graded
cells (``GRADED_PASSED``), the data a case runs on, and reading what came back."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ... import carried, checks
from ...exercise import ExerciseRun
from .. import common

# the exercises whose graded cell passed (in this kernel): a later exercise runs on the student's earlier
# piece only then, else on the grader's own (one mistake costs one exercise's points)
GRADED_PASSED: set[str] = set()

TIMEOUT = 60  # seconds a test's run may take
_HINT = "do all ranks make the same collective calls, with tensors of the same sizes?"
_HOOK_SIZES = (16, 64, 64, 4)


# --------------------------------------------------------------------------------------
# Test data, and reading what came back
# --------------------------------------------------------------------------------------
def _integers(numel: int, seed: int) -> torch.Tensor:
    """Integer-valued floats: sums of a few are exact in fp32, so the order of adding does not matter."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1001, (numel,), generator=gen).float()


def _spread(numel: int, seed: int) -> torch.Tensor:
    """Floats of very different magnitudes (1e-3 to 1e7, both signs): their fp32 sum depends on the order of adding."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-3, 8, (numel,), generator=gen).float()


def _check_topk_of(flat, values, indices, density, case):
    """(values, indices) must be a valid top-k of flat: k = ceil(density * numel) entries, largest |x|."""
    numel = flat.numel()
    k = min(numel, math.ceil(density * numel))
    assert isinstance(indices, torch.Tensor) and indices.dtype == torch.int64 and indices.dim() == 1, (
        f"{case}: indices must be a 1-D int64 tensor, got "
        f"{indices.dtype if isinstance(indices, torch.Tensor) else type(indices).__name__} "
        f"{tuple(getattr(indices, 'shape', ()))}"
    )
    assert indices.numel() == k, f"{case}: expected k = ceil({density} × {numel}) = {k} entries, got {indices.numel()}"
    if k:
        assert bool((indices[1:] > indices[:-1]).all()), (
            f"{case}: indices must be distinct and increasing, got {indices.tolist()[:10]}..."
        )
        assert 0 <= int(indices[0]) and int(indices[-1]) < numel, f"{case}: indices out of range 0..{numel - 1}"
    checks.assert_close(values, flat[indices], what=f"{case}: values, against flat[indices]")
    rest = torch.ones(numel, dtype=torch.bool)
    rest[indices] = False
    if k and rest.any():
        smallest_kept, largest_dropped = flat[indices].abs().min(), flat[rest].abs().max()
        assert smallest_kept >= largest_dropped, (
            f"{case}: kept an entry of magnitude {smallest_kept.item():g} but dropped one "
            f"of {largest_dropped.item():g}; keep the k largest |x|"
        )


def _hook_calls(calls: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Of a DDP run's collective calls (``carried.collective_payloads``), the hooks' (and DDP's bucket rebuild
    after the first step: a broadcast of a few integers).  DDP's constructor calls first: an all-gather of the
    parameters' shapes (the run's first call), then broadcasts of the module's state."""
    start = 1
    while start < len(calls) and carried.kind(calls[start][0]) == "broadcast":
        start += 1
    return calls[start:]


def _hook_calls_sent(run: ExerciseRun, rank: int, case: str) -> tuple[int, int] | None:
    """What ``rank`` sent in the hooks' collective calls of a DDP run (``_hook_calls``), from the grader's capture
    (None in the student's own kernel): (the payload of its all-gathers, of any other collective)."""
    calls = carried.collective_payloads(run, case)
    if calls is None:
        return None
    hooks = {slot for slot, _ in _hook_calls(calls)}
    gathered = other = 0
    for src, _, slot, payload in carried.sends(run, case) or []:
        if src == rank and slot in hooks:
            if carried.kind(slot) == "all_gather":
                gathered += len(payload)
            else:
                other += len(payload)
    return gathered, other


def _bytes_sent(run: ExerciseRun, rank: int) -> int:
    """Bytes this rank put on the wire in the run, as its trace says (gloo's collectives relay more,
    by their own algorithms): its own piece of each collective, and its sends."""
    events = run.trace.by_rank(rank)
    return sum(e.meta.get("in_bytes", e.bytes) for e in events if e.kind == "collective") + sum(
        e.bytes for e in events if e.op in checks.SEND_OPS
    )


def _data_sent(run: ExerciseRun, rank: int, case: str) -> int:
    """Bytes of data this rank put on the wire in the run.  Under grading, the payload of every gloo
    send it made to any rank, as the grader's capture read them (``wiretimeline.Timeline.messages``; gloo's
    own preambles and notes excluded, the pieces of other ranks an all-gather relays included).  In
    the student's own notebook, where there is no capture, the trace's account of the same: each
    collective's own piece, which an all-gather delivers to each of the N-1 others, and its sends."""
    n = run.world_size
    if run.timeline.source == "trace":
        events = run.trace.by_rank(rank)
        own = sum(e.meta.get("in_bytes", e.bytes) for e in events if e.kind == "collective")
        return (n - 1) * own + sum(e.bytes for e in events if e.op in checks.SEND_OPS)
    return sum(len(m) for dst in range(n) if dst != rank for m in carried.messages(run, rank, dst, case) or [])


def _assert_pieces_sent(run: ExerciseRun, rank: int, piece: int, what: str, numel: int, case: str) -> None:
    """Rank ``rank`` put at most N-1 times its compressed piece (``piece`` bytes of ``what``) on the wire
    (``_data_sent``): each other rank needs it once, and an all-gather relays the others' pieces, of the
    same size; never the dense gradient (``numel`` fp32 entries)."""
    n, sent = run.world_size, _data_sent(run, rank, case)
    assert sent <= (n - 1) * piece, (
        f"{case}: rank {rank} put {sent} B of data on the wire; its {what} are {piece} B, which each of the "
        f"other {n - 1} ranks needs once: at most {(n - 1) * piece} B (an all-gather relays the others' pieces, "
        f"of the same size). The dense gradient is {4 * numel} B"
    )


def _run(target: str | Callable, n: int, inputs, case: str, content: bool = False) -> ExerciseRun:
    """``target`` on n ranks; ranks that do not finish fail the test, saying which case (``content``: the
    grader's capture keeps what crossed, for ``_data_sent`` and ``carried.assert_carried``)."""
    return common.run_or_fail(target, n, inputs, case, _HINT, timeout=TIMEOUT, content=content)
