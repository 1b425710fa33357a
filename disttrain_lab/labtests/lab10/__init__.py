"""Lab 10's graded tests (context and sequence parallelism), one module a part: ``attention`` (exercises 1-2),
``sequence`` (4-5: sequence parallelism, Ulysses; 3, the prediction, is in its graded cell); ``common``: what
they share, and :func:`describe_calls` (``..common``'s), which the self-checks use in their messages. Each
check runs the student's code with ``exercise.run``, by name or through a *driver* (a ``_..._in_rank``
function: its source is sent to the student's kernel, defined there among the notebook's names, calls the
notebook's code on every rank and returns data), compares every rank's tensors with one process (torch's
causal attention, the dense block), and reads the calls each rank made and the bytes the operating system
counted (``run.traffic``); under grading, from the grader's capture of the wire: Ulysses' and sequence
parallelism's calls, bytes and content (each message's slot names its call's kind), and the keys and values ring
attention passes round (``attention._ring_blocks_on_the_wire``); in the student's own kernel, where there is no
capture, from the ranks' trace (``run.trace``). A driver uses only the notebook's names
(the student's functions and classes, the given ``RingAttention``, ``transformer_block``, and ``torch``,
``dist``, ``dl`` of the setup cell).

Nothing here is a solution or a graded answer. The references that compute an exercise's own answer stay in
the notebook and are handed to the checks: torch's attention over a block with its log-sum-exp and the
layouts' positions (the lab's helper cell, :func:`use_references`). What only the grader holds stays in the
graded cells' hidden tests: the grader's own blocks (a driver that ring attention is graded with when exercise
1 failed: :func:`ring_driver`) and the prediction's cost model.
"""

from __future__ import annotations

from ..common import describe_calls
from .attention import (
    _ring_in_rank,
    check_block,
    check_merge,
    check_positions,
    check_positions_error,
    check_ring,
    check_ring_traffic,
    ring_driver,
)
from .common import GRADED_PASSED, TIMEOUT, use_references
from .sequence import check_sp, check_sp_error, check_ulysses, check_ulysses_error

__all__ = [
    "GRADED_PASSED",
    "TIMEOUT",
    "check_block",
    "check_merge",
    "check_positions",
    "check_positions_error",
    "check_ring",
    "check_ring_traffic",
    "check_sp",
    "check_sp_error",
    "check_ulysses",
    "check_ulysses_error",
    "describe_calls",
    "ring_driver",
    "use_references",
]
