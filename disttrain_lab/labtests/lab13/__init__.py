"""Lab 13's graded tests (FP8 training): each check runs the student's functions with ``exercise.run`` (by
name, or in a *driver* of ``ranks``, whose source is sent to the student's kernel and defined there among
the notebook's names) and compares what came back with torchao's FP8 recipe (``torchao.float8``, imported in
the grader's kernel only): its casts, bit for bit; its ``Float8Linear``, to float32 rounding.  What
``fp8_all_gather`` sent is read from the grader's capture of the wire (``carried``).

A later exercise is graded on the student's ``quantize`` only when that passed its graded cell
(``GRADED_PASSED``), else on the grader's own (in the graded cell's hidden tests), so that one mistake
costs one exercise's points."""

from __future__ import annotations

from ..common import standing_in
from .common import E4M3, E5M2, GRADED_PASSED, TIMEOUT
from .gather import check_fp8_all_gather
from .linear import check_linear, linear_driver
from .ranks import linear_case
from .scaling import check_block_error, check_delayed, check_quantize, sample

__all__ = [
    "E4M3",
    "E5M2",
    "GRADED_PASSED",
    "TIMEOUT",
    "check_block_error",
    "check_delayed",
    "check_fp8_all_gather",
    "check_linear",
    "check_quantize",
    "linear_case",
    "linear_driver",
    "sample",
    "standing_in",
]
