"""What a notebook cell is to the grader, read from its nbgrader metadata: a graded test cell,
a locked cell of the instructor's, and the ``grade_id`` it is known by."""

from __future__ import annotations


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
