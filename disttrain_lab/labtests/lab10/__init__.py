"""Lab 10's graded tests (context and expert parallelism), one module a part: ``attention`` (exercises 1-2),
``experts`` (4-5), ``sequence`` (6-7), ``mesh`` (8-9); ``common``: what they share. Each check runs the
student's code with ``exercise.run``, by name or through a *driver* (a ``_..._in_rank`` function: its source
is sent to the student's kernel, defined there among the notebook's names, calls the notebook's code on
every rank and returns data), compares every rank's tensors with one process (torch's causal attention, the
dense MoE, the dense block), and reads the calls each rank made (``run.trace``) and the bytes the operating
system counted (``run.traffic``). A driver uses only the notebook's names (the student's functions and
classes, the given ``RingAttention``, ``MoE``, ``transformer_block``, and ``torch``, ``dist``, ``dl`` of the
setup cell).

Nothing here is a solution or a graded answer.  The references that compute an exercise's own answer stay in
the notebook and are handed to the checks: torch's attention over a block with its log-sum-exp and the
layouts' positions (the lab's helper cell, :func:`use_references`), the mesh's groups and the memory model
(their graded cells, ``reference=``).  What only the grader holds stays in the graded cells' hidden tests:
the grader's own blocks and router (drivers that a later exercise is graded with when an earlier one failed:
:func:`ring_driver`, :func:`moe_driver`), the router's and the capacity-limited MoE's references, and the
predictions' cost models.
"""

from __future__ import annotations

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
from .common import GRADED_PASSED, TIMEOUT, _expect_value_error, describe, use_references
from .experts import (
    _moe_in_rank,
    check_moe,
    check_moe_bytes,
    check_moe_error,
    check_router,
    check_router_literal,
    every_token_to_every_expert,
    moe_driver,
)
from .mesh import check_5d, check_5d_error, check_expert_grid, check_groups
from .sequence import check_sp, check_sp_error, check_ulysses, check_ulysses_error

__all__ = [
    "GRADED_PASSED",
    "check_5d",
    "check_5d_error",
    "check_block",
    "check_expert_grid",
    "check_groups",
    "check_merge",
    "check_moe",
    "check_moe_bytes",
    "check_moe_error",
    "check_positions",
    "check_positions_error",
    "check_ring",
    "check_ring_traffic",
    "check_router",
    "check_router_literal",
    "check_sp",
    "check_sp_error",
    "check_ulysses",
    "check_ulysses_error",
    "describe",
    "every_token_to_every_expert",
    "moe_driver",
    "ring_driver",
    "use_references",
]
