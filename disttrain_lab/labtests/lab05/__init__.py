"""Lab 5's graded tests (pipeline parallelism): each check runs the student's step function on p
ranks with ``dl.exercise.run``, through a driver that trains this rank's stage of an MLP and
returns data only (its parameters, the losses, the F/B regions it timed), then checks, outside
the ranks, the messages (one activation to the next stage and one gradient to the previous per
micro-batch, as the operating system counted their bytes), the schedule's order from when the data
crossed each link (the grader's packet capture), and the parameters and loss against one process;
the bubble checks measure the idle fraction of a step on a simulated accelerator against
(p − 1)/(m + p − 1), the step timed on the wire too.

Not here: the grader's own forward_microbatch / backward_microbatch, on which 1F1B is graded when
the student's GPipe fails (the graded cell's hidden tests hold them and hand them to
:func:`driver_for_1f1b`), the best split of a hidden case, and the predictions' cost models.
"""

from __future__ import annotations

from .bubble import (
    BUBBLE_ABOVE,
    BUBBLE_BELOW,
    BUBBLE_COST,
    BUBBLE_TRIES,
    check_1f1b_bubble,
    check_gpipe_bubble,
    check_naive_bubble,
)
from .split import check_split, check_split_refused
from .stages import TOLERANCE, gpipe_order, one_f_one_b_order, train
from .steps import check_1f1b, check_gpipe, check_naive, driver_for_1f1b

__all__ = [
    "BUBBLE_ABOVE",
    "BUBBLE_BELOW",
    "BUBBLE_COST",
    "BUBBLE_TRIES",
    "TOLERANCE",
    "check_1f1b",
    "check_1f1b_bubble",
    "check_gpipe",
    "check_gpipe_bubble",
    "check_naive",
    "check_naive_bubble",
    "check_split",
    "check_split_refused",
    "driver_for_1f1b",
    "gpipe_order",
    "one_f_one_b_order",
    "train",
]
