"""The benchmarks' own machinery (disttrain_lab/bench/), without a lab: the tables they print
and the arguments they refuse.

A benchmark that measures a lab's functions is tested in that lab's file (tests/labs/test_labNN.py),
on the solution notebook's own functions: the package holds no solutions, so only the lab's test
knows what to measure.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

import psutil
import pytest

from disttrain_lab import bench
from tests.helpers import survivors


def test_format_ddp_table():
    rows = [
        {"version": name, "world_size": 2, "steps_per_s": s, "repeats": 5, "parameters": 8_400_000, "ratio": s / 4.0}
        for name, s in (("bucketed", 3.8), (bench.TORCH_DDP, 4.0))
    ]
    table = bench.format_ddp_table(rows)
    assert "training steps/s on 2 ranks, MLP of 8.4 M parameters, median of 5" in table
    assert "0.95x" in table and "1.00x" in table


def test_ddp_table_says_where_a_wrapper_is_below_torch_ddp_with_its_cpu():
    """#39: a wrapper below torch DDP is named with both rows' CPU per step (the figures of a quiet
    `bench ddp --world-size 4,8 --repeats 7`, 4 Dec, 8 ranks); nothing is said where every wrapper is ahead."""

    def rows(figures):
        return [
            {
                "version": name,
                "world_size": 8,
                "steps_per_s": s,
                "repeats": 7,
                "parameters": 8_400_000,
                "ratio": s / figures[-1][1],
                "cpu_s_per_step": ms / 1e3,
            }
            for name, s, ms in figures
        ]

    eight = [("naive", 2.19, 107.9), ("overlapped", 2.50, 97.6), (bench.TORCH_DDP, 2.37, 99.7)]
    table = bench.format_ddp_table(rows(eight))
    assert "CPU ms/step/rank" in table and " 107.9" in table, table
    assert "  naive: 0.92x its steps/s; CPU 107.9 ms per step against 99.7 (1.08x)" in table, table
    assert "\n  overlapped:" not in table and "below by design" in table, table
    assert "below" not in bench.format_ddp_table(rows([("overlapped", 2.5, 97.6), (bench.TORCH_DDP, 2.37, 99.7)]))


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


def test_a_launcher_that_failed_every_try_is_a_row_not_measured():
    """torchrun (or mp.spawn) that fails every try on a loaded host (gloo's mesh lost a connection in two
    fresh-clone runs) leaves its row not measured, with the ranks' own error line, and the other rows stand."""
    said = (
        "[E1206 15:10:17 ProcessGroupGloo.cpp:67] Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer\n"
        "W1206 spawn.py:165] Terminating process 28708 via signal SIGTERM\n"
        "====\ndisttrain_lab.bench.launch FAILED\n  exitcode  : 1 (pid: 29906)\n"
    )
    gist = bench.launch._gist(said)
    assert gist.startswith("[E1206 15:10:17 ProcessGroupGloo.cpp:67] Gloo connectFullMesh failed"), gist
    assert "Terminating" not in gist and "exitcode" not in gist, gist  # (the launchers' own lines)

    def fails(*_):
        raise RuntimeError(f"torchrun exited with 1 (3 tries): {gist}")

    why = bench.launch._or_why(fails, None, 2, 1)
    rows = [
        {"method": "dl.launch warm", "world_size": 2, "median_s": 0.008, "mean_s": 0.009, "repeats": 20},
        {"method": "torchrun --standalone", "world_size": 2, "error": why},
    ]
    table = bench.format_launch_table(rows)
    assert "torchrun --standalone      2 not measured: torchrun exited with 1 (3 tries): [E1206" in table, table
    assert "dl.launch warm             2      8.0ms      9.0ms  20       1.0x" in table, table
    assert bench.tables.chart(rows, "t", "median_s", "ms", x="method").series == {"ms": [("dl.launch warm", 0.008)]}


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
    assert "N = 1" not in table  # no one-rank row: nothing to say about it
    rows[0]["world_size"] = 1
    assert "(N = 1: both are the MLP's two matrix products on one rank" in bench.format_tp_table(rows)


def test_world_size_takes_one_number_or_several():
    from disttrain_lab.bench import command

    assert command.world_sizes("4") == (4,)
    assert command.world_sizes("2,4,8,4") == (2, 4, 8)  # each once, in the order given
    for bad in ("", "2,,4", "two", "0", "2,-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="number of ranks|at least 1"):
            command.world_sizes(bad)
    parser = argparse.ArgumentParser()
    command.add_world_size_argument(parser, (2,))
    assert parser.parse_args([]).world_size == (2,)
    assert parser.parse_args(["--world-size", "2,4,8"]).world_size == (2, 4, 8)


def test_over_world_sizes_runs_each_and_shows_how_the_ratio_moves():
    """One measure per number of ranks, each seeing one number; the rows of all; a scaling table with
    each version's ratio per number of ranks and its change; a number of ranks that cannot be measured
    is said in its place."""
    from disttrain_lab.bench import command, tables

    seen = []

    def measure_one(args):
        seen.append(args.world_size)
        if args.world_size == 3:
            raise ValueError("heads=8 is not divisible by world_size=3")
        ratio = {2: 1.10, 4: 0.95, 8: 0.80}[args.world_size]
        rows = [
            {"version": "mine", "world_size": args.world_size, "ratio": ratio},
            {"version": "torch", "world_size": args.world_size, "ratio": 1.0},
            {"version": "broken", "world_size": args.world_size, "error": "nope"},
        ]
        return command.Measured(rows, f"table on {args.world_size}", [tables.Chart(f"on {args.world_size}", "y", {})])

    args = argparse.Namespace(world_size=(2, 3, 4, 8), repeats=1)
    measured = command.over_world_sizes(args, measure_one)
    assert seen == [2, 3, 4, 8] and args.world_size == (2, 3, 4, 8)
    assert [r["world_size"] for r in measured.rows] == [2, 2, 2, 4, 4, 4, 8, 8, 8]
    table = measured.table
    for words in ("table on 2", "table on 4", "table on 8", "on 3 ranks: not measured: heads=8 is not divisible"):
        assert words in table, table
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("scaling:"))
    assert "on 2, 4, 8 ranks" in lines[start] and "from 2 to 8" in lines[start], lines[start]
    assert lines[start + 1].split() == ["version", "2", "ranks", "4", "ranks", "8", "ranks", "change"]
    assert lines[start + 2].split() == ["mine", "1.10x", "0.95x", "0.80x", "-0.30"]
    assert lines[start + 3].split() == ["torch", "1.00x", "1.00x", "1.00x", "+0.00"]
    assert not any("broken" in line for line in lines[start:])
    scaling = measured.charts[-1]
    assert scaling.xlabel == "ranks" and scaling.series["mine"] == [(2, 1.10), (4, 0.95), (8, 0.80)]
    assert [c.title for c in measured.charts[:-1]] == ["on 2", "on 4", "on 8"]
    # one number: that run as it is; none measurable: its error
    assert command.over_world_sizes(argparse.Namespace(world_size=(4,)), measure_one).table == "table on 4"
    with pytest.raises(ValueError, match="world_size=3"):
        command.over_world_sizes(argparse.Namespace(world_size=(3,)), measure_one)
    with pytest.raises(command.NotMeasured, match="on 3 ranks"):
        command.over_world_sizes(argparse.Namespace(world_size=(3, 3)), measure_one)


AGENT = r"""
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # an agent too stuck to stop its workers
for _ in range(2):  # workers in sessions of their own, as torchrun starts them, holding the agent's output
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "--torchrun-child", sys.argv[1]],
                     start_new_session=True)
print("started", flush=True)
time.sleep(600)
"""


def test_a_hung_torchrun_job_is_stopped_with_its_workers(tmp_path, monkeypatch):
    """bench checkpoint's torchrun rows: a job past its limit is stopped, the agent and the workers it
    started in sessions of their own (left running, they held the agent's output and the bench hung)."""
    from disttrain_lab.bench import recovery

    monkeypatch.setattr(recovery, "STOP_WAIT_S", 1)  # (this agent ignores SIGTERM: it is killed after it)
    out = tmp_path / "agent.out"
    with open(out, "w") as log:
        agent = subprocess.Popen([sys.executable, "-c", AGENT, str(tmp_path)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "started" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = [p for p in psutil.pids() if f"--torchrun-child {tmp_path}" in " ".join(_cmdline(p))]
    assert len(workers) == 2, out.read_text()
    recovery._stop_job(agent, str(tmp_path))
    assert agent.returncode == -signal.SIGKILL
    assert survivors(workers) == [], "the job's workers must be stopped with its agent"


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def test_a_row_below_torch_says_whether_the_gap_is_within_this_runs_noise():
    """bench zero and checkpoint: a row under its baseline carries both rows' spread over their repeats (median
    absolute deviation / median) and says whether the gap is within their sum or beyond it."""
    assert bench.stats.spread([1.0]) == 0.0
    assert bench.stats.spread([1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.2]) == pytest.approx(0.05)
    assert bench.stats.slowest_samples([[1.0, 3.0], [2.0, 1.0]]) == [2.0, 3.0]
    held = {k: 1 for k in ("total", "parameters", "gradients", "optimizer_state", "other")}
    row = {"stage": 1, "world_size": 2, "parameters": 10, "repeats": 7, "held": held, "sent": 1, "counted": "x"}
    rows = [
        {**row, "version": bench.TORCH_ZERO_REDUNDANCY, "steps_per_s": 1.0, "ratio": 1.0, "spread": 0.03},
        {**row, "version": "Zero1Optimizer", "steps_per_s": 0.97, "ratio": 0.97, "spread": 0.02},
        {**row, "version": "Zero2Optimizer", "steps_per_s": 0.9, "ratio": 0.9, "spread": 0.01, "stage": 2},
        {**row, "version": "Zero3Module", "steps_per_s": 2.0, "ratio": 2.0, "spread": 0.5, "stage": 3},
        {**row, "version": bench.TORCH_FSDP, "steps_per_s": 1.0, "ratio": 1.0, "spread": 0.5, "stage": 3},
    ]
    for r in rows:
        r["reference"] = bench.TORCH_FSDP if r["stage"] == 3 else bench.TORCH_ZERO_REDUNDANCY
    lines = bench.format_zero_table(rows).splitlines()
    noise = lines[lines.index(next(x for x in lines if x.startswith("below its baseline"))) :]
    assert "over 7 repeats" in noise[0], lines
    assert noise[1:] == [
        f"  Zero1Optimizer: 0.97x {bench.TORCH_ZERO_REDUNDANCY}; spreads 2.0 % and 3.0 %: within the noise (±5.0 %)",
        f"  Zero2Optimizer: 0.90x {bench.TORCH_ZERO_REDUNDANCY}; spreads 1.0 % and 3.0 %: beyond the noise (±4.0 %)",
    ], lines
    assert not any("below" in x for x in bench.format_zero_table(rows[3:]).splitlines()), "none below: no lines"
