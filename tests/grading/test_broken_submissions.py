"""Submissions broken in other ways than a run of mean (the fixture 00_basics: add 1 + mean 2 +
scale 1 points), autograded in one batch beside test_grading.py's broken runs: a notebook that
replaces the kit's or torch's functions in its own kernel (every later run there is refused), a
flood of output, a test cell edited or deleted, and files that are no notebook of the lab.  Each
loses what it should, the feedback says why, and nothing is left running or on disk."""

from __future__ import annotations

import copy
import html

import pytest

from disttrain_lab import grading
from tests.grading.test_grading import MEAN_OK
from tests.notebooks import load
from tests.roundtrip import FIXTURE_LIMITS, FIXTURES, Course, feedback, grade_id, processes_with, submit, with_solution

pytestmark = pytest.mark.timeout(900)

# Replacing the kit's or torch's functions in one's own kernel: from then on the kit refuses to
# launch there (integrity.verify), so every later test fails, saying what was replaced
TAMPERED = {
    "patches_all_reduce": (
        "import torch.distributed as dist\ndist.all_reduce = lambda *a, **k: None\n" + MEAN_OK,
        "torch.distributed.all_reduce was replaced by code defined in the notebook",
    ),
    "patches_dl_checks": (
        "import importlib, types\n"
        "mod = importlib.import_module('disttrain_lab.checks')\n"
        "for name, obj in list(vars(mod).items()):\n"
        "    if isinstance(obj, types.FunctionType) and not name.startswith('_'):\n"
        "        setattr(mod, name, lambda *a, **k: None)\n" + MEAN_OK,
        "disttrain_lab.checks.assert_close was replaced by code defined in the notebook",
    ),
}
# 5 MB printed by the solution cell, whose mean() is right: the cell's output is capped, and the
# exercise is graded on its merits
FLOOD = "for _ in range(5000):\n    print('x' * 1000)\n" + MEAN_OK


@pytest.fixture(scope="module")
def odd_batch(tmp_path_factory):
    """Every case here plus an honest student, autograded in one plain `nbgrader autograde`."""
    # no case here hangs: a cell limit of 60 s, not the fixtures' 20, so that a kernel's first launch on a
    # loaded CI host (three workers on two cores) is not mistaken for a broken exercise
    course = Course(tmp_path_factory.mktemp("odd"), "00_basics", FIXTURES, dict(FIXTURE_LIMITS, cell_timeout=60))
    course.do_release()
    sol, lab = course.solution, course.lab
    for name, (source, _) in TAMPERED.items():
        submit(course.course, name, lab, with_solution(sol, "ex_mean", source))
    submit(course.course, "huge_output", lab, with_solution(sol, "ex_mean", FLOOD))
    submit(
        course.course, "huge_output_wrong", lab, with_solution(sol, "ex_mean", FLOOD + "def mean(xs):\n    return 0\n")
    )
    wrong = with_solution(sol, "ex_mean", "def mean(xs):\n    return 0\n")
    edited = copy.deepcopy(wrong)
    [test_cell] = [c for c in edited.cells if grade_id(c) == "test_mean"]
    test_cell.source = "assert True"
    submit(course.course, "tests_edited", lab, edited)
    deleted = copy.deepcopy(wrong)
    deleted.cells = [c for c in deleted.cells if grade_id(c) != "test_mean"]
    submit(course.course, "tests_deleted", lab, deleted)
    submit(course.course, "malformed_json", lab, '{"cells": [ {"cell_type": "code", ')
    submit(course.course, "empty_file", lab, "")
    submit(course.course, "wrong_lab", lab, load(FIXTURES / "00_launch" / "00_launch.ipynb"))
    submit(course.course, "honest_full", lab, sol)
    course.results = course.grade(one_process_per_student=False)
    course.table = grading.scores(lab, course.course)
    return course


def errors_of(course, student: str) -> dict[str, list[str]]:
    """Each graded cell's errors in ``student``'s autograded notebook (what a failed score assertion shows)."""
    return {
        grade_id(c): [f"{o.ename}: {o.evalue[:500]}" for o in c.outputs if o.output_type == "error"]
        for c in course.autograded(student).cells
        if c.cell_type == "code" and grade_id(c)
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tests_edited", "tests_deleted"])
def test_an_edited_or_deleted_test_cell_grades_as_the_release_has_it(odd_batch, case):
    assert odd_batch.results[case].returncode == 0, odd_batch.results[case].output[-3000:]
    assert odd_batch.table[case] == {"test_add": 1.0, "test_mean": 0.0, "test_scale": 1.0, "total": 2.0}, errors_of(
        odd_batch, case
    )
    assert "mean([1, 2, 3]) should be 2" in html.unescape(feedback(odd_batch.course, case, "00_basics"))


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_replacing_the_kit_in_ones_own_kernel_fails_every_later_test(odd_batch, case):
    assert odd_batch.results[case].returncode == 0, odd_batch.results[case].output[-3000:]
    assert odd_batch.table[case] == {"test_add": 1.0, "test_mean": 0.0, "test_scale": 0.0, "total": 1.0}, errors_of(
        odd_batch, case
    )
    page = html.unescape(feedback(odd_batch.course, case, "00_basics"))
    assert "TamperingError: grading relies on torch's and disttrain_lab's own functions" in page
    assert TAMPERED[case][1] in page
    for test in ("test_mean", "test_scale"):  # each says so, not only the first
        [cell] = [c for c in odd_batch.autograded(case).cells if grade_id(c) == test]
        assert any(TAMPERED[case][1] in o.get("evalue", "") for o in cell.outputs), (test, cell.outputs)


@pytest.mark.slow
def test_a_flood_of_output_is_capped_and_the_exercise_graded_on_its_merits(odd_batch):
    assert odd_batch.results["huge_output"].returncode == 0, odd_batch.results["huge_output"].output[-3000:]
    assert odd_batch.table["huge_output"] == {"test_add": 1.0, "test_mean": 2.0, "test_scale": 1.0, "total": 4.0}, (
        errors_of(odd_batch, "huge_output")
    )
    path = odd_batch.course / "autograded" / "huge_output" / "00_basics" / "00_basics.ipynb"
    assert path.stat().st_size < 3 * 10**6, path.stat().st_size
    [cell] = [c for c in odd_batch.autograded("huge_output").cells if grade_id(c) == "ex_mean"]
    assert [o.ename for o in cell.outputs if o.output_type == "error"] == ["OutputLimitExceeded"]
    # the cap is per cell: the failing test after the flood shows its own message
    assert odd_batch.table["huge_output_wrong"] == {
        "test_add": 1.0,
        "test_mean": 0.0,
        "test_scale": 1.0,
        "total": 2.0,
    }, errors_of(odd_batch, "huge_output_wrong")
    [test] = [c for c in odd_batch.autograded("huge_output_wrong").cells if grade_id(c) == "test_mean"]
    assert [(o.ename, o.evalue) for o in test.outputs if o.output_type == "error"] == [
        ("AssertionError", "mean([1, 2, 3]) should be 2")
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,why",
    [
        ("malformed_json", "not valid notebook JSON"),
        ("empty_file", "is an empty file"),
        ("wrong_lab", "is not the notebook of lab 00_basics"),
    ],
)
def test_unreadable_submission_scores_zero_with_a_note(odd_batch, case, why):
    assert odd_batch.results[case].returncode == 0, odd_batch.results[case].output[-3000:]
    assert odd_batch.table[case]["total"] == 0
    assert why in feedback(odd_batch.course, case, "00_basics")


@pytest.mark.slow
def test_deleted_test_cell_is_restored(odd_batch):
    assert "was missing from the submission" in feedback(odd_batch.course, "tests_deleted", "00_basics")


@pytest.mark.slow
def test_the_honest_student_beside_them_intact_and_nothing_left_behind(odd_batch):
    assert odd_batch.table["honest_full"]["total"] == 4
    assert set(odd_batch.table) == set(odd_batch.results)
    assert not processes_with(str(odd_batch.course))
    assert not list(odd_batch.tmp.iterdir())
