"""Lab 1 (point-to-point): the solution notebook runs, its graded tests can fail, and checks.py works.

- The solution notebook executes top to bottom in a real kernel, as the grader runs it
  (NBGRADER_EXECUTION set) and as a student does, within the 3-minute budget, with every
  graded cell passing.
- (The blank notebook failing every graded cell is checked by the autograde round trip in
  test_grading.py, on every lab.)  Wrong answers (a deadlocking ring, a tree that is really linear, a
  collective in disguise, ...) fail the right graded cell with a message that says why.
- Unit tests of disttrain_lab.checks and disttrain_lab.costmodel, each check shown to fail
  when it should.

The full autograde round trip (full marks, blank 0, partial) lives in test_grading.py.
"""

from __future__ import annotations

import copy

import nbformat
import numpy as np
import pytest
import torch
import torch.distributed as dist

import disttrain_lab as dl
from disttrain_lab import checks
from disttrain_lab.costmodel import AlphaBeta, fit_alpha_beta
from disttrain_lab.trace import Event, Run
from tests.notebooks import (
    cell_by_id,
    error_of_a_wrong_prediction,
    error_of_last_cell,
    load,
    output_of,
    pictures,
    prediction_problems,
    run_solution,
    solution_notebook,
)

LAB = solution_notebook("01_point_to_point")
BUDGET_S = 180  # the budget for the whole solution notebook on 2 cores
EXERCISES = [
    "ping_pong",
    "ring_shift",
    "broadcast_linear",
    "broadcast_tree",
    "scatter",
    "gather",
    "parameter_server_step",
]


# ----------------------------------------------------------------------------------------
# The notebook's structure (fast)


def test_one_exercise_heading_per_exercise_and_one_section_per_cell():
    from tests.notebooks import numbering_problems

    assert numbering_problems(load(LAB)) == []


def test_predictions_self_checks_and_graded_tests_agree():
    # two predictions, each with a self-check holding the digest of the solution's value and a
    # 1-point graded test computing the same model
    assert prediction_problems(load(LAB)) == []
    source = "\n".join(c.source for c in load(LAB).cells)
    assert source.count("dl.predictions.check(") == 2 and source.count("dl.viz.predicted_vs_measured(") == 2


def test_the_texts_link_is_the_kits_preset():
    # the predictions state α = 50 µs and 1/β = 1.25e8 bytes/s; the measurement runs on the preset
    ethernet = dl.Network.preset("1 Gbit Ethernet")
    assert (ethernet.latency, ethernet.bandwidth) == (50e-6, 1.25e8)


def test_no_claim_that_gloo_picks_its_broadcast_by_size():
    # gloo's broadcast is a binomial tree at every size (gloo/broadcast.cc); NCCL's is a pipelined ring
    text = "\n".join(c.source for c in load(LAB).cells if c.cell_type == "markdown")
    assert "NCCL and gloo pick trees, rings or pipelined chains by size" not in text
    assert "gloo runs your binomial tree, at every size" in text


# ----------------------------------------------------------------------------------------
# Executing it (slow)


@pytest.mark.slow
@pytest.mark.parametrize("autograding", [True, False], ids=["grader", "student"])
def test_solution_notebook_executes_within_budget(autograding):
    nb = run_solution(LAB, BUDGET_S, autograding)
    assert "deadlock" in output_of(nb, "def both_send_first")
    assert pictures(nb) >= 5, f"expected the α–β plot, three timelines and the bar chart, got {pictures(nb)}"


# Wrong answers the graded tests must catch: (exercise, wrong solution, words the failure must contain)
WRONG = [
    (
        "ring_shift",
        """
def ring_shift(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(x)
    dist.send(x, dst=(rank + 1) % n)          # every rank sends first: deadlock
    dist.recv(received, src=(rank - 1) % n)
    return received
""",
        "deadlock",
    ),
    (
        "broadcast_tree",
        """
def broadcast_tree(x, src):                   # really the linear broadcast
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == src:
        for peer in range(n):
            if peer != src:
                dist.send(x, dst=peer)
    else:
        dist.recv(x, src=src)
    return x
""",
        "ceil(log2 4)",
    ),
    (
        "broadcast_linear",
        """
def broadcast_linear(x, src):
    dist.broadcast(x, src=src)
    return x
""",
        "collective broadcast",
    ),
    (
        "ping_pong",
        """
def ping_pong(x, repeats=1):
    rank = dist.get_rank()
    if rank == 0:
        for _ in range(repeats):
            dist.send(x, dst=1)
        for _ in range(repeats):
            dist.recv(x, src=1)
    elif rank == 1:
        for _ in range(repeats):
            dist.recv(x, src=0)
        for _ in range(repeats):
            dist.send(x, dst=0)
    return x
""",
        "a ping must wait for its pong",
    ),
    (
        "gather",
        """
def gather(x, chunks, dst):
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank != dst:
        dist.send(x, dst=dst)
        return None
    for peer in range(n):
        if peer != dst:
            dist.recv(chunks[peer], src=peer)
    return chunks                              # forgot its own chunk
""",
        "chunk 0 on rank 0",
    ),
    (
        "parameter_server_step",
        """
def parameter_server_step(grad, server):
    average = grad.clone() if dist.get_rank() != server else torch.zeros_like(grad)
    dist.all_reduce(average)
    return average / (dist.get_world_size() - 1)
""",
        "collective all_reduce",
    ),
]


# Wrong predictions the graded cells must catch: (graded cell, the cell a student wrote)
WRONG_PREDICTIONS = [
    ("test_predict_ping_pong", "PREDICTED_PING_PONG_MS = (50e-6 + 2**20 / 1.25e8) * 1e3   # one way only"),
    ("test_predict_server_step", "PREDICTED_SERVER_STEP_MS = (4 - 1) * (50e-6 + 2**20 / 1.25e8) * 1e3   # in only"),
    ("test_predict_server_step", "PREDICTED_SERVER_STEP_MS = 2 * (50e-6 + 2**20 / 1.25e8)   # seconds, one worker's"),
]


@pytest.mark.slow
@pytest.mark.parametrize("test, wrong", WRONG_PREDICTIONS, ids=["one_way", "server_in_only", "seconds"])
def test_graded_prediction_catches_a_wrong_number(test, wrong):
    found = error_of_a_wrong_prediction(LAB, test, wrong)
    assert "does not match the cost model to 3 significant figures" in found, found


@pytest.mark.slow
@pytest.mark.parametrize("exercise, wrong, message", WRONG, ids=[w[0] for w in WRONG])
def test_graded_cell_catches_a_wrong_answer(exercise, wrong, message):
    lab = load(LAB)
    nb = nbformat.v4.new_notebook(
        cells=[
            copy.deepcopy(lab.cells[0]),
            nbformat.v4.new_code_cell(wrong),
            copy.deepcopy(cell_by_id(lab, f"test_{exercise}")),
        ]
    )
    if exercise == "broadcast_tree":  # its test reuses the helpers of the linear test cell
        nb.cells.insert(1, copy.deepcopy(cell_by_id(lab, "ex_broadcast_linear")))
        nb.cells.insert(2, copy.deepcopy(cell_by_id(lab, "test_broadcast_linear")))
    found = error_of_last_cell(nb)
    assert message in found, found


# ----------------------------------------------------------------------------------------
# checks.py, without launching


def test_assert_close_passes_on_equal_and_within_tolerance():
    checks.assert_close(torch.arange(6).reshape(2, 3), torch.arange(6).reshape(2, 3))
    checks.assert_close(torch.ones(3) + 1e-7, torch.ones(3))
    checks.assert_close(torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64) + 1e-9)


@pytest.mark.parametrize(
    "actual, expected, words",
    [
        (None, torch.ones(2), ["got NoneType", "shape (2,)"]),
        (torch.ones(3), torch.ones(4), ["expected shape (4,), got shape (3,)"]),
        (torch.ones(3, dtype=torch.float64), torch.ones(3), ["expected dtype float32, got float64"]),
        (
            torch.tensor([[1.0, 2.0], [3.0, 9.0]]),
            torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
            ["max abs diff 5 at index (1, 1)", "got 9.0, expected 4.0", "1 of 4 elements", "rtol="],
        ),
        (torch.tensor([5, 6]), torch.tensor([5, 7]), ["integers must match exactly", "index (1,)"]),
        (torch.ones(3) + 1e-3, torch.ones(3), ["3 of 3 elements differ, the first at index (0,)"]),
    ],
)
def test_assert_close_fails_with_a_useful_message(actual, expected, words):
    with pytest.raises(AssertionError) as info:
        checks.assert_close(actual, expected, what="rank 2's tensor")
    message = str(info.value)
    assert message.startswith("rank 2's tensor: ")
    for word in words:
        assert word in message, message


def test_sample_tensor_is_deterministic_and_typed():
    a = checks.sample_tensor((3, 5), torch.int64, seed=4)
    assert a.dtype == torch.int64 and a.shape == (3, 5) and torch.equal(a, checks.sample_tensor((3, 5), torch.int64, 4))
    assert not torch.equal(a, checks.sample_tensor((3, 5), torch.int64, seed=5))
    assert checks.sample_tensor(7, torch.float64).shape == (7,)


def _event(rank, op, start, end, peer=None, kind=None, name="", nbytes=4):
    kind = kind or ("p2p" if op in ("send", "recv", "isend", "irecv") else "region" if op == "region" else "collective")
    return Event(rank=rank, op=op, kind=kind, start=start, end=end, peer=peer, bytes=nbytes, name=name)


def _run(events) -> Run:
    return Run(results=[None, None], events=sorted(events, key=lambda e: e.start), world_size=2)


def test_within_keeps_only_the_region_of_each_rank():
    run = _run(
        [
            _event(0, "region", 1.0, 2.0, name="student"),
            _event(1, "region", 1.5, 3.0, name="student"),
            _event(0, "send", 1.1, 1.2, peer=1),
            _event(1, "recv", 1.6, 1.7, peer=0),
            _event(0, "broadcast", 2.5, 2.6, peer=0),  # reference after rank 0's region
            _event(1, "broadcast", 2.5, 2.6, peer=0),
        ]
    )  # inside rank 1's region: counts
    inside = checks.within(run, "student")
    assert [(e.rank, e.op) for e in inside.events] == [(0, "send"), (1, "recv"), (1, "broadcast")]
    assert inside.bytes_sent(0) == 4 and inside.world_size == 2
    with pytest.raises(ValueError, match="no region named 'other'.*regions seen: \\['student'\\]"):
        checks.within(run, "other")


def test_assert_only_p2p():
    p2p = _run(
        [
            _event(0, "isend", 0.1, 0.2, peer=1),
            _event(1, "recv", 0.1, 0.3, peer=0),
            _event(0, "wait", 0.2, 0.3, peer=1, kind="wait"),
        ]
    )
    checks.assert_only_p2p(p2p, "ring_shift")
    mixed = _run(
        p2p.events
        + [
            _event(0, "all_reduce", 0.4, 0.5),
            _event(1, "all_reduce", 0.4, 0.5),
            _event(1, "all_reduce", 0.6, 0.7),
            _event(1, "barrier", 0.8, 0.9),
        ]
    )
    with pytest.raises(AssertionError) as info:
        checks.assert_only_p2p(mixed, "broadcast_tree")
    message = str(info.value)
    assert message.startswith("broadcast_tree must be built from point-to-point calls only")
    assert "all_reduce on rank 0 (1×), rank 1 (2×)" in message and "barrier on rank 1 (1×)" in message


def test_sends_and_receives():
    run = _run(
        [
            _event(0, "send", 0.1, 0.2, peer=1),
            _event(0, "isend", 0.3, 0.4, peer=1),
            _event(1, "recv", 0.1, 0.2, peer=0),
            _event(1, "irecv", 0.3, 0.4, peer=0),
        ]
    )
    assert [e.op for e in checks.sends(run, 0)] == ["send", "isend"]
    assert checks.sends(run, 0, peer=0) == [] and checks.sends(run, 1) == []
    assert [e.op for e in checks.receives(run, 1, peer=0)] == ["recv", "irecv"]


def test_verify_untampered_catches_replaced_functions(monkeypatch):
    checks.verify_untampered()
    for module, name in [
        (dist, "broadcast"),
        (torch, "allclose"),
        (checks, "assert_close"),
        (checks, "assert_only_p2p"),
    ]:
        with monkeypatch.context() as patch:
            patch.setattr(module, name, lambda *args, **kwargs: True)
            with pytest.raises(dl.TamperingError, match=f"{module.__name__}.{name} was replaced"):
                checks.verify_untampered()
    checks.verify_untampered()  # everything restored: passes again


def test_passed_prints_a_friendly_line(capsys):
    checks.passed("ring_shift works on 3 ranks")
    assert capsys.readouterr().out == "\N{WHITE HEAVY CHECK MARK} ring_shift works on 3 ranks\n"


# ----------------------------------------------------------------------------------------
# checks.py on a real launch


def _broadcast_with_reference():
    x = torch.arange(4.0) if dist.get_rank() == 1 else torch.zeros(4)
    with dl.region("student"):
        if dist.get_rank() == 1:
            dist.send(x, dst=0)
        else:
            dist.recv(x, src=1)
    expected = x.clone()
    dist.broadcast(expected, src=1)  # the reference, outside the student's region
    return x


def test_within_a_real_traced_launch():
    run = dl.launch(_broadcast_with_reference, 2, trace=True, timeout=60)
    with pytest.raises(AssertionError, match="collective broadcast"):
        checks.assert_only_p2p(run, "broadcast_linear")
    student = checks.within(run, "student")
    checks.assert_only_p2p(student, "broadcast_linear")
    assert student.rounds() == 1 and len(checks.sends(student, 1, peer=0)) == 1


# ----------------------------------------------------------------------------------------
# costmodel.py


def test_fit_alpha_beta_recovers_the_model():
    sizes = [1, 100, 10_000, 1_000_000, 4_000_000]
    truth = AlphaBeta(alpha=50e-6, beta=0.5e-9)
    model = fit_alpha_beta(sizes, truth.predict(sizes))
    assert model.alpha == pytest.approx(50e-6, rel=1e-6) and model.beta == pytest.approx(0.5e-9, rel=1e-6)
    assert model.bandwidth == pytest.approx(2e9) and model.crossover_bytes == pytest.approx(1e5)
    assert "alpha = 50.0 µs" in str(model) and "2 GB/s" in str(model)


def test_fit_alpha_beta_weights_small_messages():
    # a 10 % error on the largest point must not swamp alpha (a plain least squares fit would)
    sizes = np.array([1, 10, 100, 1000, 10_000_000])
    seconds = 50e-6 + 1e-9 * sizes
    seconds[-1] *= 1.1
    assert fit_alpha_beta(sizes, seconds).alpha == pytest.approx(50e-6, rel=0.05)


@pytest.mark.parametrize(
    "nbytes, seconds, words",
    [
        ([1, 1, 1], [1e-5, 1e-5, 1e-5], "at least two different message sizes"),
        ([1, 2], [1e-5], "the same length"),
        ([1, 2], [1e-5, 0.0], "every time must be > 0"),
    ],
)
def test_fit_alpha_beta_rejects_bad_input(nbytes, seconds, words):
    with pytest.raises(ValueError, match=words):
        fit_alpha_beta(nbytes, seconds)
