"""The benchmarks that measure (``disttrain-lab bench NAME``), in the order of the labs: a new benchmark
is one more line here.  ``bench all`` (report.py) runs each of them."""

from __future__ import annotations

from . import (
    allreduce,
    checkpoint,
    compression,
    ddp,
    experts,
    launch,
    memory,
    pipeline,
    prefetch,
    schedules,
    sequence,
    three_d,
    tp,
    trace_overhead,
    zero,
)

MEASUREMENTS = (
    launch,
    trace_overhead,
    allreduce,
    ddp,
    zero,
    pipeline,
    tp,
    compression,
    three_d,
    memory,
    sequence,
    experts,
    checkpoint,
    schedules,
    prefetch,
)
