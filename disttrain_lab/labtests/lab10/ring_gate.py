"""Ring attention's overlap, as the grader observes it: a rank held before its ring sends anything, then held
again at its first block's computation while the wire shows its first key/value block crossing.

Ring attention overlaps each step's transfer with the block computation: the next key/value block's
``isend``/``irecv`` are posted first, the block held now is computed, and only then does the rank wait for
the transfer.  Under grading the drivers hold one rank, drawn at grading time, at the grader's gate
(``disttrain_lab.gate``) twice:

1. before its ring starts, so it posts nothing; every other rank is held as it begins its first block's
   computation (its first ``block_attention`` call).  The rank after the held one can reach its first block
   only if it computes before its first transfer is done: that transfer waits on the held rank.  A ring that
   waits for the transfer first (or receives before it computes) never reaches it while its neighbour is held;
   the grader answers the ranks it holds once every rank is held, or after ``gatekeeper.HELD_WAIT`` seconds
   with those it holds (``gate.Seen.held``), and the test fails unless all were
   (``attention._assert_reached_while_held``);
2. as it begins its own first block's computation (its first ``block_attention`` call), every other rank as it
   begins its second.  The grader answers once every rank is held and nothing more crosses (``Seen.cuts[1]``,
   on the capture's clock); until then the drawn rank computes nothing.  gloo sends a message's data only once
   its receiver has posted the receive and its sender the send, so in an overlapped ring the drawn rank's first
   key/value block (its own k and v, posted before its first block) has crossed to the next rank by then: the
   test looks for its rows in what the capture saw cross before that answer
   (``attention._assert_first_block_crossed``).  A ring that computes its block before it posts the transfer
   has sent nothing there.

In the student's own notebook no grader holds a gate: ``gated`` changes nothing, and the test reads the
ranks' trace instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ... import gate as gates

__all__ = ["HOLDS", "gated"]

HOLDS = 2  # the holds of a gated ring (the module docstring): the test's gate answers, one list per hold


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
        drawn = dist.get_rank() == held
        if drawn:
            gate.wait(torch.Size([1]))  # hold 1 (its ring has posted nothing yet)
        # the calls of block_attention held: the drawn rank's first (hold 2), each other rank's first and second
        calls, holding = [0], ((0,) if drawn else (0, 1))

        def held_at_block(*args, **kwargs):  # (the student's block_attention, held before the calls above)
            if calls[0] in holding:
                gate.wait(torch.Size([1]))
            calls[0] += 1
            return theirs(*args, **kwargs)

        names["block_attention"] = held_at_block
        yield
    finally:
        names["block_attention"] = theirs
        gate.close()
