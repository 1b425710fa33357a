"""Lab 6, exercise 1: what a rank's tensor-parallel layers hold, as the OS counts it (the grade's evidence).

``check_parallel_linear`` reads the bytes of storage under each layer's parameters as the rank reports them
(``ranks.storage_bytes``): good for a message that names a view kept into the full weight, but a rank can
rewrite it, and a layer that keeps the full layer beside its slices (in a list, a plain attribute: not a
parameter) reports only its slices.  The grade on "holds only its slices" rests on this check instead: on
``WORLD_SIZE`` (4) ranks forked fresh for the run, each builds ``ColumnParallelLinear`` of a 1024 -> 8192 layer
and ``RowParallelLinear`` of an 8192 -> 1024 layer (32 MiB each in full), drops the full layers and pauses,
and the grader reads each rank's private memory from ``/proc/<pid>/smaps_rollup`` (``osmemory.py``).  A rank's
slices are a quarter of each layer, 16 MiB in all; it may hold at most ``SLACK`` (24 MiB) more, its own memory
from the fork and gloo's buffers included.  Measured with the lab's solution: 27.6-28.2 MiB (16.0 of slices);
a column layer that keeps the full weight beside its slices (in a list): 60.2 MiB; a slice kept as a view
of the full weight holds that weight whole the same way.  The partial sums each rank returns afterwards must
be those of its slices, computed here from the same layers (torch's own initialisation after
``torch.manual_seed``)."""

from __future__ import annotations

import torch
from torch import nn

from ... import checks, osmemory
from .. import common
from .common import _DEADLOCK_HINT, TIMEOUT
from .ranks import _slices_held_in_rank, chunk

__all__ = ["check_slices_held"]

WORLD_SIZE = 4
D, HIDDEN, BATCH, SEED = 1024, 8192, 2, 6
SLACK = 24 * 2**20  # bytes a rank may hold above its slices (about 13 MiB of its own at the pause)


def check_slices_held() -> None:
    """Exercise 1 on the OS's count: ``ColumnParallelLinear(nn.Linear(1024, 8192))`` and
    ``RowParallelLinear(nn.Linear(8192, 1024))`` built on 4 ranks forked fresh, the full layers dropped; at the
    driver's pause each rank's private memory, read from the OS, at most its slices (16 MiB) + 24 MiB; then each
    rank's partial sum of the two layers' output that of its own slices."""
    n = WORLD_SIZE
    case = (
        f"ColumnParallelLinear(nn.Linear({D}, {HIDDEN})) and RowParallelLinear(nn.Linear({HIDDEN}, {D})) on {n} ranks"
    )
    run = common.run_or_fail(
        _slices_held_in_rank, n, (D, HIDDEN, BATCH, SEED), case, _DEADLOCK_HINT, timeout=TIMEOUT, memory=True
    )
    slices = 4 * (2 * D * HIDDEN + HIDDEN) // n + 4 * D  # (the row layer's bias on rank 0; counted on each)
    full = 4 * (2 * D * HIDDEN + HIDDEN + D)
    for rank in range(n):
        held = run.memory.of(rank)  # (wire.Unobserved where the OS was not read: the test fails)
        assert held <= slices + SLACK, (
            f"{case}: rank {rank} held {held / 2**20:,.1f} MiB while the ranks paused after building the layers "
            f"(the full layers dropped), as the OS counts its private memory; its slices are "
            f"{slices / 2**20:,.1f} MiB (a quarter of the full layers' {full / 2**20:,.1f} MiB) and the test allows "
            f"{SLACK / 2**20:g} MiB more.  Does a layer keep the full weight alive: a slice that is a view into it "
            "(take a copy: .clone()), or the full layer kept in an attribute?"
        )
    with osmemory.returning():  # (what the reference frees would show in the next fresh ranks' count)
        torch.manual_seed(SEED)
        first, second = nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)
        x = checks.sample_tensor((BATCH, D), seed=SEED + 1)
        with torch.no_grad():
            for rank, got in enumerate(run.results):
                part = chunk(HIDDEN, n, rank)
                h = x @ first.weight[part].T + first.bias[part]
                want = h @ second.weight[:, part].T + (second.bias if rank == 0 else 0)
                checks.assert_close(
                    got,
                    want,
                    rtol=1e-4,
                    atol=1e-5 * float(want.abs().max()),
                    what=(
                        f"{case}: rank {rank}'s RowParallelLinear(ColumnParallelLinear(x)), against its slices of the "
                        "full layers (hidden features "
                        f"{part.start}..{part.stop - 1}; the row layer's bias on rank 0 only)"
                    ),
                )
        del first, second
    if run.memory.source != "os":  # (the student's own kernel: show what it read)
        print(
            f"ColumnParallelLinear and RowParallelLinear: each rank held "
            f"{', '.join(f'{run.memory.of(r) / 2**20:.1f}' for r in range(n))} MiB as the OS counts it "
            f"(its slices {slices / 2**20:.1f} MiB, at most {(slices + SLACK) / 2**20:.1f})"
        )
