"""Lab 8's section 2 checks: ``grid_groups``, ``TensorParallelAttention``, ``PipelineStage3D``,
``train_3d`` against one process running the dense GPT, and the bytes the operating system counted."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ... import carried, checks, models, wirecalls
from ...exercise import ExerciseRun
from .common import CFG, LR, _exercise, _expect_value_error, _fields, _graders_for, _tokens
from .ranks import (
    _assert_all_reduces,
    _attention_in_rank,
    _attention_of,
    _compare_parameters,
    _dense_name,
    _describe,
    _expected_parameters,
    _grid_in_rank,
    _grid_of,
    _stage_in_rank,
    _stage_names,
    _stage_of,
    _tp_slice,
    _train_3d_in_rank,
    communication,
)


# --------------------------------------------------------------------------------------
# Section 2: grid_groups, TensorParallelAttention, PipelineStage3D, train_3d
# --------------------------------------------------------------------------------------
def check_grid(dp: int, tp: int, pp: int) -> None:
    """grid_groups(dp, tp, pp) on dp · tp · pp ranks: every rank's Grid in Megatron's order (tp fastest, then
    dp, then pp: its ranks in its TP and DP groups, its previous and next stage), and each group works (an
    all-reduce over it sums over exactly its ranks: every group made by every rank, in the same order)."""
    case = f"grid_groups(dp={dp}, tp={tp}, pp={pp}) on {dp * tp * pp} ranks"
    run = _exercise(_grid_in_rank, dp * tp * pp, (dp, tp, pp), case=case)
    for rank, got in enumerate(run.results):
        expected = {**_grid_of(rank, dp, tp, pp), "sizes": (dp, tp, pp)}
        wrong = {k: (got[k], v) for k, v in expected.items() if got[k] != v}
        assert not wrong, f"{case}: rank {rank} got " + "; ".join(
            f"{k} = {g!r}, expected {e!r}" for k, (g, e) in wrong.items()
        )
        for kind in ("tp", "dp"):  # the group works: an all-reduce sums over exactly its ranks
            members = expected[f"{kind}_group"]
            assert got.get(f"{kind}_sum") == [float(len(members)), float(sum(members))], (
                f"{case}: rank {rank}: an all-reduce over its {kind.upper()} group (ranks {members}) summed "
                f"(count, ranks) to {got.get(f'{kind}_sum')}, expected {[len(members), sum(members)]}: is every group "
                f"made by every rank, in the same order on all ranks?"
            )


def check_grid_error(world_size: int, sizes: tuple[int, int, int], words: Sequence[str]) -> str:
    """grid_groups(dp, tp, pp) (``sizes``) on ``world_size`` ranks where dp · tp · pp is not the world size (or
    a size is below 1) raises a ValueError naming ``words`` (the values); returns its message."""
    dp, tp, pp = sizes
    return _expect_value_error(
        _grid_in_rank, world_size, sizes, case=f"grid_groups({dp}, {tp}, {pp}) on {world_size} ranks", words=words
    )


def check_attention(n: int, cfg: models.GPTConfig, batch: int = 3, tp: int | None = None) -> None:
    """TensorParallelAttention of a dense attention on ``n`` ranks (in TP groups of ``tp``): each rank's output
    and input gradient equal the dense attention's (each rank attends over its own n_heads / tp heads), it
    holds its slices of query, key, value (rows) and proj (columns; the bias on TP position 0) under the dense
    names with their gradients, and makes one all-reduce forward (g's) and one backward (f's), in its group."""
    tp = tp or n
    case = (
        f"TensorParallelAttention(d_model={cfg.d_model}, n_heads={cfg.n_heads}) on {n} ranks"
        + (f" in groups of {tp}" if tp != n else "")
        + f", x of shape ({batch}, {cfg.seq_len}, {cfg.d_model})"
    )
    run = _exercise(_attention_in_rank, n, (_fields(cfg), batch, tp), case=case)
    dense = models.GPT(cfg, seed=3).blocks[0].attn  # the reference, in this process
    x = checks.sample_tensor((batch, cfg.seq_len, cfg.d_model), seed=4).requires_grad_()
    y = dense(x)
    y.backward(checks.sample_tensor(y.shape, seed=5))
    nbytes = batch * cfg.seq_len * cfg.d_model * 4
    full = {"attn." + k: (p.detach(), p.grad) for k, p in dense.named_parameters()}
    for rank, got in enumerate(run.results):
        group = range(rank - rank % tp, rank - rank % tp + tp)
        checks.assert_close(
            got["y"],
            y.detach(),
            what=f"{case}: rank {rank}'s output, against dense attention (each rank "
            f"attends over its own {cfg.n_heads // tp} of the {cfg.n_heads} heads: models.attend(q, k, v, "
            f"n_heads // {tp}) on its d/{tp} = {cfg.d_model // tp} features, not over all {cfg.n_heads})",
            atol=1e-5,
        )
        if wirecalls.observed(run):  # (grading: the grader's capture; the group's calls in the order it made them)
            if tp > 1 and rank % tp == 0:
                wirecalls.assert_group_calls(
                    run,
                    tuple(group),
                    [("all_reduce", nbytes)] * 2,
                    f"{case}: one all-reduce forward (g's), one backward (f's)",
                    case,
                )
        else:  # (the student's own kernel: the ranks' trace)
            calls = communication(run, rank)  # in order: the forward's, then the backward's
            _assert_all_reduces(calls[:1], n, rank, 1, nbytes, group, f"{case}, forward: one all-reduce, g's")
            _assert_all_reduces(calls[1:], n, rank, 1, nbytes, group, f"{case}, backward: one all-reduce, f's")
        checks.assert_close(
            got["x grad"],
            x.grad,
            what=f"{case}: rank {rank}'s input gradient, against dense attention",
            atol=1e-5,
            rtol=1e-4,
        )
        mine = {"attn." + k: v for k, v in got["params"].items()}
        _compare_parameters(mine, _expected_parameters(full, tp, rank % tp), f"{case}: rank {rank}'s parameters")


def check_attention_error(world_size: int, d_model: int, n_heads: int) -> str:
    """TensorParallelAttention of an attention with ``n_heads`` heads on ``world_size`` ranks that do not
    divide them raises a ValueError saying "divisible"; returns its message."""
    case = f"TensorParallelAttention with {n_heads} heads on {world_size} ranks"
    return _expect_value_error(_attention_of, world_size, (d_model, n_heads), case=case, words=["divisible"])


def check_stage(dp: int, tp: int, pp: int, cfg: models.GPTConfig, batch: int = 2) -> None:
    """PipelineStage3D on a dp × tp × pp grid: each rank holds the blocks of its stage (keyed by their index in
    the dense GPT), the embeddings on the first stage and the norm and head on the last, each as its TP slice
    under the dense names, leaves the dense GPT unchanged, makes 2 all-reduces per block forward (in its TP
    group) and nothing else, and the last stage's logits equal the dense GPT's.  Built on the grader's grid
    and attention where yours failed their graded tests."""
    n = dp * tp * pp
    case = f"PipelineStage3D of GPTConfig(n_layers={cfg.n_layers}, d_model={cfg.d_model}) on a {dp} × {tp} × {pp} grid"
    run = _exercise(
        _stage_in_rank,
        n,
        (_fields(cfg), dp, tp, pp, batch),
        case=case,
        graders=_graders_for("grid_groups", "tp_attention"),
    )
    dense = models.GPT(cfg, seed=2)  # the reference, in this process
    full = {k: (p.detach(), None) for k, p in dense.named_parameters()}
    x = checks.sample_tensor((batch, cfg.seq_len), torch.int64, seed=3).remainder(cfg.vocab)
    logits = dense(x).detach()
    nbytes = batch * cfg.seq_len * cfg.d_model * 4
    for rank, got in enumerate(run.results):
        where = _grid_of(rank, dp, tp, pp)
        per = cfg.n_layers // pp
        expected_blocks = [str(i) for i in range(where["pp_rank"] * per, (where["pp_rank"] + 1) * per)]
        assert got["blocks"] == expected_blocks, (
            f"{case}: rank {rank} (stage {where['pp_rank']}) holds blocks {got['blocks']}, expected {expected_blocks}"
        )
        expected = {
            k: v
            for k, v in _expected_parameters(full, tp, where["tp_rank"]).items()
            if k in _stage_names(cfg, pp, where["pp_rank"], where["tp_rank"])
        }
        _compare_parameters(got["params"], expected, f"{case}: rank {rank}'s parameters", grads=False)
        changed = sorted(set(full) ^ set(got["gpt"])) or [
            k for k, (p, _) in full.items() if not torch.allclose(got["gpt"][k], p, rtol=1e-5, atol=1e-6)
        ]
        assert not changed, f"{case}: rank {rank}: PipelineStage3D changed the dense gpt; copy what you keep"
        if wirecalls.observed(run):  # (grading: the grader's capture of the wire)
            _stage_calls_on_the_wire(run, rank, where, 2 * per, nbytes, case)
        else:  # (the student's own kernel: the ranks' trace)
            # the stage's forward: what the rank did besides this check's own receive and send
            calls = communication(run, rank)
            own = [
                next((e for e in calls if e.op in ("recv", "irecv") and e.peer == where["prev_rank"]), None)
                if where["prev_rank"] is not None
                else None,
                next((e for e in reversed(calls) if e.op in ("send", "isend") and e.peer == where["next_rank"]), None)
                if where["next_rank"] is not None
                else None,
            ]
            forward = [e for e in calls if not any(e is o for o in own)]
            _assert_all_reduces(
                forward,
                n,
                rank,
                2 * per,
                nbytes,
                where["tp_group"],
                f"{case}: forward of one batch: g of attention and MLP in each block",
            )
        if where["pp_rank"] == pp - 1:
            checks.assert_close(
                got["out"],
                logits,
                what=f"{case}: rank {rank}'s logits after the whole pipeline, against the dense GPT's",
                atol=1e-5,
                rtol=1e-4,
            )


def _stage_calls_on_the_wire(run: ExerciseRun, rank: int, where: dict, count: int, nbytes: int, case: str) -> None:
    """check_stage's calls from the grader's capture: ``rank`` sent only to its TP group and its neighbouring
    stages (this check's own activations), and its TP group made ``count`` all-reduces of ``nbytes`` (read once,
    at the group's first rank)."""
    group, neighbours = tuple(where["tp_group"]), {where["prev_rank"], where["next_rank"]} - {None}
    wirecalls.assert_stays_in(
        run, rank, {*group, *neighbours}, f"its TP group {group} and its neighbouring stages", case
    )
    if len(group) > 1 and rank == group[0]:
        wirecalls.assert_group_calls(
            run,
            group,
            [("all_reduce", nbytes)] * count,
            f"{case}: forward of one batch: g of attention and MLP in each block",
            case,
            outside=set(range(run.world_size)),  # (each rank's own destinations: checked above)
        )


def check_stage_error(world_size: int, n_layers: int, dp: int, tp: int, pp: int) -> str:
    """PipelineStage3D of a GPT whose ``n_layers`` blocks ``pp`` stages do not divide raises a ValueError naming
    both; returns its message.  (On the grader's grid and attention where yours failed.)"""
    return _expect_value_error(
        _stage_of,
        world_size,
        (n_layers, dp, tp, pp),
        case=f"PipelineStage3D of {n_layers} blocks on {pp} stages",
        words=[str(n_layers), str(pp)],
        graders=_graders_for("grid_groups", "tp_attention"),
    )


def _train_single(cfg: models.GPTConfig, batches: list, lr: float, seed: int = 0) -> tuple[models.GPT, list]:
    """The reference (section 1's train_single, again): GPT(cfg, seed) trained with SGD in this one process."""
    gpt = models.GPT(cfg, seed)
    optimizer = torch.optim.SGD(gpt.parameters(), lr=lr)
    losses, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for x, y in batches:
            optimizer.zero_grad()
            loss = models.lm_loss(gpt(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return gpt, losses


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


def check_3d(
    dp: int,
    tp: int,
    pp: int,
    micro_batches: int,
    cfg: models.GPTConfig = CFG,
    batch: int = 16,
    steps: int = 3,
    lr: float = LR,
) -> ExerciseRun:
    """train_3d on a dp × tp × pp grid: the loss of each step (the last stage reports one per step, the others
    none) and every rank's parameters after training equal the single-process run's (gradients averaged over
    the DP group, each micro-batch's loss scaled by its share of the rows), and its traffic is the
    configuration's: 4 all-reduces per block per micro-batch in its TP group, one DP all-reduce of all its
    gradients per step, activations and their gradients only to the neighbouring stages (by the trace and by
    the operating system's count).  Built on the grader's earlier pieces where yours failed.  Returns the run."""
    case = f"train_3d on a {dp} × {tp} × {pp} grid, {micro_batches} micro-batches, batch {batch}, {steps} steps"
    batches = models.lm_batches(_tokens(), batch, cfg.seq_len, steps, seed=7)
    run = _exercise(
        _train_3d_in_rank,
        dp * tp * pp,
        (_fields(cfg), batches, dp, tp, pp, micro_batches, lr),
        case=case,
        graders=_graders_for("grid_groups", "tp_attention", "pipeline_stage"),
    )
    dense, losses = _train_single(cfg, batches, lr)  # the reference, in this process
    full = {n: (p.detach(), None) for n, p in dense.named_parameters()}
    last = [r for r in range(run.world_size) if _grid_of(r, dp, tp, pp)["pp_rank"] == pp - 1]
    for rank, got in enumerate(run.results):
        assert len(got["step_s"]) == steps, (
            f"{case}: rank {rank} reported {len(got['step_s'])} step times, expected {steps}"
        )
        assert (len(got["losses"]) == steps) == (rank in last), (
            f"{case}: rank {rank} reported {len(got['losses'])} losses; the last stage reports one per step, "
            "others none"
        )
    mean = [sum(run.results[r]["losses"][s] for r in last) / len(last) for s in range(steps)]
    first = math.isclose(mean[0], losses[0], rel_tol=1e-4, abs_tol=1e-5)
    rule = (
        "the first step's loss matches, a later one does not, so the update differs: are the gradients averaged over "
        "the DP group (one all-reduce of the flattened gradients, the sum divided by dp) and each micro-batch's loss "
        "scaled by rᵢ / (B/dp)?"
        if first
        else "the first step's loss differs: the last stage's loss for micro-batch i is lm_loss · rᵢ / (B/dp), so the "
        "micro-batches add up to the shard's mean, which is not the mean of the micro-batch means when their sizes "
        "differ"
    )
    checks.assert_close(
        torch.tensor(mean),
        torch.tensor(losses),
        what=f"{case}: the loss of each step (mean over the "
        f"last stage's replicas), against the single-process run ({rule})",
        rtol=1e-4,
        atol=1e-5,
    )
    for rank, got in enumerate(run.results):
        where = _grid_of(rank, dp, tp, pp)
        expected = {
            k: v
            for k, v in _expected_parameters(full, tp, where["tp_rank"]).items()
            if k in _stage_names(cfg, pp, where["pp_rank"], where["tp_rank"])
        }
        mine = {_dense_name(k): (v, None) for k, v in got["params"].items()}
        _compare_parameters(
            mine,
            expected,
            f"{case}: rank {rank}'s parameters after training, against the "
            f"single-process run's slices (gradients averaged over the DP group: one all-reduce of the "
            f"flattened gradients, the sum divided by dp = {dp}; each micro-batch's loss scaled by rᵢ / (B/dp))",
            grads=False,
        )
    _check_traffic(run, cfg, batch, steps, dp, tp, pp, micro_batches, case)
    return run


def check_3d_error(batch: int, dp: int) -> str:
    """train_3d with a batch of ``batch`` rows that ``dp`` replicas do not divide (on dp ranks, tp = pp = 1)
    raises a ValueError naming both; returns its message.  (On the grader's earlier pieces where yours failed.)"""
    return _expect_value_error(
        _train_3d_in_rank,
        dp,
        (_fields(CFG), models.lm_batches(_tokens(), batch, CFG.seq_len, 1), dp, 1, 1, 1, LR),
        case=f"train_3d with a batch of {batch} on dp={dp}",
        words=[str(batch), str(dp)],
        graders=_graders_for("grid_groups", "tp_attention", "pipeline_stage"),
    )
