"""Lab 7's graded tests (gradient compression): each check runs the student's functions on ranks with
``exercise.run`` (by name, or in a *driver*: a function of ``ranks`` whose source is sent to the student's
kernel and defined there among the notebook's names), and compares what came back with references
computed here: the top-k of the same data, sums in rank order, quantization bounds, DDP training with
torch's own all-reduce or ``powerSGD_hook``.  The data the sparse and INT8 all-reduces sent is read
from the wire (``common._data_sent``: the payload of each gloo send, from the grader's capture), and
each rank's top-k values and indices must reach every other rank (``carried.assert_carried``); the
hooks' bytes (exercises 5 and 6: DDP's own traffic rides beside them), and at density 1 each rank's
gradient entries among what it sent, come from the same capture (the ranks' trace in the student's own
kernel).

A later exercise is graded on the student's earlier piece only when that piece passed its graded cell
(``GRADED_PASSED``), else on the grader's own (in the graded cell's hidden tests: nothing here is a
solution), so that one mistake costs one exercise's points.  A driver uses only the notebook's names
(the student's functions, ``torch``, ``dist``, ``models``, ``checks``, ``math``, ``F``,
``DistributedDataParallel`` of the setup cell) and imports what it needs of this module inside its body."""

from __future__ import annotations

from ..common import standing_in
from .common import GRADED_PASSED, TIMEOUT, _bytes_sent
from .hooks import check_hook_exact, check_powersgd, check_training, hook_driver
from .quantized import check_quantize, check_quantized_all_reduce
from .ranks import compress_steps, hook_namespaces, train_watched
from .sparse import (
    check_density_error,
    check_error_feedback,
    check_feedback_afresh,
    check_sparse_all_reduce,
    check_topk,
    feedback_driver,
)

__all__ = [
    "GRADED_PASSED",
    "check_density_error",
    "check_error_feedback",
    "check_feedback_afresh",
    "check_hook_exact",
    "check_powersgd",
    "check_quantize",
    "check_quantized_all_reduce",
    "check_sparse_all_reduce",
    "check_topk",
    "check_training",
    "feedback_driver",
    "hook_driver",
]
