"""Lab 8's graded tests (the capstone: 3D parallelism, a parallelism planner, LARS, scaling laws).

Section 2's checks run the student's grid, attention, pipeline stage and ``train_3d`` on ranks through
*drivers* (the ``_..._in_rank`` and ``_..._of`` functions below: ``exercise.run`` sends a driver's
source to the student's kernel, where it is defined among the notebook's names, calls the notebook's
code there and returns data), compare every rank's tensors with one process running the dense GPT,
and read the calls each rank made (``run.trace``) and the bytes the operating system counted
(``run.traffic``).  Sections 3-5 run the student's planner, LARS and scaling-law functions on one rank
the same way.  A driver uses only the notebook's names (the student's functions and classes, the
given ``Grid``, ``ModelSpec``, ``ClusterSpec``, ``Plan``, and ``torch``, ``dist``, ``nn``, ``models``,
``checks`` of the setup cell) and imports this module's helpers inside its body.

Nothing here is a solution or a graded answer.  What only the grader holds stays in the graded
cells' hidden tests and reaches this module at run time: the grader's own grid, attention and
pipeline stage (``_graders_pieces``, put in ``GRADERS["pieces"]``) and its own memory and step-time
models (``_graders_planner``, ``GRADERS["planner"]``), on which a later exercise is graded where an
earlier one failed its graded test (``PASSED``); and the exact step-time model.  The references that
compute an exercise's own answer (the memory formula, the power-law fit, the compute-optimal size,
the LARS update) are written in the notebook and handed to the checks (``reference=``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import linecache
import math
import numbers
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .. import checks, exercise, models
from ..exercise import ExerciseRun
from ..launcher import launch as _launch
from ..network import Network
from ..trace import Run
from . import common

__all__ = [
    "CFG",
    "GRADERS",
    "LR",
    "MEASURED",
    "PASSED",
    "SCALING_RUNS",
    "check_3d",
    "check_3d_error",
    "check_attention",
    "check_attention_error",
    "check_fit",
    "check_fit_rejects",
    "check_grid",
    "check_grid_error",
    "check_lars",
    "check_lars_without_grad",
    "check_memory",
    "check_optimal",
    "check_optimal_rejects",
    "check_plans",
    "check_stage",
    "check_stage_error",
    "check_step_time",
    "check_step_time_ranking",
    "choose_planner_graders",
    "communication",
    "launch",
    "plans_for",
]

CFG = models.GPTConfig(vocab=32, seq_len=16, d_model=32, n_heads=4, n_layers=2)  # the lab's CFG, for the tests
LR = 0.5  # the lab's LR
TIMEOUT = 120  # seconds a test's run on several ranks may take
Spec = Any  # the notebook's ModelSpec, ClusterSpec or Plan (its given, locked cell defines them)

# exercise -> whether its graded test passed: each graded cell of section 2 and of the planner sets it to False
# first and to True last, so a later exercise is graded on the grader's piece where an earlier one failed
PASSED: dict[str, bool] = {}
# the grader's own earlier pieces, put here by the hidden tests that define them ("pieces": grid_groups,
# TensorParallelAttention and PipelineStage3D; "planner": memory_per_device and step_time); never in this file
GRADERS: dict[str, Callable] = {}
_PIECES = {"grid_groups": "grid_groups", "tp_attention": "TensorParallelAttention", "pipeline_stage": "PipelineStage3D"}
_PLANNER_GRADERS: list[str] = []  # the planner's pieces plan_parallelism is graded on (choose_planner_graders)

# data/step_times.json's model, emulated cluster and median step times, copied here: the graded test runs
# where the lab's data/ folder is not
MEASURED = {
    "model": {"layers": 2, "hidden": 32, "heads": 8, "seq": 16, "batch": 64, "vocab": 32, "bytes_per_value": 4},
    "cluster": {
        "devices": 8,
        "devices_per_node": 4,
        "memory": 1000000000.0,
        "flops": 2438531021.418276,
        "intra": {"latency": 0.002, "bandwidth": 10000000.0, "name": "bench intra-node link (10 MB/s, 2 ms)"},
        "inter": {"latency": 0.005, "bandwidth": 1000000.0, "name": "bench inter-node link (1 MB/s, 5 ms)"},
    },
    "runs": [
        dict(dp=2, tp=2, pp=2, micro_batches=2, zero=0, median_step_s=0.25586983100038196),
        dict(dp=8, tp=1, pp=1, micro_batches=1, zero=0, median_step_s=0.33428737800022645),
        dict(dp=1, tp=8, pp=1, micro_batches=1, zero=0, median_step_s=2.430098208000345),
        dict(dp=4, tp=2, pp=1, micro_batches=1, zero=0, median_step_s=0.23919984900021518),
        dict(dp=2, tp=4, pp=1, micro_batches=1, zero=0, median_step_s=0.2568593559990404),
        dict(dp=4, tp=1, pp=2, micro_batches=2, zero=0, median_step_s=0.14867018000040844),
        dict(dp=1, tp=4, pp=2, micro_batches=2, zero=0, median_step_s=0.48462897700119356),
    ],
}

# every run of data/scaling_runs.json as (Ψ, D, loss), copied here for the same reason
SCALING_RUNS = [
    (2528, 659456, 1.0082740783691406),
    (8128, 204800, 1.2508436441421509),
    (16800, 99328, 1.3846378326416016),
    (28544, 58368, 1.6537681818008423),
    (61248, 27648, 1.9920727014541626),
    (106240, 15360, 2.2306301593780518),
    (2528, 1977344, 0.6888324618339539),
    (8128, 615424, 0.5599728226661682),
    (16800, 297984, 0.6440628170967102),
    (28544, 175104, 0.8463508486747742),
    (61248, 81920, 1.1391810178756714),
    (106240, 47104, 1.3240922689437866),
    (2528, 6592512, 0.4327574074268341),
    (8128, 2050048, 0.4223581850528717),
    (16800, 992256, 0.42029184103012085),
    (28544, 583680, 0.42817944288253784),
    (61248, 272384, 0.44048991799354553),
    (106240, 156672, 0.5488030910491943),
]

# Lab 6's TensorParallelMLP names its linears column and row; the dense GPT's MLP names them 0 and 2
_COLUMN = (".query.", ".key.", ".value.", ".mlp.0.")  # their rows (output features) are split
_ROW_WEIGHT = (".proj.weight", ".mlp.2.weight")  # their columns (input features) are split
_ROW_BIAS = (".proj.bias", ".mlp.2.bias")  # on TP position 0 only


@functools.cache
def _tokens() -> torch.Tensor:
    """The lab's TOKENS, for the tests."""
    return models.corpus_tokens(20_000)


def _fields(spec) -> dict:
    """A dataclass (a GPTConfig, a ModelSpec, ...) as plain data: what a test can pass to the student's kernel."""
    return dataclasses.asdict(spec)


def _notebook(name: str):
    """The notebook's (given, locked) ``name``: a class of its planner (``Plan``) that a message shows."""
    return vars(sys.modules["__main__"])[name]


# --------------------------------------------------------------------------------------
# Running a driver
# --------------------------------------------------------------------------------------
def launch(driver: Callable, world_size: int, *args, **options) -> Any:
    """``dl.launch(driver, world_size, *args, **options)`` of one of this module's drivers, defined from its
    source among the notebook's names (as ``dl.exercise.run`` defines it in the student's kernel): for a
    self-check that prints or draws what the ranks return (``trace=True``: the run, with every call)."""
    source = textwrap.dedent(inspect.getsource(driver))
    filename = f"<test driver {driver.__name__}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    names = vars(sys.modules["__main__"])  # (defined there, as a cell would: a hung function is stubbed out in it)
    exec(compile(source, filename, "exec"), names)
    return _launch(names[driver.__name__], world_size, *args, **options)


def _graders_for(*exercises: str) -> list[str]:
    """The pieces of the earlier ``exercises`` to replace by the grader's own (``GRADERS["pieces"]``, which only
    the grader holds): those whose graded test failed.  A later exercise is graded on its own: your earlier
    piece where it passed its test, the grader's where it did not."""
    if "pieces" not in GRADERS:
        return []
    return [_PIECES[e] for e in exercises if PASSED.get(e) is False]


def _with_graders(target: Callable, inputs: tuple, graders: Sequence[str]):
    """(target, inputs) for exercise.run: with ``graders``, the driver and the grader's pieces cross together,
    as source, and the driver gets the names of the pieces to replace as its last argument."""
    if not graders:
        return target, inputs
    helper = GRADERS["planner" if target is _plans_of else "pieces"]
    source = "\n\n".join(textwrap.dedent(inspect.getsource(fn)) for fn in (helper, target))
    return {"name": target.__name__, "source": source}, (*inputs, list(graders))


def _exercise(target: Callable, n: int, inputs: tuple, *, case: str, timeout: float = TIMEOUT, graders=()):
    """exercise.run(target, n, inputs): ``target`` a driver below; ``graders``: the earlier pieces it runs on the
    grader's own versions of (the driver takes them as its last argument)."""
    target, inputs = _with_graders(target, inputs, graders)
    try:
        return exercise.run(target, n, inputs, timeout=timeout)
    except exercise.ExerciseTimeout as e:
        if " was stopped at once: " in str(e):  # under grading: a function that hung before, not run again
            raise AssertionError(f"{case}: {e}") from None
        raise AssertionError(
            f"{case} did not finish within {timeout} s: do all ranks make the same collective "
            f"calls in the same order, and does every send have its receive?\n{e}"
        ) from None


def _expect_value_error(target: Callable, n: int, inputs: tuple, *, case: str, words, graders=()) -> str:
    """Run ``target`` (a driver) on n ranks with ``inputs``: the message of the ValueError your code
    raised there, which must name each of ``words``."""
    target, inputs = _with_graders(target, inputs, graders)
    try:
        exercise.run(target, n, inputs, timeout=TIMEOUT)
    except exercise.ExerciseError as e:
        if all(common.rank_raised(e, "ValueError", str(w)) for w in words):
            return e.exc_message
        got = f"{e.exc_type}: {e.exc_message}" if e.exc_type else str(e)
        raise AssertionError(
            f"{case}: expected your ValueError naming {', '.join(map(str, words))}; got {got}"
        ) from None
    raise AssertionError(f"{case}: expected a ValueError, but it ran without one")


@contextlib.contextmanager
def in_place(pieces: dict, users: list) -> Iterator[None]:
    """Within: ``pieces`` (the grader's own versions of earlier exercises, by name) in the place of yours in
    the notebook names that ``users`` (your functions or classes) look up, on this rank; yours back after.
    (A driver imports it; with no pieces it changes nothing.)"""
    saved, missing = [], object()
    for user in users:  # the notebook's names as your code looks them up, in this rank
        fn = vars(user).get("__init__") if isinstance(user, type) else user
        names = getattr(fn, "__globals__", None)
        if names is None or names.get("__name__") != "__main__" or any(names is s for s, _, _ in saved):
            continue
        for name, piece in pieces.items():
            saved.append((names, name, names.get(name, missing)))
            names[name] = piece
    try:
        yield
    finally:
        for names, name, old in reversed(saved):
            if old is missing:
                names.pop(name, None)
            else:
                names[name] = old


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
    from disttrain_lab.labtests.lab08 import parameters_of

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
    from disttrain_lab.labtests.lab08 import in_place, parameters_of

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
    from disttrain_lab.labtests.lab08 import in_place

    pieces = _graders_pieces(graders) if graders else {}  # noqa: F821  (the grader's, sent with this driver)
    with in_place(pieces, [PipelineStage3D]):  # noqa: F821  (the notebook's)
        grid = pieces.get("grid_groups", grid_groups)(dp, tp, pp)  # noqa: F821
        PipelineStage3D(models.GPT(models.GPTConfig(n_layers=n_layers)), grid)  # noqa: F821


def _train_3d_in_rank(cfg, batches, dp, tp, pp, micro_batches, lr, graders=()):
    """Driver: your train_3d on this rank (cfg: a GPTConfig's fields), what it returned as plain data.
    ``graders``: your earlier pieces that failed their graded test, replaced by the grader's own."""
    from disttrain_lab.labtests.lab08 import in_place

    cfg = models.GPTConfig(**cfg) if isinstance(cfg, dict) else cfg
    pieces = _graders_pieces(graders) if graders else {}  # noqa: F821  (the grader's, sent with this driver)
    with in_place(pieces, [train_3d]):  # noqa: F821  (the notebook's)
        out = train_3d(cfg, batches, dp=dp, tp=tp, pp=pp, micro_batches=micro_batches, lr=lr)  # noqa: F821
    return {
        "losses": [float(l) for l in out["losses"]],
        "step_s": [float(s) for s in out["step_s"]],
        "params": {k: torch.as_tensor(v).detach().clone() for k, v in out["params"].items()},
    }


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


def _check_traffic(run: ExerciseRun, cfg, batch, steps, dp, tp, pp, micro_batches, case: str) -> None:
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


# --------------------------------------------------------------------------------------
# Section 3: the planner (on one rank; the specs cross as their fields)
# --------------------------------------------------------------------------------------
def as_plain(value):
    """``value`` as plain data: numbers, strings, None, lists and tuples of them; anything else described."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        return as_plain(value.tolist())  # a NumPy array or a tensor
    if isinstance(value, (list, tuple)):
        return (tuple if isinstance(value, tuple) else list)(as_plain(v) for v in value)
    return f"{type(value).__name__} {value!r:.80}"


def specs_of(classes: tuple, model=None, cluster=None, plan=None) -> list:
    """The ModelSpec, ClusterSpec and Plan given by their fields (those given, in this order), built with the
    notebook's classes (``classes``: its ModelSpec, ClusterSpec and Plan, as the driver has them)."""
    model_spec, cluster_spec, plan_class = classes
    out = [] if model is None else [model_spec(**model)]
    if cluster is not None:
        network = dict(cluster["network"])
        inter = network.pop("inter")
        network = Network(**network, inter=None if inter is None else Network(**inter))
        out.append(cluster_spec(**{**cluster, "network": network}))
    return out + ([] if plan is None else [plan_class(**plan)])


def _memory_of(model, cluster, plan, sp=None):
    """Driver: your memory_per_device on the specs given by their fields (``sp``: passed when not None)."""
    from disttrain_lab.labtests.lab08 import as_plain, specs_of

    specs = specs_of((ModelSpec, ClusterSpec, Plan), model, cluster, plan)  # noqa: F821  (the notebook's)
    return as_plain(memory_per_device(*specs) if sp is None else memory_per_device(*specs, sp=sp))  # noqa: F821


def _step_times_of(model, cluster, plans):
    """Driver: your step_time of each plan, the specs given by their fields."""
    from disttrain_lab.labtests.lab08 import as_plain, specs_of

    model, cluster = specs_of((ModelSpec, ClusterSpec, Plan), model, cluster)  # noqa: F821  (the notebook's)
    return [as_plain(step_time(model, cluster, Plan(**plan))) for plan in plans]  # noqa: F821  (the notebook's)


def _plans_of(model, cluster, sp=None, graders=()):
    """Driver: your plan_parallelism's plans as (dp, tp, pp, micro_batches, zero, step_s, memory, your
    step_time of the plan), or what each is if not a Plan; what it returned if not a list.  ``sp``: passed when
    not None.  ``graders``: your memory_per_device or step_time where it failed its test, replaced by the
    grader's own."""
    from disttrain_lab.labtests.lab08 import as_plain, in_place, specs_of

    model, cluster = specs_of((ModelSpec, ClusterSpec, Plan), model, cluster)  # noqa: F821  (the notebook's)
    pieces = _graders_planner(graders) if graders else {}  # noqa: F821  (the grader's, sent with this driver)
    with in_place(pieces, [plan_parallelism]):  # noqa: F821  (the notebook's)
        got = plan_parallelism(model, cluster) if sp is None else plan_parallelism(model, cluster, sp=sp)  # noqa: F821
        timed = pieces.get("step_time", step_time)  # noqa: F821
        if not isinstance(got, list):
            return type(got).__name__
        return [
            (
                p.dp,
                p.tp,
                p.pp,
                p.micro_batches,
                p.zero,
                as_plain(p.step_s),
                as_plain(p.memory),
                as_plain(timed(model, cluster, replace(p, step_s=math.nan, memory=math.nan))),  # noqa: F821
            )
            if isinstance(p, Plan)  # noqa: F821
            else type(p).__name__
            for p in got
        ]


def check_memory(model: Spec, cluster: Spec, plan: Spec, sp: bool | None = None, *, reference: Callable) -> None:
    """memory_per_device(model, cluster, plan) (with ``sp=sp`` when given) equals ``reference(model, plan,
    sp)``, the text's formulas written in the graded cell: 16 bytes per parameter sharded by ZeRO stage, plus
    the activations (plain TP's or sequence parallelism's) of L/pp layers and min(pp, m) micro-batches."""
    call = f"memory_per_device(..., {plan}" + ("" if sp is None else f", sp={sp}") + ")"
    try:
        got = exercise.run(_memory_of, 1, (_fields(model), _fields(cluster), _fields(plan), sp), timeout=60).results[0]
    except exercise.ExerciseError as e:
        raise AssertionError(f"{call} raised {e.exc_type}: {e.exc_message}" if e.exc_type else f"{call}: {e}") from None
    want = reference(model, plan, bool(sp))
    if not (isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-6)):
        b = model.batch / (plan.dp * plan.micro_batches)
        rule = (
            "34·s·b·h/tp per layer (sequence parallelism splits all of it)"
            if sp
            else "s·b·h·(10 + 24/tp) per layer (plain TP splits 24 sbh; the block's input and output, 10 sbh, "
            "stay whole)"
        )
        shown = got / 1e9 if isinstance(got, (int, float)) else got
        raise AssertionError(
            f"{call} with L={model.layers}, h={model.hidden}, s={model.seq}, b={b:g}: expected "
            f"{want / 1e9:.4f} GB, got {shown} GB.  Activations: {rule}, times L/pp layers and "
            f"min(pp, m) micro-batches in flight; states: 16 bytes per parameter, sharded by ZeRO stage"
        )


def choose_planner_graders(model: Spec, cluster: Spec, plan: Spec) -> list[str]:
    """Decide, once per run of plan_parallelism's graded cell, the pieces it is graded on: memory_per_device
    and step_time where yours fails (its graded test, or ``plan`` of the worked example ``model`` on
    ``cluster``), replaced by the grader's own when it holds them (``GRADERS["planner"]``): plan_parallelism is
    graded on its own.  Returns them."""
    global _PLANNER_GRADERS
    _PLANNER_GRADERS = []
    if "planner" not in GRADERS:
        return _PLANNER_GRADERS
    graders = ["memory_per_device"] if PASSED.get("planner_memory") is False else []
    try:
        times = exercise.run(_step_times_of, 1, (_fields(model), _fields(cluster), [_fields(plan)]), timeout=60)
        [t] = times.results[0]
        works = isinstance(t, float) and math.isfinite(t) and t > 0
    except exercise.ExerciseError:
        works = False
    _PLANNER_GRADERS = graders + ([] if works else ["step_time"])
    return _PLANNER_GRADERS


def plans_for(model: Spec, cluster: Spec, sp: bool | None = None) -> list:
    """Your plan_parallelism(model, cluster) (with ``sp=sp`` when given), run in your kernel: (dp, tp, pp, m,
    zero, step_s, memory, your step_time of the plan) for each plan."""
    target, inputs = _with_graders(_plans_of, (_fields(model), _fields(cluster), sp), _PLANNER_GRADERS)
    return exercise.run(target, 1, inputs, timeout=60).results[0]


def check_plans(model: Spec, cluster: Spec, case: str, sp: bool | None = None, *, reference: Callable) -> list:
    """plan_parallelism(model, cluster) (``sp``: passed when given) lists every valid plan that fits, once:
    tp dividing the heads, pp the layers, dp · m the batch, ZeRO 1-3 only where dp > 1, each whose memory
    ``reference(model, plan, sp)`` (the graded cell's formulas) is within the device's; each with that memory
    and its step_time, fastest first.  Returns the plans (the notebook's Plan)."""
    case = case if sp is None else f"{case}, sp={sp}"
    got = plans_for(model, cluster, sp)
    assert isinstance(got, list) and all(isinstance(p, tuple) for p in got), (
        f"{case}: expected a list of Plan, got {got if isinstance(got, str) else type(got).__name__}"
    )
    plan_class = _notebook("Plan")
    want = set()
    for tp in range(1, cluster.devices + 1):
        for pp in range(1, cluster.devices + 1):
            if cluster.devices % (tp * pp) or model.heads % tp or model.layers % pp:
                continue
            dp = cluster.devices // (tp * pp)
            for m in range(1, model.batch + 1):
                if model.batch % (dp * m) == 0:
                    for z in range(4) if dp > 1 else (0,):
                        if reference(model, plan_class(dp, tp, pp, m, z), bool(sp)) <= cluster.memory:
                            want.add((dp, tp, pp, m, z))
    shapes = [p[:5] for p in got]
    assert len(shapes) == len(set(shapes)), f"{case}: a plan is listed twice"
    missing, extra = sorted(want - set(shapes)), sorted(set(shapes) - want)
    assert not missing and not extra, (
        f"{case}: (dp, tp, pp, m, zero) missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
        f"not valid or not fitting {extra[:5]}{'...' if len(extra) > 5 else ''}"
    )
    wrong = [p for p in got if not all(isinstance(v, (int, float)) for v in p[5:])]
    assert not wrong, f"{case}: step_s and memory must be numbers (seconds, bytes), got {wrong[:3]}"
    plans = [plan_class(*p[:5], step_s=p[5], memory=p[6]) for p in got]
    for p, (*_, yours) in zip(plans, got):
        assert math.isclose(p.memory, reference(model, p, bool(sp)), rel_tol=1e-6), f"{case}: {p}: wrong memory" + (
            " (memory_per_device(..., sp=True): sequence parallelism's)" if sp else ""
        )
        assert math.isclose(p.step_s, yours, rel_tol=1e-9), f"{case}: {p}: step_s is not step_time(...)"
    assert all(a.step_s <= b.step_s for a, b in zip(plans, plans[1:])), (
        f"{case}: the plans must be sorted fastest first"
    )
    return plans


def _spearman(x, y) -> float:
    """Spearman's rank correlation (no ties): the Pearson correlation of the ranks."""
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


def check_step_time_ranking(model: Spec, cluster: Spec, plans: list) -> float:
    """step_time of the measured configurations (``plans``: MEASURED's runs, in order, on its ``model`` and
    emulated ``cluster``) gives positive seconds that rank them as measured: Spearman's rank correlation at
    least 0.7, and the measured fastest among the 3 fastest predicted.  Returns the correlation."""
    p = exercise.run(
        _step_times_of, 1, (_fields(model), _fields(cluster), [_fields(plan) for plan in plans]), timeout=60
    ).results[0]  # yours, run in your kernel
    m = [r["median_step_s"] for r in MEASURED["runs"]]
    assert all(isinstance(t, float) and t > 0 for t in p), f"step_time must give positive seconds, got {p}"
    rho = _spearman(p, m)
    assert rho >= 0.7, f"Spearman rank correlation of step_time with the measured step times: {rho:.2f} < 0.7"
    order = sorted(range(len(p)), key=p.__getitem__)
    assert order.index(int(np.argmin(m))) < 3, (
        f"the measured fastest, {plans[int(np.argmin(m))]}, is number "
        f"{order.index(int(np.argmin(m))) + 1} of the predictions (at most 3)"
    )
    return rho


def check_step_time(model: Spec, cluster: Spec, plan: Spec, *, reference: Callable) -> None:
    """step_time(model, cluster, plan) equals ``reference(model, cluster.network, cluster.flops, plan)``, the
    cost model of the text, held by the graded cell: (m + pp − 1) · (compute + TP + PP) + DP, each group paying
    the slowest tier it spans."""
    want = reference(model, cluster.network, cluster.flops, plan)
    [got] = exercise.run(_step_times_of, 1, (_fields(model), _fields(cluster), [_fields(plan)]), timeout=60).results[0]
    assert math.isclose(got, want, rel_tol=1e-6), (
        f"step_time({plan}) on {cluster.network}: expected {want:.6g} s, got {got}: "
        f"(m + pp − 1) · (compute + TP + PP) + DP, "
        f"each group paying the slowest tier it spans"
        + (
            "; ZeRO 3's DP is (1 + 2m)/2 all-reduces (the weights gathered for each micro-batch's forward and backward)"
            if plan.zero == 3
            else ""
        )
    )


# --------------------------------------------------------------------------------------
# Section 4: LARS (on one rank)
# --------------------------------------------------------------------------------------
def _lars_in_rank(ws, grads, groups, lrs, options):
    """Driver: your LARS on parameters ``ws`` (``groups``: the options of 2 parameter groups, the first
    holding ws[0]), one step per gradient in each ``grads[i]``, the rate ``lrs[k]`` set before step k;
    the parameters after."""
    params = [nn.Parameter(w.clone()) for w in ws]
    if groups:
        optimizer = LARS([{"params": params[:1], **groups[0]}, {"params": params[1:], **groups[1]}], **options)  # noqa: F821
    else:
        optimizer = LARS(params, **options)  # noqa: F821  (the notebook's)
    for k in range(len(grads[0])):
        if lrs:
            for group in optimizer.param_groups:
                group["lr"] = lrs[k]
        optimizer.zero_grad()
        for p, g in zip(params, grads):
            p.grad = g[k].clone()
        optimizer.step()
    return [p.detach().clone() for p in params]


def _lars_without_grad():
    """Driver: your LARS stepping two parameters of ones, the second without a gradient: that one after
    the step, and whether the optimizer keeps state for it."""
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    optimizer = LARS([p, q], lr=1.0)  # noqa: F821  (the notebook's)
    p.grad = torch.ones(3)
    optimizer.step()
    return {"q": q.detach().clone(), "state": bool(q in optimizer.state and optimizer.state[q])}


def check_lars_without_grad() -> None:
    """LARS leaves a parameter whose .grad is None alone and keeps no state for it."""
    got = exercise.run(_lars_without_grad, 1, timeout=60).results[0]
    assert torch.equal(got["q"], torch.ones(2)), (
        f"LARS: a parameter whose .grad is None must be left alone; it changed from ones(2) to {got['q']}"
    )
    assert not got["state"], (
        "LARS: a parameter whose .grad is None gets no state: optimizer.state[p] should stay empty "
        "(create the momentum buffer at the first step that has a gradient)"
    )


def check_lars(
    shapes: Sequence,
    steps: int,
    groups: list | None = None,
    lrs: list | None = None,
    seed: int = 0,
    *,
    reference: Callable,
    **options,
) -> None:
    """LARS(**options) on tensors of ``shapes`` (``zero_weight=i``: tensor i all zeros; ``zero_grad=i``: its
    gradients zero), ``steps`` steps, equals ``reference`` (the text's formulas, step by step in float64, held by
    the notebook): trust = η‖w‖ / (‖∇‖ + λ‖w‖ + ε), 1 for a zero weight or gradient; v = μv + lr · trust ·
    (∇ + λw); w = w − v.  ``groups``: per-tensor options of 2 parameter groups; ``lrs``: the rate of each step."""
    zero_grad, zero_weight = options.pop("zero_grad", None), options.get("zero_weight")
    ws = [torch.zeros(s) if seed < 0 else checks.sample_tensor(s, seed=seed + i) for i, s in enumerate(shapes)]
    ws = [w * 0 if i == options.get("zero_weight") else w for i, w in enumerate(ws)]
    options.pop("zero_weight", None)
    grads = [
        [checks.sample_tensor(s, seed=100 * (k + 1) + i) * (0 if i == zero_grad else 1) for k in range(steps)]
        for i, s in enumerate(shapes)
    ]
    params = exercise.run(_lars_in_rank, 1, (ws, grads, groups, lrs, options), timeout=60).results[0]
    for i, (p, w) in enumerate(zip(params, ws)):
        mine = {**options, **(groups[0] if groups and i == 0 else groups[1] if groups else {})}
        expected = reference(w, grads[i], lrs=lrs, **mine)
        rule = (
            " — a zero weight: ‖w‖ = 0, so its trust ratio is 1 and its first step is lr · (∇ + λw)"
            if i == zero_weight
            else " — a zero gradient: ‖∇‖ = 0, so its trust ratio is 1 (weight decay still moves it)"
            if i == zero_grad
            else " — trust = η‖w‖ / (‖∇‖ + λ‖w‖ + ε), v = μv + lr · trust · (∇ + λw), w = w − v"
        )
        checks.assert_close(
            p,
            expected,
            what=f"LARS({mine}) after {steps} step(s): tensor {i} of shape {tuple(shapes[i])}{rule}",
            rtol=1e-5,
            atol=1e-6,
        )


# --------------------------------------------------------------------------------------
# Section 5: scaling laws (on one rank)
# --------------------------------------------------------------------------------------
def _fit_power_law_of(x, y):
    """Driver: your fit_power_law(x, y), as plain data."""
    from disttrain_lab.labtests.lab08 import as_plain

    return as_plain(fit_power_law(x, y))  # noqa: F821  (the notebook's)


def _compute_optimal_of(*args):
    """Driver: your compute_optimal(*args), as plain data."""
    from disttrain_lab.labtests.lab08 import as_plain

    return as_plain(compute_optimal(*args))  # noqa: F821  (the notebook's)


def check_fit(x: Sequence[float], y: Sequence[float], case: str, *, reference: Callable) -> None:
    """fit_power_law(x, y) gives (c, e) within 1e-6 of ``reference(x, y)``, the least-squares fit of log y on
    log x written in the graded cell."""
    got = exercise.run(_fit_power_law_of, 1, (list(x), list(y)), timeout=60).results[0]
    want = reference(x, y)
    assert len(got) == 2 and all(math.isclose(g, w, rel_tol=1e-6) for g, w in zip(got, want)), (
        f"fit_power_law on {case}: expected (c, e) = ({want[0]:.6g}, {want[1]:.6g}), got {got}"
    )


def check_fit_rejects(x: Sequence, y: Sequence, why: str) -> None:
    """fit_power_law(x, y) on input it cannot fit (``why``) raises a ValueError."""
    bad = (x, y)
    try:
        exercise.run(_fit_power_law_of, 1, bad, timeout=60)
    except exercise.ExerciseError as e:
        if e.exc_type != "ValueError":
            raise AssertionError(
                f"fit_power_law{bad} ({why}) should raise a ValueError saying what is wrong; it raised "
                f"{e.exc_type or 'an error'}: {e.exc_message or e}"
            ) from None
    else:
        raise AssertionError(f"fit_power_law{bad} ({why}) should raise a ValueError saying what is wrong")


def check_optimal(flops: float, ratio: float | None = None, *, reference: Callable) -> None:
    """compute_optimal(flops) (``ratio`` tokens per parameter when given, else its default of 20) gives
    (Ψ, D) within 1e-9 of ``reference(flops, ratio)``, the graded cell's C = 6 Ψ D with D = ratio · Ψ."""
    args = (flops,) if ratio is None else (flops, ratio)
    got = exercise.run(_compute_optimal_of, 1, args, timeout=60).results[0]
    want_n, want_d = reference(flops, 20.0 if ratio is None else ratio)
    right = len(got) == 2 and math.isclose(got[0], want_n, rel_tol=1e-9) and math.isclose(got[1], want_d, rel_tol=1e-9)
    assert right, (
        f"compute_optimal({flops:g}"
        + ("" if ratio is None else f", {ratio}")
        + f"): expected ({want_n:.6g}, {want_d:.6g}), got {got}"
    )


def check_optimal_rejects(args: tuple) -> None:
    """compute_optimal(*args) with a budget or ratio that is not a finite positive number raises a ValueError."""
    try:
        exercise.run(_compute_optimal_of, 1, args, timeout=60)
    except exercise.ExerciseError as e:
        if e.exc_type != "ValueError":
            raise AssertionError(
                f"compute_optimal{args}: flops and tokens_per_param must be finite positive numbers, so "
                f"this should raise a ValueError; it raised {e.exc_type or 'an error'}: "
                f"{e.exc_message or e}"
            ) from None
    else:
        raise AssertionError(
            f"compute_optimal{args}: flops and tokens_per_param must be finite positive numbers "
            "(not 0, a negative, inf, nan or a string); expected a ValueError"
        )
