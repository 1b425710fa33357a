"""Lab 8, sections 3 (a parallelism planner) and 5 (scaling laws).

- The shipped measurements: ``data/step_times.json`` (``disttrain-lab bench 3d``: train_3d in several
  configurations on the two-tier emulated network) and ``data/scaling_runs.json``
  (``scripts/scaling_runs.py``) say how, where and when they were made, and hold what the
  exercises need (2 x 2 x 2, pure DP 8, pure TP 8; several sizes at each budget).
- The notebook's structure: the graded cells exist and their hidden tests cover the issue's
  known cases (pure DP first when the model fits, no unsharded pure DP when it does not, TP
  inside a node, memory rejection), the ranking against measured step times, the power-law fit
  and the compute-optimal (N, D).
- Executed as the grader runs it (slow): every graded planner_/scaling_ cell passes on the
  solution, and fails on the blank (released) version; the predicted/measured picture and the
  GPT-3 comparison are printed.

The cells are written into ``drafts/08_planner_scaling.ipynb`` until the integrator splices them
into the lab notebook; the checks take an executed notebook, so ``LAB`` is all that changes then.
"""
from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import nbformat
import pytest

from tests.notebooks import REPO, blank, cell_by_id, errors, execute, graded_cells, nbgrader_meta, output_of, \
    pictures, run_solution, text

LAB_DIR = REPO / "solutions" / "08_capstone"
LAB = REPO / "drafts" / "08_planner_scaling.ipynb"     # the integrator: LAB_DIR / "08_capstone.ipynb"
BUDGET_S = 60                                          # these sections' share of the lab's 5 minutes
GRADED = ["planner_test_memory", "planner_test_plans", "planner_test_step_time",
          "scaling_test_fit", "scaling_test_optimal"]


def load_lab() -> nbformat.NotebookNode:
    return nbformat.read(LAB, as_version=4)


def sections_3_and_5(nb) -> nbformat.NotebookNode:
    """The notebook's setup cell and its sections 3 and 5 only: they use nothing of the other
    sections, so the blank and wrong-answer runs need not run the 8-rank ones (the draft or the
    whole lab notebook alike)."""
    nb = copy.deepcopy(nb)
    keep, inside = [nb.cells[0]], False
    for cell in nb.cells[1:]:
        if cell.cell_type == "markdown" and cell.source.startswith("## "):
            inside = cell.source.startswith(("## 3.", "## 5."))
        if inside:
            keep.append(cell)
    nb.cells = keep
    return nb


def _mine(nb) -> list:
    return [c for c in graded_cells(nb) if nbgrader_meta(c)["grade_id"].startswith(("planner_", "scaling_"))]


# ----------------------------------------------------------------------------------------
# The shipped measurements (fast)

def test_step_times_say_how_they_were_measured_and_cover_the_issue():
    record = json.loads((LAB_DIR / "data" / "step_times.json").read_text())
    for key in ("command", "torch", "machine", "date"):
        assert record[key], key
    assert "bench_3d" in record["command"] or "bench 3d" in record["command"], record["command"]
    shapes = {(r["dp"], r["tp"], r["pp"]) for r in record["runs"]}
    assert {(2, 2, 2), (8, 1, 1), (1, 8, 1)} <= shapes and len(shapes) >= 5, shapes
    c = record["cluster"]
    assert c["devices"] == 8 and c["devices_per_node"] == 4
    assert c["inter"]["bandwidth"] < c["intra"]["bandwidth"]
    for r in record["runs"]:
        assert r["median_step_s"] > 0 and len(r["step_s"]) == record["steps"] * record["repeats"]


def test_scaling_runs_hold_several_sizes_per_budget():
    record = json.loads((LAB_DIR / "data" / "scaling_runs.json").read_text())
    for key in ("command", "torch", "machine", "date"):
        assert record[key], key
    budgets = {r["budget"] for r in record["runs"]}
    assert len(budgets) >= 3
    for budget in budgets:
        runs = [r for r in record["runs"] if r["budget"] == budget]
        assert len({r["params"] for r in runs}) >= 5
        for r in runs:   # each run spent its budget: 6 N D within one step's tokens
            assert abs(r["flops"] - budget) <= 6 * r["params"] * record["batch"] * record["seq_len"]
            assert 0 < r["loss"] < 10


# ----------------------------------------------------------------------------------------
# The notebook's structure (fast)

def test_graded_cells_and_hidden_tests_cover_the_issue():
    nb = load_lab()
    assert [nbgrader_meta(c)["grade_id"] for c in _mine(sections_3_and_5(nb))] == [nbgrader_meta(c)["grade_id"]
                                                                                  for c in _mine(nb)]
    assert sorted(nbgrader_meta(c)["grade_id"] for c in _mine(nb)) == sorted(GRADED)
    for exercise in ("planner_memory", "planner_step_time", "planner_plans", "scaling_fit", "scaling_optimal"):
        assert nbgrader_meta(cell_by_id(nb, exercise))["solution"]
    hidden = {g: cell_by_id(nb, g).source.split("### BEGIN HIDDEN TESTS")[1] for g in GRADED}
    plans = cell_by_id(nb, "planner_test_plans").source
    assert "pure DP first" in plans                                   # a model that fits: pure DP
    for needle in ("p.tp == 1 and p.pp == 1 and p.zero == 0",         # cannot fit unsharded: no pure DP
                   "_plans[0].tp <= 8",                               # TP stays on the fast tier
                   "memory=1e9)) == []"):                             # memory rejection
        assert needle in hidden["planner_test_plans"], needle
    measured = cell_by_id(nb, "planner_test_step_time").source
    assert "_rho >= 0.7" in measured and "< 3" in measured and 'Path("data/step_times.json")' not in measured
    assert "_ref_step" in hidden["planner_test_step_time"]
    assert "np.polyfit" not in cell_by_id(nb, "scaling_test_fit").source   # the reference is written out
    assert "(flops / (6 * r)) ** 0.5" in cell_by_id(nb, "scaling_test_optimal").source
    # the graded tests' references are formulas in the test, never code of the kit
    for g in GRADED:
        assert "disttrain_lab" not in cell_by_id(nb, g).source


# ----------------------------------------------------------------------------------------
# Executing it (slow): once as the solution, once blank

@pytest.fixture(scope="module")
def lab_folder(tmp_path_factory) -> Path:
    """A lab folder as the student gets it: the notebook and the measurements beside it."""
    folder = tmp_path_factory.mktemp("lab08")
    shutil.copy(LAB, folder / LAB.name)
    shutil.copytree(LAB_DIR / "data", folder / "data")
    return folder


@pytest.fixture(scope="module")
def executed(lab_folder) -> nbformat.NotebookNode:
    return run_solution(lab_folder / LAB.name, BUDGET_S)


def check_planner(nb) -> None:
    """Section 3 of an executed solution notebook."""
    printed = output_of(nb, "_pred = [step_time(_bench_model")
    rho = float(re.search(r"Spearman rank correlation (-?\d\.\d+)", printed).group(1))
    assert rho >= 0.7, printed
    assert "dp=2    tp=2   pp=2" in printed and "dp=8    tp=1   pp=1" in printed and "dp=1    tp=8   pp=1" in printed
    gpt3 = output_of(nb, "plans1024 = plan_parallelism(")
    assert "GPT-3 (175.2 B parameters) on 1024 GPUs" in gpt3, gpt3
    best = re.search(r"plans fit\n\s+dp=(\d+)\s+tp=(\d+)\s+pp=(\d+)", gpt3)
    assert best and int(best.group(2)) == 8, gpt3     # the published 8-way tensor parallelism, inside a node


def check_scaling(nb) -> None:
    """Section 5 of an executed solution notebook."""
    printed = output_of(nb, "_cn, N_EXPONENT = fit_power_law")
    exponent = float(re.search(r"N_opt ∝ C\^(-?\d\.\d+)", printed).group(1))
    assert 0 < exponent < 1.5, printed                   # bigger budgets, bigger optimal models
    table = output_of(nb, "CHINCHILLA_TABLE = [")
    assert "10T" not in table and len(table.strip().splitlines()) >= 10, table


@pytest.mark.slow
def test_solution_passes_every_graded_cell_with_its_pictures(executed):
    assert sorted(nbgrader_meta(c)["grade_id"] for c in _mine(executed)) == sorted(GRADED)
    assert pictures(executed) >= 2       # predicted against measured; the IsoFLOP profiles
    check_planner(executed)
    check_scaling(executed)


@pytest.mark.slow
def test_blank_notebook_fails_every_graded_cell(lab_folder):
    released = blank(sections_3_and_5(load_lab()))
    nb, _ = execute(released, autograding=True, cwd=lab_folder)
    for cell in _mine(nb):
        grade_id = nbgrader_meta(cell)["grade_id"]
        assert errors(cell), f"{grade_id} passed on the blank notebook: {text(cell)[-300:]}"
        assert "NotImplementedError" in " ".join(errors(cell)), (grade_id, errors(cell))


# wrong answers, each in its own exercise, so each graded cell is caught by its own mistake:
# grade id of the exercise -> (the solution's line, the mistake); the graded cell that must fail
WRONG = {
    "planner_step_time": ("ranks=range(plan.tp))", ")", "planner_test_step_time"),          # TP tier ignored
    "planner_plans": ("if memory <= cluster.memory:", "if True:", "planner_test_plans"),      # keeps what does not fit
    "scaling_fit": ("np.polyfit(np.log(x), np.log(y), 1)", "np.polyfit(np.log10(x), np.log10(y), 1)",
                    "scaling_test_fit"),                                                      # log10 fit, exp back
    "scaling_optimal": ("math.sqrt(flops / (6 * tokens_per_param))", "math.sqrt(flops / 6) / tokens_per_param",
                        "scaling_test_optimal"),
}


@pytest.mark.slow
def test_wrong_answers_fail_their_graded_cells(lab_folder):
    nb = sections_3_and_5(load_lab())
    for exercise, (right, wrong, _) in WRONG.items():
        cell = cell_by_id(nb, exercise)
        assert right in cell.source, (exercise, right)
        cell.source = cell.source.replace(right, wrong)
    nb, _ = execute(nb, autograding=True, cwd=lab_folder)
    for exercise, (_, _, graded) in WRONG.items():
        assert errors(cell_by_id(nb, graded)), f"{graded} passed with the mistake in {exercise}"
    assert not errors(cell_by_id(nb, "planner_test_memory")), errors(cell_by_id(nb, "planner_test_memory"))


def test_bench_3d_reads_the_planner_and_predicts_each_measured_run():
    # what `disttrain-lab bench 3d` prints beside each measurement (no run here: the table is
    # made from the shipped measurements)
    from disttrain_lab.bench import three_d as bench_3d
    record = json.loads((LAB_DIR / "data" / "step_times.json").read_text())
    planner = bench_3d.lab_functions(str(LAB), ["ModelSpec", "ClusterSpec", "Plan", "step_time"])
    predicted = bench_3d.predictions(record, planner)
    assert len(predicted) == len(record["runs"]) and all(p > 0 for p in predicted)
    table = bench_3d.format_table(record, predicted)
    assert "dp=2 tp=2 pp=2 m=2" in table and "predicted" in table
    assert bench_3d.predictions(record, {}) is None and "n/a" in bench_3d.format_table(record, None)
