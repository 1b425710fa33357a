"""Lab 2's exercise 1: the naive all-reduce, every rank's tensor through rank 0."""

from __future__ import annotations

import math

import torch

from ... import carried, checks
from .common import _check_all_reduce, _element_size, _flats


def check_naive_all_reduce(n: int, shape: tuple, dtype: torch.dtype = torch.float32, contiguous: bool = True) -> None:
    """``naive_all_reduce(x)`` (exercise 1): every rank's ``x`` holds the sum, in place, and is returned
    (any shape and dtype; a non-contiguous ``x`` summed too, or refused with a ValueError that says
    "contiguous"); only send/recv; every other rank sends ``x`` to rank 0 in one message and receives
    the sum back in one, and no one else talks (the operating system's count of each connection)."""
    case, run = _check_all_reduce("naive_all_reduce", n, shape, dtype, contiguous)
    if run is None:
        return
    size = math.prod(shape) * _element_size(dtype)
    checks.assert_messages(
        run,
        {**{(r, 0): (1, size) for r in range(1, n)}, **{(0, r): (1, size) for r in range(1, n)}},
        case,
        "Rank 0 receives each other rank's whole tensor once and sends each the sum once; the others talk only "
        "to rank 0.",
    )
    if contiguous:  # (a non-contiguous x's bytes may cross in its memory's order or in its own)
        flats, everyone = _flats(n, shape, dtype), frozenset(range(n))
        carried.assert_carried(run, {(r, 0): [flats[r]] for r in range(1, n)}, case)
        carried.assert_sums_carried(run, flats, {(0, r): [[everyone]] for r in range(1, n)}, case)
