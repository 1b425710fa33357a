"""The instructor's steps (release, autograde, feedback, grades, scores, timing the solution's
cells) and the command line ``disttrain-lab release`` (``disttrain-lab grade`` is
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

import nbformat
from nbgrader.api import Gradebook, MissingEntry

from ..start import labs_in
from . import cell_times, config, intake, readme_labs, sandbox
from . import install_source as install  # (release() has an argument named install_source)
from .config import LIMITED_ISOLATION, REPO_ROOT, Limits, course_dir, isolation_notice, release_dir, source_dir
from .execute import NOTES_FILE
from .steps import StepResult, run_nbgrader, stop_running_steps
from .submission import grade_report

# ----------------------------------------------------------------------------------------
# The instructor's steps.


def _env(course: Path | None, source: Path | None, release: Path | None) -> dict:
    # no backend override: dl.launch follows one policy (gloo on the CPU unless a lab asks
    # for device="cuda"), so grading runs exactly what the notebook ran
    env = {}
    for name, value in (
        (config.COURSE_DIR_ENV, course),
        (config.SOURCE_DIR_ENV, source),
        # always named: the course's own release if it has one, else labs/ (the maintainer's)
        (config.RELEASE_DIR_ENV, release if release is not None else graded_release(course)),
    ):
        if value is not None:
            env[name] = str(Path(value).resolve())
    return env


def list_labs(source: Path | None = None) -> list[str]:
    """The labs in ``source`` (default: solutions/): what ``disttrain-lab start`` calls a lab too."""
    source = Path(source or source_dir())
    return labs_in(source) if source.is_dir() else []


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


class ReleaseWouldOverwrite(ValueError):
    """Where a release would write, someone has worked: a notebook that was run, or a file the lab's
    source does not have.  A release writes only the kit's own files, and never over anyone's work."""


def worked_on(released: Path, source: Path) -> list[Path]:
    """Files under ``released`` (a released lab's folder) that a release did not write as they are: a
    notebook with outputs or execution counts (``normalize_release`` strips both; JupyterLab's autosave
    of a student's run keeps them), one that cannot be read, or a file the lab's ``source`` folder lacks."""
    found = []
    for path in sorted(p for p in Path(released).rglob("*") if p.is_file()):
        relative = path.relative_to(released)
        if {".ipynb_checkpoints", "__pycache__"} & set(relative.parts):
            continue  # JupyterLab's and Python's own leftovers: nobody's work
        if not (Path(source) / relative).exists():
            found.append(path)
            continue
        if path.suffix != ".ipynb":
            continue
        try:
            cells = nbformat.read(path, as_version=4).cells
        except Exception:  # not a notebook any more: not what a release wrote either
            found.append(path)
            continue
        if any(c.cell_type == "code" and (c.get("outputs") or c.get("execution_count")) for c in cells):
            found.append(path)
    return found


def _refuse_overwriting(labs: list[str], folder: Path, source: Path) -> None:
    kept = [path for lab in labs if (folder / lab).is_dir() for path in worked_on(folder / lab, source / lab)]
    if kept:
        shown = "\n".join(f"  {path}" for path in kept)
        raise ReleaseWouldOverwrite(
            f"the release would write over work in {folder} that it did not write (a notebook that was run: it "
            f"has outputs; or a file the lab's source does not have):\n{shown}\nMove them to a folder of your own "
            f"first (students work in their own copies: `disttrain-lab start NN` makes work/NN_name/), e.g. `mv "
            f"{kept[0]} {kept[0].stem}.mine{kept[0].suffix}`; then release again (in a git checkout, `git checkout "
            f"-- labs/` first)."
        )


# Where a release goes.  A course folder is the instructor's and the kit's checkout is not:
# with a course folder the release goes to <course>/release/ (nbgrader's own layout, what
# `nbgrader release_assignment` hands to the exchange), the wheel beside the labs in
# <course>/release/wheels/; only the maintainer, with no course folder, regenerates labs/.

COURSE_RELEASE = "release"  # <course>/release/<lab>/, nbgrader's CourseDirectory.release_directory


def release_folder(course: Path | None = None) -> Path:
    """Where a release writes the labs (and ``wheels/`` beside them): ``$DISTTRAIN_RELEASE_DIR``
    if set; else ``<course>/release/`` for a course folder (``course``, else
    ``$DISTTRAIN_COURSE_DIR``); else, with no course folder, the checkout's ``labs/``.
    ``grader/nbgrader_config.py`` gives plain nbgrader the same folder (``release_assignment``
    hands it out); ``disttrain-lab grade`` names its own (:func:`graded_release`).

    >>> release_folder(Path("/srv/dl101"))  # with neither variable set
    PosixPath('/srv/dl101/release')
    """
    if os.environ.get(config.RELEASE_DIR_ENV):
        return release_dir()
    if course is None and os.environ.get(config.COURSE_DIR_ENV):
        course = course_dir()
    return Path(course).expanduser().resolve() / COURSE_RELEASE if course is not None else release_dir()


def graded_release(course: Path | None = None) -> Path:
    """The release ``disttrain-lab grade`` grades a course against (test cells are restored
    from it): ``$DISTTRAIN_RELEASE_DIR`` if set; else ``<course>/release/`` once a release
    wrote it (the course folder ``course``, else the configured one); else the checkout's
    ``labs/`` (the maintainer's default course, released there)."""
    if os.environ.get(config.RELEASE_DIR_ENV):
        return release_dir()
    own = Path(course or course_dir()).expanduser().resolve() / COURSE_RELEASE
    return own if own.is_dir() else release_dir()


def release(
    labs: list[str] | None = None,
    *,
    course: Path | None = None,
    source: Path | None = None,
    release_to: Path | None = None,
    tmp_root: str | None = None,
    install_source: str | None = None,
) -> list[StepResult]:
    """generate_assignment for each lab (all of solutions/ by default), into ``release_to``
    (default: :func:`release_folder` of ``course``: ``<course>/release/``, or with no course
    folder the checkout's ``labs/``); the lab is recorded in ``course``'s gradebook.

    ``install_source`` (default: the configured one, see :mod:`disttrain_lab.grading.install_source`)
    is stamped into every lab's setup cell; the unset placeholder is refused before anything
    is written, and so is a release folder where someone worked (:func:`worked_on`).  For
    ``wheel`` sources the kit's wheel is built into ``wheels/`` beside the labs.
    """
    chosen = install_source or install.configured_install_source()
    install.stamped_requirement(chosen)  # raises InstallSourceError, saying what to set
    folder = Path(release_to or release_folder(course)).expanduser().resolve()
    env = _env(course, source, folder)  # nbgrader writes where this release decided, whatever the shell says
    env[install.ENV_VAR] = chosen
    labs = labs or list_labs(source)
    _refuse_overwriting(labs, folder, Path(source or source_dir()))
    if install.needs_wheel(chosen):
        install.build_wheel(out=folder / install.WHEELS)
    results = []
    for lab in labs:
        result = run_nbgrader(["generate_assignment", lab, "--force"], timeout=600, env=env, tmp_root=tmp_root)
        if result.returncode != 0:
            raise RuntimeError(f"nbgrader generate_assignment {lab} failed:\n{result.output}")
        normalize_release(folder / lab)
        results.append(result)
    return results


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
    env = _env(course, source, release_from)
    env.update(limits.environment(), DISTTRAIN_SANDBOX_WARNED="1")  # nbgrader's process: the same Limits()
    isolated, why = limits.sandboxed()
    if not isolated:
        log(isolation_notice(why))
    elif sandbox.caveat():
        log(LIMITED_ISOLATION.format(why=sandbox.caveat()))
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
    return run_nbgrader(args, timeout=600, env=_env(course, source, None), tmp_root=tmp_root)


def export_grades(csv_path: Path | None = None, *, course: Path | None = None, tmp_root: str | None = None) -> Path:
    course = Path(course or course_dir()).resolve()
    csv_path = Path(csv_path or course / "grades.csv").resolve()
    result = run_nbgrader(["export", f"--to={csv_path}"], timeout=600, env=_env(course, None, None), tmp_root=tmp_root)
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


def _comparable(nb_path: Path) -> list:
    nb = nbformat.read(nb_path, as_version=4)
    return [(c.cell_type, c.source, json.dumps(c.metadata, sort_keys=True)) for c in nb.cells]


def release_differences(fresh: Path, committed: Path) -> list[str]:
    """What differs between a fresh release and the committed one (sources and metadata)."""
    fresh_files = {p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file()} if fresh.is_dir() else set()
    committed_files = (
        {p.relative_to(committed) for p in committed.rglob("*") if p.is_file()} if committed.is_dir() else set()
    )
    lines = [f"missing from {committed}: {p}" for p in sorted(fresh_files - committed_files)]
    lines += [f"not in a fresh release: {committed / p}" for p in sorted(committed_files - fresh_files)]
    for rel in sorted(fresh_files & committed_files):
        a, b = fresh / rel, committed / rel
        same = _comparable(a) == _comparable(b) if rel.suffix == ".ipynb" else a.read_bytes() == b.read_bytes()
        if not same:
            lines.append(f"differs from a fresh release: {committed / rel}")
    return lines
