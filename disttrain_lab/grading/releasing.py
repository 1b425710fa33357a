"""A course's release: where it goes (``release_folder``; the one a grading is checked against,
``graded_release``), made with nbgrader's ``generate_assignment`` (``release``), normalised so
that a release is the same bytes each time, never over a folder where someone worked, and
compared with the committed one (``release_differences``).  ``step_env`` is what every nbgrader
step of a course is told of its three folders.  The other instructor's steps are ``course.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat

from ..start import labs_in
from . import config
from . import install_source as install  # (release() has an argument named install_source)
from .config import course_dir, release_dir, source_dir
from .steps import StepResult, run_nbgrader


def step_env(course: Path | None, source: Path | None, release: Path | None) -> dict:
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
    env = step_env(course, source, folder)  # nbgrader writes where this release decided, whatever the shell says
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
