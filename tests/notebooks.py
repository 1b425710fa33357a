"""Running lab notebooks in tests: execute in a real kernel, blank them as nbgrader releases them."""
from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent


def nbgrader_meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def cell_by_id(nb, grade_id: str):
    [cell] = [c for c in nb.cells if nbgrader_meta(c).get("grade_id") == grade_id]
    return cell


def execute(nb, autograding: bool, timeout: int = 240, cwd: Path | None = None) -> tuple[nbformat.NotebookNode, float]:
    """Execute a copy of nb in a fresh kernel, errors kept in the outputs; return it and the seconds taken."""
    nb = copy.deepcopy(nb)
    env = {k: v for k, v in os.environ.items() if k != "NBGRADER_EXECUTION"}
    if autograding:
        env["NBGRADER_EXECUTION"] = "autograde"
    env["PATH"] = f"{REPO / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(cwd or REPO)}})
    start = time.perf_counter()
    client.execute(env=env)
    return nb, time.perf_counter() - start


def errors(cell) -> list[str]:
    return [f"{o.ename}: {o.evalue}" for o in cell.get("outputs", []) if o.output_type == "error"]


def text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")


def graded_cells(nb) -> list:
    return [c for c in nb.cells if nbgrader_meta(c).get("grade")]


def blank(nb) -> nbformat.NotebookNode:
    """The student's version: what nbgrader's ClearSolutions makes of the solution cells."""
    from nbgrader.preprocessors import ClearSolutions
    nb, _ = ClearSolutions().preprocess(copy.deepcopy(nb), {"metadata": {"path": str(REPO)}})
    return nb
