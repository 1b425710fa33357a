"""`disttrain-lab new-lab NN_name` (issue 35): a new lab's files in the shape every lab has, which
release and grade as they are: the blank notebook earns nothing, the solution every point.

The lab is made in a throw-away project folder (a copy of the README, an empty solutions/), its
checks module there under disttrain_lab/labtests/, found by the kernels through DISTTRAIN_LABTESTS
(disttrain_lab/labtests/__init__.py extends its path); graded without the sandbox, whose kernel
gets only the variables it names.
"""

from __future__ import annotations

import shutil
import subprocess

import nbformat
import pytest

from disttrain_lab import grading
from tests.grading.test_grading import Course, all_points, submit
from tests.helpers import REPO
from tests.labs.test_time_budgets import budget_of, summed
from tests.notebooks import nbgrader_meta, numbering_problems, prediction_problems

LAB = "99_scaffolded"
TITLE = "A lab from the scaffold"
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # (a subprocess each: over the fast tier's 3 s)


def _new_lab(root, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(REPO / ".venv" / "bin" / "disttrain-lab"), "new-lab", *args, "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    shutil.copy(REPO / "README.md", root / "README.md")
    (root / "solutions").mkdir()
    made = _new_lab(root, LAB, "--title", TITLE)
    assert made.returncode == 0, made.stderr
    return root


def test_the_new_lab_has_every_section_and_its_own_files_only(project):
    nb = nbformat.read(project / "solutions" / LAB / f"{LAB}.ipynb", as_version=4)
    ids = [nbgrader_meta(c).get("grade_id") for c in nb.cells if nbgrader_meta(c)]
    assert ids == ["setup", "ex_all_sum", "test_all_sum", "ex_predict_all_sum", "test_predict_all_sum"]
    assert nb.cells[0].source.count("from disttrain_lab.labtests import lab99 as lab_tests") == 1
    assert numbering_problems(nb) == [] and prediction_problems(nb) == []
    # its time table has the labs' form, and its claim is the sum of its rows (tests/labs/test_time_budgets.py)
    budget = budget_of(nb, LAB)
    assert budget["core"] == summed(budget["rows"], {"core"}) == (25, 35) and budget["total"] is None, budget
    for cell in nb.cells:
        if nbgrader_meta(cell).get("grade"):
            assert cell.source.startswith("checks.verify_untampered()") and "### BEGIN HIDDEN TESTS" in cell.source
    checks = (project / "disttrain_lab" / "labtests" / "lab99.py").read_text()
    assert "def check_all_sum(" in checks and "all_reduce" not in checks  # a check, not a solution
    readme = (project / "README.md").read_text()
    assert f"| `{LAB}` | {TITLE} | — |" in readme
    assert readme.index("`11_expert_parallel`") < readme.index(f"`{LAB}`")  # after the last lab's row
    assert sorted(p.relative_to(project).as_posix() for p in project.rglob("*") if p.is_file()) == [
        "README.md",
        "disttrain_lab/labtests/lab99.py",
        f"solutions/{LAB}/{LAB}.ipynb",
    ]


def test_a_taken_number_or_a_bad_name_is_refused_and_changes_nothing(project):
    before = (project / "README.md").read_text()
    taken = _new_lab(project, "99_other")
    assert taken.returncode == 2 and "lab number 99 is taken" in taken.stderr, taken.stderr
    bad = _new_lab(project, "Lab-11")
    assert bad.returncode == 2 and "two digits, an underscore and lower-case words" in bad.stderr, bad.stderr
    assert (project / "README.md").read_text() == before and not (project / "solutions" / "99_other").exists()


@pytest.mark.slow
def test_the_new_lab_releases_and_grades_blank_zero_and_solution_full(project, tmp_path, monkeypatch):
    monkeypatch.setenv("DISTTRAIN_LABTESTS", str(project / "disttrain_lab" / "labtests"))  # lab99's checks
    course = Course(tmp_path, LAB, project / "solutions", {"sandbox": "off", "cell_timeout": 120})
    course.do_release()
    submit(course.course, "full", LAB, course.solution)
    submit(course.course, "blank", LAB, course.blank())
    results = course.grade(["full", "blank"], one_process_per_student=False)
    assert all(r.returncode == 0 for r in results.values()), {s: r.output[-2000:] for s, r in results.items()}
    table = grading.scores(LAB, course.course)
    assert table["full"]["total"] == sum(all_points(course.solution).values()) == 3, table
    assert table["blank"]["total"] == 0, table
