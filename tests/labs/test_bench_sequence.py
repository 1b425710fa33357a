"""``disttrain-lab bench sequence`` (lab 10: ring attention against all-gathered K/V and torch's
context_parallel, and against Ulysses on an emulated link).

- bench.format_sequence_table: the attention part (a row torch could not run says why) and the
  long-sequence rows (ring against Ulysses, the ring's time the ratio's baseline), and the ring's
  exposed communication per pass (exposed_per_pass, from one traced step).
- ``disttrain-lab bench sequence`` with tiny options, the functions taken from lab 10's solution
  notebook: every version's row, only torch's "not measured" (on the CPU, with torch's own reason).
- ``--device``: auto, cpu, cuda (command.pick_device, which bench experts shares).
"""

from __future__ import annotations

import pytest

from disttrain_lab import bench
from tests import benchreport


def test_format_sequence_table():
    size = {"seq_len": 64, "heads": 2, "dim": 8}
    rows = [
        {
            "part": "attention",
            "version": bench.ALL_GATHER_KV,
            "world_size": 2,
            "size": size,
            "repeats": 3,
            "counted": bench.SENT_ON_THE_WIRE,
            "ms": 4.0,
            "bytes": 4096,
            "baseline": bench.ALL_GATHER_KV,
            "ratio": 1.0,
        },
        {
            "part": "attention",
            "version": "ring_attention",
            "world_size": 2,
            "size": size,
            "repeats": 3,
            "counted": bench.SENT_ON_THE_WIRE,
            "ms": 2.0,
            "bytes": 8192,
            "baseline": bench.ALL_GATHER_KV,
            "ratio": 2.0,
        },
        {
            "part": "attention",
            "version": bench.TORCH_CP,
            "world_size": 2,
            "size": size,
            "repeats": 3,
            "counted": bench.SENT_ON_THE_WIRE,
            "error": "NotImplementedError: no CPU",
        },
    ]
    long = {
        "part": bench.LONG,
        "world_size": 2,
        "size": {"heads": 2, "dim": 8, "link": "10 Gbit Ethernet"},
        "repeats": 3,
        "counted": bench.SENT_ON_THE_WIRE,
    }
    rows += [
        {
            **long,
            "version": "ring_attention, S=64",
            "ms": 6.0,
            "bytes": 2048,
            "baseline": "ring_attention",
            "ratio": 1.0,
            "exposed_ms": {"forward": {"exposed": 0.5, "link": 3.4}, "backward": {"exposed": 6.4, "link": 10.1}},
        },
        {
            **long,
            "version": "ulysses_attention, S=64",
            "ms": 2.0,
            "bytes": 1024,
            "baseline": "ring_attention",
            "ratio": 3.0,
        },
    ]
    table = bench.format_sequence_table(rows)
    assert "attention on 2 ranks, cpu (seq_len 64, heads 2, dim 8)" in table, table
    assert "long sequences on 2 ranks, cpu (heads 2, dim 8, link 10 Gbit Ethernet)" in table, table
    assert "ratio: ring_attention's time / this one's" in table and "3.00x" in table, table
    assert "ratio: all-gather K/V's time / this one's" in table
    assert "ring_attention" in table and "2.00x" in table and "8.0 KiB" in table
    assert f"{bench.TORCH_CP}" in table and "not measured: NotImplementedError: no CPU" in table
    assert "experts" not in table  # lab 11's: bench experts
    assert "forward 0.5 ms exposed of 3.4 ms on the link, backward 6.4 ms exposed of 10.1 ms on the link" in table


def test_exposed_communication_per_pass():
    """One rank's trace of a ring step: its sends, receives and waits count as exposed, in the forward until the last forward block ends, then
    in the backward (whose first sends come before its first block); the link's time is the model's for
    what it sent; compute regions count for nothing."""
    from disttrain_lab.bench.sequence import exposed_per_pass
    from disttrain_lab.events import Event

    def event(op, kind, start, end, name="", network_s=None):
        meta = {} if network_s is None else {"network_s": network_s}
        return Event(rank=0, op=op, kind=kind, start=start, end=end, peer=1, bytes=8, name=name, meta=meta)

    events = [
        event("isend", "p2p", 0.0, 0.001, network_s=0.002),
        event("irecv", "p2p", 0.001, 0.0015, network_s=0.002),
        event("region", "region", 0.0015, 0.5, "block"),
        event("wait", "wait", 0.5, 0.502, "irecv"),
        event("region", "region", 0.502, 0.8, "block"),
        event("isend", "p2p", 0.81, 0.814, network_s=0.004),  # the backward's K, V, before its first block
        event("region", "region", 0.814, 1.2, "block backward"),
        event("wait", "wait", 1.2, 1.21, "isend"),
    ]
    passes = exposed_per_pass(events)
    assert passes["forward"] == pytest.approx({"exposed": 0.0035, "link": 0.002})
    assert passes["backward"] == pytest.approx({"exposed": 0.014, "link": 0.004})
    assert exposed_per_pass([]) == {p: {"exposed": 0.0, "link": 0.0} for p in ("forward", "backward")}


@pytest.mark.slow
@pytest.mark.bench_report
def test_cli_bench_sequence_with_tiny_options():
    args = ["--world-size", "2", "--seq-len", "64", "--heads", "2", "--dim", "8"]
    args += ["--repeats", "1", "--seq-lens", "32,64"]
    out = benchreport.quick_report().printed_by("sequence", args)  # (bench all --quick's run of it)
    assert "ring and Ulysses attention from solutions/10_context_parallel/10_context_parallel.ipynb\n" in out, out
    for line in ("ring_attention", bench.ALL_GATHER_KV, "ring_attention, S=32", "ulysses_attention, S=64"):
        assert f"  {line} " in out, out
    assert "ExpertParallelMoE" not in out and "experts on" not in out, out  # lab 11's: bench experts
    exposed = [line for line in out.splitlines() if "ms exposed of" in line]  # the ring's, one line a length
    assert [line.split()[1] for line in exposed] == ["S=32", "S=64"], out
    assert all(" on the link, backward " in line for line in exposed), out
    unmeasured = [line for line in out.splitlines() if "not measured" in line]
    assert all(line.strip().startswith(bench.TORCH_CP) for line in unmeasured), out  # only torch's, where it cannot run
    if "device: cpu" in out:  # --device auto on a machine without a GPU per rank: torch's says why, from torch itself
        assert "device: cpu (auto: " in out and "attention on 2 ranks, cpu" in out, out
        assert unmeasured and "aten._scaled_dot_product_flash_attention_for_cpu" in unmeasured[0], out
        assert "NotImplementedError" in unmeasured[0], out


def test_bench_sequence_picks_its_device():
    from disttrain_lab.bench.command import pick_device  # sequence's --device, and experts'

    assert pick_device("cpu", 4) == ("cpu", "asked") and pick_device("cuda", 2) == ("cuda", "asked")
    chosen, why = pick_device("auto", 10_000)  # more ranks than any machine's GPUs: the CPU
    assert chosen == "cpu" and why.startswith("auto: ") and "for 10000 ranks" in why
    with pytest.raises(ValueError, match="auto"):
        pick_device("tpu", 2)
