"""``disttrain-lab bench schedules`` (lab 14: the lab's interleaved and zero-bubble orders, run by the lab's
``run_order`` and by torch's runtime, against torch's schedules).

- bench.format_schedules_table: the sizes and the models of time in its first line, every version's line.
- bench.bench_schedules runs torch's five schedules with no lab function at all, says which lab versions it could
  not measure and why (a function missing, an order that is not one: the simulator's refusal), and gives each
  measured order its simulated bubble and rank 0's peak (torch's 1F1B on 2 ranks, 4 micro-batches: 1/4 and 2).
- ``disttrain-lab bench schedules`` with tiny options, the functions taken from lab 14's solution notebook:
  every version measured, the lab's orders with torch's bubbles.
"""

from __future__ import annotations

import pytest

from disttrain_lab import bench
from tests import benchreport


def test_format_schedules_table():
    common = {
        "part": "schedules",
        "world_size": 2,
        "device": "cpu",
        "size": {"micro_batches": 4, "rows": 4, "d": 8, "unit": 0.002},
        "repeats": 3,
    }
    rows = [
        {
            **common,
            "version": bench.TORCH_1F1B,
            "ms": 50.0,
            "ratio": 1.0,
            "bubble": 0.25,
            "held": 2.0,
            "simulated_ms": 30.0,
        },
        {
            **common,
            "version": "lab zb_h1_order, torch's runtime",
            "error": "LookupError: the notebook defines no zb_h1_order",
        },
    ]
    lines = bench.format_schedules_table(rows).splitlines()
    assert lines[0].startswith("schedules on 2 ranks, cpu (4 micro-batches of 4 rows, 4 layers of width 8"), lines[0]
    assert "a rank's forward 2 ms a micro-batch" in lines[0] and "median of 3, slowest rank" in lines[0], lines[0]
    assert "F = I = W = 1, B = 2, messages free" in lines[0], lines[0]
    assert lines[1].split() == ["version", "ms", "ratio", "simulated", "ms", "bubble", "held"], lines[1]
    assert lines[2].split()[-5:] == ["50.0", "1.00x", "30.0", "0.250", "2.00"], lines[2]
    assert lines[3].endswith("not measured: LookupError: the notebook defines no zb_h1_order"), lines[3]


def test_torch_alone_and_lab_orders_refused():
    def not_an_order(p, v, m):  # every rank runs stage 0's forwards only
        return [[f"0F{j}" for j in range(m)] for _ in range(p)]

    rows = bench.bench_schedules(
        {"interleaved_order": not_an_order}, world_size=2, micro_batches=4, unit=0.001, d=8, repeats=1
    )
    by = {r["version"]: r for r in rows}
    assert list(by) == list(bench.schedules.VERSIONS)
    for name in (
        bench.TORCH_1F1B,
        "torch ScheduleInterleaved1F1B",
        "torch ScheduleZBVZeroBubble",
        "torch ScheduleDualPipeV",
        "torch ScheduleInterleavedZeroBubble (ZB-H1)",
    ):
        assert by[name]["ms"] > 0 and "error" not in by[name], by[name]
    assert by[bench.TORCH_1F1B]["bubble"] == 0.25 and by[bench.TORCH_1F1B]["held"] == 2.0
    assert by[bench.TORCH_1F1B]["ratio"] == 1.0
    assert by["lab interleaved_order, torch's runtime"]["error"].startswith("ValueError: "), by
    assert by["lab interleaved_order, lab run_order"]["error"] == "LookupError: the notebook defines no run_order"
    assert by["lab zb_h1_order, torch's runtime"]["error"] == "LookupError: the notebook defines no zb_h1_order"


@pytest.mark.slow
@pytest.mark.bench_report
def test_cli_bench_schedules_with_tiny_options():
    args = ["--world-size", "2", "--micro-batches", "4", "--unit", "0.002", "--d", "8", "--repeats", "1"]
    out = benchreport.quick_report().printed_by("schedules", args)  # (bench all --quick's run of it)
    assert "schedules from solutions/14_schedules/14_schedules.ipynb\n" in out, out  # all three found
    assert "not measured" not in out, out
    for version in bench.schedules.VERSIONS:
        assert any(line.startswith(f"  {version} ") for line in out.splitlines()), (version, out)
    interleaved = [line for line in out.splitlines() if "Interleaved1F1B" in line or "lab interleaved_order" in line]
    assert len({line.split()[-2] for line in interleaved}) == 1, interleaved  # the lab's order: torch's bubble
