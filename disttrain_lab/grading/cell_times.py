"""Per-cell time limits for grading, derived from the solution's own cell times.

A fixed limit per cell (180 s) makes a spinning submission expensive: every graded cell
that calls the spinning function waits the whole limit.  Instead, ``disttrain-lab release
--time-cells`` grades the solution once and records how long each of its cells took, in
``grader/cell_times/<lab>.json``; the grader then gives each cell

    limit = max(FLOOR, FACTOR * solution's seconds) * scale * host

(``scale``: ``DISTTRAIN_CELL_TIME_SCALE`` / ``Limits.cell_time_scale``, an instructor's
margin; ``host``: how much slower this grading host runs a fixed piece of work, ``probe()``,
than the machine that recorded the times ran it -- the record keeps that machine's probe --
at least 1, at most ``HOST_MAX``, measured by the grader, never by student code, as each
student's grading starts: a host twice as slow gives twice the time, so an honest
submission does not fail on the grading host's speed.  The probe is short, and the kernel
gives a short burst a core quickly: it follows the host's speed more than its load -- it
read 0.07 to 0.14 s on this project's 2-core machine at loads of 7 to 14; a host busy with
other work still needs ``DISTTRAIN_CELL_TIME_SCALE`` or fewer parallel jobs).  A cell is known by its nbgrader
``grade_id``, or by its source for a cell without one (text the student did not edit); a
cell the record does not know (one the student added, a lab never timed) gets the plain
cell limit, stretched by the same host factor (a lab never timed against ``REFERENCE_PROBE``).
(Grading the solution to time it is a course step: ``course.measure_cell_times``.)
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

from .config import GRADER_DIR

FACTOR = 5.0  # a loaded or slower grading machine, a slower but correct submission
FLOOR = 30.0  # seconds: a cold kernel importing torch or starting ranks on a loaded 2-core machine
ENV_VAR = "DISTTRAIN_CELL_TIMES_DIR"  # where the records live, instead of grader/cell_times/
HOST_MAX = 4.0  # the most a slow or loaded host stretches the limits (what a spinner can cost)
PROBE_N = 1_000_000  # the probe's work: about 0.1 s of pure Python on a 2-core laptop
# the probe where the kit's own records were made (0.08-0.11 s): what a lab never timed, or a
# record from before the probe, is stretched against
REFERENCE_PROBE = 0.1


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
    """Seconds allowed per cell key when grading ``lab`` (``scale``: an instructor's margin
    times ``host_factor``)."""
    return {key: int(max(FLOOR, FACTOR * seconds) * scale + 0.5) for key, seconds in recorded(lab).items()}


def probe() -> float:
    """Seconds this process takes for a fixed piece of pure-Python work (the median of three):
    the host's single-core speed."""
    runs = []
    for _ in range(3):
        start, total = time.perf_counter(), 0
        for i in range(PROBE_N):
            total += i * i
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def host_factor(lab: str, now: float) -> tuple[float, str]:
    """(how much to stretch ``lab``'s limits on this host: ``now``, its ``probe()``, against the
    one its record kept, between 1 and ``HOST_MAX``; the figures, for the grader's notes).  A
    lab never timed, or a record without a probe, is measured against ``REFERENCE_PROBE``: its
    plain cell limit stretches the same way (a loaded host took 50 s to import torch in a cell
    a quiet one runs in 13)."""
    try:
        then = float(json.loads((times_dir() / f"{lab}.json").read_text())["probe"])
        where = "where the times were recorded"
    except (OSError, ValueError, KeyError, TypeError):
        then, where = REFERENCE_PROBE, "on the kit's reference machine (no probe recorded for this lab)"
    factor = min(HOST_MAX, max(1.0, now / then)) if then > 0 else 1.0
    return factor, f"probe {now:.3f} s here, {then:.3f} s {where}"


def record(lab: str, seconds: dict[str, float], probe_seconds: float) -> Path:
    """Write the solution's cell times of ``lab`` and the grader's probe as that grading started
    (from the grader's notes of a graded solution)."""
    path = times_dir() / f"{lab}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "lab": lab,
                "machine": f"{os.cpu_count()} cores, {platform.machine()}",
                "probe": round(probe_seconds, 4),  # (host_factor: this machine's speed then)
                "cells": {k: round(v, 2) for k, v in sorted(seconds.items())},
            },
            indent=1,
        )
        + "\n"
    )
    return path
