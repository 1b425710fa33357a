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
cell limit.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

FACTOR = 5.0     # a loaded or slower grading machine, a slower but correct submission
FLOOR = 30.0     # seconds: a cold kernel importing torch or starting ranks on a loaded 2-core machine

REPO_ROOT = Path(__file__).resolve().parent.parent


def times_dir() -> Path:
    """Where the records live: ``$DISTTRAIN_CELL_TIMES_DIR``, else grader/cell_times/."""
    return Path(os.environ.get("DISTTRAIN_CELL_TIMES_DIR", "") or REPO_ROOT / "grader" / "cell_times")


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
    path.write_text(json.dumps({"lab": lab, "machine": f"{os.cpu_count()} cores, {platform.machine()}",
                                "cells": {k: round(v, 2) for k, v in sorted(seconds.items())}}, indent=1) + "\n")
    return path


def measure(lab: str, *, source: Path | None = None, tmp_root: str | None = None) -> dict[str, float]:
    """Grade the solution of ``lab`` once, in a scratch course, under the plain cell limit, and
    return its seconds per cell key (as RobustExecute measured them)."""
    import tempfile
    from . import grading
    source = Path(source or grading.source_dir())
    with tempfile.TemporaryDirectory(prefix="disttrain-cell-times-", dir=tmp_root) as scratch:
        scratch = Path(scratch)
        course, release, empty = scratch / "course", scratch / "release", scratch / "no-times"
        empty.mkdir()
        folder = course / "submitted" / "solution" / lab
        folder.mkdir(parents=True)
        (folder / f"{lab}.ipynb").write_bytes((source / lab / f"{lab}.ipynb").read_bytes())
        saved = os.environ.get("DISTTRAIN_CELL_TIMES_DIR")
        os.environ["DISTTRAIN_CELL_TIMES_DIR"] = str(empty)       # time it under the plain limit
        try:
            grading.release([lab], course=course, source=source, release_to=release, tmp_root=tmp_root)
            result = grading.autograde(lab, ["solution"], course=course, source=source, release_from=release,
                                       tmp_root=tmp_root, log=lambda *a: None)["solution"]
        finally:
            if saved is None:
                os.environ.pop("DISTTRAIN_CELL_TIMES_DIR")
            else:
                os.environ["DISTTRAIN_CELL_TIMES_DIR"] = saved
        if result.returncode != 0:
            raise RuntimeError(f"grading the solution of {lab} failed:\n{result.output[-3000:]}")
        notes = json.loads((course / "autograded" / "solution" / lab / grading.NOTES_FILE).read_text())
        return notes["cell_seconds"]
