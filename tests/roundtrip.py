"""Courses for grading tests, and the nbgrader round trip of a lab, made once per test session.

A lab's round trip (release it; autograde the solution submitted as a student and the released
blank notebook; on the launch fixture also a partly done and a crashed one) is
the costliest thing the suite does with a lab, and two test files need it:
tests/grading/test_grading.py checks the scores, and the lab's own file checks what the
solution's cells showed (``tests.notebooks.run_solution``). ``round_trip`` makes it once per
session, whichever pytest-xdist worker asks first (the other waits on a file lock, as
pytest-xdist's documentation does for a session fixture run once), and both read it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import nbformat
from filelock import FileLock

from disttrain_lab import grading
from disttrain_lab.grading.steps import processes_with  # noqa: F401  (the tests import it from here)
from tests.helpers import REPO, load

FIXTURES = REPO / "tests" / "fixtures" / "source"
SOLUTIONS = REPO / "solutions"
FIRST_REAL_LAB = (grading.list_labs(SOLUTIONS) or [None])[0]

# where the workers of one session share their round trips (tests/conftest.py sets it)
SHARED: Path | None = None

# small limits so broken cases cost seconds, not minutes; real labs get the defaults.  A fixture's
# test makes up to three runs on the student's ranks, and a run is not started with less than
# 5 s of the test's limit left (hangs.REPORT_MARGIN + MIN_LAUNCH): 20 s leaves room under load
FIXTURE_LIMITS = dict(cell_timeout=20, notebook_timeout=180, kernel_memory=2 * 2**30, student_timeout=300)

# ----------------------------------------------------------------------------------------
# crafting submissions


def grade_id(cell) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def with_solution(nb, exercise: str, source: str):
    """A copy of nb whose solution cell `exercise` has `source` instead."""
    nb = copy.deepcopy(nb)
    [cell] = [c for c in nb.cells if grade_id(c) == exercise]
    cell.source = source
    return nb


def points_after(nb, solution_id: str) -> dict[str, float]:
    """Test cells of the exercise whose solution cell is `solution_id` (until the next solution)."""
    out, inside = {}, False
    for cell in nb.cells:
        nbg = cell.get("metadata", {}).get("nbgrader", {})
        if nbg.get("solution"):
            inside = nbg.get("grade_id") == solution_id
        elif inside and nbg.get("grade"):
            out[nbg["grade_id"]] = float(nbg["points"])
    return out


def all_points(nb) -> dict[str, float]:
    return {
        grade_id(c): float(c.metadata.nbgrader["points"])
        for c in nb.cells
        if c.get("metadata", {}).get("nbgrader", {}).get("grade")
    }


def submit(course: Path, student: str, lab: str, content) -> None:
    folder = course / "submitted" / student / lab
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{lab}.ipynb"
    if isinstance(content, (str, bytes)):
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    else:
        nbformat.write(content, path)


def feedback(course: Path, student: str, lab: str) -> str:
    path = course / "feedback" / student / lab / f"{lab}.html"
    return path.read_text() if path.exists() else ""


class Course:
    """A throw-away course directory for one lab, with its own release and temp root."""

    def __init__(self, root: Path, lab: str, source: Path, limits: dict | None):
        self.lab, self.source, self.root = lab, source, root
        self.course, self.release, self.tmp = root / "course", root / "release", root / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.limits = grading.Limits(**limits) if limits else grading.Limits()
        self.solution = load(source / lab / f"{lab}.ipynb")

    def do_release(self):
        return grading.release(
            [self.lab], course=self.course, source=self.source, release_to=self.release, tmp_root=str(self.tmp)
        )

    def grade(self, students=None, one_process_per_student=True, jobs=1, feedback=True):
        """Autograde ``students`` (all: None), then (``feedback``) make every graded student's feedback."""
        results = grading.autograde(
            self.lab,
            students,
            course=self.course,
            source=self.source,
            release_from=self.release,
            limits=self.limits,
            tmp_root=str(self.tmp),
            one_process_per_student=one_process_per_student,
            jobs=jobs,
        )
        if feedback:
            step = grading.generate_feedback(self.lab, course=self.course, source=self.source, tmp_root=str(self.tmp))
            assert step.returncode == 0, step.output[-3000:]
        return results

    def blank(self):
        return load(self.release / self.lab / f"{self.lab}.ipynb")

    def autograded(self, student: str) -> nbformat.NotebookNode:
        return load(self.course / "autograded" / student / self.lab / f"{self.lab}.ipynb")


# ----------------------------------------------------------------------------------------
# the round trip of a lab, once per session


@dataclass
class Step:
    """What one autograde call left: its exit code and output (as classgrade reports them)."""

    returncode: int
    output: str


@dataclass
class RoundTrip:
    course: Course
    students: list[str]  # "full", "blank" (and "partial", "crashed": see _grade_round_trip)
    results: dict[str, Step]
    table: dict  # grading.scores
    full_seconds: float  # the solution's cells as autograding ran them, each timed by the grader
    kept: dict[str, float]  # the test cells of the one exercise the partial submission did
    lost: dict[str, float]  # the test cells of the last exercise, which the crashed submission kills
    total: dict[str, float]  # every test cell's points
    left_processes: list[int]  # processes of this course left when grading ended
    left_files: list[str]  # what was left in the course's temp folder


def shared_root() -> Path:
    """This session's folder shared by its workers (set by a session fixture in tests/conftest.py)."""
    if SHARED is None:
        raise RuntimeError("tests.roundtrip.SHARED is set by a session fixture in tests/conftest.py")
    SHARED.mkdir(parents=True, exist_ok=True)
    return SHARED


# The suite grades on three workers beside each other on 2 cores: a host busy with other work, which the
# instructor's guide answers with a cell-time scale (cell_times.py).  A real lab's honest round trip gets 2:
# lab 8's large-batch cell (4 runs of DDP on 8 ranks, 11 s alone, limit 55 s) ran over its limit once in a
# loaded full run.  The limits themselves are tested at scale 1 (test_cell_times.py, lab 8's spinning grid).
LOADED_HOST_SCALE = 2.0


def round_trip(lab: str, source: Path = SOLUTIONS, limits: dict | None = None) -> RoundTrip:
    """Lab ``lab``'s round trip, made by the first caller of the session and read by the others."""
    if limits is None:
        limits = {"cell_time_scale": LOADED_HOST_SCALE * grading.Limits().cell_time_scale}
    root = shared_root() / "round_trip" / lab
    with FileLock(str(root) + ".lock"):
        done = root / "round_trip.json"
        if not done.exists():
            root.mkdir(parents=True, exist_ok=True)
            facts = _grade_round_trip(Course(root, lab, source, limits))
            done.write_text(json.dumps(facts))
        facts = json.loads(done.read_text())
    course = Course(root, lab, source, limits)
    return RoundTrip(
        course=course,
        students=facts["students"],
        results={s: Step(**r) for s, r in facts["results"].items()},
        table=facts["table"],
        full_seconds=facts["full_seconds"],
        kept=facts["kept"],
        lost=facts["lost"],
        total=facts["total"],
        left_processes=facts["left_processes"],
        left_files=facts["left_files"],
    )


def cells_seconds(course: Course, student: str) -> float:
    """The seconds ``student``'s cells took as the grader timed each on its own clock (the notes
    ``RobustExecute`` leaves beside the autograded notebook, which ``measure_cell_times`` reads too)."""
    notes = course.course / "autograded" / student / course.lab / grading.NOTES_FILE
    return sum(json.loads(notes.read_text())["cell_seconds"].values())


def _grade_round_trip(course: Course) -> dict:
    """Release ``course``'s lab, submit the solution and the blank, and autograde them in one
    nbgrader process (the grader times the solution's cells; their outputs are what the lab's
    file checks).  On the launch fixture (real ranks, the real sandbox, the same grader) also a
    partly done notebook (the blank with only its first exercise done: exactly that exercise's
    points) and one whose kernel dies in the last exercise (only that exercise's points lost):
    each is a whole grading more, made where it proves the grader's behaviour, not on every lab
    (a later exercise graded when an earlier one fails is each lab's own wrong-answer tests')."""
    course.do_release()
    sol, lab = course.solution, course.lab
    solution_ids = [grade_id(c) for c in sol.cells if c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    first, last = solution_ids[0], solution_ids[-1]
    submit(course.course, "full", lab, sol)
    submit(course.course, "blank", lab, course.blank())
    every_case = lab == "00_launch"  # (on lab 1 too until 4 Dec: 2 more gradings of its 40 cells, ~70 s of the suite)
    students = ["full", "blank"] + (["partial", "crashed"] if every_case else [])
    if every_case:
        [first_source] = [c.source for c in sol.cells if grade_id(c) == first]
        submit(course.course, "partial", lab, with_solution(course.blank(), first, first_source))
        [last_source] = [c.source for c in sol.cells if grade_id(c) == last]
        submit(course.course, "crashed", lab, with_solution(sol, last, "__import__('os')._exit(1)\n" + last_source))
    # one nbgrader process for all (test_cli_grade_... covers one process per student), then one
    # feedback step for every student, as an instructor runs them: on the launch fixture, whose
    # crashed student's page is read, and on the first real lab, a lab's pictures and tables through
    # the feedback page's sanitising (#35: the other labs' pages were made and never read, an nbgrader
    # process each; the page itself is test_feedback_page.py's and test_sanitize.py's)
    pages = every_case or lab == FIRST_REAL_LAB
    results = dict(course.grade(students, one_process_per_student=False, feedback=pages))
    return {
        "students": students,
        "results": {s: {"returncode": r.returncode, "output": r.output[-5000:]} for s, r in results.items()},
        "table": grading.scores(lab, course.course),
        "full_seconds": cells_seconds(course, "full"),
        "kept": points_after(sol, first),
        "lost": points_after(sol, last),
        "total": all_points(sol),
        "left_processes": processes_with(str(course.course)),
        "left_files": [p.name for p in course.tmp.iterdir()],
    }
