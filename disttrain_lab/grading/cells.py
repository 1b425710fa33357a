"""What a notebook cell is to the grader, read from its nbgrader metadata and its source: a
graded test cell, a locked cell of the instructor's, the ``grade_id`` it is known by, the
names it uses and binds, the exercise it grades (named by the lab's heading); and the error
outputs the grader writes into a cell."""

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


def is_graded(cell) -> bool:
    """A cell worth points: a test, or an answer graded by hand."""
    nbg = nbgrader_metadata(cell)
    return bool(nbg.get("grade")) and float(nbg.get("points") or 0) > 0


_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")


def headings(markdown: str) -> list[str]:
    """A markdown cell's headings, in order, as read (no backticks or bold; not a ``# comment``
    in a fenced code block)."""
    found, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (m := _HEADING.match(line)):
            found.append(" ".join(m.group(1).replace("`", "").replace("**", "").split()))
    return found


def exercise_names(nb) -> dict[str, str]:
    """{grade_id of every graded cell: the name of the exercise it grades}, in the lab's order.

    A test grades a solution cell: the one named like it (``ex_X`` for ``test_X``), else the
    nearest above it that binds a name the test uses (a function, a prediction's ``PREDICTED_...``;
    names the lab's own cells bind do not count).  The exercise's name is the last heading above
    that cell (``Exercise 1: ping_pong(x, repeats)``); a graded answer is its own exercise.  No
    solution found: the heading above the test; no heading at all: the grade_id.
    """
    heading, above = None, []  # the heading in force at each cell
    for cell in nb.cells:
        found = headings(cell.source) if cell.cell_type == "markdown" else []
        heading = found[-1] if found else heading
        above.append(heading)
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    solutions = [(i, c) for i, c in code if nbgrader_metadata(c).get("solution")]
    lab_names = {n for _, c in code if not nbgrader_metadata(c).get("solution") for n in names_bound(c.source)}
    names = {}
    for i, cell in code:
        if not is_graded(cell):
            continue
        gid, where = grade_id(cell), i
        if is_test_cell(cell):
            used = set(names_used(cell.source))
            named = [j for j, s in solutions if gid.startswith("test_") and grade_id(s) == "ex_" + gid[5:]]
            binding = [j for j, s in solutions if j < i and (set(names_bound(s.source)) - lab_names) & used]
            where = (named or binding[-1:] or [None])[0]
        names[gid] = (above[where] if where is not None else None) or above[i] or gid
    return names


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
