"""Lab 2's exercise 5: recursive halving-doubling, N a power of two (and what it does on other N)."""

from __future__ import annotations

import math

import torch

from ... import carried, checks, exercise
from .. import common
from .common import _check_all_reduce, _chunks, _flats, _steps


def _cosets(rank: int, n: int, partner: int) -> list[frozenset[int]]:
    """The ranks whose data a halving message to ``partner`` can hold: ``rank``'s group over the distances
    exchanged before (any order of them), never the partner's."""
    distances = [d for d in (2**k for k in range(int(math.log2(n)))) if d != rank ^ partner]
    groups = []
    for mask in range(2 ** len(distances)):
        group = {rank}
        for k, d in enumerate(distances):
            if mask >> k & 1:
                group |= {g ^ d for g in group}
        groups.append(frozenset(group))
    return groups


def check_halving_doubling_all_reduce(
    n: int, shape: tuple, dtype: torch.dtype = torch.float32, contiguous: bool = True
) -> None:
    """``halving_doubling_all_reduce(x)`` (exercise 5), N a power of two: the sum, in place and
    returned; only send/recv; 2(N-1)/N of the data sent per rank, in 2·log2(N) rounds, each an
    exchange of one message with the partner whose rank differs in one bit (rank XOR distance): with
    the partner at distance d, one message of d chunks while halving and one while doubling, and
    nothing with anyone else (the operating system's count, when every chunk has an element)."""
    numel = math.prod(shape)
    best = 2 * int(math.log2(n))
    case, run = _check_all_reduce(
        "halving_doubling_all_reduce", n, shape, dtype, contiguous, rounds=best if numel >= n else 0
    )
    if run is None or numel < n:
        return
    chunks = _chunks(n, numel, dtype)
    checks.assert_messages(
        run,
        {
            (rank, rank ^ d): (2, 2 * d * min(chunks), 2 * d * max(chunks))
            for rank in range(n)
            for d in (2**k for k in range(int(math.log2(n))))
        },
        case,
        "Exchange with the partner rank XOR d, for d = N/2, ..., 1 and back: half of your current part (S/2, "
        "then S/4, ...) while halving, your whole part while doubling, one message each, and nothing else.",
    )
    if contiguous:  # halving: a sum over the group exchanged with so far; doubling: the total
        everyone = frozenset(range(n))
        partners = [(rank, rank ^ d) for rank in range(n) for d in (2**k for k in range(int(math.log2(n))))]
        sums = {(a, b): [_cosets(a, n, b), [everyone]] for a, b in partners}
        found = carried.assert_sums_carried(run, _flats(n, shape, dtype), sums, case)
        _assert_groups_double(found, n, case)
    _steps(
        run,
        case,
        best,
        f"recursive halving then doubling: 2·log2({n}) = {best} rounds, one exchange with one partner per round "
        f"(distances N/2, ..., 1, then 1, ..., N/2)",
    )


def _assert_groups_double(found: dict[tuple[int, int], list[frozenset[int]]], n: int, case: str) -> None:
    """Halving's log2(N) messages from a rank hold sums over groups of 1, 2, 4, …, N/2 ranks, one of each size:
    each round sends on what the rounds before brought in (the partner of the first round gets the sender's own
    data, the next one its sum with that partner's, …).  Every halving message a piece of the sender's own data
    (a right piece of a right set, no round's sum passed on) fails.  (Nothing found: the student's own kernel.)"""
    for rank in sorted({a for a, _ in found}):
        sizes = sorted(len(sets[0]) for (a, _), sets in found.items() if a == rank and sets)
        want = [2**k for k in range(int(math.log2(n)))]
        assert sizes == want, (
            f"{case}: rank {rank}'s halving messages held sums over groups of {sizes} ranks (the grader's capture of "
            f"the wire); recursive halving sends one over each of {want}: its own data first, then each round the "
            f"sum of its group with the partner it has just exchanged with"
        )


def check_halving_doubling_not_a_power_of_two(n: int) -> None:
    """``halving_doubling_all_reduce(x)`` on N ranks, N not a power of two (exercise 5): either every
    rank raises a ValueError whose message says "power of two" (so that torch's own error about a
    partner rank that does not exist is not taken for it), or a fallback gives the right sum."""
    case = f"halving_doubling_all_reduce on {n} ranks (not a power of two)"
    try:
        _check_all_reduce("halving_doubling_all_reduce", n, (6,))
    except exercise.ExerciseError as e:
        if e.exc_type is None:  # not a rank's own exception: a failed check
            raise AssertionError(
                f"{case}: either raise ValueError (N must be a power of two) on every rank "
                f"before communicating, or fall back to a correct algorithm. Instead: {e}"
            ) from None
        # the exercise asks for the words "power of two"
        assert common.rank_raised(e, "ValueError", "power of two", loose=True), (
            f"{case}: raise ValueError saying N must be a power of two (or fall back to a correct algorithm); "
            f"it raised {e.exc_type}: {e.exc_message}"
        )
    except AssertionError as e:
        raise AssertionError(
            f"{case}: either raise ValueError (N must be a power of two) on every rank "
            f"before communicating, or fall back to a correct algorithm. Instead: {e}"
        ) from None
