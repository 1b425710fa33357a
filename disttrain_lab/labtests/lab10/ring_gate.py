"""Ring attention's overlap, as the grader observes it: a rank held before its ring sends anything.

Ring attention overlaps each step's transfer with the block computation: the next key/value block's
``isend``/``irecv`` are posted first, the block held now is computed, and only then does the rank wait for
the transfer.  Under grading the drivers hold one rank, drawn at grading time, at the grader's gate
(``disttrain_lab.gate``) before its ring starts, so it posts nothing; every other rank is held as it begins
its first block's computation (its first ``block_attention`` call).  The rank after the held one can reach
its first block only if it computes before its first transfer is done: that transfer waits on the held
rank.  A ring that waits for the transfer first (or receives before it computes) never reaches it while its
neighbour is held; the grader answers the ranks it holds once every rank is held, or after
``gatekeeper.HELD_WAIT`` seconds with those it holds (``gate.Seen.held``), and the test fails unless all were.

In the student's own notebook no grader holds a gate: ``gated`` changes nothing, and the test reads the
ranks' trace instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ... import gate as gates

__all__ = ["gated"]


@contextlib.contextmanager
def gated(names: dict, held: int | None) -> Iterator[None]:
    """Around one ring attention forward on this rank (see the module docstring): ``names``, the namespace
    whose ``block_attention`` the student's ring calls; ``held``, the rank held before its ring starts (None:
    no gate)."""
    gate = gates.connect(dist.get_rank()) if held is not None else None
    if gate is None:
        yield
        return
    theirs = names.get("block_attention")
    try:
        if dist.get_rank() == held:
            gate.wait(torch.Size([1]))  # (its ring has posted nothing yet)
        else:
            first = [True]

            def held_at_first(*args, **kwargs):  # (the student's block_attention, held before its first call)
                if first[0]:
                    first[0] = False
                    gate.wait(torch.Size([1]))
                return theirs(*args, **kwargs)

            names["block_attention"] = held_at_first
        yield
    finally:
        names["block_attention"] = theirs
        gate.close()
