"""Per-cell time limits for grading, derived from the solution's own cell times.

A fixed limit per cell (180 s) makes a spinning submission expensive: every graded cell
that calls the spinning function waits the whole limit.  Instead, ``disttrain-lab release
--time-cells`` grades the solution once and records how long each of its cells took, in
``grader/cell_times/<lab>.json``; the grader then gives each cell

    limit = max(FLOOR, FACTOR * solution's seconds) * scale

(``scale``: ``DISTTRAIN_CELL_TIME_SCALE`` / ``Limits.cell_time_scale``, e.g. 2 on a grading
machine twice as slow as the one that recorded them).  A cell is known by its nbgrader
``grade_id``, or by its source for a cell without one (text the student did not edit); a
cell the record does not know (one the student added, a lab never timed) keeps the plain
cell limit.  (Grading the solution to time it is a course step: ``course.measure_cell_times``.)
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

from .config import GRADER_DIR

FACTOR = 5.0  # a loaded or slower grading machine, a slower but correct submission
FLOOR = 30.0  # seconds: a cold kernel importing torch or starting ranks on a loaded 2-core machine
ENV_VAR = "DISTTRAIN_CELL_TIMES_DIR"  # where the records live, instead of grader/cell_times/


def times_dir() -> Path:
    """Where the records live: ``$DISTTRAIN_CELL_TIMES_DIR``, else grader/cell_times/."""
    return Path(os.environ.get(ENV_VAR, "") or GRADER_DIR / "cell_times")


def cell_key(cell) -> str:
    grade_id = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
    return grade_id or "source:" + hashlib.sha1(cell.get("source", "").encode()).hexdigest()[:16]


def recorded(lab: str) -> dict[str, float]:
    """The solution's seconds per cell key, or {} when the lab was never timed."""
    try:
        return {k: float(v) for k, v in json.loads((times_dir() / f"{lab}.json").read_text())["cells"].items()}
    except (OSError, ValueError, KeyError):
        return {}


def limits_for(lab: str, scale: float = 1.0) -> dict[str, int]:
    """Seconds allowed per cell key when grading ``lab``."""
    return {key: int(max(FLOOR, FACTOR * seconds) * scale + 0.5) for key, seconds in recorded(lab).items()}


def record(lab: str, seconds: dict[str, float]) -> Path:
    """Write the solution's cell times of ``lab`` (from the grader's notes of a graded solution)."""
    path = times_dir() / f"{lab}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "lab": lab,
                "machine": f"{os.cpu_count()} cores, {platform.machine()}",
                "cells": {k: round(v, 2) for k, v in sorted(seconds.items())},
            },
            indent=1,
        )
        + "\n"
    )
    return path
