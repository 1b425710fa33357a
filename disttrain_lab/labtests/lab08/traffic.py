"""What ``train_3d`` puts on the wire in lab 8's section 2: each rank's traffic from the configuration alone
(the lab's table), its calls checked against it (under grading from the grader's capture of the wire, in the
student's own kernel from the ranks' trace), then the bytes the operating system counted between ranks that
share no group."""

from __future__ import annotations

import torch

from ... import carried, checks, models, wirecalls
from ...exercise import ExerciseRun
from .ranks import _describe, _grid_of, _stage_names, _tp_slice, communication


def _expected_traffic(cfg, batch, dp, tp, pp, micro_batches, rank) -> dict:
    """What ``rank`` must put on the wire in one step, from the configuration alone (the lab's table)."""
    where = _grid_of(rank, dp, tp, pp)
    shard = list(range(batch))[where["dp_rank"] * batch // dp : (where["dp_rank"] + 1) * batch // dp]
    rows = [len(part) for part in torch.tensor(shard).tensor_split(micro_batches)]
    act = [r * cfg.seq_len * cfg.d_model * 4 for r in rows if r]
    per_stage = cfg.n_layers // pp
    sends = [(where["next_rank"], b) for b in act] if where["next_rank"] is not None else []
    sends += [(where["prev_rank"], b) for b in act] if where["prev_rank"] is not None else []
    recvs = [(where["prev_rank"], b) for b in act] if where["prev_rank"] is not None else []
    recvs += [(where["next_rank"], b) for b in act] if where["next_rank"] is not None else []
    held = {
        n: p
        for n, p in models.GPT(cfg).named_parameters()
        if n in _stage_names(cfg, pp, where["pp_rank"], where["tp_rank"])
    }
    numel = sum(_tp_slice(n, p, tp, where["tp_rank"]).numel() for n, p in held.items())
    return {
        "tp": sorted(b for b in act for _ in range(4 * per_stage)),
        "tp_group": where["tp_group"],
        "dp": [numel * 4] if dp > 1 else [],
        "dp_group": where["dp_group"],
        "sends": sorted(sends),
        "recvs": sorted(recvs),
    }


def _calls_on_the_wire(run: ExerciseRun, cfg, batch, steps, dp, tp, pp, micro_batches, case: str) -> None:
    """_check_traffic's calls, from the grader's capture of the wire: all-reduces alone (besides the stages'
    sends); each rank sends only to its TP group, its DP group and its neighbouring stages; each TP and DP group
    makes the all-reduces of the lab's table; each rank's sends carry its activations and their gradients."""
    made = {carried.kind(slot) for _, _, _, slot, _ in wirecalls.data_sends(run, case)} - {"all_reduce", "send/recv"}
    assert not made, (
        f"{case}: the ranks may make no collective but all-reduce; the grader's capture shows {sorted(made)}"
    )
    read: dict[tuple, list] = {}  # group -> its calls' sizes (one read a group)
    for rank in range(run.world_size):
        expected = _expected_traffic(cfg, batch, dp, tp, pp, micro_batches, rank)
        peers = {peer for peer, _ in expected["sends"]}
        wirecalls.assert_stays_in(
            run,
            rank,
            {*expected["tp_group"], *expected["dp_group"], *peers},
            f"its TP group {expected['tp_group']}, its DP group {expected['dp_group']} and its neighbouring stages",
            case,
        )
        for name, per_step in (("tp", expected["tp"]), ("dp", expected["dp"])):
            group = tuple(expected[f"{name}_group"])
            if len(group) < 2:
                continue  # (a group of one: nothing crosses)
            if group not in read:
                per_rank, found = wirecalls.group_calls(run, group, case)
                read[group] = sorted(size for _, size in found), per_rank
            sizes, per_rank = read[group]
            assert sizes == sorted(per_step * steps) and per_rank[rank] == len(sizes), (
                f"{case}: over its {name.upper()} group {group} rank {rank} should make {len(per_step) * steps} "
                f"all-reduces of {sorted(set(per_step))} B ({steps} steps); the grader's capture of the wire shows "
                f"{len(sizes)} of {sorted(set(sizes))} B, rank {rank} sending in {per_rank[rank]}"
            )
        sent = sorted(
            (dst, len(payload))
            for src, dst, _, slot, payload in wirecalls.data_sends(run, case)
            if src == rank and carried.kind(slot) == "send/recv"
        )
        assert sent == sorted(expected["sends"] * steps), (
            f"{case}: rank {rank} should send {sorted(set(expected['sends']))} ((peer, bytes), "
            f"{len(expected['sends'])} per step), only to the neighbouring stages with the same (dp, tp) coordinate; "
            f"the grader's capture of the wire shows {sorted(set(sent))} ({len(sent)} in all)"
        )


def _calls_in_the_trace(run: ExerciseRun, cfg, batch, steps, dp, tp, pp, micro_batches, case: str) -> None:
    """_check_traffic's calls in the student's own kernel, where there is no capture: the ranks' trace."""
    for rank in range(run.world_size):
        expected = _expected_traffic(cfg, batch, dp, tp, pp, micro_batches, rank)
        calls = communication(run, rank)
        group_of = lambda e: list(e.group or range(run.world_size))
        other = [e for e in calls if e.kind == "collective" and e.op != "all_reduce"]
        assert not other, (
            f"{case}: rank {rank} made collectives other than all-reduce: {_describe(other, run.world_size)}"
        )
        reduces = [e for e in calls if e.op == "all_reduce"]
        outside = [e for e in reduces if group_of(e) not in (expected["tp_group"], expected["dp_group"])]
        assert not outside, (
            f"{case}: rank {rank} all-reduced over ranks other than its TP group "
            f"{expected['tp_group']} or DP group {expected['dp_group']}: {_describe(outside, run.world_size)}"
        )
        tp_calls = sorted(e.bytes for e in reduces if group_of(e) == expected["tp_group"])
        dp_calls = sorted(e.bytes for e in reduces if group_of(e) == expected["dp_group"] != expected["tp_group"])
        assert tp_calls == sorted(expected["tp"] * steps), (
            f"{case}: rank {rank}: over its TP group {expected['tp_group']} it should make "
            f"{len(expected['tp']) * steps} "
            f"all-reduces ({steps} steps × 4 per block per micro-batch) of {sorted(set(expected['tp']))} B; it made "
            f"{len(tp_calls)} of {sorted(set(tp_calls))} B"
        )
        assert dp_calls == expected["dp"] * steps, (
            f"{case}: rank {rank}: over its DP group {expected['dp_group']} it should make "
            + (
                f"one all-reduce of {expected['dp'][0]} B (all its gradients, flattened) per step, {steps} in all"
                if dp > 1
                else "no all-reduce (dp = 1)"
            )
            + f"; it made {len(dp_calls)} of {sorted(set(dp_calls))} B"
        )
        sends = sorted((e.peer, e.bytes) for e in calls if e.op in checks.SEND_OPS)
        recvs = sorted((e.peer, e.bytes) for e in calls if e.op in checks.RECV_OPS)
        assert sends == sorted(expected["sends"] * steps) and recvs == sorted(expected["recvs"] * steps), (
            f"{case}: rank {rank} (stage {_grid_of(rank, dp, tp, pp)['pp_rank']}) should send "
            f"{sorted(set(expected['sends']))} and receive {sorted(set(expected['recvs']))} ((peer, bytes), "
            f"{len(expected['sends'])} and {len(expected['recvs'])} per step): only to the neighbouring stages with "
            f"the same (dp, tp) coordinate; it sent {sorted(set(sends))} ({len(sends)} in all) and received "
            f"{sorted(set(recvs))} ({len(recvs)} in all)"
        )


def _check_traffic(run: ExerciseRun, cfg, batch, steps, dp, tp, pp, micro_batches, case: str) -> None:
    """Each rank's calls (under grading from the grader's capture, else from the ranks' trace), then the bytes
    the operating system counted between ranks that share no group."""
    if wirecalls.observed(run):
        _calls_on_the_wire(run, cfg, batch, steps, dp, tp, pp, micro_batches, case)
    else:
        _calls_in_the_trace(run, cfg, batch, steps, dp, tp, pp, micro_batches, case)
    # the same messages as the operating system counted them (gloo's headers included): between the
    # neighbouring stages, the activations and their gradients; between ranks that share no group, nothing
    for src in range(run.world_size):
        mine = _expected_traffic(cfg, batch, dp, tp, pp, micro_batches, src)
        for dst in range(run.world_size):
            if dst == src or dst in mine["tp_group"] or dst in mine["dp_group"]:
                continue  # gloo's all-reduces: their bytes are gloo's choice
            want = steps * sum(b for peer, b in mine["sends"] if peer == dst)
            got = run.traffic.between(src, dst)
            assert want <= got <= want + checks.WIRE_SLACK + want // 100, (
                f"{case}: rank {src} should send rank {dst} "
                + (
                    f"{want:,} bytes ({steps} steps of activations or their gradients)"
                    if want
                    else "nothing (they share no group and are not neighbouring stages)"
                )
                + f", but the operating system counted {got:,} bytes (all pairs: {run.traffic.describe()})"
            )
