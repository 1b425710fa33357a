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
5. ``config``: where a course lives, and the ``Limits``.  ``configure`` (below) is the wiring
   that ``grader/nbgrader_config.py`` applies, so plain ``nbgrader autograde`` run from
   ``grader/`` behaves exactly like ``disttrain-lab grade``.
"""

from __future__ import annotations

import os
import sys

from .startup import skip_slow_imports

skip_slow_imports()  # before nbconvert imports jsonschema (startup.py)
# isort: split
from nbconvert.preprocessors import ClearMetadataPreprocessor
from nbgrader.converters import GenerateAssignment, GenerateFeedback
from nbgrader.preprocessors import (
    AssignLatePenalties,
    CheckCellMetadata,
    ClearOutput,
    DeduplicateIds,
    IgnorePattern,
    LimitOutput,
    OverwriteKernelspec,
    SaveAutoGrades,
)

from . import sandbox
from .config import (
    GRADER_DIR,
    LIMITED_ISOLATION,
    REPO_ROOT,
    Limits,
    SandboxRefused,
    course_dir,
    isolation_notice,
    release_dir,
    release_ignore,
    source_dir,
)
from .course import autograde, cli_release, export_grades, generate_feedback, scores, students_of
from .execute import NOTES_FILE, RobustExecute
from .feedback_page import FeedbackPage, configure_exporter
from .hidden_tests import ScrubHiddenTests
from .install_source import configured_install_source
from .releasing import list_labs, normalize_release, release, release_differences
from .sanitize import SanitizeStudentHTML
from .steps import StepResult, clean_stale_steps, run_nbgrader, stop_running_steps
from .submission import (
    FeedbackWithoutHiddenTests,
    RestoringOverwriteCells,
    StampInstallSource,
    SubmissionExporter,
    grade_report,
    scan_submission,
)
from .verdict import ScoreByPassing

__all__ = [
    "GRADER_DIR",
    "REPO_ROOT",
    "Limits",
    "SandboxRefused",
    "configure",
    "configured_install_source",
    "course_dir",
    "release_dir",
    "release_ignore",
    "source_dir",
    "autograde",
    "cli_release",
    "export_grades",
    "generate_feedback",
    "list_labs",
    "normalize_release",
    "release",
    "release_differences",
    "scores",
    "students_of",
    "NOTES_FILE",
    "RobustExecute",
    "StepResult",
    "clean_stale_steps",
    "run_nbgrader",
    "stop_running_steps",
    "FeedbackPage",
    "FeedbackWithoutHiddenTests",
    "RestoringOverwriteCells",
    "SanitizeStudentHTML",
    "ScrubHiddenTests",
    "StampInstallSource",
    "SubmissionExporter",
    "grade_report",
    "scan_submission",
    "ScoreByPassing",
]


def configure(c, limits: Limits | None = None) -> None:
    """Apply the whole grading setup to an nbgrader config object ``c``."""
    limits = limits or Limits()
    course_dir().mkdir(parents=True, exist_ok=True)
    c.CourseDirectory.root = str(course_dir())
    # parallel students write to one gradebook: wait for another job's write (sqlite's default is 5 s)
    c.CourseDirectory.db_url = f"sqlite:///{course_dir() / 'gradebook.db'}?timeout=300"
    c.CourseDirectory.source_directory = str(source_dir())
    c.CourseDirectory.release_directory = str(release_dir())
    c.CourseDirectory.ignore = release_ignore(source_dir())
    c.Execute.timeout = limits.cell_timeout
    c.Execute.startup_timeout = 120
    c.RobustExecute.notebook_timeout = limits.notebook_timeout
    c.RobustExecute.cell_time_scale = limits.cell_time_scale
    c.RobustExecute.memory_limit = limits.kernel_memory
    use_sandbox, why = limits.sandboxed()
    if not use_sandbox and not os.environ.get("DISTTRAIN_SANDBOX_WARNED"):
        print(isolation_notice(why), file=sys.stderr)
    elif use_sandbox and sandbox.caveat() and not os.environ.get("DISTTRAIN_SANDBOX_WARNED"):
        print(LIMITED_ISOLATION.format(why=sandbox.caveat()), file=sys.stderr)
    c.RobustExecute.sandbox = "on" if use_sandbox else ("container" if limits.sandbox == "container" else "off")
    c.RobustExecute.student_memory = limits.student_memory
    c.RobustExecute.student_pids = limits.student_pids
    c.LimitOutput.max_lines = 300
    c.LimitOutput.max_traceback = 60
    c.OverwriteCells.add_missing_cells = True
    c.Autograde.exporter_class = "disttrain_lab.grading.submission.SubmissionExporter"
    # stamp the install source before the setup cell is locked and checksummed
    steps = list(GenerateAssignment().preprocessors)
    c.GenerateAssignment.preprocessors = [StampInstallSource] + [p for p in steps if p is not StampInstallSource]
    c.Autograde.sanitize_preprocessors = [
        ClearOutput,
        DeduplicateIds,
        OverwriteKernelspec,
        RestoringOverwriteCells,
        CheckCellMetadata,
    ]
    c.GenerateFeedback.preprocessors = [
        FeedbackWithoutHiddenTests,
        *GenerateFeedback().preprocessors,
        FeedbackPage,  # the index by exercise, MathJax inlined, a prediction's answer withheld till the deadline
        SanitizeStudentHTML,  # last: the page a student opens runs nothing a submission wrote
    ]
    configure_exporter(c)  # the page through templates/disttrain_feedback (feedback_page.py)
    c.Autograde.autograde_preprocessors = [
        RobustExecute,
        ScoreByPassing,  # a test scores by passing, never by an execute_result (verdict.py)
        IgnorePattern,
        ClearMetadataPreprocessor,
        LimitOutput,
        SaveAutoGrades,
        ScrubHiddenTests,  # after the grades are saved: scrubbing never changes a score
        SanitizeStudentHTML,  # likewise: the formgrader shows this notebook in the instructor's browser
        AssignLatePenalties,
        CheckCellMetadata,
    ]
