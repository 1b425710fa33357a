"""Lab 2's exercise 6 (optional): the pipelined ring all-reduce, each step's chunk in segments."""

from __future__ import annotations

import math

import torch

from ... import carried, checks, wire
from .. import common
from .common import (
    _all_reduce_inputs,
    _chunks,
    _dtype,
    _flats,
    _ring,
    _ring_all_reduce_messages,
    check_summed_in_place,
)


def check_pipelined_ring_all_reduce(
    n: int, shape: tuple, segments: int, dtype: torch.dtype = torch.float32, contiguous: bool = True
) -> None:
    """``pipelined_ring_all_reduce(x, segments)`` (exercise 6, optional): the sum, in place and
    returned; only point-to-point messages, to the right neighbour, from the left; 2(N-1)/N of the
    data sent per rank; and, when every chunk has at least ``segments`` elements, each of the 2(N-1)
    steps sends its chunk as ``segments`` messages."""
    case = f"pipelined_ring_all_reduce on {n} ranks ({_dtype(dtype)}, shape {shape}, segments={segments}" + (
        ")" if contiguous else ", non-contiguous)"
    )
    data, xs = _all_reduce_inputs(n, shape, dtype, contiguous)
    run = common.run_or_fail(
        "pipelined_ring_all_reduce",
        n,
        [(x, segments) for x in xs],
        case,
        "a deadlock, or a receive whose message is never sent (are the segments received in the order they are sent?)",
        timeout=30,
        content=True,
    )
    check_summed_in_place(run, data, case, "pipelined_ring_all_reduce")
    numel = math.prod(shape)
    if numel >= n * segments:  # every chunk has `segments` non-empty segments
        checks.assert_messages(
            run,
            _ring_all_reduce_messages(n, numel, dtype, per_step=segments),
            case,
            f"Each of the 2(N-1) steps sends its chunk of S/N to the right neighbour only, as segments = {segments} "
            f"messages.",
        )
        if contiguous:  # each segment a piece of a partial sum of the ranks passed so far, or of the total
            sums = [[_ring(r, s, n) for s in range(n - 1)] + [frozenset(range(n))] for r in range(n)]
            per_rank = 2 * (n - 1) * segments  # (a step's segments may cross before the step before has ended)
            expected = {(r, (r + 1) % n): [sums[r]] * per_rank for r in range(n)}
            found = carried.assert_sums_carried(run, _flats(n, shape, dtype), expected, case)
            _assert_each_step_sent(found, n, segments, case)
    else:  # empty segments: a rank may send them or not, so the messages' number is a range
        chunks = _chunks(n, numel, dtype)
        least, most = 2 * (sum(chunks) - max(chunks)), 2 * (sum(chunks) - min(chunks))
        messages = 2 * (n - 1) * segments  # at most: every segment, empty ones too
        for rank in range(n):
            right, left = (rank + 1) % n, (rank - 1) % n
            others = {peer: run.traffic.between(rank, peer) for peer in range(n) if peer not in (rank, right, left)}
            notes = run.traffic.between(rank, left) if left != right else 0  # its receives' notes, to its left
            quiet = all(b <= wire.HANDSHAKE_BYTES for b in others.values())
            assert quiet and notes <= wire.GLOO_PREAMBLE * messages + wire.HANDSHAKE_BYTES, (
                f"{case}: in a ring, rank {rank} sends only to its right neighbour {right} (and gloo's 48-byte "
                f"notes of its receives to its left neighbour {left}); the operating system counted "
                f"{run.traffic.describe()}"
            )
            sent = run.traffic.between(rank, right)
            high = most + 3 * wire.GLOO_PREAMBLE * messages + wire.HANDSHAKE_BYTES
            assert least <= sent <= high, (
                f"{case}: rank {rank} sent its right neighbour {sent:,} bytes (the operating system counted); a "
                f"ring sends 2·(N-1)/N of the data, {least:,}…{most:,} bytes per rank, and gloo's 96 bytes with "
                f"each of at most {messages} messages. Each step sends one chunk of S/N, in segments"
            )


def _assert_each_step_sent(
    found: dict[tuple[int, int], list[frozenset[int]]], n: int, segments: int, case: str
) -> None:
    """Each of a ring's 2(N − 1) steps sends its chunk as ``segments`` messages: of what rank r sent, ``segments``
    pieces of each partial sum of its reduce-scatter (its own data, then its and the rank before's, …) and
    (N − 1)·``segments`` pieces of the total (the all-gather), in whatever order the segments crossed.  A ring
    whose every message is a piece of the sender's own data (a right sum of each message's set, but no step's
    partial sum passed on) fails."""
    for (src, dst), sets in found.items():
        want = {_ring(src, s, n): segments for s in range(n - 1)}
        want[frozenset(range(n))] = want.get(frozenset(range(n)), 0) + (n - 1) * segments
        got = {ranks: sets.count(ranks) for ranks in want}
        assert got == want, (
            f"{case}: rank {src} sent rank {dst} "
            + ", ".join(f"{got[r]} piece(s) of the sum of ranks {sorted(r)}" for r in want)
            + f"; a ring sends each step's chunk once, as {segments} segments: "
            + ", ".join(f"{want[r]} of ranks {sorted(r)}'" for r in want)
            + " (its reduce-scatter's partial sums, then the all-gather's totals). Each step passes on what the "
            "step before brought in"
        )
