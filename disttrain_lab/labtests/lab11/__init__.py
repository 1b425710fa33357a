"""Lab 11's graded tests (expert parallelism and the five-dimensional grid), one module a part: ``experts``
(exercises 1 and 3: the router, the expert-parallel MoE layer), ``mesh`` (5-6: ``mesh_groups``,
``memory_per_device_5d``); ``common``: what they share.  Each check runs the student's code with
``exercise.run``, by name or through a *driver* (a ``_..._in_rank`` function: its source is sent to the
student's kernel, defined there among the notebook's names, calls the notebook's code on every rank and
returns data), compares every rank's tensors with one process (the dense MoE), and reads the calls each rank
made (``run.trace``) and the bytes the operating system counted (``run.traffic``).  A driver uses only the
notebook's names (the student's functions and classes, the given ``MoE``, and ``torch``, ``dist``, ``dl`` of
the setup cell).

Nothing here is a solution or a graded answer.  The references that compute an exercise's own answer stay in
the notebook and are handed to the checks: the mesh's groups and the memory model (their graded cells,
``reference=``).  What only the grader holds stays in the graded cells' hidden tests: the grader's own router
(a driver that the expert-parallel layer is graded with when exercise 1 failed: :func:`moe_driver`), the
router's and the capacity-limited MoE's references, and the predictions' cost models.
"""

from __future__ import annotations

from .common import GRADED_PASSED, TIMEOUT
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

__all__ = [
    "GRADED_PASSED",
    "TIMEOUT",
    "check_5d",
    "check_5d_error",
    "check_expert_grid",
    "check_groups",
    "check_moe",
    "check_moe_bytes",
    "check_moe_error",
    "check_router",
    "check_router_literal",
    "every_token_to_every_expert",
    "moe_driver",
]
