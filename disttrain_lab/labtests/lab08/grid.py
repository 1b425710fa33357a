"""Lab 8's section 2 checks of the pieces: ``grid_groups``, ``TensorParallelAttention`` and ``PipelineStage3D``
on ranks, against one process running the dense attention and GPT, and the calls each rank made (``train_3d``,
built on them, is ``three_d``'s)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ... import carried, checks, models, wirecalls
from ...exercise import ExerciseRun
from .. import tp_partials
from .common import _exercise, _expect_value_error, _fields, _graders_for
from .ranks import (
    _assert_all_reduces,
    _attention_in_rank,
    _attention_of,
    _compare_parameters,
    _expected_parameters,
    _grid_in_rank,
    _grid_of,
    _stage_in_rank,
    _stage_names,
    _stage_of,
    communication,
)


# --------------------------------------------------------------------------------------
# Section 2: grid_groups, TensorParallelAttention, PipelineStage3D
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
    if wirecalls.observed(run):  # (grading: the group sums read from the grader's capture, not the ranks' word)
        _assert_groups_on_the_wire(run, case, dp, tp, pp)


def _assert_groups_on_the_wire(run: ExerciseRun, case: str, dp: int, tp: int, pp: int) -> None:
    """Each TP and DP group of more than one rank (Megatron's order, computed here) made an all-reduce of 8 B among
    exactly its ranks, each sending in it (the driver's sum of (1, rank) over it), its messages pieces of sums of those
    inputs (``carried.assert_reduced_carried``): a group made for real, seen on the wire.  Groups reported
    right by a rank that made no such group, their sums made up, fail."""
    groups = {
        (kind, tuple(_grid_of(rank, dp, tp, pp)[f"{kind}_group"]))
        for rank in range(dp * tp * pp)
        for kind in ("tp", "dp")
    }
    for kind, members in sorted(groups):
        if len(members) == 1:
            continue
        made = wirecalls.group_calls(run, members, case)[1]  # (each call's kind and size, in call_payloads' order)
        calls = [
            payloads
            for (kind_made, payloads), (_, size) in zip(wirecalls.call_payloads(run, members, case), made)
            if kind_made == "all_reduce" and size == 8 and set(payloads) == set(members)
        ]
        assert calls, (
            f"{case}: the {kind.upper()} group of ranks {members} should all-reduce the driver's (1, rank), 8 B, among "
            f"exactly its ranks, each sending in it; the grader's capture of the wire shows {wirecalls.describe(made)} "
            "among them"
        )
        partials = {rank: [torch.tensor([1.0, float(rank)])] for rank in members}
        carried.assert_reduced_carried(
            calls[-1], partials, case, f"the driver's all-reduce of (1, rank) over the {kind.upper()} group {members}"
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
    forward, backward = tp_partials.attention_partials(dense, x, checks.sample_tensor(y.shape, seed=5), tp)
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
                wirecalls.assert_all_reduces_carried(
                    run,
                    tuple(group),
                    [lambda r: forward[r % tp], lambda r: backward[r % tp]],
                    [
                        "the forward's all-reduce (g), of each rank's partial output (its heads through its columns "
                        "of proj)",
                        "the backward's all-reduce (f), of each rank's partial input gradient (through its heads)",
                    ],
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
    entering: list[torch.Tensor] = []  # each block's input, in the dense GPT's forward
    keep = lambda _, args: entering.append(args[0].detach())  # noqa: E731
    hooks = [block.register_forward_pre_hook(keep) for block in dense.blocks]
    logits = dense(x).detach()
    for hook in hooks:
        hook.remove()
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
            blocks = [dense.blocks[int(i)] for i in expected_blocks]
            _stage_sums_on_the_wire(run, rank, where, blocks, entering[int(expected_blocks[0]) :], tp, case)
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


def _stage_sums_on_the_wire(run: ExerciseRun, rank: int, where: dict, blocks: list, entering: list, tp: int, case: str):
    """What check_stage's all-reduces carried (read once, at the TP group's first rank): in each of the stage's
    ``blocks`` in turn (``entering``: each one's input in the dense GPT), g of attention then g of the MLP, each
    rank's partial output on that block's LayerNorm of its input (``tp_partials``)."""
    group = tuple(where["tp_group"])
    if len(group) == 1 or rank != group[0]:
        return
    inputs, whats = [], []
    for block, x in zip(blocks, entering):
        attention, _ = tp_partials.attention_partials(block.attn, block.ln1(x), None, tp)
        mlp, _ = tp_partials.mlp_partials(block.mlp, block.ln2(x + block.attn(block.ln1(x))), None, tp)
        inputs += [lambda r, sums=attention: sums[group.index(r)], lambda r, sums=mlp: sums[group.index(r)]]
        whats += [f"g of {what}, each rank's partial output" for what in ("a block's attention", "a block's MLP")]
    with torch.no_grad():
        wirecalls.assert_all_reduces_carried(run, group, inputs, whats, case)


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
