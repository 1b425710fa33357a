"""Lab 2's graded tests (all-reduce): each check runs the student's all-reduce (or one of its halves)
on ranks with ``dl.exercise.run``, compares every rank's tensor with the sum of every rank's data
computed in one process (what ``dist.all_reduce`` gives), and reads what the algorithm sent from
the operating system: the bytes on each connection, which under gloo's protocol fix how many
messages crossed and how big they were (``checks.assert_messages``), and what each message held,
from the grader's capture of the wire: a ring's partial sums, each the sum of the ranks it has
passed (``carried.assert_sums_carried``), an all-gather's chunks whole (``carried.assert_carried``).
The number of
steps comes from the grader's gate (``rounds_gate``): every rank held at each of its receives, each
step's message must have crossed by then.  That only send/recv were
called is the wire's too (``checks.assert_point_to_point``: gloo's collectives mark their messages'
slots).  The
predictions' cost model stays in the notebook's hidden tests.

One module an algorithm: ``naive`` (exercise 1), ``ring`` (2-4: the ring's reduce-scatter and
all-gather, and the ring all-reduce built on them), ``halving`` (5: halving-doubling), ``pipelined`` (6: the
pipelined ring); ``ranks``: what runs on the student's ranks (the *drivers*, whose source ``exercise.run``
sends to the student's kernel, where they call the notebook's functions by name, and the grader's
stand-ins for the ring's halves, which a driver imports there); ``common``: what the checks share (the
data a case runs on, the bytes it makes, running an all-reduce on ranks against one process, its steps)."""

from __future__ import annotations

from .common import GRADED_PASSED, HALVES
from .halving import check_halving_doubling_all_reduce, check_halving_doubling_not_a_power_of_two
from .naive import check_naive_all_reduce
from .pipelined import check_pipelined_ring_all_reduce
from .ranks import direct_all_gather, direct_reduce_scatter
from .ring import check_ring_all_gather, check_ring_all_reduce, check_ring_reduce_scatter

__all__ = [
    "GRADED_PASSED",
    "direct_all_gather",
    "direct_reduce_scatter",
    "check_halving_doubling_all_reduce",
    "check_halving_doubling_not_a_power_of_two",
    "check_naive_all_reduce",
    "check_pipelined_ring_all_reduce",
    "check_ring_all_gather",
    "check_ring_all_reduce",
    "check_ring_reduce_scatter",
]
