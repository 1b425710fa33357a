"""Grading on Gradescope: ``disttrain-lab gradescope LAB --out FILE.zip`` packs a released lab as
a Gradescope autograder, and ``run`` (what its ``run_autograder`` calls, in Gradescope's container)
grades the submitted notebook with this package's own grader into Gradescope's results file.

Gradescope's autograder, as its specification documents it
(https://gradescope-autograders.readthedocs.io/en/latest/specs/): a zip whose root holds
``setup.sh`` (run once, as root, when the image is built; Ubuntu, apt) and ``run_autograder`` (run
for each submission from ``/autograder``); the zip is unpacked into ``/autograder/source``, the
student's files are put in ``/autograder/submission``, and ``run_autograder`` writes
``/autograder/results/results.json``: ``score``, ``execution_time`` (seconds), ``output`` (shown
to the student), ``stdout_visibility`` (``/autograder/results/stdout`` is the instructor's) and
``tests``, each with ``name``, ``score``, ``max_score``, ``status`` (``passed``/``failed``),
``output`` and ``visibility``: ``visible``, ``hidden``, ``after_due_date`` or ``after_published``.

The package::

    setup.sh, run_autograder
    gradescope.json   the lab, its graded tests (grade_id, exercise, points, whether it holds hidden
                      tests), the visibility of those, the sandbox setting
    kit/              the kit's source (pyproject.toml, disttrain_lab/, grader/nbgrader_config.py, the
                      lab's cell times): setup.sh installs it, with torch pinned, in /opt/disttrain-lab
    lab/              the lab's source folder (its hidden tests) and release, and its gradebook (the
                      lab alone, no student): under /autograder, which ``run`` makes root's only

``run`` puts the notebook in a one-student course in a temp folder and grades it with
``course.autograde`` (the sandbox, the grader kernel, the OS's byte counts: ``disttrain-lab
grade``'s own steps), then reads each test's score and first line of failure from that gradebook
and autograded notebook (``export.results``): the scores are ``disttrain-lab grade``'s for the same
notebook.  In Gradescope's container (Docker's default capabilities: no CAP_SYS_ADMIN) the sandbox
cannot run, and the default refuses: every test 0, saying why and what the instructor can choose.
``--sandbox container`` opts in to ``run_container.py``'s weaker isolation, said in every result.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import sys
import tempfile
import time
import traceback
import zipfile
from contextlib import closing
from datetime import datetime, timezone
from pathlib import Path

import nbformat
from nbgrader.api import Gradebook, MissingEntry

from .. import withheld
from .._version import __version__
from . import cell_times, export, intake, run_container, sandbox
from .cells import exercise_names, grade_id, is_test_cell
from .config import (
    LIMITED_ISOLATION,
    REPO_ROOT,
    Limits,
    SandboxRefused,
    course_dir,
    isolation_notice,
    show_expected,
    source_dir,
)
from .course import autograde
from .feedback_page import WITHHELD, expected_shown
from .hidden_tests import BEGIN as HIDDEN_TESTS
from .releasing import graded_release

ROOT_ENV = "DISTTRAIN_AUTOGRADER_DIR"  # Gradescope's /autograder (a test's stand-in elsewhere)
PACKAGE = "gradescope.json"
STUDENT = "student"  # the one student of the course ``run`` builds
VISIBILITIES = ("after_due_date", "after_published", "hidden", "visible")  # Gradescope's, for a test's result
SANDBOXES = ("auto", "container")  # not "off": the student's code would run as root there, and write results.json

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu, apt):
# https://gradescope-autograders.readthedocs.io/en/latest/specs/  (written by `disttrain-lab gradescope`)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PREFIX=/opt/disttrain-lab
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# ss (iproute2) counts the bytes between the ranks; setpriv (util-linux) and libseccomp serve container mode
apt-get install -y -q --no-install-recommends python3 python3-venv python3-pip iproute2 util-linux libseccomp2
rm -rf "$PREFIX" && mkdir -p "$PREFIX" && cp -r "$HERE/kit" "$PREFIX/kit"
python3 -m venv "$PREFIX/venv"
"$PREFIX/venv/bin/pip" install -q --upgrade pip
# the kit with the instructor's tools, and torch as pyproject.toml pins it (the `torch` extra, torch==X):
# its CPU build from PyTorch's index, never an unpinned torch (several GB of CUDA packages)
"$PREFIX/venv/bin/pip" install -q --extra-index-url https://download.pytorch.org/whl/cpu -e "$PREFIX/kit[grader,torch]"
chmod -R a+rX,go-w "$PREFIX"  # the student's uid runs the interpreter and the kit, and changes neither
# but imports none of the grader's references (torchao, lab 13's): root's only (kernels.reference_paths)
"$PREFIX/venv/bin/python" -c 'import disttrain_lab.grading.kernels as k; print(*k.reference_paths(), sep="\\n")' \\
    | while read -r reference; do chmod -R go-rwx "$reference"; done
"$PREFIX/venv/bin/python" -c "import torch, disttrain_lab.grading; print('ready: torch', torch.__version__)"
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for each submission, as root, from /autograder: it grades the notebook in
# /autograder/submission into /autograder/results/results.json (disttrain_lab/grading/gradescope.py).
# DISTTRAIN_PYTHON and DISTTRAIN_AUTOGRADER_DIR stand in for /opt/disttrain-lab and /autograder in a test.
cd /  # (no working folder on the interpreter's path)
exec "${DISTTRAIN_PYTHON:-/opt/disttrain-lab/venv/bin/python}" -c \\
    'import sys; from disttrain_lab.grading.gradescope import main; sys.exit(main())'
"""


# ----------------------------------------------------------------------------------------
# Building the package (the instructor's machine)


def build(
    lab: str,
    out: Path,
    *,
    course: Path | None = None,
    source: Path | None = None,
    release: Path | None = None,
    hidden_visibility: str = "after_due_date",
    sandbox_setting: str = "auto",
) -> dict:
    """Write the autograder zip ``out`` for ``lab``: its source (default: ``source_dir()``), the
    release it is graded against (default: the course's, ``releasing.graded_release``) and the lab's
    gradebook entry from ``course`` (default: ``course_dir()``).  Returns the package's settings."""
    if hidden_visibility not in VISIBILITIES:
        raise ValueError(f"hidden_visibility is one of {', '.join(VISIBILITIES)}, not {hidden_visibility!r}")
    if sandbox_setting not in SANDBOXES:
        raise ValueError(f"the package's sandbox is one of {', '.join(SANDBOXES)}, not {sandbox_setting!r}")
    course = Path(course or course_dir()).resolve()
    source, release = Path(source or source_dir()).resolve(), Path(release or graded_release(course)).resolve()
    for folder in (source, release):
        if not (folder / lab / f"{lab}.ipynb").is_file():
            notebook = folder / lab / f"{lab}.ipynb"
            raise LookupError(f"no {notebook}: release the lab first (disttrain-lab release {lab} --course-dir DIR)")
    with tempfile.TemporaryDirectory(prefix="disttrain-gradescope-") as scratch:
        gradebook = _lab_gradebook(course / "gradebook.db", lab, Path(scratch) / "gradebook.db")
        settings = {
            "lab": lab,
            "kit": __version__,
            "hidden_visibility": hidden_visibility,
            "sandbox": sandbox_setting,
            "tests": _tests(lab, source, gradebook),
        }
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
            _add(z, "setup.sh", SETUP_SH.encode(), 0o755)
            _add(z, "run_autograder", RUN_AUTOGRADER.encode(), 0o755)
            _add(z, PACKAGE, json.dumps(settings, indent=1).encode())
            for path in ["pyproject.toml", "README.md", "grader/nbgrader_config.py", *_package_files()]:
                _add(z, f"kit/{path}", (REPO_ROOT / path).read_bytes())
            times = cell_times.times_dir() / f"{lab}.json"
            if times.is_file():  # (the grader's per-cell limits, wherever the course keeps them)
                _add(z, f"kit/grader/cell_times/{lab}.json", times.read_bytes())
            for name, folder in (("source", source), ("release", release)):
                for path in _lab_files(folder / lab):
                    _add(z, f"lab/{name}/{lab}/{path}", (folder / lab / path).read_bytes())
            _add(z, "lab/gradebook.db", gradebook.read_bytes())
    return settings


def _add(z: zipfile.ZipFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # (the same lab packs to the same bytes)
    info.external_attr = (0o100000 | mode) << 16  # a regular file; run_autograder and setup.sh executable
    info.compress_type = zipfile.ZIP_DEFLATED
    z.writestr(info, data)


def _package_files() -> list[str]:
    root = REPO_ROOT / "disttrain_lab"
    return sorted(
        p.relative_to(REPO_ROOT).as_posix() for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )


def _lab_files(folder: Path) -> list[str]:
    """What a lab folder gives grading: its notebooks and its ``data/`` (a release's rule too)."""
    found = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and ".ipynb_checkpoints" not in rel.parts and (rel.parts[0] == "data" or p.suffix == ".ipynb"):
            found.append(rel.as_posix())
    return found


def _lab_gradebook(db: Path, lab: str, into: Path) -> Path:
    """A copy of the course's gradebook holding ``lab`` alone, with no student in it."""
    if not db.is_file():
        raise LookupError(f"no gradebook at {db}: release {lab} into the course first (disttrain-lab release)")
    with closing(sqlite3.connect(db)) as src, closing(sqlite3.connect(into)) as dst:
        src.backup(dst)  # (consistent while a grading writes to it)
    with Gradebook(f"sqlite:///{into}") as gb:
        try:
            gb.find_assignment(lab)
        except MissingEntry:
            have = ", ".join(a.name for a in gb.assignments) or "none"
            raise LookupError(f"{db} does not record {lab} (it has: {have}); release it into that course") from None
        for other in [a.name for a in gb.assignments if a.name != lab]:
            gb.remove_assignment(other)
        for student in [s.id for s in gb.students]:
            gb.remove_student(student)
    with closing(sqlite3.connect(into, isolation_level=None)) as c:
        c.execute("VACUUM")  # no freed page keeps a student's name or grade
    return into


def _tests(lab: str, source: Path, gradebook: Path) -> list[dict]:
    """The lab's graded tests in its order: grade_id, exercise, points, whether it holds hidden tests."""
    nb = nbformat.read(source / lab / f"{lab}.ipynb", as_version=4)
    names = exercise_names(nb)
    hidden = {grade_id(c) for c in nb.cells if c.cell_type == "code" and is_test_cell(c) and HIDDEN_TESTS in c.source}
    with Gradebook(f"sqlite:///{gradebook}") as gb:
        cells = [(c.name, float(c.max_score)) for n in gb.find_assignment(lab).notebooks for c in n.grade_cells]
    order = list(names)
    cells.sort(key=lambda t: order.index(t[0]) if t[0] in order else len(order))
    return [
        {"grade_id": g, "exercise": names.get(g, g), "max_score": most, "hidden": g in hidden}
        for g, most in cells
        if most
    ]


# ----------------------------------------------------------------------------------------
# Grading one submission (in Gradescope's container, from run_autograder)


def run(root: Path | None = None) -> dict:
    """Grade the notebook in ``root/submission`` (``root``: ``$DISTTRAIN_AUTOGRADER_DIR``, else
    ``/autograder``) and write ``root/results/results.json``; returns what was written."""
    started = time.monotonic()
    root = Path(root or os.environ.get(ROOT_ENV) or "/autograder")
    settings = json.loads((root / "source" / PACKAGE).read_text())
    os.chmod(root, 0o700)  # the package (hidden tests), the submission and its metadata, the results: root's only
    (root / "results").mkdir(exist_ok=True)
    os.chmod(root / "results", 0o700)
    variable = Limits.variable("sandbox")
    os.environ[variable] = os.environ.get(variable) or settings["sandbox"]  # (this process's Limits, and nbgrader's)
    hide = [os.environ.get("DISTTRAIN_SANDBOX_HIDE"), str(root)]  # (the full sandbox's mounts hide it too)
    os.environ["DISTTRAIN_SANDBOX_HIDE"] = os.pathsep.join(filter(None, hide))
    lab = settings["lab"]
    try:
        limits = Limits()
        isolated, why = limits.sandboxed()
        isolation = (
            isolation_notice(why)
            if not isolated
            else LIMITED_ISOLATION.format(why=sandbox.caveat())
            if sandbox.caveat()
            else "isolation: the kit's sandbox (grader/README.md, 'Threat model')"
        ).strip()
        scores, said = _grade(root, lab, limits), isolation
    except SandboxRefused as refused:
        scores = said = (
            f"Not graded (0 points): the autograder runs no student code without the isolation it needs, and this "
            f"container cannot give it: {refused}. The instructor can choose `disttrain-lab gradescope {lab} "
            "--sandbox container` (what it guarantees: the kit's grader/README.md, 'Grading on Gradescope')."
        )
    except NotGraded as failed:
        scores = said = f"Not graded (0 points): {failed}"
    except Exception:  # noqa: BLE001 - whatever broke, results.json says so and scores nothing
        traceback.print_exc()
        scores = said = "Not graded (0 points): the autograder failed (its output, for the instructor, says why)."
    finally:
        if os.geteuid() == 0:
            for uid in run_container.student_uids():  # (container mode: nothing of the student outlives its grading)
                run_container.sweep(uid)
    if isinstance(scores, dict) and not _expected_shown(root):  # (a student may still resubmit)
        instead = WITHHELD[show_expected()]
        scores = {g: (s, m and withheld.withhold_expected(m, instead)) for g, (s, m) in scores.items()}
    results = _results(settings, scores, said, time.monotonic() - started)
    partial = root / "results" / "results.json.partial"
    partial.write_text(json.dumps(results, indent=1))
    os.replace(partial, root / "results" / "results.json")
    return results


def _expected_shown(root: Path) -> bool:
    """Whether a failed prediction's result shows the expected value (``config.show_expected``):
    by default only once the assignment's due date, which Gradescope writes into
    ``submission_metadata.json`` (``assignment.due_date``, ISO 8601), has passed."""
    try:
        due = json.loads((root / "submission_metadata.json").read_text())["assignment"]["due_date"]
        due = datetime.fromisoformat(due).astimezone(timezone.utc).replace(tzinfo=None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        due = None
    return expected_shown(show_expected(), due, datetime.now(timezone.utc).replace(tzinfo=None))


class NotGraded(Exception):
    """Why a submission got no grading (said to the student)."""


def _grade(root: Path, lab: str, limits: Limits) -> dict[str, tuple[float, str | None]]:
    """{grade_id: (score, first line of its failure)} for the submitted notebook, graded as
    ``disttrain-lab grade`` grades it, in a one-student course of its own."""
    notebook = _submitted(root / "submission", lab)
    lab_dir = root / "source" / "lab"
    with tempfile.TemporaryDirectory(prefix="disttrain-gradescope-") as scratch:  # (root's, 0700)
        course = Path(scratch) / "course"
        (course / "submitted" / STUDENT / lab).mkdir(parents=True)
        shutil.copyfile(lab_dir / "gradebook.db", course / "gradebook.db")
        (course / "submitted" / STUDENT / lab / f"{lab}.ipynb").write_bytes(notebook)
        step = autograde(
            lab,
            [STUDENT],
            course=course,
            source=lab_dir / "source",
            release_from=lab_dir / "release",
            limits=limits,
            tmp_root=scratch,
            log=print,
        )[STUDENT]
        report = course / "reports" / f"{lab}.txt"
        print(report.read_text() if report.is_file() else "(no grade report)")
        if step.returncode != 0:
            print(step.output[-5000:])
            raise NotGraded("grading stopped at its time limit" if step.timed_out else "grading failed (see its log)")
        graded = [s for s in export.results(lab, course, lab_dir / "source").students if s.student == STUDENT]
        if not graded:
            raise NotGraded("the grader recorded no grade (the instructor's log says why)")
        return {t.grade_id: (t.score, t.message) for t in graded[0].tests}


def _submitted(folder: Path, lab: str) -> bytes:
    """The submitted notebook: ``<lab>.ipynb`` (the shallowest, if a zip nested it), else the only
    notebook there is; read as a regular file, never through a link (``intake.read_notebook``)."""
    found = []
    for where, dirs, files in os.walk(folder):  # (links to folders are not walked into)
        dirs[:] = sorted(d for d in dirs if d not in (".ipynb_checkpoints", "__MACOSX"))
        found += [Path(where) / f for f in sorted(files) if f.endswith(".ipynb")]
    named = sorted((p for p in found if p.name == f"{lab}.ipynb"), key=lambda p: len(p.parts))
    chosen = named[:1] or (found if len(found) == 1 else [])
    if not chosen:
        seen = ", ".join(str(p.relative_to(folder)) for p in found) or "none"
        raise NotGraded(f"submit the lab's notebook, {lab}.ipynb (notebooks in this submission: {seen})")
    try:
        return intake.read_notebook(chosen[0])
    except intake.Refused as refused:
        raise NotGraded(f"the submitted {chosen[0].relative_to(folder)} {refused}") from None


def _results(settings: dict, scores: dict | str, output: str, seconds: float) -> dict:
    """results.json: a test per graded cell (``scores``: {grade_id: (score, message)}, or why
    none was graded), named ``exercise (grade_id)``; a test holding hidden tests is shown as the
    package says (``hidden_visibility``), the others at once."""
    tests = []
    for t in settings["tests"]:
        score, message = scores.get(t["grade_id"], (0.0, None)) if isinstance(scores, dict) else (0.0, scores)
        passed = score >= t["max_score"]
        name = t["grade_id"] if t["exercise"] == t["grade_id"] else f"{t['exercise']} ({t['grade_id']})"
        test = {"name": name, "score": score, "max_score": t["max_score"], "status": "passed" if passed else "failed"}
        if not passed:
            test["output"] = message or "did not pass"
        test["visibility"] = settings["hidden_visibility"] if t["hidden"] else "visible"
        tests.append(test)
    total, most = sum(t["score"] for t in tests), sum(t["max_score"] for t in tests)
    head = f"{settings['lab']}: {total:g} of {most:g} points (disttrain-lab {settings['kit']})"
    return {
        "score": total,
        "execution_time": round(seconds),
        "output": f"{head}\n{output}",
        "stdout_visibility": "hidden",  # the grader's log is the instructor's
        "tests": tests,
    }


def main() -> int:
    """``run_autograder``: grade, write results.json, say the score on stdout (the instructor's)."""
    results = run()
    print(results["output"])
    return 0


# ----------------------------------------------------------------------------------------
# `disttrain-lab gradescope LAB --out FILE.zip`


def cli_gradescope(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="disttrain-lab gradescope",
        description="Pack a released lab as a Gradescope autograder (setup.sh, run_autograder, the kit, the lab's "
        "source, release and gradebook entry): upload the zip as a programming assignment's autograder.",
    )
    parser.add_argument("lab", help="the lab's name, as released (e.g. 01_point_to_point)")
    parser.add_argument("--out", type=Path, required=True, help="the zip to write")
    parser.add_argument(
        "--course-dir",
        type=Path,
        help="the course the lab is released in: its gradebook and release (default: $DISTTRAIN_COURSE_DIR "
        "or ~/.disttrain-lab/course)",
    )
    parser.add_argument(
        "--hidden-visibility",
        choices=VISIBILITIES,
        default="after_due_date",
        help="when students see a test that holds hidden tests (its score and message): Gradescope's visibility "
        "(default %(default)s); tests without hidden tests are visible at once",
    )
    parser.add_argument(
        "--sandbox",
        choices=SANDBOXES,
        default="auto",
        help="auto (the default): the kit's sandbox or no grading (Gradescope's container cannot sandbox, so every "
        "test scores 0 saying why); container: grade with run_container.py's weaker isolation, said in every result "
        "(grader/README.md, 'Grading on Gradescope')",
    )
    args = parser.parse_args(argv)
    try:
        settings = build(
            args.lab,
            args.out,
            course=args.course_dir,
            hidden_visibility=args.hidden_visibility,
            sandbox_setting=args.sandbox,
        )
    except LookupError as exc:
        print(f"disttrain-lab gradescope: {exc}", file=sys.stderr)
        return 1
    points = sum(t["max_score"] for t in settings["tests"])
    print(f"wrote {args.out}: {args.lab}, {len(settings['tests'])} tests, {points:g} points, sandbox {args.sandbox}")
    return 0
