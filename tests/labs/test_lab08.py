"""Lab 8 (capstone): the solution notebook runs, and its graded tests catch wrong answers.

- The notebook's structure: ten exercises (sections 2-5), each followed by its graded cell; the hidden tests
  cover several grids (1 × 2 × 4, 4 × 1 × 2, ...), uneven micro-batches, 3 and 4 ranks, the
  errors each exercise must raise; the kit's Lab 6 pieces ship with Lab 8 (data/) and not in
  the package students install.
- ONE kernel (a module fixture) executes the solution notebook as the grader runs it
  (NBGRADER_EXECUTION set), within its 5-minute budget, every graded cell passing, with its
  pictures; the planner ranks the measured runs of data/step_times.json and finds GPT-3's
  8-way tensor parallelism; the scaling-law fit and Chinchilla's table are printed; then, in the same kernel, wrong answers (Megatron's order mixed up, attention
  without f, blocks keyed by their place in the stage, gradients summed instead of averaged,
  LARS without its trust ratio, the planner ignoring the TP tier or keeping plans that do not
  fit, a log10 power-law fit, a wrong compute-optimal N) each fail their graded cell saying why, and the Lab 6 pieces
  fall back on the reference ones when the Lab 6 notebook is missing or blank.

The blank notebook failing every graded cell, and the autograde round trip, are in test_grading.py.
"""

from __future__ import annotations

import ast
import copy
import re

import nbformat
import pytest

from tests.notebooks import (
    REPO,
    SLOWDOWN,
    cell_by_id,
    errors,
    execute,
    graded_cells,
    load,
    nbgrader_meta,
    numbering_problems,
    output_of,
    pictures,
    solution_notebook,
    text,
)

LAB = solution_notebook("08_capstone")
BUDGET_S = 300  # the issue's budget for the whole solution notebook on 2 cores
EXERCISES = [
    "grid_groups",
    "tp_attention",
    "pipeline_stage",
    "three_d",  # section 2
    "planner_memory",
    "planner_step_time",
    "planner_plans",  # section 3
    "lars",
    "scaling_fit",
    "scaling_optimal",
]  # sections 4, 5


# ----------------------------------------------------------------------------------------
# The notebook's structure (fast)


def test_exercises_and_hidden_tests_cover_the_issue():
    nb = load(LAB)
    ids = [nbgrader_meta(c).get("grade_id") for c in nb.cells if nbgrader_meta(c)]
    assert [i for i in ids if i.startswith("ex_")] == [f"ex_{e}" for e in EXERCISES]
    assert numbering_problems(nb) == []
    hidden = "".join(cell_by_id(nb, f"test_{e}").source.split("### BEGIN HIDDEN TESTS")[1] for e in EXERCISES)
    for needle in (
        "_check_grid(1, 2, 4)",
        "_check_grid(4, 1, 2)",
        "_check_grid(3, 2, 1)",
        "_expect_value_error(_grid_in_rank, 8, (3, 2, 2)",
        "_check_attention(4, models.GPTConfig(seq_len=7, d_model=24, n_heads=6), batch=1, tp=2)",
        "_check_attention(3,",
        "_expect_value_error(_attention_of, 4, (8, 2)",
        "_check_stage(1, 1, 3,",
        "_check_stage(2, 2, 2,",
        "_expect_value_error(_stage_of, 2, (3, 1, 1, 2)",
        "_check_3d(1, 2, 2, micro_batches=3, batch=10",
        "_check_3d(1, 2, 4,",
        "_check_3d(2, 1, 2,",
        "models.lm_batches(_TOKENS, 5,",
        "zero_grad=1",
        "groups=[",
        "lrs=[0.1, 0.2, 0.3, 0.4]",
    ):
        assert needle in hidden, needle
    # the traffic the graded test expects comes from the configuration, not from the solution
    helpers = cell_by_id(nb, "test_helpers_three_d").source
    assert "def _expected_traffic(cfg, batch, dp, tp, pp, micro_batches, rank)" in helpers
    assert "train_3d(" not in helpers.split("def _expected_traffic")[1].split("def _train_3d_in_rank")[0]
    assert (
        "def train_3d(cfg: models.GPTConfig, batches: list, *, dp: int, tp: int, pp: int, micro_batches: int,"
        in cell_by_id(nb, "ex_three_d").source
    )
    for cell in graded_cells(nb):
        assert nbgrader_meta(cell)["locked"] and nbgrader_meta(cell)["points"] > 0


def test_reference_pieces_ship_with_lab_8_only():
    pieces = REPO / "solutions" / "08_capstone" / "data" / "reference_pieces.py"
    released = REPO / "labs" / "08_capstone" / "data" / "reference_pieces.py"
    assert released.read_bytes() == pieces.read_bytes()
    package = "\n".join(p.read_text() for p in (REPO / "disttrain_lab").rglob("*.py"))
    for name in ("ColumnParallelLinear", "RowParallelLinear", "TensorParallelMLP"):
        assert f"class {name}(" in pieces.read_text() and f"class {name}(" not in package, name


# ----------------------------------------------------------------------------------------
# Executing it, then wrong answers in the same kernel (slow)


def exercise_cells(exercise: str) -> tuple[str, str]:
    """(grade id of the exercise's cell, grade id of its graded cell)."""
    return f"ex_{exercise}", f"test_{exercise}"


def _replaced(exercise: str, right: str, wrong: str) -> str:
    """The solution cell of ``exercise`` with one line changed."""
    source = cell_by_id(load(LAB), exercise_cells(exercise)[0]).source
    assert right in source, right
    return source.replace(right, wrong)


# Wrong answers: (exercise, wrong definition, words the graded cell's failure must contain); the
# exercise's cell is ex_<exercise> and its graded cell test_<exercise>
WRONG = [
    (
        "grid_groups",
        _replaced(
            "grid_groups",  # dp fastest: not Megatron's order
            "tp_rank, dp_rank, pp_rank = rank % tp, rank // tp % dp, rank // (tp * dp)",
            "dp_rank, tp_rank, pp_rank = rank % dp, rank // dp % tp, rank // (tp * dp)",
        ),
        "tp_rank = 0, expected 1",
    ),
    (
        "tp_attention",
        _replaced("tp_attention", "x = f(x, self.group)", "x = x"),  # no all-reduce backward
        "backward: one all-reduce, f's",
    ),
    (
        "pipeline_stage",
        _replaced(
            "pipeline_stage",  # blocks keyed by their place in the stage
            "self.blocks[str(i)] = block",
            "self.blocks[str(len(self.blocks))] = block",
        ),
        "holds blocks ['0'], expected ['1']",
    ),
    (
        "three_d",
        _replaced("three_d", "            flat /= dp\n", ""),  # the sum, not the average
        "against the single-process run",
    ),
    (
        "lars",
        _replaced(
            "lars",
            'trust = group["trust_coefficient"] * w_norm / (g_norm + group["weight_decay"] * w_norm + group["eps"])',
            "trust = 1.0",
        ),  # momentum SGD
        "LARS({'lr': 0.5, 'weight_decay': 0.01, 'trust_coefficient': 0.02}) after 3 step(s)",
    ),
    (
        "planner_step_time",
        _replaced("planner_step_time", "ranks=range(plan.tp))", ")"),  # TP tier ignored
        "step_time(dp=1    tp=8   pp=1",
    ),
    (
        "planner_plans",
        _replaced("planner_plans", "if memory <= cluster.memory:", "if True:"),  # keeps what does not fit
        "not valid or not fitting",
    ),
    (
        "scaling_fit",
        _replaced(
            "scaling_fit",
            "np.polyfit(np.log(x), np.log(y), 1)",  # log10 fit, exp back
            "np.polyfit(np.log10(x), np.log10(y), 1)",
        ),
        "fit_power_law on y = 3 x^2: expected (c, e) = (3, 2)",
    ),
    (
        "scaling_optimal",
        _replaced(
            "scaling_optimal", "math.sqrt(flops / (6 * tokens_per_param))", "math.sqrt(flops / 6) / tokens_per_param"
        ),
        "compute_optimal(5.76e+23): expected",
    ),
]


CATCH = """
_source = {source!r}
try:
    exec(compile(_source, "graded cell {grade_id}", "exec"), globals())
except Exception as _error:
    print("FAILED:", type(_error).__name__, _error)
else:
    print("PASSED")
"""


@pytest.fixture(scope="module")
def executed():
    """The solution notebook, then each wrong answer and its graded cell, then the solution again;
    then the Lab 6 pieces loaded from a missing and from the blank Lab 6 notebook.  One kernel."""
    lab = load(LAB)
    cells = [copy.deepcopy(c) for c in lab.cells]
    solution_end = len(cells)
    wrong_at = []
    for exercise, wrong, _ in WRONG:
        solution, graded = exercise_cells(exercise)
        cells.append(nbformat.v4.new_code_cell(wrong))
        wrong_at.append(len(cells))  # the cell running the graded cell
        cells.append(nbformat.v4.new_code_cell(CATCH.format(source=cell_by_id(lab, graded).source, grade_id=graded)))
        cells.append(copy.deepcopy(cell_by_id(lab, solution)))
    fallback_at = len(cells)
    blank_lab6 = REPO / "labs" / "06_tensor_parallel" / "06_tensor_parallel.ipynb"
    cells.append(
        nbformat.v4.new_code_cell(
            f"_found = [load_tp_pieces(path) for path in ('../no_such_lab/06_tensor_parallel.ipynb', {str(blank_lab6)!r})]\n"
            "print(repr([(sorted(pieces), pieces['f'].__module__, why) for pieces, why in _found]))\n"
        )
    )
    for i, cell in enumerate(cells[solution_end:]):
        cell.id = f"extra-{i}"  # copies of solution cells: ids must stay unique
    nb, seconds = execute(
        nbformat.v4.new_notebook(cells=cells, metadata=lab.metadata), autograding=True, timeout=300, cwd=LAB.parent
    )
    return nb, seconds, solution_end, wrong_at, fallback_at


@pytest.mark.slow
def test_solution_notebook_executes_within_budget(executed):
    nb, seconds, solution_end, _, _ = executed
    failed = {i: errors(c) for i, c in enumerate(nb.cells) if c.cell_type == "code" and errors(c)}
    assert not failed, f"cells raised: {failed}"
    for cell in graded_cells(nbformat.v4.new_notebook(cells=nb.cells[:solution_end])):
        assert "\N{WHITE HEAVY CHECK MARK}" in text(cell), (nbgrader_meta(cell)["grade_id"], text(cell))
        assert not [o for o in cell.outputs if o.get("name") == "stderr"], nbgrader_meta(cell)["grade_id"]
    assert seconds < BUDGET_S * SLOWDOWN, (
        f"the solution notebook (and the wrong answers after it) took {seconds:.0f} s, "
        f"the budget is {BUDGET_S} s (x{SLOWDOWN:g} allowed for a loaded machine)"
    )
    assert pictures(nb) == 5, (
        "expected the single-process loss curve, the 2 × 2 × 2 timeline, the planner's predicted "
        "against measured step times, the large-batch curves and the IsoFLOP profiles"
    )
    # run beside the Lab 6 solution, the lab takes its pieces from there
    assert output_of(nb, "_pieces, _source = load_tp_pieces()").startswith(
        "tensor-parallel pieces: your Lab 6 (../06_tensor_parallel/06_tensor_parallel.ipynb)"
    )
    # the 2 × 2 × 2 self-check: 8 TP all-reduces + 1 DP all-reduce, 2 sends and 2 receives, per step (3 steps)
    printed = output_of(nb, "# Self-check: 8 ranks, 2 × 2 × 2")
    assert "rank 0, 3 steps: 27 all_reduce, 6 isend, 6 recv" in printed, printed
    # the large-batch picture: × 8 from step 0 diverges, LARS ends below plain SGD at the same rate
    printed = output_of(nb, "LARGE_BATCH_RUNS = {")
    final = {name.strip(): value for name, value in re.findall(r"^(.+?)\s+final loss\s+(\S+)$", printed, re.M)}
    assert final["SGD, lr 2.4 (× 8) from step 0"] == "nan", printed
    assert float(final["LARS, lr 1, η 0.01, 5 warm-up steps"]) < float(final["SGD, lr 0.3 (not scaled)"]), printed
    assert float(final["1 rank, batch 8"]) < float(final["LARS, lr 1, η 0.01, 5 warm-up steps"]), printed


@pytest.mark.slow
def test_planner_ranks_the_measured_runs_and_finds_gpt3s_tensor_parallelism(executed):
    nb = executed[0]
    printed = output_of(nb, "_pred = [step_time(_bench_model")
    rho = float(re.search(r"Spearman rank correlation (-?\d\.\d+)", printed).group(1))
    assert rho >= 0.7, printed
    assert "dp=2    tp=2   pp=2" in printed and "dp=8    tp=1   pp=1" in printed and "dp=1    tp=8   pp=1" in printed
    gpt3 = output_of(nb, "plans1024 = plan_parallelism(")
    assert "GPT-3 (175.2 B parameters) on 1024 GPUs" in gpt3, gpt3
    best = re.search(r"plans fit\n\s+dp=(\d+)\s+tp=(\d+)\s+pp=(\d+)", gpt3)
    assert best and int(best.group(2)) == 8, gpt3  # the published 8-way tensor parallelism, inside a node


@pytest.mark.slow
def test_scaling_laws_fit_and_check_chinchillas_table(executed):
    nb = executed[0]
    printed = output_of(nb, "_cn, N_EXPONENT = fit_power_law")
    exponent = float(re.search(r"N_opt ∝ C\^(-?\d\.\d+)", printed).group(1))
    assert 0 < exponent < 1.5, printed  # bigger budgets, bigger optimal models
    table = output_of(nb, "CHINCHILLA_TABLE = [")
    assert "10T" not in table and len(table.strip().splitlines()) >= 10, table


@pytest.mark.slow
def test_graded_cells_catch_wrong_answers(executed):
    nb, _, _, wrong_at, _ = executed
    missed = {}
    for (exercise, _, message), at in zip(WRONG, wrong_at):
        printed = text(nb.cells[at])  # a graded cell may print its visible checks' ✅ before failing
        if "FAILED: AssertionError" not in printed or message not in printed.split("FAILED: AssertionError", 1)[1]:
            missed[exercise] = printed[:2000]
    assert not missed, f"graded cells that passed a wrong answer, or failed without saying why: {missed}"


@pytest.mark.slow
def test_lab6_pieces_fall_back_on_the_reference(executed):
    nb, _, _, _, fallback_at = executed
    (missing, blank) = ast.literal_eval(text(nb.cells[fallback_at]).splitlines()[-1])
    names = ["ColumnParallelLinear", "RowParallelLinear", "TensorParallelMLP", "f", "g"]
    assert missing[:2] == blank[:2] == (names, "<run_path>"), (missing, blank)  # data/reference_pieces.py's
    assert missing[2].startswith("the kit's reference pieces (data/reference_pieces.py): no Lab 6 notebook at"), missing
    assert (
        blank[2].startswith(
            "the kit's reference pieces (data/reference_pieces.py): your Lab 6 pieces did not run (RankError"
        )
        and "NotImplementedError" in blank[2]
    ), blank
