"""Running lab notebooks in tests: execute in a real kernel, blank them as nbgrader releases them."""

from __future__ import annotations

import copy
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from jupyter_client import KernelManager
from nbclient import NotebookClient
from nbformat.corpus.words import generate_corpus_id

from tests import roundtrip
from tests.helpers import REPO, load  # noqa: F401  (load: the lab tests take it from here)

# A lab's time budget is a figure for a quiet 2-core machine (measured and reported with the
# benchmarks); CI machines are shared, so a test allows this factor on top before it calls a
# notebook too slow.  DISTTRAIN_TEST_SLOWDOWN=1 checks the budget itself on a quiet machine.
SLOWDOWN = float(os.environ.get("DISTTRAIN_TEST_SLOWDOWN", "3"))
# what autograding adds to a notebook's own time while its cells run: each test cell's call from
# the grader kernel to the student's (the round trip sums the cells' times as the grader took them,
# not nbgrader's start-up nor the kernels': those 12 s were allowed when it timed the whole step)
GRADING_OVERHEAD_S = 6


def solution_notebook(lab: str) -> Path:
    """Lab ``lab``'s solution notebook (the instructor's version, e.g. ``solution_notebook("03_data_parallel")``)."""
    return REPO / "solutions" / lab / f"{lab}.ipynb"


def nbgrader_meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def cell_by_id(nb, grade_id: str):
    [cell] = [c for c in nb.cells if nbgrader_meta(c).get("grade_id") == grade_id]
    return cell


class UnixSocketKernelManager(KernelManager):
    """A kernel whose channels are unix sockets in a folder of its own: TCP ports picked by the
    client and bound later by the kernel can be taken meanwhile by another process of a busy
    machine ("Address already in use": the kernel dies before replying)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sockets = tempfile.mkdtemp(prefix="nbk-", dir="/tmp" if os.path.isdir("/tmp") else None)
        self.transport, self.ip = "ipc", os.path.join(self.sockets, "k")

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if not restart:
            shutil.rmtree(self.sockets, ignore_errors=True)


def execute(nb, autograding: bool, timeout: int = 240, cwd: Path | None = None) -> tuple[nbformat.NotebookNode, float]:
    """Execute a copy of nb in a fresh kernel, errors kept in the outputs; return it and the seconds taken."""
    nb = copy.deepcopy(nb)
    env = {k: v for k, v in os.environ.items() if k != "NBGRADER_EXECUTION"}
    if autograding:
        env["NBGRADER_EXECUTION"] = "autograde"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this venv's tools
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=True,
        kernel_manager_class=UnixSocketKernelManager,
        resources={"metadata": {"path": str(cwd or REPO)}},
    )
    start = time.perf_counter()
    client.execute(env=env)  # starts the kernel, and shuts it down at the end
    return nb, time.perf_counter() - start


def unique_ids(cells: list) -> list:
    """``cells``, each copy of a cell already in it given an id of its own (as nbformat would, with a warning,
    when it validates a notebook whose cells share ids)."""
    seen = set()
    for cell in cells:
        while cell.get("id") in seen:
            cell["id"] = generate_corpus_id()
        seen.add(cell.get("id"))
    return cells


def errors(cell) -> list[str]:
    return [f"{o.ename}: {o.evalue}" for o in cell.get("outputs", []) if o.output_type == "error"]


def text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")


def graded_cells(nb) -> list:
    return [c for c in nb.cells if nbgrader_meta(c).get("grade")]


def exercise_ids(nb) -> list[str]:
    """The grade ids of a notebook's exercise cells (``ex_...``), in order."""
    return [i for c in nb.cells if (i := nbgrader_meta(c).get("grade_id", "")).startswith("ex_")]


def graded_points(nb) -> dict[str, float]:
    """Each graded cell's grade id and its points."""
    return {nbgrader_meta(c)["grade_id"]: nbgrader_meta(c)["points"] for c in nb.cells if nbgrader_meta(c).get("grade")}


def blank(nb) -> nbformat.NotebookNode:
    """The student's version: what nbgrader's ClearSolutions makes of the solution cells."""
    from nbgrader.preprocessors import ClearSolutions

    nb, _ = ClearSolutions().preprocess(copy.deepcopy(nb), {"metadata": {"path": str(REPO)}})
    return nb


def run_solution(path: Path, budget_s: float, autograding: bool = True) -> nbformat.NotebookNode:
    """The solution notebook executed, checked for what every lab promises: no cell raises,
    every graded cell prints its success line and nothing on stderr (nbgrader zeroes a test
    cell that writes to stderr), all within ``budget_s``.  Returns the executed notebook.

    ``autograding``: the notebook as nbgrader's autograde left it when the solution was
    submitted as a student (graded cells run in the grader kernel), from the lab's round trip
    (made once per session, tests/roundtrip.py); its time is its cells' as autograding ran them,
    each test cell a call from the grader kernel (``GRADING_OVERHEAD_S``).  Otherwise
    the notebook runs here as a student runs it, in one kernel, beside the other labs' folders
    (lab 7's demonstration reads the student's Lab 3 from there, which a graded submission never has)."""
    if autograding:
        trip = roundtrip.round_trip(Path(path).parent.name)
        nb, seconds, budget = trip.course.autograded("full"), trip.full_seconds, budget_s + GRADING_OVERHEAD_S
    else:
        nb, seconds = execute(load(path), autograding, cwd=Path(path).parent)
        budget = budget_s
    failed = {i: errors(c) for i, c in enumerate(nb.cells) if c.cell_type == "code" and errors(c)}
    assert not failed, f"cells raised: {failed}"
    for cell in graded_cells(nb):
        assert "\N{WHITE HEAVY CHECK MARK}" in text(cell), (nbgrader_meta(cell)["grade_id"], text(cell))
        assert not [o for o in cell.outputs if o.get("name") == "stderr"], (
            f"graded cell {nbgrader_meta(cell)['grade_id']} wrote to stderr"
        )
    assert seconds < budget * SLOWDOWN, (
        f"the solution notebook took {seconds:.0f} s, the budget is {budget:g} s "
        f"(x{SLOWDOWN:g} allowed for a loaded machine)"
    )
    return nb


def output_of(nb, marker: str) -> str:
    """The printed text of the first code cell whose source contains ``marker``."""
    return text(next(c for c in nb.cells if c.cell_type == "code" and marker in c.source))


def pictures(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def error_of_last_cell(nb, cwd: Path | None = None) -> str:
    """Execute nb as the grader does; every cell but the last must run cleanly, and the last
    (a graded test cell) must fail.  Returns its error, "ename: evalue"."""
    nb, _ = execute(nb, autograding=True, cwd=cwd)
    for cell in nb.cells[:-1]:
        assert not errors(cell), errors(cell)
    found = errors(nb.cells[-1])
    assert found, "the graded cell passed a wrong answer"
    return found[0]


def base_cells(lab, given, exercises) -> tuple[list, list]:
    """Copies of the lab's setup, its solutions (``ex_<e>`` for each of ``exercises``), its given definitions
    (grade_ids ``given``) and its test helpers, in the notebook's order; and those of them that are solutions."""
    wanted = {"setup", "test_helpers", *given, *(f"ex_{e}" for e in exercises)}
    cells = [copy.deepcopy(c) for c in lab.cells if nbgrader_meta(c).get("grade_id") in wanted]
    return cells, [c for c in cells if nbgrader_meta(c).get("grade_id", "").startswith("ex_")]


def add_wrong_answers(
    lab, cells: list, solutions: list, wrong: list[tuple[str, str]], tests: list[str] | None = None, replace=False
) -> list[int]:
    """Many wrong answers in one kernel: appends to ``cells``, for each ``(exercise, wrong source)``,
    the ``solutions`` cells again (the right answers) with the wrong definition after them
    (``replace``: in the place of the exercise's own cell ``ex_<exercise>``, so that the solutions
    below it are built on it, as in a student's notebook), then ``lab``'s graded cell (``tests[i]``,
    else ``test_<exercise>``), each copy with an id of its own (else nbformat corrects the repeated ids with a
    warning each).  Returns where those graded cells are (``assert_wrong_answers_caught``)."""
    graded_at = []
    for i, (exercise, source) in enumerate(wrong):
        right = [copy.deepcopy(s) for s in solutions]  # the right answers again, then one wrong
        planted = nbformat.v4.new_code_cell(source)
        if replace:
            [at] = [j for j, c in enumerate(right) if nbgrader_meta(c).get("grade_id") == f"ex_{exercise}"]
            right[at] = planted
        graded = copy.deepcopy(cell_by_id(lab, tests[i] if tests else f"test_{exercise}"))
        added = [*(right if replace else [*right, planted]), graded]
        for k, cell in enumerate(added):
            cell["id"] = f"wrong-{i}-{k}"
        cells += added
        graded_at.append(len(cells) - 1)
    return graded_at


def assert_wrong_answers_caught(nb, graded_at: list[int], words: list) -> None:
    """In the executed ``nb``, every cell but the graded ones at ``graded_at`` ran cleanly, and each of
    those failed saying ``words[i]`` (a string, or a tuple of strings that must all be said)."""
    for i, cell in enumerate(nb.cells):
        if i not in graded_at:
            assert not errors(cell), (i, errors(cell))
    for said, at in zip(words, graded_at, strict=True):
        graded = nbgrader_meta(nb.cells[at]).get("grade_id")
        found = errors(nb.cells[at])
        assert found, f"the graded cell {graded} passed a wrong answer"
        for word in (said,) if isinstance(said, str) else said:
            assert word in found[0], (graded, found[0])


# the grade ids of graded predictions' solution cells: ex_predict_NAME (their tests: test_predict_NAME)
PREDICTION_IDS = ("ex_predict_",)


def numbering_problems(nb) -> list[str]:
    """What breaks "one `### Exercise n` per graded exercise cell, numbered 1, 2, … in order, and one
    `##` section per markdown cell" (the table of contents reads well); empty when nothing does.
    Prediction cells (grade id ``ex_predict_*``) need no heading of their own; one under its own
    next ``### Exercise n`` counts as that exercise."""
    import re

    problems, heading, last = [], None, 0
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            lines = cell.source.splitlines()
            if sum(line.startswith("## ") for line in lines) > 1:
                problems.append(f"cell {i} holds several ## sections")
            problems += [
                f"cell {i}: an exercise as a ## section: {line!r}"
                for line in lines
                if line.startswith("## ") and "Exercise" in line
            ]
            for line in lines:
                found = re.match(r"### Exercise (\d+)\b", line)
                if found:
                    heading = int(found.group(1))
        elif nbgrader_meta(cell).get("solution"):
            if nbgrader_meta(cell)["grade_id"].startswith(PREDICTION_IDS) and heading != last + 1:
                continue  # a prediction needs no exercise heading, but may have one (lab 10 numbers them)
            if heading != last + 1:
                problems.append(
                    f"cell {i} ({nbgrader_meta(cell)['grade_id']}) comes under Exercise {heading}, "
                    f"expected Exercise {last + 1}"
                )
            last = heading or last
    return problems


def device_setting(nb, device: str):
    """A new cell: the lab's ``DEVICE = "cpu"`` cell saying ``DEVICE = "<device>"`` instead."""
    cell = next(c for c in nb.cells if c.cell_type == "code" and c.source.rstrip().endswith('DEVICE = "cpu"'))
    return nbformat.v4.new_code_cell(cell.source.replace('DEVICE = "cpu"', f'DEVICE = "{device}"'))


def code_cells_on_device(nb, last_grade_id: str, device: str) -> nbformat.NotebookNode:
    """Every code cell up to the graded cell ``last_grade_id``, with ``DEVICE = device``."""
    upto = nb.cells.index(cell_by_id(nb, last_grade_id))
    cells = [
        device_setting(nb, device) if c.source.rstrip().endswith('DEVICE = "cpu"') else copy.deepcopy(c)
        for c in nb.cells[: upto + 1]
        if c.cell_type == "code"
    ]
    return nbformat.v4.new_notebook(cells=cells)


def execute_without_errors(nb, cwd: Path) -> nbformat.NotebookNode:
    """Execute nb as a student does; no cell may raise.  Returns the executed notebook."""
    nb, _ = execute(nb, autograding=False, cwd=cwd)
    failed = {i: errors(c) for i, c in enumerate(nb.cells) if errors(c)}
    assert not failed, failed
    return nb


def one_rank_notebook(lab: Path, device: str, given: str, exercises, checks: str) -> nbformat.NotebookNode:
    """Lab ``lab``'s setup, ``DEVICE = device``, its given code (the first cell holding ``given``),
    the solution of every exercise (``ex_<name>`` for each name in ``exercises``) and the test
    helpers (no self-checks or graded cells: they use 2-4 ranks), then ``checks``, code that runs
    the exercises on one rank."""
    nb = load(lab)
    setup, device_cell = nb.cells[0], device_setting(nb, device)
    given_cell = next(c for c in nb.cells if given in c.source)
    cells = [
        setup,
        device_cell,
        given_cell,
        *(cell_by_id(nb, f"ex_{e}") for e in exercises),
        cell_by_id(nb, "test_helpers"),
        nbformat.v4.new_code_cell(checks),
    ]
    return nbformat.v4.new_notebook(cells=[copy.deepcopy(c) for c in cells])


_SELF_CHECK = re.compile(r'\s*"([^"]+)",\s*globals\(\)\.get\("(\w+)"\)\s*(?:,\s*(?:cases=)?([\w\[].*?))?\s*', re.S)


def self_check_problems(nb) -> tuple[list[str], list[tuple[str, str, str | None]]]:
    """Whether the prediction self-checks of ``nb`` (a solution or a released notebook) could hold
    an answer: each must be ``dl.predictions.check(name, globals().get("X"))``, with the cases
    after it for a function, and nothing more; no code cell may hold a hex string (a digest).
    Returns the problems and each self-check's (name, variable, cases text or None)."""
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    problems = [f"a hex string in a code cell: {h}" for h in re.findall(r"\b(?=[0-9]*[a-f])[0-9a-f]{16,}\b", code)]
    calls = []
    for call in re.findall(r"dl\.predictions\.check\((.*?)\)\s*(?:\n|$)", code, re.S):
        found = _SELF_CHECK.fullmatch(call)
        if found:
            calls.append((found[1], found[2], found[3]))
        else:
            problems.append(f"a self-check that passes more than the name, the value and the cases: check({call})")
    return problems, calls


def prediction_problems(nb) -> list[str]:
    """What breaks the pattern of a lab's graded predictions; empty when nothing does.

    A self-check is ``dl.predictions.check(name, globals().get("X"))`` for a number, with the
    graded cases after it for a function, and nothing else: no argument that could hold the
    answer (a digest of a 3-figure number is found by search in well under a second), and no
    hex string anywhere in the notebook's code.  A number (``PREDICTED_X = ...``): the solution's
    value passes its self-check, lies away from a rounding boundary, and one 1-point graded test
    fetches it under the same name.  A function (a solution cell ``ex_predict_X`` defining one):
    its self-check's cases are cases of the graded cell ``test_predict_X`` (the form is checked
    where it is graded) and the solution passes it.  A lab with neither is a problem too."""
    import ast
    import contextlib
    import io
    import math
    import re

    from disttrain_lab import predictions

    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    problems, calls = self_check_problems(nb)
    checks, function_checks = [], {}
    for name, variable, cases in calls:
        if cases is None:
            checks.append((name, variable))
        else:
            function_checks[variable] = (name, cases)
    quiet = contextlib.redirect_stdout(io.StringIO())
    for name, variable in checks:
        [solution] = [c for c in nb.cells if nbgrader_meta(c).get("solution") and f"{variable} =" in c.source]
        namespace: dict = {}
        exec(solution.source, namespace)
        value = float(namespace[variable])
        with quiet:
            predictions.check(name, value)
        exponent = math.floor(math.log10(abs(value)))
        step = 10.0 ** (exponent - predictions.SIG + 1)  # one unit in the last significant figure
        boundary = (math.floor(value / step) + 0.5) * step
        if abs(value - boundary) <= 1e-6 * abs(value) or abs(value - boundary + step) <= 1e-6 * abs(value):
            problems.append(f"{name}: {value} lies within 1e-6 of a rounding boundary of {predictions.SIG} figures")
        tests = [c for c in nb.cells if nbgrader_meta(c).get("grade") and f'fetch("{variable}")' in c.source]
        if len(tests) != 1 or f'"{name}"' not in tests[0].source or nbgrader_meta(tests[0]).get("points") != 1:
            problems.append(f"{name}: expected one 1-point graded test that fetches {variable} under this name")
    functions = 0
    for cell in nb.cells:
        grade_id = nbgrader_meta(cell).get("grade_id", "")
        if not grade_id.startswith("ex_predict_"):
            continue
        defined = [n.name for n in ast.parse(cell.source).body if isinstance(n, ast.FunctionDef)]
        if not defined:
            continue  # a number: checked above
        functions += 1
        namespace = {"math": math}  # (the lab's setup cell imports it)
        exec(compile(cell.source, f"<{grade_id}>", "exec"), namespace)
        [fn_name] = defined
        test = cell_by_id(nb, "test_" + grade_id[3:]).source
        cases = ast.literal_eval(re.search(r"^_cases = (\[.*?\])", test, re.M).group(1))
        if fn_name not in function_checks:
            problems.append(f"{grade_id}: no self-check of {fn_name}")
            continue
        name, given = function_checks[fn_name]
        defined_as = re.search(rf"^{re.escape(given)} = (\[.*\])", code, re.M) if given.isidentifier() else None
        checked = ast.literal_eval(defined_as[1] if defined_as else given)
        if not checked or any(tuple(c) not in cases for c in checked):
            problems.append(f"{grade_id}: the self-check's cases {checked} are not all graded cases {cases}")
        with quiet:
            predictions.check(name, namespace[fn_name], checked)
    if not checks and not functions:
        problems.append("no dl.predictions.check(...) self-check found")
    return problems


def _graded_predictions_run(lab: Path, prediction: str, tests: list[str], given: tuple[str, ...] = ()):
    """The lab's setup cell, its cells ``given``, ``prediction`` (the student's cell) and the graded
    prediction tests ``tests``, executed as autograding runs them."""
    nb = load(lab)
    cells = [nb.cells[0], *(cell_by_id(nb, g) for g in given), nbformat.v4.new_code_cell(prediction)]
    cells += [cell_by_id(nb, t) for t in tests]
    done, _ = execute(
        nbformat.v4.new_notebook(cells=[copy.deepcopy(c) for c in cells]), autograding=True, cwd=lab.parent
    )
    return done


def errors_of_graded_predictions(lab: Path, prediction: str, tests: list[str], given: tuple[str, ...] = ()) -> list:
    """The errors each graded prediction test in ``tests`` gives a student whose notebook holds
    the setup cell, the lab's cells ``given`` (e.g. its test helpers) and ``prediction`` (the
    student's cell), graded as autograding runs them; one list of errors per test, in order."""
    done = _graded_predictions_run(lab, prediction, tests, given)
    return [errors(c) for c in done.cells[-len(tests) :]]


def notebook_of(cells: list) -> nbformat.NotebookNode:
    """A notebook of copies of ``cells``, each given an id of its own (a cell there twice keeps one id, which
    nbformat corrects with a warning)."""
    cells = [copy.deepcopy(c) for c in cells]
    for i, cell in enumerate(cells):
        cell["id"] = f"cell-{i}"
    return nbformat.v4.new_notebook(cells=cells)


def errors_of_wrong_predictions(lab: Path, cases: list[tuple[str, str]]) -> list[str]:
    """Many wrong predictions in one kernel (a kernel's start is about 5 s of CPU): the setup cell, then for
    each ``(graded prediction test, the cell a student wrote)`` that cell and the test, executed as autograding
    runs them.  Every cell but the tests must run cleanly; returns each test's error, "ename: evalue" ("" where
    it passed)."""
    nb = load(lab)
    cells = [nb.cells[0]]
    for test, cell in cases:
        cells += [nbformat.v4.new_code_cell(cell), cell_by_id(nb, test)]
    done, _ = execute(notebook_of(cells), autograding=True, cwd=lab.parent)
    for i, cell in enumerate(done.cells):
        if i == 0 or i % 2:  # the setup cell and the students' cells
            assert not errors(cell), (i, errors(cell))
    return [(errors(cell) or [""])[0] for cell in done.cells[2::2]]


def prediction_cells_problems(nb, predictions) -> list[str]:
    """``prediction_problems`` of ``nb``, and a graded prediction cell worth other than 1 point (of
    the grade ids ``predictions`` names, without ``test_``)."""
    points = {g: cell_by_id(nb, f"test_{g}").metadata.nbgrader.points for g in predictions}
    return prediction_problems(nb) + [f"test_{g} is worth {p} points, not 1" for g, p in points.items() if p != 1]


def assert_prediction_verdicts(nb, grade_id: str, right, wrongs) -> None:
    """The graded prediction cell ``test_<grade_id>`` passes ``right`` (a one-line function) and
    fails each of ``wrongs`` with the kit's rule (3 significant figures)."""
    from disttrain_lab.predictions import PredictionError

    prediction_verdict(nb, f"test_{grade_id}", right)
    for wrong in wrongs:
        try:
            prediction_verdict(nb, f"test_{grade_id}", wrong)
        except PredictionError as exc:
            assert "does not match the cost model to 3 significant figures" in str(exc), str(exc)
        else:
            raise AssertionError(f"test_{grade_id} passed a wrong prediction")


def prediction_verdict(nb, test_id: str, predicted) -> None:
    """Run the graded prediction cell ``test_id`` of ``nb`` in this process, with ``predicted`` (the
    student's one-line function) read as ``dl.predictions.fetch`` reads it: its value at each case.
    Returns when the cell passes; raises what it raises (a PredictionError for a wrong prediction).
    The lab's setup and test-helper cells (where it has them) run first, as in the grader kernel; no
    kernel, no ranks."""

    def fetch(name, cases=None, timeout=30.0):
        return [float(predicted(*case)) for case in cases]

    namespace = {"__name__": "__prediction_test__"}
    helpers = [c for c in nb.cells if nbgrader_meta(c).get("grade_id") == "test_helpers"]  # a lab may have none
    for cell in (nb.cells[0], *helpers):
        exec(compile(cell.source, f"<{nbgrader_meta(cell)['grade_id']}>", "exec"), namespace)
    source = cell_by_id(nb, test_id).source
    assert "dl.predictions.fetch(" in source and "dl.predictions.assert_prediction(" in source, test_id
    visible = source.split("### BEGIN HIDDEN TESTS")[0]
    assert "assert_prediction" not in visible, f"{test_id}: the reference must sit in the hidden tests"
    namespace["_fetch"] = fetch  # the cell's own dl.predictions.fetch, reading ``predicted`` instead
    exec(compile(source.replace("dl.predictions.fetch(", "_fetch("), f"<{test_id}>", "exec"), namespace)
