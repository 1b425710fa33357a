"""The instructor's steps (autograde, feedback, grades, scores, timing the solution's cells; the
release is ``releasing.py``) and the command line ``disttrain-lab release`` (``disttrain-lab grade`` is
:mod:`disttrain_lab.grading.classgrade`)."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import queue
import shutil
import sys
import tempfile
import threading
from pathlib import Path

from nbgrader.api import Gradebook, MissingEntry

from .. import confine
from . import cell_times, intake, readme_labs, sandbox
from . import install_source as install  # (release() has an argument named install_source)
from .config import LIMITED_ISOLATION, REPO_ROOT, Limits, course_dir, isolation_notice, source_dir
from .execute import NOTES_FILE
from .releasing import ReleaseWouldOverwrite, list_labs, release, release_differences, release_folder, step_env
from .steps import StepResult, run_nbgrader, stop_running_steps
from .submission import grade_report

# ----------------------------------------------------------------------------------------
# The instructor's steps.


def students_of(lab: str, course: Path | None = None) -> list[str]:
    submitted = Path(course or course_dir()) / "submitted"
    return sorted(p.name for p in submitted.iterdir() if (p / lab).is_dir()) if submitted.is_dir() else []


def _ensure_in_gradebook(lab: str, course: Path, env: dict, tmp_root: str | None) -> None:
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        try:
            gb.find_assignment(lab)
            return
        except MissingEntry:
            pass
    # a course directory that never released this lab: record it without touching labs/
    with tempfile.TemporaryDirectory(prefix="disttrain-release-", dir=tmp_root) as scratch:
        result = run_nbgrader(
            ["generate_assignment", lab, "--force", f"--CourseDirectory.release_directory={scratch}"],
            timeout=600,
            env=env,
            tmp_root=tmp_root,
        )
    if result.returncode != 0:
        raise RuntimeError(f"could not add {lab} to the gradebook:\n{result.output}")


def autograde(
    lab: str,
    students: list[str] | None = None,
    *,
    course: Path | None = None,
    source: Path | None = None,
    release_from: Path | None = None,
    limits: Limits | None = None,
    tmp_root: str | None = None,
    one_process_per_student: bool = True,
    jobs: int = 1,
    on_result=None,
    log=print,
) -> dict[str, StepResult]:
    """Autograde each student in its own nbgrader process, ``jobs`` at a time; one result per
    student.  ``on_result(student, result)`` is called as each finishes (from a worker thread).
    An interrupt (KeyboardInterrupt) stops every running student and is raised again."""
    course = Path(course or course_dir()).resolve()
    limits = limits or Limits()
    env = step_env(course, source, release_from)
    env.update(limits.environment(), DISTTRAIN_SANDBOX_WARNED="1")  # nbgrader's process: the same Limits()
    isolated, why = limits.sandboxed()
    if not isolated:
        log(isolation_notice(why))
    elif sandbox.caveat():
        log(LIMITED_ISOLATION.format(why=sandbox.caveat()))
    if isolated and confine.host_problem():  # (the ranks' own confinement, confine.py)
        log(LIMITED_ISOLATION.format(why=confine.host_problem()))
    _ensure_in_gradebook(lab, course, env, tmp_root)
    students = students or students_of(lab, course)

    def staged(names: list[str]):
        # nbgrader grades a staged copy of what the grader takes of each submission folder
        # (the notebook, never through a link); the folder itself it never sees (intake.py)
        def prepare(step_dir: Path) -> list[str]:
            into = intake.stage(course / "submitted", names, lab, step_dir / "submitted")
            return [f"--CourseDirectory.submitted_directory={into}"]

        return prepare

    if not one_process_per_student:
        # plain `nbgrader autograde LAB`: every student in one process (faster; no per-student cap)
        result = run_nbgrader(
            ["autograde", lab, "--force"],
            timeout=limits.student_timeout * len(students),
            env=env,
            tmp_root=tmp_root,
            prepare=staged(students),
        )
        log(f"autograde {lab} ({len(students)} students): rc={result.returncode} in {result.seconds:.1f} s")
        results = {student: result for student in students}
        grade_report(lab, students, results, course, why if not isolated else None)
        return results
    results, slots, stopping = {}, queue.Queue(), threading.Event()
    for slot in range(jobs):
        slots.put(slot)

    def grade_one(student: str) -> None:
        slot = slots.get()  # a free slot: its sandbox uid and nobody else's while this student runs
        try:
            if stopping.is_set():
                return
            result = run_nbgrader(
                ["autograde", lab, "--student", student, "--force"],
                timeout=limits.student_timeout,
                env=env,
                tmp_root=tmp_root,
                slot=slot,
                prepare=staged([student]),
            )
        finally:
            slots.put(slot)
        if stopping.is_set():  # killed by the interrupt: not a grade
            return
        if result.timed_out:  # as nbgrader does for a failed submission: no half-written results
            shutil.rmtree(course / "autograded" / student / lab, ignore_errors=True)
        results[student] = result
        status = "ok" if result.returncode == 0 else ("STOPPED (time cap)" if result.timed_out else "FAILED")
        if on_result is not None:
            on_result(student, result)
        else:
            log(f"autograde {lab} {student}: {status} in {result.seconds:.1f} s")
            if result.returncode != 0:
                log(result.output[-3000:])

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="grade")
    futures = []
    try:
        futures = [pool.submit(grade_one, student) for student in students]
        for future in concurrent.futures.as_completed(futures):
            future.result()
    except BaseException:
        stopping.set()
        for future in futures:
            future.cancel()
        stop_running_steps()
        raise
    finally:
        pool.shutdown(wait=True)
    graded = [s for s in students if s in results]
    report = grade_report(lab, graded, results, course, why if not isolated else None)
    log(f"grade report: {report}")
    return results


def generate_feedback(
    lab: str,
    students: list[str] | None = None,
    *,
    course: Path | None = None,
    source: Path | None = None,
    tmp_root: str | None = None,
) -> StepResult:
    args = ["generate_feedback", lab, "--force"]
    if students and len(students) == 1:
        args += ["--student", students[0]]
    return run_nbgrader(args, timeout=600, env=step_env(course, source, None), tmp_root=tmp_root)


def export_grades(csv_path: Path | None = None, *, course: Path | None = None, tmp_root: str | None = None) -> Path:
    course = Path(course or course_dir()).resolve()
    csv_path = Path(csv_path or course / "grades.csv").resolve()
    result = run_nbgrader(
        ["export", f"--to={csv_path}"], timeout=600, env=step_env(course, None, None), tmp_root=tmp_root
    )
    if result.returncode != 0:
        raise RuntimeError(f"nbgrader export failed:\n{result.output}")
    return csv_path


def scores(lab: str, course: Path | None = None) -> dict[str, dict[str, float]]:
    """{student: {grade_id: score, ..., "total": score}} from the gradebook."""
    course = Path(course or course_dir()).resolve()
    table = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        assignment = gb.find_assignment(lab)
        for submission in assignment.submissions:
            row = {}
            for notebook in submission.notebooks:
                for grade in notebook.grades:
                    if grade.max_score:
                        row[grade.name] = float(grade.score)
            row["total"] = float(submission.score)
            table[submission.student.id] = row
    return table


def measure_cell_times(
    lab: str, *, source: Path | None = None, tmp_root: str | None = None
) -> tuple[dict[str, float], float]:
    """Grade the solution of ``lab`` once, in a scratch course, under the plain cell limit, and
    return its seconds per cell key (as RobustExecute measured them) and the grader's probe as
    that grading started (``cell_times.probe``): what ``cell_times.record`` keeps for
    ``disttrain-lab release --time-cells``."""
    source = Path(source or source_dir())
    with tempfile.TemporaryDirectory(prefix="disttrain-cell-times-", dir=tmp_root) as scratch:
        scratch = Path(scratch)
        course, release_to, empty = scratch / "course", scratch / "release", scratch / "no-times"
        empty.mkdir()
        folder = course / "submitted" / "solution" / lab
        folder.mkdir(parents=True)
        (folder / f"{lab}.ipynb").write_bytes((source / lab / f"{lab}.ipynb").read_bytes())
        saved = os.environ.get(cell_times.ENV_VAR)
        os.environ[cell_times.ENV_VAR] = str(empty)  # time it under the plain limit
        try:
            release([lab], course=course, source=source, release_to=release_to, tmp_root=tmp_root)
            result = autograde(
                lab,
                ["solution"],
                course=course,
                source=source,
                release_from=release_to,
                tmp_root=tmp_root,
                log=lambda *a: None,
            )["solution"]
        finally:
            if saved is None:
                os.environ.pop(cell_times.ENV_VAR)
            else:
                os.environ[cell_times.ENV_VAR] = saved
        if result.returncode != 0:
            raise RuntimeError(f"grading the solution of {lab} failed:\n{result.output[-3000:]}")
        notes = json.loads((course / "autograded" / "solution" / lab / NOTES_FILE).read_text())
        return notes["cell_seconds"], notes["probe"]


# ----------------------------------------------------------------------------------------
# Command line: `disttrain-lab release`.


def cli_release(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="disttrain-lab release",
        description="Release the labs from solutions/ with nbgrader generate_assignment: with a course folder "
        "(--course-dir, or $DISTTRAIN_COURSE_DIR) into <course>/release/ and nothing else; with none, the "
        "maintainer's release, regenerating the checkout's labs/.",
    )
    parser.add_argument("labs", nargs="*", help="lab names (default: every lab in solutions/)")
    parser.add_argument(
        "--course-dir",
        type=Path,
        help="the course folder: the release goes to <course>/release/<lab>/ and <course>/release/wheels/, the "
        "labs are recorded in its gradebook.db (default: $DISTTRAIN_COURSE_DIR; with neither, the checkout's labs/ "
        "and the gradebook in ~/.disttrain-lab/course)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="release into a scratch directory and fail if the release folder (labs/, or <course>/release/) differs",
    )
    parser.add_argument(
        "--install-source",
        help="where the labs' setup cell installs the kit from "
        "(default: c.StampInstallSource.pip_requirement in grader/nbgrader_config.py): 'wheel', "
        "'wheel:<URL of the released wheels/ folder>', 'git+<URL>' or a wheel's URL",
    )
    parser.add_argument(
        "--time-cells",
        action="store_true",
        help="also grade each lab's solution once and record its cell times in grader/cell_times/ "
        "(the grader derives each cell's time limit from them; see disttrain_lab/grading/cell_times.py)",
    )
    args = parser.parse_args(argv)
    folder = release_folder(args.course_dir)
    shown = "labs/" if folder == (REPO_ROOT / "labs").resolve() else f"{folder}/"
    # the maintainer's release (labs/) also writes the README's Colab column (readme_labs.py)
    readme = REPO_ROOT / "README.md" if folder == (REPO_ROOT / "labs").resolve() else None
    try:
        chosen = args.install_source or install.configured_install_source()
        if not args.check:
            labs = args.labs or list_labs()
            if readme is not None and readme.is_file() and readme_labs.update(readme, chosen):
                print(f"wrote {readme.name}'s Colab column for {chosen!r}")
            for lab in _track(labs, "releasing"):
                for result in release([lab], course=args.course_dir, install_source=args.install_source):
                    print(f"released {lab} -> {folder / lab} ({result.seconds:.1f} s)")
                url = install.colab_url(chosen, lab)
                if url:  # once the release folder is pushed where its install source says
                    print(f"  Open in Colab: {url}")
            for lab in _track(labs if args.time_cells else [], "timing the solutions' cells"):
                print(f"cell times of {lab}: {cell_times.record(lab, *measure_cell_times(lab))}")
            return 0
        stale = []
        with tempfile.TemporaryDirectory(prefix="disttrain-check-") as scratch:
            fresh = Path(scratch) / "labs"
            labs = args.labs or list_labs()
            release(labs, course=Path(scratch) / "course", release_to=fresh, install_source=args.install_source)
            for lab in labs:
                stale += release_differences(fresh / lab, folder / lab)
            stale += install.wheel_differences(fresh / install.WHEELS, folder / install.WHEELS)
            if readme is not None and readme.is_file():
                text = readme.read_text()
                if readme_labs.with_badges(text, chosen) != text:
                    stale.append(f"{readme}: its Colab column is not what {chosen!r} gives")
    except (install.InstallSourceError, ReleaseWouldOverwrite) as exc:
        print(f"disttrain-lab release: {exc}", file=sys.stderr)
        return 2
    for line in stale:
        print(line)
    print(f"{shown} is up to date" if not stale else f"{shown} is out of date: run `disttrain-lab release`")
    return 1 if stale else 0


def _track(items: list, description: str):
    """``items`` with a progress bar on stderr (rich); what the loop prints stays on stdout."""
    # rich only when the command line draws: every nbgrader process imports this module
    # (grader/nbgrader_config.py imports disttrain_lab.grading) and never needs it
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn(description),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        redirect_stdout=False,
    ) as progress:
        yield from progress.track(items)
