"""What an instructor reads after grading a class: what went wrong in grading each student
(``diagnose``: timeout, crash, kernel death, cell time limit, flagged) and the summary table
(per student: score, time, the exercises they lost points on with the first line of each
message, grading problems; the class's pass rate per exercise), read from the gradebook and
the autograded notebooks by ``export.results``; and, where the submissions carry the students'
record of their work, time on task per exercise (``time_on_task.py``)."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbgrader.api import Gradebook
from rich.table import Table
from rich.text import Text

from .export import ClassResults, StudentResult, lab_notebook, results
from .ledger import Outcome
from .steps import StepResult
from .submission import scan_submission
from .time_on_task import class_times, table


def diagnose(course: Path, lab: str, student: str, result: StepResult) -> list[str]:
    """What a human should know: timeout, crash, kernel death, cell time limit, flagged."""
    problems = []
    if result.timed_out:
        problems.append("timeout: STOPPED (time cap)")
    elif result.returncode != 0:
        problems.append("crash: grading failed (nbgrader exited with an error)")
    path = course / "autograded" / student / lab / f"{lab}.ipynb"
    try:
        nb = nbformat.read(path, as_version=4) if path.exists() else None
    except Exception:  # noqa: BLE001 - an unreadable result is itself the problem
        nb, _ = None, problems.append("crash: the autograded notebook cannot be read")
    found = {"DeadKernelError": [], "CellTimeoutError": []}
    for cell in nb.cells if nb else []:
        names = {o.get("ename") for o in cell.get("outputs", []) if o.get("output_type") == "error"}
        for ename, cells in found.items():
            if ename in names:
                cells.append(cell.get("metadata", {}).get("nbgrader", {}).get("grade_id"))
    for ename, what in (("DeadKernelError", "kernel death"), ("CellTimeoutError", "cell time limit")):
        named = [c for c in found[ename] if c]
        others = len(found[ename]) - len(named)
        if found[ename]:
            problems.append(f"{what}: " + ", ".join(named + ([f"{others} other cell(s)"] if others else [])))
    # hostile constructs a human should look at (the grader's notes are in the grade report too)
    flags = scan_submission(course / "submitted" / student / lab / f"{lab}.ipynb")
    if flags:
        problems.append(f"flagged: {len(flags)} construct(s) to look at (see the grade report)")
    return problems


def gradebook_points(lab: str, course: Path) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """({student: {grade_id: score, "total": score}}, {grade_id: max points}) from the gradebook."""
    table, maximum = {}, {}
    with Gradebook(f"sqlite:///{Path(course) / 'gradebook.db'}") as gb:
        assignment = gb.find_assignment(lab)
        for notebook in assignment.notebooks:
            for cell in notebook.grade_cells:
                if cell.max_score:
                    maximum[cell.name] = float(cell.max_score)
        for submission in assignment.submissions:
            row = {g.name: float(g.score) for nb in submission.notebooks for g in nb.grades if g.max_score}
            row["total"] = float(submission.score)
            table[submission.student.id] = row
    return table, maximum


LOST_CHARS = 100  # of a message in the terminal table (the export's JSON keeps up to export.MESSAGE_CHARS)


def lost_points(student: StudentResult | None) -> str:
    """One line per test the student lost points on: the exercise, the points, the message's first line."""
    if student is None:
        return "-"
    lines = []
    for t in student.lost():
        message = t.message or "no message (see the feedback)"
        message = message if len(message) <= LOST_CHARS else message[: LOST_CHARS - 1] + "…"
        lines.append(f"{t.exercise} ({t.score:g}/{t.max_score:g}): {message}")
    return "\n".join(lines) or "none: full marks"


def summary(lab: str, outcomes: dict[str, Outcome], course: Path, console, found: ClassResults | None = None) -> None:
    """Per student: score, time, the exercises they lost points on (with why), what went wrong in
    grading; per exercise: the class's pass rate (full marks)."""
    found = found or results(lab, course)
    by_student = {s.student: s for s in found.students}
    total = sum(found.exercises.values())
    students = Table(title=f"{lab}: {len(outcomes)} students", title_justify="left")
    for name, justify in (
        ("student", "left"),
        ("score", "right"),
        ("time", "right"),
        ("lost points", "left"),
        ("grading problems", "left"),
    ):
        students.add_column(name, justify=justify, overflow="fold")
    for student, outcome in outcomes.items():
        graded = by_student.get(student)
        problems = "; ".join(outcome.problems) + (
            "  (grading failed: needs a look)" if outcome.status != "graded" else ""
        )
        students.add_row(
            Text(student),  # (Text: what a student wrote is never read as rich markup)
            f"{graded.score:g} / {total:g}" if graded else "-",
            f"{outcome.seconds:.0f} s" + ("" if outcome.regraded else " (earlier run)"),
            Text(lost_points(graded)),
            Text(problems or "none"),
        )
    console.print(students)
    exercises = Table(title="pass rate per exercise (full marks)", title_justify="left")
    for name, justify in (("exercise", "left"), ("points", "right"), ("passed", "right"), ("rate", "right")):
        exercises.add_column(name, justify=justify)
    graded = [by_student[s] for s in outcomes if s in by_student]
    for exercise, most in found.exercises.items():
        passed = sum(all(t.passed for t in s.tests if t.exercise == exercise) for s in graded)
        exercises.add_row(
            exercise, f"{most:g}", f"{passed} / {len(graded)}", f"{passed / len(graded):.0%}" if graded else "-"
        )
    console.print(exercises)
    times = class_times(course, lab, lab_notebook(lab, None))
    if any(times.values()):  # (labs done where no front end sends cell ids, Colab: no record at all)
        console.print(table(times, len(outcomes)))
