"""Lab 8's graded tests (the capstone: 3D parallelism, a parallelism planner, LARS, scaling laws), one module a
section: section 2's in three, on ``ranks`` (what a rank holds and the drivers): ``grid`` (the grid, attention
and pipeline stage), ``three_d`` (``train_3d``) and ``traffic`` (what ``train_3d`` puts on the wire); then
``planner``, ``lars``, ``scaling``; ``common``: the constants, what only the grader holds, running a driver.

Section 2's checks run the student's grid, attention, pipeline stage and ``train_3d`` on ranks through
*drivers* (the ``_..._in_rank`` and ``_..._of`` functions of ``ranks`` and ``planner``: ``exercise.run``
sends a driver's source to the student's kernel, where it is defined among the notebook's names, calls the notebook's
code there and returns data), compare every rank's tensors with one process running the dense GPT,
and read the calls each rank made (under grading from the grader's capture of the wire, ``wirecalls``; in the
student's own kernel, where there is none, from the ranks' trace) and the bytes the operating system counted
(``run.traffic``).  Sections 3-5 run the student's planner, LARS and scaling-law functions on one rank
the same way.  A driver uses only the notebook's names (the student's functions and classes, the
given ``Grid``, ``ModelSpec``, ``ClusterSpec``, ``Plan``, and ``torch``, ``dist``, ``nn``, ``models``,
``checks`` of the setup cell) and imports this module's helpers inside its body.

Nothing here is a solution or a graded answer.  What only the grader holds stays in the graded
cells' hidden tests and reaches this module at run time: the grader's own grid, attention and
pipeline stage (``_graders_pieces``, put in ``GRADERS["pieces"]``) and its own memory and step-time
models (``_graders_planner``, ``GRADERS["planner"]``), on which a later exercise is graded where an
earlier one failed its graded test (``PASSED``; the step time crosses to the kernel only as a table of its
ranks for the plans of each case, ``planner._stand_ins_source``); and the exact step-time model.  The references that
compute an exercise's own answer (the memory formula, the power-law fit, the compute-optimal size,
the LARS update) are written in the notebook and handed to the checks (``reference=``).
"""

from __future__ import annotations

from .common import (
    CFG,
    GRADERS,
    LR,
    MEASURED,
    PASSED,
    SCALING_RUNS,
    TIMEOUT,
    Spec,
    as_plain,
    in_place,
    launch,
    specs_of,
)
from .grid import (
    check_attention,
    check_attention_error,
    check_grid,
    check_grid_error,
    check_stage,
    check_stage_error,
)
from .lars import check_lars, check_lars_without_grad
from .planner import (
    check_memory,
    check_plans,
    check_step_time,
    check_step_time_ranking,
    choose_planner_graders,
    plans_for,
)
from .ranks import _grid_in_rank, _stage_in_rank, communication, parameters_of
from .scaling import check_fit, check_fit_rejects, check_optimal, check_optimal_rejects
from .three_d import check_3d, check_3d_error
from .traffic import _expected_traffic

__all__ = [
    "CFG",
    "GRADERS",
    "LR",
    "MEASURED",
    "PASSED",
    "SCALING_RUNS",
    "check_3d",
    "check_3d_error",
    "check_attention",
    "check_attention_error",
    "check_fit",
    "check_fit_rejects",
    "check_grid",
    "check_grid_error",
    "check_lars",
    "check_lars_without_grad",
    "check_memory",
    "check_optimal",
    "check_optimal_rejects",
    "check_plans",
    "check_stage",
    "check_stage_error",
    "check_step_time",
    "check_step_time_ranking",
    "choose_planner_graders",
    "communication",
    "launch",
    "plans_for",
]
