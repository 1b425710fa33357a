"""Lab 5 (pipeline parallelism): the solution notebook runs, its graded tests can fail, and the
pipeline bench harness and Gantt chart work.

- The solution notebook executes top to bottom in a real kernel as the grader runs it
  (NBGRADER_EXECUTION set), within the 4-minute budget, every graded cell passing, with its
  Gantt charts, bubble plot and bench table.
- The blank notebook (solutions cleared the way nbgrader releases it) fails every graded cell,
  quickly.  Wrong answers (a split with as many layers per stage instead of balanced parameters,
  GPipe that runs F,B,F,B, activations sent to a non-neighbour, micro-batch losses not scaled,
  a received activation without requires_grad_(), 1F1B that runs GPipe's order) fail the right
  graded cell with a message that says why; GPipe with its backwards in reverse order passes;
  1F1B is graded on its own (the grader's micro-batch helpers where exercise 3's fail).
  Timing (bubble) checks sit in graded cells of their own.
- viz.pipeline_idle / pipeline_schedule on a traced run; bench.bench_pipeline /
  format_pipeline_table / `disttrain-lab bench pipeline`, on the solution's functions.

The notebook helpers come from tests/notebooks.py; the autograde round trip lives in test_grading.py.
"""

from __future__ import annotations

import copy
import functools
import os
import re

import nbformat
import pytest

import disttrain_lab as dl
from disttrain_lab import bench
from disttrain_lab.labtests import lab05
from tests import benchreport
from tests.helpers import (
    gpu_count,
    needs_gpus,
    notebook_names,
    observed_from_outside,
    shm_clear,
    source_of,
)
from tests.notebooks import (
    add_wrong_answers,
    assert_prediction_verdicts,
    assert_wrong_answers_caught,
    cell_by_id,
    error_of_last_cell,
    errors,
    execute,
    load,
    output_of,
    pictures,
    prediction_cells_problems,
    run_solution,
    solution_notebook,
    text,
)

LAB = solution_notebook("05_pipeline")
BUDGET_S = 240  # the issue's budget for the whole solution notebook on 2 cores
EXERCISES = {
    "split": "def split_stages(",
    "naive": "def naive_step(",
    "gpipe": "def gpipe_step(",
    "1f1b": "def one_f_one_b_step(",
}
TESTS = {
    "split": ["test_split"],
    "naive": ["test_naive", "test_naive_bubble"],
    "gpipe": ["test_gpipe", "test_gpipe_bubble"],
    "1f1b": ["test_1f1b", "test_1f1b_bubble"],
}
# The graded predictions: (grade id, the right one-line function, wrong ones a student may write)
PREDICTIONS = {
    "predict_step_time": (
        lambda p, m, rows, cost: (m + p - 1) * 3 * cost * rows / m,
        [
            lambda p, m, rows, cost: (m + p - 1) * 3 * cost * rows,  # a slot as long as the whole batch
            lambda p, m, rows, cost: (m + p - 1) * 2 * cost * rows / m,  # backward as long as forward
            lambda p, m, rows, cost: m * 3 * cost * rows / m,  # no bubble
        ],
    ),
    "predict_stage_bytes": (
        lambda rows, width, m: 8 * rows * width,
        [
            lambda rows, width, m: 4 * rows * width,  # activations only
            lambda rows, width, m: 8 * rows * width * m,  # the whole batch once per micro-batch
        ],
    ),
    "predict_held": (
        lambda s, p, m: min(p - s, m),
        [
            lambda s, p, m: m,  # GPipe's
            lambda s, p, m: p - s,  # without the short-step case m < p − s
            lambda s, p, m: min(p - s - 1, m),  # the warm-up forwards only
        ],
    ),
}
FUNCTIONS = ["split_stages", "Stage", "naive_step", "gpipe_step", "one_f_one_b_step"]


@pytest.fixture(scope="module")
def solution() -> dict:
    """The solution notebook's functions, as `disttrain-lab bench pipeline` loads them."""
    return bench.functions_from_notebook(LAB, FUNCTIONS)


# ----------------------------------------------------------------------------------------
# The notebook's structure (fast)


def test_hidden_tests_cover_the_issue():
    # p = 2, 3, 4; several m, uneven micro-batches; bubble on 4 stages at m = 1, 2, 4, 8
    nb = load(LAB)
    hidden = "".join(
        part.split("### END HIDDEN TESTS")[0]
        for ts in TESTS.values()
        for t in ts
        for part in cell_by_id(nb, t).source.split("### BEGIN HIDDEN TESTS")[1:]
    )
    for needle in (
        "(4, 11, 3)",
        "(4, 16, 8)",
        "(3, 10, 4)",
        "(2, 9, 2)",
        "(4, 13, 6)",
        "check_gpipe_bubble(4, [1, 2, 4, 8])",
        "check_1f1b_bubble(4, [2, 8]",
    ):
        assert needle in hidden, needle
    checks = source_of(lab05)  # the checks these cases call
    assert "BUBBLE_BELOW, BUBBLE_ABOVE = 0.08, 0.15" in checks and "common.run_or_fail(driver, p, args" in checks


def test_timing_checks_sit_in_their_own_graded_cells():
    # a busy machine must not cost a correct schedule its correctness points
    nb = load(LAB)
    for correctness in ("naive", "gpipe", "1f1b"):
        assert "_bubble(" not in cell_by_id(nb, f"test_{correctness}").source, correctness
    for timing in ("naive", "gpipe", "1f1b"):
        source = cell_by_id(nb, f"test_{timing}_bubble").source
        assert f"lab_tests.check_{timing}_bubble(" in source.split("### BEGIN HIDDEN TESTS")[0], timing  # visibly too
        assert not [c for c in ("naive", "gpipe", "1f1b") if f"check_{c}(" in source], timing


def test_predictions_self_checks_hold_no_answer():
    # each self-check checks the form at graded cases; it holds no answer (nor any digest of one)
    assert prediction_cells_problems(load(LAB), PREDICTIONS) == []


@pytest.mark.parametrize("grade_id", list(PREDICTIONS))
def test_graded_prediction_passes_the_right_formula_and_fails_wrong_ones(grade_id):
    assert_prediction_verdicts(load(LAB), grade_id, *PREDICTIONS[grade_id])


@pytest.mark.slow
def test_wrong_prediction_fails_its_graded_cell_in_a_kernel():
    # read from the student's kernel through dl.exercise.run, as the grader reads it
    lab = load(LAB)
    wrong = copy.deepcopy(cell_by_id(lab, "ex_predict_held"))
    wrong.source = "def predicted_held(s, p, m):\n    return m\n"
    nb = nbformat.v4.new_notebook(
        cells=[copy.deepcopy(c) for c in (lab.cells[0], cell_by_id(lab, "test_helpers"))]
        + [wrong, copy.deepcopy(cell_by_id(lab, "test_predict_held"))]
    )
    found = error_of_last_cell(nb, LAB.parent)
    assert "predicted_held(0, 4, 8): predicted 8.00e+00, the cost model gives 4.00e+00" in found, found


# ----------------------------------------------------------------------------------------
# Executing it (slow)


@pytest.mark.slow
def test_solution_notebook_executes_within_budget():
    nb = run_solution(LAB, BUDGET_S)
    table = output_of(nb, "bench.format_pipeline_table(rows)")
    for name in ("naive", "GPipe m=8", "1F1B m=8", f"{bench.TORCH_PIPELINE} m=4"):
        assert name in table, table
    assert pictures(nb) >= 3, f"expected the naive Gantt, the bubble plot and the three schedules, got {pictures(nb)}"
    slider = next(c for c in nb.cells if "widgets.interact(show_gpipe" in c.source)
    # the slider was built and shown: its widget's repr (the view itself, a widget manager's job, is
    # dropped from an autograded notebook with the rest of what could run in a browser: grading/sanitize.py)
    shown = [o.get("data", {}).get("text/plain", "") for o in slider.outputs]
    assert any(t.startswith("interactive(children=(SelectionSlider(") for t in shown), shown


# Wrong answers the graded tests must catch: (solution cell, wrong source, graded cell, words the failure must contain)
WRONG = [
    (
        "split",
        """
def split_stages(model, num_stages):          # as many blocks per stage, not as many parameters
    children = list(model.named_children())
    starts = [i for i, (_, layer) in enumerate(children) if i == 0 or list(layer.parameters())]
    bounds = [starts[len(starts) * s // num_stages] for s in range(num_stages)] + [len(children)]
    return [nn.Sequential(OrderedDict(children[a:b])) for a, b in zip(bounds, bounds[1:])]
""",
        "test_split",
        "the most balanced split",
    ),
    # (the order from the data's times on the wire, as the grader reads it; the counted bytes for a stray message)
    ("gpipe", "F, B, F, B", "test_gpipe", "GPipe runs every forward before any backward"),
    ("gpipe", "activations to the last stage", "test_gpipe", "from rank 0 to rank 2"),
    ("gpipe", "unscaled", "test_gpipe", "scale each micro-batch's loss by rows / batch"),  # visible: 4 even ones
    ("gpipe", "no requires_grad_", "test_gpipe", "call inputs.requires_grad_() on the received buffer"),
    (
        "1f1b",
        """
def one_f_one_b_step(stage, x, y, micro_batches):   # GPipe's order under 1F1B's name
    return gpipe_step(stage, x, y, micro_batches)
""",
        "test_1f1b",
        "in 1F1B stage 0 holds at most p − s = 2 micro-batches",
    ),
]


def wrong_gpipe(kind: str, source: str) -> str:
    """The solution's GPipe cell with one mistake."""
    if kind == "F, B, F, B":  # each micro-batch's backward right after its forward: no pipelining
        return source.replace(
            "    stash = [forward_microbatch(stage, xs[i], ys[i], i, len(x), sends, posted[i]) for i in range(micro_batches)]\n"
            "    posted = [None if stage.is_last else receive(outputs.shape, stage.index + 1, stage.device) for _, outputs in stash]\n"
            "    loss = sum(backward_microbatch(stage, inputs, outputs, i, sends, posted[i])\n"
            "               for i, (inputs, outputs) in enumerate(stash))",
            "    loss = sum(backward_microbatch(stage, *forward_microbatch(stage, xs[i], ys[i], i, len(x), sends, posted[i]),\n"
            "                                   i, sends) for i in range(micro_batches))",
        )
    if kind == "unscaled":  # the sum of the micro-batch means: m times the gradient
        return source.replace(" * (len(y) / batch)", "")
    if kind == "no requires_grad_":  # the received activation is a plain tensor: inputs.grad stays None
        return source.replace("        inputs.requires_grad_()\n", "")
    if kind == "B(m-1) ... B0":  # the lecture's order: backwards in reverse (accepted)
        return source.replace(
            "for i, (inputs, outputs) in enumerate(stash))",
            "for i, (inputs, outputs) in reversed(list(enumerate(stash))))",
        ).replace("for _, outputs in stash]", "for _, outputs in reversed(stash)][::-1]")
    if kind == "activations to the last stage":  # every stage also copies its activation to the last one
        return source.replace(
            "        sends.append(dist.isend(outputs.detach(), dst=stage.index + 1))",
            "        sends.append(dist.isend(outputs.detach(), dst=stage.index + 1))\n"
            "        if stage.index + 1 != stage.count - 1:\n"
            "            sends.append(dist.isend(outputs.detach(), dst=stage.count - 1))",
        ).replace(
            "    if stage.is_first:\n        inputs = x\n    else:",
            "    for src in range(stage.count - 2) if stage.is_last else ():\n"
            "        dist.recv(torch.empty(len(x), stage.input_width), src=src)\n"
            "    if stage.is_first:\n        inputs = x\n    else:",
            1,
        )
    raise ValueError(kind)


@pytest.mark.slow
def test_graded_cells_catch_wrong_answers():
    """One kernel: for each wrong answer (a split by layer count, GPipe as F, B, F, B, sending to a stage
    that is not the next, unscaled losses, no requires_grad_, 1F1B in GPipe's order), the solutions with the
    wrong one in its place, then its graded cell."""
    lab = load(LAB)
    stage = next(c for c in lab.cells if "class Stage" in c.source)
    solutions = [cell_by_id(lab, f"ex_{e}") for e in EXERCISES]
    cells = [copy.deepcopy(c) for c in (lab.cells[0], stage, *solutions, cell_by_id(lab, "test_helpers"))]
    wrong = []
    for exercise, source, _, _ in WRONG:
        right = cell_by_id(lab, f"ex_{exercise}").source
        planted = source if exercise != "gpipe" else wrong_gpipe(source, right)
        assert planted != right, f"the mistake {source[:40]!r} was not planted"
        wrong.append((exercise, planted))
    graded_at = add_wrong_answers(lab, cells, solutions, wrong, [t for _, _, t, _ in WRONG], replace=True)
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, timeout=240, cwd=LAB.parent)
    assert_wrong_answers_caught(nb, graded_at, [message for _, _, _, message in WRONG])


@pytest.mark.slow
def test_gpipe_backwards_in_reverse_order_pass():
    # the lecture's diagram runs B(m-1) ... B0: the graded cell (hidden cases included) accepts it
    nb, _ = execute(_notebook_with("gpipe", "B(m-1) ... B0", "test_gpipe"), autograding=True, cwd=LAB.parent)
    assert not [errors(c) for c in nb.cells if errors(c)], [errors(c) for c in nb.cells if errors(c)]
    assert "\N{WHITE HEAVY CHECK MARK}" in text(nb.cells[-1]), text(nb.cells[-1])


@pytest.mark.slow
def test_1f1b_is_graded_on_its_own():
    # exercise 3's helpers without the loss scaling fail GPipe; 1F1B, which reuses them, is graded with the grader's
    nb, _ = execute(_notebook_with("gpipe", "unscaled", "test_1f1b"), autograding=True, cwd=LAB.parent)
    assert not [errors(c) for c in nb.cells if errors(c)], [errors(c) for c in nb.cells if errors(c)]
    assert "\N{WHITE HEAVY CHECK MARK}" in text(nb.cells[-1]), text(nb.cells[-1])


def test_the_bubble_fails_closed_where_the_wire_was_not_seen(monkeypatch):
    # under grading, a run whose wire was not captured is never timed from the ranks' boxes
    from types import SimpleNamespace

    from disttrain_lab import wire, wiretimeline

    monkeypatch.setattr(lab05.bubble, "_schedule", lambda run: pytest.fail("the ranks' F/B boxes were read"))
    unseen = SimpleNamespace(
        timeline=wiretimeline.Timeline.unobserved("no capture"), traffic=wire.Traffic.unobserved("no ss")
    )
    with pytest.raises(wire.Unobserved):
        lab05.bubble._idle(unseen, "gpipe_step on 2 stages", 2, 4, 4, "gpipe_step")


def _gpipe_wire(forward: float) -> list[tuple[float, int, int, int]]:
    """The segments a capture sees of GPipe on 2 stages, 2 micro-batches of 4 rows (256-byte payloads), each
    forward taking ``forward`` seconds and each backward twice that: gloo's handshake, stage 1's notes for its
    two receives, stage 0's activations (a note, then preamble and payload) and its notes for the gradients,
    stage 1's gradients."""
    note, data, start = 48, 48 + 256, 0.012
    sent = [start + forward, start + 2 * forward]  # stage 0: F0, F1 one after the other
    back = [sent[1] + 3 * forward, sent[1] + 5 * forward]  # stage 1: F0, F1, then B0, B1
    return sorted(
        [(0.0, 1, 0, 8), (0.005, 1, 0, note), (0.0051, 1, 0, note)]
        + [(t + dt, 0, 1, n) for t in sent for dt, n in ((0.0, note), (1e-5, data))]
        + [(sent[1] + 1e-4, 0, 1, note), (sent[1] + 2e-4, 0, 1, note)]
        + [(t + dt, 1, 0, n) for t in back for dt, n in ((0.0, note), (1e-5, data))]
    )


def test_the_bubbles_compute_is_read_from_the_wire():
    # #42: the step's length counts 3 · BUBBLE_COST of busy time per micro-batch; the wire must show it spent. A
    # made-up capture of GPipe on 2 stages: at BUBBLE_COST per forward it passes (its last stage's step, 2 × 90 ms,
    # is exactly the compute it holds); with the forwards 10 ms shorter its last stage fails, and with no capture
    # the check fails closed
    from types import SimpleNamespace

    from disttrain_lab import wire, wiretimeline

    def computed(forward):
        run = SimpleNamespace(timeline=wiretimeline.Timeline(segments=_gpipe_wire(forward)))
        return lab05.bubble._assert_computed(run, "gpipe_step on 2 stages, 2 micro-batches of 4 rows", 2, 2, 4)

    assert computed(lab05.BUBBLE_COST) == pytest.approx(1.0, abs=1e-3)
    with pytest.raises(AssertionError) as caught:
        computed(lab05.BUBBLE_COST - 0.01)
    assert (
        "stage 1 (the last) began sending gradient 0 (micro-batch 0's, or 1's with the backwards in reverse) 80.0 ms "
        "after micro-batch 0's activations had reached it"
        in str(caught.value)
        and "a micro-batch's forward, loss and backward take 90 ms" in str(caught.value)
        and "at least 88 ms must lie between them" in str(caught.value)
    ), str(caught.value)
    with pytest.raises(wire.Unobserved):
        lab05.bubble._assert_computed(
            SimpleNamespace(timeline=wiretimeline.Timeline.unobserved("no capture")), "gpipe_step", 2, 2, 4
        )


def _1f1b_wire(forward: float, backward0: float) -> list[tuple[float, int, int, int]]:
    """The segments a capture sees of 1F1B on 2 stages, 3 micro-batches of 4 rows (as ``_gpipe_wire``), each
    forward taking ``forward`` seconds, the last stage's backwards twice that and stage 0's ``backward0``:
    stage 0 sends micro-batch 2's activations once gradient 0 has come back and it has run B0, then F2."""
    note, data, start = 48, 48 + 256, 0.012
    acts = [start + forward, start + 2 * forward]  # stage 0's warm-up F0, then F1
    grads = [acts[0] + 3 * forward]  # stage 1: F0 and B0 as activation 0 comes
    grads.append(max(grads[0], acts[1]) + 3 * forward)
    acts.append(grads[0] + backward0 + forward)  # stage 0: B0, then F2
    grads.append(max(grads[1], acts[2]) + 3 * forward)
    return sorted(
        [(0.0, 1, 0, 8)]
        + [(0.005 + 1e-4 * i, 1, 0, note) for i in range(3)]
        + [(t + dt, 0, 1, n) for t in acts for dt, n in ((0.0, note), (1e-5, data))]
        + [(acts[1] + 1e-4 * (i + 1), 0, 1, note) for i in range(3)]
        + [(t + dt, 1, 0, n) for t in grads for dt, n in ((0.0, note), (1e-5, data))]
    )


def test_stage_0s_backwards_in_1f1b_are_read_from_the_wire():
    # #42: stage 0's backwards send nothing, but in 1F1B each forward after the warm-up follows one, so the wire
    # bounds them: a made-up capture of 1F1B on 2 stages, 3 micro-batches, passes with stage 0's backward at
    # twice the forward; with stage 0's backward skipped it passes as GPipe's windows read it (only forwards on
    # stage 0) and fails as 1F1B's do, naming the gradient, the micro-batch and the compute between them
    from types import SimpleNamespace

    from disttrain_lab import wiretimeline

    case, cost = "one_f_one_b_step on 2 stages, 3 micro-batches of 4 rows", lab05.BUBBLE_COST

    def computed(backward0, name="one_f_one_b_step"):
        run = SimpleNamespace(timeline=wiretimeline.Timeline(segments=_1f1b_wire(cost, backward0)))
        return lab05.bubble._assert_computed(run, case, 2, 3, 4, name)

    assert computed(2 * cost) == pytest.approx(1.0, abs=1e-3)
    assert computed(0.0, "gpipe_step") == pytest.approx(1.0, abs=1e-3)
    with pytest.raises(AssertionError) as caught:
        computed(0.0)
    assert (
        f"{case}: stage 0 began sending micro-batch 2's activations 30.0 ms after gradient 0 from stage 1 had "
        "reached it, as the grader's capture timed the bytes, but 1F1B runs gradient 0's backward, then "
        "micro-batch 2's forward in between"
        in str(caught.value)
        and "they take 90 ms" in str(caught.value)
    ), str(caught.value)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_the_schedule_is_graded_from_the_wire_not_the_stages_boxes(solution, monkeypatch):
    # as the grader reads a run (the OS's bytes, a packet capture), the ranks' F/B boxes never read: the solution's
    # 1F1B and GPipe pass, and 1F1B's bubble; GPipe run under 1F1B's name fails the order, one micro-batch at a
    # time (no pipeline) the bubble
    import __main__
    from disttrain_lab.labtests import lab05

    gpipe = solution["gpipe_step"]
    helpers = gpipe.__globals__  # the solution's forward_microbatch and backward_microbatch

    def one_at_a_time(stage, x, y, micro_batches):  # each micro-batch's F and B before the next one's: no pipeline
        xs, ys, sends, loss = x.tensor_split(micro_batches), y.tensor_split(micro_batches), [], 0.0
        for i in range(micro_batches):
            inputs, outputs = helpers["forward_microbatch"](stage, xs[i], ys[i], i, len(x), sends)
            loss += helpers["backward_microbatch"](stage, inputs, outputs, i, sends)
        for request in sends:
            request.wait()
        return loss if stage.is_last else None

    for module in (lab05.steps, lab05.bubble):
        monkeypatch.setattr(module, "_schedule", lambda run: pytest.fail("the ranks' F/B boxes were read"))
    for name in FUNCTIONS:
        monkeypatch.setattr(__main__, name, solution[name], raising=False)
    with observed_from_outside():
        lab05.check_1f1b(3, batch=10, m=4)
        lab05.check_gpipe(3, batch=10, m=4)
        lab05.check_1f1b_bubble(2, [1, 4])  # the step timed from gloo's handshake to the last gradient
        monkeypatch.setattr(__main__, "one_f_one_b_step", one_at_a_time)
        with pytest.raises(AssertionError, match="the stages were idle"):
            lab05.check_1f1b_bubble(2, [4])
        monkeypatch.setattr(
            __main__, "one_f_one_b_step", lambda stage, x, y, micro_batches: gpipe(stage, x, y, micro_batches)
        )
        with pytest.raises(AssertionError, match=r"in 1F1B stage \d holds at most p − s = \d micro-batches"):
            lab05.check_1f1b(3, batch=10, m=4)


def _serialized_at_the_formula(helpers: dict):
    """GPipe's messages one micro-batch at a time (no pipeline: the stages idle 1 − 1/p of the step), with every
    stage's simulated compute shrunk by (m + p − 1)/(p · m), so that the step's length on the wire, read as
    3 · BUBBLE_COST of busy time per micro-batch, lands on the bubble (p − 1)/(m + p − 1)."""

    def gpipe_step(stage, x, y, micro_batches):
        p, m = stage.count, micro_batches
        stage.cost *= (m + p - 1) / (p * m)
        xs, ys, sends, loss = x.tensor_split(m), y.tensor_split(m), [], 0.0
        for i in range(m):
            inputs, outputs = helpers["forward_microbatch"](stage, xs[i], ys[i], i, len(x), sends)
            loss += helpers["backward_microbatch"](stage, inputs, outputs, i, sends)
        for request in sends:
            request.wait()
        return loss if stage.is_last else None

    return gpipe_step


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_a_bubble_from_shrunk_compute_fails_from_the_wire(solution, monkeypatch):
    """#42: the bubble's busy time is what the stages sleep (``stage.cost``, which the step function can change);
    the grader reads from the wire that they spent it.  The solution's GPipe passes; a GPipe that runs one
    micro-batch at a time and shrinks ``stage.cost`` until the step's length gives the formula's idle fraction
    passed on that length alone (the check without ``_assert_computed``) and fails now, naming the stage, the
    micro-batch, the time seen and the compute required.  (In the student's own kernel the F/B boxes measure the
    shrunk compute itself: there it is as idle as any serialized schedule.)"""
    import __main__

    helpers = solution["gpipe_step"].__globals__  # the solution's namespace: Stage, forward_microbatch, ...
    notebook_names(monkeypatch, helpers)
    computed = lab05.bubble._assert_computed
    with observed_from_outside():
        lab05.check_gpipe_bubble(2, [1, 4])
        monkeypatch.setattr(__main__, "gpipe_step", _serialized_at_the_formula(helpers))
        monkeypatch.setattr(lab05.bubble, "_assert_computed", lambda *args: 1.0)
        lab05.check_gpipe_bubble(2, [4])  # the step's length alone: 1 − 1/(2 · 5/8) = 20%, the formula's
        monkeypatch.setattr(lab05.bubble, "_assert_computed", computed)
        with pytest.raises(AssertionError) as caught:
            lab05.check_gpipe_bubble(2, [4])
    said = str(caught.value)
    assert (
        re.search(
            r"gpipe_step on 2 stages, 4 micro-batches of 4 rows: stage 1 \(the last\) began sending .*gradient.* "
            r"\d+\.\d ms after micro-batch \d's activations had reached it, as the grader's capture timed the bytes, but a "
            r"micro-batch's forward, loss and backward take 90 ms on the simulated accelerator",
            said,
        )
        and "at least 88 ms must lie between them" in said
    ), said


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_a_1f1b_whose_stage_0_skips_its_backwards_fails_from_the_wire(solution, monkeypatch):
    """#42: a 1F1B step whose stage 0 runs its backwards at no cost (``stage.cost`` set to 0 around them) passed
    the bubble's checks as they read stage 0 before (its forwards only: the check with GPipe's windows) and fails
    now: after the warm-up each of stage 0's forwards follows a backward, so the window from a gradient's arrival
    to the next activation's send must hold both."""
    import __main__

    helpers = solution["one_f_one_b_step"].__globals__
    notebook_names(monkeypatch, helpers)
    one_f_one_b = solution["one_f_one_b_step"]

    def stage_0_backwards_free(stage, x, y, micro_batches):
        if stage.is_first:
            backward = stage.backward

            def free(*args):
                cost, stage.cost = stage.cost, 0.0
                try:
                    return backward(*args)
                finally:
                    stage.cost = cost

            stage.backward = free
        return one_f_one_b(stage, x, y, micro_batches)

    windows = lab05.bubble._windows
    with observed_from_outside():
        monkeypatch.setattr(__main__, "one_f_one_b_step", stage_0_backwards_free)
        monkeypatch.setattr(lab05.bubble, "_windows", lambda run, p, m, rows, name: windows(run, p, m, rows, "gpipe"))
        lab05.check_1f1b_bubble(2, [4])  # stage 0's forwards alone: it passed
        monkeypatch.setattr(lab05.bubble, "_windows", windows)
        with pytest.raises(AssertionError) as caught:
            lab05.check_1f1b_bubble(2, [4])
    said = str(caught.value)
    assert re.search(
        r"one_f_one_b_step on 2 stages, 4 micro-batches of 4 rows: stage 0 began sending micro-batch \d's activations "
        r"\d+\.\d ms after gradient \d from stage 1 had reached it, as the grader's capture timed the bytes, but 1F1B "
        r"runs gradient \d's backward, then micro-batch \d's forward in between",
        said,
    ), said


def _naive_by_shared_memory(stage, x, y):
    """The naive schedule's messages, of their sizes and order, that carry zeros: the activation and the
    gradient reach the other stage through /dev/shm instead."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from tests.helpers import shm_get, shm_path, shm_put

    step = stage.__dict__.setdefault("calls", 0)
    stage.calls += 1

    def put(name, t):
        shm_put(shm_path("lab05-test", f"{step}-{name}"), t.detach().clone())

    def get(name):
        return shm_get(shm_path("lab05-test", f"{step}-{name}"))

    inputs = x
    if not stage.is_first:
        dist.recv(torch.empty(len(x), stage.input_width), src=stage.index - 1)  # junk
        inputs = get(f"act{stage.index - 1}").requires_grad_()
    outputs = stage.forward(inputs, 0)
    loss = None
    if stage.is_last:
        loss = F.mse_loss(outputs, y)
        stage.backward(loss, None, 0)
    else:
        put(f"act{stage.index}", outputs)
        dist.send(torch.zeros_like(outputs), dst=stage.index + 1)
        dist.recv(torch.empty_like(outputs), src=stage.index + 1)  # junk
        stage.backward(outputs, get(f"grad{stage.index + 1}"), 0)
    if not stage.is_first:
        put(f"grad{stage.index}", inputs.grad)
        dist.send(torch.zeros_like(inputs.grad), dst=stage.index - 1)
    return loss.item() if loss is not None else None


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_a_pipelines_messages_carry_its_activations_and_gradients(solution, monkeypatch):
    """#42: every activation and gradient that crossed a link holds its values as one process computes
    them (``content.check_wire_content``, from the grader's capture): the solution's naive step and
    GPipe pass; a naive step whose messages have the right count, size and order but carry zeros, the
    activations and gradients passed through /dev/shm, trains right and fails."""

    import __main__
    from disttrain_lab.labtests import lab05

    for name in FUNCTIONS:
        monkeypatch.setattr(__main__, name, solution[name], raising=False)
    try:
        with observed_from_outside():
            lab05.check_naive(3, batch=8, steps=2)
            lab05.check_gpipe(2, batch=10, m=3)
            monkeypatch.setattr(__main__, "naive_step", _naive_by_shared_memory)
            with pytest.raises(AssertionError) as caught:
                lab05.check_naive(3, batch=8, steps=2)
    finally:
        shm_clear("lab05-test")
    said = str(caught.value)
    assert "activation or gradient message 1 of 2 from rank 0 to rank 1" in said and "holds none of the values" in said


def _notebook_with(exercise: str, wrong: str, test_id: str) -> nbformat.NotebookNode:
    """The setup, Stage, every exercise (one of them changed), the test helpers and one graded cell."""
    lab = load(LAB)
    stage = next(c for c in lab.cells if "class Stage" in c.source)
    solutions = []
    for e in EXERCISES:
        cell = copy.deepcopy(cell_by_id(lab, f"ex_{e}"))
        if e == exercise:
            cell.source = wrong if exercise != "gpipe" else wrong_gpipe(wrong, cell.source)
            assert cell.source != cell_by_id(lab, f"ex_{e}").source, "the mistake was not planted"
        solutions.append(cell)
    return nbformat.v4.new_notebook(
        cells=[copy.deepcopy(c) for c in (lab.cells[0], stage)]
        + solutions
        + [copy.deepcopy(cell_by_id(lab, "test_helpers")), copy.deepcopy(cell_by_id(lab, test_id))]
    )


# ----------------------------------------------------------------------------------------
# The Gantt chart, the idle measurement and the bench harness


def _traced_gpipe(stage_cls, split, gpipe, m):
    import torch.distributed as dist

    from disttrain_lab import models

    rank, p = dist.get_rank(), dist.get_world_size()
    stage = stage_cls(split(models.MLP([8] * 5, seed=0), p)[rank], rank, p, 1e-2)  # 20 ms boxes
    x, y = models.regression_data(8, 8, 8, seed=1)
    for step in range(2):  # step 0 warms up (gloo's first messages are slow)
        with dl.region("step", step=step):
            gpipe(stage, x, y, micro_batches=m)


def test_pipeline_idle_and_schedule(solution):
    import matplotlib

    matplotlib.use("Agg")
    run = dl.launch(
        _traced_gpipe, 2, solution["Stage"], solution["split_stages"], solution["gpipe_step"], 4, trace=True
    )
    assert [f"{e.name}{e.meta['microbatch']}" for e in dl.viz.pipeline_regions(run, 1, step=1)] == [
        "F0",
        "F1",
        "F2",
        "F3",
        "B0",
        "B1",
        "B2",
        "B3",
    ]
    idle = dl.viz.pipeline_idle(run, step=1)
    # (p − 1)/(m + p − 1) = 0.2, plus what a loaded machine adds between the boxes (only ever more idle: CI's
    # host, three workers, read 0.62 on one stage); an idle measure that missed the boxes would read 0 or 1
    assert all(0.12 < i < 0.9 for i in idle), idle
    ax = dl.viz.pipeline_schedule(run, step=1)
    assert "idle" in ax.get_title() and len(ax.get_yticklabels()) == 2
    with pytest.raises(ValueError, match='no region "step" with step=3'):
        dl.viz.pipeline_regions(run, 0, step=3)


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_bench_pipeline_measures_side_by_side(solution):
    versions = {
        "naive": (solution["naive_step"], 1),
        "GPipe m=2": (functools.partial(solution["gpipe_step"], micro_batches=2), 2),
    }
    rows = bench.bench_pipeline(
        versions,
        solution["split_stages"],
        solution["Stage"],
        world_size=2,
        sizes=(16,) * 5,
        batch=8,
        cost=1e-4,
        repeats=1,
        warmup=1,
        torch_micro_batches=(2,),
    )
    assert [r["version"] for r in rows] == ["naive", "GPipe m=2", f"{bench.TORCH_PIPELINE} m=2"]
    for row in rows:
        assert row.get("steps_per_s", 0) > 0, row
    assert rows[0]["speedup"] == 1.0 and rows[1]["ideal"] == pytest.approx(4 / 3)


@pytest.mark.slow
@pytest.mark.bench_report
def test_cli_bench_pipeline_uses_the_notebook():
    out = benchreport.quick_report().printed_by("pipeline", ["--repeats", "1", "--world-size", "2"])
    assert f" from solutions/{LAB.parent.name}" in out, out
    for name in ("naive", "GPipe m=8", "1F1B m=8", f"{bench.TORCH_PIPELINE} m=8", "ideal"):
        assert name in out, out


# ----------------------------------------------------------------------------------------
# On GPUs (device="cuda", NCCL): skipped, saying why, where fewer than 2 GPUs are visible


def _gpipe_on_device(stage_cls, split, gpipe):
    import torch.distributed as dist

    from disttrain_lab import models

    rank, p = dist.get_rank(), dist.get_world_size()
    stage = stage_cls(split(models.MLP([8] * 5, seed=0), p)[rank].to(dl.device()), rank, p)
    x, y = (t.to(dl.device()) for t in models.regression_data(8, 8, 8, seed=1))
    loss = gpipe(stage, x, y, micro_batches=4)
    return loss, {name: q.grad.cpu() for name, q in stage.module.named_parameters()}, str(stage.device)


@needs_gpus(1)
def test_gpipe_on_gpus(solution):
    # one stage per visible GPU, up to 2 (one GPU: one NCCL rank, every stage-local step on the GPU)
    world = min(gpu_count(), 2)
    import torch
    import torch.nn.functional as F

    from disttrain_lab import models

    results = dl.launch(
        _gpipe_on_device,
        world,
        solution["Stage"],
        solution["split_stages"],
        solution["gpipe_step"],
        device="cuda",
        timeout=120,
    )
    assert [device for _, _, device in results] == [f"cuda:{k}" for k in range(world)]
    model = models.MLP([8] * 5, seed=0)
    x, y = models.regression_data(8, 8, 8, seed=1)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    assert results[-1][0] == pytest.approx(loss.item(), rel=1e-4)
    grads = {name: g for _, rank_grads, _ in results for name, g in rank_grads.items()}
    for name, q in model.named_parameters():
        torch.testing.assert_close(grads[name], q.grad, rtol=1e-4, atol=1e-5)
