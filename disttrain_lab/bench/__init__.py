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

The names below are loaded from their modules when first used (PEP 562, as ``grading`` does), so
that a notebook's ``from disttrain_lab import bench`` imports only the benchmarks it runs: all of them
import torch's checkpointing and pipelining and matplotlib, about 2.5 s of CPU in every kernel.

    >>> from disttrain_lab import bench
    >>> rows = bench.bench_allreduce({"ring": ring_all_reduce}, world_size=4, sizes=[1 << 20])
    >>> print(bench.format_allreduce_table(rows))
"""

from __future__ import annotations

import importlib
import importlib.util

# What notebooks and tests use as ``bench.X``: every benchmark's functions, tables and reference names,
# and the module that defines each
_HOME = {
    "ALLREDUCE_SIZES": "allreduce",
    "TORCH_ALL_REDUCE": "allreduce",
    "bench_allreduce": "allreduce",
    "busbw_factor": "allreduce",
    "format_allreduce_table": "allreduce",
    "bench_saves": "checkpoint",
    "format_checkpoint_table": "checkpoint",
    "progress": "command",
    "COMPRESSION_MODEL": "compression",
    "TORCH_DENSE": "compression",
    "TORCH_FP16": "compression",
    "TORCH_POWERSGD": "compression",
    "bench_compression": "compression",
    "format_compression_table": "compression",
    "DDP_MODEL": "ddp",
    "TORCH_DDP": "ddp",
    "bench_ddp": "ddp",
    "format_ddp_table": "ddp",
    "ALL_GATHER_DISPATCH": "experts",
    "ONE_PROCESS_MOE": "experts",
    "bench_experts": "experts",
    "format_experts_table": "experts",
    "bench_launch": "launch",
    "format_launch_table": "launch",
    "time_launch": "launch",
    "time_spawn": "launch",
    "time_torchrun": "launch",
    "functions_from_lab": "notebook",
    "functions_from_notebook": "notebook",
    "PIPELINE_COST": "pipeline",
    "PIPELINE_MODEL": "pipeline",
    "TORCH_PIPELINE": "pipeline",
    "bench_pipeline": "pipeline",
    "format_pipeline_table": "pipeline",
    "LAB_NO_PREFETCH": "prefetch",
    "bench_prefetch": "prefetch",
    "format_prefetch_table": "prefetch",
    "bench_recovery": "recovery",
    "MEASUREMENTS": "registry",
    "TORCH_1F1B": "schedules",
    "bench_schedules": "schedules",
    "format_schedules_table": "schedules",
    "ALL_GATHER_KV": "sequence",
    "LONG": "sequence",
    "TORCH_CP": "sequence",
    "bench_sequence": "sequence",
    "format_sequence_table": "sequence",
    "slowest_median": "stats",
    "OPS_SIZES": "timing",
    "SENT_ON_THE_WIRE": "timing",
    "free_port": "timing",
    "take_turns": "timing",
    "TORCH_TP": "tp",
    "TP_MODEL": "tp",
    "bench_tp": "tp",
    "format_tp_table": "tp",
    "bench_trace": "trace_overhead",
    "format_trace_table": "trace_overhead",
    "TORCH_FSDP": "zero",
    "TORCH_ZERO_REDUNDANCY": "zero",
    "ZERO_MODEL": "zero",
    "bench_zero": "zero",
    "format_zero_table": "zero",
}
__all__ = [*_HOME, "BENCHMARKS", "benchmarks"]


def __getattr__(name: str):
    """``bench.NAME``: the public name from its module, :data:`BENCHMARKS`, or the submodule ``NAME``."""
    if name in _HOME:
        value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    elif name == "BENCHMARKS":
        # disttrain-lab bench NAME: the module (in this package) of each benchmark, in the order of the labs
        # (registry.py: a new benchmark is one more line there), then `bench all`, which runs them all (report.py)
        value = (
            *importlib.import_module(f"{__name__}.registry").MEASUREMENTS,
            importlib.import_module(f"{__name__}.report"),
        )
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def benchmarks() -> dict:
    """``NAME -> module`` of every benchmark in :data:`BENCHMARKS`."""
    return {module.NAME: module for module in __getattr__("BENCHMARKS")}
