"""Lab 1 (point-to-point): the solution notebook runs and its graded tests can fail.

(checks.py and costmodel.py are tested in tests/kit/test_checks.py and tests/kit/test_costmodel.py.)

- The solution notebook executes top to bottom in a real kernel, as the grader runs it
  (NBGRADER_EXECUTION set) and as a student does, within the 3-minute budget, with every
  graded cell passing.
- (The blank notebook failing every graded cell is checked by the autograde round trip in
  test_grading.py, on every lab.)  Wrong answers (a deadlocking ring, a tree that is really linear, a
  collective in disguise, ...) fail the right graded cell with a message that says why.

The full autograde round trip (full marks, blank 0) lives in test_grading.py.
"""

from __future__ import annotations

import copy
import os

import nbformat
import pytest
import torch

import disttrain_lab as dl
from disttrain_lab import bench
from disttrain_lab.labtests import lab01
from tests.notebooks import (
    add_wrong_answers,
    assert_wrong_answers_caught,
    cell_by_id,
    errors_of_wrong_predictions,
    execute,
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


def test_predictions_self_checks_and_graded_tests_agree():
    # two predictions, each with a self-check of its form (no answer, no digest) that the solution's value
    # passes, and a 1-point graded test computing the same model
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
        "each ping waiting for its pong",
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


@pytest.fixture(scope="module")
def wrong_prediction_errors():
    return errors_of_wrong_predictions(LAB, WRONG_PREDICTIONS)  # (one kernel for them all)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(WRONG_PREDICTIONS)), ids=["one_way", "server_in_only", "seconds"])
def test_graded_prediction_catches_a_wrong_number(case, wrong_prediction_errors):
    found = wrong_prediction_errors[case]
    assert found, f"the graded cell {WRONG_PREDICTIONS[case][0]} passed a wrong prediction"
    assert "does not match the cost model to 3 significant figures" in found, found


@pytest.mark.slow
def test_graded_cells_catch_wrong_answers():
    """One kernel: for each wrong answer (named in WRONG), the solutions, the wrong definition, then its
    graded cell; the linear broadcast's graded cell first, whose helpers the tree's test reuses."""
    lab = load(LAB)
    solutions = [cell_by_id(lab, f"ex_{e}") for e in EXERCISES]
    cells = [copy.deepcopy(c) for c in (lab.cells[0], *solutions, cell_by_id(lab, "test_broadcast_linear"))]
    graded_at = add_wrong_answers(lab, cells, solutions, [(exercise, wrong) for exercise, wrong, _ in WRONG])
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, timeout=240)
    assert_wrong_answers_caught(nb, graded_at, [message for _, _, message in WRONG])


# ----------------------------------------------------------------------------------------
# The tree's rounds, from the grader's capture (#42)


def _chain(x, src):
    """A broadcast passed down a chain: the source sends once, every other rank receives once and forwards
    once (the tree's bytes and message counts), in N-1 rounds."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    if (rank - src) % n:
        dist.recv(x, (rank - 1) % n)
    if (rank - src) % n < n - 1:
        dist.send(x, (rank + 1) % n)
    return x


def _tree_untraced(x, src):
    """A binomial tree (the largest subtree first), with its trace switched off: the trace counts no round."""
    import torch.distributed as dist

    from disttrain_lab import trace

    rank, n = dist.get_rank(), dist.get_world_size()
    rel, mask = (rank - src) % n, 1
    with trace.unrecorded():
        while mask < n:  # receive from the parent: the lowest set bit of rel
            if rel & mask:
                dist.recv(x, (rank - mask) % n)
                break
            mask <<= 1
        mask >>= 1
        while mask > 0:  # send to the children below it, the farthest first
            if rel + mask < n:
                dist.send(x, (rank + mask) % n)
            mask >>= 1
    return x


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_the_trees_rounds_are_graded_from_the_wire_not_the_ranks_trace():
    """#42: ``broadcast_tree``'s rounds come from the grader's capture (``lab01.wire_rounds``: each message
    sent when its data begins to cross, received when its data is in): a binomial tree with no trace at all
    passes, the solution's too, on several sizes and sources; a chain with the tree's bytes and message counts
    fails on the wire's rounds, and so does a chain that posts every send at once (its send-ready notes all
    leave in round 1: read from the notes, as before, it passed)."""
    import __main__
    from tests.helpers import observed_from_outside

    solution = bench.functions_from_notebook(LAB, ["broadcast_tree"])["broadcast_tree"]
    try:
        with observed_from_outside():
            for fn in (solution, _tree_untraced):
                __main__.broadcast_tree = fn
                for n, src in ((4, 0), (8, 3), (5, 2)):
                    lab01.check_broadcast_tree(n, (7,), torch.float32, src)
            __main__.broadcast_tree = _chain
            with pytest.raises(AssertionError) as caught:
                lab01.check_broadcast_tree(4, (7,), torch.float32, 1)
            __main__.broadcast_tree = _chain_posted_early
            with pytest.raises(AssertionError) as early:
                lab01.check_broadcast_tree(4, (7,), torch.float32, 1)
    finally:
        del __main__.broadcast_tree
    for said in (str(caught.value), str(early.value)):
        assert "needs ceil(log2 4) = 2 rounds, this took 3 (from its messages on the wire" in said, said


def _chain_posted_early(x, src):
    """A chain src → src + 1 → … whose every send is posted at once, before its rank has received what it sends
    (gloo sends the send-ready note as a send is posted, and reads the tensor only once the receiver is ready):
    each rank receives later than the one before it, so the data of every hop crosses after the hop before's."""
    import time

    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    place = (rank - src) % n
    sent = dist.isend(x, (rank + 1) % n) if place < n - 1 else None
    if place:
        time.sleep(0.3 * place)
        dist.recv(x, (rank - 1) % n)
    if sent is not None:
        sent.wait()
    return x


def _broadcast_untraced(x, src):
    """torch's own broadcast, its call left out of the trace: the right data, one message from the source to
    each rank (a 2- or 3-rank broadcast is linear), and a trace that lists no collective."""
    import torch.distributed as dist

    from disttrain_lab import trace

    with trace.unrecorded():
        dist.broadcast(x, src)
    return x


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_only_send_and_recv_is_graded_from_the_wire_not_the_ranks_trace():
    """#42: "only send/recv" comes from the grader's capture (``checks.assert_point_to_point``: a gloo
    collective's messages carry its kind in their slot's top byte, torch's send/recv the caller's tag): the
    solution's broadcast passes, and torch's broadcast with its call kept out of the trace fails on the wire."""
    import __main__
    from tests.helpers import observed_from_outside

    solution = bench.functions_from_notebook(LAB, ["broadcast_linear"])["broadcast_linear"]
    try:
        with observed_from_outside():
            __main__.broadcast_linear = solution
            lab01.check_broadcast_linear(3, (5,), torch.float32, 1)
            __main__.broadcast_linear = _broadcast_untraced
            with pytest.raises(AssertionError) as caught:
                lab01.check_broadcast_linear(3, (5,), torch.float32, 1)
    finally:
        del __main__.broadcast_linear
    said = str(caught.value)
    assert "the grader's capture of the wire shows a collective's messages: broadcast from rank(s) 0, 1, 2" in said, (
        said
    )


def _server_relayed(grad, server):
    """A forged parameter_server_step: the workers' gradients through the launcher's store (a few bytes: under what
    the grader allows a rank to exchange with processes that are not ranks), zeros of their size sent to the server
    and back, one message each way per worker, send/recv alone."""
    import torch
    import torch.distributed as dist

    from tests.helpers import through_the_store

    rank, n = dist.get_rank(), dist.get_world_size()
    everyone = through_the_store(grad, "server")
    average = sum(g for r, g in enumerate(everyone) if r != server) / (n - 1)
    if rank == server:
        for worker in (r for r in range(n) if r != server):
            dist.recv(torch.empty_like(grad), worker)
        for worker in (r for r in range(n) if r != server):
            dist.send(torch.zeros_like(grad), worker)
    else:
        dist.send(torch.zeros_like(grad), server)
        dist.recv(torch.empty_like(grad), server)
    return average


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_a_parameter_server_relaying_through_the_store_fails_on_the_wires_content():
    """#42: what the parameter server's messages carried is read on the wire: each worker's gradient to the server,
    byte for byte, and the server's average back.  The solution passes; a step that passes the gradients through
    the launcher's store and sends zeros in their place, with the right averages, bytes, message counts and
    send/recv alone, passes in the student's own kernel and fails on the wire."""
    import __main__
    from tests.helpers import observed_from_outside

    solution = bench.functions_from_notebook(LAB, ["parameter_server_step"])["parameter_server_step"]
    try:
        __main__.parameter_server_step = _server_relayed
        lab01.check_parameter_server_step(3, (7,), torch.float32, 2)  # (no capture: its account passes)
        with observed_from_outside():
            __main__.parameter_server_step = solution
            lab01.check_parameter_server_step(3, (7,), torch.float32, 2)
            lab01.check_parameter_server_step(4, (2, 3, 5), torch.float64, 3)
            __main__.parameter_server_step = _server_relayed
            with pytest.raises(AssertionError) as caught:
                lab01.check_parameter_server_step(3, (7,), torch.float32, 2)
    finally:
        del __main__.parameter_server_step
    said = str(caught.value)
    assert "the data from rank 0 to rank 2 should carry 1 message(s) of the tensor's own bytes" in said, said
    assert "found 0 of them" in said, said
