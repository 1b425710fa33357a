"""Lab 8's section 3 checks: the parallelism planner (memory per device, step time, the plans and
their ranking), run on one rank; the specs cross as their fields."""

from __future__ import annotations

import inspect
import math
import textwrap
from collections.abc import Callable

import numpy as np

from ... import exercise
from .common import GRADERS, MEASURED, PASSED, Spec, _fields, _notebook, _with_graders

_PLANNER_GRADERS: list[str] = []  # the planner's pieces plan_parallelism is graded on (choose_planner_graders)


# --------------------------------------------------------------------------------------
# Section 3: the planner (on one rank; the specs cross as their fields)
# --------------------------------------------------------------------------------------
def _memory_of(model, cluster, plan, sp=None):
    """Driver: your memory_per_device on the specs given by their fields (``sp``: passed when not None)."""
    from disttrain_lab.labtests.lab08.common import as_plain, specs_of

    specs = specs_of((ModelSpec, ClusterSpec, Plan), model, cluster, plan)  # noqa: F821  (the notebook's)
    return as_plain(memory_per_device(*specs) if sp is None else memory_per_device(*specs, sp=sp))  # noqa: F821


def _step_times_of(model, cluster, plans):
    """Driver: your step_time of each plan, the specs given by their fields."""
    from disttrain_lab.labtests.lab08.common import as_plain, specs_of

    model, cluster = specs_of((ModelSpec, ClusterSpec, Plan), model, cluster)  # noqa: F821  (the notebook's)
    return [as_plain(step_time(model, cluster, Plan(**plan))) for plan in plans]  # noqa: F821  (the notebook's)


def _plans_of(model, cluster, sp=None, graders=()):
    """Driver: your plan_parallelism's plans as (dp, tp, pp, micro_batches, zero, step_s, memory, your
    step_time of the plan), or what each is if not a Plan; what it returned if not a list.  ``sp``: passed when
    not None.  ``graders``: your memory_per_device or step_time where it failed its test, replaced by the
    grader's own."""
    from disttrain_lab.labtests.lab08.common import as_plain, in_place, specs_of

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


# plans of the worked example on 16 devices (dp, tp, pp, micro-batches, ZeRO): one of each shape the planner ranks
_ORDER_PLANS = (
    (16, 1, 1, 4, 1),
    (2, 8, 1, 4, 0),
    (1, 16, 1, 4, 0),
    (4, 2, 2, 8, 3),
    (1, 2, 8, 16, 0),
    (8, 1, 2, 16, 3),
)


def choose_planner_graders(model: Spec, cluster: Spec, plan: Spec) -> list[str]:
    """Decide, once per run of plan_parallelism's graded cell, the pieces it is graded on: memory_per_device
    where yours failed its graded test, and step_time where yours does not rank plans as the formula does
    (``plan`` and the plans of ``_ORDER_PLANS`` of the worked example ``model`` on ``cluster``: their times must
    be finite, positive and one constant multiple of the grader's, whose order the planner's test reads; the
    step-time's own graded test comes later), each replaced by the grader's stand-in when it holds them
    (``GRADERS["planner"]``): plan_parallelism is graded on its own.  The step_time that crosses to your kernel
    then is no formula but a table of the formula's ranks for the plans of each case (``_stand_ins_source``).
    Returns them."""
    global _PLANNER_GRADERS
    _PLANNER_GRADERS = []
    if "planner" not in GRADERS:
        return _PLANNER_GRADERS
    graders = ["memory_per_device"] if PASSED.get("planner_memory") is False else []
    plan_class = _notebook("Plan")
    plans = [plan, *(plan_class(*fields) for fields in _ORDER_PLANS)]
    try:
        run = exercise.run(
            _step_times_of, 1, (_fields(model), _fields(cluster), [_fields(p) for p in plans]), timeout=60
        )
        times = run.results[0]
        works = all(isinstance(t, float) and math.isfinite(t) and t > 0 for t in times) and len(times) == len(plans)
    except exercise.ExerciseError:
        works = False
    if works:
        formula = GRADERS["planner"](["step_time"])["step_time"]
        ratios = [t / formula(model, cluster, p) for t, p in zip(times, plans)]
        works = all(math.isclose(r, ratios[0], rel_tol=1e-6) for r in ratios)
    _PLANNER_GRADERS = graders + ([] if works else ["step_time"])
    return _PLANNER_GRADERS


def plans_for(model: Spec, cluster: Spec, sp: bool | None = None) -> list:
    """Your plan_parallelism(model, cluster) (with ``sp=sp`` when given), run in your kernel: (dp, tp, pp, m,
    zero, step_s, memory, your step_time of the plan) for each plan; on the grader's stand-ins
    (``_stand_ins_source``) for the pieces ``choose_planner_graders`` chose."""
    graders = _PLANNER_GRADERS if "planner" in GRADERS else []
    helper = _stand_ins_source(model, cluster, graders) if graders else None
    target, inputs = _with_graders(_plans_of, (_fields(model), _fields(cluster), sp), graders, helper)
    return exercise.run(target, 1, inputs, timeout=60).results[0]


def _candidate_plans(model: Spec, cluster: Spec) -> list[tuple[int, int, int, int, int]]:
    """Every (dp, tp, pp, m, zero) a planner may price for ``model`` on ``cluster``, valid or not: tp · pp
    dividing the devices, dp the rest, dp · m dividing the batch, ZeRO 0 to 3 (a superset of plan_parallelism's
    plans, whatever it checks first)."""
    found = []
    for tp in range(1, cluster.devices + 1):
        for pp in range(1, cluster.devices // tp + 1):
            if cluster.devices % (tp * pp):
                continue
            dp = cluster.devices // (tp * pp)
            found += [
                (dp, tp, pp, m, zero)
                for m in range(1, model.batch // dp + 1)
                if not model.batch % (dp * m)
                for zero in range(4)
            ]
    return found


def _step_ranks(model: Spec, cluster: Spec) -> dict[tuple, int]:
    """(dp, tp, pp, m, zero) -> the rank of its step time by the grader's formula (``GRADERS["planner"]``) among
    the ``_candidate_plans`` of ``model`` on ``cluster``, 1 the fastest, equal times the same rank: all that
    plan_parallelism's test reads of step_time (the order of the plans and that each one's step_s is step_time's),
    and no time in seconds."""
    formula = GRADERS["planner"](["step_time"])["step_time"]
    plan_class = _notebook("Plan")
    times = {}
    for fields in _candidate_plans(model, cluster):
        try:
            t = float(formula(model, cluster, plan_class(*fields)))
        except (ArithmeticError, ValueError):
            continue
        if math.isfinite(t):
            times[fields] = t
    order = {t: i + 1 for i, t in enumerate(sorted(set(times.values())))}
    return {fields: order[t] for fields, t in times.items()}


def _stand_ins_source(model: Spec, cluster: Spec, graders: list[str]) -> str:
    """The source of ``_graders_planner(graders)`` as it crosses to your kernel with the driver ``_plans_of``:
    memory_per_device the grader's formula (its graded test came before), step_time a table of ranks
    (``_step_ranks``) for exactly the plans of ``model`` on ``cluster`` that this test may price, which raises a
    ValueError for any other model, cluster or plan.  No formula for step time crosses: captured, the stand-in
    knows no time in seconds, on no model, and earns step_time's graded test nothing."""
    memory = ""
    if "memory_per_device" in graders:
        memory = textwrap.dedent(inspect.getsource(GRADERS["planner"](["memory_per_device"])["memory_per_device"]))
    ranks = _step_ranks(model, cluster) if "step_time" in graders else {}
    call = f"_table_planner(graders, {memory!r}, {_fields(model)!r}, {cluster.devices!r}, {ranks!r})"
    helper = textwrap.dedent(inspect.getsource(_table_planner))
    return f"{helper}\n\n_graders_planner = lambda graders: {call}  # noqa: E731\n"  # (what the driver calls)


def _table_planner(graders, memory, model_fields, devices, ranks):
    """The grader's stand-ins, in your kernel (``_stand_ins_source``): memory_per_device defined from
    ``memory`` (its source), step_time the rank of a plan of ``model_fields`` on ``devices`` devices in
    ``ranks`` (infinite for a plan whose shape is not the cluster's: none that fits), and nothing else."""
    import dataclasses
    import math

    pieces = {}
    if memory:
        defined = {}
        exec(compile(memory, "<the grader's memory_per_device>", "exec"), defined)  # noqa: S102  (the grader's)
        pieces["memory_per_device"] = defined["memory_per_device"]

    def ranked(model, cluster, plan):  # (step_time's place: a plan's rank, no time)
        key = (plan.dp, plan.tp, plan.pp, plan.micro_batches, plan.zero)
        if dataclasses.asdict(model) != model_fields or cluster.devices != devices:
            raise ValueError("the grader's stand-in for step_time ranks only the plans of this graded case")
        return float(ranks.get(key, math.inf))  # (no such plan here: dp · tp · pp is not the devices)

    pieces["step_time"] = ranked
    return {name: pieces[name] for name in graders}


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
    cost model of the text, held by the graded cell: pp · (t_F + t_B) + 2 · (pp − 1) · (α + σ) + (m − 1) ·
    (max(t_F, σ) + max(t_B, σ)) + DP, each group paying the slowest tier it spans."""
    want = reference(model, cluster.network, cluster.flops, plan)
    [got] = exercise.run(_step_times_of, 1, (_fields(model), _fields(cluster), [_fields(plan)]), timeout=60).results[0]
    assert math.isclose(got, want, rel_tol=1e-6), (
        f"step_time({plan}) on {cluster.network}: expected {want:.6g} s, got {got}: "
        "pp · (t_F + t_B) + 2 · (pp − 1) · (α + σ) + (m − 1) · (max(t_F, σ) + max(t_B, σ)) + DP, "
        "each group paying the slowest tier it spans"
        + (
            "; ZeRO 3's DP is (1 + 2m)/2 all-reduces (the weights gathered for each micro-batch's forward and backward)"
            if plan.zero == 3
            else ""
        )
    )
