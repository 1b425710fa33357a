"""Lab 14's grader side (pipeline schedules beyond 1F1B: interleaved 1F1B, zero bubble, ZB-V, DualPipeV; and the
prefetch of a sharded model's all-gathers).

Its reference (``orders``: schedules as per-rank orders of F, B, I and W actions, torch's own orders
read from ``torch.distributed.pipelining.schedules``, a simulator that times an order (makespan, bubble) and
refuses one that deadlocks, and the activations a rank holds); the graded checks of the two exercises that
write an order (``schedule``: ``interleaved_order``, ``zb_h1_order``, against torch's); and the check of an
order run on ranks from the grader's capture of the wire (``wireorder``: each message named by its value, then
placed in time); exercise 3's split backward against torch's ``backward()``
(``split``: ``backward_input``, ``backward_weight``) and the graded predictions of a schedule's bubble and of the
activations a rank holds (``predictions``, against the simulator on torch's order); exercise 2's ``run_order`` run
on real ranks (``running``: gradients and loss against one process, the order on the grader's capture of the wire);
exercise 5's ``sharded_step``, an FSDP-style step that prefetches the next layer's all-gather (``prefetch``: gradients
and losses against one process, the overlap at the grader's two holds on its capture of the wire).
"""

from __future__ import annotations

from .orders import (
    DEFAULT_COSTS,
    KINDS,
    PLACEMENTS,
    SCHEDULES,
    Action,
    Simulated,
    bubble_formula,
    check_order,
    gpipe_order,
    held,
    one_f_one_b_order,
    rank_and_chunk,
    simulate,
    stage_of,
    torch_order,
    torch_pipeline_order,
)
from .predictions import check_bubble_prediction, check_held_prediction
from .prefetch import check_sharded_step
from .running import check_run_order
from .schedule import (
    SHOWN_INTERLEAVED,
    SHOWN_ZB_H1,
    check_interleaved_order,
    check_zb_h1_order,
    compare_order,
    parse_order,
    self_check_interleaved_order,
    self_check_zb_h1_order,
)
from .split import SHOWN_SPLIT, check_split_backward, self_check_split_backward
from .wireorder import (
    Expected,
    Junk,
    Name,
    Seen,
    check_order_on_wire,
    named_messages,
    needed_by,
    reference_messages,
    sent_by,
)

__all__ = [
    "check_run_order",
    "check_sharded_step",
    "Name",
    "Expected",
    "Seen",
    "Junk",
    "reference_messages",
    "sent_by",
    "needed_by",
    "named_messages",
    "check_order_on_wire",
    "SHOWN_SPLIT",
    "check_bubble_prediction",
    "check_held_prediction",
    "check_split_backward",
    "self_check_split_backward",
    "DEFAULT_COSTS",
    "KINDS",
    "PLACEMENTS",
    "SCHEDULES",
    "SHOWN_INTERLEAVED",
    "SHOWN_ZB_H1",
    "Action",
    "Simulated",
    "bubble_formula",
    "check_interleaved_order",
    "check_order",
    "check_zb_h1_order",
    "compare_order",
    "gpipe_order",
    "held",
    "one_f_one_b_order",
    "parse_order",
    "rank_and_chunk",
    "self_check_interleaved_order",
    "self_check_zb_h1_order",
    "simulate",
    "stage_of",
    "torch_order",
    "torch_pipeline_order",
]
