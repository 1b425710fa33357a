"""Lab 2's exercises 2-4: the ring's reduce-scatter and all-gather, and the ring all-reduce built on them
(graded on the grader's stand-ins, ``ranks``, where a half has not passed its graded test)."""

from __future__ import annotations

import math

import torch

from ... import carried, checks
from .. import common
from .common import (
    GRADED_PASSED,
    HALVES,
    _check_all_reduce,
    _chunks,
    _dtype,
    _flats,
    _ring,
    _ring_all_reduce_messages,
    _run_held,
    _steps,
)


def check_ring_reduce_scatter(n: int, numel: int, dtype: torch.dtype = torch.float32) -> None:
    """``ring_reduce_scatter(flat)`` (exercise 2): rank r returns chunk r of ``flat.tensor_split(N)``,
    summed over all ranks; only send/recv; N-1 messages to the right neighbour, one chunk each (every
    chunk but its own: (N-1)/N of the data), and nothing to anyone else (the operating system's count,
    when every chunk has an element); N-1 steps."""
    case = f"ring_reduce_scatter on {n} ranks ({numel} x {_dtype(dtype)})"
    flats = [checks.sample_tensor(numel, dtype, seed=common.unseen(rank)) for rank in range(n)]
    rounds = n - 1 if numel >= n else 0  # (empty chunks: a rank may skip their messages)
    run = _run_held("ring_reduce_scatter", n, [(f.clone(),) for f in flats], case, "a deadlock?", rounds)
    for rank, out in enumerate(run.results):
        checks.assert_sum_close(
            out,
            [f.tensor_split(n)[rank] for f in flats],
            what=f"{case}: the chunk rank {rank} returned (chunk {rank}, summed)",
        )
    checks.assert_point_to_point(run, "ring_reduce_scatter")
    if numel >= n:
        chunks = _chunks(n, numel, dtype)
        checks.assert_messages(
            run,
            {(r, (r + 1) % n): (n - 1, sum(chunks) - chunks[r]) for r in range(n)},
            case,
            "In each of the N-1 steps a rank sends one chunk (S/N, not the whole tensor) to its right neighbour "
            "only: every chunk but its own.",
        )
        # step s: rank r passes on the chunk it has just added its own to, the sum of ranks r-s, ..., r
        ring = {(r, (r + 1) % n): [[_ring(r, s, n)] for s in range(n - 1)] for r in range(n)}
        carried.assert_sums_carried(run, flats, ring, case)
        _steps(
            run,
            case,
            n - 1,
            "reduce-scatter on a ring: N-1 steps, one chunk out and one in per step, on every rank at once",
        )


def _piece(rank: int, n: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return checks.sample_tensor(numel, dtype, seed=common.unseen(rank)).tensor_split(n)[rank]


def check_ring_all_gather(n: int, numel: int, dtype: torch.dtype = torch.float32) -> None:
    """``ring_all_gather(flat)`` (exercise 3): from chunk r of rank r's ``flat``, every rank's ``flat``
    ends up (in place, and returned) holding every rank's chunk in place; only send/recv; N-1 messages
    to the right neighbour, one chunk each (every chunk but the one its right neighbour owns: (N-1)/N
    of the data), and nothing to anyone else (the operating system's count, when every chunk has an
    element); each message carries its chunk's own values (the grader's capture); N-1 steps."""
    case = f"ring_all_gather on {n} ranks ({numel} x {_dtype(dtype)})"
    flats = []
    for rank in range(n):
        flat = torch.full((numel,), -7, dtype=dtype)
        flat.tensor_split(n)[rank].copy_(_piece(rank, n, numel, dtype))
        flats.append((flat,))
    rounds = n - 1 if numel >= n else 0  # (empty chunks: a rank may skip their messages)
    run = _run_held("ring_all_gather", n, flats, case, "a deadlock?", rounds)
    expected = torch.cat([_piece(r, n, numel, dtype) for r in range(n)])  # in one process
    for rank, out in enumerate(run.results):
        checks.assert_close(run.inputs_after[rank][0], expected, what=f"{case}: rank {rank}'s flat after the call")
        checks.assert_close(out, expected, what=f"{case}: the tensor rank {rank} returned")
    checks.assert_point_to_point(run, "ring_all_gather")
    if numel >= n:
        chunks = _chunks(n, numel, dtype)
        checks.assert_messages(
            run,
            {(r, (r + 1) % n): (n - 1, sum(chunks) - chunks[(r + 1) % n]) for r in range(n)},
            case,
            "In each of the N-1 steps a rank passes one chunk (S/N) to its right neighbour only: its own first, "
            "then the one it has just received.",
        )
        # step s: rank r passes chunk r - s (its own first, then each one it has just received)
        pieces = [_piece(r, n, numel, dtype) for r in range(n)]
        carried.assert_carried(
            run, {(r, (r + 1) % n): [pieces[(r - s) % n] for s in range(n - 1)] for r in range(n)}, case
        )
        _steps(run, case, n - 1, "all-gather on a ring: N-1 steps, one chunk out and one in per step")


def _stand_in_messages(n: int, numel: int, dtype: torch.dtype, replace: tuple) -> dict:
    """ring_all_reduce's messages where the stand-ins replace the halves in ``replace``: a replaced
    reduce-scatter sends chunk c from every rank to rank c, a replaced all-gather rank r's chunk to every
    rank; a half that passed its graded test sends every chunk but one to the right neighbour."""
    chunks = _chunks(n, numel, dtype)
    messages: dict[tuple[int, int], list[int]] = {}
    for r in range(n):
        right = (r + 1) % n
        # (half, the chunk the stand-in sends each rank s: None for chunk s itself, the chunk the ring keeps back)
        for half, sent, kept in (("ring_reduce_scatter", None, r), ("ring_all_gather", r, right)):
            if half in replace:
                sends = [(s, 1, chunks[s if sent is None else sent]) for s in range(n) if s != r]
            else:
                sends = [(right, n - 1, sum(chunks) - chunks[kept])]
            for dst, count, payload in sends:
                total = messages.setdefault((r, dst), [0, 0])
                total[0], total[1] = total[0] + count, total[1] + payload
    return {pair: tuple(v) for pair, v in messages.items()}


def _stand_in_sums(n: int, replace: tuple) -> dict:
    """What each of ring_all_reduce's messages holds where the stand-ins replace the halves in ``replace``
    (``carried.assert_sums_carried``'s sets of ranks, per connection, in order): a replaced reduce-scatter sends
    rank c a piece of the sender's own data (chunk c), a replaced all-gather a piece of the total (the sender's
    chunk, reduced); a ring half that passed sends the right neighbour its partial sums, then the totals."""
    everyone = frozenset(range(n))
    expected: dict[tuple[int, int], list[list[frozenset[int]]]] = {}
    for r in range(n):
        right = (r + 1) % n
        if "ring_reduce_scatter" in replace:
            for c in range(n):
                if c != r:
                    expected.setdefault((r, c), []).append([frozenset({r})])
        else:
            expected.setdefault((r, right), []).extend([[_ring(r, step, n)] for step in range(n - 1)])
        if "ring_all_gather" in replace:
            for c in range(n):
                if c != r:
                    expected.setdefault((r, c), []).append([everyone])
        else:
            expected.setdefault((r, right), []).extend([[everyone]] * (n - 1))
    return expected


def check_ring_all_reduce(n: int, shape: tuple, dtype: torch.dtype = torch.float32, contiguous: bool = True) -> None:
    """``ring_all_reduce(x)`` (exercise 4): the sum, in place and returned, as ``naive_all_reduce``'s;
    only send/recv; 2(N-1) messages to the right neighbour, one chunk each (2(N-1)/N of the data), and
    nothing to anyone else (the operating system's count, when every chunk has an element), in 2(N-1)
    steps.  Where ring_reduce_scatter or ring_all_gather has not passed its graded test (``GRADED_PASSED``),
    the grader's stand-in replaces it (``direct_reduce_scatter``, ``direct_all_gather``: not rings), and
    the messages are those the two halves make, read for what they carried (``_stand_in_sums``)."""
    replace = tuple(half for half in HALVES if half not in GRADED_PASSED)
    common.say_standing_in(
        replace,
        "ring_all_reduce is graded on the grader's stand-in, which sends each chunk straight to its rank, so that "
        "a mistake there does not cost this exercise too",
    )
    numel = math.prod(shape)
    case, run = _check_all_reduce(
        "ring_all_reduce", n, shape, dtype, contiguous, replace, rounds=2 * (n - 1) if numel >= n else 0
    )
    if run is None or numel < n:
        return  # empty chunks: steps and bytes are not compared
    if replace:  # the stand-ins' messages, and those of the half that passed: ring_all_reduce calls both
        checks.assert_messages(
            run,
            _stand_in_messages(n, numel, dtype, replace),
            case,
            "ring_all_reduce calls ring_reduce_scatter, then ring_all_gather, on x's data as one flat tensor.",
        )
        if contiguous:  # and what they carried: x's own data, then the sums
            carried.assert_sums_carried(run, _flats(n, shape, dtype), _stand_in_sums(n, replace), case)
        return
    checks.assert_messages(
        run,
        _ring_all_reduce_messages(n, numel, dtype),
        case,
        "Each of the 2(N-1) steps sends one chunk of S/N, not the whole tensor, to the right neighbour only.",
    )
    if contiguous:  # the reduce-scatter's partial sums (the ranks passed so far), then the all-gather's totals
        everyone = frozenset(range(n))
        sums = [[[_ring(r, s, n)] for s in range(n - 1)] + [[everyone]] * (n - 1) for r in range(n)]
        carried.assert_sums_carried(run, _flats(n, shape, dtype), {(r, (r + 1) % n): sums[r] for r in range(n)}, case)
    _steps(run, case, 2 * (n - 1), "a ring all-reduce: 2(N-1) steps, N-1 of reduce-scatter, N-1 of all-gather")
