"""The feedback page a student reads in a minute (issue 43, item 3): an index named by exercise
with points, long messages that wrap, formulas typeset with no network, each cell's own
``In [n]``, an endless loop named as such, and a prediction's expected value withheld until
the deadline (``DISTTRAIN_SHOW_EXPECTED``).

The page is rendered here as ``nbgrader generate_feedback`` renders it (``configure``'s exporter,
template and preprocessors but the gradebook's) from a lab's notebook; the slow tests grade one
small lab once (a module-scoped fixture: a student whose ``ping_pong`` never ends and whose
prediction is wrong) and load its feedback in headless Chromium with every request aborted.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import sys
import time
from datetime import datetime, timedelta, timezone
from html import unescape
from pathlib import Path

import nbformat
import pytest
from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
from nbgrader.api import Gradebook
from nbgrader.converters import GenerateFeedback
from nbgrader.coursedir import CourseDirectory
from traitlets.config import Config

from disttrain_lab.grading import feedback_page
from disttrain_lab.grading.cells import exercise_names
from disttrain_lab.grading.execute import prompt_numbers
from disttrain_lab.grading.feedback_page import FeedbackPage, configure_exporter, expected_shown
from disttrain_lab.grading.sanitize import SanitizeStudentHTML
from tests.helpers import REPO
from tests.roundtrip import FIXTURE_LIMITS, Course, feedback, grade_id, submit, with_solution

LAB1 = "01_point_to_point"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-background-networking", "--disable-component-update", "--no-first-run"]


def _scored(nb, score: float = 0.0):
    """``nb`` as autograde leaves it for the feedback step: every graded cell scored, no outputs."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        nbg = cell.get("metadata", {}).get("nbgrader", {})
        if nbg.get("grade"):
            nbg["score"] = score
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def render(nb, tmp_path: Path, **ids) -> str:
    """The feedback page of ``nb``: GenerateFeedback's exporter as ``configure`` sets it, with its
    preprocessors but the gradebook's (GetGrades, hidden tests)."""
    config = Config()
    config.GenerateFeedback.preprocessors = [CSSHTMLHeaderPreprocessor, FeedbackPage, SanitizeStudentHTML]
    configure_exporter(config)
    converter = GenerateFeedback(coursedir=CourseDirectory(root=str(tmp_path)), config=config)
    exporter = converter.exporter_class(parent=converter, config=converter.config)  # as BaseConverter.start
    for preprocessor in converter.preprocessors:
        exporter.register_preprocessor(preprocessor)
    ids = {"student": "s", "assignment": "lab", "notebook": "lab", "score": 0.0, "max_score": 1.0, **ids}
    html, _ = exporter.from_notebook_node(nb, resources={"nbgrader": {"late_penalty": 0, **ids}})
    return html


def index(html: str) -> list[str]:
    """The page's index, one entry a line, as a student reads it."""
    [toc] = re.findall(r'<div id="toc">(.*?)</div>', html, re.DOTALL)
    return [
        " ".join(unescape(re.sub(r"<[^>]+>", " ", item)).split()) for item in re.findall(r"<li>(.*?)</li>", toc, re.S)
    ]


def lab1():
    return nbformat.read(REPO / "solutions" / LAB1 / f"{LAB1}.ipynb", as_version=4)


# ---------------------------------------------------------------------------------------------
# the index


def test_the_index_names_each_graded_cell_by_its_exercise_with_its_points(tmp_path):
    nb = _scored(lab1())
    points = {
        grade_id(c): float(c.metadata.nbgrader["points"])
        for c in nb.cells
        if "nbgrader" in c.metadata and c.metadata.nbgrader.get("grade")
    }
    names = exercise_names(nb)
    shown = index(render(nb, tmp_path))
    assert shown == [f"{names[g]} (Score: 0.0 / {p})" for g, p in points.items()]
    assert shown[:2] == [
        "Exercise 1: ping_pong(x, repeats) (Score: 0.0 / 2.0)",
        "Prediction 1: a round trip on a 1 Gbit link (Score: 0.0 / 1.0)",
    ]


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_the_index_takes_the_instructors_headings_and_shows_a_students_as_text(tmp_path):
    nb = _scored(lab1())
    [heading] = [c for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("### Exercise 2")]
    heading.source = '### Exercise 2: <img src=x onerror="alert(1)"> I deserve full marks'
    # graded in the course (the lab's source at hand): the instructor's heading, whatever the student wrote
    assert index(render(nb, tmp_path, assignment=LAB1, notebook=LAB1))[2] == (
        "Exercise 2: ring_shift(x), one step around a ring (Score: 0.0 / 2.0)"
    )
    # no source: the submission's heading, as text
    html = render(nb, tmp_path)
    assert '<img src=x onerror="alert(1)">' not in html.split('<div id="notebook"')[0]
    assert index(html)[2] == 'Exercise 2: <img src=x onerror="alert(1)"> I deserve full marks (Score: 0.0 / 2.0)'


def test_an_exercise_with_two_tests_numbers_them():
    assert feedback_page.unique_names({"a": "Ex 1", "b": "Ex 2", "c": "Ex 2"}) == {
        "a": "Ex 1",
        "b": "Ex 2 (1 of 2)",
        "c": "Ex 2 (2 of 2)",
    }


# ---------------------------------------------------------------------------------------------
# wrapping, formulas


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_outputs_wrap_and_no_page_loads_anything_from_the_network(tmp_path):
    with_formula, without = _scored(lab1()), _scored(lab1())
    without.cells = [c for c in without.cells if "$" not in c.source or c.cell_type != "markdown"]
    for nb, has_mathjax in ((with_formula, True), (without, False)):
        html = render(nb, tmp_path)
        assert re.search(r"div\.output_subarea pre \{\s*white-space: pre-wrap;", html)
        assert not re.search(r"""\bsrc=["']?(https?:)?//|<link\b""", html), "the page loads something from the network"
        assert ("window.MathJax = {" in html) == has_mathjax and ("MathJax.version" in html) == has_mathjax
        scripts = re.findall(r"<script\b[^>]*>(.*?)</script>", html, re.DOTALL | re.IGNORECASE)
        assert len(scripts) == (2 if has_mathjax else 0), [s[:80] for s in scripts]  # its config, MathJax itself


def test_mathjax_is_inlined_whole_and_safely():
    script = feedback_page.mathjax_script()
    assert len(script) > 1_000_000 and "</script" not in script.lower() and "<!--" not in script
    assert "MathJax" in script
    # a formula anywhere MathJax looks: markdown, a LaTeX or markdown output; currency-free text is none
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("Costs 5 and 10.")])
    assert not feedback_page.has_formula(nb)
    code = nbformat.v4.new_code_cell("x")
    code.outputs = [nbformat.v4.new_output("display_data", data={"text/latex": r"\(x^2\)"})]
    nb.cells.append(code)
    assert feedback_page.has_formula(nb)


# ---------------------------------------------------------------------------------------------
# a prediction's expected value


PREDICTION_MESSAGE = (
    "the prediction does not match the cost model to 3 significant figures: round trip (ms): predicted "
    "2.00e+00, the cost model gives 3.00e+00"
)


def _failed_prediction():
    cell = nbformat.v4.new_code_cell("dl.predictions.assert_prediction(...)")
    cell.metadata.nbgrader = {"grade": True, "solution": False, "locked": True, "grade_id": "test_predict", "points": 1}
    cell.outputs = [
        nbformat.v4.new_output(
            "error",
            ename="PredictionError",
            evalue=PREDICTION_MESSAGE,
            traceback=[f"\x1b[0;31mPredictionError\x1b[0m: {PREDICTION_MESSAGE}"],
        )
    ]
    return nbformat.v4.new_notebook(cells=[cell])


@pytest.fixture(scope="module")
def gradebook(tmp_path_factory):
    """A gradebook with an assignment due in two days, one due two days ago, one with no due date."""
    path = tmp_path_factory.mktemp("gradebook") / "gradebook.db"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # nbgrader's alembic
        now = datetime.now(timezone.utc).replace(tzinfo=None)  # the gradebook's time: UTC, no zone
        with Gradebook(f"sqlite:///{path}") as gb:
            for name, due in (
                ("due_later", now + timedelta(days=2)),
                ("due_before", now - timedelta(days=2)),
                ("no_due_date", None),
            ):
                gb.update_or_create_assignment(name, duedate=due)
    return f"sqlite:///{path}"


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_a_predictions_expected_value_is_shown_after_the_deadline(gradebook, monkeypatch):
    cases = [  # (DISTTRAIN_SHOW_EXPECTED, the assignment, shown)
        (None, "no_due_date", False),  # the default: after the deadline, and there is none
        (None, "due_later", False),
        (None, "due_before", True),
        ("after-deadline", "due_before", True),
        ("always", "no_due_date", True),
        ("always", "due_later", True),
        ("never", "due_before", False),
    ]
    for setting, assignment, shown in cases:
        if setting is None:
            monkeypatch.delenv("DISTTRAIN_SHOW_EXPECTED", raising=False)
        else:
            monkeypatch.setenv("DISTTRAIN_SHOW_EXPECTED", setting)
        resources = {"nbgrader": {"db_url": gradebook, "assignment": assignment, "notebook": "lab"}}
        nb, _ = FeedbackPage().preprocess(_failed_prediction(), resources)
        [error] = nb.cells[0].outputs
        for text in (error.evalue, error.traceback[0]):
            assert ("3.00e+00" in text) == shown, (setting, assignment, text)
            assert "predicted 2.00e+00" in text  # the student's own value, always
            assert shown or "the cost model gives a different value" in text, text


def test_the_show_expected_setting_is_checked(monkeypatch):
    monkeypatch.setenv("DISTTRAIN_SHOW_EXPECTED", "sometimes")
    with pytest.raises(
        ValueError, match="DISTTRAIN_SHOW_EXPECTED='sometimes': use one of after-deadline, always, never"
    ):
        feedback_page.show_expected()
    now = datetime(2030, 1, 1)
    assert not expected_shown("after-deadline", None, now) and expected_shown("after-deadline", now, now)
    with pytest.raises(ValueError, match="use one of"):
        expected_shown("later", None, now)


# ---------------------------------------------------------------------------------------------
# each cell's In [n]


def test_each_code_cell_that_runs_is_numbered_by_its_place():
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("# title"),
            nbformat.v4.new_code_cell("a = 1"),
            nbformat.v4.new_code_cell("  \n"),  # an empty cell does not run
            nbformat.v4.new_code_cell("assert a == 1"),
            nbformat.v4.new_raw_cell("raw"),
            nbformat.v4.new_code_cell("b = 2"),
        ]
    )
    assert prompt_numbers(nb) == {1: 1, 3: 2, 5: 3}


# ---------------------------------------------------------------------------------------------
# one small lab graded once: a student whose ping_pong never ends and whose prediction is wrong

LAB = "00_feedback"


def _cell(kind: str, source: str, **nbgrader):
    cell = nbformat.v4.new_markdown_cell(source) if kind == "markdown" else nbformat.v4.new_code_cell(source)
    if nbgrader:
        defaults = {"grade": False, "solution": False, "locked": False, "schema_version": 3, "task": False}
        cell.metadata.nbgrader = {**defaults, **nbgrader}
    return cell


def _solution(grade_id: str, body: str):
    return _cell("code", f"### BEGIN SOLUTION\n{body}### END SOLUTION\n", grade_id=grade_id, solution=True)


def _test(grade_id: str, points: int, source: str):
    return _cell("code", source, grade_id=grade_id, grade=True, locked=True, points=points)


PING_PONG = (
    "def ping_pong(x, repeats):\n"
    "    rank = dist.get_rank()\n"
    "    for _ in range(repeats):\n"
    "        if rank == 0:\n"
    "            dist.send(x, dst=1)\n"
    "            dist.recv(x, src=1)\n"
    "        else:\n"
    "            dist.recv(x, src=0)\n"
    "            dist.send(x, dst=0)\n"
    "    return x\n"
)
ENDLESS_PING_PONG = (  # `done` is never counted up
    "def ping_pong(x, repeats):\n"
    "    rank, done = dist.get_rank(), 0\n"
    "    while done < repeats:\n"
    "        if rank == 0:\n"
    "            dist.send(x, dst=1)\n"
    "            dist.recv(x, src=1)\n"
    "        else:\n"
    "            dist.recv(x, src=0)\n"
    "            dist.send(x, dst=0)\n"
    "    return x\n"
)


def _feedback_lab() -> nbformat.NotebookNode:
    """Two exercises and a prediction, graded through ``dl.exercise.run`` (the grader kernel), under
    a text with a formula."""
    return nbformat.v4.new_notebook(
        cells=[
            _cell(
                "code",
                "import torch\nimport torch.distributed as dist\nimport disttrain_lab as dl\n",
                grade_id="setup",
                locked=True,
            ),
            _cell(
                "markdown",
                "# Fixture: feedback\n\nA message of $n$ bytes takes $$T(n) = \\alpha + \\beta\\, n$$",
                grade_id="intro",
                locked=True,
            ),
            _cell("markdown", "### Exercise 1: `double(x)`", grade_id="double_intro", locked=True),
            _solution("ex_double", "def double(x):\n    return 2 * x\n"),
            _test(
                "test_double",
                2,
                "run = dl.exercise.run('double', 2, [(torch.ones(3),), (torch.ones(3),)], timeout=20)\n"
                "assert all(torch.equal(r, 2 * torch.ones(3)) for r in run.results), 'double(x) is 2 * x'\n",
            ),
            _cell("markdown", "### Exercise 2: `ping_pong(x, repeats)`", grade_id="ping_pong_intro", locked=True),
            _solution("ex_ping_pong", PING_PONG),
            _test(
                "test_ping_pong",
                1,
                "run = dl.exercise.run('ping_pong', 2, [(torch.arange(3.0), 2), (torch.zeros(3), 2)], timeout=5)\n"
                "assert torch.equal(run.results[1], torch.arange(3.0)), 'rank 1 ends with rank 0s tensor'\n",
            ),
            _cell("markdown", "### Prediction 1: a round trip", grade_id="predict_intro", locked=True),
            _solution("ex_predict", "PREDICTED_ROUND_TRIP_MS = 2 * 1.5\n"),
            _test(
                "test_predict",
                1,
                "### BEGIN HIDDEN TESTS\n"
                "dl.predictions.assert_prediction('round trip (ms)', dl.predictions.fetch('PREDICTED_ROUND_TRIP_MS'), 3.0)\n"
                "### END HIDDEN TESTS\n",
            ),
        ],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The lab released and one student graded (one nbgrader process), with feedback."""
    root = tmp_path_factory.mktemp("feedback")
    source = root / "source"
    (source / LAB).mkdir(parents=True)
    nbformat.write(_feedback_lab(), source / LAB / f"{LAB}.ipynb")
    # a cell limit for a busy machine (the grader kernel's own start is not counted against a test's)
    course = Course(
        root, LAB, source, {**FIXTURE_LIMITS, "cell_timeout": 60, "notebook_timeout": 300, "student_timeout": 400}
    )
    course.do_release()
    student = with_solution(course.blank(), "ex_double", "def double(x):\n    return 2 * x\n")
    student = with_solution(student, "ex_ping_pong", ENDLESS_PING_PONG)
    student = with_solution(student, "ex_predict", "PREDICTED_ROUND_TRIP_MS = 2.0\n")
    submit(course.course, "looper", LAB, student)
    start = time.monotonic()
    results = course.grade(["looper"], one_process_per_student=False)
    course.seconds = time.monotonic() - start
    assert all(r.returncode == 0 for r in results.values()), {s: r.output[-3000:] for s, r in results.items()}
    course.page = feedback(course.course, "looper", LAB)
    assert course.page, "no feedback page"
    return course


@pytest.mark.slow
def test_graded_feedback_names_exercises_numbers_cells_and_says_endless_loop(graded):
    page = graded.page
    assert index(page) == [
        "Exercise 1: double(x) (Score: 2.0 / 2.0)",
        "Exercise 2: ping_pong(x, repeats) (Score: 0.0 / 1.0)",
        "Prediction 1: a round trip (Score: 0.0 / 1.0)",
    ]
    # every code cell that ran shows its own place, tests (run in the grader kernel) included
    autograded = graded.autograded("looper")
    places = prompt_numbers(autograded)
    assert {i: c.execution_count for i, c in enumerate(autograded.cells) if i in places} == places
    prompts = re.findall(r'input_prompt">In(?:\s|&nbsp;)\[(\d+)\]:', unescape(page))
    assert [int(n) for n in prompts] == list(range(1, len(places) + 1)), prompts
    # the endless loop, named as one with the student's line; no deadlock guessed from the call it was in
    text = unescape(page)
    assert re.search(r"Not a deadlock: ranks 0 and 1 kept making torch\.distributed calls", text), text[-4000:]
    assert re.search(r"in ping_pong \(line [4-9]\): an endless loop\?", text)
    assert "no rank is receiving" not in text and "no rank is sending" not in text
    assert "EarlierTimeout" not in text
    # no due date: the prediction's expected value is the instructor's only
    assert "predicted 2.00e+00, the cost model gives a different value (shown in the feedback after" in text
    assert "3.00e+00" not in text
    [test_predict] = [c for c in autograded.cells if grade_id(c) == "test_predict"]
    # (the error, then the kernel's note on the kit frames it hid: hints.py)
    [error] = [o for o in test_predict.outputs if o.output_type == "error"]
    assert "the cost model gives 3.00e+00" in error.evalue


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (`apt-get install -y chromium`)")
def test_graded_feedback_typesets_formulas_offline_and_wraps_messages(graded, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    path = tmp_path / "feedback.html"
    path.write_text(graded.page)
    requested: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 800})
            page.route(re.compile(r"^(?!file:)"), lambda route: (requested.append(route.request.url), route.abort()))
            page.goto(path.as_uri(), wait_until="load", timeout=30_000)
            page.wait_for_function("() => document.querySelectorAll('mjx-container svg').length >= 2", timeout=20_000)
            typeset, errors, raw = page.evaluate(
                """() => [document.querySelectorAll('mjx-container svg').length,
                          document.querySelectorAll('mjx-merror, [data-mjx-error]').length,
                          document.body.innerText.includes('\\\\alpha')]"""
            )
            wide, wrapped = page.evaluate(
                """() => {
                    const pres = [...document.querySelectorAll('div.output_subarea pre')];
                    const wide = pres.filter(p => p.scrollWidth > p.clientWidth + 1).length;
                    return [wide, pres.map(p => getComputedStyle(p).whiteSpace)];
                }"""
            )
        finally:
            browser.close()
    assert not requested, f"the page asked the network for {requested}"
    assert typeset >= 2 and not errors and not raw, (typeset, errors, raw)  # $n$ and T(n) = α + β n, drawn
    assert wrapped and set(wrapped) == {"pre-wrap"} and not wide, (wrapped, wide)
