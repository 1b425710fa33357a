"""What every check of lab 8 shares: the lab's constants, what only the grader holds (``PASSED``,
``GRADERS``), running a driver on ranks with the grader's pieces in place of failed ones."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import linecache
import numbers
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ... import exercise, models
from ...launcher import launch as _launch
from ...network import Network
from .. import common

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

# data/step_times.json's model, emulated cluster and median step times, copied here: the graded test runs
# where the lab's data/ folder is not
MEASURED = {
    "model": {"layers": 2, "hidden": 32, "heads": 8, "seq": 16, "batch": 64, "vocab": 32, "bytes_per_value": 4},
    "cluster": {
        "devices": 8,
        "devices_per_node": 4,
        "memory": 1000000000.0,
        "flops": 433264577.9880237,
        "intra": {"latency": 0.002, "bandwidth": 10000000.0, "name": "bench intra-node link (10 MB/s, 2 ms)"},
        "inter": {"latency": 0.005, "bandwidth": 1000000.0, "name": "bench inter-node link (1 MB/s, 5 ms)"},
    },
    "runs": [
        dict(dp=2, tp=2, pp=2, micro_batches=2, zero=0, median_step_s=0.2711772399925394),
        dict(dp=8, tp=1, pp=1, micro_batches=1, zero=0, median_step_s=0.3294421769969631),
        dict(dp=1, tp=8, pp=1, micro_batches=1, zero=0, median_step_s=2.4391191949980566),
        dict(dp=4, tp=2, pp=1, micro_batches=1, zero=0, median_step_s=0.24422238700208254),
        dict(dp=2, tp=4, pp=1, micro_batches=1, zero=0, median_step_s=0.27372046100208536),
        dict(dp=4, tp=1, pp=2, micro_batches=2, zero=0, median_step_s=0.16563227400183678),
        dict(dp=1, tp=4, pp=2, micro_batches=2, zero=0, median_step_s=0.5009993450075854),
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


def _with_graders(target: Callable, inputs: tuple, graders: Sequence[str], helper: str | None = None):
    """(target, inputs) for exercise.run: with ``graders``, the driver and the grader's pieces cross together,
    as source, and the driver gets the names of the pieces to replace as its last argument.  ``helper``: the
    source that defines them (default: ``GRADERS["pieces"]``'s; the planner's is ``planner._stand_ins_source``)."""
    if not graders:
        return target, inputs
    helper = textwrap.dedent(inspect.getsource(GRADERS["pieces"])) if helper is None else helper
    source = f"{helper}\n\n{textwrap.dedent(inspect.getsource(target))}"
    return {"name": target.__name__, "source": source}, (*inputs, list(graders))


def _exercise(target: Callable, n: int, inputs: tuple, *, case: str, timeout: float = TIMEOUT, graders=()):
    """exercise.run(target, n, inputs): ``target`` a driver below; ``graders``: the earlier pieces it runs on the
    grader's own versions of (the driver takes them as its last argument)."""
    target, inputs = _with_graders(target, inputs, graders)
    try:
        return exercise.run(target, n, inputs, timeout=timeout, content=True)  # (the calls: ``wirecalls``)
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
