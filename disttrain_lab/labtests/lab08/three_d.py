"""Lab 8's section 2 check of ``train_3d``: the losses and every rank's parameters after training, against one
process training the dense GPT, and its traffic (``traffic``).  Built on the grader's grid, attention and pipeline
stage where the student's failed their graded tests."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ... import carried, checks, models, wirecalls
from ...exercise import ExerciseRun
from .. import tp_partials
from .common import CFG, LR, _exercise, _expect_value_error, _fields, _graders_for, _tokens
from .ranks import _compare_parameters, _dense_name, _expected_parameters, _grid_of, _stage_names, _train_3d_in_rank
from .traffic import _check_traffic

# what a TP all-reduce's message may be off the grader's partial sum (relative; absolute, of the call's largest sum):
# the ranks' training drifts from the dense GPT's by rounding over the steps (float32's own tolerance for a sum held
# on one machine and failed on another: 7 Dec, block 1's MLP at step 2 of a 1 x 2 x 2 grid; it passes at 3e-5, 3e-6)
TP_RTOL, TP_ATOL = 1e-3, 1e-4
# what an activation or its gradient sent between stages may be off the grader's (relative; absolute, of the
# largest entry of the grader's tensor): the stages' TP sums round otherwise than the dense GPT (the solution on the
# graded grids, 7 Dec: at most 1.7e-6 of the largest entry off, 0.6 % of this allowance; zeros are 100 % off)
STAGE_RTOL, STAGE_ATOL = 1e-3, 1e-4


def _train_single(
    cfg: models.GPTConfig, batches: list, lr: float, seed: int = 0, at_step: Callable | None = None
) -> tuple[models.GPT, list]:
    """The reference (section 1's train_single, again): GPT(cfg, seed) trained with SGD in this one process;
    ``at_step(gpt, x, y)``, where given, runs before each step, on the model as it is then (what it does to the
    gradients is cleared before the step's own)."""
    gpt = models.GPT(cfg, seed)
    optimizer = torch.optim.SGD(gpt.parameters(), lr=lr)
    losses, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for x, y in batches:
            if at_step is not None:
                at_step(gpt, x, y)
            optimizer.zero_grad()
            loss = models.lm_loss(gpt(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return gpt, losses


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
    the operating system's count); under grading, what the DP all-reduce, the TP group's all-reduces (g forward,
    f backward) and the sends between stages (each micro-batch's activation forward, its gradient back) carried,
    read on the wire.  Built on the grader's earlier pieces where yours failed.  Returns the
    run."""
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
    if dp > 1 and carried.sends(run, case) is not None:  # (under grading: the grader's capture of the wire)
        local = _local_gradients(cfg, batches, lr, dp, tp, pp)
        of = {}  # each rank's gradients at each step, as the grader computed them
        for rank in range(run.world_size):
            where = _grid_of(rank, dp, tp, pp)
            of[rank] = local[where["dp_rank"], where["tp_rank"], where["pp_rank"]]
        for rank in range(run.world_size):
            group = _grid_of(rank, dp, tp, pp)["dp_group"]
            carried.assert_gradients_all_reduced(run, rank, group, {r: of[r] for r in group}, case, rtol=1e-3)
    if tp > 1 and wirecalls.observed(run):
        _tp_sums_on_the_wire(run, _tp_partials(cfg, batches, lr, dp, tp, pp, micro_batches), dp, tp, pp, case)
    if pp > 1 and wirecalls.observed(run):
        owed = _stage_messages(cfg, batches, lr, dp, pp, micro_batches)
        _stage_messages_on_the_wire(run, owed, dp, tp, pp, case)
    return run


def _stage_messages(cfg: models.GPTConfig, batches: list, lr: float, dp: int, pp: int, micro_batches: int) -> dict:
    """(dp_rank, s) -> for each step, for each micro-batch of the DP shard that has rows, what crosses between
    stages s and s + 1: (the activation, the output of stage s's last block in the dense GPT, and the gradients
    it may be sent back as: of the micro-batch's loss scaled by its share of the shard's rows, as the exercise
    asks, or unscaled, the scaling left to the end), in one process along the reference's training
    (``_train_single``)."""
    per = cfg.n_layers // pp
    found: dict[tuple, list] = {(d, s): [] for d in range(dp) for s in range(pp - 1)}

    def at_step(gpt, x, y):
        for d, (shard, targets) in enumerate(zip(x.tensor_split(dp), y.tensor_split(dp))):
            step: dict[int, list] = {s: [] for s in range(pp - 1)}
            for rows, wanted in zip(shard.tensor_split(micro_batches), targets.tensor_split(micro_batches)):
                if not len(rows):
                    continue  # (an empty micro-batch: nothing crosses)
                made: list[torch.Tensor] = []  # each boundary's activation, stage by stage

                def hold(_m, _i, out, into=made):
                    out.retain_grad()
                    into.append(out)

                hooks = [gpt.blocks[(s + 1) * per - 1].register_forward_hook(hold) for s in range(pp - 1)]
                try:
                    share = len(rows) / len(shard)
                    (models.lm_loss(gpt(rows), wanted) * share).backward()
                finally:
                    for hook in hooks:
                        hook.remove()
                for s, act in enumerate(made):
                    grad = act.grad.detach().clone()
                    step[s].append((act.detach().clone(), (grad, grad / share)))
            for s in range(pp - 1):
                found[d, s].append(step[s])

    _train_single(cfg, batches, lr, at_step=at_step)
    return found


def _stage_messages_on_the_wire(run: ExerciseRun, owed: dict, dp: int, tp: int, pp: int, case: str) -> None:
    """Under grading: every point-to-point message a rank sent the next stage, as the grader's capture saw it
    cross, holds the activation of one of its DP shard's micro-batches at that step or another, the dense GPT's
    output of the stage's last block along the single-process training (``_stage_messages``), and every one it
    sent the previous stage the gradient of the loss with respect to one (scaled by the micro-batch's share of the
    shard's rows, or not), within STAGE_RTOL of each value plus STAGE_ATOL of the tensor's largest; and each of
    them crosses (their number is the traffic's check).  Every TP rank of a stage sends its counterpart in the
    next stage the whole tensor.  Junk of the right size (zeros), with the values passed some other way (the
    launcher's store), fails."""
    sent = [(s, d, p) for s, d, _, slot, p in wirecalls.data_sends(run, case) if carried.kind(slot) == "send/recv"]
    for rank in range(run.world_size):
        where = _grid_of(rank, dp, tp, pp)
        for peer, forward in ((where["next_rank"], True), (where["prev_rank"], False)):
            if peer is None:
                continue
            boundary = where["pp_rank"] if forward else where["pp_rank"] - 1
            what = (
                f"activation (stage {boundary}'s output)"
                if forward
                else f"gradient of the loss with respect to the activation (stage {boundary}'s output)"
            )
            owed_here = {
                (step, m): [act] if forward else list(grads)
                for step, items in enumerate(owed[where["dp_rank"], boundary])
                for m, (act, grads) in enumerate(items)
            }
            payloads = [p for s, d, p in sent if s == rank and d == peer and p]
            seen: set = set()
            for i, payload in enumerate(payloads):
                found, nearest = _match(payload, owed_here)
                if found is not None:
                    seen.add(found)
                    continue
                values = torch.frombuffer(bytearray(payload[: len(payload) // 4 * 4]), dtype=torch.float32)
                scales = sorted({round(float(w.abs().max()), 6) for ws in owed_here.values() for w in ws})
                raise AssertionError(
                    f"{case}: message {i + 1} of {len(payloads)} from rank {rank} (stage {where['pp_rank']}) to rank "
                    f"{peer} should hold the {what} of one of its DP shard's micro-batches, as the grader computed it "
                    f"in one process along the single-process training (largest entry {scales[0]:.3g} to "
                    f"{scales[-1]:.3g}; each value within rtol={STAGE_RTOL:g} plus {STAGE_ATOL:g} of the largest); "
                    f"the grader's capture of the wire found {len(payload):,} bytes, "
                    + (
                        f"values in [{float(values.min()):.3g}, {float(values.max()):.3g}], off the nearest by "
                        f"{nearest:.3g} of its largest entry"
                        if nearest is not None
                        else "the size of none of them"
                    )
                    + ". What a stage sends must be the data itself: values that arrive some other way (the launcher's "
                    "store), with other bytes sent in their place, do not count"
                )
            missing = sorted(set(owed_here) - seen)
            assert not missing, (
                f"{case}: rank {rank} (stage {where['pp_rank']}) should send rank {peer} the {what} of each of its DP "
                f"shard's micro-batches at each step; the grader's capture of the wire found none for (step, "
                f"micro-batch) {', '.join(f'({s + 1}, {m})' for s, m in missing)}"
            )


def _match(payload: bytes, owed: dict) -> tuple[tuple | None, float | None]:
    """The (step, micro-batch) of ``owed`` (-> its tensors, the alternatives) whose values ``payload`` holds,
    within STAGE_RTOL of each plus STAGE_ATOL of the tensor's largest (else None), and, where none, the smallest
    largest deviation from a tensor of its size, in units of that tensor's largest entry (None: no such size)."""
    nearest = None
    for key, wants in owed.items():
        for want in wants:
            if len(payload) != want.numel() * want.element_size():
                continue
            values = torch.frombuffer(bytearray(payload), dtype=want.dtype).double()
            want = want.reshape(-1).double()
            scale = float(want.abs().max()) or 1.0
            off = (values - want).abs()
            if bool((off <= STAGE_RTOL * want.abs() + STAGE_ATOL * scale).all()):
                return key, None
            worst = float(off.max()) / scale
            nearest = worst if nearest is None else min(nearest, worst)
    return None, nearest


def _tp_partials(cfg: models.GPTConfig, batches: list, lr: float, dp: int, tp: int, pp: int, micro_batches: int):
    """(dp_rank, pp_rank) -> for each step, what that stage's all-reduces carry in its TP group: for each micro-batch
    of the DP shard and each of the stage's blocks, (what, each TP position's partial: ``tp_partials``) of attention's
    and the MLP's g (forward: the partial outputs, on the dense GPT's LayerNorms of the block's input) and f
    (backward: the partial gradients of those LayerNorms' outputs, from the gradients of attention's and the MLP's
    outputs under the micro-batch's loss scaled by its share of the shard's rows), in one process along the
    reference's training (``_train_single``)."""
    per = cfg.n_layers // pp
    found: dict[tuple, list] = {(d, s): [] for d in range(dp) for s in range(pp)}

    def at_step(gpt, x, y):
        for d, (shard, targets) in enumerate(zip(x.tensor_split(dp), y.tensor_split(dp))):
            step: dict[int, list] = {s: [] for s in range(pp)}
            cut = zip(shard.tensor_split(micro_batches), targets.tensor_split(micro_batches))
            for m, (rows, wanted) in enumerate(cut):
                entering: list[torch.Tensor] = []  # each block's input, in the dense GPT's forward
                made: list[torch.Tensor] = []  # each block's attention output, then its MLP's: their gradients
                keep = lambda _, args, into=entering: into.append(args[0].detach())  # noqa: E731
                hold = lambda _m, _i, out, into=made: into.append(out) or out.retain_grad()  # noqa: E731
                hooks = [block.register_forward_pre_hook(keep) for block in gpt.blocks]
                parts = [part for block in gpt.blocks for part in (block.attn, block.mlp)]
                hooks += [part.register_forward_hook(hold) for part in parts]
                loss = models.lm_loss(gpt(rows), wanted) * (len(rows) / len(shard))
                for hook in hooks:
                    hook.remove()
                loss.backward()
                for i, (block, h) in enumerate(zip(gpt.blocks, entering)):
                    into_attention = block.ln1(h).detach()
                    with torch.no_grad():
                        into_mlp = block.ln2(h + block.attn(into_attention))
                    attention, attention_back = tp_partials.attention_partials(
                        block.attn, into_attention, made[2 * i].grad, tp
                    )
                    mlp, mlp_back = tp_partials.mlp_partials(block.mlp, into_mlp, made[2 * i + 1].grad, tp)
                    step[i // per] += [
                        (f"g of block {i}'s attention on micro-batch {m}", attention),
                        (f"g of block {i}'s MLP on micro-batch {m}", mlp),
                        (f"f of block {i}'s attention on micro-batch {m} (backward)", attention_back),
                        (f"f of block {i}'s MLP on micro-batch {m} (backward)", mlp_back),
                    ]
            for s in range(pp):
                found[d, s].append(step[s])

    _train_single(cfg, batches, lr, at_step=at_step)
    return found


def _tp_sums_on_the_wire(run: ExerciseRun, partials: dict, dp: int, tp: int, pp: int, case: str) -> None:
    """Under grading: at each step, every all-reduce a TP group owes (``_tp_partials``: its DP shard's micro-batches
    through its stage's blocks, g forward and f backward) is one of that step's all-reduces in the group, whose every
    message is a piece of a sum of the ranks' partials over ranks that include its sender
    (``carried.assert_reduced_carried``), whatever the order of the micro-batches' forwards and backwards."""
    for rank in range(run.world_size):
        where = _grid_of(rank, dp, tp, pp)
        group = tuple(where["tp_group"])
        if rank != group[0]:
            continue
        owed = partials[where["dp_rank"], where["pp_rank"]]
        calls = [payloads for kind, payloads in wirecalls.call_payloads(run, group, case) if kind == "all_reduce"]
        per_step = len(calls) // len(owed)  # (their count, every step's alike: checked with the traffic)
        for step, wanted in enumerate(owed):
            wanted = list(wanted)
            for payloads in calls[step * per_step : (step + 1) * per_step]:
                for j, (what, sums) in enumerate(wanted):
                    try:
                        with torch.no_grad():
                            mine = {r: sums[group.index(r)] for r in group}
                            largest = len(group) * max(float(t.abs().max()) for ts in mine.values() for t in ts)
                            tolerance = (TP_RTOL, TP_ATOL * largest)
                            carried.assert_reduced_carried(payloads, mine, case, what, tolerance=tolerance)
                    except AssertionError:
                        continue
                    del wanted[j]
                    break
            assert not wanted, (
                f"{case}: at step {step}, ranks {group} (the TP group of stage {where['pp_rank']}, DP replica "
                f"{where['dp_rank']}) should all-reduce each rank's partial output of every block's attention and MLP "
                f"on every micro-batch (g, forward) and its partial input gradient (f, backward): no all-reduce of "
                f"theirs at that step carried the {wanted[0][0]} (each message a piece of a sum, over ranks that "
                f"include its sender, of the ranks' partials; {len(wanted)} such all-reduce(s) missing). What a rank "
                "all-reduces must be the data itself, not zeros or a copy while the sums travel some other way"
            )


def _local_gradients(cfg: models.GPTConfig, batches: list, lr: float, dp: int, tp: int, pp: int) -> dict:
    """(dp_rank, tp_rank, pp_rank) -> each step's gradient of that rank's parameters (its stage's, its TP slices)
    on its DP shard's mean loss (what its micro-batches' scaled losses add up to), flat, in one process along the
    reference's training (``_train_single``)."""
    names = {(t, s): _stage_names(cfg, pp, s, t) for t in range(tp) for s in range(pp)}
    found: dict[tuple, list] = {(d, t, s): [] for d in range(dp) for t in range(tp) for s in range(pp)}

    def at_step(gpt, x, y):
        for d, (xs, ys) in enumerate(zip(x.tensor_split(dp), y.tensor_split(dp))):
            gpt.zero_grad()
            models.lm_loss(gpt(xs), ys).backward()
            full = {n: (p.detach(), p.grad) for n, p in gpt.named_parameters()}
            for (t, s), kept in names.items():
                grads = [g for n, (_, g) in _expected_parameters(full, tp, t).items() if n in kept]
                found[d, t, s].append(torch.cat([g.reshape(-1) for g in grads]).numpy().copy())

    _train_single(cfg, batches, lr, at_step=at_step)
    return found


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
