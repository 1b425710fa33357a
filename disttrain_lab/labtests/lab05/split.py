"""Lab 5's exercise 1: ``split_stages``, checked on the grader's own copy of each model."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ... import exercise, models


def _split_in_rank(cases):
    """A driver (dl.exercise.run defines it where the notebook's code runs): the notebook's split_stages on
    models.MLP(sizes, seed=0) for each (sizes, p) of ``cases``.  Per case, as data: each stage's layers as
    (name, whether it is the model's own layer object), or the repr of what came back if that is not p modules."""
    found = []
    for sizes, p in cases:
        model = models.MLP(sizes, seed=0)
        own = dict(model.named_children())
        stages = split_stages(model, p)  # noqa: F821  (the notebook's)
        if isinstance(stages, (list, tuple)) and len(stages) == p and all(isinstance(s, nn.Module) for s in stages):
            found.append([[(name, layer is own.get(name)) for name, layer in s.named_children()] for s in stages])
        else:
            found.append(repr(stages)[:300])
    return found


def _split(cases: list) -> list:
    """What split_stages returned for each (MLP sizes, p) of ``cases``, in one run where the notebook's code runs."""
    try:
        found = exercise.run(_split_in_rank, 1, (cases,), timeout=60).results[0]
    except exercise.ExerciseTimeout as e:
        raise AssertionError(f"split_stages did not finish within 60 s (an endless loop?)\n{e}") from None
    assert isinstance(found, list) and len(found) == len(cases), f"expected one split per case, got {found!r:.200}"
    return found


def _check_split(sizes: Sequence[int], p: int, found, largest: int | None = None) -> list[int]:
    """What split_stages returned for MLP(sizes) and p stages, against the grader's own copy of the model."""
    model = models.MLP(sizes, seed=0)
    case = f"split_stages({type(model).__name__} with {len(model)} layers, {p})"
    assert isinstance(found, list) and len(found) == p, f"{case}: expected a list of {p} stages, got {found}"
    layers = dict(model.named_children())
    assert [name for stage in found for name, _ in stage] == list(layers) and all(
        own for stage in found for _, own in stage
    ), (
        f"{case}: the stages must hold the model's own layers, in order, each once, under their names; got "
        f"{[[name for name, _ in stage] for stage in found]}"
    )
    for s, stage in enumerate(found):
        assert len(stage) > 0, f"{case}: stage {s} is empty"
        first = layers[stage[0][0]]
        assert s == 0 or any(True for _ in first.parameters()), (
            f"{case}: stage {s} starts with {type(first).__name__}, which has no parameters; cut only before a "
            f"layer with parameters"
        )
    per_stage = [sum(q.numel() for name, _ in stage for q in layers[name].parameters()) for stage in found]
    if largest is not None:
        assert max(per_stage) == largest, (
            f"{case}: parameters per stage {per_stage}; the most balanced split has at most {largest} in its "
            f"largest stage"
        )
    return per_stage


def check_split(cases: Sequence[tuple[Sequence[int], int, int | None]]) -> None:
    """Exercise 1, ``split_stages(model, num_stages)``, on ``models.MLP(sizes)`` for each case ``(sizes, p,
    largest)``: p stages (nn.Modules) holding the model's own layers, in order, each once, under their names;
    no stage empty; each stage but the first starts with a layer that has parameters; and, where ``largest``
    is given, the largest stage holds that many parameters (the most balanced split).  One run on one rank."""
    for (sizes, p, largest), found in zip(cases, _split([(sizes, p) for sizes, p, _ in cases])):
        _check_split(sizes, p, found, largest)


def check_split_refused(sizes: Sequence[int], p: int) -> None:
    """Exercise 1: ``split_stages(MLP(sizes), p)`` with fewer layers with parameters than p stages raises
    ValueError."""
    case = f"split_stages(MLP({sizes}), {p})"
    try:
        _split([(sizes, p)])
    except exercise.ExerciseError as e:
        if e.exc_type == "ValueError":
            return
        if e.exc_type is None:  # not the student's own exception
            raise
        raise AssertionError(
            f"{case}: the model has {len(sizes) - 1} layers with parameters, so {p} stages are "
            f"impossible: raise ValueError, not {e.exc_type}.\n{e}"
        ) from None
    raise AssertionError(
        f"{case}: the model has {len(sizes) - 1} layers with parameters, so {p} stages are impossible: raise ValueError"
    )
