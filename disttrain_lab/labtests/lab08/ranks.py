"""What a rank holds and calls in lab 8's section 2 (its slice of the dense GPT's parameters, its
collectives), and the drivers that run the student's grid, attention, stage and ``train_3d`` there."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ... import checks, models
from ...exercise import ExerciseRun
from ...trace import Run
from .common import _COLUMN, _ROW_BIAS, _ROW_WEIGHT


# --------------------------------------------------------------------------------------
# What a rank holds and calls
# --------------------------------------------------------------------------------------
def _grid_of(rank: int, dp: int, tp: int, pp: int) -> dict:
    """What grid_groups must give ``rank``, from Megatron's order alone."""
    tp_rank, dp_rank, pp_rank = rank % tp, rank // tp % dp, rank // (tp * dp)
    return {
        "tp_rank": tp_rank,
        "dp_rank": dp_rank,
        "pp_rank": pp_rank,
        "tp_group": [(pp_rank * dp + dp_rank) * tp + t for t in range(tp)],
        "dp_group": [(pp_rank * dp + d) * tp + tp_rank for d in range(dp)],
        "prev_rank": rank - dp * tp if pp_rank > 0 else None,
        "next_rank": rank + dp * tp if pp_rank < pp - 1 else None,
    }


def _dense_name(name: str) -> str:
    """A stage's parameter name as the dense GPT names it (Lab 6's TensorParallelMLP: column, row = 0, 2)."""
    return ("." + name).replace(".mlp.column.", ".mlp.0.").replace(".mlp.row.", ".mlp.2.")[1:]


def _tp_slice(name: str, tensor: torch.Tensor, tp: int, position: int) -> torch.Tensor | None:
    """The part of the dense parameter ``name`` that TP position ``position`` of ``tp`` holds (None: none)."""
    name = "." + name
    if any(k in name for k in _COLUMN):
        return tensor.tensor_split(tp, dim=0)[position]
    if any(name.endswith(k) for k in _ROW_WEIGHT):
        return tensor.tensor_split(tp, dim=1)[position]
    if any(name.endswith(k) for k in _ROW_BIAS):
        return tensor if position == 0 else None
    return tensor  # LayerNorms, embeddings, head: replicated


def _expected_parameters(dense: dict, tp: int, position: int) -> dict:
    """name -> (value, gradient) slices of the dense ``name -> (value, gradient)`` for one TP position."""
    out = {}
    for name, (value, grad) in dense.items():
        part = _tp_slice(name, value, tp, position)
        if part is not None:
            out[name] = (part, None if grad is None else _tp_slice(name, grad, tp, position))
    return out


def parameters_of(module: nn.Module) -> dict:
    """A module's parameters under the dense names, (value, gradient) each: what a driver returns."""
    return {
        _dense_name(n): (p.detach().clone(), None if p.grad is None else p.grad.clone())
        for n, p in module.named_parameters()
    }


def _compare_parameters(got: dict, expected: dict, what: str, grads: bool = True, rtol=1e-4, atol=1e-5) -> None:
    assert set(got) == set(expected), (
        f"{what}: expected the parameters {sorted(expected)}, got {sorted(got)} (the row-parallel bias lives on "
        f"TP position 0 only; keep the dense names: query, key, value, proj, ...)"
    )
    for name, (value, grad) in expected.items():
        checks.assert_close(got[name][0], value, what=f"{what}: {name}", rtol=rtol, atol=atol)
        if grads:
            assert got[name][1] is not None, f"{what}: no gradient reached {name}"
            checks.assert_close(got[name][1], grad, what=f"{what}: the gradient of {name}", rtol=rtol, atol=atol)


def communication(run: ExerciseRun | Run, rank: int) -> list:
    """Rank ``rank``'s collectives and point-to-point calls in the order it made them (``run``: what
    dl.exercise.run returned, or its trace: the call only)."""
    trace = getattr(run, "trace", run)
    return sorted((e for e in trace.by_rank(rank) if e.kind in ("collective", "p2p")), key=lambda e: e.start)


def _describe(events, world_size: int) -> str:
    return (
        ", ".join(
            f"{e.op} of {e.bytes} B "
            + (f"with rank {e.peer}" if e.kind == "p2p" else f"over ranks {list(e.group or range(world_size))}")
            for e in events
        )
        or "nothing"
    )


def _assert_all_reduces(calls, world_size: int, rank: int, count: int, nbytes: int, group, what: str) -> None:
    ok = len(calls) == count and all(
        e.op == "all_reduce" and e.bytes == nbytes and list(e.group or range(world_size)) == list(group) for e in calls
    )
    assert ok, (
        f"{what}: rank {rank} should make exactly {count} all-reduce(s) of {nbytes} B over ranks "
        f"{list(group)} and nothing else; it made: {_describe(calls, world_size)}"
    )


def _stage_names(cfg: models.GPTConfig, pp: int, pp_rank: int, position: int) -> set:
    """The dense names of the parameters stage ``pp_rank`` holds at TP position ``position``."""
    per = cfg.n_layers // pp
    keep = {"token.", "position."} if pp_rank == 0 else set()
    keep |= {f"blocks.{i}." for i in range(pp_rank * per, (pp_rank + 1) * per)}
    keep |= {"norm.", "head."} if pp_rank == pp - 1 else set()
    names = {n for n, _ in models.GPT(cfg).named_parameters() if any(n.startswith(k) for k in keep)}
    return {n for n in names if not (position > 0 and any(n.endswith(k) for k in _ROW_BIAS))}


# --------------------------------------------------------------------------------------
# Drivers of section 2 (defined in the student's kernel: the notebook's names, no others)
# --------------------------------------------------------------------------------------
def _grid_in_rank(dp, tp, pp):
    """Driver: this rank's grid_groups(dp, tp, pp), as plain data; where a group holds the ranks Megatron's
    order gives it, the sum of (1, rank) over it by an all-reduce (does the group work?)."""
    grid = grid_groups(dp, tp, pp)  # noqa: F821  (the notebook's)
    rank = dist.get_rank()
    got = {
        "tp_rank": grid.tp_rank,
        "dp_rank": grid.dp_rank,
        "pp_rank": grid.pp_rank,
        "tp_group": dist.get_process_group_ranks(grid.tp_group),
        "dp_group": dist.get_process_group_ranks(grid.dp_group),
        "prev_rank": grid.prev_rank,
        "next_rank": grid.next_rank,
        "sizes": (grid.dp, grid.tp, grid.pp),
    }
    tp_rank, dp_rank, pp_rank = rank % tp, rank // tp % dp, rank // (tp * dp)
    right = {
        "tp": [(pp_rank * dp + dp_rank) * tp + t for t in range(tp)],
        "dp": [(pp_rank * dp + d) * tp + tp_rank for d in range(dp)],
    }
    for kind, group in (("tp", grid.tp_group), ("dp", grid.dp_group)):
        if got[f"{kind}_group"] == right[kind]:  # every rank of the group takes this branch: no hang
            total = torch.tensor([1.0, float(rank)])
            dist.all_reduce(total, group=group)
            got[f"{kind}_sum"] = total.tolist()
    return got


def _attention_in_rank(cfg, batch, tp):
    """Driver: your TensorParallelAttention of a dense attention (cfg: a GPTConfig's fields), forward then backward."""
    from disttrain_lab.labtests.lab08.ranks import parameters_of

    cfg = models.GPTConfig(**cfg) if isinstance(cfg, dict) else cfg
    group = dist.new_subgroups(tp)[0] if tp != dist.get_world_size() else None
    dense = models.GPT(cfg, seed=3).blocks[0].attn
    x = checks.sample_tensor((batch, cfg.seq_len, cfg.d_model), seed=4).requires_grad_()
    attn = TensorParallelAttention(dense, group)  # noqa: F821  (the notebook's)
    y = attn(x)
    y.backward(checks.sample_tensor(y.shape, seed=5))
    return {"y": y.detach(), "x grad": x.grad, "params": parameters_of(attn)}


def _attention_of(d_model, n_heads):
    """Driver: your TensorParallelAttention of a dense attention with ``n_heads`` heads, over all ranks."""
    TensorParallelAttention(models.GPT(models.GPTConfig(d_model=d_model, n_heads=n_heads)).blocks[0].attn)  # noqa: F821


def _stage_in_rank(cfg, dp, tp, pp, batch, graders=()):
    """Driver: your grid and PipelineStage3D (cfg: a GPTConfig's fields), and one forward through the
    pipeline (the receive and send between stages are this driver's own).  ``graders``: your earlier pieces
    that failed their graded test, replaced by the grader's own (only the grader holds them)."""
    from disttrain_lab.labtests.lab08.common import in_place
    from disttrain_lab.labtests.lab08.ranks import parameters_of

    cfg = models.GPTConfig(**cfg) if isinstance(cfg, dict) else cfg
    pieces = _graders_pieces(graders) if graders else {}  # noqa: F821  (the grader's, sent with this driver)
    with in_place(pieces, [PipelineStage3D]):  # noqa: F821  (the notebook's)
        grid = pieces.get("grid_groups", grid_groups)(dp, tp, pp)  # noqa: F821
        gpt = models.GPT(cfg, seed=2)
        stage = PipelineStage3D(gpt, grid)  # noqa: F821
    x = checks.sample_tensor((batch, cfg.seq_len), torch.int64, seed=3).remainder(cfg.vocab)
    if grid.pp_rank == 0:
        h = x
    else:
        h = torch.empty(batch, cfg.seq_len, cfg.d_model)
        dist.recv(h, src=grid.prev_rank)
    out = stage(h)
    if grid.next_rank is not None:
        dist.send(out.detach(), dst=grid.next_rank)
    return {
        "params": parameters_of(stage),
        "out": out.detach(),
        "blocks": [k if isinstance(k, str) else type(k).__name__ for k in stage.blocks],
        "gpt": {n: p.detach().clone() for n, p in gpt.named_parameters()},
    }


def _stage_of(n_layers, dp, tp, pp, graders=()):
    """Driver: your PipelineStage3D of a dense GPT with ``n_layers`` blocks on a dp × tp × pp grid."""
    from disttrain_lab.labtests.lab08.common import in_place

    pieces = _graders_pieces(graders) if graders else {}  # noqa: F821  (the grader's, sent with this driver)
    with in_place(pieces, [PipelineStage3D]):  # noqa: F821  (the notebook's)
        grid = pieces.get("grid_groups", grid_groups)(dp, tp, pp)  # noqa: F821
        PipelineStage3D(models.GPT(models.GPTConfig(n_layers=n_layers)), grid)  # noqa: F821


def _train_3d_in_rank(cfg, batches, dp, tp, pp, micro_batches, lr, graders=()):
    """Driver: your train_3d on this rank (cfg: a GPTConfig's fields), what it returned as plain data.
    ``graders``: your earlier pieces that failed their graded test, replaced by the grader's own."""
    from disttrain_lab.labtests.lab08.common import in_place

    cfg = models.GPTConfig(**cfg) if isinstance(cfg, dict) else cfg
    pieces = _graders_pieces(graders) if graders else {}  # noqa: F821  (the grader's, sent with this driver)
    with in_place(pieces, [train_3d]):  # noqa: F821  (the notebook's)
        out = train_3d(cfg, batches, dp=dp, tp=tp, pp=pp, micro_batches=micro_batches, lr=lr)  # noqa: F821
    return {
        "losses": [float(l) for l in out["losses"]],
        "step_s": [float(s) for s in out["step_s"]],
        "params": {k: torch.as_tensor(v).detach().clone() for k, v in out["params"].items()},
    }
