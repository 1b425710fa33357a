"""Sanitizing a submission before it is executed, and what a grader sees of it afterwards:
unreadable files graded as the blank lab with a note, deleted test cells put back, feedback
without hidden tests, a scan for constructs a human should look at, the grade report, and the
install source stamped into a release."""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import nbformat
from nbconvert.exporters import NotebookExporter
from nbgrader.api import Gradebook, MissingEntry, TaskCell
from nbgrader.preprocessors import ClearHiddenTests, NbGraderPreprocessor, OverwriteCells
from traitlets import Integer, Unicode

from . import intake, sandbox
from .cells import is_test_cell
from .config import isolation_report
from .execute import NOTES_FILE
from .hidden_tests import gradebook_hidden_lines, hidden_lines, scrub_outputs
from .install_source import BADGE_START, ENV_VAR, colab_badge, colab_url, stamped_requirement

# ----------------------------------------------------------------------------------------
# Sanitizing a submission.


def released_notebook(configurable, ids: dict) -> nbformat.NotebookNode | None:
    """The released (student) notebook ``ids`` names (nbgrader's resources["nbgrader"]), from
    the release directory of the course that ``configurable`` (a converter, or something
    it owns: its exporter, a preprocessor) grades; None where there is none."""
    while configurable is not None and getattr(configurable, "coursedir", None) is None:
        configurable = configurable.parent
    if configurable is None:
        return None
    coursedir = configurable.coursedir
    path = Path(coursedir.format_path(coursedir.release_directory, ".", ids["assignment"])) / f"{ids['notebook']}.ipynb"
    return nbformat.read(path, as_version=4) if path.is_file() else None


# what the gradebook knows of a cell's nbgrader metadata; restored above before they are copied
_GRADEBOOK_KEYS = ("grade", "solution", "locked", "task", "grade_id", "checksum", "points")


class RestoringOverwriteCells(OverwriteCells):
    """OverwriteCells that takes a test cell, and every locked cell of the instructor, from
    the release and the gradebook as a whole: source, points and *all* metadata (tags too:
    nbclient skips a cell tagged ``skip-execution``), never from the submission.  Its
    deleted-test-cell restore never fails: nbgrader's own version only looks for the previous
    *graded* cell and raises KeyError when the cell before a deleted test is, e.g., a locked
    markdown cell."""

    def preprocess(self, nb, resources):
        released = released_notebook(self, resources["nbgrader"])
        self._released = {
            c.metadata.nbgrader["grade_id"]: c.metadata
            for c in (released.cells if released else [])
            if "grade_id" in c.get("metadata", {}).get("nbgrader", {})
        }
        return super().preprocess(nb, resources)

    def preprocess_cell(self, cell, resources, index):
        """Put the gradebook's nbgrader flags back first: one flipped ``grade``/``solution``/
        ``locked`` flag would otherwise make the checksum check fail the whole notebook.
        After nbgrader put the source back, the metadata of a test or locked instructor cell
        is the release's (the gradebook's flags, points and checksum in it)."""
        nbg = cell.get("metadata", {}).get("nbgrader", {})
        grade_id = nbg.get("grade_id")
        if grade_id is not None:

            def find(kind):
                try:
                    return getattr(self.gradebook, f"find_{kind}_cell")(grade_id, self.notebook_id, self.assignment_id)
                except MissingEntry:
                    return None

            source_cell = find("source")
            if source_cell is not None:
                graded, solution = find("graded"), find("solution")
                genuine = {
                    "grade": graded is not None and not isinstance(graded, TaskCell),
                    "solution": solution is not None,
                    "locked": bool(source_cell.locked),
                    "task": isinstance(graded, TaskCell),
                }
                for flag, value in genuine.items():
                    if bool(nbg.get(flag, False)) != value:
                        self.report_change(grade_id, flag, value, nbg.get(flag))
                        nbg[flag] = value
                if graded is not None:
                    nbg["points"] = float(graded.max_score)
                cell, resources = super().preprocess_cell(cell, resources, index)
                if not genuine["solution"] and (genuine["grade"] or genuine["locked"]):
                    cell.metadata = self._genuine_metadata(cell)
                return cell, resources
        return super().preprocess_cell(cell, resources, index)

    def _genuine_metadata(self, cell) -> nbformat.NotebookNode:
        nbg = cell.metadata.nbgrader
        # without a release to read (a lab recorded in the gradebook only): nothing but nbgrader's own
        metadata = copy.deepcopy(self._released.get(nbg["grade_id"])) or {"deletable": False, "editable": False}
        metadata["nbgrader"] = {
            "schema_version": 3,
            "cell_type": cell.cell_type,
            **{k: v for k, v in metadata.get("nbgrader", {}).items() if k != "points"},
            **{k: nbg[k] for k in _GRADEBOOK_KEYS if k in nbg and (k != "points" or nbg.get("grade"))},
        }
        return nbformat.from_dict(metadata)

    def add_missing_grade_cells(self, nb, resources):
        source_nb = self.gradebook.find_notebook(self.notebook_id, self.assignment_id)
        source_cells = list(source_nb.source_cells)
        grade_cells = {c.name: c for c in source_nb.grade_cells}
        solution_ids = {c.name for c in source_nb.solution_cells}
        for pos, source_cell in enumerate(source_cells):
            present = {
                c.metadata["nbgrader"]["grade_id"]: i
                for i, c in enumerate(nb.cells)
                if "grade_id" in c.get("metadata", {}).get("nbgrader", {})
            }
            if source_cell.name not in grade_cells or source_cell.name in present:
                continue
            self.log.warning("Missing grade cell %s: adding it back", source_cell.name)
            restored = self.missing_cell_transform(
                source_cell, grade_cells[source_cell.name].max_score, is_solution=source_cell.name in solution_ids
            )
            before = [present[c.name] for c in source_cells[:pos] if c.name in present]
            nb.cells.insert(max(before) + 1 if before else 0, restored)
        return nb, resources


class SubmissionProblem(Exception):
    """Why a submitted file cannot be graded as it is (said to the student)."""


class SubmissionExporter(NotebookExporter):
    """Reads submissions for nbgrader autograde; a file that is not a gradable notebook of
    this lab is replaced by the blank lab with a note saying why (so it scores 0 with a
    reason in the feedback, instead of failing the grader run)."""

    max_submission_bytes = Integer(intake.MAX_NOTEBOOK_BYTES).tag(config=True)

    def from_filename(self, filename, resources=None, **kw):
        if not getattr(self.parent, "_sanitizing", False):
            return super().from_filename(filename, resources, **kw)
        resources = resources or {}
        resources.setdefault("metadata", {})
        resources["metadata"].update(name=Path(filename).stem, path=os.path.dirname(filename))
        pristine = copy.deepcopy(resources)
        try:
            nb = self._read(filename)
            self._check_lab(nb, resources["nbgrader"])
            return self.from_notebook_node(nb, resources, **kw)
        except SubmissionProblem as problem:
            reason = str(problem)
        except Exception as exc:
            if type(exc).__module__.startswith("sqlalchemy"):
                raise  # the gradebook itself is broken: not the student's fault
            reason = f"could not be processed by the grader ({type(exc).__name__}: {exc})"
        self.log.warning("Submission %s %s: grading it as the blank lab", filename, reason)
        return self.from_notebook_node(self._blank(pristine["nbgrader"], reason), pristine, **kw)

    def _read(self, filename: str) -> nbformat.NotebookNode:
        try:  # a regular file only, never through a symbolic link (intake.py)
            data = intake.read_notebook(Path(filename), self.max_submission_bytes)
        except intake.Refused as refused:
            raise SubmissionProblem(str(refused)) from None
        if not data:
            raise SubmissionProblem("is an empty file")
        text = data.decode("utf-8", errors="replace")
        try:
            json.loads(text)
        except ValueError as exc:
            raise SubmissionProblem(f"is not valid notebook JSON ({exc})") from None
        try:
            nb = nbformat.reads(text, as_version=4)
            nbformat.validate(nb)
        except Exception as exc:
            raise SubmissionProblem(
                f"is not a valid Jupyter notebook ({type(exc).__name__}: {str(exc)[:200]})"
            ) from None
        return nb

    def _check_lab(self, nb, ids: dict) -> None:
        with Gradebook(ids["db_url"]) as gb:
            expected = {c.name for c in gb.find_notebook(ids["notebook"], ids["assignment"]).source_cells}
        present = {c.get("metadata", {}).get("nbgrader", {}).get("grade_id") for c in nb.cells} - {None}
        ours, foreign = present & expected, present - expected
        if expected and (not ours or len(foreign) > len(ours)):
            raise SubmissionProblem(
                f"is not the notebook of lab {ids['assignment']} (its exercise cells "
                "are not this lab's: another lab, or cells copied into a new notebook?)"
            )

    def _blank(self, ids: dict, reason: str) -> nbformat.NotebookNode:
        nb = released_notebook(self, ids) or nbformat.v4.new_notebook()
        note = (
            f"**Grading note:** your submitted `{ids['notebook']}.ipynb` {reason}, so it was graded "
            "as the blank lab: every exercise scores 0. Fix the file and submit again, or ask your instructor."
        )
        nb.cells.insert(0, nbformat.v4.new_markdown_cell(note))
        for cell in nb.cells:
            cell.pop("id", None)
        nbformat.validator.normalize(nb)
        return nbformat.from_dict(nb)


class FeedbackWithoutHiddenTests(ClearHiddenTests):
    """Feedback step: the student sees each failing test's message, never the test code:
    hidden test regions are cut from graded cells, and their error tracebacks (which
    quote the failing line) are cut to their last line, ``Error: message``; no output of
    any cell shows a line of a hidden test (hidden_tests.py)."""

    enforce_metadata = False

    def preprocess(self, nb, resources):
        ids = resources.get("nbgrader", {})
        sources = [c.source for c in nb.cells if is_test_cell(c)]  # (autograde restored them)
        lines = hidden_lines(sources)
        if ids.get("db_url"):
            lines = sorted({*lines, *gradebook_hidden_lines(ids["db_url"], ids["notebook"], ids["assignment"])})
        scrub_outputs(nb, sorted(lines, key=len, reverse=True))
        return super().preprocess(nb, resources)

    def preprocess_cell(self, cell, resources, index):
        if not is_test_cell(cell):
            return cell, resources
        cell, resources = super().preprocess_cell(cell, resources, index)
        for output in cell.get("outputs", []):
            if output.output_type == "error":  # a traceback's last line is "Error: message"
                output.traceback = output.traceback[-1:] or [f"\x1b[0;31m{output.ename}\x1b[0m: {output.evalue}"]
        return cell, resources


# Constructs a grader should look at; a match only flags the submission for a human.
HOSTILE_CONSTRUCTS = {
    "IPython hook APIs": r"get_ipython\s*\(|set_custom_exc|\.events\.register|ast_transformers|input_transformers|"
    r"displayhook|excepthook|showtraceback|run_cell",
    "frame or object-graph introspection": r"\bimport\s+(gc|inspect)\b|\bfrom\s+(gc|inspect)\s+import|\bgc\.|"
    r"\binspect\.|sys\._getframe|f_back|f_globals|settrace|setprofile",
    "code-object surgery": r"__code__|__defaults__|__kwdefaults__|__globals__|sys\.modules",
    "ctypes / native code": r"\bctypes\b|\bcffi\b|\bmmap\b",
    "process or file-system probing": r"/proc\b|/dev/shm|sqlite3|gradebook|\.\./|\bos\.kill|\bkillpg\b|"
    r"\bsetsid\b|setpgid|\bos\.fork\b|daemon",
    "builtins": r"\bbuiltins\b|__builtins__|__import__",
    # a trace's events can be forged from inside a rank; the grader's byte count catches sends
    # that never happened, these show where the data may have moved instead
    "the tracer's internals, or a channel besides torch.distributed": r"\b_REC\b|_RUN_OBSERVERS|\btrace\._|"
    r"\b(begin|end|set)_recording\b|\bnotify_observers\b|\bemulation\.|"
    r"\bsocket\b|shared_memory|\bmultiprocessing\b|\bos\.pipe\b|\bzmq\b",
}


def scan_submission(path: Path) -> list[str]:
    """Flags for a human: the student-editable cells of a submitted notebook that use a
    grader-hostile construct (one line per construct: the kind, the cell, the text).
    Flagging never changes a score."""
    try:  # the file itself, never through a link (intake.py)
        nb = nbformat.reads(intake.read_notebook(Path(path)).decode("utf-8", errors="replace"), as_version=4)
    except intake.Refused:
        return []  # graded as the blank lab; the report says why
    except Exception as exc:
        return [f"could not be read for the scan ({type(exc).__name__})"]
    flags = []
    for index, cell in enumerate(nb.cells):
        nbg = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type != "code" or (nbg.get("locked") and not nbg.get("solution")):
            continue  # locked cells are restored from the gradebook anyway
        for kind, pattern in HOSTILE_CONSTRUCTS.items():
            found = sorted({m.group(0) for m in re.finditer(pattern, cell.source)})
            if found:
                where = nbg.get("grade_id") or f"cell {index}"
                flags.append(f"{kind} in {where}: {', '.join(found)[:120]}")
    return flags


def grade_report(lab: str, students: list[str], results: dict, course: Path, isolation: str | None) -> Path:
    """<course>/reports/<lab>.txt: how each student was graded and what a human should look
    at (grading failures, what the grader noted: a test it could not grade or whose copy it did
    not run, hostile constructs)."""
    lines = [
        f"Grade report for {lab}",
        "isolation: "
        + (
            "every kernel sandboxed (see grader/README.md, 'Threat model')"
            if isolation is None
            else isolation_report(isolation)
        )
        + (f"\nisolation LIMITED: {sandbox.caveat()}" if isolation is None and sandbox.caveat() else ""),
        "",
    ]
    for student in students:
        result = results.get(student)
        status = (
            "ok"
            if result and result.returncode == 0
            else ("STOPPED (time cap)" if result and result.timed_out else "FAILED")
        )
        notes_path = course / "autograded" / student / lab / NOTES_FILE
        try:
            notes = json.loads(notes_path.read_text()).get("notes", [])
        except (OSError, ValueError):
            notes = []
        notebook = course / "submitted" / student / lab / f"{lab}.ipynb"
        flags = scan_submission(notebook)
        try:
            intake.read_notebook(notebook)
            refused = []
        except (intake.Refused, OSError) as problem:
            refused = [f"  notebook: {problem}; graded as the blank lab"]
        extra = [f"  not taken (never copied or read): {line}" for line in intake.extras(notebook)]
        look = notes or flags or refused or extra
        # (what a student lost is the class summary's and exports/<lab>/'s, not this report's)
        lines.append(f"{student}: grading {status}" + ("" if look else ", nothing flagged"))
        lines += [f"  grader: {n}" for n in notes] + [f"  flag: {f}" for f in flags] + refused + extra
    path = course / "reports" / f"{lab}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


class StampInstallSource(NbGraderPreprocessor):
    """Release step: write where the kit installs from into each lab's setup cell (the line
    ``DISTTRAIN_LAB_PIP = "..."``), so a fresh kernel (Colab) can install it.

    Where the source says the labs are published on GitHub (``wheel:https://raw.githubusercontent.com/...``),
    the lab's first markdown cell also begins with an "Open in Colab" badge linking to the lab itself
    (:func:`~disttrain_lab.grading.install_source.colab_url`).

    Set it once in grader/nbgrader_config.py, e.g. ``c.StampInstallSource.pip_requirement =
    "wheel:https://raw.githubusercontent.com/ORG/REPO/main/labs/wheels"``; the choices and
    what each stamps are in :mod:`disttrain_lab.grading.install_source`.  ``$DISTTRAIN_LAB_INSTALL_SOURCE``
    (set by ``disttrain-lab release --install-source``) wins over the file.
    """

    pip_requirement = Unicode(
        "",
        help="where a lab's setup cell installs the kit from: 'wheel', "
        "'wheel:<URL of labs/wheels>', 'git+<URL>' or a wheel's URL",
    ).tag(config=True)

    _LINE = re.compile(r'^DISTTRAIN_LAB_PIP = "[^"\n]*"', re.MULTILINE)

    def preprocess(self, nb, resources):
        source = os.environ.get(ENV_VAR) or self.pip_requirement
        self._stamp = stamped_requirement(source)
        lab = resources.get("nbgrader", {}).get("notebook") or resources.get("metadata", {}).get("name", "")
        url = colab_url(source, lab)
        title = next((c for c in nb.cells if c.cell_type == "markdown"), None)
        # the lab's own badge, where its address is known (released again: replaced, or removed)
        if title is not None and (url or BADGE_START in title.source):
            body = "\n".join(line for line in title.source.split("\n") if not line.startswith(BADGE_START)).lstrip("\n")
            title.source = f"{colab_badge(url)}\n\n{body}" if url else body
        return super().preprocess(nb, resources)

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "code" and self._LINE.search(cell.source):
            requirement = self._stamp.replace('"', '\\"')
            cell.source = self._LINE.sub(lambda _: f'DISTTRAIN_LAB_PIP = "{requirement}"', cell.source)
        return cell, resources
