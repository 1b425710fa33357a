"""Grading a whole class: ``disttrain-lab grade LAB [--jobs N] [--force] [--shard I/N]`` and
``disttrain-lab grade merge``.

- **Parallel.**  ``--jobs N`` students at a time, each still in its own nbgrader process,
  temp dir, cgroups (an equal CPU share among them) and sandbox; a job's sandboxed kernels
  run as a uid leased for it (``uids.py``), so two students never share a user.
  The default is :func:`default_jobs`: one job per 4 cores (a student runs up to 4 ranks)
  and per ``Limits.student_memory`` of available memory.
- **Resumable.**  ``<course>/grading-state/<lab>.json`` (the ledger) records each student
  once nbgrader has written their grade, with a digest of what was graded (the submission,
  the lab's source, its cell-time record).  A rerun grades only students who are new or
  whose digest changed (``--force``: everyone); a run killed mid-way (Ctrl-C, SIGKILL, a
  restart) resumes where it stopped, and a grade in the gradebook is only ever replaced by
  nbgrader writing the new one.
- **Shards.**  ``--shard I/N`` grades the students whose name hashes to shard I of N, so N
  machines with the same ``submitted/`` split a class with no student in two shards;
  ``disttrain-lab grade merge OUT.csv GRADEBOOK.db ...`` writes one grades CSV (nbgrader's
  export format) from their gradebooks, refusing a student graded on two of them.
- **Seen while it runs.**  A progress bar (rich: count, ETA, failures so far), then a table per
  student (score, time, what failed: timeout, crash, kernel death, cell time limit, flagged)
  and the class's pass rate per exercise.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat
from nbgrader.api import Gradebook, MissingEntry
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from . import cell_times, intake
from .config import Limits, course_dir, source_dir
from .course import autograde, export_grades, generate_feedback, students_of
from .steps import StepResult, clean_stale_steps
from .submission import grade_report, scan_submission

LEDGER_DIR = "grading-state"


# ----------------------------------------------------------------------------------------
# How many students at once


def default_jobs(limits: Limits | None = None) -> tuple[int, str]:
    """(jobs, the rule in words): one per 4 cores, since a student's notebook runs up to 4
    ranks, and one per ``student_memory`` (the cap of one student's sandbox) of available memory."""
    limits = limits or Limits()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    available = _available_memory()
    by_cores, by_memory = max(1, cores // 4), max(1, available // limits.student_memory)
    jobs = min(by_cores, by_memory)
    return jobs, (
        f"{jobs}: one per 4 cores ({cores} cores) and one per {limits.student_memory / 2**30:g} GiB "
        f"of available memory ({available / 2**30:.1f} GiB)"
    )


def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ----------------------------------------------------------------------------------------
# What was graded: the ledger


def submission_digest(course: Path, student: str, lab: str, source: Path) -> str:
    """Changes when what grading takes from the submission (intake.fingerprint: the notebook,
    never through a link, and the timestamp), the lab's source notebook or its cell-time
    record changes."""
    h = hashlib.sha256()
    h.update(intake.fingerprint(course / "submitted" / student / lab / f"{lab}.ipynb"))
    for path in (source / lab / f"{lab}.ipynb", cell_times.times_dir() / f"{lab}.json"):
        h.update(path.read_bytes() if path.exists() else b"-")
    return h.hexdigest()


@dataclass
class Outcome:
    """One student's grading, as the ledger keeps it."""

    student: str
    digest: str
    status: str  # "graded", "stopped" (the student's time cap), "failed" (nbgrader failed)
    seconds: float
    problems: list[str] = field(default_factory=list)
    finished: float = 0.0  # time.time() when it was recorded
    regraded: bool = True  # False: taken from the ledger, not graded in this run


class Ledger:
    """``<course>/grading-state/<lab>.json``: written whole (atomically) after every student."""

    def __init__(self, course: Path, lab: str):
        self.path = course / LEDGER_DIR / f"{lab}.json"
        self._lock = threading.Lock()
        try:
            raw = json.loads(self.path.read_text())["students"]
        except (OSError, ValueError, KeyError):
            raw = {}
        self.entries = {name: Outcome(**{**entry, "regraded": False}) for name, entry in raw.items()}

    def put(self, outcome: Outcome) -> None:
        with self._lock:
            self.entries[outcome.student] = outcome
            self.path.parent.mkdir(parents=True, exist_ok=True)
            part = self.path.with_suffix(f".part{os.getpid()}")
            part.write_text(
                json.dumps(
                    {
                        "students": {
                            n: {k: v for k, v in asdict(o).items() if k != "regraded"}
                            for n, o in sorted(self.entries.items())
                        }
                    },
                    indent=1,
                )
            )
            os.replace(part, self.path)


# ----------------------------------------------------------------------------------------
# Which students: shards


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes I/N (this machine's shard I of N, 1 <= I <= N), got {text!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"--shard I/N needs 1 <= I <= N, got {i}/{n}")
    return i, n


def in_shard(student: str, shard: tuple[int, int]) -> bool:
    """Student ``student`` belongs to shard I of N by a hash of the name: the same on every machine,
    whatever else is in its submitted/ folder."""
    i, n = shard
    return int(hashlib.sha256(student.encode()).hexdigest(), 16) % n == i - 1


# ----------------------------------------------------------------------------------------
# What went wrong for one student


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


# ----------------------------------------------------------------------------------------
# Grading the class


def grade_class(
    lab: str,
    students: list[str],
    *,
    course: Path,
    source: Path | None = None,
    release_from: Path | None = None,
    limits: Limits | None = None,
    tmp_root: str | None = None,
    jobs: int = 1,
    force: bool = False,
    show_progress: bool = True,
    console=None,
) -> dict[str, Outcome]:
    """Autograde ``students`` of ``lab``, ``jobs`` at a time, skipping those the ledger says were
    graded as they are now (unless ``force``).  Returns an Outcome per student."""
    course = Path(course).resolve()
    source = Path(source or source_dir())
    console = console or Console(stderr=True)
    clean_stale_steps(tmp_root)  # what a killed run left: temp dirs, cgroups, kernels
    ledger = Ledger(course, lab)
    digests = {s: submission_digest(course, s, lab, source) for s in students}
    todo = [s for s in students if force or s not in ledger.entries or ledger.entries[s].digest != digests[s]]
    done = {s: ledger.entries[s] for s in students if s not in todo}
    if done:
        console.print(
            f"{len(done)} of {len(students)} students already graded as submitted (the ledger "
            f"{ledger.path}); grading {len(todo)}" + ("" if todo else ": nothing to do") + " (--force: all)"
        )
    if not todo:
        return done
    failures = 0
    progress = _progress_bar(console, show_progress)
    task = progress.add_task(f"grading {lab}", total=len(todo), failures=0)

    def finished(student: str, result: StepResult) -> None:
        nonlocal failures
        status = "graded" if result.returncode == 0 else ("stopped" if result.timed_out else "failed")
        outcome = Outcome(
            student,
            digests[student],
            status,
            round(result.seconds, 1),
            diagnose(course, lab, student, result),
            time.time(),
        )
        ledger.put(outcome)  # after nbgrader wrote the grade: a kill before this regrades the student
        done[student] = outcome
        failures += bool(outcome.problems)
        progress.update(task, advance=1, failures=failures)
        if result.returncode != 0:
            progress.console.print(
                f"[bold red]{student}[/]: {outcome.problems[0]}\n{result.output[-1500:]}", markup=True, highlight=False
            )

    with progress:
        autograde(
            lab,
            todo,
            course=course,
            source=source,
            release_from=release_from,
            limits=limits,
            tmp_root=tmp_root,
            jobs=jobs,
            on_result=finished,
            log=lambda *a: progress.console.print(*a, markup=False, highlight=False),
        )
    outcomes = {s: done[s] for s in students if s in done}
    isolated, why = (limits or Limits()).sandboxed()
    as_results = {
        s: StepResult([], 0 if o.status == "graded" else 1, "", o.seconds, o.status == "stopped")
        for s, o in outcomes.items()
    }
    grade_report(lab, list(outcomes), as_results, course, None if isolated else why)  # the whole class
    return outcomes


def _progress_bar(console, show: bool):
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("failures: {task.fields[failures]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=not show,
    )


# ----------------------------------------------------------------------------------------
# The summary an instructor reads first


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


# ----------------------------------------------------------------------------------------
# Merging shards

EXPORT_KEYS = (
    "assignment",
    "duedate",
    "timestamp",
    "student_id",
    "last_name",
    "first_name",
    "email",
    "raw_score",
    "late_submission_penalty",
    "score",
    "max_score",
)


def _export_rows(gradebook: Path) -> dict[tuple[str, str], tuple[bool, dict]]:
    """(assignment, student) -> (graded there, the row nbgrader's CSV export writes for it)."""
    rows = {}
    with Gradebook(f"sqlite:///{Path(gradebook).resolve()}") as gb:
        for assignment in gb.assignments:
            for student in gb.students:
                row = {
                    "assignment": assignment.name,
                    "duedate": assignment.duedate,
                    "student_id": student.id,
                    "last_name": student.last_name,
                    "first_name": student.first_name,
                    "email": student.email,
                    "max_score": assignment.max_score,
                }
                try:
                    submission = gb.find_submission(assignment.name, student.id)
                    present = True
                    penalty = submission.late_submission_penalty
                    row.update(
                        timestamp=submission.timestamp,
                        raw_score=submission.score,
                        late_submission_penalty=penalty,
                        score=max(0.0, submission.score - penalty),
                    )
                except MissingEntry:
                    present = False
                    row.update(timestamp="", raw_score=0.0, late_submission_penalty=0.0, score=0.0)
                rows[(assignment.name, student.id)] = (
                    present,
                    {k: "" if row[k] is None else str(row[k]) for k in EXPORT_KEYS},
                )
    return rows


def merge(gradebooks: list[Path], out: Path) -> tuple[int, list[str]]:
    """One grades CSV (nbgrader's export format) from the shards' gradebooks: each (lab, student)
    from the gradebook that graded it.  Returns (rows written, problems: a student graded on two)."""
    merged: dict[tuple[str, str], tuple[bool, dict, Path]] = {}
    problems = []
    for gradebook in gradebooks:
        for key, (present, row) in _export_rows(gradebook).items():
            seen = merged.get(key)
            if seen and seen[0] and present:
                problems.append(f"{key[1]} is graded for {key[0]} in both {seen[2]} and {gradebook}")
            if not seen or (present and not seen[0]):
                merged[key] = (present, row, gradebook)
    # nbgrader's order: assignments as the gradebook lists them (by due date, name), students by id
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(EXPORT_KEYS)
    for key in sorted(merged, key=lambda k: (k[0], k[1])):
        writer.writerow([merged[key][1][k] for k in EXPORT_KEYS])
    Path(out).write_text(buffer.getvalue())
    return len(merged), problems


def cli_merge(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="disttrain-lab grade merge",
        description=(
            "Merge the gradebooks of a class graded in shards (--shard I/N on each machine) into one grades CSV."
        ),
    )
    parser.add_argument("out", type=Path, help="the grades CSV to write")
    parser.add_argument("gradebooks", type=Path, nargs="+", help="each shard's <course-dir>/gradebook.db")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.gradebooks if not p.is_file()]
    if missing:
        print(f"disttrain-lab grade merge: no such gradebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    rows, problems = merge(args.gradebooks, args.out)
    for line in problems:
        print(f"disttrain-lab grade merge: {line}", file=sys.stderr)
    if problems:
        print(
            "a student graded on two shards: the shards overlap (same --shard I/N given twice?); "
            f"{args.out} keeps the first",
            file=sys.stderr,
        )
        return 1
    print(f"merged {len(args.gradebooks)} gradebooks: {rows} rows -> {args.out}")
    return 0


# ----------------------------------------------------------------------------------------
# `disttrain-lab grade LAB`


def cli_grade(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        return cli_merge(argv[1:])
    parser = argparse.ArgumentParser(
        prog="disttrain-lab grade",
        description=(
            "Autograde one lab, generate feedback, export grades as CSV.  `disttrain-lab grade merge OUT.csv "
            "GRADEBOOK.db ...` merges the gradebooks of a class graded in shards."
        ),
    )
    parser.add_argument("lab")
    parser.add_argument("--student", action="append", help="grade only this student (repeatable)")
    parser.add_argument(
        "--course-dir",
        type=Path,
        help="course directory (default: $DISTTRAIN_COURSE_DIR "
        "or ~/.disttrain-lab/course); submissions are in submitted/<student>/<lab>/",
    )
    parser.add_argument("--csv", type=Path, help="where to write grades (default: <course-dir>/grades.csv)")
    parser.add_argument("--no-feedback", action="store_true", help="skip generating feedback HTML")
    parser.add_argument(
        "--jobs",
        type=int,
        help="students graded at once (default: one per 4 cores and per "
        "DISTTRAIN_STUDENT_MEMORY of available memory, at least 1)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="grade every student again, even those already graded as they are submitted now",
    )
    parser.add_argument(
        "--shard",
        help="I/N: grade only this machine's shard I of N of the students (by a hash "
        "of the name); merge the shards' gradebooks with `disttrain-lab grade merge`",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    course = Path(args.course_dir or course_dir()).resolve()
    err = Console(stderr=True)
    out = Console(width=None if sys.stdout.isatty() else 160, soft_wrap=not sys.stdout.isatty())
    students = args.student or students_of(args.lab, course)
    if args.shard:
        try:
            shard = parse_shard(args.shard)
        except ValueError as exc:
            parser.error(str(exc))
        students = [s for s in students if in_shard(s, shard)]
    if not students:
        print(
            f"no submissions found in {course / 'submitted'}/<student>/{args.lab}/"
            + (f" in shard {args.shard}" if args.shard else "")
        )
        return 1
    limits = Limits()
    jobs, rule = (args.jobs, f"{args.jobs} (--jobs)") if args.jobs else default_jobs(limits)
    if jobs < 1:
        parser.error(f"--jobs must be at least 1, got {jobs}")
    err.print(f"grading {len(students)} students of {args.lab}, {rule} at a time", highlight=False)
    try:
        outcomes = grade_class(
            args.lab,
            students,
            course=course,
            limits=limits,
            jobs=jobs,
            force=args.force,
            show_progress=not args.no_progress,
            console=err,
        )
    except KeyboardInterrupt:
        err.print(
            "interrupted: the students graded so far are kept (grading-state/); run the same command "
            "again to grade the rest"
        )
        return 130
    regraded = [s for s, o in outcomes.items() if o.regraded]
    feedback = [course / "feedback" / s / args.lab / f"{args.lab}.html" for s in outcomes]
    if not args.no_feedback and (regraded or not all(p.exists() for p in feedback)):
        generate_feedback(args.lab, regraded if len(regraded) == 1 else None, course=course)
    csv_path = export_grades(args.csv, course=course)
    summary(args.lab, outcomes, course, out)
    print(f"grades: {csv_path}\nfeedback: {course / 'feedback' / '<student>' / args.lab}")
    return 0
