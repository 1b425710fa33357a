"""The feedback page a student reads in a minute: nbgrader's feedback, made plain.

nbgrader's page lists its graded cells as "Test cell (Score: 0.0 / 2.0)", lets a long message
run off the right edge, loads MathJax from a CDN (a student reading offline sees raw ``$...$``)
and would show a prediction's expected value as soon as the test fails.  Here:

- ``FeedbackPage`` (a preprocessor, before the sanitiser) names each graded cell by its exercise
  (``cells.exercise_names``, from the instructor's notebook where the grader has it) for the
  index; inlines MathJax when the page has a formula; and withholds the cost model's values in
  a failed prediction's message until the deadline (``expected_shown``);
- ``FeedbackExporter`` renders the page with ``templates/disttrain_feedback`` (nbgrader's
  ``feedback`` template with that index, wrapping outputs, and the inlined MathJax in place of
  the CDN's).

MathJax 3 (``tex-svg.js``: the TeX input and the SVG output, whose glyphs are drawn from data in
the script, so no font file is fetched) comes from the ``django-static-mathjax`` wheel, which
ships MathJax's files and nothing else (no Django is needed).  It is inlined, not copied beside
the page: ``nbgrader release_feedback`` hands a student the HTML file alone.  It runs with no
``require`` or ``autoload`` (nothing is fetched; ``\\href``, ``\\class``, ``\\style`` are unknown
there, so a student's formula makes no link or style) and no menu.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import nbformat
from nbconvert.exporters import HTMLExporter
from nbgrader.api import Gradebook, MissingEntry
from nbgrader.preprocessors import NbGraderPreprocessor

from .. import withheld
from .cells import exercise_names, is_test_cell
from .config import SHOW_EXPECTED, show_expected, source_dir

TEMPLATES = Path(__file__).parent / "templates"
TEMPLATE = "disttrain_feedback"  # templates/disttrain_feedback: extends nbgrader's "feedback"

# what a failed prediction's feedback says instead of the cost model's value (config.show_expected)
WITHHELD = {
    "after-deadline": "a different value (shown in the feedback after the deadline)",
    "never": "a different value",
}

# a formula as MathJax finds one (its delimiters below), in markdown or a LaTeX/markdown output
_FORMULA = re.compile(r"\$\$.+?\$\$|\$[^$\n]+\$|\\\(.+?\\\)|\\\[.+?\\\]|\\begin\{", re.DOTALL)
_MATHJAX_FILE = "mathjax/static/mathjax/es5/tex-svg.js"  # in the django-static-mathjax wheel
MATHJAX_CONFIG = r"""window.MathJax = {
  tex: {
    inlineMath: [['$', '$'], ['\\(', '\\)']],
    displayMath: [['$$', '$$'], ['\\[', '\\]']],
    processEscapes: true,
    processEnvironments: true,
    packages: {'[-]': ['require', 'autoload']}  // nothing is fetched: an unknown macro shows in red
  },
  svg: {fontCache: 'global'},
  options: {enableMenu: false}
};"""


def expected_shown(setting: str, duedate: datetime | None, now: datetime) -> bool:
    """Whether feedback made at ``now`` shows a prediction's expected value (``duedate`` and
    ``now`` in UTC, as nbgrader's gradebook keeps them: without a time zone)."""
    if setting == "always":
        return True
    if setting == "never":
        return False
    if setting == "after-deadline":
        return duedate is not None and now >= duedate
    raise ValueError(f"show-expected setting {setting!r}: use one of {', '.join(SHOW_EXPECTED)}")


def due_date(db_url: str, assignment: str) -> datetime | None:
    """The assignment's due date in the gradebook (UTC, no time zone), or None."""
    with Gradebook(db_url) as gb:
        try:
            return gb.find_assignment(assignment).duedate
        except MissingEntry:
            return None


def has_formula(nb) -> bool:
    """Whether MathJax would typeset something on the page: a formula in a markdown cell, or in
    a LaTeX or markdown output."""
    texts = [c.source for c in nb.cells if c.cell_type == "markdown"]
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            texts += [data.get("text/latex", ""), data.get("text/markdown", "")]
    return any(_FORMULA.search(text) for text in texts if isinstance(text, str))


def mathjax_script() -> str:
    """MathJax's ``tex-svg.js``, safe to put between ``<script>`` and ``</script>``: the two
    sequences that would end or confuse a script element are written as the same characters
    with an escape (``\\x3C``), which means ``<`` in a JavaScript string and regular expression
    alike, where MathJax has them."""
    path = importlib.metadata.distribution("django-static-mathjax").locate_file(_MATHJAX_FILE)
    text = Path(str(path)).read_text(encoding="utf-8")
    return re.sub(r"<(?=!--|/script)", r"\\x3C", text, flags=re.IGNORECASE)


def unique_names(names: dict[str, str]) -> dict[str, str]:
    """A name shared by several graded cells (an exercise with two tests) numbered: "(1 of 2)"."""
    counts, seen = Counter(names.values()), Counter()
    unique = {}
    for gid, name in names.items():
        if counts[name] > 1:
            seen[name] += 1
            name = f"{name} ({seen[name]} of {counts[name]})"
        unique[gid] = name
    return unique


class FeedbackPage(NbGraderPreprocessor):
    """Feedback step, before the sanitiser: what ``templates/disttrain_feedback`` shows beyond
    nbgrader's page (``resources["feedback_page"]``: the exercise names, the inlined MathJax), and
    each failed prediction's expected value withheld unless ``show_expected`` says otherwise."""

    def preprocess(self, nb, resources):
        ids = resources.get("nbgrader", {})
        page = resources.setdefault("feedback_page", {})
        page["exercises"] = unique_names(exercise_names(self._instructors_notebook(ids) or nb))
        page["mathjax"] = mathjax_script() if has_formula(nb) else ""
        page["mathjax_config"] = MATHJAX_CONFIG
        setting = show_expected()
        duedate = due_date(ids["db_url"], ids["assignment"]) if ids.get("db_url") and ids.get("assignment") else None
        now = datetime.now(timezone.utc).replace(tzinfo=None)
        if not expected_shown(setting, duedate, now):
            instead = WITHHELD.get(setting, WITHHELD["never"])
            for cell in nb.cells:
                if cell.cell_type == "code" and is_test_cell(cell):
                    _withhold(cell, instead)
        return nb, resources

    def _instructors_notebook(self, ids: dict):
        """The lab's notebook in the course's source (its headings are the instructor's, whatever
        the student edited), or None where the grader has none."""
        if not ids.get("assignment") or not ids.get("notebook"):
            return None
        path = source_dir() / ids["assignment"] / f"{ids['notebook']}.ipynb"
        try:
            return nbformat.read(path, as_version=4)
        except (OSError, ValueError) as exc:  # no source here, or not a notebook: the submission's headings
            self.log.debug("exercise names from the submission (%s: %s)", path, exc)
            return None


def _withhold(cell, instead: str) -> None:
    for output in cell.get("outputs", []):
        if output.output_type == "error":
            output.evalue = withheld.withhold_expected(output.evalue, instead)
            output.traceback = [withheld.withhold_expected(line, instead) for line in output.traceback]
        elif output.output_type == "stream":
            output.text = withheld.withhold_expected(output.text, instead)


class FeedbackExporter(HTMLExporter):
    """nbgrader's feedback page through ``templates/disttrain_feedback`` (``configure_exporter``)."""


def configure_exporter(c) -> None:
    """Make ``nbgrader generate_feedback`` render with ``FeedbackExporter`` and its template.
    Set on the subclass, so the formgrader's own HTMLExporter (template ``formgrade``) is
    untouched."""
    import nbgrader.converters.generate_feedback as generate_feedback

    nbgrader_templates = Path(generate_feedback.__file__).parents[1] / "server_extensions" / "formgrader"
    c.GenerateFeedback.exporter_class = FeedbackExporter
    c.FeedbackExporter.template_name = TEMPLATE
    c.FeedbackExporter.extra_template_basedirs = [str(TEMPLATES), str(nbgrader_templates / "templates")]
    c.FeedbackExporter.extra_template_paths = [  # nbgrader's templates (extended) and its bootstrap.min.css
        str(nbgrader_templates / "templates"),
        str(nbgrader_templates / "static" / "node_modules" / "bootstrap" / "dist" / "css"),
    ]
