"""A graded lab's results in the files a course needs: ``disttrain-lab export LAB`` (and the end
of ``disttrain-lab grade``, unless ``--no-export``), written into ``<course>/exports/<lab>/``:

- ``students/<student>.json``: every graded test (grade_id, exercise, score, max score,
  passed, the first line of its failure message);
- ``<lab>_exercises.csv``: one row per student, one column of points per exercise, the total;
- ``<lab>_canvas.csv`` and ``<lab>_moodle.csv``: the total in the shape each LMS's gradebook
  import takes, keyed on the student's nbgrader id.

Scores come from the gradebook (nbgrader's API), never from a notebook.  A message comes from the
test cell's error output (else its stderr) in the autograded notebook: text the student's code
controls, so only its first line is kept, without control characters or colour codes, bounded to
``MESSAGE_CHARS`` and scrubbed of hidden-test lines as the feedback is; a test's source is never
read.  An exercise is named by the lab's heading above the solution cell its test grades
(``cells.exercise_names``, read from the lab's source notebook).
"""

from __future__ import annotations

import argparse
import csv
import difflib
import json
import re
import sys
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path

import nbformat
from nbgrader.api import Gradebook, MissingEntry

from .cells import exercise_names, grade_id, nbgrader_metadata
from .config import course_dir, release_dir, source_dir
from .hidden_tests import gradebook_hidden_lines, scrub_text

MESSAGE_CHARS = 200  # of a message's first line: room for "AssertionError: ring_shift(x) gave X, expected Y"
EXPORT_DIR = "exports"  # <course>/exports/<lab>/


@dataclass
class TestResult:
    """One graded test of one student, as the student's JSON file lists it."""

    grade_id: str
    exercise: str  # the lab's heading for it, or its grade_id
    score: float
    max_score: float
    passed: bool  # full marks
    message: str | None  # why it failed, first line; None when it passed (or no autograded notebook shows why)


@dataclass
class StudentResult:
    student: str  # nbgrader's student id: what the LMS files key on
    first_name: str
    last_name: str
    email: str
    score: float
    max_score: float
    tests: list[TestResult]

    def lost(self) -> list[TestResult]:
        return [t for t in self.tests if not t.passed]


@dataclass
class ClassResults:
    lab: str
    exercises: dict[str, float]  # exercise name -> its points, in the lab's order
    students: list[StudentResult]  # by student id


# ----------------------------------------------------------------------------------------
# Reading: the gradebook, the lab's headings, the autograded notebooks


def results(lab: str, course: Path | None = None, source: Path | None = None) -> ClassResults:
    """Every graded student of ``lab`` in the course's gradebook.  LookupError when there is no
    gradebook or no such lab in it (naming the labs it has)."""
    course = Path(course or course_dir())
    db = f"sqlite:///{course / 'gradebook.db'}"
    if not (course / "gradebook.db").is_file():
        raise LookupError(f"no gradebook at {course / 'gradebook.db'} (grade the lab first, or give --course-dir)")
    names = exercise_names(lab_notebook(lab, source))
    with Gradebook(db) as gb:
        try:
            assignment = gb.find_assignment(lab)
        except MissingEntry:
            labs = [a.name for a in gb.assignments]
            close = difflib.get_close_matches(lab, labs, n=1)
            raise LookupError(
                f"no lab {lab!r} in {course / 'gradebook.db'} (it has: {', '.join(labs) or 'none'})"
                + (f"; did you mean {close[0]!r}?" if close else "")
            ) from None
        order = list(names)  # the lab's order; a cell its source lacks goes last
        tests = sorted(
            ((c.name, float(c.max_score)) for nb in assignment.notebooks for c in nb.grade_cells if c.max_score),
            key=lambda t: order.index(t[0]) if t[0] in order else len(order),
        )
        exercises: dict[str, float] = {}
        for gid, most in tests:
            exercises[names.get(gid, gid)] = exercises.get(names.get(gid, gid), 0.0) + most
        notebooks = [nb.name for nb in assignment.notebooks]
        hidden = sorted(
            {line for nb in notebooks for line in gradebook_hidden_lines(db, nb, lab)}, key=len, reverse=True
        )
        students = []
        for sub in assignment.submissions:
            scores = {g.name: float(g.score) for nb in sub.notebooks for g in nb.grades if g.max_score}
            messages = {}
            for nb in notebooks:
                messages.update(failure_messages(course / "autograded" / sub.student.id / lab / f"{nb}.ipynb", hidden))
            graded = []
            for gid, most in tests:
                score = scores.get(gid, 0.0)
                passed = score >= most
                graded.append(
                    TestResult(gid, names.get(gid, gid), score, most, passed, None if passed else messages.get(gid))
                )
            who = sub.student
            identity = (who.first_name or "", who.last_name or "", who.email or "")
            students.append(StudentResult(who.id, *identity, float(sub.score), float(sub.max_score), graded))
    return ClassResults(lab, exercises, sorted(students, key=lambda s: s.student))


def lab_notebook(lab: str, source: Path | None) -> nbformat.NotebookNode:
    """The lab as the instructor wrote it (for its headings): the source, else the release, else none."""
    for folder in (Path(source or source_dir()), release_dir()):
        try:
            return nbformat.read(folder / lab / f"{lab}.ipynb", as_version=4)
        except (OSError, ValueError):
            continue
    return nbformat.v4.new_notebook()  # every test named by its grade_id


def failure_messages(path: Path, hidden: list[str]) -> dict[str, str]:
    """{grade_id: the first line of why it failed} for each graded cell of the autograded notebook at
    ``path`` that shows an error (else stderr output); {} when there is no such notebook."""
    try:
        nb = nbformat.read(path, as_version=4)
    except (OSError, ValueError):
        return {}
    found = {}
    for cell in nb.cells:
        if cell.cell_type != "code" or not nbgrader_metadata(cell).get("grade"):
            continue
        outputs = cell.get("outputs", [])
        errors = [o for o in outputs if o.get("output_type") == "error"]
        stderr = "".join(
            o.get("text", "") for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stderr"
        )
        if errors:
            name, value = (clean(str(errors[0].get(key, "")), hidden) for key in ("ename", "evalue"))
            found[grade_id(cell)] = _bounded(f"{name}: {value}" if value else name or "error")
        elif stderr.strip():
            found[grade_id(cell)] = _bounded("stderr: " + clean(stderr, hidden))
    return found


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")


def clean(text: str, hidden: list[str]) -> str:
    """The first non-blank line of ``text`` (the student's code wrote it; with the next one when it
    only announces it: "ping_pong failed on a rank:"), its colour codes and every control or format
    character (bidi overrides, zero-width) gone, hidden-test lines scrubbed."""
    lines = [line for line in _ANSI.sub("", text).splitlines() if line.strip()][:2]
    line = scrub_text(" ".join(lines) if lines and lines[0].rstrip().endswith(":") else "".join(lines[:1]), hidden)
    line = "".join(" " if unicodedata.category(ch)[0] in "CZ" else ch for ch in line)  # (Z: odd spaces, too)
    return scrub_text(" ".join(line.split()), hidden)  # again: a line that control characters hid


def _bounded(text: str) -> str:
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 1] + "…"


# ----------------------------------------------------------------------------------------
# Writing: a JSON file per student, three CSVs


def write(found: ClassResults, out: Path, canvas_key: str = "login") -> list[Path]:
    """The export files of ``found``, written into ``out`` (a student's file from an earlier export
    whom the gradebook no longer has is removed); returns their paths."""
    if canvas_key not in ("login", "sis"):
        raise ValueError(f"canvas_key is 'login' (SIS Login ID) or 'sis' (SIS User ID), not {canvas_key!r}")
    lab, total = found.lab, sum(found.exercises.values())
    (out / "students").mkdir(parents=True, exist_ok=True)
    for stale in (out / "students").glob("*.json"):
        stale.unlink()
    written = []
    for s in found.students:
        path = out / "students" / f"{s.student}.json"
        record = {"lab": lab, "student": s.student, "score": s.score, "max_score": s.max_score}
        path.write_text(json.dumps({**record, "tests": [asdict(t) for t in s.tests]}, indent=1) + "\n")
        written.append(path)

    def table(name: str, rows: list[list[str]]) -> None:
        written.append(out / f"{lab}_{name}.csv")
        with open(written[-1], "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows(rows)

    exercises = [
        ["student", *(f"{name} (max {most:g})" for name, most in found.exercises.items()), f"total (max {total:g})"]
    ]
    for s in found.students:
        points = dict.fromkeys(found.exercises, 0.0)
        for t in s.tests:
            points[t.exercise] += t.score
        exercises.append([s.student, *map(_num, points.values()), _num(s.score)])
    table("exercises", exercises)

    # Canvas, Grades > Import: the columns of its own export, "Student", "ID", "SIS User ID", "SIS Login ID",
    # "Section", then one per assignment, and a "Points Possible" row (community.canvaslms.com/t5/Instructor-Guide/
    # How-do-I-import-grades-in-the-Gradebook/ta-p/807; canvas-lms app/models/gradebook_importer.rb).  A row is matched
    # by ID (Canvas's own user number: left empty, nbgrader does not know it), then SIS User ID, then SIS Login ID,
    # then name; nbgrader's id goes in the SIS column `canvas_key` names.  The assignment column is the lab's name
    # alone: Canvas reads a header "Title (123)" as its assignment number 123.
    canvas = [
        ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", lab],
        ["Points Possible", "", "", "", "", _num(total)],
    ]
    for s in found.students:
        ids = [s.student, ""] if canvas_key == "sis" else ["", s.student]
        canvas.append([_sortable_name(s), "", *ids, "", _num(s.score)])
    table("canvas", canvas)

    # Moodle, Grades > Import > CSV file (docs.moodle.org/en/Grade_import): the import maps one column to a user field
    # ("Map from" a column, "Map to" username, useremail, useridnumber or userid) and each other to a grade item.
    # "Username" holds nbgrader's id (map it to username), "Email address" the gradebook's, if it has one.
    table(
        "moodle", [["Username", "Email address", lab], *([s.student, s.email, _num(s.score)] for s in found.students)]
    )
    return written


def _num(x: float) -> str:
    return f"{x:g}"


def _sortable_name(s: StudentResult) -> str:
    # Canvas falls back to the name ("Last, First" or "First Last") only when no SIS column matched
    return (
        f"{s.last_name}, {s.first_name}" if s.first_name and s.last_name else s.last_name or s.first_name or s.student
    )


def export_dir(lab: str, course: Path) -> Path:
    return Path(course) / EXPORT_DIR / lab


# ----------------------------------------------------------------------------------------
# `disttrain-lab export LAB`


def cli_export(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="disttrain-lab export",
        description="Write a graded lab's results from the gradebook: per student a JSON file of every test "
        "(score, first line of the failure), a per-exercise CSV, and CSVs for Canvas's and Moodle's gradebook import.",
    )
    parser.add_argument("lab", help="the lab's name, as graded (e.g. 01_point_to_point)")
    parser.add_argument(
        "--course-dir",
        type=Path,
        help="course directory holding gradebook.db and autograded/ (default: $DISTTRAIN_COURSE_DIR "
        "or ~/.disttrain-lab/course)",
    )
    parser.add_argument("--out", type=Path, help="the folder to write into (default: <course-dir>/exports/<lab>/)")
    parser.add_argument(
        "--canvas-key",
        choices=("login", "sis"),
        default="login",
        help="the Canvas column holding nbgrader's student id: login (SIS Login ID, the default) or sis (SIS User ID)",
    )
    args = parser.parse_args(argv)
    course = Path(args.course_dir or course_dir()).resolve()
    out = Path(args.out or export_dir(args.lab, course))
    try:
        found = results(args.lab, course)
    except LookupError as exc:
        print(f"disttrain-lab export: {exc}", file=sys.stderr)
        return 1
    write(found, out, args.canvas_key)
    print(f"exported {args.lab}, {len(found.students)} students: {out}")
    return 0
