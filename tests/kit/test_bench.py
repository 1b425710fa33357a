"""The benchmarks' own machinery (disttrain_lab/bench/), without a lab: the tables they print
and the arguments they refuse.

A benchmark that measures a lab's functions is tested in that lab's file (tests/labs/test_labNN.py),
on the solution notebook's own functions: the package holds no solutions, so only the lab's test
knows what to measure.
"""

from __future__ import annotations

import pytest

from disttrain_lab import bench


def test_format_ddp_table():
    rows = [
        {"version": name, "world_size": 2, "steps_per_s": s, "repeats": 5, "parameters": 8_400_000, "ratio": s / 4.0}
        for name, s in (("bucketed", 3.8), (bench.TORCH_DDP, 4.0))
    ]
    table = bench.format_ddp_table(rows)
    assert "training steps/s on 2 ranks, MLP of 8.4 M parameters, median of 5" in table
    assert "0.95x" in table and "1.00x" in table


def test_bench_ddp_rejects_one_rank():
    with pytest.raises(ValueError, match="world_size >= 2"):
        bench.bench_ddp({}, world_size=1)


def test_format_pipeline_table():
    rows = [
        {
            "version": "naive",
            "micro_batches": 1,
            "world_size": 4,
            "batch": 64,
            "repeats": 5,
            "cost": 5e-4,
            "ideal": 1.0,
            "steps_per_s": 2.5,
            "speedup": 1.0,
        },
        {
            "version": f"{bench.TORCH_PIPELINE} m=4",
            "micro_batches": 4,
            "world_size": 4,
            "batch": 64,
            "repeats": 5,
            "cost": 5e-4,
            "ideal": 16 / 7,
            "error": "RuntimeError: no",
        },
    ]
    table = bench.format_pipeline_table(rows)
    assert "4 stages, batch 64, simulated accelerator 0.5 ms/sample" in table
    assert "1.00x" in table and "not measured: RuntimeError: no" in table


def test_bench_pipeline_rejects_one_stage():
    with pytest.raises(ValueError, match="world_size >= 2"):
        bench.bench_pipeline({}, None, None, world_size=1)


def test_format_tp_table():
    rows = [
        {
            "version": name,
            "world_size": 2,
            "batch": 64,
            "sizes": (8, 32, 8),
            "repeats": 5,
            "ms_per_step": ms,
            "bytes_per_step": 4096,
            "calls_per_step": 2,
            "counted": bench.SENT_ON_THE_WIRE,
            "ratio": 4.0 / ms,
        }
        for name, ms in (("ours", 5.0), (bench.TORCH_TP, 4.0))
    ]
    rows.append({"version": "broken", "world_size": 2, "batch": 64, "sizes": (8, 32, 8), "repeats": 5, "error": "nope"})
    table = bench.format_tp_table(rows)
    assert "MLP 8 -> 32 -> 8 (0.0 M parameters), batch 64, median of 5" in table
    assert "0.80x" in table and "4.0 KiB" in table and "not measured: nope" in table
    assert f"bytes: what rank 0 sent per step ({bench.SENT_ON_THE_WIRE})" in table
