"""Measurements, always side by side with torch's own in one run and reported as medians.

One module per benchmark (``disttrain-lab bench NAME``), each with ``NAME``, ``HELP``, ``QUICK`` (its
tiny settings), ``add_arguments(parser)`` and ``measure(args) -> Measured`` (rows, table, pictures),
whose table ``bench NAME`` prints; :data:`registry.MEASUREMENTS` lists them, ``bench all``
(:mod:`.report`, with a ``run(args)`` of its own) runs them all and writes a report, and the command
line is built from :data:`BENCHMARKS`. What they share is a module per idea: :mod:`.command` (a
benchmark as a command: Measured, its options, the progress bar), :mod:`.timing` (what each rank measures:
taking turns, the bytes it sent, free ports), :mod:`.stats` (the slowest rank's median, a run's noise),
:mod:`.tables` (the tables' and pictures' pieces), :mod:`.notebook` (reading a lab notebook's functions)
and :mod:`.collectives` (the all-gather baselines' GatherRows and ScatterRows). A benchmark of two ideas
keeps the second in a module of its own: :mod:`.recovery` measures ``bench checkpoint``'s recoveries
from a killed rank, and is the script its torchrun workers and torchft replicas run. The lab benchmarks
measure the implementations a lab notebook defines: this package holds no solutions (see
:func:`functions_from_notebook`).

    >>> from disttrain_lab import bench
    >>> rows = bench.bench_allreduce({"ring": ring_all_reduce}, world_size=4, sizes=[1 << 20])
    >>> print(bench.format_allreduce_table(rows))
"""

from __future__ import annotations

from . import report  # (registry.py imports every benchmark module: bench.zero, bench.tp, ...)

# What notebooks and tests use as ``bench.X``: every benchmark's functions, tables and reference names.
from .allreduce import (
    ALLREDUCE_SIZES,
    TORCH_ALL_REDUCE,
    bench_allreduce,
    busbw_factor,
    format_allreduce_table,
)
from .checkpoint import bench_saves, format_checkpoint_table
from .command import progress
from .compression import (
    COMPRESSION_MODEL,
    TORCH_DENSE,
    TORCH_FP16,
    TORCH_POWERSGD,
    bench_compression,
    format_compression_table,
)
from .ddp import DDP_MODEL, TORCH_DDP, bench_ddp, format_ddp_table
from .experts import ALL_GATHER_DISPATCH, ONE_PROCESS_MOE, bench_experts, format_experts_table
from .launch import bench_launch, format_launch_table, time_launch, time_spawn, time_torchrun
from .notebook import functions_from_lab, functions_from_notebook
from .pipeline import PIPELINE_COST, PIPELINE_MODEL, TORCH_PIPELINE, bench_pipeline, format_pipeline_table
from .prefetch import LAB_NO_PREFETCH, bench_prefetch, format_prefetch_table
from .recovery import bench_recovery
from .registry import MEASUREMENTS
from .schedules import TORCH_1F1B, bench_schedules, format_schedules_table
from .sequence import ALL_GATHER_KV, LONG, TORCH_CP, bench_sequence, format_sequence_table
from .stats import slowest_median
from .timing import OPS_SIZES, SENT_ON_THE_WIRE, free_port, take_turns
from .tp import TORCH_TP, TP_MODEL, bench_tp, format_tp_table
from .trace_overhead import bench_trace, format_trace_table
from .zero import TORCH_FSDP, TORCH_ZERO_REDUNDANCY, ZERO_MODEL, bench_zero, format_zero_table

# disttrain-lab bench NAME: the module (in this package) of each benchmark, in the order of the labs
# (registry.py: a new benchmark is one more line there), then `bench all`, which runs them all (report.py)
BENCHMARKS = (*MEASUREMENTS, report)


def benchmarks() -> dict:
    """``NAME -> module`` of every benchmark in :data:`BENCHMARKS`."""
    return {module.NAME: module for module in BENCHMARKS}
