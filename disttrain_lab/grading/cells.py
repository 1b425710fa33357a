"""What a notebook cell is to the grader, read from its nbgrader metadata and its source: a
graded test cell, a locked cell of the instructor's, the ``grade_id`` it is known by, the
names it uses and binds; and the error outputs the grader writes into a cell."""

from __future__ import annotations

import ast
import re

import nbformat


def nbgrader_metadata(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def grade_id(cell) -> str:
    """The cell's nbgrader ``grade_id``, or "?" (for messages and notes)."""
    return nbgrader_metadata(cell).get("grade_id", "?")


def is_test_cell(cell) -> bool:
    """A graded cell the student does not write: the tests (autograder tests, hidden or not)."""
    nbg = nbgrader_metadata(cell)
    return bool(nbg.get("grade")) and not nbg.get("solution")


def is_instructor_cell(cell) -> bool:
    """A locked cell that is neither graded nor a solution (a lab's setup cell)."""
    # nbgrader restores their source from the gradebook, so the names they bind are the lab's own
    nbg = nbgrader_metadata(cell)
    return bool(nbg.get("locked")) and not nbg.get("grade") and not nbg.get("solution")


def names_used(source: str) -> list[str]:
    return sorted(set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", source)))


def names_bound(source: str) -> list[str]:
    """Top-level names a cell binds (imports, defs, classes, plain assignments)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    names = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names += [(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names += [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
    return names


def student_functions(nb) -> list[str]:
    """The functions the submission's solution cells define (a hang is blamed on one of these)."""
    names = set()
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.get("metadata", {}).get("nbgrader", {}).get("solution"):
            try:
                tree = ast.parse(cell.source)
            except SyntaxError:
                continue
            names.update(n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return sorted(names)


def error_output(ename: str, message: str) -> nbformat.NotebookNode:
    # an error output is what makes nbgrader give a graded cell 0 points
    return nbformat.v4.new_output(
        "error", ename=ename, evalue=message, traceback=[f"\x1b[0;31m{ename}\x1b[0m: {message}"]
    )


def clamp_partial_credit(cell) -> None:
    """nbgrader reads a number a test cell returns as partial credit and fails the whole
    notebook when it exceeds the cell's points: keep it within [0, points]."""
    points = float(cell.metadata.nbgrader.get("points", 0))
    for output in cell.outputs:
        if output.output_type == "execute_result":
            try:
                value = float(output.get("data", {}).get("text/plain", ""))
            except (TypeError, ValueError):
                return
            if not 0 <= value <= points:
                output.data["text/plain"] = repr(min(max(value, 0.0), points))
            return
