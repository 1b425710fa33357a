"""Results export (disttrain_lab/grading/export.py) and the lost points in the class summary
(class_summary.py), on a gradebook made here with nbgrader's own API: a lab of two tests, one
student with full marks and one who lost an exercise, whose autograded notebook shows a hostile
message (colour codes, a bidi override, a hidden-test line, a second line, far too long).

The same files from a real grading run (lab 1, a class of three, graded once by the command
line) are checked against the gradebook in tests/grading/test_gradeclass.py::
test_exports_match_the_gradebook, which also runs ``disttrain-lab export``.
"""

from __future__ import annotations

import csv
import json

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output
from nbgrader.api import Gradebook
from rich.console import Console

from disttrain_lab.grading import cells, class_summary, export
from disttrain_lab.grading.hidden_tests import BEGIN, END, MARKER
from disttrain_lab.grading.ledger import Outcome

LAB = "lab"
HIDDEN = "assert _secret_reference(x) == 42  # the hidden check"


def graded(grade_id: str, source: str, points: float = 0, solution: bool = False) -> nbformat.NotebookNode:
    nbg = {"grade_id": grade_id, "grade": points > 0, "solution": solution, "locked": not solution}
    if points:
        nbg["points"] = points
    return new_code_cell(source, metadata={"nbgrader": nbg})


def the_lab() -> nbformat.NotebookNode:
    return new_notebook(
        cells=[
            new_markdown_cell("# Lab\n## 1. Sums\n### Exercise 1: `add(a, b)`\n```python\n# not a heading\n```"),
            graded("ex_add", "def add(a, b):\n    return a + b", solution=True),
            new_markdown_cell("### Exercise 2: `mul(a, b)`"),
            graded("ex_mul", "def mul(a, b):\n    return a * b", solution=True),
            new_markdown_cell("### Something else"),
            graded("test_add", "assert add(1, 2) == 3", points=2),
            graded("test_product", f"assert mul(2, 3) == 6\n{BEGIN}\n{HIDDEN}\n{END}", points=3),
        ]
    )


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(course dir, source dir): the gradebook as nbgrader would leave it after grading two students
    (made once: nbgrader's database migrations take seconds)."""
    tmp_path = tmp_path_factory.mktemp("export")
    course, source = tmp_path / "course", tmp_path / "source"
    (source / LAB).mkdir(parents=True)
    nbformat.write(the_lab(), source / LAB / f"{LAB}.ipynb")
    course.mkdir()
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        gb.add_assignment(LAB)
        gb.update_or_create_notebook(LAB, LAB)
        gb.add_grade_cell("test_add", LAB, LAB, max_score=2, cell_type="code")
        gb.add_grade_cell("test_product", LAB, LAB, max_score=3, cell_type="code")
        source_of = {c.metadata.nbgrader["grade_id"]: c.source for c in the_lab().cells if c.cell_type == "code"}
        for name in ("test_add", "test_product"):
            gb.add_source_cell(name, LAB, LAB, cell_type="code", locked=True, source=source_of[name], checksum="x")
        gb.add_student("ann", first_name="Ann", last_name="Lee", email="ann@example.org")
        gb.add_student("ben")
        for student, scores in {"ann": (2, 3), "ben": (2, 0)}.items():
            gb.add_submission(LAB, student)
            for name, score in zip(("test_add", "test_product"), scores):
                grade = gb.find_grade(name, LAB, LAB, student)
                grade.auto_score = score
            gb.db.commit()
    # ben's autograded notebook: the failing test shows what his code made it print
    hostile = "\x1b[0;31mmul(2, 3) gave 5\x1b[0m \u202eevil\u200b " + HIDDEN + " " + "x" * 500 + "\nsecond line"
    failing = graded("test_product", "assert mul(2, 3) == 6", points=3)
    failing.outputs = [
        new_output("stream", name="stdout", text="checking\n"),
        new_output("error", ename="AssertionError", evalue=hostile, traceback=["File ...", HIDDEN]),
    ]
    stderr_only = graded("test_add", "assert add(1, 2) == 3", points=2)
    stderr_only.outputs = [new_output("stream", name="stderr", text="\n  a warning\nmore\n")]
    (course / "autograded" / "ben" / LAB).mkdir(parents=True)
    nbformat.write(new_notebook(cells=[stderr_only, failing]), course / "autograded" / "ben" / LAB / f"{LAB}.ipynb")
    return course, source


def test_exercise_names_follow_the_solution_cell_each_test_grades():
    assert cells.exercise_names(the_lab()) == {
        "test_add": "Exercise 1: add(a, b)",  # ex_add: named like it
        "test_product": "Exercise 2: mul(a, b)",  # no ex_product: the cell that binds mul, which it uses
    }
    lonely = new_notebook(cells=[graded("test_x", "assert True", points=1)])
    assert cells.exercise_names(lonely) == {"test_x": "test_x"}  # no heading at all: its grade_id


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_results_read_the_gradebook_and_the_first_line_of_each_failure(made, tmp_path):
    course, source = made
    found = export.results(LAB, course, source)
    assert found.exercises == {"Exercise 1: add(a, b)": 2.0, "Exercise 2: mul(a, b)": 3.0}
    ann, ben = found.students
    assert (ann.student, ann.score, ann.max_score, ann.lost()) == ("ann", 5.0, 5.0, [])
    assert [(t.grade_id, t.score, t.max_score, t.passed, t.message) for t in ann.tests] == [
        ("test_add", 2.0, 2.0, True, None),
        ("test_product", 3.0, 3.0, True, None),
    ]
    [lost] = ben.lost()
    assert (lost.grade_id, lost.exercise, lost.score, lost.passed) == (
        "test_product",
        "Exercise 2: mul(a, b)",
        0.0,
        False,
    )
    # the first line only, colour codes and control characters gone, bounded, the hidden line scrubbed
    assert lost.message.startswith("AssertionError: mul(2, 3) gave 5 evil ")
    assert MARKER in lost.message and HIDDEN not in lost.message and "_secret_reference" not in lost.message
    assert len(lost.message) == export.MESSAGE_CHARS and lost.message.endswith("…")
    assert "second line" not in lost.message and not any(c in lost.message for c in "\x1b\u202e\u200b\n")
    assert ben.tests[0].passed and ben.tests[0].message is None  # stderr, but it scored: no message
    assert export.failure_messages(course / "autograded" / "ben" / LAB / f"{LAB}.ipynb", [])["test_add"] == (
        "stderr: a warning"
    )
    assert export.failure_messages(tmp_path / "none.ipynb", []) == {}
    # a first line that only announces the reason comes with the next (the kit's "f failed on a rank:")
    assert export.clean("add failed on a rank:\n\nrank 1 raised ValueError: no\nTraceback", []) == (
        "add failed on a rank: rank 1 raised ValueError: no"
    )


def test_a_lab_not_in_the_gradebook_names_the_closest(made, tmp_path):
    course, source = made
    with pytest.raises(LookupError, match="it has: lab.*did you mean 'lab'"):
        export.results("lba", course, source)
    with pytest.raises(LookupError, match="no gradebook"):
        export.results(LAB, tmp_path, source)


def test_written_files_carry_the_gradebooks_scores(made, tmp_path):
    course, source = made
    found = export.results(LAB, course, source)
    out = tmp_path / "out"
    (out / "students").mkdir(parents=True)
    (out / "students" / "gone.json").write_text("{}")  # a student an earlier export had
    written = export.write(found, out)
    assert sorted(p.relative_to(out).as_posix() for p in written) == [
        f"{LAB}_canvas.csv",
        f"{LAB}_exercises.csv",
        f"{LAB}_moodle.csv",
        "students/ann.json",
        "students/ben.json",
    ]
    assert not (out / "students" / "gone.json").exists()
    ben = json.loads((out / "students" / "ben.json").read_text())
    assert (ben["lab"], ben["student"], ben["score"], ben["max_score"]) == (LAB, "ben", 2.0, 5.0)
    assert [t["grade_id"] for t in ben["tests"]] == ["test_add", "test_product"]
    assert set(ben["tests"][1]) == {"grade_id", "exercise", "score", "max_score", "passed", "message"}
    text = "".join(p.read_text() for p in written)
    assert HIDDEN not in text and "_secret_reference" not in text

    def rows(name):
        with open(out / f"{LAB}_{name}.csv", newline="") as f:
            return list(csv.reader(f))

    assert rows("exercises") == [
        ["student", "Exercise 1: add(a, b) (max 2)", "Exercise 2: mul(a, b) (max 3)", "total (max 5)"],
        ["ann", "2", "3", "5"],
        ["ben", "2", "0", "2"],
    ]
    assert rows("canvas") == [
        ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", LAB],
        ["Points Possible", "", "", "", "", "5"],
        ["Lee, Ann", "", "", "ann", "", "5"],
        ["ben", "", "", "ben", "", "2"],
    ]
    assert rows("moodle") == [["Username", "Email address", LAB], ["ann", "ann@example.org", "5"], ["ben", "", "2"]]
    export.write(found, out, canvas_key="sis")
    assert [r[2:4] for r in rows("canvas")[2:]] == [["ann", ""], ["ben", ""]]


def test_the_summary_lists_the_points_each_student_lost_and_why(made):
    course, source = made
    found = export.results(LAB, course, source)
    outcomes = {s: Outcome(s, "digest", "graded", 12.0) for s in ("ann", "ben")}
    console = Console(record=True, width=300)
    class_summary.summary(LAB, outcomes, course, console, found)
    table = console.export_text()
    [ann] = [line for line in table.splitlines() if "│ ann" in line]
    [ben] = [line for line in table.splitlines() if "│ ben" in line]
    assert "none: full marks" in ann and "5 / 5" in ann
    assert "Exercise 2: mul(a, b) (0/3): AssertionError: mul(2, 3) gave 5 evil [hidden test line removed] xxx" in ben
    assert "2 / 5" in ben and "x…" in ben  # bounded (LOST_CHARS): one line of the table
    assert "nothing to look at" not in table and "pass rate per exercise" in table
    assert class_summary.lost_points(None) == "-"
