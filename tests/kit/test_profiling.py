"""``dl.profiled`` and ``dl.merge_traces``: torch.profiler's trace of every rank, merged into one
Chrome/Perfetto trace (one process per rank, rank 0's clock, messages as flows)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

import disttrain_lab as dl
from disttrain_lab import profiling

NUMEL = 1 << 18  # 1 MiB of float32 a message
NET = dl.Network(latency=2e-3, bandwidth=1e9)


def _ring_step(numel: int) -> float:
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.full((numel,), float(r))
    with dl.region("compute"):
        y = x * 2 + 1
    send = dist.isend(y, (r + 1) % n)
    dist.recv(x, (r - 1) % n)
    send.wait()
    dist.all_reduce(x)
    return float(x[0])


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profile")
    run = dl.launch(dl.profiled(_ring_step, folder), 3, NUMEL, network=NET, trace=True)
    merged = json.loads(dl.merge_traces(folder).read_text())
    return folder, run, merged


@pytest.mark.slow  # a 3-rank profiled launch: over the fast tier's 3 s on a loaded machine
def test_one_process_per_rank_with_its_regions_and_the_kits_calls(profiled_run):
    _, run, merged = profiled_run
    assert run.results == [sum(2 * r + 1 for r in range(3))] * 3  # the function's answer, returned
    events = merged["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    slices = [e for e in events if e.get("ph") == "X"]
    for rank in range(3):
        mine = {e["name"] for e in slices if e["pid"] == rank}
        # the student's region, the kit's calls (the emulated network's time inside them), torch's ops
        assert {"compute", "dl:isend", "dl:recv", "dl:wait(isend)", "dl:all_reduce", "gloo:all_reduce"} <= mine
        assert {"aten::mul", "c10d::send", "c10d::recv_"} <= mine
    assert min(e["ts"] for e in slices) == 0  # counted from the run's first event
    # the clock pings are not the student's messages: not in the kit's trace, not drawn as flows
    assert [e.describe() for e in run.events if e.kind == "p2p" and e.tag == profiling.PING_TAG] == []
    assert {e.op for e in run.events if e.kind == "p2p"} == {"isend", "recv"}


@pytest.mark.slow
def test_each_message_is_a_flow_that_takes_the_networks_time_on_one_clock(profiled_run):
    _, _, merged = profiled_run
    offsets, errors = merged["disttrain_lab"]["clock_offset_ns"], merged["disttrain_lab"]["clock_error_ns"]
    # one host, one clock: each measured offset is within its error (half the fastest round trip) of 0
    assert offsets[0] == errors[0] == 0
    for offset, error in zip(offsets[1:], errors[1:]):
        assert 0 < error < 50e6 and abs(offset) <= error + 100_000, (offsets, errors)
    messages = sorted(profiling.messages(merged), key=lambda m: m["src"])
    assert [(m["src"], m["dst"], m["bytes"], m["tag"]) for m in messages] == [
        (r, (r + 1) % 3, 4 * NUMEL, 0) for r in range(3)
    ]
    model_us = NET.time(4 * NUMEL) * 1e6
    for m in messages:
        # received at least the link's time after it was sent, on the merged (rank 0's) clock;
        # the clocks' alignment error is the only slack
        slack = errors[m["src"]] / 1e3 + errors[m["dst"]] / 1e3
        assert m["received"] - m["sent"] >= model_us - slack, (m, model_us)
    starts = {e["id"]: e for e in merged["traceEvents"] if e.get("ph") == "s"}
    ends = [e for e in merged["traceEvents"] if e.get("ph") == "f"]
    assert len(starts) == len(ends) == 3 and {e["id"] for e in ends} == set(starts)
    for e in ends:  # each end of a flow lies inside a slice of its rank's thread, which it binds to
        assert any(
            x["pid"] == e["pid"] and x["tid"] == e["tid"] and x["ts"] <= e["ts"] <= x["ts"] + x["dur"]
            for x in merged["traceEvents"]
            if x.get("ph") == "X"
        )


@pytest.mark.slow
def test_merging_undoes_each_ranks_clock_offset(profiled_run, tmp_path):
    folder, _, merged = profiled_run
    (tmp_path / "ranks").mkdir()
    for rank in range(3):
        data = json.loads((folder / "ranks" / f"rank{rank}.json").read_text())
        if rank == 1:  # rank 1's clock 7 s ahead: its base later, its measured offset -7 s
            data["baseTimeNanoseconds"] += 7_000_000_000
            data["disttrain_lab"]["clock_offset_ns"] -= 7_000_000_000
        (tmp_path / "ranks" / f"rank{rank}.json").write_text(json.dumps(data))
    again = json.loads(dl.merge_traces(tmp_path).read_text())
    assert [e.get("ts") for e in again["traceEvents"]] == [e.get("ts") for e in merged["traceEvents"]]
    # and without the offset, rank 1's events would sit 7 s late
    data = json.loads((tmp_path / "ranks" / "rank1.json").read_text())
    data["disttrain_lab"]["clock_offset_ns"] += 7_000_000_000
    (tmp_path / "ranks" / "rank1.json").write_text(json.dumps(data))
    skewed = json.loads(dl.merge_traces(tmp_path, tmp_path / "skewed.json").read_text())
    since_epoch = lambda trace: [  # noqa: E731  (µs: each trace's times count from its first slice)
        e["ts"] + trace["baseTimeNanoseconds"] / 1e3
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e["pid"] == 1
    ]
    late, right = since_epoch(skewed), since_epoch(merged)
    # each of rank 1's slices 7 s later than where the offset put it, to the microsecond (not "more than 6.9 s after
    # the first slice": on a loaded host one of rank 1's slices began 0.15 s before the other ranks' first)
    assert len(late) == len(right) > 0 and all(abs(a - b - 7e6) <= 1 for a, b in zip(late, right)), (late, right)


def test_merging_says_what_is_wrong_with_a_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no rank traces"):
        dl.merge_traces(tmp_path)
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "rank0.json").write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="not written by dl.profiled"):
        dl.merge_traces(tmp_path)
    meta = {"rank": 1, "world_size": 2, "clock_offset_ns": 0, "clock_error_ns": 0}
    (tmp_path / "ranks" / "rank0.json").write_text(json.dumps({"traceEvents": [], "disttrain_lab": meta}))
    with pytest.raises(ValueError, match=r"ranks \[1\], expected 0..1"):
        dl.merge_traces(tmp_path)


def _rank_slices(frame, symbols) -> list[tuple[str, float]]:
    """A rank's slices as Holistic Trace Analysis read them: (name, duration in µs), sorted."""
    return sorted((symbols[i], float(d)) for i, d in zip(frame["name"], frame["dur"]))


@pytest.mark.slow  # a 4-rank profiled launch and HTA's parse
def test_a_merged_four_rank_trace_loads_in_holistic_trace_analysis(tmp_path):
    """Meta's trace reader (HTA 0.5.0, a test dependency) reads the merged file as four processes, each
    with every slice HTA reads from that rank's own torch trace, and one message's timing on one clock."""
    from hta.trace_analysis import TraceAnalysis  # (1.1 s to import, pandas and plotly: this test's alone)

    folder = tmp_path / "profile"
    dl.launch(dl.profiled(_ring_step, folder), 4, NUMEL, network=NET)
    merged_file = dl.merge_traces(folder)
    merged = TraceAnalysis(trace_files={0: str(merged_file)}, trace_dir=str(folder)).t
    per_rank = TraceAnalysis(trace_dir=str(folder / "ranks")).t
    assert sorted(per_rank.traces) == [0, 1, 2, 3]  # HTA found each rank in torch's distributedInfo
    frame = merged.traces[0]
    assert sorted(frame["pid"].unique()) == [0, 1, 2, 3]
    for rank in range(4):
        mine = _rank_slices(frame[frame["pid"] == rank], merged.symbol_table.sym_table)
        own = _rank_slices(per_rank.traces[rank], per_rank.symbol_table.sym_table)
        # nothing lost or changed in the merge (HTA rounds each file's times to whole µs on its own base)
        assert [n for n, _ in mine] == [n for n, _ in own], rank
        assert all(abs(a - b) <= 1.0 for (_, a), (_, b) in zip(mine, own)), rank
        assert {"compute", "dl:isend", "dl:recv", "dl:all_reduce", "gloo:all_reduce"} <= {n for n, _ in mine}
    # on the merged clock, as HTA reads it: each rank's receive (the kit's dl:recv, which holds the
    # emulated link's time) ends at least the link's time after its neighbour's send began, less the
    # clocks' measured error
    symbols = merged.symbol_table.sym_table
    errors = json.loads(merged_file.read_text())["disttrain_lab"]["clock_error_ns"]
    names = frame["name"].map(lambda i: symbols[i])
    for rank in range(4):
        sender = (rank - 1) % 4
        sent = frame[(frame["pid"] == sender) & (names == "c10d::send")]["ts"].min()
        took = frame[(frame["pid"] == rank) & (names == "dl:recv")]
        received = float((took["ts"] + took["dur"]).max())
        slack = (errors[rank] + errors[sender]) / 1e3
        assert received - float(sent) >= NET.time(4 * NUMEL) * 1e6 - slack, (rank, sent, received)
