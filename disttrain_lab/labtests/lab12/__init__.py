"""Lab 12's graded tests (running a training job): reading a merged profiler trace (part 1,
:mod:`.traces`), and a training state checkpointed on one grid and resumed on another (part 2:
:mod:`.mlp` the training, :mod:`.checkpoint_files` a checkpoint's files read as data,
:mod:`.checkpoint` the checks), and a job that survives a rank the grader kills (part 3, :mod:`.restart`).

This package is installed with the kit, so nothing here may let a student's code find a graded
answer: the hidden cases draw their trace, or their training's seed, in the grader kernel at grading
time, and what crosses to the student's ranks is only the input its exercise names.
"""

from __future__ import annotations

from .checkpoint import CHECKPOINT, TOLERANCE_RESHARD, check_load, check_save, grader_checkpoint
from .checkpoint_files import CheckpointUnreadable, read_checkpoint
from .mlp import (
    HIDDEN,
    LAYOUTS,
    RANKS,
    WIDE,
    Training,
    full_parameters,
    reference,
    reference_parameters,
    train_step,
    training,
)
from .restart import check_restart, driver_for_restart
from .traces import COLLECTIVES, built_trace, check_exposed_communication, check_overlap_fraction, check_stragglers

__all__ = [
    "CHECKPOINT",
    "HIDDEN",
    "WIDE",
    "check_restart",
    "driver_for_restart",
    "COLLECTIVES",
    "LAYOUTS",
    "RANKS",
    "TOLERANCE_RESHARD",
    "CheckpointUnreadable",
    "Training",
    "built_trace",
    "check_exposed_communication",
    "check_load",
    "check_overlap_fraction",
    "check_save",
    "check_stragglers",
    "full_parameters",
    "grader_checkpoint",
    "read_checkpoint",
    "reference",
    "reference_parameters",
    "train_step",
    "training",
]
