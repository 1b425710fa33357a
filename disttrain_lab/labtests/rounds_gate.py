"""A point-to-point algorithm's rounds, as the grader's gate observes them: every rank held at each receive.

A ring all-reduce takes N − 1 steps per half, halving-doubling 2·log2(N), when every rank sends its step's
message and receives the step's other one *at once* (the one-port model: isend, then recv).  The ranks'
trace would count the steps from their calls' times, but the ranks write it.  The wire alone cannot either:
a rank that posted its receives early and is late to its next send looks there like a rank that waited for
its data (``docs/architecture.md``, who observes what).  Under grading the grader makes the steps observable
instead, with its gate (``disttrain_lab.gate``):

- the driver wraps the rank's receives (``dist.recv``, and the ``wait()`` of what ``dist.irecv`` returns):
  at each of its first ``rounds`` waits for a message, a rank first posts the receive (gloo tells the sender
  it may send), then stops at the gate;
- the grader (``grading/gatekeeper.py``) answers a round once every rank is held at the same wait and what
  they sent each other has stopped growing (``gate.Seen.held``, ``Seen.cuts``);
- gloo sends a message's data only once its receiver has posted the receive (its ``NOTIFY_RECV_READY``,
  ``gloo_ops``), and every rank has posted its k-th receive when it is held the k-th time.  So in an
  algorithm that posts each step's send before it waits for the step's receive, every rank's k-th message
  has crossed before the grader answers round k, and this module's check finds it on the capture.  A rank
  that waits for its data before it sends (a blocking ring ordered even/odd, an exchange where one partner
  receives first) has sent one message too few when it is held: its step took two rounds.

In the student's own notebook no grader holds a gate: ``held_at_receives`` changes nothing, and the test
counts the steps from the ranks' trace instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from .. import gate as gates
from .. import trace
from ..exercise import ExerciseRun

__all__ = ["assert_rounds", "held_at_receives"]

_MODULES = (dist, distributed_c10d)


class _HeldWork:
    """What ``dist.irecv`` returns, whose first ``wait()`` stops at the gate first (the receive is posted)."""

    def __init__(self, work, hold):
        self._work, self._hold, self._waited = work, hold, False

    def wait(self, *args, **kwargs):
        if not self._waited:
            self._waited = True
            self._hold()
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def held_at_receives(names: dict, rounds: int) -> Iterator[None]:
    """Around one call of a point-to-point algorithm on this rank (see the module docstring): ``names``, the
    notebook's namespace (a ``recv`` or ``irecv`` imported from torch there is wrapped too); ``rounds``, how
    many of its waits for a message the grader holds."""
    gate = gates.connect(dist.get_rank())
    if gate is None:
        yield
        return
    recv, irecv = dist.recv, dist.irecv
    held = [0]

    def hold() -> None:
        if held[0] < rounds:
            held[0] += 1
            gate.wait(torch.Size([1]))  # (the answer, zeros, is not used: it only says "go on")

    def held_recv(tensor, src=None, group=None, tag=0, **kwargs):
        if src is None:  # (from any rank: the sender is known only once it arrives)
            return recv(tensor, src, group, tag, **kwargs)
        work = irecv(tensor, src, group, tag, **kwargs)
        hold()
        work.wait()
        return src

    def held_irecv(*args, **kwargs):
        return _HeldWork(irecv(*args, **kwargs), hold)

    # torch's functions, the kit's trace around them (in torch.distributed and its distributed_c10d alike), and
    # a name the notebook imported from either: each is the receive the rank's code may call
    ours = {"recv": held_recv, "irecv": held_irecv}
    theirs = {
        name: {id(f) for m in _MODULES for f in (m.__dict__[name], trace.genuine_of(m.__dict__[name]))} for name in ours
    }
    saved = [
        (space, name, value)
        for space in (*(m.__dict__ for m in _MODULES), names)
        for name, value in list(space.items())
        if name in ours and id(value) in theirs[name]
    ]
    try:
        gate.start()  # (a mark: every rank connected, the call about to begin)
        for space, name, _ in saved:
            space[name] = ours[name]
        yield
    finally:
        for space, name, value in saved:
            space[name] = value
        gate.close()


def assert_rounds(run: ExerciseRun, case: str, rounds: int, why: str) -> bool:
    """Fail unless, under grading, every rank was held at each of its first ``rounds`` waits for a message and,
    each time, its message of that step had crossed (the module docstring).  Returns False in the student's
    own notebook (no gate: the caller counts the trace's steps), True where the gate's evidence was checked.
    ``why``: what a step is, in the exercise's words."""
    seen = run.gate
    if seen.source == "none":
        return False
    n = run.world_size
    for k in range(rounds):
        held = set(seen.ranks_held(k))
        missing = sorted(set(range(n)) - held)
        assert not missing, (
            f"{case}: the grader held every rank as it began to wait for its message of step {k + 1} of {rounds} "
            f"({why}); rank(s) {', '.join(map(str, missing))} never waited for a message of step {k + 1} while the "
            f"others were held.  Receive each step's message with dist.recv or dist.irecv(...).wait(), once per "
            f"step."
        )
        start, cut = seen.hold_window(k)
        sent = [
            sum(len(run.timeline.sends_between(r, peer, start, cut) or ()) for peer in range(n) if peer != r)
            for r in range(n)
        ]
        late = [r for r in range(n) if sent[r] < k + 1]
        assert not late, (
            f"{case}: when every rank waited for its message of step {k + 1} of {rounds} ({why}), rank(s) "
            f"{', '.join(f'{r} had sent {sent[r]}' for r in late)} of their messages (the grader's capture of the "
            f"wire); each should have sent {k + 1}: its step's message, posted before it waits for the one it "
            f"receives.  A rank that receives before it sends makes each step two rounds: post the send with "
            f"isend, then recv."
        )
    return True
