"""``configure``: the whole grading setup applied to an nbgrader config object, which
``grader/nbgrader_config.py`` calls, so that a plain ``nbgrader autograde`` run from ``grader/``
behaves exactly like ``disttrain-lab grade``: the course's folders, the time and memory
limits, the sandbox, and this package's steps in nbgrader's pipelines (release, autograde,
feedback).  Only the nbgrader process of a step imports it (it imports nbconvert and nbgrader)."""

from __future__ import annotations

import os
import sys

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
from .config import LIMITED_ISOLATION, Limits, course_dir, isolation_notice, release_dir, release_ignore, source_dir
from .execute import RobustExecute
from .feedback_page import FeedbackPage, configure_exporter
from .hidden_tests import ScrubHiddenTests
from .sanitize import SanitizeStudentHTML
from .submission import FeedbackWithoutHiddenTests, RestoringOverwriteCells, StampInstallSource
from .verdict import ScoreByPassing


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
