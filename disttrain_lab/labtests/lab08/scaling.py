"""Lab 8's section 5 checks: the scaling-law fit and the compute-optimal size (on one rank)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ... import exercise


# --------------------------------------------------------------------------------------
# Section 5: scaling laws (on one rank)
# --------------------------------------------------------------------------------------
def _fit_power_law_of(x, y):
    """Driver: your fit_power_law(x, y), as plain data."""
    from disttrain_lab.labtests.lab08.common import as_plain

    return as_plain(fit_power_law(x, y))  # noqa: F821  (the notebook's)


def _compute_optimal_of(*args):
    """Driver: your compute_optimal(*args), as plain data."""
    from disttrain_lab.labtests.lab08.common import as_plain

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
