"""Lab 6's graded tests (tensor parallelism): each check runs the student's classes on ranks in a
*driver* (a function of ``ranks`` whose source ``exercise.run`` sends to the student's kernel, where it is
defined among the notebook's names, builds and calls the notebook's classes, and returns data),
compares every rank's tensors with one process running the dense layer or MLP, and reads the
collective calls the ranks made: how many all-reduces, of how many bytes, over which group.  Under grading
they come from the grader's capture of the wire (each message's connection, its process group's own, and its
slot, its call: ``reading._wire_calls``); in the student's own kernel, where there is none, from the ranks'
trace, phase by phase of the driver.

A driver uses only the notebook's names (the student's classes, and ``dist``, ``nn``, ``checks``,
``models`` of the setup cell) and imports what it needs of this module inside its body.  Nothing here is a
solution: train_2d's fallback (the grader's own TensorParallelMLP, used where exercise 3 fails)
stays in the graded cell's hidden tests, as do the predictions' cost models."""

from __future__ import annotations

from .checks import (
    check_2d,
    check_f_and_g,
    check_groups_not_divisible,
    check_linear_not_divisible,
    check_mlp_not_divisible,
    check_parallel_linear,
    check_tp_mlp,
    train_2d_driver,
)
from .common import GRADED_PASSED, TIMEOUT
from .held import check_slices_held
from .ranks import (
    batches_2d,
    chunk,
    next_phase,
    parameter_bytes,
    parameters_of,
    storage_bytes,
    tp_group,
    trained_2d_with,
)

__all__ = [
    "GRADED_PASSED",
    "check_2d",
    "check_f_and_g",
    "check_groups_not_divisible",
    "check_linear_not_divisible",
    "check_mlp_not_divisible",
    "check_parallel_linear",
    "check_slices_held",
    "check_tp_mlp",
    "train_2d_driver",
]
