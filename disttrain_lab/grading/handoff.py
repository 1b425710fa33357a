"""What the grading step (``RobustExecute``, in nbgrader's process) hands the grader kernel
(``remote.RemoteRunner``) through files in the grader's folder: where the student's kernel is,
which test cell runs and until when.  Standard library only: nbgrader's process writes these and
imports neither torch nor the kit's runner (each of a class's steps would pay for torch's import).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CELL_FILE = "cell.json"  # the test cell being graded: its grade_id, deadline, the student's function names
TIMED_OUT_FILE = "timed-out.json"  # the student's functions that timed out, and where (kept across kernels)


def write_settings(path: Path, *, connection_file: str, kernel_pid: int | None, host_dir: str, kernel_dir: str) -> None:
    """Tell the grader kernel where the student's kernel is (RobustExecute, at each start)."""
    tmp = path.with_suffix(".partial")
    tmp.write_text(
        json.dumps(
            {
                "connection_file": connection_file,
                "kernel_pid": kernel_pid,
                "host_dir": host_dir,
                "kernel_dir": kernel_dir,
            }
        )
    )
    os.replace(tmp, path)


def write_cell(folder: Path, grade_id: str, deadline: float, student_functions: list[str]) -> None:
    """Tell the grader kernel which test cell it is running and when its limit ends
    (``time.monotonic()``, one clock for every process of the host), and the names of the
    functions the student's solution cells define (RobustExecute, before each graded cell)."""
    tmp = folder / (CELL_FILE + ".partial")
    tmp.write_text(json.dumps({"grade_id": grade_id, "deadline": deadline, "student_functions": student_functions}))
    os.replace(tmp, folder / CELL_FILE)


def read_json(path: Path) -> dict:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
