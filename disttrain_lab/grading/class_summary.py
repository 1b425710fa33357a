"""What an instructor reads after grading a class: what went wrong for each student
(``diagnose``: timeout, crash, kernel death, cell time limit, flagged) and the summary table
(score, time, problems per student; the class's pass rate per exercise)."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbgrader.api import Gradebook
from rich.table import Table

from .ledger import Outcome
from .steps import StepResult
from .submission import scan_submission


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
    # hostile constructs a human should look at (what the guard put back is in the grade report too)
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


def summary(lab: str, outcomes: dict[str, Outcome], course: Path, console) -> None:
    """Per student: score, time, what failed; per exercise: the class's pass rate (full marks)."""
    points, maximum = gradebook_points(lab, course)
    total = sum(maximum.values())
    students = Table(title=f"{lab}: {len(outcomes)} students", title_justify="left")
    for name, justify in (("student", "left"), ("score", "right"), ("time", "right"), ("what failed", "left")):
        students.add_column(name, justify=justify, overflow="fold")
    for student, outcome in outcomes.items():
        score = points.get(student, {}).get("total")
        failed = "; ".join(outcome.problems) + (
            "  (grading failed: needs a look)" if outcome.status != "graded" else ""
        )
        students.add_row(
            student,
            f"{score:g} / {total:g}" if score is not None else "-",
            f"{outcome.seconds:.0f} s" + ("" if outcome.regraded else " (earlier run)"),
            failed,
        )
    console.print(students)
    exercises = Table(title="pass rate per exercise (full marks)", title_justify="left")
    for name, justify in (("exercise", "left"), ("points", "right"), ("passed", "right"), ("rate", "right")):
        exercises.add_column(name, justify=justify)
    graded = [points[s] for s in outcomes if s in points]
    for grade_id, most in maximum.items():
        passed = sum(row.get(grade_id, 0.0) >= most for row in graded)
        exercises.add_row(
            grade_id, f"{most:g}", f"{passed} / {len(graded)}", f"{passed / len(graded):.0%}" if graded else "-"
        )
    console.print(exercises)
