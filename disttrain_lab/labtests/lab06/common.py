"""What every check of lab 6 shares: its constants and the data a case runs on."""

from __future__ import annotations

TIMEOUT = 60  # seconds a test's run may take
PAUSE_S = 8.0  # the memory case's longest pause; the grader ends it once it has read each rank (``held.py``)
_DEADLOCK_HINT = "do all ranks of a group make the same collective calls, in the same order?"
_F_G_PHASES = ("set-up", "f forward", "f backward", "g forward", "g backward")
_MLP_PHASES = ("building", "forward", "backward")
GRADED_PASSED: set[str] = set()  # the exercises whose graded cell passed, for the exercises built on them
STAND_IN_FOR = {  # an exercise -> the notebook's names the grader's stand-ins replace where it has not passed
    "parallel_linear": ("ColumnParallelLinear", "RowParallelLinear"),
    "f_and_g": ("CopyToTensorParallel", "ReduceFromTensorParallel"),
}
