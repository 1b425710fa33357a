"""Lab 14 (pipeline schedules beyond 1F1B): the solution notebook runs, its graded tests catch wrong answers, and
its references are torch's own schedules.

- The notebook's structure: the exercises and predictions in order, their points, the hidden cases (torch's
  rounds rule with m not a multiple of p, m < p, v = 1 and v = 4, 1F1B and interleaving on 3 and 4 ranks for
  ``run_order``); the predictions' self-checks (their form only).
- The solution notebook executes top to bottom as the grader runs it (its round trip) and as a student runs it,
  within BUDGET_S, every graded cell passing, with its pictures; the figures its text states hold (the
  simulated bubbles (p − 1)/m and (p − 1)/(v·m), held micro-batches p and p + (p − 1)/v, ZB-H1's third of 1F1B's
  bubble).
- Wrong answers fail the right graded cell with a message that says why, all in one kernel: 1F1B's warm-up
  in an interleaved order, the chunks' backwards in the wrong order, a loss returned by every rank, a loss not
  scaled by 1/m, an I that computes the weights' gradients too, a W that overwrites .grad, W run at once after
  I (1F1B with a split backward), gradients summed where the exercise averages them, and wrong predictions.
- Under the grader's capture of the wire, the notebook's own ``run_order`` passes, and the same function made
  to run GPipe's order (every F, then every B) gives the right values and fails on the wire; the notebook's own
  ``sharded_step`` passes with prefetch and without, and the same with the forward's prefetch taken out fails.

The unit tests of the grader's side are test_lab14_{orders,schedule,wireorder,split,running,prefetch}.py; the blank
notebook failing every graded cell, and the autograde round trip, are in test_grading.py.
"""

from __future__ import annotations

import os
import re

import nbformat
import pytest

from tests.notebooks import (
    add_wrong_answers,
    assert_wrong_answers_caught,
    base_cells,
    execute,
    exercise_ids,
    graded_points,
    load,
    nbgrader_meta,
    output_of,
    pictures,
    prediction_problems,
    run_solution,
    solution_notebook,
)

LAB = solution_notebook("14_schedules")
BUDGET_S = 180  # the whole solution notebook on 2 cores (a student's run: about 20 s from a fresh kernel, quiet)
EXERCISES = [
    "interleaved_order",
    "predict_bubble",
    "run_order",
    "predict_held",
    "split_backward",
    "zb_h1_order",
    "sharded_step",
]


# ----------------------------------------------------------------------------------------
# The notebook's structure (fast)


def test_exercises_and_hidden_tests_cover_the_lab():
    nb = load(LAB)
    assert exercise_ids(nb) == [f"ex_{e}" for e in EXERCISES]
    assert graded_points(nb) == {
        "test_interleaved_order": 2,
        "test_predict_bubble": 1,
        "test_run_order": 3,
        "test_predict_held": 1,
        "test_split_backward": 2,
        "test_zb_h1_order": 2,
        "test_sharded_step": 3,
    }
    hidden = "".join(
        part.split("### END HIDDEN TESTS")[0]
        for c in nb.cells
        if nbgrader_meta(c).get("grade")
        for part in c.source.split("### BEGIN HIDDEN TESTS")[1:]
    )
    for needle in (
        "(4, 2, 10)",  # two rounds of 5: m not a multiple of p
        "(4, 2, 3)",  # m < p: one round of 3
        "(2, 4, 4)",  # v = 4
        "(3, 1, 6)",  # v = 1
        'lab_tests.check_run_order("run_order", 3, 2, 6, "Interleaved1F1B")',
        'lab_tests.check_run_order("run_order", 4, 1, 4, "1F1B")',
        "((2, 9, 4, 7), 1)",  # a batch of one, three layers
        "(4, 3), (4, 10)",  # ZB-H1 with m < p and two rounds
        'lab_tests.check_sharded_step("sharded_step", 4, prefetch=False)',  # 4 ranks: padding on every layer
        'dl.predictions.fetch("PREDICTED_BUBBLE")',
        'dl.predictions.fetch("PREDICTED_HELD")',
    ):
        assert needle in hidden, needle


def test_predictions_self_checks_hold_no_answer():
    assert prediction_problems(load(LAB)) == []


# ----------------------------------------------------------------------------------------
# Executing it (slow)


@pytest.mark.slow
@pytest.mark.parametrize("autograding", [True, False], ids=["grader", "student"])
def test_solution_notebook_executes_within_budget(autograding):
    nb = run_solution(LAB, BUDGET_S, autograding)
    assert pictures(nb) == 7, (
        "GPipe/1F1B, interleaved v = 1..3 and its bars, the real run, held, four schedules, prefetch's real run"
    )
    lab5 = output_of(nb, "def draw_schedule")
    assert "GPipe: bubble 0.375 (formula (p − 1)/m = 0.375)" in lab5, lab5
    assert "1F1B : bubble 0.375" in lab5 and "by rank: [4.0, 3.0, 2.0, 1.0]" in lab5, lab5
    interleaved = output_of(nb, "# Simulated: torch's interleaved order")
    for v, bubble in ((1, "0.3750"), (2, "0.1875"), (4, "0.0938")):  # (p − 1)/(v·m), m = 8: not the graded m = 12
        assert f"v = {v}, m = 8: bubble {bubble}" in interleaved, interleaved
    real = output_of(nb, "class _Busy")  # a picture only: its title holds the measured bubbles
    assert "Traceback" not in real, real
    held = output_of(nb, "# Counted: the micro-batches each rank holds")  # p = 3: not the graded p = 4
    assert "p = 3, Interleaved1F1B, v = 2: held at the peak by rank [4.0, 3.0, 2.0]" in held, held
    assert "p = 3, Interleaved1F1B, v = 3: held at the peak by rank [3.667, 3.0, 2.333]" in held, held
    assert "5.5" not in held and "0.125" not in interleaved and "0.1250" not in interleaved  # the graded answers
    four = output_of(nb, "_zb_label")
    assert re.search(r"1F1B +: bubble 0\.3750; rank 0 holds 4\.0", four), four
    assert re.search(r"your ZB-H1 +: bubble 0\.1250; rank 0 holds 4\.0", four), four  # a third of 1F1B's, its memory
    benched = output_of(nb, "bench.bench_schedules(")
    assert "not measured" not in benched, benched
    for version in ("torch Schedule1F1B", "lab interleaved_order, lab run_order", "lab zb_h1_order, torch's runtime"):
        assert f"  {version} " in benched, benched
    # ranks' clocks, a picture: both steps measured and shown against the cost model (which is shorter is the bench's
    # to measure, `bench prefetch`: on a loaded host the sleeps run late; a full run once read 308 ms with prefetch,
    # 239 ms without)
    prefetched = output_of(nb, "class _Compute")
    steps = {flag: float(ms) for flag, ms in re.findall(r"prefetch=(\w+): step (\d+) ms, cost model", prefetched)}
    assert set(steps) == {"False", "True"} and all(ms > 0 for ms in steps.values()), prefetched


_RUN_ORDER = re.compile(r"def run_order\(.*?### END SOLUTION\n", re.S)


def _run_order_with(lab, old: str, new: str) -> str:
    """The solution's run_order with ``old`` replaced by ``new`` (the markers taken out)."""
    source = next(c.source for c in lab.cells if nbgrader_meta(c).get("grade_id") == "ex_run_order")
    assert old in source, old
    return source.replace(old, new).replace("    ### BEGIN SOLUTION\n", "").replace("    ### END SOLUTION\n", "")


def _sharded_step_with(lab, old: str, new: str) -> str:
    """The solution's sharded_step with ``old`` replaced by ``new`` (the markers taken out)."""
    source = next(c.source for c in lab.cells if nbgrader_meta(c).get("grade_id") == "ex_sharded_step")
    assert old in source, old
    return source.replace(old, new).replace("    ### BEGIN SOLUTION\n", "").replace("    ### END SOLUTION\n", "")


# Wrong answers: (graded cell, wrong definition, words the failure must contain)
def _wrong(lab) -> list[tuple[str, str, str]]:
    return [
        (
            "interleaved_order",
            """
_right_interleaved = interleaved_order
def interleaved_order(p, v, m):                   # 1F1B's warm-up: one hop ahead, not two
    orders = []
    for r in range(p):
        n = m // max(1, m // p)
        warmup, total, done, actions = min((v - 1) * n + (p - 1 - r), v * m), v * m, {}, []
        def act(kind, chunk):
            stage = chunk * p + r
            done[kind, stage] = done.get((kind, stage), -1) + 1
            actions.append(f"{stage}{kind}{done[kind, stage]}")
        for k in range(warmup):
            act("F", (k // n) % v)
        for k in range(total - warmup):
            act("F", ((warmup + k) // n) % v); act("B", v - 1 - (k // n) % v)
        for k in range(total - warmup, total):
            act("B", v - 1 - (k // n) % v)
        orders.append(actions)
    return orders
""",
            "ScheduleInterleaved1F1B",
        ),
        (
            "interleaved_order",
            """
_right_interleaved = interleaved_order
def interleaved_order(p, v, m):                   # backwards through the chunks in the forward's order
    return [[re.sub(r"^(\\d+)B", lambda g: f"{(v - 1 - int(g[1]) // p) * p + int(g[1]) % p}B", a) for a in actions]
            for actions in _right_interleaved(p, v, m)]
""",
            "ScheduleInterleaved1F1B",
        ),
        (
            "run_order",
            _run_order_with(lab, "return total if last % p == rank else None", "return total"),
            "only the rank holding the last stage (rank 1) returns the loss, every other rank None",
        ),
        (
            "run_order",
            _run_order_with(lab, "loss = F.mse_loss(out, ys[j]) / micro_batches", "loss = F.mse_loss(out, ys[j])"),
            ".grad, against loss.backward() on the whole model",
        ),
        (
            "split_backward",
            """
def backward_input(stage, x, out, grad_out):      # everything at once: the weights' gradients too
    out.backward(grad_out, retain_graph=True)
    return x.grad
""",
            "must leave the weights' gradients to backward_weight",
        ),
        (
            "split_backward",
            """
def backward_weight(stage, x, out, grad_out):     # overwrites .grad instead of adding
    for q, g in zip(stage.parameters(), torch.autograd.grad(out, list(stage.parameters()), grad_out, retain_graph=True)):
        q.grad = g
""",
            "must add into .grad",
        ),
        (
            "zb_h1_order",
            """
def zb_h1_order(p, m):                            # W at once after its I: 1F1B with a split backward
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        actions = [f"{r}F{j}" for j in range(warmup)]
        for k in range(m):
            if warmup + k < m:
                actions.append(f"{r}F{warmup + k}")
            actions += [f"{r}I{k}", f"{r}W{k}"]
        orders.append(actions)
    return orders
""",
            "ScheduleInterleavedZeroBubble",
        ),
        (
            "sharded_step",
            _sharded_step_with(lab, "op=dist.ReduceOp.AVG", "op=dist.ReduceOp.SUM"),  # summed, not averaged
            "shards[0].grad, against loss.backward() in one process",
        ),
        ("predict_bubble", "PREDICTED_BUBBLE = (4 - 1) / 12     # 1F1B's (p − 1)/m\n", "significant figures"),
        ("predict_held", "PREDICTED_HELD = 4     # 1F1B's p\n", "significant figures"),
    ]


@pytest.mark.slow
def test_graded_cells_catch_wrong_answers():
    """One kernel: the setup and solutions, then for each wrong answer the solutions again, the wrong definition
    and its graded cell."""
    lab = load(LAB)
    wrong = _wrong(lab)
    cells, solutions = base_cells(lab, [], EXERCISES)
    graded_at = add_wrong_answers(lab, cells, solutions, [(graded, source) for graded, source, _ in wrong])
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, timeout=240, cwd=LAB.parent)
    assert_wrong_answers_caught(nb, graded_at, [message for _, _, message in wrong])


_GPIPE = (
    "    order = sorted(order, key=lambda a: (re.fullmatch(r'(\\d+)([FB])(\\d+)', a)[2] == 'B',\n"
    "                                         int(re.fullmatch(r'(\\d+)([FB])(\\d+)', a)[1]) * (1 if 'F' in a else -1)))\n"
    "    for action in order:\n"
)


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_the_notebooks_run_order_on_the_wire(monkeypatch):
    """The solution's run_order passes under the grader's capture; the same function running GPipe's order
    (every forward, then every backward, last stage first) passes on the values in the student's kernel and fails
    on the wire."""
    from disttrain_lab import bench
    from disttrain_lab.labtests.lab14 import running
    from tests.helpers import notebook_names, observed_from_outside

    solution = bench.functions_from_notebook(LAB, ["run_order"])
    names = dict(solution["run_order"].__globals__)
    notebook_names(monkeypatch, names)
    with observed_from_outside():
        running.check_run_order("run_order", 2, 2, 4, "Interleaved1F1B")
    source = _run_order_with(load(LAB), "    for action in order:\n", _GPIPE)
    exec(source, names)
    notebook_names(monkeypatch, names)
    running.check_run_order("run_order", 2, 2, 4, "Interleaved1F1B")  # the student's own kernel: the values, right
    with observed_from_outside(), pytest.raises(AssertionError) as said:
        running.check_run_order("run_order", 2, 2, 4, "Interleaved1F1B")
    assert "the ranks did not run the order" in str(said.value), said.value


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_the_notebooks_sharded_step_on_the_wire(monkeypatch):
    """The solution's sharded_step passes under the grader's capture, with prefetch and without; the same function
    with the forward's prefetch taken out passes on the values in the student's kernel and fails on the wire."""
    from disttrain_lab import bench
    from disttrain_lab.labtests.lab14 import prefetch
    from tests.helpers import notebook_names, observed_from_outside

    solution = bench.functions_from_notebook(LAB, ["sharded_step"])
    names = dict(solution["sharded_step"].__globals__)
    notebook_names(monkeypatch, names)
    with observed_from_outside():
        prefetch.check_sharded_step("sharded_step", 2)
        prefetch.check_sharded_step("sharded_step", 2, prefetch=False)
    exec(_sharded_step_with(load(LAB), "            gather(i + 1)", "            pass"), names)
    notebook_names(monkeypatch, names)
    prefetch.check_sharded_step("sharded_step", 2)  # the student's own kernel: the values, right
    with observed_from_outside(), pytest.raises(AssertionError) as said:
        prefetch.check_sharded_step("sharded_step", 2)
    assert "layer 2's forward all-gather crossed from" in str(said.value), said.value
    assert "backward all-gather" not in str(said.value), said.value  # the backward still prefetches
