"""The grading wing: what only an instructor's machine runs.  Autograding that no submission
can break: release, autograde, feedback, grades.

The student kit (the modules at the top of ``disttrain_lab``) never imports this package;
this package uses the kit.  nbgrader does the bookkeeping (gradebook, checksums, hidden
tests, feedback); this package adds what a course on distributed training needs on top of it:

1. ``execute.RobustExecute`` runs the notebook like nbgrader's ``Execute`` but survives the
   kernel dying (``os._exit``, a crash, out of memory) and cells that ignore the
   interrupt: it marks the cell with a message, restarts the kernel, replays the earlier
   cells to restore their definitions and carries on.  It also enforces a per-notebook
   wall-clock budget, a per-process memory limit in the kernel (and the ranks it starts),
   and caps huge output while it arrives.  Every graded test cell runs, as the lab's release
   has it, in the grader kernel (``grader_kernel.py``), which holds no student code and
   reaches the student's functions only through ``dl.exercise.run`` (``remote.py``): data
   comes back, never code; a test the grader has no release copy of scores 0, saying why.
   Where the host allows it, each student's kernel runs in a sandbox (``sandbox.py``, which
   starts ``run_sandbox.py``: another user, private /tmp and /dev/shm, hidden grader files,
   cgroup caps, one pid namespace killed as a unit; the kernel itself: ``kernels.py``).
   ``cells.py`` says which cells are tests; ``cell_times.py`` gives each cell a time limit
   from the solution's own time.
2. ``intake`` takes from a submission folder only the notebook (a regular file, never
   through a symbolic link) and stages it for nbgrader; the rest is listed, never copied.
   ``submission.SubmissionExporter`` pre-checks each submission (a link, empty file,
   malformed JSON, a notebook of another lab, metadata nbgrader chokes on) and grades such a
   file as the blank lab with a note at the top, so the feedback says why it scored 0.
   ``submission.RestoringOverwriteCells`` takes test cells whole from the release and the
   gradebook (deleted ones too); ``verdict.ScoreByPassing`` lets a test score only by
   passing; ``submission.FeedbackWithoutHiddenTests`` shows failing messages, not test code,
   and ``hidden_tests`` keeps hidden tests out of every output;
   ``feedback_page`` makes the page a student reads: the index by exercise, wrapped messages,
   formulas typeset offline, a prediction's expected value withheld until the deadline;
   ``sanitize.SanitizeStudentHTML`` makes what the student wrote inert (outputs, markdown, HTML)
   in the autograded notebook the formgrader shows and in the feedback page;
   ``scan_submission`` and ``grade_report`` flag what a human should look at.
3. ``steps.run_nbgrader`` runs one nbgrader step in its own process under a wall-clock cap,
   in a private temp directory, and every process it started is gone afterwards, and every
   folder: ``trees.remove`` takes away what a student's kernel wrote into them, whatever it is,
   without raising.
4. ``releasing``: ``release`` (where it goes, made the same each time, never over a student's work);
   ``course``: ``autograde`` / ``generate_feedback`` / ``export_grades`` /
   ``scores`` and ``disttrain-lab release``; ``classgrade``: ``disttrain-lab grade`` (a class
   in parallel, resumable by ``ledger``, in ``shards``, summed up by ``class_summary``).
   ``install_source``: where a lab's setup cell installs the kit from, and the wheel beside
   the labs.
5. ``config``: where a course lives, and the ``Limits``.  ``wiring.configure`` is the wiring
   that ``grader/nbgrader_config.py`` applies, so plain ``nbgrader autograde`` run from
   ``grader/`` behaves exactly like ``disttrain-lab grade``.

The names below are loaded from their modules when first used (PEP 562), so a process that
needs one piece imports that piece only: the grader kernel, which imports ``remote`` for every
student, does not import nbconvert and nbgrader, which only the nbgrader process of a step needs
(the grader kernel's CPU per fixture student: 6.2 s -> 4.7 s on the 2-core course machine).
"""

from __future__ import annotations

import importlib
import importlib.util

from .startup import skip_slow_imports

skip_slow_imports()  # before anything imports nbconvert, which imports jsonschema (startup.py)

# each public name and the module that defines it
_HOME = {
    "GRADER_DIR": "config",
    "REPO_ROOT": "config",
    "Limits": "config",
    "SandboxRefused": "config",
    "course_dir": "config",
    "release_dir": "config",
    "release_ignore": "config",
    "source_dir": "config",
    "configure": "wiring",
    "configured_install_source": "install_source",
    "autograde": "course",
    "cli_release": "course",
    "export_grades": "course",
    "generate_feedback": "course",
    "scores": "course",
    "students_of": "course",
    "list_labs": "releasing",
    "normalize_release": "releasing",
    "release": "releasing",
    "release_differences": "releasing",
    "NOTES_FILE": "execute",
    "RobustExecute": "execute",
    "StepResult": "steps",
    "clean_stale_steps": "steps",
    "run_nbgrader": "steps",
    "stop_running_steps": "steps",
    "FeedbackPage": "feedback_page",
    "FeedbackWithoutHiddenTests": "submission",
    "RestoringOverwriteCells": "submission",
    "SanitizeStudentHTML": "sanitize",
    "ScrubHiddenTests": "hidden_tests",
    "StampInstallSource": "submission",
    "SubmissionExporter": "submission",
    "grade_report": "submission",
    "scan_submission": "submission",
    "ScoreByPassing": "verdict",
}
__all__ = list(_HOME)


def __getattr__(name: str):
    """``grading.NAME``: the public name from its module, or the submodule ``NAME``."""
    if name in _HOME:
        value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
        globals()[name] = value  # once loaded, a plain attribute
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
