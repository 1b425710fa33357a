"""What a student wrote is inert where a browser shows it (issue 40): the autograded notebook
that nbgrader's formgrader renders in the instructor's browser, and the feedback page.

Every payload is put where a student can put HTML: a markdown cell, a raw cell, a ``text/html``
and a ``text/markdown`` output.  After ``SanitizeStudentHTML`` each place is rendered as the
templates render it (markdown through nbconvert's ``markdown2html``) and read back with an HTML
parser: only allowlisted tags, no ``on*``/``style``/``class``/``id`` attribute, every URL http,
https, mailto, relative or a raster ``data:`` picture.  Harmless markup survives; the
instructor's locked markdown is left exactly as the gradebook has it.  The slow test loads both
pages, rendered as nbgrader renders them, in headless Chromium (Debian's, through Playwright)
and watches for a payload that ran.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from html import unescape
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook
from traitlets.config import Config

from disttrain_lab import grading
from disttrain_lab.grading.sanitize import TAGS, SanitizeStudentHTML, render_markdown
from tests.grading.test_feedback_page import render

MARK = "window.__pwned=1"
PAYLOADS = {
    "script": f"<script>{MARK}</script>",
    "img onerror": f'<img src=x onerror="{MARK}">',
    "javascript link": f'<a href="javascript:{MARK}">j1</a>',
    "JaVaScRiPt: with entities": f'<a href="  JaVaScRiPt&#x3A;{MARK}">j2</a>',
    "javascript: with a tab": f'<a href="java&#09;script:{MARK}">j3</a>',
    "javascript: with a newline": f'<a href="&#10;&#106;avascript:{MARK}">j4</a>',
    "data:text/html link": f'<a href="data:text/html,<script>{MARK}</script>">d1</a>',
    "DATA: base64 link": '<a href="DATA:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==">d2</a>',
    "data:image/svg+xml picture": '<img src="data:image/svg+xml;base64,PHN2ZyBvbmxvYWQ9YWxlcnQoMSk+">',
    "svg onload": f'<svg onload="{MARK}"><circle r="4"/></svg>',
    "svg script": f"<svg><script>{MARK}</script></svg>",
    "iframe srcdoc": '<iframe srcdoc="<script>parent.__pwned=1</script>"></iframe>',
    "object": f'<object data="javascript:{MARK}"></object>',
    "embed": f'<embed src="javascript:{MARK}">',
    "form action": f'<form action="javascript:{MARK}"><button>go</button></form>',
    "button formaction": f'<button formaction="javascript:{MARK}">go</button>',
    "base href": '<base href="https://attacker.example/">',
    "meta refresh": '<meta http-equiv="refresh" content="0;url=about:blank#pwned">',
    "style block": f"<style>body {{ background: url(javascript:{MARK}) }} b {{ display: none }}</style>",
    "style url attribute": f'<p style="background:url(javascript:{MARK})">s1</p>',
    "style expression attribute": f'<p style="width:expression({MARK})">s2</p>',
    "math xlink:href": f'<math><maction actiontype="statusline" xlink:href="javascript:{MARK}">m</maction></math>',
    "math href": f'<math href="javascript:{MARK}"><mi>x</mi></math>',
    "details ontoggle": f'<details open ontoggle="{MARK}"><summary>t</summary></details>',
    "class and id for the page's scripts": '<a class="full-credit" id="cell-1" href="#">c</a>',
    "noscript mXSS": f'<noscript><p title="</noscript><img src=x onerror={MARK}>"></noscript>',
    "svg style mXSS": f'<svg></p><style><a id="</style><img src=1 onerror={MARK}>">',
    "markdown javascript link": f"[md1](javascript:{MARK})",
    "markdown JaVaScRiPt link with an entity": f"[md2](JaVaScRiPt&#58;{MARK})",
    "markdown autolink": f"<javascript:{MARK}>",
    "markdown image": f"![md3](javascript:{MARK})",
    "markdown reference link": f"[md4][r]\n\n[r]: javascript:{MARK}",
    "markdown data: link": "[md5](data:text/html,<script>alert(1)</script>)",
}
HARMLESS = (  # as HTML, and as markdown too
    "<p><b>HARMLESS-BOLD</b> and <i>italics</i></p>\n\n"
    "<table><tr><th>HARMLESS-TH</th></tr><tr><td>HARMLESS-TD</td></tr></table>\n\n"
    "<details><summary>HARMLESS-SUMMARY</summary>HARMLESS-DETAILS</details>\n\n"
    '<p><a href="https://example.com/page">HARMLESS-LINK</a> <img src="data:image/png;base64,iVBORw0KGgo=" alt="pic"></p>\n'
)
HARMLESS_MARKDOWN = "**HARMLESS-STRONG**, `a<b` in code, [HARMLESS-MDLINK](https://example.com/md)\n"

# ---------------------------------------------------------------------------------------------
# reading a page's HTML back


def _safe_url(element: str, attribute: str, value: str) -> bool:
    url = re.sub(r"[\t\n\r]", "", value).strip("".join(chr(c) for c in range(0x21))).lower()
    scheme = re.match(r"([a-z][a-z0-9+.-]*):", url)
    if scheme is None:
        return True  # relative
    if scheme.group(1) == "data":
        return (element, attribute) == ("img", "src") and re.match(r"data:image/(png|jpeg|gif);base64,", url)
    return scheme.group(1) in ("http", "https", "mailto")


class _Inspector(HTMLParser):
    """Every problem an HTML string would give a browser that shows it."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.problems: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in TAGS:
            self.problems.append(f"tag <{tag}>")
        for name, value in attrs:
            if name.startswith("on") or name in ("style", "class", "id", "srcdoc", "formaction", "action"):
                self.problems.append(f"attribute {name} on <{tag}>")
            elif name in ("href", "src", "xlink:href", "data") and not _safe_url(tag, name, value or ""):
                self.problems.append(f"URL {name}={value!r} on <{tag}>")
            if tag == "a" and name == "href" and "noopener noreferrer" not in dict(attrs).get("rel", ""):
                self.problems.append("a link without rel=noopener noreferrer")

    handle_startendtag = handle_starttag


def problems(html: str) -> list[str]:
    inspector = _Inspector()
    inspector.feed(html)
    inspector.close()
    return inspector.problems


def _shown(cell) -> list[str]:
    """The HTML the templates make of a cell: its markdown rendered, its raw source, its outputs."""
    shown = []
    if cell.cell_type == "markdown":
        shown.append(render_markdown(cell.source))
    elif cell.cell_type == "raw":
        shown.append(cell.source)
    for output in cell.get("outputs", []):
        data = output.get("data", {})
        shown += [data.get("text/html", ""), render_markdown(data.get("text/markdown", ""))]
    return shown


# ---------------------------------------------------------------------------------------------
# notebooks


def _display(data: dict, metadata: dict | None = None):
    return nbformat.v4.new_output("display_data", data=data, metadata=metadata or {})


def _student_notebook(html: str) -> nbformat.NotebookNode:
    """``html`` everywhere a student can write HTML."""
    nb = nbformat.v4.new_notebook()
    code = nbformat.v4.new_code_cell("show()")
    code.outputs = [_display({"text/html": html, "text/plain": "x"}), _display({"text/markdown": html})]
    nb.cells = [
        nbformat.v4.new_markdown_cell(html),
        nbformat.v4.new_raw_cell(html, metadata={"raw_mimetype": "text/html"}),
        code,
    ]
    return nb


def _sanitised(nb, resources=None) -> nbformat.NotebookNode:
    nb, _ = SanitizeStudentHTML().preprocess(nb, resources or {})
    nbformat.validate(nb)
    return nb


@pytest.mark.parametrize("name", PAYLOADS)
def test_no_payload_survives_anywhere_a_student_writes_html(name):
    nb = _sanitised(_student_notebook(f"before\n\n{PAYLOADS[name]}\n\nafter\n\n{HARMLESS}"))
    for where, cell in zip(("markdown cell", "raw cell", "outputs"), nb.cells):
        for html in _shown(cell):
            assert not problems(html), f"{name} in the {where}: {problems(html)}\n{html}"


def test_harmless_markup_survives():
    nb = _sanitised(_student_notebook(f"{HARMLESS}\n{HARMLESS_MARKDOWN}"))
    cell, raw, output = render_markdown(nb.cells[0].source), nb.cells[1].source, nb.cells[2].outputs[0]
    for html in (cell, raw, output.data["text/html"], render_markdown(nb.cells[2].outputs[1].data["text/markdown"])):
        for text in ("<b>HARMLESS-BOLD</b>", "<i>italics</i>", "<th>HARMLESS-TH</th>", "<td>HARMLESS-TD</td>"):
            assert text in html
        assert "<details><summary>HARMLESS-SUMMARY</summary>HARMLESS-DETAILS</details>" in html
        assert '<a href="https://example.com/page" rel="noopener noreferrer">HARMLESS-LINK</a>' in html
        assert '<img src="data:image/png;base64,iVBORw0KGgo=" alt="pic">' in html
    assert "<strong>HARMLESS-STRONG</strong>" in cell and "<code>a&lt;b</code>" in cell
    assert '<a href="https://example.com/md" rel="noopener noreferrer">HARMLESS-MDLINK</a>' in cell


def test_student_markdown_renders_as_written_then_stays_put():
    # quotes, code with blank lines, maths: the cleaned block renders as the markdown did
    source = "> a quote\n\n```python\ndef f(x):\n\n    return x < 1\n```\n\n$a<b$ and $$\\sum_i x_i$$\n"
    once = _sanitised(_student_notebook(source))
    html = render_markdown(once.cells[0].source)
    assert "<blockquote>" in html and "\n\n    <span>return</span>" in html.replace("&#10;", "\n")
    assert "$a&lt;b$" in html and "$$\\sum_i x_i$$" in html
    twice = _sanitised(nbformat.from_dict(once))  # autograde, then feedback
    assert twice.cells == once.cells


def test_text_a_student_markdown_cannot_render_is_shown_as_text():
    nb = _student_notebook(f"![missing](attachment:gone.png) [x](javascript:{MARK})")
    nb.cells[0].attachments = {}
    cell = _sanitised(nb).cells[0]
    assert cell.source.startswith("<pre>") and not problems(render_markdown(cell.source))
    assert "attachment:gone.png" in unescape(render_markdown(cell.source))  # the text itself, shown as text


def test_an_empty_markdown_cell_stays_empty():
    nb = _sanitised(_student_notebook(" \n"))
    assert nb.cells[0].source == " \n" and nb.cells[2].outputs[1].data["text/markdown"] == " \n"


def test_an_attached_picture_stays():
    nb = _student_notebook("![HARMLESS-ATTACHED](attachment:pic.png)")
    nb.cells[0].attachments = {"pic.png": {"image/png": "iVBORw0KGgo="}}
    html = render_markdown(_sanitised(nb).cells[0].source)
    assert '<img src="data:image/png;base64,iVBORw0KGgo=" alt="HARMLESS-ATTACHED"' in html


def test_outputs_keep_only_inert_types():
    code = nbformat.v4.new_code_cell("show()")
    png, jpeg = "iVBORw0KGgo=", "/9j/4AAQ"
    code.outputs = [
        _display({"application/javascript": f"{MARK}", "text/plain": "<IPython.core.display.Javascript>"}),
        _display({"image/svg+xml": f"<svg onload='{MARK}'><script>{MARK}</script></svg>"}),
        _display({"application/vnd.jupyter.widget-view+json": {"model_id": "1", "version_major": 2}}),
        _display({"text/vnd.mermaid": f"<img src=x onerror={MARK}>", "application/x-unknown": "?"}),
        _display({"image/png": png, "image/jpeg": jpeg, "text/latex": "$x$"}, {"image/png": {"width": 10}}),
        nbformat.v4.new_output("execute_result", data={"text/plain": "3"}, execution_count=1),
        nbformat.v4.new_output("stream", name="stdout", text="<b>as text</b>"),
        nbformat.v4.new_output("error", ename="E", evalue="<b>", traceback=["<b>"]),
    ]
    nb = nbformat.v4.new_notebook(cells=[code], metadata={"widgets": {"application/vnd.jupyter.widget-state+json": {}}})
    nb = _sanitised(nb)
    js, svg, widget, unknown, inert, result, stream, error = nb.cells[0].outputs
    assert js.data == {"text/plain": "<IPython.core.display.Javascript>"}
    assert set(svg.data) == set(widget.data) == set(unknown.data) == {"text/plain"}
    assert "image/svg+xml output removed" in svg.data["text/plain"] and MARK not in svg.data["text/plain"]
    assert "application/x-unknown, text/vnd.mermaid output removed" in unknown.data["text/plain"]
    assert inert.data == {"image/png": png, "image/jpeg": jpeg, "text/latex": "$x$"}
    assert inert.metadata == {"image/png": {"width": 10}}
    assert result.data == {"text/plain": "3"}
    assert stream.text == "<b>as text</b>" and error.traceback == ["<b>"]  # the templates escape these
    assert "widgets" not in nb.metadata


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_the_instructors_locked_markdown_is_left_as_the_gradebook_has_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # nbgrader's alembic
    # the instructor's text quotes, shows `a<b` in code and uses a tag: exactly as written
    intro = "> **Read this.** `a<b` is <b>fine</b>\n\n<details><summary>hint</summary>x</details>"
    db_url = f"sqlite:///{tmp_path / 'gradebook.db'}"
    with Gradebook(db_url) as gb:
        gb.add_assignment("lab")
        gb.add_notebook("lab", "lab")
        gb.add_source_cell("intro", "lab", "lab", cell_type="markdown", locked=True, source=intro)
        gb.add_source_cell("answer", "lab", "lab", cell_type="markdown", locked=False, source="YOUR ANSWER HERE")

    def cell(grade_id, source, locked):
        nbg = {"grade_id": grade_id, "locked": locked, "solution": not locked, "grade": False, "schema_version": 3}
        return nbformat.v4.new_markdown_cell(source, metadata={"nbgrader": nbg})

    payload = f"{intro}\n\n<img src=x onerror={MARK}>"
    nb = nbformat.v4.new_notebook()
    nb.cells = [cell("intro", intro, True), cell("answer", payload, False), cell("intro", payload, True)]
    resources = {"nbgrader": {"db_url": db_url, "notebook": "lab", "assignment": "lab", "student": "s"}}
    instructors, answer, edited = _sanitised(nb, resources).cells
    assert instructors.source == intro
    for student in (answer, edited):  # the student's answer, and a locked cell whose text is not the gradebook's
        assert student.source.startswith("<div>\n<blockquote>") and "<details>" in student.source
        assert not problems(render_markdown(student.source))


def test_configure_sanitises_after_the_grades_are_saved_and_last_in_the_feedback(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTTRAIN_COURSE_DIR", str(tmp_path / "course"))
    monkeypatch.setenv("DISTTRAIN_SANDBOX", "off")  # the wiring only: no host check, no warning
    monkeypatch.setenv("DISTTRAIN_SANDBOX_WARNED", "1")
    c = Config()
    grading.configure(c)
    autograde = [getattr(p, "__name__", p) for p in c.Autograde.autograde_preprocessors]
    assert autograde.index("SanitizeStudentHTML") > autograde.index("SaveAutoGrades")
    assert c.GenerateFeedback.preprocessors[-1] is SanitizeStudentHTML


def test_no_module_of_the_package_imports_bleach():
    from tests.helpers import REPO

    for path in (REPO / "disttrain_lab").rglob("*.py"):
        assert not re.search(r"^\s*(import|from)\s+bleach\b", path.read_text(), re.MULTILINE), path


# ---------------------------------------------------------------------------------------------
# the two pages in a real browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-background-networking", "--disable-component-update", "--no-first-run"]
# each payload tries to leave a mark: a dialog, the title, a global, the address
BROWSER_PAYLOADS = [
    *PAYLOADS.values(),
    "<script>alert('script')</script><img src=x onerror=\"document.title='PWNED'\">",
    "<svg><animate onbegin=\"alert('svg')\" attributeName=x dur=1s></animate></svg>",
    "<img src=x onerror=\"window.__pwned=1;alert('img')\">",
    '<iframe src="javascript:parent.__pwned=1"></iframe>',
    "<video><source onerror=\"alert('video')\"></video><input autofocus onfocus=\"alert('input')\">",
    # TeX for the feedback page's MathJax: links, classes, styles, a fetched extension (none may work)
    r"$\href{javascript:alert('tex')}{x} \class{full-credit}{y} \style{color:red}{z} \require{html}$",
]


def _browser_notebook() -> nbformat.NotebookNode:
    """Every payload in a student's answer cell, plain markdown, raw HTML and outputs, among
    harmless text, with the nbgrader metadata the formgrade and feedback templates read."""
    html = "\n\n".join(BROWSER_PAYLOADS) + f"\n\n{HARMLESS}\n{HARMLESS_MARKDOWN}"
    nb = _student_notebook(html)
    answer = nbformat.v4.new_markdown_cell(html)
    answer.metadata.nbgrader = {
        **{"grade_id": "answer", "solution": True, "grade": True, "locked": False, "points": 1.0},
        **{"schema_version": 3, "score": 0.0},
    }
    nb.cells[2].outputs += [
        _display({"application/javascript": "alert('js')", "text/plain": "js"}),
        _display({"image/svg+xml": "<svg xmlns='http://www.w3.org/2000/svg' onload=\"alert('svg')\"/>"}),
    ]
    nb.cells.insert(0, answer)
    nb.metadata.widgets = {"application/vnd.jupyter.widget-state+json": {"state": {}, "version_major": 2}}
    return nb


def _formgrader_page(nb) -> str:
    """The formgrader's page of a submission: nbgrader/server_extensions/formgrader/handlers.py,
    SubmissionHandler.get, with the HTMLExporter formgrader.py configures (template ``formgrade``),
    of the autograded notebook, which SanitizeStudentHTML cleaned at autograde."""
    from nbconvert.exporters import HTMLExporter
    from nbgrader.server_extensions.formgrader import handlers

    c = Config()
    c.HTMLExporter.template_name = "formgrade"
    c.HTMLExporter.extra_template_basedirs = [handlers.template_path]
    resources = {
        **{"assignment_id": "lab", "notebook_id": "lab", "submission_id": "1", "index": 0, "total": 1},
        **{"base_url": "", "student": "s", "last_name": "L", "first_name": "F", "notebook_path": "lab.ipynb"},
    }
    html, _ = HTMLExporter(config=c).from_notebook_node(_sanitised(nb), resources=resources)
    return html


# the notebook's cells (both templates extend nbconvert's classic one: a cell is a `.cell`); the
# page around them is nbgrader's (the formgrader's own `onclick`s, say)
_CELLS_IN_PAGE = """() => {
    const bad = [], cells = document.querySelectorAll('.cell *');
    for (const el of cells) {
        for (const attr of el.attributes) {
            const name = attr.name.toLowerCase();
            if (name.startsWith('on') || name === 'srcdoc' || name === 'formaction') bad.push(name);
            if (!['href', 'src', 'action', 'xlink:href', 'data'].includes(name)) continue;
            let url;
            try { url = new URL(attr.value, document.baseURI); } catch (e) { continue; }  // no URL: goes nowhere
            if (['http:', 'https:', 'mailto:', 'file:'].includes(url.protocol)) continue;
            if (url.protocol === 'data:' && /^data:image\\/(png|jpeg|gif);/i.test(url.href)) continue;
            bad.push(name + '=' + attr.value);
        }
    }
    return [cells.length, bad];
}"""


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (`apt-get install -y chromium`)")
def test_no_payload_runs_in_the_formgrader_or_the_feedback_page(tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    start = time.monotonic()
    pages = {
        "formgrader": _formgrader_page(_browser_notebook()),
        "feedback": render(_browser_notebook(), tmp_path),  # (the feedback page as configure() makes it)
    }
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            for name, html in pages.items():
                path = tmp_path / f"{name}.html"
                path.write_text(html)
                page = browser.new_page()
                dialogs: list[str] = []
                page.on("dialog", lambda dialog, seen=dialogs: (seen.append(dialog.message), dialog.dismiss()))
                page.route(re.compile(r"^https?://"), lambda route: route.abort())  # MathJax, require.js: offline
                page.goto(path.as_uri(), wait_until="load", timeout=15_000)
                page.wait_for_timeout(1_500)  # a refresh, an animation, a timer
                if name == "feedback":  # MathJax typeset the TeX payload (as text: no link, class or style)
                    page.wait_for_function("() => document.querySelector('mjx-container svg')", timeout=15_000)
                marks = page.evaluate("() => [window.__pwned, document.title, location.href, document.baseURI]")
                assert not dialogs, f"{name}: a payload opened a dialog: {dialogs}"
                assert marks == [None, marks[1], path.as_uri(), path.as_uri()] and "PWNED" not in marks[1], (
                    f"{name}: a payload left a mark: {marks}"
                )
                assert len(page.frames) == 1, f"{name}: a payload made a frame"
                scanned, bad = page.evaluate(_CELLS_IN_PAGE)
                assert scanned > 50 and not bad, f"{name}: in the cells: {bad}"
                for text in ("HARMLESS-BOLD", "HARMLESS-TD", "HARMLESS-SUMMARY", "HARMLESS-LINK", "HARMLESS-STRONG"):
                    assert page.get_by_text(text).first.is_visible(), f"{name}: {text} is not shown"
                page.close()
        finally:
            browser.close()
    assert time.monotonic() - start < 60
