"""Hidden tests stay hidden: out of the kernel's memory after they run, and out of every
output a student sees.

A graded test cell runs without input history (``store_history=False``: no ``In``,
``_ih``, ``_i``, history database entry), and right after it the grader tells the kernel to
forget it (``forget_program``): IPython still caches the source of every cell it compiles
in ``linecache`` (for tracebacks), and keeps the last cell's ``ExecutionResult`` and
traceback.  What code running *during* the test can see (its caller's frame) may still be
printed, so every output of every cell of the autograded notebook and the feedback is
scrubbed: a line of a hidden-tests block (between the BEGIN and END markers) of the lab's source (read from the
gradebook, where nbgrader keeps it) that appears in an output is replaced by ``MARKER``;
an output that shows one only once its markup, escapes or spacing are undone is replaced
whole.  (An encoded copy -- base64, one character a line -- is not recognised: that is
why the kernel must not keep the source in the first place.)
"""

from __future__ import annotations

import hashlib
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


def forget_program(source: str) -> str:
    """Code that makes the kernel forget a test cell it just ran (``source``): IPython's
    cached copies of its lines (``linecache``, the compiler's file names), the last
    execution's result and traceback.  Only digests of its hidden lines are sent, never the lines."""
    digests = sorted(hashlib.sha256(line.encode()).hexdigest() for line in hidden_lines([source]))
    return (
        "def __disttrain_forget(digests):\n"
        "    import hashlib, linecache, sys\n"
        "    from IPython import get_ipython\n"
        "    ip = get_ipython()\n"
        "    names = getattr(getattr(ip, 'compile', None), '_filename_map', {})\n"
        "    for cache in (linecache.cache, getattr(linecache, '_ipython_cache', {})):\n"
        "        for name, entry in list(cache.items()):\n"
        "            lines = entry[2] if isinstance(entry, tuple) and len(entry) > 2 else []\n"
        "            if any(hashlib.sha256(str(l).strip().encode()).hexdigest() in digests for l in lines):\n"
        "                cache.pop(name, None)\n"
        "                names.pop(name, None)\n"
        "    for name in ('last_type', 'last_value', 'last_traceback', 'last_exc'):\n"
        "        if hasattr(sys, name):\n"
        "            setattr(sys, name, None)\n"
        "    ip.last_execution_result = None\n"
        f"__disttrain_forget(set({digests!r}))\n"
        "del __disttrain_forget\n"
    )
