"""How a graded test cell scores: by running to the end without an error, never by what it
shows.

nbgrader's rule (``nbgrader.utils.determine_grade``) reads a test cell's first
``execute_result`` as partial credit: a number is that many points, and any other text is
full marks.  A test's last expression can be a value the student's code chose (a function's
return, an object whose ``__repr__`` it wrote), and the student's code can send an
``execute_result`` of its own; so after the cell ran, each of a test cell's
``execute_result`` outputs becomes a ``display_data`` output: still shown in the feedback,
never counted.  A test that never ran scores 0 (``execute.RobustExecute`` adds the error).
"""

from __future__ import annotations

import nbformat
from nbgrader.preprocessors import NbGraderPreprocessor

from .cells import is_test_cell


def shown_not_counted(output: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """``output`` as nbgrader does not score it: an execute_result becomes a display_data."""
    if output.get("output_type") != "execute_result":
        return output
    return nbformat.v4.new_output("display_data", data=output.get("data", {}), metadata=output.get("metadata", {}))


class ScoreByPassing(NbGraderPreprocessor):
    """Autograde step right after the executor: no test cell keeps an ``execute_result``."""

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "code" and is_test_cell(cell):
            cell.outputs = [shown_not_counted(o) for o in cell.outputs]
        return cell, resources
