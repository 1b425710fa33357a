"""``disttrain-lab bench prefetch`` (lab 14: the lab's ``sharded_step`` with and without prefetching the next layer's
all-gather, against torch's ``fully_shard``, on an emulated link and a stand-in accelerator).

- bench.format_prefetch_table: the sizes, the link and the models of time in its first line, every version's line.
- bench.model_seconds: the cost model's step, without prefetch every gather and compute in turn, with it only the
  first gather and the last reduce-scatter exposed while a layer's compute covers its gather.
- bench.bench_prefetch runs torch's two versions with no lab function at all and says why it could not measure
  the lab's; with a sharded_step written here (the exercise's schedule), prefetch is faster than no prefetch.
- ``disttrain-lab bench prefetch`` with tiny options, the function taken from lab 14's solution notebook: every
  version measured.
"""

from __future__ import annotations

import pytest

from disttrain_lab import bench
from disttrain_lab.bench import prefetch
from disttrain_lab.network import Network
from tests import benchreport
from tests.labs.test_lab14_prefetch import honest


def test_format_prefetch_table():
    common = {
        "part": "prefetch",
        "world_size": 2,
        "device": "cpu",
        "size": {"layers": 3, "width": 64, "rows": 4, "unit": 0.002, "gbit": 1.0},
        "repeats": 3,
    }
    rows = [
        {
            **common,
            "version": prefetch.LAB_PREFETCH,
            "ms": 30.0,
            "ratio": 1.5,
            "compute_ms": 18.0,
            "exposed_ms": 12.0,
            "model_ms": 20.0,
        },
        {
            **common,
            "version": prefetch.TORCH_FULLY_SHARD,
            "ms": 50.0,
            "ratio": 0.9,
            "compute_ms": 18.0,
            "exposed_ms": 32.0,
        },
        {**common, "version": prefetch.LAB_NO_PREFETCH, "error": "LookupError: the notebook defines no sharded_step"},
    ]
    lines = bench.format_prefetch_table(rows).splitlines()
    assert lines[0].startswith("prefetch on 2 ranks, cpu, an emulated 1 Gbit/s link (3 layers of 64 x 64, 4 rows"), (
        lines[0]
    )
    assert "a layer's forward 2 ms, its backward twice that" in lines[0] and "median of 3, slowest rank" in lines[0]
    assert lines[1].split() == ["version", "ms", "ratio", "compute", "exposed", "model"], lines[1]
    assert lines[2].split()[-5:] == ["30.0", "1.50x", "18.0", "12.0", "20.0"], lines[2]
    assert lines[3].split()[-5:] == ["50.0", "0.90x", "18.0", "32.0", "—"], lines[3]
    assert lines[4].endswith("not measured: LookupError: the notebook defines no sharded_step"), lines[4]


def test_the_cost_model():
    size = {"layers": 4, "width": 100, "rows": 2, "unit": 0.01, "gbit": 1.0}
    link = Network.gbit(1.0)
    t_g = link.collective_time("all_gather", 4 * (100 * 100 + 100), 2)
    assert prefetch.model_seconds(size, link, 2, False) == pytest.approx(4 * (t_g + 0.01) + 4 * (2 * t_g + 0.02))
    assert prefetch.model_seconds(size, link, 2, True) == pytest.approx(t_g + 4 * 0.01 + 4 * 0.02 + t_g)  # hidden
    slow = Network.gbit(0.005)  # a gather longer than a layer's compute: the link sets the pace
    t_slow = slow.collective_time("all_gather", 4 * (100 * 100 + 100), 2)
    assert t_slow > 0.02
    assert prefetch.model_seconds(size, slow, 2, True) == pytest.approx(t_slow + 4 * t_slow + 4 * 2 * t_slow + t_slow)


def test_torch_alone_then_a_sharded_step():
    kwargs = dict(world_size=2, layers=3, width=64, unit=0.004, repeats=3)
    rows = {r["version"]: r for r in bench.bench_prefetch({}, **kwargs)}
    assert list(rows) == list(prefetch.VERSIONS)
    for name in (prefetch.LAB_NO_PREFETCH, prefetch.LAB_PREFETCH):
        assert rows[name]["error"] == "LookupError: the notebook defines no sharded_step", rows[name]
    for name in (prefetch.TORCH_FULLY_SHARD, prefetch.TORCH_FULLY_SHARD_PREFETCH):
        assert rows[name]["ms"] > rows[name]["compute_ms"] == 36.0 and "ratio" not in rows[name], rows[name]
    rows = {r["version"]: r for r in bench.bench_prefetch({"sharded_step": honest}, **kwargs)}
    assert all("error" not in r for r in rows.values()), rows
    assert rows[prefetch.LAB_NO_PREFETCH]["ratio"] == 1.0
    # (a 3-layer step over 1 Gbit/s: each 16.6 KB gather takes 0.13 ms, so prefetch's gain here is small; the
    # ratio's direction is the cost model's, and rows report what was measured)
    assert rows[prefetch.LAB_PREFETCH]["model_ms"] < rows[prefetch.LAB_NO_PREFETCH]["model_ms"]


@pytest.mark.slow
@pytest.mark.bench_report
def test_cli_bench_prefetch_with_tiny_options():
    args = ["--world-size", "2", "--layers", "3", "--width", "64", "--unit", "0.002", "--repeats", "1"]
    out = benchreport.quick_report().printed_by("prefetch", args)  # (bench all --quick's run of it)
    assert "prefetch from solutions/14_schedules/14_schedules.ipynb\n" in out, out
    assert "not measured" not in out, out
    for version in prefetch.VERSIONS:
        assert any(line.startswith(f"  {version} ") for line in out.splitlines()), (version, out)
