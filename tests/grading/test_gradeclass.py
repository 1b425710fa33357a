"""Grading a class (disttrain_lab/grading/classgrade.py, ledger.py, shards.py, class_summary.py):
parallel students, resume after a kill, shards merged into one grades CSV.  (Per-cell limits from
the solution's own cell times: tests/grading/test_cell_times.py.)

One small class of submissions of the fixture lab 00_launch (three exercises on 2 and 3 ranks,
with hidden tests; alice: the solution, bob: the blank lab, carol: the last exercise left blank)
is graded twice: serially by the real command line, killed with SIGKILL after its first student
and run again (the reference single run), and in two shards of two "machines" with two students
at a time, whose gradebooks merge into one CSV.  The names split the class 1 + 2 over two
shards, so the second shard grades two students at once.  What is tested is the class's
bookkeeping, the same for every lab: a fixture's student grades in seconds where a real lab's
takes a minute or more (seven gradings here; each real lab's grading is its round trip,
tests/roundtrip.py).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook

from disttrain_lab import grading
from disttrain_lab.grading import class_summary, classgrade, export, shards
from disttrain_lab.grading.cells import exercise_names
from disttrain_lab.grading.hidden_tests import hidden_lines
from disttrain_lab.grading.ledger import LEDGER_DIR, Ledger
from tests.grading.test_grading import (
    Course,
    all_points,
    grade_id,
    points_after,
    processes_with,
    submit,
    with_solution,
)
from tests.helpers import REPO
from tests.roundtrip import FIXTURES

LAB = "00_launch"
STUDENTS = ("alice", "bob", "carol")  # shards of 2: alice in 1/2, bob and carol in 2/2

pytestmark = pytest.mark.timeout(1500)


# ----------------------------------------------------------------------------------------
# fast: the rules


def test_shards_partition_the_class():
    names = [f"student{i:03d}" for i in range(200)] + list(STUDENTS)
    for n in (1, 2, 3, 7):
        counts = [sum(shards.in_shard(s, (i, n)) for i in range(1, n + 1)) for s in names]
        assert counts == [1] * len(names), f"with {n} shards a student is in {set(counts)} shards"
    assert [shards.in_shard(s, (1, 2)) for s in STUDENTS] == [True, False, False]
    assert shards.parse_shard("2/3") == (2, 3)
    for bad in ("0/2", "3/2", "1", "a/b"):
        with pytest.raises(ValueError, match="I/N"):
            shards.parse_shard(bad)


def test_default_jobs_follow_cores_and_memory():
    jobs, rule = classgrade.default_jobs(grading.Limits(student_memory=2**30))
    cores = len(os.sched_getaffinity(0))
    assert jobs == max(1, min(cores // 4, classgrade._available_memory() // 2**30))
    assert "4 cores" in rule and "memory" in rule


def test_diagnose_names_what_failed(tmp_path):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    course, lab = tmp_path, "lab"

    def cell(grade, ename):
        c = new_code_cell("x", metadata={"nbgrader": {"grade_id": grade}} if grade else {})
        c.outputs = [new_output("error", ename=ename, evalue="", traceback=[])]
        return c

    (course / "autograded" / "s" / lab).mkdir(parents=True)
    nbformat.write(
        new_notebook(
            cells=[
                cell("test_a", "DeadKernelError"),
                cell("test_b", "CellTimeoutError"),
                cell(None, "CellTimeoutError"),
            ]
        ),
        course / "autograded" / "s" / lab / f"{lab}.ipynb",
    )
    submit(course, "s", lab, new_notebook(cells=[new_code_cell("import ctypes")]))
    ok = grading.StepResult([], 0, "", 1.0)
    assert class_summary.diagnose(course, lab, "s", ok) == [
        "kernel death: test_a",
        "cell time limit: test_b, 1 other cell(s)",
        "flagged: 1 construct(s) to look at (see the grade report)",
    ]
    stopped = grading.StepResult([], -9, "", 1.0, timed_out=True)
    assert class_summary.diagnose(course, lab, "s", stopped)[0] == "timeout: STOPPED (time cap)"
    assert class_summary.diagnose(course, lab, "s", grading.StepResult([], 1, "", 1.0))[0].startswith("crash")


# ----------------------------------------------------------------------------------------
# slow: one small class of lab 1


@pytest.fixture(scope="module")
def lab1_class(tmp_path_factory):
    """The released fixture lab and the class's three submissions (each with the same timestamp.txt)."""
    course = Course(tmp_path_factory.mktemp("release"), LAB, FIXTURES, None)
    course.do_release()
    sol = course.solution
    solution_ids = [grade_id(c) for c in sol.cells if c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    last = solution_ids[-1]
    [blank_last] = [c.source for c in course.blank().cells if grade_id(c) == last]
    total, lost = all_points(sol), points_after(sol, last)
    course.submissions = {"alice": sol, "bob": course.blank(), "carol": with_solution(sol, last, blank_last)}
    course.expected = {
        "alice": total,
        "bob": {k: 0.0 for k in total},
        "carol": {k: (0.0 if k in lost else v) for k, v in total.items()},
    }
    return course


def new_course(lab1_class, root: Path) -> dict:
    """A course directory with the class submitted, and the environment the command line reads."""
    course, tmp = root / "course", root / "tmp"
    tmp.mkdir(parents=True)
    for student, nb in lab1_class.submissions.items():
        submit(course, student, LAB, nb)
        (course / "submitted" / student / LAB / "timestamp.txt").write_text("2026-01-01 12:00:00.000000 UTC")
    return dict(
        os.environ,
        DISTTRAIN_COURSE_DIR=str(course),
        DISTTRAIN_SOURCE_DIR=str(FIXTURES),
        DISTTRAIN_RELEASE_DIR=str(lab1_class.release),
        TMPDIR=str(tmp),
        DISTTRAIN_LAB_PROGRESS="0",
    )


def grade_cli(env: dict, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "disttrain_lab.cli", "grade", LAB, "--no-progress", *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def wait_for(condition, what: str, proc: subprocess.Popen, timeout: float = 900.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        assert proc.poll() is None, f"the grading run ended before {what}:\n{proc.stdout.read()[-3000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout:.0f} s")


def scores_by_exercise(course: Path, expected: dict) -> dict:
    table = grading.scores(LAB, course)
    return {s: {k: table[s][k] for k in expected[s]} for s in table}


@pytest.fixture(scope="module")
def single_run(lab1_class, tmp_path_factory):
    """The class graded serially by `disttrain-lab grade --jobs 1`, SIGKILLed after its first student
    and run again: (course dir, the ledger's first finished entry before the kill, its autograded mtime)."""
    env = new_course(lab1_class, tmp_path_factory.mktemp("single"))
    course = Path(env["DISTTRAIN_COURSE_DIR"])
    ledger = course / LEDGER_DIR / f"{LAB}.json"
    proc = grade_cli(env, "--jobs", "1", "--no-feedback")

    def first_finished():
        try:
            return Ledger(course, LAB).entries or None
        except Exception:  # noqa: BLE001 - written atomically, but not yet there
            return None

    try:
        before = wait_for(first_finished, "a student graded", proc)
        os.kill(proc.pid, signal.SIGKILL)  # the real process, mid-way through the class
    finally:
        proc.kill()
        proc.wait()
    before = Ledger(course, LAB).entries  # what the killed run recorded
    assert 1 <= len(before) < len(STUDENTS), before
    mtimes = {s: (course / "autograded" / s / LAB / f"{LAB}.ipynb").stat().st_mtime_ns for s in before}
    rerun = grade_cli(env, "--no-feedback")
    out, _ = rerun.communicate(timeout=1200)
    assert rerun.returncode == 0, out[-3000:]
    return {"course": course, "env": env, "before": before, "mtimes": mtimes, "out": out, "ledger": ledger}


@pytest.mark.slow
def test_resume_after_sigkill_loses_nothing_and_regrades_nothing_finished(lab1_class, single_run):
    course, before = single_run["course"], single_run["before"]
    after = Ledger(course, LAB).entries
    assert sorted(after) == sorted(STUDENTS)
    for student, entry in before.items():  # graded before the kill: kept, not graded again
        assert after[student].finished == entry.finished and after[student].digest == entry.digest
        assert (course / "autograded" / student / LAB / f"{LAB}.ipynb").stat().st_mtime_ns == single_run["mtimes"][
            student
        ]
    assert f"{len(before)} of {len(STUDENTS)} students already graded" in single_run["out"]
    assert scores_by_exercise(course, lab1_class.expected) == lab1_class.expected
    # the summary: every student, and the class's pass rate per exercise
    for student in STUDENTS:
        assert student in single_run["out"]
    assert "pass rate per exercise" in single_run["out"]
    # nothing of the killed run is left: no process, no temp dir
    assert not processes_with(str(course))
    assert not list(Path(single_run["env"]["TMPDIR"]).iterdir())
    # a third run has nothing to grade; --force grades a changed submission only when it changed
    submit(course, "bob", LAB, lab1_class.submissions["bob"])  # the same bytes: not a change
    again = grade_cli(single_run["env"], "--no-feedback")
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0 and "3 of 3 students already graded" in out, out[-3000:]
    assert Ledger(course, LAB).entries["bob"].finished == after["bob"].finished


@pytest.mark.slow
def test_parallel_shards_merge_into_the_single_run(lab1_class, single_run, tmp_path):
    gradebooks = []
    for shard in ("1/2", "2/2"):  # two machines, each with the whole submitted/ folder
        env = new_course(lab1_class, tmp_path / shard.replace("/", "of"))
        proc = grade_cli(env, "--jobs", "2", "--shard", shard, "--no-feedback")
        out, _ = proc.communicate(timeout=1200)
        assert proc.returncode == 0, out[-3000:]
        course = Path(env["DISTTRAIN_COURSE_DIR"])
        graded = sorted(Ledger(course, LAB).entries)
        assert graded == [s for s in STUDENTS if shards.in_shard(s, shards.parse_shard(shard))]
        # students graded two at a time score what the serial run gave them
        assert scores_by_exercise(course, lab1_class.expected) == {s: lab1_class.expected[s] for s in graded}
        gradebooks.append(course / "gradebook.db")
    merged = tmp_path / "merged.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "disttrain_lab.cli", "grade", "merge", str(merged), *map(str, gradebooks)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    single = single_run["course"] / "grades.csv"  # nbgrader's own export of the single run

    def rows(path):
        with open(path) as f:
            return sorted(tuple(r.items()) for r in csv.DictReader(f))

    assert rows(merged) == rows(single)
    assert len(rows(merged)) == len(STUDENTS)
    # the same shard twice: a student graded on two machines is refused, not doubled
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "disttrain_lab.cli",
            "grade",
            "merge",
            str(tmp_path / "twice.csv"),
            str(gradebooks[1]),
            str(gradebooks[1]),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 1 and "graded for" in proc.stderr and "both" in proc.stderr


@pytest.mark.slow
def test_exports_match_the_gradebook(lab1_class, single_run, tmp_path):
    """What `disttrain-lab grade` exported at the end of the single run (and `disttrain-lab export`
    writes again), against nbgrader's own reading of the gradebook: every test's score, each
    exercise's points, the totals in the Canvas and Moodle files; the failures' first lines, and no
    hidden-test line anywhere."""
    course = single_run["course"]
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        assignment = gb.find_assignment(LAB)
        maximum = {c.name: float(c.max_score) for nb in assignment.notebooks for c in nb.grade_cells if c.max_score}
        graded = {
            s.student.id: ({g.name: float(g.score) for nb in s.notebooks for g in nb.grades if g.max_score}, s.score)
            for s in assignment.submissions
        }
        hidden = hidden_lines(c.source or "" for c in gb.find_notebook(LAB, LAB).source_cells)
    assert sorted(graded) == sorted(STUDENTS) and hidden
    names = exercise_names(lab1_class.solution)
    out = course / "exports" / LAB
    assert f"exports (per-student JSON, per-exercise, Canvas and Moodle CSVs): {out.resolve()}" in single_run["out"]
    for student, (scores, total) in graded.items():
        record = json.loads((out / "students" / f"{student}.json").read_text())
        assert (record["score"], record["max_score"]) == (total, sum(maximum.values()))
        assert [(t["grade_id"], t["exercise"], t["score"], t["max_score"]) for t in record["tests"]] == [
            (gid, names[gid], scores[gid], maximum[gid]) for gid in names
        ]
        for t in record["tests"]:
            assert t["passed"] == (t["score"] == t["max_score"]) and (t["message"] is None) == t["passed"], t
            assert t["passed"] or ("\n" not in t["message"] and len(t["message"]) <= export.MESSAGE_CHARS), t
    # alice lost nothing, bob everything, carol the last exercise (its message from her autograded notebook)
    lost = {
        s: [t for t in json.loads((out / "students" / f"{s}.json").read_text())["tests"] if not t["passed"]]
        for s in graded
    }
    assert (len(lost["alice"]), len(lost["bob"])) == (0, len(maximum))
    last = lab1_class.expected["carol"]
    assert [t["grade_id"] for t in lost["carol"]] == [gid for gid in names if last[gid] == 0.0]
    autograded = nbformat.read(course / "autograded" / "carol" / LAB / f"{LAB}.ipynb", as_version=4)
    for t in lost["carol"]:
        [cell] = [c for c in autograded.cells if grade_id(c) == t["grade_id"]]
        [error] = [o for o in cell.outputs if o.output_type == "error"][:1]
        assert t["message"].startswith(f"{error.ename}: ") and error.evalue.strip().splitlines()[0][:40] in t["message"]
        # the summary's lost points (a table: its long cells wrap)
        assert f"{t['exercise'][:30]}" in single_run["out"] and t["message"].split(":")[0] in single_run["out"]
    assert "none: full marks" in single_run["out"]
    text = "".join(p.read_text() for p in out.rglob("*") if p.is_file())
    assert not [line for line in hidden if line in text], "a hidden-test line in the exports"

    def rows(path):
        with open(path, newline="") as f:
            return list(csv.reader(f))

    exercises = rows(out / f"{LAB}_exercises.csv")
    order = list(dict.fromkeys(names.values()))
    assert exercises[0][1:-1] == [f"{e} (max {sum(maximum[g] for g in names if names[g] == e):g})" for e in order]
    for row in exercises[1:]:
        scores, total = graded[row[0]]
        assert [float(v) for v in row[1:]] == [sum(scores[g] for g in names if names[g] == e) for e in order] + [total]
    canvas = rows(out / f"{LAB}_canvas.csv")
    assert canvas[:2] == [
        ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", LAB],
        ["Points Possible", "", "", "", "", f"{sum(maximum.values()):g}"],
    ]
    assert {r[3]: float(r[5]) for r in canvas[2:]} == {s: total for s, (_, total) in graded.items()}
    moodle = rows(out / f"{LAB}_moodle.csv")
    assert moodle[0] == ["Username", "Email address", LAB]
    assert {r[0]: float(r[2]) for r in moodle[1:]} == {s: total for s, (_, total) in graded.items()}
    # `disttrain-lab export`: the same files again, elsewhere, with the id in Canvas's SIS User ID
    again = tmp_path / "again"
    command = [sys.executable, "-m", "disttrain_lab", "export", LAB, "--course-dir", str(course)]
    proc = subprocess.run(
        [*command, "--out", str(again), "--canvas-key", "sis"],
        capture_output=True,
        text=True,
        timeout=300,
        env=single_run["env"],  # (the lab's source: the fixtures' folder)
    )
    assert proc.returncode == 0 and f"exported {LAB}, 3 students: {again}" in proc.stdout, proc.stdout + proc.stderr
    for path in out.rglob("*.*"):
        if path.name != f"{LAB}_canvas.csv":
            assert (again / path.relative_to(out)).read_text() == path.read_text(), path
    assert [r[2:4] for r in rows(again / f"{LAB}_canvas.csv")[2:]] == [[s, ""] for s in sorted(graded)]
    proc = subprocess.run(
        [*command[:4], "00_lanch", *command[5:]], capture_output=True, text=True, timeout=300, env=single_run["env"]
    )
    assert proc.returncode == 1 and "did you mean '00_launch'?" in proc.stderr, proc.stdout + proc.stderr
