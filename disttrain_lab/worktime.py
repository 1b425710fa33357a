"""Time on task, recorded where the student works: the first time each cell of a lab ran, and the
first time it ran without an error, by the cell's id, in ``disttrain-times.json`` beside the notebook.

nbgrader collects the lab's folder, so the file reaches the instructor with the notebook, and the
class report (``grading/time_on_task.py``) turns it into time on task per exercise: from the first
run of any of the exercise's cells to the first passing run of its self-check.  A lab's claims of
hours can then come from a class, not a guess.

JupyterLab and Jupyter Notebook 7 send each cell's id with its run; where a front end does not
(Colab, a script), nothing is recorded.  Only cell ids and two times per cell are written, never
code or output.  What the student's kernel writes is the student's to edit: the report shows it for
planning a course and grades nothing.  Off under autograding (``NBGRADER_EXECUTION``) and with
``DISTTRAIN_NO_TIMES=1``; a folder that cannot be written turns it off quietly.

    dl.worktime.install()     # what `import disttrain_lab` does in a notebook's kernel
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

__all__ = ["FILE", "MAX_CELLS", "install", "read"]

FILE = "disttrain-times.json"  # beside the notebook (the kernel's working folder)
MAX_CELLS = 2000  # cells recorded at most (a lab has about 60)
MAX_BYTES = 1 << 20  # a file larger than this is not read


def read(path: Path) -> dict[str, dict[str, float]]:
    """The record in ``path`` as {cell id: {"first_run": t, "first_ok": t}} (seconds since the epoch),
    keeping only well-formed entries: the file is the student's, so anything else in it is dropped."""
    try:
        if path.stat().st_size > MAX_BYTES:
            return {}
        found = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    cells = found.get("cells") if isinstance(found, dict) else None
    if not isinstance(cells, dict):
        return {}
    kept: dict[str, dict[str, float]] = {}
    for cell_id, times in list(cells.items())[:MAX_CELLS]:
        if not (isinstance(cell_id, str) and 0 < len(cell_id) <= 64 and isinstance(times, dict)):
            continue
        good = {
            k: float(v)
            for k, v in times.items()
            if k in ("first_run", "first_ok") and type(v) in (int, float) and math.isfinite(v) and v > 0
        }
        if good:
            kept[cell_id] = good
    return kept


class _Recorder:
    """The kernel's hooks: note a cell's first run (``pre_run_cell``) and first success (``post_run_cell``)."""

    def __init__(self, path: Path):
        self.path = path
        self.cells = read(path)
        self.on = True

    def pre_run_cell(self, info) -> None:
        cell_id = getattr(info, "cell_id", None)
        if self.on and cell_id and cell_id not in self.cells and len(self.cells) < MAX_CELLS:
            self.cells[cell_id] = {"first_run": time.time()}
            self._write()

    def post_run_cell(self, result) -> None:
        cell_id = getattr(getattr(result, "info", None), "cell_id", None)
        if not (self.on and cell_id):
            return
        if cell_id not in self.cells and len(self.cells) < MAX_CELLS:  # the cell that installed the hooks
            self.cells[cell_id] = {"first_run": time.time()}
            self._write()
        times = self.cells.get(cell_id)
        if times is not None and "first_ok" not in times and result.success:
            times["first_ok"] = time.time()
            self._write()

    def _write(self) -> None:
        partial = self.path.with_name(self.path.name + ".partial")
        try:
            partial.write_text(json.dumps({"version": 1, "cells": self.cells}))
            os.replace(partial, self.path)
        except OSError:  # a folder the student cannot write: record nothing more
            self.on = False


def install(folder: Path | None = None) -> bool:
    """Record time on task in this notebook's kernel (``folder``: where the file goes, the kernel's
    working folder by default).  False where there is no notebook kernel, under autograding, or with
    ``DISTTRAIN_NO_TIMES=1``."""
    if os.environ.get("NBGRADER_EXECUTION") or os.environ.get("DISTTRAIN_NO_TIMES") == "1":
        return False
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if getattr(shell, "kernel", None) is None or getattr(shell, "_disttrain_worktime", None) is not None:
        return False
    recorder = _Recorder(Path(folder or os.getcwd()) / FILE)
    shell.events.register("pre_run_cell", recorder.pre_run_cell)
    shell.events.register("post_run_cell", recorder.post_run_cell)
    shell._disttrain_worktime = recorder
    return True
