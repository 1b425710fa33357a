"""Lab 4's graded tests (ZeRO): each check runs the student's code on ranks with
``dl.exercise.run`` through a driver that builds and trains it there and returns data only (what
a rank holds after backward, its parameters, the layers' bytes at every forward and backward),
then compares, outside the ranks, the memory with the shard the stage allows, the parameters with
the same optimizer in one process, and the collectives the ranks say they made with 2Ψ or 3Ψ.  The
grade on memory rests on :func:`check_held` (``held.py``): each rank's private memory read from the
OS by the grader while the ranks pause between two steps of a 33.6 M-parameter model; what a rank
reports of its tensors (``memory.held``) names the tensor kept whole in the messages.

The memory calculator's reference (the ZeRO formula, exercise 1's answer) is not here: the graded
cell defines it and hands it to :func:`check_zero_memory`.  Nor is the grader's own ZeRO-1 that
Zero2Optimizer is graded on when the student's failed: it sits in that cell's hidden tests and
reaches :func:`check_zero2` as a driver (:func:`zero2_driver`).

The lab's helper cell calls :func:`setup` (the device the tests' ranks use, no exercise passed yet).
"""

from __future__ import annotations

from .calculator import check_zero_memory
from .common import (
    GRADED_PASSED,
    OPTIMIZERS,
    SLACK_PER_TENSOR,
    STEPS,
    TEST_DEVICE,
    batches,
    communication_volume,
    setup,
)
from .held import check_held
from .ranks import train
from .zero import check_zero1, check_zero2, check_zero3, zero2_driver

__all__ = [
    "GRADED_PASSED",
    "OPTIMIZERS",
    "STEPS",
    "batches",
    "check_held",
    "check_zero1",
    "check_zero2",
    "check_zero3",
    "check_zero_memory",
    "communication_volume",
    "setup",
    "train",
    "zero2_driver",
]
