"""Lab 12 (running a training job; part 1: reading a merged profile): the solution notebook runs, its
graded tests catch wrong answers, and the traces they grade on are built with their answers.

- The notebook's structure: the exercises and the prediction in order, with their points; the hidden
  tests on traces of 3 and 4 ranks; the rules the hidden tests check stated in the text and exercised
  by a visible self-check (the union across threads, the exact "dl:" prefix, the point-to-point calls
  and waits that are not collectives, a gloo slice inside another).
- The grader's traces: each answer built by construction (``labtests/lab12.built_trace``) equals the
  one read from the trace by this file's own reading (an interval union, written here, not shipped),
  for many seeds; the answers differ between ranks and the stragglers between collectives.
- The prediction: the graded cell passes the α–β model and fails the usual slips.
- The solution notebook executes top to bottom in a real kernel, as the grader runs it and as a
  student runs it, within the budget (BUDGET_S), with its pictures; what it prints is what the text
  says (the straggler of each step's first all-reduce, exposed communication at or above the model).
- Wrong answers (a sum of durations with no union, the main thread only, a "dl" prefix without its
  colon, the first rank into a collective, the waits counted as collectives, an overlap that does not
  take the union of gloo's slices) fail the right graded cell with a message that says why.

The blank notebook failing every graded cell, and the autograde round trip, are in test_grading.py.
"""

from __future__ import annotations

import re

import nbformat
import pytest

from disttrain_lab.labtests import lab12
from tests.notebooks import (
    add_wrong_answers,
    assert_wrong_answers_caught,
    base_cells,
    cell_by_id,
    execute,
    load,
    nbgrader_meta,
    output_of,
    pictures,
    prediction_problems,
    run_solution,
    solution_notebook,
)

LAB = solution_notebook("12_running_jobs")
BUDGET_S = 120  # the whole solution notebook on 2 cores: three profiled 4-rank runs of 3 steps, each merged
EXERCISES = ["predict_exposed", "exposed", "stragglers", "overlap"]


# ----------------------------------------------------------------------------------------
# The notebook's structure (fast)


def test_exercises_points_and_hidden_tests():
    nb = load(LAB)
    ids = [nbgrader_meta(c).get("grade_id") for c in nb.cells if nbgrader_meta(c)]
    assert [i for i in ids if i.startswith("ex_")] == [f"ex_{e}" for e in EXERCISES]
    points = {
        nbgrader_meta(c)["grade_id"]: nbgrader_meta(c)["points"] for c in nb.cells if nbgrader_meta(c).get("grade")
    }
    assert points == {"test_predict_exposed": 1, "test_exposed": 2, "test_stragglers": 2, "test_overlap": 2}
    hidden = "".join(
        part.split("### END HIDDEN TESTS")[0]
        for e in EXERCISES
        for part in cell_by_id(nb, f"test_{e}").source.split("### BEGIN HIDDEN TESTS")[1:]
    )
    for check in ("check_exposed_communication", "check_stragglers", "check_overlap_fraction"):
        # the hidden traces are drawn at grading time (seed None): labtests/lab12.py is installed with the kit
        assert f"lab_tests.{check}(None, 3, " in hidden and f"lab_tests.{check}(None, 4, " in hidden, check
    assert "dl.predictions.assert_prediction(" in hidden
    seeds = re.findall(r"lab_tests\.check_\w+\((\d+),", "\n".join(c.source for c in nb.cells if c.cell_type == "code"))
    assert len(seeds) == len(set(seeds)) == 3 and not re.search(r"lab_tests\.check_\w+\(\d+,", hidden), seeds


def test_every_hidden_rule_is_stated_and_exercised_by_a_visible_self_check():
    nb = load(LAB)
    text_cells = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for rule in (
        'whose name begins with `"dl:"` (exactly: `"dl loader"` is not one)',
        "on **any** of the rank's threads",
        "counts **once**: the length of their union",
        "`dl:send`, `dl:recv`, `dl:isend`, `dl:irecv` and any\n  `dl:wait(...)`",
        "(a tie goes\n  to the lower rank)",
        'the union of the rank\'s slices whose name begins with `"gloo:"`',
        'no `"gloo:"` slice returns 0.0',
        "come in no particular order",
    ):
        assert rule in text_cells, rule
    small = cell_by_id_source(nb, "SMALL = {")
    for piece in (
        '_slice("dl:wait(irecv)", 0, 200.0, 100.0, tid=2)',  # a wait on a second thread, overlapping the first's
        '_slice("dl loader", 0, 300.0, 100.0)',  # "dl" without its colon
        '_slice("gloo:recv", 0, 20.0, 20.0)',  # a gloo slice inside another
        '_slice("dl:isend", 1, 10.0, 5.0)',  # a point-to-point call: exposed, not a collective
        '"ph": "i"',  # an instant: no dur
    ):
        assert piece in small, piece
    visible = "\n".join(c.source.split("### BEGIN HIDDEN TESTS")[0] for c in nb.cells if c.cell_type == "code")
    for call in ("exposed_communication(SMALL, 0)", "stragglers(SMALL) == [1, 0]", "overlap_fraction(SMALL, 0)"):
        assert call in visible, call


def cell_by_id_source(nb, marker: str) -> str:
    [cell] = [c for c in nb.cells if c.cell_type == "code" and marker in c.source]
    return cell.source


def test_the_prediction_is_graded_on_the_model_and_its_self_check_knows_no_answer():
    nb = load(LAB)
    assert prediction_problems(nb) == []
    source = cell_by_id(nb, "test_predict_exposed").source
    model = 4 * sum(2 * 3 * (100e-6 + 4 * n / 4 / 1.25e7) for n in (256 * 256, 256)) * 1e3
    wrongs = [
        model * 3 / 2,  # 2N steps instead of 2(N-1)
        4 * sum(2 * 3 * (100e-6 + 4 * n / 1.25e7) for n in (256 * 256, 256)) * 1e3,  # whole tensors, not S/N
        4 * 2 * 3 * (100e-6 + 4 * 256 * 256 / 4 / 1.25e7) * 1e3,  # the biases forgotten
        model / 4,  # one layer
    ]
    from disttrain_lab.predictions import PredictionError

    def verdict(value):
        namespace = {"__name__": "__prediction_test__"}
        exec(compile(nb.cells[0].source, "<setup>", "exec"), namespace)
        namespace["_fetch"] = lambda name, cases=None, timeout=30.0: value
        exec(compile(source.replace("dl.predictions.fetch(", "_fetch("), "<test>", "exec"), namespace)

    verdict(model)
    for wrong in wrongs:
        with pytest.raises(PredictionError, match="does not match the cost model to 3 significant figures"):
            verdict(wrong)


# ----------------------------------------------------------------------------------------
# The grader's traces


def _union(spans):
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _spans(trace, rank, prefix):
    return [
        (e["ts"], e["ts"] + e["dur"])
        for e in trace["traceEvents"]
        if e["ph"] == "X" and e["pid"] == rank and e["name"].startswith(prefix)
    ]


def _read(trace):
    """The three readings, done here the direct way (the tests' own, not shipped with the kit)."""
    n = trace["disttrain_lab"]["world_size"]
    exposed = [_union(_spans(trace, r, "dl:")) for r in range(n)]
    overlap = []
    for r in range(n):
        moving, waits = _spans(trace, r, "gloo:"), _spans(trace, r, "dl:")
        inside = _union([(max(a, c), min(b, d)) for a, b in moving for c, d in waits if min(b, d) > max(a, c)])
        overlap.append((_union(moving) - inside) / _union(moving))
    p2p = ("dl:send", "dl:recv", "dl:isend", "dl:irecv")
    entered = [
        sorted(
            e["ts"]
            for e in trace["traceEvents"]
            if e["ph"] == "X"
            and e["pid"] == r
            and e["name"].startswith("dl:")
            and e["name"] not in p2p
            and not e["name"].startswith("dl:wait(")
        )
        for r in range(n)
    ]
    stragglers = [max(range(n), key=lambda r: (entered[r][k], -r)) for k in range(len(entered[0]))]
    return exposed, stragglers, overlap


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_answers_built_with_a_trace_are_the_ones_read_from_it(world_size):
    seen = set()
    for seed in range(40):
        trace, answers = lab12.built_trace(seed, world_size)
        exposed, stragglers, overlap = _read(trace)
        assert exposed == pytest.approx(answers["exposed"], rel=1e-9)
        assert stragglers == answers["stragglers"]
        assert overlap == pytest.approx(answers["overlap"], rel=1e-9)
        # the naive readings differ: a sum of durations counts the overlapping waits twice
        summed = [sum(b - a for a, b in _spans(trace, r, "dl:")) for r in range(world_size)]
        assert any(s > e * 1.001 for s, e in zip(summed, answers["exposed"]))
        seen.add(tuple(stragglers))
        assert len(set(answers["exposed"])) == world_size  # every rank its own answer
    assert len(seen) > 10  # the stragglers differ from trace to trace


def test_the_graders_traces_vary_and_the_visible_ones_are_not_the_hidden():
    nb = load(LAB)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    calls = re.findall(r"lab_tests\.check_(\w+)\((\d+), (\d+),", code)
    traces = {(int(seed), int(n)): lab12.built_trace(int(seed), int(n)) for _, seed, n in calls}
    answers = [tuple(a["exposed"]) for _, a in traces.values()]
    assert len(set(answers)) == len(answers) == 3
    # a hidden case's trace is drawn afresh each time
    assert lab12.built_trace(None, 3)[1] != lab12.built_trace(None, 3)[1]


# ----------------------------------------------------------------------------------------
# Executing it (slow)


@pytest.mark.slow
@pytest.mark.parametrize("autograding", [True, False], ids=["grader", "student"])
def test_solution_notebook_executes_within_budget(autograding):
    nb = run_solution(LAB, BUDGET_S, autograding)
    assert pictures(nb) >= 4, "the run without overlap, predicted against measured, the straggler, the overlap"
    stragglers = output_of(nb, "# Self-check: SMALL by hand (rank 1 calls")
    first = re.search(r"the straggler of each step's first all-reduce: \[([\d, ]+)\]", stragglers)
    assert first and first[1].split(", ").count("2") >= 2, stragglers  # rank 2, 200 ms late each step
    measured = output_of(nb, "# Self-check: the small trace by hand")
    exposed = [float(x) for x in re.search(r"ranks 0-3: \[([\d., ]+)\]", measured)[1].split(",")]
    model = 4 * sum(2 * 3 * (100e-6 + 4 * n / 4 / 1.25e7) for n in (256 * 256, 256)) * 1e3
    assert min(exposed) >= model * 0.97, (exposed, model)  # the link's time is a floor (the clocks' error aside)


def _replaced(grade_id: str, right: str, wrong: str) -> str:
    source = cell_by_id(load(LAB), grade_id).source
    assert right in source, right
    return source.replace(right, wrong)


# Wrong answers the graded tests must catch: (graded cell, wrong definition, words the failure must contain)
WRONG = [
    (
        "exposed",  # the durations summed: overlapping waits counted twice
        """
def exposed_communication(trace, rank):
    return sum(e["dur"] for e in trace["traceEvents"]
               if e.get("ph") == "X" and e.get("pid") == rank and e["name"].startswith("dl:"))
""",
        "the union of the rank's slices whose name begins with 'dl:'",
    ),
    (
        "exposed",  # the main thread only (the thread of the rank's first dl: slice)
        _replaced(
            "ex_exposed",
            'if e.get("ph") == "X" and e.get("pid") == rank and e.get("name", "").startswith("dl:"))',
            'if e.get("ph") == "X" and e.get("pid") == rank and e.get("name", "").startswith("dl:")'
            " and e.get('tid') == 1000)",
        ),
        "on every thread of its pid",
    ),
    (
        "exposed",  # its input looked up among the kit's own traces: the visible case is one, the hidden ones none
        """
def exposed_communication(trace, rank):
    from disttrain_lab.labtests import lab12
    for seed in range(50):
        built, answers = lab12.built_trace(seed, trace["disttrain_lab"]["world_size"])
        if built == trace:
            return answers["exposed"][rank]
    return 0.0
""",
        "a 3-rank trace drawn at grading time",
    ),
    (
        "exposed",  # "dl" without its colon: a region named "dl loader" counted as a call
        _replaced("ex_exposed", '.startswith("dl:"))', '.startswith("dl"))'),
        "expected",
    ),
    (
        "stragglers",  # the first rank into each collective
        _replaced("ex_stragglers", "key=lambda r: (entered[r][k], -r)", "key=lambda r: (-entered[r][k], -r)"),
        "the rank whose slice of it starts last",
    ),
    (
        "stragglers",  # the waits counted as collectives: the ranks' counts differ, and the student's line says so
        _replaced("ex_stragglers", ' and not e["name"].startswith("dl:wait(")', ""),
        ("IndexError", "in stragglers"),
    ),
    (
        "overlap",  # one minus exposed over gloo's time: the kit's calls outside gloo's time counted too
        """
def overlap_fraction(trace, rank):
    def total(prefix):
        return sum(e["dur"] for e in trace["traceEvents"]
                   if e.get("ph") == "X" and e.get("pid") == rank and e["name"].startswith(prefix))
    return max(0.0, 1 - total("dl:") / total("gloo:"))
""",
        "over all the time gloo moved its data",
    ),
    (
        "overlap",  # gloo's slices not united: a copy inside another counted twice
        _replaced("ex_overlap", "total = union_length(moving)", "total = sum(b - a for a, b in moving)"),
        "overlaps once",
    ),
]


@pytest.mark.slow
def test_graded_cells_catch_wrong_answers():
    """One kernel: the setup and solutions, then for each wrong answer the solutions again, the wrong
    definition and its graded cell."""
    lab = load(LAB)
    cells, solutions = base_cells(lab, [], [e for e in EXERCISES if e != "predict_exposed"])
    graded_at = add_wrong_answers(lab, cells, solutions, [(graded, wrong) for graded, wrong, _ in WRONG])
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, timeout=240, cwd=LAB.parent)
    assert_wrong_answers_caught(nb, graded_at, [message for _, _, message in WRONG])
