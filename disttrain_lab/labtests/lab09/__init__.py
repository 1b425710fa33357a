"""Lab 9's graded tests (memory).  ``checks.py``: each exercise's values (the bytes autograd saved against the
kit's count, the loss scaler against torch's ``GradScaler``, mixed precision and offloading against Adam on
fp32 master weights, recomputation's gradients against the model's own), run through drivers in the student's
kernel.  ``kept.py``: what recomputation keeps for backward, read from the OS by the grader while the rank waits
at its gate (the grade on Exercises 4 and 5's memory; the rank's own count of saved tensors and forward calls
is the student's self-check).  ``mixed.py``: what ``MixedPrecisionAdam`` holds after a backward, read at the gate
likewise (Exercise 3's memory; ``dl.memory.held`` is the self-check).  ``offload.py``: what ``OffloadAdam`` moved
over the host link and whether the gradients went while backward ran, as the grader read them at its gate (Exercise
6 under grading; the link's log and the timed saving are the self-check)."""

from __future__ import annotations

from .checks import (
    check_checkpoint,
    check_checkpoint_args,
    check_loss_scaler,
    check_mixed_precision,
    check_mode_error,
    check_offload,
    check_recompute,
    check_saved_bytes,
    check_saving,
    check_scaler_pattern,
    module_and_inputs,
    pattern_scales,
)
from .kept import SHAPE, check_kept, kept_step
from .mixed import check_mixed_held, mixed_step
from .offload import check_offload_held, check_overlap_held, held_steps

__all__ = [
    "SHAPE",
    "check_checkpoint",
    "check_checkpoint_args",
    "check_kept",
    "check_loss_scaler",
    "check_mixed_held",
    "check_mixed_precision",
    "check_mode_error",
    "check_offload",
    "check_offload_held",
    "check_overlap_held",
    "check_recompute",
    "check_saved_bytes",
    "check_saving",
    "check_scaler_pattern",
    "held_steps",
    "kept_step",
    "mixed_step",
    "module_and_inputs",
    "pattern_scales",
]
