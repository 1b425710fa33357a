"""Lab 13's exercise 4: ``fp8_all_gather``, FSDP's all-gather of a weight in FP8: the values against
torchao's cast of the whole weight, and what crossed the wire (from the grader's capture): each rank's
e4m3 shard reaches every other rank, and no rank sends more than its N-1 shards' bytes."""

from __future__ import annotations

import torch

from ... import carried, checks
from .common import E4M3, reference_cast, run

SCALE_ALLOWANCE = 256  # bytes a rank may send besides the shards: the amax's all-reduce (4-byte messages)
COUNTED_ALLOWANCE = 1024  # bytes per peer the OS counts besides the shards: gloo's headers, the amax (measured 390-450)


def check_fp8_all_gather(n: int, rows: int, cols: int, seed: int = 0, target="fp8_all_gather") -> None:
    """Exercise 4: on n ranks, rank r holding rows r·rows/n .. of a (rows, cols) float32 weight,
    ``fp8_all_gather(shard)`` returns on every rank the whole weight after one e4m3 cast with one scale
    (torchao's cast of the whole weight, dequantized), and the data on the wire is e4m3: each rank's shard
    as torchao casts it reaches every other rank, and each rank sends at most N-1 shards of 1 byte an entry
    (+ ``SCALE_ALLOWANCE``).  In the student's own kernel, where the grader does not capture the wire, the
    operating system's byte counts stand in for it: at most N-1 shards + ``COUNTED_ALLOWANCE`` per peer."""
    case = f"fp8_all_gather of a ({rows}, {cols}) weight on {n} ranks"
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(rows, cols, generator=gen) * 10.0 ** torch.randint(-3, 3, (rows, 1), generator=gen).float()
    shards = list(full.chunk(n))
    result = run(target, n, [(s.clone(),) for s in shards], case, content=True)
    want_q, scale = reference_cast(full, E4M3)
    want = want_q.float() / scale
    for rank, out in enumerate(result.results):
        checks.assert_close(out, want, rtol=1e-6, atol=0, what=f"{case}: rank {rank}'s weight (one scale for all)")
    pieces = list(want_q.chunk(n))
    shard = pieces[0].numel()
    float32 = f"a float32 all-gather would send {4 * (n - 1) * shard:,} B"
    if result.timeline.source == "trace":  # the student's own kernel: no capture of the wire
        if result.traffic.source == "os":
            for rank in range(n):
                sent, limit = result.traffic.sent(rank), (n - 1) * (shard + COUNTED_ALLOWANCE)
                assert sent <= limit, (
                    f"{case}: the operating system counted {sent:,} B sent by rank {rank}; an all-gather of e4m3 "
                    f"shards sends N-1 = {n - 1} shards of {shard:,} B, plus gloo's headers and the amax "
                    f"(at most {COUNTED_ALLOWANCE:,} B per peer): {limit:,} B; {float32}. Gather the bytes of the "
                    "e4m3 shard (q.view(torch.uint8)), not the float32 shard, and gather once"
                )
        return
    for src in range(n):
        for dst in range(n):
            if dst != src:
                carried.assert_carried(
                    result,
                    {(None, dst): [pieces[src]]},
                    f"{case}: rank {src}'s e4m3 shard, cast with the whole weight's scale (fmax / the all-reduced "
                    "amax) and sent as its bytes",
                )
    for rank in range(n):
        sent = sum(len(m) for dst in range(n) if dst != rank for m in carried.messages(result, rank, dst, case) or [])
        limit = (n - 1) * shard + SCALE_ALLOWANCE
        assert sent <= limit, (
            f"{case}: rank {rank} put {sent:,} B of data on the wire; an all-gather of e4m3 shards sends at most "
            f"N-1 = {n - 1} shards of {shard:,} B (+ {SCALE_ALLOWANCE} B for the amax): {limit:,} B; {float32}. "
            "Gather the bytes of the e4m3 shard (q.view(torch.uint8)), once, not the float32 shard or the whole weight"
        )
