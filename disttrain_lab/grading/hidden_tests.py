"""Hidden tests stay hidden: out of the student's kernel, and out of every output a student sees.

A graded test cell runs only in the grader kernel (``grader_kernel.py``), which holds no student
code and keeps no input history; the student's kernel never receives a test's source, only the
requests of ``dl.exercise.run`` (a function's name and its inputs, as data).  What a test itself
prints or raises is shown, so every output of every cell of the autograded notebook and the
feedback is scrubbed all the same: a line of a hidden-tests block (between the BEGIN and END
markers) of the lab's source (read from the gradebook, where nbgrader keeps it) that appears in
an output is replaced by ``MARKER``; an output that shows one only once its markup, escapes or
spacing are undone is replaced whole.  (An encoded copy -- base64, one character a line -- is not
recognised: that is why a test's source never reaches the student's kernel.)
"""

from __future__ import annotations

import html
import re

from nbgrader.api import Gradebook, MissingEntry
from nbgrader.preprocessors import NbGraderPreprocessor

_MARK = "HIDDEN TESTS"  # (the markers are put together here, so that none is in the package's text)
BEGIN, END = f"### BEGIN {_MARK}", f"### END {_MARK}"
MARKER = "[hidden test line removed]"
MIN_CHARS = 8  # shorter lines (`)`, `else:`, `pass`) tell nothing and would match honest output


def hidden_lines(sources) -> list[str]:
    """The lines (stripped, at least MIN_CHARS long) inside the hidden-test blocks of ``sources``,
    and the blocks' markers."""
    found, inside = set(), False
    for source in sources:
        for line in source.splitlines():
            stripped = line.strip()
            if stripped.startswith(BEGIN):
                inside = True
                found.add(BEGIN)  # (the markers too: output quoting a test cell shows neither)
            elif stripped.startswith(END):
                inside = False
                found.add(END)
            elif inside and len(stripped) >= MIN_CHARS:
                found.add(stripped)
        inside = False
    return sorted(found, key=len, reverse=True)  # longest first: a line may hold a shorter one


def gradebook_hidden_lines(db_url: str, notebook: str, assignment: str) -> list[str]:
    """The hidden-test lines of the notebook's source cells as the gradebook keeps them."""
    with Gradebook(db_url) as gb:
        try:
            cells = gb.find_notebook(notebook, assignment).source_cells
        except MissingEntry:
            return []
        return hidden_lines(c.source or "" for c in cells)


_TAG = re.compile(r"<[^>]*>")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_SPACE = re.compile(r"[\s\u200b-\u200f\u2060\ufeff]+")


def _plain(text: str) -> str:
    """What a reader sees of ``text``: markup, escapes, colour codes and spacing undone."""
    return _SPACE.sub(" ", html.unescape(_TAG.sub("", _ANSI.sub("", text)))).strip()


def scrub_text(text: str, lines: list[str]) -> str:
    for line in lines:
        if line in text:
            text = text.replace(line, MARKER)
    if lines and any(_plain(line) in _plain(text) for line in lines):
        return MARKER  # hidden behind markup or spacing: the whole value goes
    return text


def scrub(value, lines: list[str]):
    """``value`` (an output, or any JSON value in it) with hidden-test text replaced."""
    if isinstance(value, str):
        return scrub_text(value, lines)
    if isinstance(value, list):
        return [scrub(v, lines) for v in value]
    if isinstance(value, dict):
        for key in list(value):
            value[key] = scrub(value[key], lines)
        return value
    return value


def scrub_outputs(nb, lines: list[str]) -> None:
    """Scrub every output of every code cell of ``nb`` in place."""
    if not lines:
        return
    for cell in nb.cells:
        for i, output in enumerate(cell.get("outputs", [])):
            cell.outputs[i] = scrub(output, lines)


class ScrubHiddenTests(NbGraderPreprocessor):
    """Autograde step (after the grades are saved, so it never changes a score): no
    output of the autograded notebook shows a hidden-test line."""

    def preprocess(self, nb, resources):
        ids = resources.get("nbgrader", {})
        lines = gradebook_hidden_lines(ids["db_url"], ids["notebook"], ids["assignment"])
        scrub_outputs(nb, lines)
        return nb, resources
