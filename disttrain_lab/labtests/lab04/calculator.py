"""Lab 4's exercise 1: the memory calculator (one rank), against the reference its graded cell hands in."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ... import exercise


# --------------------------------------------------------------------------------------
# Exercise 1: the memory calculator
# --------------------------------------------------------------------------------------
def _ask_calculator(cases):
    """The test's driver, run next to the notebook's code: zero_memory_per_rank(*args, **kwargs) for each case
    (args, kwargs).  Returns data: each answer's items (numbers as numbers, anything else as its repr), or the
    repr of an answer that is not a dict, or what it raised."""
    answers = []
    for args, kwargs in cases:
        try:
            got = zero_memory_per_rank(*args, **kwargs)  # noqa: F821  (the notebook's)
        except Exception as e:
            answers.append(
                {"raised": type(e).__name__, "value_error": isinstance(e, ValueError), "message": str(e)[:500]}
            )
            continue
        if not isinstance(got, dict):
            answers.append({"other": repr(got)[:200]})
            continue
        items = {}
        for key, value in got.items():
            if type(value) not in (int, float, bool):
                try:
                    value = value.item()  # a numpy or torch scalar
                except Exception:
                    pass
            items[str(key)] = value if type(value) in (int, float, bool) else repr(value)[:100]
        answers.append({"dict": items})
    return answers


def _check_calculator(formula: Callable, psi: int, stage: int, n: int, answer: dict, **bytes_per_element) -> None:
    short = {"param_bytes": "pb", "grad_bytes": "gb", "optimizer_bytes": "ob"}
    want = formula(psi, stage, n, **{short[k]: v for k, v in bytes_per_element.items()})
    case = (
        f"zero_memory_per_rank({psi}, stage={stage}, world_size={n}"
        + "".join(f", {k}={v}" for k, v in bytes_per_element.items())
        + ")"
    )
    assert "raised" not in answer, f"{case} raised {answer['raised']}: {answer['message']}"
    got = answer.get("dict")
    assert isinstance(got, dict) and set(want) <= set(got), (
        f"{case} should return a dict with the keys {sorted(want)}, "
        f"got {got if got is not None else answer.get('other')!r}"
    )
    for key in want:
        assert got[key] == want[key], (
            f"{case}[{key!r}] = {got[key]}, expected {want[key]} (a sharded part is held for ceil(Ψ/N) = "
            f"{-(-psi // n)} parameters, an unsharded one for all Ψ = {psi}; stage {stage} shards "
            f"{['nothing', 'the optimizer state', 'optimizer state and gradients', 'everything'][stage]})"
        )


def check_zero_memory(formula: Callable, cases: Sequence[tuple], bad: Sequence[dict] = ()) -> None:
    """Exercise 1, ``zero_memory_per_rank(num_parameters, stage, world_size, param_bytes=2, grad_bytes=2,
    optimizer_bytes=12)``: for each case ``(Ψ, N)`` or ``(Ψ, N, bytes per element)`` and every stage 0-3,
    a dict whose "parameters", "gradients", "optimizer_state" and "total" are ``formula``'s (the graded
    cell's: ceil(Ψ/N) parameters for a part the stage shards, Ψ for one it does not); and a ValueError
    for each set of arguments in ``bad`` (a stage other than 0-3, a world_size below 1).  One run on one
    rank, stage by stage."""
    cases = [(psi, stage, n, dict(rest[0]) if rest else {}) for stage in range(4) for psi, n, *rest in cases]
    asked = [((psi, stage, n), kwargs) for psi, stage, n, kwargs in cases] + [((100,), kwargs) for kwargs in bad]
    try:
        run = exercise.run(_ask_calculator, 1, (asked,), timeout=60)
    except exercise.ExerciseTimeout as e:
        raise AssertionError(f"zero_memory_per_rank did not return within 60 s\n{e}") from None
    answers = run.results[0]
    assert isinstance(answers, list) and len(answers) == len(asked), (
        f"expected {len(asked)} answers, got {answers!r:.200}"
    )
    for (psi, stage, n, kwargs), answer in zip(cases, answers):
        _check_calculator(formula, psi, stage, n, answer, **kwargs)
    for kwargs, answer in zip(bad, answers[len(cases) :]):
        assert answer.get("value_error"), f"zero_memory_per_rank(100, **{kwargs}) should raise ValueError" + (
            f"; it raised {answer['raised']}: {answer['message']}" if "raised" in answer else ""
        )
