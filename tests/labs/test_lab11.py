"""Lab 11 (expert parallelism and the five-dimensional grid): the solution notebook runs, its graded
tests catch wrong answers, and the expert-parallel layer is graded on its own.

- The notebook's structure: the exercises and predictions in order, the hidden tests covering what
  the issue asks (k = 1 and 2, capacity factors that drop tokens, the bytes counted by the OS; the
  experts' view of the grid; the five-dimensional memory with cp and ep up to 16, and the invalid
  grids), the predictions' self-checks (their form only).
- The solution notebook executes top to bottom in a real kernel, as the grader runs it (its round
  trip: NBGRADER_EXECUTION set) and as a student runs it (the full benchmark), each within the
  budget (BUDGET_S), every graded cell passing, with its pictures and the benchmark table; the
  dropped tokens follow the capacity rule.
- Wrong answers (the grader's stand-in router, a router that serves capacity token by token, an
  expert-parallel layer that ships the dropped tokens too, predictions off the cost model (a
  capacity rounded down among them), a column-major grid, a five-dimensional memory that shards
  ZeRO over dp only or does not divide the activations by cp) fail the right graded cell with a
  message that says why; all in one kernel, to keep the suite's time down.
- The expert-parallel layer is graded with the grader's router when exercise 1 fails, and a router
  that passes only the visible case costs the layer nothing.

The benchmark (`disttrain-lab bench experts`) is tested in test_bench_experts.py; the blank notebook
failing every graded cell, and the autograde round trip, in test_grading.py.
"""

from __future__ import annotations

import copy
import inspect
import math
import re

import nbformat
import pytest

from disttrain_lab import bench
from disttrain_lab.labtests import common, lab11
from tests.notebooks import (
    add_wrong_answers,
    assert_prediction_verdicts,
    assert_wrong_answers_caught,
    base_cells,
    cell_by_id,
    errors,
    execute,
    exercise_ids,
    graded_points,
    load,
    output_of,
    pictures,
    prediction_problems,
    run_solution,
    solution_notebook,
    text,
)

LAB = solution_notebook("11_expert_parallel")
BUDGET_S = 180  # the whole solution notebook on 2 cores (measured as a student runs it: 23 s from a fresh kernel, load 0.2-2.4)
EXERCISES = ["router", "predict_dropped_tokens", "expert_parallel", "predict_moe_bytes", "mesh_groups", "planner_5d"]
GIVEN = ["given_moe"]
# the graded predictions: (the cost model, written here; wrong formulas the graded cell must fail)
PREDICTIONS = {
    "predict_moe_bytes": (
        lambda n, t, k, d: 2 * t * k * (n - 1) / n * d * 4,
        [lambda n, t, k, d: t * k * (n - 1) / n * d * 4, lambda n, t, k, d: 2 * t * k * d * 4],
    ),
    "predict_dropped_tokens": (  # C = ceil(cf * k * T / E); an expert wanted by w choices keeps min(w, C)
        lambda t, e, k, f, w: max(0, w - math.ceil(f * k * t / e)),
        [
            lambda t, e, k, f, w: max(0, w - math.floor(f * k * t / e)),  # capacity rounded down
            lambda t, e, k, f, w: w - math.ceil(f * k * t / e),  # a negative count when it fits
            lambda t, e, k, f, w: max(0, w - math.ceil(f * t / e)),  # k left out of the capacity
        ],
    ),
}


# ----------------------------------------------------------------------------------------
# The notebook's structure (fast)


def test_exercises_and_hidden_tests_cover_the_issue():
    nb = load(LAB)
    assert exercise_ids(nb) == [f"ex_{e}" for e in EXERCISES]
    assert graded_points(nb) == {
        "test_router": 2,
        "test_predict_dropped_tokens": 1,
        "test_expert_parallel": 4,
        "test_predict_moe_bytes": 1,
        "test_mesh_groups": 2,
        "test_planner_5d": 2,
    }
    hidden = "".join(
        part.split("### END HIDDEN TESTS")[0]
        for e in EXERCISES
        for part in cell_by_id(nb, f"test_{e}").source.split("### BEGIN HIDDEN TESTS")[1:]
    )
    for needle in (
        "lab_tests.check_router(33, 8, 2, 0.5,",  # k = 2, tokens dropped
        "lab_tests.check_router(10, 5, 1, 2.0,",
        "lab_tests.check_moe(_moe, 4, 5, 7, 8, 2, 0.5,",
        "lab_tests.check_moe(_moe, 3, 4, 5, 6, 1, 0.75,",
        "lab_tests.check_moe_bytes(_moe, 4,",
        "lab_tests.check_moe_error(4, 6)",
        "def _moe_with_graders_router(",
        "def _reference_route(",  # the router's and the capacity-limited MoE's references stay hidden
        "def _reference_moe(",
        "dl.predictions.assert_prediction(",
        # five dimensions: the experts' view of pp·dp·cp·tp
        "lab_tests.check_expert_grid(pp=2, dp=2, cp=2, tp=2, ep=2, reference=_reference_groups)",
        "lab_tests.check_expert_grid(pp=1, dp=4, cp=2, tp=2, ep=4, reference=_reference_groups)",
        'lab_tests.check_groups({"pp": 2, "dp": 3, "cp": 2, "tp": 2}, "cp", reference=_reference_groups)',
        "dict(dp=128, tp=8, micro_batches=12, zero=3)",  # cp = ep = 1: Lab 8's memory_per_device, on GPT-3
        "dict(tp=8, cp=16, zero=1, sp=True)",  # cp up to 16, ep up to 16, ZeRO 0-3, sp both ways
        "dict(dp=4, cp=4, ep=16, zero=3)",
        "dict(dp=2, tp=2, pp=2, cp=2, ep=4, micro_batches=8, zero=2, sp=True)",
        "is not the world size 16",  # the four invalid grids
        '"12 heads not divisible by tp = 8"',
        '"6 experts not divisible by ep = 4"',
        '"dp·cp = 12 not divisible by ep = 16"',
    ):
        assert needle in hidden, needle
    planner = inspect.getsource(lab11.check_5d)  # its reference reduces to Lab 8's where cp = ep = 1
    assert "math.isclose(want, lab8_reference(config), rel_tol=1e-12)" in planner
    assert "lab_tests.check_5d(_LAB8, _ref_memory_5d, _lab8_memory," in cell_by_id(nb, "test_planner_5d").source
    helpers = inspect.getsource(common.expect_divisible_error)
    assert 'rank_raised(e, "ValueError", "divisible", loose=True)' in helpers
    # the graded cells reach the notebook only through dl.exercise.run (or dl.predictions.fetch): the module's
    # checks they call run the student's code with exercise.run (run_or_fail and expect_divisible_error run it)
    runs = ("exercise.run(", "common.run_or_fail(", "common.expect_divisible_error(", "check_groups(")
    for e in EXERCISES:
        source = cell_by_id(nb, f"test_{e}").source
        called = set(re.findall(r"lab_tests\.(check_\w+)\(", source))
        assert called or "dl.predictions.fetch(" in source, e
        for name in called:
            assert any(r in inspect.getsource(getattr(lab11, name)) for r in runs), name


def test_visible_self_checks_exercise_every_hidden_requirement():
    nb = load(LAB)
    visible = "\n".join(c.source.split("### BEGIN HIDDEN TESTS")[0] for c in nb.cells if c.cell_type == "code")
    for needle in (
        "checks.assert_traffic(_run",  # the bytes of the MoE, counted by the OS
        "ExpertParallelMoE(MoE(4, 4, 6))",  # not divisible
        "top_k_route(_logits, 2, 0.5)",  # k = 2, capacity served choice-major
        'dl.predictions.check("moe bytes"',
        'dl.predictions.check("dropped tokens"',
        "dl.launch(_torch_mesh_groups, 8)",  # against torch's DeviceMesh
        'world._unflatten(0, (4 // ep, ep, 2), ("edp", "ep", "tp"))',  # torchtitan's expert view of the same ranks
        "# Lab 8's grid_groups(dp=2, tp=2, pp=2)",
        "memory_per_device_5d(world=16, **_lab8, dp=16, micro_batches=4, zero=1)",  # Lab 8's worked example
        "memory_per_device_5d(world=16, **_lab8, dp=4, cp=4, micro_batches=16, zero=1)",  # cp
        "memory_per_device_5d(world=16, **_lab8, experts=8, dp=16, ep=4, micro_batches=4)",  # ep
        "memory_per_device_5d(**_args)",  # the invalid grids
    ):
        assert needle in visible, needle
    text_cells = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for rule in (
        "**not divisible**",
        "choice-major",
        "**only the kept choices' rows**",
        "`heads` is **not divisible** by `tp`",
        "`experts` is **not divisible** by `ep`",
        "`dp · cp` is **not divisible** by `ep`",
        "differs from `world` (say both numbers)",
        "**Expert parallelism is not a fifth factor of the world.**",
        "`(256, 8, 2, 1.0, 96)`, `(1000, 16, 1, 1.25, 150)` and `(4096, 64, 2, 1.5, 100)`",
    ):
        assert rule in text_cells, rule


def test_predictions_self_checks_hold_no_answer_and_use_the_graded_cases():
    nb = load(LAB)
    assert prediction_problems(nb) == []
    moe = [(4, 4096, 2, 768), (8, 1000, 1, 512)]
    dropped = [(256, 8, 2, 1.0, 96), (1000, 16, 1, 1.25, 150), (4096, 64, 2, 1.5, 100)]
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    for cases in (moe, dropped):  # the self-checks use the graded cases
        assert source.count(f"cases={cases!r}") == 1 and source.count(f"_cases = {cases!r}") == 1, cases
    for value in (37748736, 3584000, 32, 71):  # not within 1e-6 of a rounding boundary
        mantissa = value / 10 ** len(str(value)[1:])
        assert abs(round(mantissa * 100) - mantissa * 100 - 0.5) % 1 > 1e-4


@pytest.mark.parametrize("grade_id", list(PREDICTIONS))
def test_graded_prediction_passes_the_right_formula_and_fails_wrong_ones(grade_id):
    assert_prediction_verdicts(load(LAB), grade_id, *PREDICTIONS[grade_id])


# ----------------------------------------------------------------------------------------
# Executing it (slow)


@pytest.mark.slow
@pytest.mark.parametrize("autograding", [True, False], ids=["grader", "student"])
def test_solution_notebook_executes_within_budget(autograding):
    nb = run_solution(LAB, BUDGET_S, autograding)
    table = output_of(nb, "bench.format_experts_table(rows)")
    for line in ("ExpertParallelMoE", bench.ALL_GATHER_DISPATCH, bench.ONE_PROCESS_MOE):
        assert line in table, table
    dropped = output_of(nb, "# Measured: the skewed router above")
    for factor, wanted, capacity, drops in re.findall(
        r"factor ([\d.]+): expert 0 wants (\d+) choices, capacity (\d+), drops (\d+)", dropped
    ):
        assert int(capacity) == math.ceil(float(factor) * 2 * 256 / 8) and int(drops) == max(
            0, int(wanted) - int(capacity)
        )
    assert dropped.count("expert 0 wants") == 6 and "drops 0" not in dropped.splitlines()[0], dropped
    assert pictures(nb) >= 4, "the router's load, the predictions' bars (2), the memory against cp"


def _ships_dropped_choices() -> str:
    """The solution's ExpertParallelMoE, dispatching every choice (dropped ones too, their gate zeroed):
    the same output, more bytes."""
    source = cell_by_id(load(LAB), "ex_expert_parallel").source
    for right, wrong in (
        ("token, choice = kept.nonzero(as_tuple=True)", "token, choice = torch.ones_like(kept).nonzero(as_tuple=True)"),
        ("gates[token, choice, None] * back", "(gates * kept)[token, choice, None] * back"),
    ):
        assert right in source, right
        source = source.replace(right, wrong)
    return source


def _wrong_planner_5d(right: str, wrong: str) -> str:
    """The solution's memory_per_device_5d with ``right`` replaced by ``wrong``."""
    source = cell_by_id(load(LAB), "ex_planner_5d").source
    assert right in source, right
    return source.replace(right, wrong)


# Wrong answers the graded tests must catch: (graded cell, wrong definition, words the failure must contain)
WRONG = [
    (
        "router",
        """
def top_k_route(logits, k, capacity_factor):        # the grader's stand-in, captured: float64 whatever comes in
    tokens, n = logits.shape
    gates, experts = torch.softmax(logits.double(), -1).topk(k, -1)
    capacity = math.ceil(capacity_factor * k * tokens / n)
    load, kept = [0] * n, torch.zeros(tokens, k, dtype=torch.bool)
    for c in range(k):
        for t in range(tokens):
            e = int(experts[t, c])
            if load[e] < capacity:
                load[e] += 1
                kept[t, c] = True
    return experts, gates, kept
""",
        "top_k_route(k=1): the gates",
    ),
    (
        "router",
        """
def top_k_route(logits, k, capacity_factor):           # capacity served token by token, not choice-major
    tokens, n_experts = logits.shape
    gates, experts = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    capacity = math.ceil(capacity_factor * k * tokens / n_experts)
    order = experts.reshape(-1)
    one_hot = F.one_hot(order, n_experts)
    place = (one_hot.cumsum(0) * one_hot).sum(-1) - 1
    return experts, gates, (place < capacity).view(tokens, k)
""",
        "served choice-major",
    ),
    ("expert_parallel", _ships_dropped_choices(), "Something moved that the exercise does not need"),
    (
        "mesh_groups",
        """
def mesh_groups(sizes, dims):                          # column-major: the first dimension changes fastest
    names, dims = list(sizes), (dims,) if isinstance(dims, str) else tuple(dims)
    grid = torch.arange(math.prod(sizes.values())).view(*reversed(list(sizes.values())))
    grid = grid.permute(*reversed(range(len(names))))
    kept = [names.index(d) for d in dims]
    rest = [i for i in range(len(names)) if i not in kept]
    groups = grid.permute(*rest, *kept).reshape(-1, math.prod(sizes[d] for d in dims))
    return sorted(sorted(g) for g in groups.tolist())
""",
        "row-major, the last dimension fastest",
    ),
    (
        "planner_5d",  # ZeRO shards the dense states over dp only, not over the dp · cp ranks that reduce them
        _wrong_planner_5d("states(dense, dp * cp)", "states(dense, dp)"),
        "States: zero(Ψ_dense, dp·cp)",
    ),
    (
        "planner_5d",  # context parallelism does not split the activations
        _wrong_planner_5d("sbh = seq / cp * b * hidden", "sbh = seq * b * hidden"),
        "activations of s/cp tokens",
    ),
    (
        "predict_moe_bytes",
        "def predicted_moe_bytes(n, tokens, k, d):\n    return tokens * k * (n - 1) / n * d * 4\n",
        "does not match the cost model",
    ),
    (
        "predict_dropped_tokens",  # the capacity rounded down: 1000 tokens, 16 experts, cf 1.25 give C = 78, not 79
        "def predicted_dropped_tokens(tokens, n_experts, k, capacity_factor, wanted):\n"
        "    return max(0, wanted - int(capacity_factor * k * tokens / n_experts))\n",
        "does not match the cost model",
    ),
]


def _base_cells(lab):
    return base_cells(lab, GIVEN, EXERCISES)


@pytest.mark.slow
def test_graded_cells_catch_wrong_answers():
    """One kernel: the setup, solutions, given code and test helpers, then for each wrong answer the
    solutions again, the wrong definition and its graded cell."""
    lab = load(LAB)
    cells, solutions = _base_cells(lab)
    graded_at = add_wrong_answers(lab, cells, solutions, [(graded, wrong) for graded, wrong, _ in WRONG])
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, timeout=240, cwd=LAB.parent)
    assert_wrong_answers_caught(nb, graded_at, [message for _, _, message in WRONG])


@pytest.mark.slow
def test_later_exercises_are_graded_on_the_graders_pieces():
    # a top_k_route that keeps everything fails exercise 1; the MoE layer is graded with the grader's router.
    lab = load(LAB)
    cells, _ = _base_cells(lab)
    broken_router = (
        "def top_k_route(logits, k, capacity_factor):\n"
        "    gates, experts = torch.softmax(logits, -1).topk(k, -1)\n"
        "    return experts, gates, torch.ones_like(experts, dtype=torch.bool)\n"
    )
    cells.append(nbformat.v4.new_code_cell(broken_router))
    graded = ["router", "expert_parallel"]
    start = len(cells)
    cells += [copy.deepcopy(cell_by_id(lab, f"test_{g}")) for g in graded]
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, timeout=240, cwd=LAB.parent)
    results = dict(zip(graded, nb.cells[start:]))
    assert errors(results["router"])
    assert not errors(results["expert_parallel"]), errors(results["expert_parallel"])
    assert "\N{WHITE HEAVY CHECK MARK}" in text(results["expert_parallel"]), text(results["expert_parallel"])


TOKEN_MAJOR_ROUTER = """
def top_k_route(logits, k, capacity_factor):      # serves capacity token by token (both choices of token 0 first)
    tokens, n_experts = logits.shape
    gates, experts = torch.softmax(logits, -1).topk(k, -1)
    capacity = math.ceil(capacity_factor * k * tokens / n_experts)
    load, kept = [0] * n_experts, torch.zeros(tokens, k, dtype=torch.bool)
    for token in range(tokens):
        for choice in range(k):
            e = int(experts[token, choice])
            if load[e] < capacity:
                load[e] += 1
                kept[token, choice] = True
    return experts, gates, kept
"""


@pytest.mark.slow
def test_a_router_that_passes_the_visible_case_only_costs_expert_parallelism_nothing():
    # #41: the gate was exercise 1's visible 5-token case (k = 1); a token-major router passes it, fails the graded
    # test's k = 2 cases, and used to cost the expert-parallel layer its points on the student's router.  The layer
    # is now graded on the student's router only once exercise 1's graded test passed, else on the grader's.
    lab = load(LAB)
    cells, _ = _base_cells(lab)
    cells.append(nbformat.v4.new_code_cell(TOKEN_MAJOR_ROUTER))
    start = len(cells)
    cells += [copy.deepcopy(cell_by_id(lab, f"test_{g}")) for g in ("router", "expert_parallel")]
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, timeout=240, cwd=LAB.parent)
    router, layer = nb.cells[start:]
    assert errors(router), "the token-major router should fail exercise 1's graded test"
    assert not errors(layer), errors(layer)
    assert "\N{WHITE HEAVY CHECK MARK}" in text(layer), text(layer)


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_the_calls_a_moe_made_are_read_from_the_wire(monkeypatch):
    """ "Only all_to_all_single" comes from the grader's capture: each message's slot names its call's kind.  The
    solution passes with and without a capture; the solution's layer with every rank's tokens all-gathered beside
    it, off the trace, passes on the trace alone and fails on the wire."""
    import torch
    import torch.distributed as dist

    from disttrain_lab import trace
    from disttrain_lab.labtests.lab11 import experts
    from tests.helpers import notebook_names, observed_from_outside

    solution = bench.functions_from_notebook(LAB, ["ExpertParallelMoE", "top_k_route"], given=True)
    notebook_names(monkeypatch, solution["top_k_route"].__globals__)  # (the notebook's namespace: MoE, the layer)

    class Gathering(solution["ExpertParallelMoE"]):  # the solution's layer, every rank's tokens gathered aside
        def forward(self, x):
            with trace.unrecorded():
                dist.all_gather([torch.empty_like(x) for _ in range(dist.get_world_size())], x.detach().contiguous())
            return super().forward(x)

    def check():
        lab11.check_moe(experts._moe_in_rank, 2, 6, 8, 2, 2, 1.0, 8, 0, reference=lab11.every_token_to_every_expert)

    check()
    with observed_from_outside():
        check()
        monkeypatch.setattr("__main__.ExpertParallelMoE", Gathering)
        with pytest.raises(AssertionError) as gathered:
            check()
    check()  # (the student's own kernel: the trace's account, fooled)
    said = str(gathered.value)
    assert "only call all_to_all_single; the grader's capture of the wire shows" in said, said
    assert "all_gather from rank(s) 0, 1" in said, said


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
@pytest.mark.parametrize("relayed", ["dispatch and combine", "combine"])
def test_rows_passed_through_the_store_with_zeros_on_the_wire_fail_on_the_wires_content(monkeypatch, relayed):
    """The solution's layer whose all-to-alls move the rows through the launcher's store (a few KiB: under what the
    grader allows a rank to exchange with processes that are not ranks) while ``all_to_all_single`` sends zeros of
    the same sizes (both, or the combine alone, with its backward): the calls and their bytes are the solution's,
    the values right, and it passes in the student's own kernel; the grader's capture finds the rows missing from
    the wire and fails it."""
    import torch
    import torch.distributed as dist

    from disttrain_lab.labtests.lab11 import experts
    from tests.helpers import notebook_names, observed_from_outside, through_the_store

    solution = bench.functions_from_notebook(LAB, ["ExpertParallelMoE", "top_k_route"], given=True)
    notebook_names(monkeypatch, solution["top_k_route"].__globals__)
    namespace = solution["ExpertParallelMoE"].forward.__globals__  # (where the layer's forward finds all_to_all)
    given, calls = namespace["all_to_all"], [0]

    def relay(rows, out_splits, in_splits, group):
        """Rank r's rows in_splits[s] to rank s through the store; zeros of the same sizes on the wire."""
        pieces = through_the_store([p.clone() for p in rows.detach().split(list(in_splits))], "relay")
        out = torch.empty(sum(out_splits), *rows.shape[1:], dtype=rows.dtype)
        dist.all_to_all_single(out, torch.zeros_like(rows), list(out_splits), list(in_splits), group=group)
        return torch.cat([theirs[dist.get_rank()] for theirs in pieces])

    class Relayed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, out_splits, in_splits, group):
            ctx.splits, ctx.group = (list(out_splits), list(in_splits)), group
            return relay(x, out_splits, in_splits, group)

        @staticmethod
        def backward(ctx, grad):
            out_splits, in_splits = ctx.splits
            return relay(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None

    def all_to_all(x, out_splits, in_splits, group=None):
        calls[0] += 1  # (forward's first call a step is the dispatch, its second the combine)
        if relayed == "combine" and calls[0] % 2:
            return given(x, out_splits, in_splits, group)
        return Relayed.apply(x, out_splits, in_splits, group)

    def check():
        lab11.check_moe(experts._moe_in_rank, 2, 6, 8, 2, 2, 1.0, 8, 0, reference=lab11.every_token_to_every_expert)

    monkeypatch.setitem(namespace, "all_to_all", all_to_all)
    check()  # (the student's own kernel: values and the trace's calls)
    with observed_from_outside(), pytest.raises(AssertionError) as failed:
        check()
    said = str(failed.value)
    step = "its dispatch should carry" if relayed == "dispatch and combine" else "back its experts' outputs"
    assert step in said and "The rows must travel in the all-to-all itself" in said, said


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
@pytest.mark.parametrize("relayed", ["combine and dispatch", "dispatch"])
def test_gradients_passed_through_the_store_with_zeros_in_the_backward_all_to_alls_fail_on_the_wires_content(
    monkeypatch, relayed
):
    """#42: the backward's all-to-alls are read for content too.  The solution passes under the grader's capture,
    on the visible case and on 4 ranks with dropped choices.  Its layer whose all-to-alls send the rows forward as
    the given ``all_to_all`` does, but in backward send zeros of the same sizes and take the gradients through the
    launcher's store (both backward all-to-alls, or the dispatch's alone: its experts' input gradients): values,
    calls, bytes and the forward's rows all right, it passes in the student's own kernel; the grader's capture
    finds the gradients missing from the backward's all-to-alls and fails it."""
    import torch
    import torch.distributed as dist

    from disttrain_lab.labtests.lab11 import experts
    from tests.helpers import notebook_names, observed_from_outside, through_the_store

    solution = bench.functions_from_notebook(LAB, ["ExpertParallelMoE", "top_k_route"], given=True)
    notebook_names(monkeypatch, solution["top_k_route"].__globals__)
    namespace = solution["ExpertParallelMoE"].forward.__globals__  # (where the layer's forward finds all_to_all)
    given, route, calls = namespace["all_to_all"], solution["top_k_route"], [0]

    class BackwardRelayed(torch.autograd.Function):
        """The given all-to-all forward; backward, the gradients through the store and zeros on the wire."""

        @staticmethod
        def forward(ctx, x, out_splits, in_splits, group):
            ctx.splits, ctx.group = (list(out_splits), list(in_splits)), group
            out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
            dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
            return out

        @staticmethod
        def backward(ctx, grad):
            out_splits, in_splits = ctx.splits
            pieces = through_the_store([p.clone() for p in grad.detach().split(out_splits)], "relay")
            back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
            dist.all_to_all_single(back, torch.zeros_like(grad), in_splits, out_splits, group=ctx.group)
            return torch.cat([theirs[dist.get_rank()] for theirs in pieces]), None, None, None

    def all_to_all(x, out_splits, in_splits, group=None):
        calls[0] += 1  # (forward's first call a step is the dispatch, its second the combine)
        if relayed == "dispatch" and not calls[0] % 2:
            return given(x, out_splits, in_splits, group)
        return BackwardRelayed.apply(x, out_splits, in_splits, group)

    def routed(dense, x):
        """The dense MoE (k = 2, capacity factor 0.5) on x: (y, aux, rows each expert received)."""
        y, aux = dense(x)
        chosen, _, kept = route(dense.router(x), 2, 0.5)
        return y, aux, torch.bincount(chosen[kept], minlength=len(dense.experts)).tolist()

    def check():
        lab11.check_moe(experts._moe_in_rank, 2, 6, 8, 2, 2, 1.0, 8, 0, reference=lab11.every_token_to_every_expert)

    with observed_from_outside():  # the solution, under grading
        check()
        lab11.check_moe(experts._moe_in_rank, 4, 5, 7, 8, 2, 0.5, 10, 2, reference=routed)
    monkeypatch.setitem(namespace, "all_to_all", all_to_all)
    check()  # (the student's own kernel: values and the trace's calls)
    with observed_from_outside(), pytest.raises(AssertionError) as failed:
        check()
    said = str(failed.value)
    step = "(the dispatch's backward" if relayed == "dispatch" else "(the combine's backward"
    assert step in said and "The gradients must travel in the all-to-all itself" in said, said
