"""Lab 12 (running a training job; part 1: reading a merged profile; part 2: checkpoint and reshard): the
solution notebook runs, its graded tests catch wrong answers, and the traces and checkpoints they grade
on are built with their answers.

- The notebook's structure: the exercises and the predictions in order, with their points; the hidden
  tests on traces of 3 and 4 ranks and on trainings seeded at grading time; the rules the hidden tests
  check stated in the text and exercised by a visible self-check (the union across threads, the exact
  "dl:" prefix, the point-to-point calls and waits that are not collectives, a gloo slice inside
  another; the checkpoint's form, a resume on other grids).
- The grader's traces: each answer built by construction (``labtests/lab12/traces.built_trace``) equals
  the one read from the trace by this file's own reading (an interval union, written here, not
  shipped), for many seeds; the answers differ between ranks and the stragglers between collectives.
- The grader's checkpoint reader (``labtests/lab12/checkpoint_files``): it reads DCP's files whole,
  pieces put together, and refuses, without running it, a ``.metadata`` that asks for anything else.
- The predictions: the graded cells pass the models and fail the usual slips.
- The solution notebook executes top to bottom in a real kernel, as the grader runs it and as a
  student runs it, within the budget (BUDGET_S), with its pictures; what it prints is what the text
  says (the straggler of each step's first all-reduce, exposed communication at or above the model,
  checkpoint shards of 12·Ψ/N bytes, an asynchronous save that blocks less than a synchronous one).
- Wrong answers (a sum of durations with no union, the main thread only, a "dl" prefix without its
  colon, the first rank into a collective, the waits counted as collectives, an overlap that does not
  take the union of gloo's slices; a load of the model alone, without the loader or the step, a save
  of nothing, without Adam's moments, or of a .metadata that runs code, a load that computes the
  visible case's answer; a restart from the oldest checkpoint, reported as the newest or not, from a
  save cut short, on a train step of its own, saving only at the end, or not at all) fail the right graded
  cell with a message that says why.

The blank notebook failing every graded cell, and the autograde round trip, are in test_grading.py.
"""

from __future__ import annotations

import pickle
import re

import nbformat
import pytest
import torch

from disttrain_lab.labtests import lab12
from tests.notebooks import (
    add_wrong_answers,
    assert_wrong_answers_caught,
    base_cells,
    cell_by_id,
    execute,
    exercise_ids,
    graded_points,
    load,
    output_of,
    pictures,
    prediction_problems,
    run_solution,
    solution_notebook,
)

LAB = solution_notebook("12_running_jobs")
TRACE_CHECKS = "(?:exposed_communication|stragglers|overlap_fraction)"  # part 1's checks: (seed, ranks, case)
BUDGET_S = 120  # the whole solution notebook on 2 cores: three profiled 4-rank runs of 3 steps, each merged
EXERCISES = [
    "predict_exposed",
    "exposed",
    "stragglers",
    "overlap",
    "predict_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "train_with_checkpoints",
    "predict_interval",
]


# ----------------------------------------------------------------------------------------
# The notebook's structure (fast)


def test_exercises_points_and_hidden_tests():
    nb = load(LAB)
    assert exercise_ids(nb) == [f"ex_{e}" for e in EXERCISES]
    assert graded_points(nb) == {
        "test_predict_exposed": 1,
        "test_exposed": 2,
        "test_stragglers": 2,
        "test_overlap": 2,
        "test_predict_checkpoint": 1,
        "test_save_checkpoint": 1,
        "test_load_checkpoint": 2,
        "test_train_with_checkpoints": 3,
        "test_predict_interval": 1,
    }
    hidden = "".join(
        part.split("### END HIDDEN TESTS")[0]
        for e in EXERCISES
        for part in cell_by_id(nb, f"test_{e}").source.split("### BEGIN HIDDEN TESTS")[1:]
    )
    for check in ("check_exposed_communication", "check_stragglers", "check_overlap_fraction"):
        # the hidden traces are drawn at grading time (seed None): labtests/lab12/ is installed with the kit
        assert f"lab_tests.{check}(None, 3, " in hidden and f"lab_tests.{check}(None, 4, " in hidden, check
    assert hidden.count("dl.predictions.assert_prediction(") == 3
    # saved on 2 ranks by FSDP and by TP; the grader's checkpoint (one piece a tensor) resumed on 4 ranks,
    # on 2 by tensor parallelism and on 1; each from a training seeded at grading time (seed=None)
    for case in ('save("fsdp", 2', 'save("tp", 4', 'load("dp2xtp2", 2, 5', 'load("tp", 4, 6', 'load("plain", 1, 3'):
        assert f"lab_tests.check_{case}, seed=None)" in hidden, case
    # the restart: a save at the very step killed after, a start at step 1, a kill before any save
    for case in ("(13, 3, 9, seed=None", "(14, 3, 7, start=1, seed=None", "(11, 5, 4, start=3, seed=None"):
        assert f"lab_tests.check_restart{case}, driver=_restart_driver)" in hidden, case
    assert hidden.count("seed=None") == 8
    # graded on its own: the grader's own save and load where the student's fail (lab 5's pattern)
    graded = cell_by_id(nb, "test_train_with_checkpoints").source
    assert "def _restart_with_graders_checkpoints(" in hidden
    assert 'lab_tests.driver_for_restart(globals().get("_restart_with_graders_checkpoints"), afresh=True)' in graded
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    seeds = re.findall(rf"lab_tests\.check_{TRACE_CHECKS}\((\d+),", code)
    assert len(seeds) == len(set(seeds)) == 3 and not re.search(rf"lab_tests\.check_{TRACE_CHECKS}\(\d+,", hidden), (
        seeds
    )


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


def test_the_checkpoint_rules_are_stated_and_the_self_check_resumes_on_other_grids():
    nb = load(LAB)
    text_cells = " ".join(" ".join(c.source.split()) for c in nb.cells if c.cell_type == "markdown")
    for rule in (
        "with one `torch.distributed.checkpoint.save(state, checkpoint_id=path)`, the state in this form",
        'state = {"model": model_state, "optim": optim_state, "step": step, "loader": generator.get_state()}',
        "reads the files it wrote itself, running nothing in them",
        "of a training only the grader ran, from a seed it draws at grading time",
        "`torch.distributed.checkpoint.load(..., checkpoint_id=path)`",
        "**returns the step**",
        "(within 10⁻¹⁰)",
        "so use `path` as DCP's `checkpoint_id` and nothing else",
    ):
        assert rule in text_cells, rule
    visible = cell_by_id_source(nb, "# Self-check: saved after 3 steps on 4 ranks")
    assert 'dl.launch(_save_after, 4, "dp2xtp2", 3, CHECKPOINT_DIR' in visible
    assert '(("fsdp", 2), ("plain", 1))' in visible and "lab_tests.training(layout, seed=7)" in visible
    for rule in (  # Exercise 6
        "a sub-folder named `step_<n>` (`n` an integer) that holds a `.metadata` file",
        "with none (or no `folder` yet), starts at step 0",
        "by calling `train_step(t)` once per step until step `total`",
        'after each step `n` with `n % every == 0` saves with your `save_checkpoint(f"{folder}/step_{n}"',
        "**returns the step it resumed from** (0 when it started afresh)",
        "a `step_<n>` with data files and no `.metadata`",
        "counted from the bytes each rank sent, as the operating system counted them",
    ):
        assert rule in text_cells, rule
    restart = cell_by_id_source(nb, "# Self-check: a job of 16 steps on 2 ranks")
    assert "dl.launch(_job, 2, 16, 4, 10, 0, timeout=120)" in restart and "except dl.RankDied" in restart
    graded = cell_by_id(nb, "test_train_with_checkpoints").source.split("### BEGIN HIDDEN TESTS")
    assert "lab_tests.check_restart(12, 4, 9, driver=_restart_driver)" in graded[1].split("### END HIDDEN TESTS")[1]


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
    source = cell_by_id(nb, "test_predict_checkpoint").source
    verdict(3 * 4 * 7e9 / 64 / 1e9)
    for wrong in (4 * 7e9 / 64 / 1e9, 2 * 4 * 7e9 / 64 / 1e9, 16 * 7e9 / 64 / 1e9, 3 * 4 * 7e9 / 1e9):
        # the values only, without Adam's two moments, with mixed precision's 16 bytes, on one rank
        with pytest.raises(PredictionError, match="does not match the cost model to 3 significant figures"):
            verdict(wrong)
    source = cell_by_id(nb, "test_predict_interval").source
    young = (2 * 60 * 3 * 3600) ** 0.5
    verdict(young)
    for wrong in (young / 2**0.5, young / 60, 2 * 60 * 3 * 3600, (2 * 60 * 3) ** 0.5, young - 60):
        # the 2 forgotten, minutes, no root, M in hours, Daly's correction (not what the text asks)
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
    calls = re.findall(rf"lab_tests\.check_{TRACE_CHECKS}\((\d+), (\d+),", code)
    traces = {(int(seed), int(n)): lab12.built_trace(int(seed), int(n)) for seed, n in calls}
    answers = [tuple(a["exposed"]) for _, a in traces.values()]
    assert len(set(answers)) == len(answers) == 3
    # a hidden case's trace is drawn afresh each time
    assert lab12.built_trace(None, 3)[1] != lab12.built_trace(None, 3)[1]


# ----------------------------------------------------------------------------------------
# The grader's checkpoints


def test_the_graders_reader_reads_a_checkpoint_whole_and_runs_nothing_in_it():
    files, t = lab12.grader_checkpoint(2, 99)
    got = lab12.read_checkpoint(files)
    for name, p in t.model.named_parameters():
        assert torch.equal(got[f"model.{name}"], p.detach())
        assert torch.equal(got[f"optim.state.{name}.exp_avg_sq"], t.optimizer.state[p]["exp_avg_sq"])
    assert got["step"] == 2 and torch.equal(got["loader"], t.generator.get_state())
    assert got["optim.param_groups.0.lr"] == 0.01

    class Payload:  # what a hostile .metadata holds: a call made as it is unpickled
        def __reduce__(self):
            return (exec, ("raise SystemExit('ran')",))

    with pytest.raises(lab12.CheckpointUnreadable, match=r"asks for builtins\.exec"):
        lab12.read_checkpoint({**files, ".metadata": pickle.dumps(Payload())})
    # the pieces must be where .metadata says, and cover every element
    with pytest.raises(lab12.CheckpointUnreadable, match="is missing"):
        lab12.read_checkpoint({".metadata": files[".metadata"]})
    with pytest.raises(lab12.CheckpointUnreadable, match="could not be read with torch.load"):
        lab12.read_checkpoint({**files, "__0_0.distcp": b"x" * len(files["__0_0.distcp"])})


def test_the_graders_checkpoint_comes_from_its_seed_and_not_from_the_visible_one():
    (files, _), (again, _), (visible, _) = (lab12.grader_checkpoint(3, s) for s in (2**61 + 5, 2**61 + 5, 0))
    w = [lab12.read_checkpoint(f)["model.0.weight"] for f in (files, again, visible)]
    assert torch.equal(w[0], w[1]) and not torch.allclose(w[0], w[2], atol=1e-3)
    assert torch.equal(w[2], lab12.reference_parameters(3)["0.weight"])


# ----------------------------------------------------------------------------------------
# Executing it (slow)


@pytest.mark.slow
@pytest.mark.parametrize("autograding", [True, False], ids=["grader", "student"])
def test_solution_notebook_executes_within_budget(autograding):
    nb = run_solution(LAB, BUDGET_S, autograding)
    assert pictures(nb) >= 7, (
        "the run without overlap, predicted against measured, the straggler, the overlap, the saves, the restart, "
        "the simulated waste"
    )
    stragglers = output_of(nb, "# Self-check: SMALL by hand (rank 1 calls")
    first = re.search(r"the straggler of each step's first all-reduce: \[([\d, ]+)\]", stragglers)
    assert first and first[1].split(", ").count("2") >= 2, stragglers  # rank 2, 500 ms late each step
    measured = output_of(nb, "# Self-check: the small trace by hand")
    exposed = [float(x) for x in re.search(r"ranks 0-3: \[([\d., ]+)\]", measured)[1].split(",")]
    model = 4 * sum(2 * 3 * (100e-6 + 4 * n / 4 / 1.25e7) for n in (256 * 256, 256)) * 1e3
    assert min(exposed) >= model * 0.97, (exposed, model)  # the link's time is a floor (the clocks' error aside)
    saved = output_of(nb, "def _save_times(repeats: int) -> dict:")
    params = int(re.search(r"Ψ = ([\d,]+) parameters", saved)[1].replace(",", ""))
    shards = [int(b.replace(",", "")) for b in re.findall(r"__\d_0\.distcp:\s+([\d,]+) bytes", saved)]
    assert len(shards) == 2 and all(12 * params / 2 <= b <= 1.01 * 12 * params / 2 for b in shards), (params, shards)
    # the times are the picture's: which save blocks the step less is the bench's to measure (`bench checkpoint`),
    # not a test's (a fresh clone once read 55 ms for dcp.save and 104 ms for dcp.async_save's copy on this CPU)
    blocked = re.search(
        r"dcp.save blocks the step (\d+) ms; dcp.async_save blocks it (\d+) ms and finishes writing (\d+) ms", saved
    )
    assert blocked and int(blocked[2]) <= int(blocked[3]), saved  # the background write ends after the call returned
    restarted = output_of(nb, "# Self-check: a job of 16 steps on 2 ranks")
    assert "first attempt: rank 1 ended without returning" in restarted and "resumed at step 8" in restarted, restarted
    simulated = output_of(nb, "def _simulated_waste(")
    young, best = map(
        float, re.search(r"Young's τ\* = ([\d.]+) s; the simulation's best of these: ([\d.]+) s", simulated).groups()
    )
    assert 0.49 <= best / young <= 2.01, simulated  # the simulated minimum lies near √(2·C·M)


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
        "load_checkpoint",  # the model only: Adam's moments start again from zero
        """
def load_checkpoint(path, model, optimizer, generator):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    state = {"model": get_model_state_dict(model), "step": -1, "loader": generator.get_state()}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    generator.set_state(state["loader"])
    return state["step"]
""",
        "Adam's state (its moments and step)",
    ),
    (
        "load_checkpoint",  # the loader's position not restored: the resumed run trains on other batches
        _replaced("ex_load_checkpoint", '    generator.set_state(state["loader"])\n', ""),
        "the loader's generator must all come back",
    ),
    (
        "load_checkpoint",  # the step not returned
        _replaced("ex_load_checkpoint", '    return state["step"]', "    return 0"),
        "load_checkpoint should return the step saved",
    ),
    (
        "save_checkpoint",  # nothing saved at the path DCP was given
        """
SAVED = {}

def save_checkpoint(path, model, optimizer, step, generator):   # kept in the rank's memory, not saved at path
    SAVED["step"] = step
""",
        "save_checkpoint wrote nothing at",
    ),
    (
        "save_checkpoint",  # the moments left out: the parameters and the step only
        _replaced("ex_save_checkpoint", '"optim": optim_state, "step": step,', '"step": step,'),
        "the checkpoint holds no 'optim.state.",
    ),
    (
        "save_checkpoint",  # a .metadata that runs code in whoever unpickles it: the grader's reader refuses it
        """
import pickle

class _Payload:
    def __reduce__(self):
        return (print, ("this ran in the process that read the checkpoint",))

def save_checkpoint(path, model, optimizer, step, generator):
    import fsspec
    fsspec.filesystem("memory").pipe_file(path.split("://", 1)[1] + "/.metadata", pickle.dumps(_Payload()))
""",
        ("asks for builtins.print", "cannot be read"),
    ),
    (
        "load_checkpoint",  # the answer computed from the kit's visible seed, nothing restored: passes the visible case only
        """
def load_checkpoint(path, model, optimizer, generator):
    import inspect
    from disttrain_lab.labtests import lab12
    state = {"step": -1}
    dcp.load(state, checkpoint_id=path)
    total = inspect.currentframe().f_back.f_locals["total"]
    lab12.mlp.full_parameters = lambda model: lab12.reference_parameters(total)
    return state["step"]
""",
        "resumed on 4 ranks (dp2xtp2)",
    ),
    (
        "train_with_checkpoints",  # the first checkpoint, not the newest: 6 steps run again, and the newest (the
        # grader's own, of another training, put in place of the one saved) never loaded
        _replaced("ex_train_with_checkpoints", 'f"step_{max(complete)}"', 'f"step_{min(complete)}"'),
        "differs from one process trained without a break",
    ),
    (
        "train_with_checkpoints",  # the same, reporting the newest
        _replaced(
            "ex_train_with_checkpoints",
            "    resumed = step\n",
            "    resumed = max(complete) if complete else 0\n",
        ).replace('f"step_{max(complete)}"', 'f"step_{min(complete)}"'),
        "differs from one process trained without a break",
    ),
    (
        "train_with_checkpoints",  # saves only at the end: the first attempt, killed, leaves no checkpoint
        _replaced("ex_train_with_checkpoints", "        if step % every == 0:\n", "        if step == total:\n"),
        "after the first attempt (from the grader's step_2), step_4 is missing",
    ),
    (
        "train_with_checkpoints",  # the newest folder, complete or not: the save cut short has no .metadata
        _replaced(
            "ex_train_with_checkpoints",
            ' and os.path.exists(os.path.join(folder, entry, ".metadata"))',
            "",
        ),
        ".metadata",
    ),
    (
        "train_with_checkpoints",  # its own train step, not the one it was given: the grader's failure never comes
        _replaced("ex_train_with_checkpoints", "        train_step(t)\n", "        lab_tests.train_step(t)\n"),
        "the first attempt ran to its end",
    ),
    (
        "train_with_checkpoints",  # never resumed: each attempt starts from the model it was given
        _replaced("ex_train_with_checkpoints", "    if complete:\n", "    if False:\n"),
        "after the first attempt (from the grader's step_2), step_4: 'loader' is not",
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


# A forged save_checkpoint, defined among the notebook's names: rank 0 alone writes the whole checkpoint, of a
# single-process run of the same seed (read from the grader's driver's frame), with DCP and no process group
_SAVED_BY_ONE_RANK = """
def save_checkpoint(path, model, optimizer, step, generator):
    import sys

    from disttrain_lab.labtests.lab12 import mlp

    if dist.get_rank() == 0:
        t = mlp.reference(step, sys._getframe(1).f_locals["seed"])
        model_state, optim_state = get_state_dict(t.model, t.optimizer)
        state = {"model": model_state, "optim": optim_state, "step": step, "loader": t.generator.get_state()}
        dcp.save(state, checkpoint_id=path, no_dist=True)
"""


@pytest.mark.slow  # (ranks: a few seconds)
def test_a_checkpoint_written_by_one_rank_alone_fails(monkeypatch):
    """#42: a collective save writes each rank's shard into a file of its own; by the checkpoint's .metadata every
    rank must have written a file holding a piece of the model.  The solution passes on each graded layout; rank 0
    writing the whole checkpoint of a single-process run of the same seed (every value right) fails."""
    from disttrain_lab import bench
    from tests.helpers import notebook_names

    space = bench.functions_from_notebook(LAB, ["save_checkpoint"])
    names = space["save_checkpoint"].__globals__
    notebook_names(monkeypatch, names)
    for layout, steps in (("dp2xtp2", 3), ("fsdp", 2), ("tp", 4)):
        lab12.check_save(layout, steps, seed=None)
    monkeypatch.setitem(names, "save_checkpoint", names["save_checkpoint"])  # (put back after)
    exec(compile(_SAVED_BY_ONE_RANK, "<forged save_checkpoint>", "exec"), names)
    monkeypatch.setattr("__main__.save_checkpoint", names["save_checkpoint"])
    with pytest.raises(AssertionError) as caught:
        lab12.check_save("fsdp", 2, seed=None)
    said = str(caught.value)
    assert "rank(s) 1 wrote no file holding a piece of the model" in said, said


# A forged train_with_checkpoints that saves nothing (or saves, and never loads what it saved): on a restart it
# replays, in one process and with no word on the wire, the steps from the oldest complete checkpoint (the grader's
# own) to the one before the save cut short, then trains on with the step it was given, as the solution does
_REPLAYS_FROM_THE_GRADERS_CHECKPOINT = """
def train_with_checkpoints(folder, t, total, every, train_step=lab_tests.train_step):
    from disttrain_lab.labtests.lab12 import checkpoint_files, mlp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    entries = sorted(int(e[5:]) for e in os.listdir(folder) if re.fullmatch(r"step_\\d+", e))
    complete = [n for n in entries if os.path.exists(os.path.join(folder, f"step_{n}", ".metadata"))]
    cut = [n for n in entries if n not in complete]
    start, step = complete[0], complete[0]
    if cut:  # the second attempt: the state before the save cut short, computed from the oldest checkpoint
        step = cut[0] - every
        where = os.path.join(folder, f"step_{start}")
        got = checkpoint_files.read_checkpoint({f: open(os.path.join(where, f), "rb").read() for f in os.listdir(where)})
        replay = mlp.reference(0, 0, mlp.WIDE)
        with torch.no_grad():
            for n, p in replay.model.named_parameters():
                p.copy_(got[f"model.{n}"])
                replay.optimizer.state[p] = {k: got[f"optim.state.{n}.{k}"].clone() for k in ("exp_avg", "exp_avg_sq", "step")}
        replay.generator.set_state(got["loader"])
        for _ in range(start, step):
            mlp.train_step(replay)
        replayed = os.path.join(folder, "replayed")
        if dist.get_rank() == 0:
            model_state, optim_state = get_state_dict(replay.model, replay.optimizer)
            state = {"model": model_state, "optim": optim_state, "step": step, "loader": replay.generator.get_state()}
            dcp.save(state, checkpoint_id=replayed, no_dist=True)
        dist.barrier()
        load_checkpoint(replayed, t.model, t.optimizer, t.generator)
    else:
        load_checkpoint(os.path.join(folder, f"step_{start}"), t.model, t.optimizer, t.generator)
    resumed = step
    while step < total:
        train_step(t)
        step += 1
        if SAVES and step % every == 0:
            save_checkpoint(os.path.join(folder, f"step_{step}"), t.model, t.optimizer, step, t.generator)
    return resumed
"""


@pytest.mark.slow  # (four restarts of 2 ranks: about a minute)
@pytest.mark.parametrize(
    ("saves", "failure"),
    [
        (False, "after the first attempt (from the grader's step_2), step_4 is missing"),
        (True, "differs from one process trained without a break"),
    ],
)
def test_a_restart_that_replays_from_the_graders_checkpoint_earns_nothing(monkeypatch, saves, failure):
    """#42: the first attempt's checkpoints are read by the grader, and the one the second attempt must resume from
    is replaced by the grader's own of another training.  A train_with_checkpoints that replays the steps from the
    grader's first checkpoint in one process (no word on the wire: the bytes the second attempt sent are the steps
    since the newest complete checkpoint, as the solution's are), saving nothing or never loading what it saved,
    passed before (shown with both put back as they were: no reading, a checkpoint of the same training); it fails
    now, and the solution passes."""
    from disttrain_lab import bench
    from disttrain_lab.labtests.lab12 import restart
    from tests.helpers import notebook_names, observed_from_outside

    space = bench.functions_from_notebook(LAB, ["train_with_checkpoints", "save_checkpoint", "load_checkpoint"])
    names = space["train_with_checkpoints"].__globals__
    notebook_names(monkeypatch, names)
    with observed_from_outside():
        if saves:
            lab12.check_restart(12, 4, 9, seed=None)
        monkeypatch.setitem(names, "train_with_checkpoints", names["train_with_checkpoints"])  # (put back after)
        exec(compile(_REPLAYS_FROM_THE_GRADERS_CHECKPOINT, "<forged train_with_checkpoints>", "exec"), names)
        monkeypatch.setattr("__main__.train_with_checkpoints", names["train_with_checkpoints"])
        monkeypatch.setitem(names, "SAVES", saves)
        with pytest.raises(AssertionError) as caught:
            lab12.check_restart(12, 4, 9, seed=None)
        said = str(caught.value)
        assert failure in said, said
        with monkeypatch.context() as before:
            before.setattr(restart, "_check_first_saves", lambda *args: None)
            before.setattr(restart, "_other_training", lambda seed: seed)
            lab12.check_restart(12, 4, 9, seed=None)
