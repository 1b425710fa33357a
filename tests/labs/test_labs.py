"""What every lab notebook in solutions/ promises, checked the same way for all of them.

(Executing each solution, the blank release failing every graded cell, and the autograde
round trip are in test_labNN.py and test_grading.py.)
"""

from __future__ import annotations

import ast
import functools
import zipfile

import nbformat
import pytest

from tests.notebooks import REPO, nbgrader_meta, numbering_problems

LABS = sorted((REPO / "solutions").glob("[0-9][0-9]_*/[0-9][0-9]_*.ipynb"))


def definitions(source: str) -> list[str]:
    """Names of the functions and classes a cell defines at top level, and the names it assigns
    (a graded prediction is a variable: ``PREDICTED_BUCKETS = 5``)."""
    tree = ast.parse(source)
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    return names + [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]


@pytest.fixture(params=LABS, ids=[p.stem for p in LABS])
def lab(request) -> nbformat.NotebookNode:
    return nbformat.read(request.param, as_version=4)


def test_setup_cell_first(lab):
    setup = lab.cells[0]
    assert nbgrader_meta(setup).get("grade_id") == "setup" and nbgrader_meta(setup).get("locked")
    for needed in (
        'DISTTRAIN_LAB_PIP = "',
        "import disttrain_lab as dl",
        "dl.doctor(short=True)",
        'FAST = bool(os.environ.get("NBGRADER_EXECUTION"))',
    ):
        assert needed in setup.source, needed


def test_every_exercise_is_followed_by_locked_graded_tests(lab):
    ids = [nbgrader_meta(c)["grade_id"] for c in lab.cells if nbgrader_meta(c)]
    assert len(ids) == len(set(ids)), f"grade ids must be unique: {ids}"
    seen = []
    for cell in lab.cells:
        meta = nbgrader_meta(cell)
        if meta.get("solution"):
            assert meta["grade_id"].startswith("ex_"), meta["grade_id"]
            assert "### BEGIN SOLUTION" in cell.source and definitions(cell.source), meta["grade_id"]
            seen.append(meta["grade_id"])
        elif meta.get("grade"):
            assert seen, f"graded cell {meta['grade_id']} comes before any exercise"
            assert meta.get("locked") and meta.get("points", 0) > 0, meta
            assert cell.source.startswith("checks.verify_untampered()"), meta["grade_id"]
            assert "### BEGIN HIDDEN TESTS" in cell.source and "### END HIDDEN TESTS" in cell.source, meta["grade_id"]
    graded = [i for i in ids if i.startswith("test_")]
    for exercise in seen:  # ex_X is graded by test_X, after it
        name = "test_" + exercise[3:]
        assert name in graded and ids.index(name) > ids.index(exercise), f"{exercise} has no graded {name} after it"


def test_committed_without_outputs(lab):
    assert not [i for i, c in enumerate(lab.cells) if c.cell_type == "code" and c.outputs]


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_one_exercise_heading_per_exercise_and_one_section_per_cell(path):
    # the table of contents reads well: `### Exercise n` above each exercise, numbered 1, 2, ... in
    # order; one `##` section per markdown cell (tests/notebooks.py, numbering_problems)
    assert numbering_problems(nbformat.read(path, as_version=4)) == []


@functools.cache
def _installed_sources() -> str:
    """Every Python file students install: the package's folders at every depth (bench/,
    grading/ ...) and every file of the committed wheel the labs install from."""
    texts = [p.read_text() for p in sorted((REPO / "disttrain_lab").rglob("*.py"))]
    for wheel in sorted((REPO / "labs" / "wheels").glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            texts += [z.read(n).decode() for n in z.namelist() if n.endswith(".py")]
    assert len(texts) > 40, "expected the package's files and the wheel's"
    return "\n".join(texts)


def test_package_ships_none_of_the_solutions(lab):
    # students install disttrain_lab: no function or class they write may be defined in it
    package = _installed_sources()
    for cell in lab.cells:
        if nbgrader_meta(cell).get("solution"):
            for name in definitions(cell.source):
                assert (
                    f"def {name}(" not in package
                    and f"class {name}(" not in package
                    and f"class {name}:" not in package
                ), f"disttrain_lab defines {name}, a solution"


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_graded_tests_run_where_no_student_code_runs(path):
    # issue 24: every graded test runs in the grader kernel, which holds no student code, so a
    # lab's tests reach the student's functions only through dl.exercise.run (or
    # dl.predictions.fetch, a run of it); a test that called them by name would fail there on
    # every submission, the solution's too
    from disttrain_lab.grading.grader_kernel import tests_reach_student_code

    assert tests_reach_student_code(path.parent.name), (
        f"{path.parent.name}: no graded test cell or locked cell calls dl.exercise.run or dl.predictions.fetch"
    )
