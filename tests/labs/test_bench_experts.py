"""``disttrain-lab bench experts`` (lab 11: the expert-parallel MoE against the all-gather dispatch
and the dense MoE in one process).

- bench.format_experts_table: the sizes, the baseline of the ratios (the all-gather dispatch), every
  version's line.
- bench.bench_experts refuses, before it launches, versions without the lab's MoE and experts that
  the ranks cannot share evenly.
- ``disttrain-lab bench experts`` with tiny options, the functions taken from lab 11's solution
  notebook (its given MoE among them): every version measured.
- ``--device``: auto (the default), cpu, cuda, nothing else; the run says which it chose and why.
"""

from __future__ import annotations

import argparse

import pytest

from disttrain_lab import bench
from tests import benchreport


def test_format_experts_table():
    common = {
        "part": "experts",
        "world_size": 2,
        "device": "cpu",
        "size": {"tokens": 16, "d": 8, "n_experts": 2, "k": 2, "capacity_factor": 1.25},
        "repeats": 3,
        "baseline": bench.ALL_GATHER_DISPATCH,
        "counted": bench.SENT_ON_THE_WIRE,
    }
    rows = [
        {**common, "version": "ExpertParallelMoE", "ms": 2.0, "bytes": 2048, "ratio": 2.0},
        {**common, "version": bench.ONE_PROCESS_MOE, "ms": 1.0, "bytes": 0, "ratio": 4.0},
        {**common, "version": bench.ALL_GATHER_DISPATCH, "ms": 4.0, "bytes": 4096, "ratio": 1.0},
    ]
    table = bench.format_experts_table(rows)
    lines = table.splitlines()
    assert lines[0].startswith("experts on 2 ranks, cpu (tokens 16, d 8, n_experts 2, k 2, capacity_factor 1.25)")
    assert "median of 3, slowest rank" in lines[0] and "ratio: all-gather dispatch's time / this one's" in lines[0]
    assert f"bytes: what rank 0 sent per step ({bench.SENT_ON_THE_WIRE})" in lines[0], table
    assert lines[1].split() == ["version", "ms", "bytes", "ratio"], table
    assert len(lines) == 5, table
    assert "ExpertParallelMoE" in lines[2] and "2.0 KiB" in lines[2] and lines[2].endswith("2.00x"), table
    assert bench.ONE_PROCESS_MOE in lines[3] and lines[3].endswith("4.00x"), table
    assert bench.ALL_GATHER_DISPATCH in lines[4] and "4.0 KiB" in lines[4] and lines[4].endswith("1.00x"), table


def test_bench_experts_checks_its_arguments():
    with pytest.raises(ValueError, match="no MoE"):
        bench.bench_experts({"ExpertParallelMoE": object}, world_size=2)
    with pytest.raises(ValueError, match="n_experts=3 is not divisible by world_size=2"):
        bench.bench_experts({"MoE": object}, world_size=2, n_experts=3)


@pytest.mark.slow
@pytest.mark.bench_report
def test_cli_bench_experts_with_tiny_options():
    args = ["--world-size", "2", "--tokens", "16", "--d", "8", "--experts", "2", "--repeats", "1"]
    out = benchreport.quick_report().printed_by("experts", args)  # (bench all --quick's run of it)
    assert "MoE layers from solutions/11_expert_parallel/11_expert_parallel.ipynb\n" in out, out  # all three found
    for line in ("ExpertParallelMoE", bench.ALL_GATHER_DISPATCH, bench.ONE_PROCESS_MOE):
        assert f"  {line} " in out, out
    assert "not measured" not in out and "ratio: all-gather dispatch's time / this one's" in out, out
    if "device: cpu" in out:  # --device auto on a machine without a GPU per rank
        assert "device: cpu (auto: " in out and "experts on 2 ranks, cpu (tokens 16, d 8, n_experts 2" in out, out


def test_bench_experts_picks_its_device(capsys):
    from disttrain_lab.bench import command, experts

    parser = argparse.ArgumentParser()
    experts.add_arguments(parser)
    assert parser.parse_args([]).device == "auto" and parser.parse_args(["--device", "cuda"]).device == "cuda"
    with pytest.raises(SystemExit):
        parser.parse_args(["--device", "tpu"])
    assert "invalid choice: 'tpu'" in capsys.readouterr().err
    # auto on more ranks than any machine's GPUs: the CPU, and the run says why (pick_device: test_bench_sequence.py)
    assert command.chosen_device(parser.parse_args(["--world-size", "10000"])) == "cpu"
    said = capsys.readouterr().out
    assert said.startswith("device: cpu (auto: ") and said.endswith(" GPU(s) visible for 10000 ranks)\n"), said
