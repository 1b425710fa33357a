"""Time on task per exercise, for the instructor's class report (#41): how long the class took,
so that a lab's claims of hours come from a class, not a guess.

Each submission carries ``disttrain-times.json`` (``worktime.py`` writes it in the student's
kernel): the first run and the first error-free run of each cell, by cell id.  An exercise's cells
are the code cells after the previous graded cell up to its own graded cell (its teaching cells,
its solution, its self-check), named as the export names it (``cells.exercise_names``, from the
lab's source: the release keeps its cell ids).  A student's time on it runs from the first run of
any of those cells to the first passing run of its self-check (a cell calling ``checks.passed`` or
``dl.predictions.check``; else its graded cell's visible part).  A student who did not reach a
passing self-check, or worked out of order (the end before the start), counts for nothing there.

The record is the student's own and grades nothing; it is read as untrusted data
(``worktime.read``).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import nbformat
from rich.table import Table

from ..worktime import FILE, read
from .cells import exercise_names, grade_id, is_graded

__all__ = ["exercise_cells", "seconds_per_exercise", "class_times", "table"]

SELF_CHECK_MARKS = ("checks.passed(", "predictions.check(")


def exercise_cells(nb: nbformat.NotebookNode) -> dict[str, tuple[list[str], list[str]]]:
    """{exercise name: (the ids of its code cells, the ids of the cells whose passing run ends it)}, in
    the lab's order; an exercise graded by two cells gets the cells of both."""
    names = exercise_names(nb)
    found: dict[str, tuple[list[str], list[str]]] = {}
    since: list = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if not is_graded(cell):
            since.append(cell)
            continue
        ids, ends = found.setdefault(names.get(grade_id(cell), grade_id(cell)), ([], []))
        checks = [c.id for c in since if any(mark in c.source for mark in SELF_CHECK_MARKS)]
        ids += [c.id for c in since] + [cell.id]
        ends += checks or [cell.id]
        since = []
    return found


def seconds_per_exercise(nb: nbformat.NotebookNode, times: dict[str, dict[str, float]]) -> dict[str, float]:
    """One student's time on each exercise (``exercise_cells``), from their record ``times``."""
    spent = {}
    for exercise, (ids, ends) in exercise_cells(nb).items():
        starts = [times[i]["first_run"] for i in ids if "first_run" in times.get(i, {})]
        if not starts:
            continue
        passed = [times[i]["first_ok"] for i in ends if times.get(i, {}).get("first_ok", 0) >= min(starts)]
        if passed:
            spent[exercise] = min(passed) - min(starts)
    return spent


def class_times(course: Path, lab: str, nb: nbformat.NotebookNode) -> dict[str, list[float]]:
    """{exercise: each student's seconds on it} over the course's submissions of ``lab``
    (``<course>/submitted/<student>/<lab>/disttrain-times.json``)."""
    per_exercise: dict[str, list[float]] = {name: [] for name in exercise_cells(nb)}
    for folder in sorted((Path(course) / "submitted").glob(f"*/{lab}")):
        for exercise, seconds in seconds_per_exercise(nb, read(folder / FILE)).items():
            per_exercise[exercise].append(seconds)
    return per_exercise


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def table(per_exercise: dict[str, list[float]], students: int) -> Table:
    """The report's table: per exercise, how many of the ``students`` have a time, its median and quartiles."""
    out = Table(
        title="time on task per exercise (the students' own record, from the first run of its cells to its first "
        "passing self-check; grades nothing)",
        title_justify="left",
    )
    for name, justify in (("exercise", "left"), ("students", "right"), ("median", "right"), ("middle half", "right")):
        out.add_column(name, justify=justify)
    for exercise, seconds in per_exercise.items():
        if not seconds:
            out.add_row(exercise, f"0 / {students}", "-", "-")
            continue
        low, _, high = statistics.quantiles(seconds, n=4, method="inclusive") if len(seconds) > 1 else seconds * 3
        out.add_row(
            exercise,
            f"{len(seconds)} / {students}",
            _minutes(statistics.median(seconds)),
            f"{_minutes(low)} – {_minutes(high)}",
        )
    return out
