"""Student-controlled notebook content made inert before a browser shows it.

Two pages show what a student's notebook holds, and neither sanitises it:

- nbgrader's formgrader renders ``autograded/<student>/<lab>/<lab>.ipynb`` in the instructor's
  browser (``nbgrader/server_extensions/formgrader/handlers.py``, ``SubmissionHandler.get``: the
  ``HTMLExporter`` that ``formgrader.py`` sets up with nbgrader's ``formgrade`` template and no
  preprocessor), on the Jupyter server the instructor is logged in to: a script there can do
  whatever the instructor can, open a terminal included;
- ``nbgrader generate_feedback`` writes the page a student opens (``HTMLExporter``, nbgrader's
  ``feedback`` template).

Both templates extend nbconvert's ``classic`` one: a markdown cell goes through ``markdown2html``
unfiltered, a ``text/html`` output is written as it is, ``application/javascript`` becomes a
``<script>``, and nbconvert's markdown renderer keeps ``javascript:`` links.  So the notebook
itself is made inert, by :class:`SanitizeStudentHTML` in both steps (at autograde after the
grades are saved, so that it never changes a score):

1. an output keeps only what a browser shows without running anything (text, PNG, JPEG,
   LaTeX, cleaned HTML and markdown); JavaScript, SVG (it can hold scripts and handlers),
   widget views and any type not known to be inert go;
2. HTML (a ``text/html`` output, a raw cell) is cleaned by nh3, the binding of the Rust crate
   ammonia, to an allowlist of tags and attributes (no ``on*`` handler, no ``style``, no
   ``class`` or ``id`` the page's own scripts could pick up), URLs only http, https, mailto or
   relative (and a PNG/JPEG/GIF ``data:`` picture in an ``<img>``), ``rel="noopener
   noreferrer"`` on every link;
3. markdown (the student's markdown cells, ``text/markdown`` outputs) is rendered to HTML first,
   with nbconvert's own renderer, and cleaned as HTML: ``[x](javascript:...)`` is no tag that a
   sanitiser of the markdown text would see.  The clean HTML goes back into the cell as an HTML
   block, which markdown passes through unchanged (checked, not assumed);
4. the instructor's own markdown (a locked cell as the gradebook has it) is left as written, so
   that its quotes and code spans render as the instructor wrote them;
5. the notebook's widget state goes (the templates load a widget manager from a CDN to show it).

Math stays text: the pages typeset it with MathJax 2.7 and its ``Safe`` extension, which keeps
``\\href`` to safe URLs.
"""

from __future__ import annotations

import re

import nh3
from nbconvert.filters.markdown_mistune import IPythonRenderer, MarkdownWithMath
from nbformat import NotebookNode
from nbgrader.api import Gradebook, MissingEntry
from nbgrader.preprocessors import NbGraderPreprocessor
from traitlets import Dict, Set

# What a student's HTML may keep: text markup, lists, tables, details, links and pictures.
TAGS = {
    *("a", "abbr", "acronym", "b", "blockquote", "br", "code", "del", "details", "div", "em", "hr"),
    *("h1", "h2", "h3", "h4", "h5", "h6", "i", "img", "ins", "kbd", "li", "ol", "p", "pre", "s"),
    *("samp", "small", "span", "strong", "sub", "summary", "sup", "u", "ul", "var", "dl", "dt", "dd"),
    *("table", "caption", "thead", "tbody", "tfoot", "tr", "th", "td"),
}
# Removed with everything inside (the rest of what is not in TAGS loses its tag, keeps its text).
CLEAN_CONTENT_TAGS = {
    *("script", "style", "template", "noscript", "title", "textarea", "select", "xmp"),
    *("iframe", "frame", "frameset", "object", "embed", "applet", "noembed", "noframes"),
    *("svg", "math"),
}
# No `class`, `id`, `name` or `data-*`: the formgrader page runs jQuery, Bootstrap and its own
# Backbone views, which find their elements by exactly those (a student's `class="full-credit"`
# inside a graded cell would be its button).
ATTRIBUTES = {
    "*": {"title"},
    "a": {"href"},
    "img": {"src", "alt", "width", "height"},
    "ol": {"start"},
    "details": {"open"},
    "th": {"colspan", "rowspan", "align"},
    "td": {"colspan", "rowspan", "align"},
}
URL_SCHEMES = {"http", "https", "mailto"}  # and relative URLs (ammonia passes those through)
# Output types a page shows without running anything, as they are; text/html and text/markdown
# are kept cleaned; every other type is dropped.
INERT_MIMETYPES = {"text/plain", "image/png", "image/jpeg", "text/latex"}

_RASTER_DATA_URL = re.compile(r"data:image/(png|jpeg|gif);base64,[a-z0-9+/=\s]*", re.IGNORECASE)
_URL_STRIP = "".join(chr(c) for c in range(0x21))  # what a URL parser strips around a URL: C0 and space


def _raster_data_urls_only(element: str, attribute: str, value: str) -> str | None:
    """nh3's attribute filter, after ammonia checked the URL's scheme: a ``data:`` URL stays only as
    an ``<img>``'s PNG, JPEG or GIF (a picture runs nothing; a ``data:`` link opens a page that
    the student wrote).  The URL is read as a browser reads it: tabs and newlines inside ignored."""
    if attribute not in ("href", "src"):
        return value
    url = re.sub(r"[\t\n\r]", "", value).strip(_URL_STRIP)
    if not url.lower().startswith("data:"):
        return value
    return value if element == "img" and attribute == "src" and _RASTER_DATA_URL.fullmatch(url) else None


def render_markdown(source: str, attachments: dict | None = None) -> str:
    """Markdown to HTML as nbconvert's HTMLExporter renders a cell (``markdown2html``), with the
    cell's attachments as ``data:`` URLs."""
    return MarkdownWithMath(renderer=IPythonRenderer(escape=False, attachments=attachments or {})).render(source)


# A blank line ends an HTML block in markdown; each is folded into the line after it as a newline
# character reference, which is whitespace to HTML and keeps a <pre>'s lines as they were.
_BLANK_LINE = re.compile(r"\n([ \t]*)\n")


def instructor_markdown(ids: dict) -> dict[str, str]:
    """The locked markdown cells of the instructor, ``{grade_id: source}``, from the gradebook that
    ``ids`` (nbgrader's ``resources["nbgrader"]``) names; none without a gradebook."""
    if not ids.get("db_url"):
        return {}
    with Gradebook(ids["db_url"]) as gb:
        try:
            cells = gb.find_notebook(ids["notebook"], ids["assignment"]).source_cells
        except MissingEntry:
            return {}
        return {c.name: c.source for c in cells if c.locked and c.cell_type == "markdown"}


class SanitizeStudentHTML(NbGraderPreprocessor):
    """Autograde (after ``SaveAutoGrades``) and feedback (last): nothing a submission wrote runs
    in the browser that shows the notebook, the instructor's formgrader or the student's
    feedback page.  Outputs keep only inert types, HTML and markdown are cleaned by nh3 to the
    allowlists below (configurable), the instructor's locked markdown is left as written."""

    tags = Set(TAGS, help="HTML tags a student's HTML and markdown may keep").tag(config=True)
    clean_content_tags = Set(CLEAN_CONTENT_TAGS, help="tags removed with their content").tag(config=True)
    attributes = Dict(ATTRIBUTES, help="attributes kept per tag ('*': on every tag)").tag(config=True)
    url_schemes = Set(URL_SCHEMES, help="URL schemes a link or picture may use; relative URLs pass").tag(config=True)
    inert_mimetypes = Set(INERT_MIMETYPES, help="output types kept as they are").tag(config=True)

    def preprocess(self, nb, resources):
        # a `data:` URL is let through ammonia's scheme check and then judged by the filter
        self._cleaner = nh3.Cleaner(
            tags=set(self.tags),
            clean_content_tags=set(self.clean_content_tags),
            attributes={tag: set(names) for tag, names in self.attributes.items()},
            attribute_filter=_raster_data_urls_only,
            url_schemes={*self.url_schemes, "data"},
            link_rel="noopener noreferrer",
            strip_comments=True,
        )
        self._instructors = instructor_markdown(resources.get("nbgrader", {}))
        nb.metadata.pop("widgets", None)
        return super().preprocess(nb, resources)

    def preprocess_cell(self, cell, resources, index):
        grade_id = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        if cell.cell_type == "markdown" and self._instructors.get(grade_id) != cell.source:
            cell.source = self.inert_markdown(cell.source, cell.get("attachments"))
        elif cell.cell_type == "raw":
            cell.source = self.clean(cell.source)
        for output in cell.get("outputs", []):
            self._sanitise_output(output)
        return cell, resources

    def clean(self, html: str) -> str:
        """``html`` cleaned to the allowlists."""
        return self._cleaner.clean(html)

    def inert_markdown(self, source: str, attachments: dict | None = None) -> str:
        """Markdown that renders to ``source``'s HTML, cleaned: an HTML block.  Where rendering
        fails (an attachment missing) or the block would not pass through markdown unchanged,
        the text itself in a ``<pre>``, as character references."""
        if not source.strip():
            return source  # (an empty block would not pass through: a blank line inside)
        try:
            html = self.clean(render_markdown(source, attachments))
            block = _BLANK_LINE.sub(r"\n\1&#10;", html.strip())
            if not block.startswith("<div>\n"):  # (one that starts so is this block, cleaned again)
                block = f"<div>\n{block}\n</div>"
            if render_markdown(block).strip() == block:
                return block
        except Exception as exc:  # the student's text is still shown, as text
            self.log.warning("markdown shown as text: it could not be rendered (%s: %s)", type(exc).__name__, exc)
        # every character but letters, digits and spaces as a reference: no tag, and no markdown either
        text = "".join(c if c.isalnum() or c in " \n" else f"&#{ord(c)};" for c in source)
        return f"<pre>{text}</pre>"

    def _sanitise_output(self, output) -> None:
        if output.get("output_type") not in ("display_data", "execute_result"):
            return  # a stream or an error: the templates escape their text
        data, kept = output.get("data", {}), {}
        for mimetype, value in data.items():
            text = "".join(value) if isinstance(value, list) else value
            if mimetype in self.inert_mimetypes:
                kept[mimetype] = value
            elif mimetype == "text/html":
                kept[mimetype] = self.clean(text)
            elif mimetype == "text/markdown":
                kept[mimetype] = self.inert_markdown(text)
        if data and not kept:  # say what was there, instead of an empty output
            kept["text/plain"] = f"[{', '.join(sorted(data))} output removed: it could run code in the browser]"
        output["data"] = NotebookNode(kept)
