"""Grading a whole class: ``disttrain-lab grade LAB [--jobs N] [--force] [--shard I/N]`` and
``disttrain-lab grade merge``.

- **Parallel.**  ``--jobs N`` students at a time, each still in its own nbgrader process,
  temp dir, cgroups (an equal CPU share among them) and sandbox; a job's sandboxed kernels
  run as a uid leased for it (``uids.py``), so two students never share a user.
  The default is :func:`default_jobs`: one job per 4 cores (a student runs up to 4 ranks)
  and per ``Limits.student_memory`` of available memory.
- **Resumable** (``ledger.py``).  ``<course>/grading-state/<lab>.json`` (the ledger) records each student
  once nbgrader has written their grade, with a digest of what was graded (the submission,
  the lab's source, its cell-time record).  A rerun grades only students who are new or
  whose digest changed (``--force``: everyone); a run killed mid-way (Ctrl-C, SIGKILL, a
  restart) resumes where it stopped, and a grade in the gradebook is only ever replaced by
  nbgrader writing the new one.
- **Shards** (``shards.py``).  ``--shard I/N`` grades the students whose name hashes to shard I of N, so N
  machines with the same ``submitted/`` split a class with no student in two shards;
  ``disttrain-lab grade merge OUT.csv GRADEBOOK.db ...`` writes one grades CSV (nbgrader's
  export format) from their gradebooks, refusing a student graded on two of them.
- **Seen while it runs** (``class_summary.py``).  A progress bar (rich: count, ETA, failures so far), then a table per
  student (score, time, the exercises they lost points on with the first line of each message, grading
  problems: timeout, crash, kernel death, cell time limit, flagged) and the class's pass rate per exercise.
- **Exported** (``export.py``, unless ``--no-export``): per student a JSON file of every test, a
  per-exercise CSV and CSVs for Canvas's and Moodle's gradebook import, in ``<course>/exports/<lab>/``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .class_summary import diagnose, summary
from .config import Limits, SandboxRefused, course_dir, source_dir
from .course import autograde, export_grades, generate_feedback, students_of
from .export import export_dir, results, write
from .ledger import Ledger, Outcome, submission_digest
from .shards import in_shard, merge, parse_shard
from .steps import StepResult, clean_stale_steps
from .submission import grade_report

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
    parser.add_argument("lab", help="the lab to grade (a folder of the source directory, e.g. 01_point_to_point)")
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
        "--no-export",
        action="store_true",
        help="skip writing <course-dir>/exports/<lab>/ (per-student JSON, per-exercise, Canvas and Moodle CSVs; "
        "`disttrain-lab export LAB` writes them any time)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        help="students graded at once (default: one per 4 cores and per "
        f"{Limits.variable('student_memory')} of available memory, at least 1)",
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
    try:  # before anything starts: a host that cannot sandbox a student grades no one
        limits.sandboxed()
    except SandboxRefused as refused:
        print(f"disttrain-lab grade: refused: {refused}", file=sys.stderr)
        return 2
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
    found = results(args.lab, course)  # the gradebook's scores, each failure's first line
    summary(args.lab, outcomes, course, out, found)
    print(f"grades: {csv_path}\nfeedback: {course / 'feedback' / '<student>' / args.lab}")
    if not args.no_export:
        write(found, export_dir(args.lab, course))
        print(f"exports (per-student JSON, per-exercise, Canvas and Moodle CSVs): {export_dir(args.lab, course)}")
    return 0
