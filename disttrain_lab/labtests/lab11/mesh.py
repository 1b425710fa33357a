"""Lab 11's exercises 5-6: ``mesh_groups`` and ``memory_per_device_5d`` (one rank), against the
references their graded cells hand in."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ... import exercise
from .common import TIMEOUT


# --------------------------------------------------------------------------------------
# Exercise 5: mesh_groups (on one rank)
# --------------------------------------------------------------------------------------
def check_groups(sizes: dict, dims: str | Sequence[str], *, reference: Callable) -> None:
    """mesh_groups(sizes, dims) equals ``reference(sizes, dims)`` (the graded cell's: the grid torch's
    DeviceMesh builds, row-major, its groups along ``dims``), each group sorted, sorted by their first rank."""
    case = f"mesh_groups({sizes}, {dims!r})"
    got = exercise.run("mesh_groups", 1, (sizes, dims), timeout=TIMEOUT).results[0]
    want = reference(sizes, dims)
    assert isinstance(got, list) and [list(g) for g in got] == want, (
        f"{case}: got {got}; the grid is torch.arange({math.prod(sizes.values())}).view{tuple(sizes.values())} "
        f"(row-major, the last dimension fastest), and the groups of {dims!r} are the ranks differing there only, "
        f"each sorted, sorted by their first rank: {want}"
    )


def check_expert_grid(pp: int, dp: int, cp: int, tp: int, ep: int, *, reference: Callable) -> None:
    """The dense grid pp × dp × cp × tp and the experts' view of the same ranks, pp × (dp·cp/ep) × ep × tp:
    your groups of both (against ``reference``), and each of your ep groups inside one of your dp·cp groups."""
    dense, expert = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}, {"pp": pp, "edp": dp * cp // ep, "ep": ep, "tp": tp}
    for sizes, dims in ((dense, ("dp", "cp")), (expert, "ep"), (expert, "edp"), (expert, "pp")):
        check_groups(sizes, dims, reference=reference)
    dp_cp = exercise.run("mesh_groups", 1, (dense, ("dp", "cp")), timeout=TIMEOUT).results[0]
    for group in exercise.run("mesh_groups", 1, (expert, "ep"), timeout=TIMEOUT).results[0]:
        assert any(set(group) <= set(g) for g in dp_cp), (
            f"pp={pp}, dp={dp}, cp={cp}, tp={tp}, ep={ep}: the ep group {group} is not inside one dp·cp group {dp_cp}"
        )


# --------------------------------------------------------------------------------------
# Exercise 6: memory_per_device_5d (on one rank)
# --------------------------------------------------------------------------------------
_DEFAULTS = dict(experts=1, dp=1, tp=1, pp=1, cp=1, ep=1, micro_batches=1, zero=0, sp=False)


def _memory_5d_of(config):
    """The test's driver: your memory_per_device_5d on this configuration, as a plain number."""
    got = memory_per_device_5d(**config)  # noqa: F821  (the notebook's)
    return float(got) if isinstance(got, (int, float)) or hasattr(got, "__float__") else repr(got)


def check_5d(model: dict, reference: Callable, lab8_reference: Callable, **grid) -> None:
    """memory_per_device_5d(world=dp·tp·pp·cp, **model, **grid) equals ``reference(config)`` (the graded cell's
    formulas), which reduces to Lab 8's memory_per_device (``lab8_reference``) where cp = ep = experts = 1:
    states zero(Ψ_dense, dp·cp) + zero(Ψ_expert, dp·cp/ep), activations of s/cp tokens per layer."""
    config = {**_DEFAULTS, **model, **grid}
    config["world"] = config["dp"] * config["tp"] * config["pp"] * config["cp"]
    shown = ", ".join(
        f"{k}={config[k]}" for k in ("world", "experts", "dp", "tp", "pp", "cp", "ep", "micro_batches", "zero", "sp")
    )
    try:
        got = exercise.run(_memory_5d_of, 1, (config,), timeout=TIMEOUT).results[0]
    except exercise.ExerciseError as e:
        raise AssertionError(
            f"memory_per_device_5d({shown}) raised {e.exc_type}: {e.exc_message}"
            if e.exc_type
            else f"memory_per_device_5d({shown}): {e}"
        ) from None
    want = reference(config)
    lab8 = config["cp"] == config["ep"] == config["experts"] == 1
    if lab8:
        assert math.isclose(want, lab8_reference(config), rel_tol=1e-12)  # the reference reduces to Lab 8's
    assert isinstance(got, float) and math.isclose(got, want, rel_tol=1e-6), (
        f"memory_per_device_5d({shown}) with L={config['layers']}, h={config['hidden']}, s={config['seq']}, "
        f"B={config['batch']}, V={config['vocab']}: expected {want / 1e9:.4f} GB, got "
        f"{got / 1e9 if isinstance(got, float) else got} GB.  States: zero(Ψ_dense, dp·cp) + zero(Ψ_expert, dp·cp/ep), "
        f"Ψ_dense = (4Lh² + 2Vh)/(tp·pp), Ψ_expert = 8Lh²·E/(tp·pp·ep); activations of s/cp tokens per layer, times "
        f"L/pp layers and min(pp, m) micro-batches"
        + ("; with cp = ep = experts = 1 this is Lab 8's memory_per_device" if lab8 else "")
    )


def check_5d_error(model: dict, world: int, needles: Sequence[Sequence[str]], rule: str, **grid) -> None:
    """memory_per_device_5d(world=world, **model, **grid) on an invalid grid (``rule``) raises a ValueError
    naming the rule and the values: for each group of ``needles``, one of them in its message."""
    config = {**_DEFAULTS, **model, **grid, "world": world}
    case = f"memory_per_device_5d(world={world}, " + ", ".join(f"{k}={v}" for k, v in grid.items()) + f") ({rule})"
    try:
        exercise.run(_memory_5d_of, 1, (config,), timeout=TIMEOUT)
    except exercise.ExerciseError as e:
        message = e.exc_message or ""
        if e.exc_type == "ValueError" and all(any(n in message for n in alternatives) for alternatives in needles):
            return
        got = f"{e.exc_type}: {message}" if e.exc_type is not None else str(e)
        raise AssertionError(
            f"{case}: expected a ValueError naming the rule and the values "
            f"({' and '.join(' or '.join(map(repr, a)) for a in needles)}); got {got}"
        ) from None
    raise AssertionError(f"{case}: expected a ValueError ({rule}), but it returned a number")
