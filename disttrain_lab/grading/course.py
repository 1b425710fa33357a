"""The instructor's steps (release, autograde, feedback, grades, scores) and the command line
``disttrain-lab release`` (``disttrain-lab grade`` is :mod:`disttrain_lab.gradeclass`)."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import nbformat

from .. import cell_times, sandbox
from .config import (_LIMITED_ISOLATION, _NO_ISOLATION, Limits, configured_install_source, course_dir,
                     release_dir, source_dir)
from .steps import StepResult, run_nbgrader, stop_running_steps
from .submission import grade_report

# ----------------------------------------------------------------------------------------
# The instructor's steps.

def _env(course: Path | None, source: Path | None, release: Path | None) -> dict:
    # no backend override: dl.launch follows one policy (gloo on the CPU unless a lab asks
    # for device="cuda"), so grading runs exactly what the notebook ran
    env = {}
    for name, value in (("DISTTRAIN_COURSE_DIR", course), ("DISTTRAIN_SOURCE_DIR", source),
                        ("DISTTRAIN_RELEASE_DIR", release)):
        if value is not None:
            env[name] = str(Path(value).resolve())
    return env


def list_labs(source: Path | None = None) -> list[str]:
    source = Path(source or source_dir())
    return sorted(p.name for p in source.iterdir() if p.is_dir() and (p / f"{p.name}.ipynb").exists()) \
        if source.is_dir() else []


def normalize_release(path: Path) -> None:
    """Strip what differs between two releases of the same source (so labs/ is stable)."""
    for nb_path in sorted(Path(path).rglob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        nb.metadata.pop("widgets", None)
        nb.metadata.get("language_info", {}).pop("version", None)
        for cell in nb.cells:
            cell.metadata.pop("execution", None)
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        nbformat.write(nb, nb_path)


def release(labs: list[str] | None = None, *, course: Path | None = None, source: Path | None = None,
            release_to: Path | None = None, tmp_root: str | None = None,
            install_source: str | None = None) -> list[StepResult]:
    """generate_assignment for each lab (all of solutions/ by default), into labs/.

    ``install_source`` (default: the configured one, see :mod:`disttrain_lab.release`) is
    stamped into every lab's setup cell; the unset placeholder is refused before anything
    is written.  For ``wheel`` sources the kit's wheel is built into ``labs/wheels/``.
    """
    from .. import release as install
    chosen = install_source or configured_install_source()
    install.stamped_requirement(chosen)  # raises InstallSourceError, saying what to set
    env = _env(course, source, release_to)
    env[install.ENV_VAR] = chosen
    if install.needs_wheel(chosen):
        install.build_wheel(out=Path(release_to or release_dir()) / install.WHEELS)
    results = []
    for lab in labs or list_labs(source):
        result = run_nbgrader(["generate_assignment", lab, "--force"], timeout=600, env=env, tmp_root=tmp_root)
        if result.returncode != 0:
            raise RuntimeError(f"nbgrader generate_assignment {lab} failed:\n{result.output}")
        normalize_release(Path(release_to or release_dir()) / lab)
        results.append(result)
    return results


def students_of(lab: str, course: Path | None = None) -> list[str]:
    submitted = Path(course or course_dir()) / "submitted"
    return sorted(p.name for p in submitted.iterdir() if (p / lab).is_dir()) if submitted.is_dir() else []


def _ensure_in_gradebook(lab: str, course: Path, env: dict, tmp_root: str | None) -> None:
    from nbgrader.api import Gradebook, MissingEntry
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        try:
            gb.find_assignment(lab)
            return
        except MissingEntry:
            pass
    # a course directory that never released this lab: record it without touching labs/
    with tempfile.TemporaryDirectory(prefix="disttrain-release-", dir=tmp_root) as scratch:
        result = run_nbgrader(["generate_assignment", lab, "--force",
                               f"--CourseDirectory.release_directory={scratch}"],
                              timeout=600, env=env, tmp_root=tmp_root)
    if result.returncode != 0:
        raise RuntimeError(f"could not add {lab} to the gradebook:\n{result.output}")


def autograde(lab: str, students: list[str] | None = None, *, course: Path | None = None,
              source: Path | None = None, release_from: Path | None = None, limits: Limits | None = None,
              tmp_root: str | None = None, one_process_per_student: bool = True, jobs: int = 1,
              on_result=None, log=print) -> dict[str, StepResult]:
    """Autograde each student in its own nbgrader process, ``jobs`` at a time; one result per
    student.  ``on_result(student, result)`` is called as each finishes (from a worker thread).
    An interrupt (KeyboardInterrupt) stops every running student and is raised again."""
    course = Path(course or course_dir()).resolve()
    limits = limits or Limits()
    env = _env(course, source, release_from)
    env.update(DISTTRAIN_CELL_TIMEOUT=str(limits.cell_timeout), DISTTRAIN_NOTEBOOK_TIMEOUT=str(limits.notebook_timeout),
               DISTTRAIN_KERNEL_MEMORY=str(limits.kernel_memory), DISTTRAIN_STUDENT_MEMORY=str(limits.student_memory),
               DISTTRAIN_STUDENT_PIDS=str(limits.student_pids), DISTTRAIN_SANDBOX=limits.sandbox,
               DISTTRAIN_CELL_TIME_SCALE=str(limits.cell_time_scale), DISTTRAIN_SANDBOX_WARNED="1")
    isolated, why = limits.sandboxed()
    if not isolated:
        log(_NO_ISOLATION.format(why=why))
    elif sandbox.caveat():
        log(_LIMITED_ISOLATION.format(why=sandbox.caveat()))
    _ensure_in_gradebook(lab, course, env, tmp_root)
    students = students or students_of(lab, course)
    if not one_process_per_student:
        # plain `nbgrader autograde LAB`: every student in one process (faster; no per-student cap)
        result = run_nbgrader(["autograde", lab, "--force"], timeout=limits.student_timeout * len(students),
                              env=env, tmp_root=tmp_root)
        log(f"autograde {lab} ({len(students)} students): rc={result.returncode} in {result.seconds:.1f} s")
        results = {student: result for student in students}
        grade_report(lab, students, results, course, why if not isolated else None)
        return results
    import concurrent.futures
    import queue
    results, slots, stopping = {}, queue.Queue(), threading.Event()
    for slot in range(jobs):
        slots.put(slot)

    def grade_one(student: str) -> None:
        slot = slots.get()      # a free slot: its sandbox uid and nobody else's while this student runs
        try:
            if stopping.is_set():
                return
            result = run_nbgrader(["autograde", lab, "--student", student, "--force"],
                                  timeout=limits.student_timeout, env=env, tmp_root=tmp_root, slot=slot)
        finally:
            slots.put(slot)
        if stopping.is_set():   # killed by the interrupt: not a grade
            return
        if result.timed_out:      # as nbgrader does for a failed submission: no half-written results
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


def generate_feedback(lab: str, students: list[str] | None = None, *, course: Path | None = None,
                      source: Path | None = None, tmp_root: str | None = None) -> StepResult:
    args = ["generate_feedback", lab, "--force"]
    if students and len(students) == 1:
        args += ["--student", students[0]]
    return run_nbgrader(args, timeout=600, env=_env(course, source, None), tmp_root=tmp_root)


def export_grades(csv_path: Path | None = None, *, course: Path | None = None,
                  tmp_root: str | None = None) -> Path:
    course = Path(course or course_dir()).resolve()
    csv_path = Path(csv_path or course / "grades.csv").resolve()
    result = run_nbgrader(["export", f"--to={csv_path}"], timeout=600, env=_env(course, None, None), tmp_root=tmp_root)
    if result.returncode != 0:
        raise RuntimeError(f"nbgrader export failed:\n{result.output}")
    return csv_path


def scores(lab: str, course: Path | None = None) -> dict[str, dict[str, float]]:
    """{student: {grade_id: score, ..., "total": score}} from the gradebook."""
    from nbgrader.api import Gradebook
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


# ----------------------------------------------------------------------------------------
# Command line: `disttrain-lab release` and `disttrain-lab grade`.

def cli_release(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disttrain-lab release",
                                     description="Regenerate labs/ from solutions/ with nbgrader generate_assignment.")
    parser.add_argument("labs", nargs="*", help="lab names (default: every lab in solutions/)")
    parser.add_argument("--course-dir", type=Path, help="course directory holding gradebook.db "
                        "(default: $DISTTRAIN_COURSE_DIR or ~/.disttrain-lab/course)")
    parser.add_argument("--check", action="store_true",
                        help="release into a scratch directory and fail if labs/ differs from it")
    parser.add_argument("--install-source", help="where the labs' setup cell installs the kit from "
                        "(default: c.StampInstallSource.pip_requirement in grader/nbgrader_config.py): 'wheel', "
                        "'wheel:<URL of labs/wheels>', 'git+<URL>' or a wheel's URL")
    parser.add_argument("--time-cells", action="store_true",
                        help="also grade each lab's solution once and record its cell times in grader/cell_times/ "
                        "(the grader derives each cell's time limit from them; see disttrain_lab/cell_times.py)")
    args = parser.parse_args(argv)
    from ..release import WHEELS, InstallSourceError, wheel_differences
    try:
        if not args.check:
            labs = args.labs or list_labs()
            for lab in _track(labs, "releasing"):
                for result in release([lab], course=args.course_dir, install_source=args.install_source):
                    print(f"released {lab} -> {release_dir() / lab} ({result.seconds:.1f} s)")
            for lab in _track(labs if args.time_cells else [], "timing the solutions' cells"):
                print(f"cell times of {lab}: {cell_times.record(lab, cell_times.measure(lab))}")
            return 0
        stale = []
        with tempfile.TemporaryDirectory(prefix="disttrain-check-") as scratch:
            fresh = Path(scratch) / "labs"
            labs = args.labs or list_labs()
            release(labs, course=Path(scratch) / "course", release_to=fresh, install_source=args.install_source)
            for lab in labs:
                stale += release_differences(fresh / lab, release_dir() / lab)
            stale += wheel_differences(fresh / WHEELS, release_dir() / WHEELS)
    except InstallSourceError as exc:
        print(f"disttrain-lab release: {exc}", file=sys.stderr)
        return 2
    for line in stale:
        print(line)
    print("labs/ is up to date" if not stale else "labs/ is out of date: run `disttrain-lab release`")
    return 1 if stale else 0


def _track(items: list, description: str):
    """``items`` with a progress bar on stderr (rich); what the loop prints stays on stdout."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    with Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True, redirect_stdout=False) as progress:
        yield from progress.track(items)


def _comparable(nb_path: Path) -> list:
    nb = nbformat.read(nb_path, as_version=4)
    return [(c.cell_type, c.source, json.dumps(c.metadata, sort_keys=True)) for c in nb.cells]


def release_differences(fresh: Path, committed: Path) -> list[str]:
    """What differs between a fresh release and the committed one (sources and metadata)."""
    fresh_files = {p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file()} if fresh.is_dir() else set()
    committed_files = {p.relative_to(committed) for p in committed.rglob("*") if p.is_file()} if committed.is_dir() else set()
    lines = [f"missing from {committed}: {p}" for p in sorted(fresh_files - committed_files)]
    lines += [f"not in a fresh release: {committed / p}" for p in sorted(committed_files - fresh_files)]
    for rel in sorted(fresh_files & committed_files):
        a, b = fresh / rel, committed / rel
        same = _comparable(a) == _comparable(b) if rel.suffix == ".ipynb" else a.read_bytes() == b.read_bytes()
        if not same:
            lines.append(f"differs from a fresh release: {committed / rel}")
    return lines


def cli_grade(argv: list[str] | None = None) -> int:
    """``disttrain-lab grade``: see :mod:`disttrain_lab.gradeclass` (parallel, resumable, shards)."""
    from ..gradeclass import cli_grade as grade_class_cli
    return grade_class_cli(argv)
