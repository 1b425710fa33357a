"""Lab 3's graded tests (data parallelism): each check runs the student's code on ranks through
``dl.exercise.run`` with a *driver* of this module (``_shards``, ``_broadcast_in_rank``,
``_train_in_rank``: sent to the student's kernel as source, they build the student's classes by
name there and hand back plain data: parameters, the ranks' trace), then compares every rank with
a reference computed here, in one process, from the kit's own models, and reads the trace for the
rules the text states (when the all-reduces run, how many, how many bytes).

Exercises built on an earlier one (``average_gradients`` through ``NaiveDDP``, which broadcasts;
``AccumulatingDDP`` on ``BucketedDDP``) are graded on the grader's own version of the earlier one
when the student's did not pass its graded test (``GRADED_PASSED``): that grader's version is a
solution, so it is defined in the graded cell's hidden tests, never here."""

from __future__ import annotations

from .checks import (
    broadcast_that_passed,
    bucketed_ddp_that_passed,
    check_average_gradients,
    check_broadcast_parameters,
    check_bucketed_ddp,
    check_ddp,
    check_no_sync,
    check_overlapped_ddp,
    check_shard,
)
from .common import GRADED_PASSED, TOLERANCE, batches, bucket_sizes, graded_model, per_parameter

__all__ = [
    "GRADED_PASSED",
    "TOLERANCE",
    "batches",
    "broadcast_that_passed",
    "bucket_sizes",
    "bucketed_ddp_that_passed",
    "check_average_gradients",
    "check_broadcast_parameters",
    "check_bucketed_ddp",
    "check_ddp",
    "check_no_sync",
    "check_overlapped_ddp",
    "check_shard",
    "graded_model",
    "per_parameter",
]
