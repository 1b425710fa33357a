"""Lab 2 (all-reduce): the solution notebook runs, its graded tests can fail, and the
all-reduce bench harness and ring-steps picture work.

- The solution notebook executes top to bottom in a real kernel as the grader runs it
  (NBGRADER_EXECUTION set), within the 4-minute budget, every graded cell passing.
- (The blank notebook failing every graded cell is checked by the autograde round trip in
  test_grading.py, on every lab.)  Wrong answers (a ring that calls dist.all_reduce, a ring that sends the
  whole tensor each step, a naive one without the broadcast, halving on 3 ranks without an
  error, a reduce-scatter that leaves the wrong chunk on each rank) fail the right graded
  cell with a message that says why.
- bench.bench_allreduce / functions_from_notebook / `disttrain-lab bench allreduce` and
  viz.ring_steps, on the solution's own functions.

The notebook helpers come from tests/notebooks.py; the autograde round trip lives in test_grading.py.
"""

from __future__ import annotations

import copy
import inspect
import math
import os

import matplotlib
import nbformat
import pytest
import torch

import disttrain_lab as dl
from disttrain_lab import bench
from disttrain_lab.labtests import common, lab02
from tests.helpers import run_python, shm_clear
from tests.notebooks import (
    REPO,
    cell_by_id,
    errors,
    errors_of_wrong_predictions,
    execute,
    load,
    notebook_of,
    output_of,
    pictures,
    prediction_problems,
    run_solution,
    solution_notebook,
    text,
)

matplotlib.use("Agg")

LAB = solution_notebook("02_all_reduce")
BUDGET_S = 240  # the budget for the whole solution notebook on 2 cores
EXERCISES = [
    "naive_all_reduce",
    "ring_reduce_scatter",
    "ring_all_gather",
    "ring_all_reduce",
    "halving_doubling_all_reduce",
    "pipelined_ring_all_reduce",
]
FUNCTIONS = [
    "naive_all_reduce",
    "parallel_all_reduce",
    "ring_all_reduce",
    "halving_doubling_all_reduce",
    "pipelined_ring_all_reduce",
]


@pytest.fixture(scope="module")
def solution() -> dict:
    """The solution notebook's functions, as `disttrain-lab bench allreduce` loads them."""
    return bench.functions_from_notebook(LAB, FUNCTIONS + ["ring_reduce_scatter", "ring_all_gather", "scratch_buffer"])


# ----------------------------------------------------------------------------------------
# The notebook's structure (fast)


def test_not_a_power_of_two_is_matched_on_the_words_the_text_asks_for():
    # the exercise asks for a ValueError that says "power of two" (torch's own ValueError for a partner
    # rank that does not exist must not pass), and the graded cell's check matches exactly that
    nb = load(LAB)
    hidden = cell_by_id(nb, "test_halving_doubling_all_reduce").source.split("### BEGIN HIDDEN TESTS")[1]
    assert "lab_tests.check_halving_doubling_not_a_power_of_two(3)" in hidden
    check = inspect.getsource(lab02.check_halving_doubling_not_a_power_of_two)
    assert 'common.rank_raised(e, "ValueError", "power of two", loose=True)' in check
    raised = inspect.getsource(common.rank_raised)
    assert "error.exc_type == exc_type and words in said" in raised and 'said.lower().replace("-", " ")' in raised
    assert "says N must be a **power of two**" in "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


def test_predictions_self_checks_and_graded_tests_agree():
    # three predictions, each with a self-check of its form (no answer, no digest) that the solution's value
    # passes, and a 1-point graded test computing section 2's model
    assert prediction_problems(load(LAB)) == []
    source = "\n".join(c.source for c in load(LAB).cells)
    assert source.count("dl.predictions.check(") == 3 and source.count("dl.viz.predicted_vs_measured(") == 2


def test_no_claim_that_gloo_chooses_its_all_reduce_by_size():
    # torch's ProcessGroupGloo calls gloo::allreduce without an algorithm: gloo's ring, at every size
    text = "\n".join(c.source for c in load(LAB).cells if c.cell_type == "markdown")
    assert "NCCL and gloo choose by size" not in text
    assert "gloo, as torch calls it, does not choose" in text and "`gloo/allreduce.cc`" in text


def test_the_stretch_is_optional_and_the_ring_stays_the_lectures():
    nb = load(LAB)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "### Exercise 6 (optional): `pipelined_ring_all_reduce" in text and "## 8. Optional stretch" in text
    assert "segments" not in cell_by_id(nb, "ex_ring_all_reduce").source  # one message per step, as taught


# ----------------------------------------------------------------------------------------
# Executing it (slow)


@pytest.mark.slow
def test_solution_notebook_executes_within_budget():
    nb = run_solution(LAB, BUDGET_S)
    table = output_of(nb, "bench.format_allreduce_table(rows)")
    for name in ("naive", "parallel", "ring", "halving-doubling", "dist.all_reduce"):
        assert name in table, table
    assert "not measured" not in table, table
    assert pictures(nb) >= 4, f"expected two timelines, the ring steps and the busbw plot, got {pictures(nb)}"


# Wrong answers the graded tests must catch: (graded cell, wrong solution, words the failure must contain)
WRONG = [
    (
        "ring_all_reduce",
        """
def ring_all_reduce(x):
    dist.all_reduce(x)
    return x
""",
        "collective all_reduce",
    ),
    (
        "ring_all_reduce",
        """
def ring_all_reduce(x):                       # passes whole tensors around the ring: N-1 steps of S bytes
    rank, n = dist.get_rank(), dist.get_world_size()
    total, message, incoming = x.clone(), x.clone(), torch.empty_like(x)
    for step in range(n - 1):
        request = dist.isend(message, dst=(rank + 1) % n)
        dist.recv(incoming, src=(rank - 1) % n)
        request.wait()
        total += incoming
        message = incoming.clone()
    x.copy_(total)
    return x
""",
        "one chunk of S/N, not the whole tensor",
    ),
    (
        "naive_all_reduce",
        """
def naive_all_reduce(x):                      # reduces to rank 0, forgets to send the sum back
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        incoming = torch.empty_like(x)
        for peer in range(1, n):
            dist.recv(incoming, src=peer)
            x += incoming
    else:
        dist.send(x, dst=0)
    return x
""",
        "rank 1's x after the call",
    ),
    ("halving_doubling_all_reduce", None, "not a power of two"),  # the solution without its check
    (
        "ring_reduce_scatter",
        """
def ring_reduce_scatter(flat):                # the textbook indices: rank r ends with chunk r+1
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = flat.tensor_split(n)
    for step in range(n - 1):
        send, recv = (rank - step) % n, (rank - step - 1) % n
        buffer = torch.empty_like(chunks[recv])
        request = dist.isend(chunks[send], dst=(rank + 1) % n)
        dist.recv(buffer, src=(rank - 1) % n)
        chunks[recv].add_(buffer)
        request.wait()
    return chunks[rank]
""",
        "the chunk rank 0 returned",
    ),
]


WRONG += [
    (
        "pipelined_ring_all_reduce",
        """
def pipelined_ring_all_reduce(x, segments=16):   # the plain ring: one message per step
    return ring_all_reduce(x)
""",
        "as segments = 4 messages",
    ),
    (
        "pipelined_ring_all_reduce",
        """
def pipelined_ring_all_reduce(x, segments=16):
    dist.all_reduce(x)
    return x
""",
        "collective all_reduce",
    ),
]

# Wrong predictions the graded cells must catch: (graded cell, the cell a student wrote)
WRONG_PREDICTIONS = [
    ("test_predict_busiest_bytes", "PREDICTED_NAIVE_BYTES = 2 * (8 - 1) * 4 * 2**20   # sent and received"),
    ("test_predict_ring_bytes", "PREDICTED_RING_BYTES = (8 - 1) * 4 * 2**20 / 8     # reduce-scatter only"),
    ("test_predict_ring_time", "PREDICTED_RING_MS = 2 * (4 - 1) * (50e-6 + 16 * 2**20 / 1.25e8) * 1e3   # S per step"),
]


@pytest.fixture(scope="module")
def wrong_prediction_errors():
    return errors_of_wrong_predictions(LAB, WRONG_PREDICTIONS)  # (one kernel for them all)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", range(len(WRONG_PREDICTIONS)), ids=["naive_both_ways", "ring_one_phase", "ring_whole_S"]
)
def test_graded_prediction_catches_a_wrong_number(case, wrong_prediction_errors):
    found = wrong_prediction_errors[case]
    assert found, f"the graded cell {WRONG_PREDICTIONS[case][0]} passed a wrong prediction"
    assert "does not match the cost model to 3 significant figures" in found, found


def _without_power_of_two_check(source: str) -> str:
    start = source.index("    if world_size & (world_size - 1):")
    end = source.index("    work = x.contiguous()", start)
    return source[:start] + source[end:]


@pytest.fixture(scope="module")
def wrong_answer_errors():
    """One kernel for every wrong answer in WRONG (a kernel's start is about 5 s of CPU): the setup cell and the
    scratch buffer's, then for each the solutions it is built on, the note that the ring's halves passed, the
    wrong definition and its graded cell.  Each graded cell's error ("" where it passed)."""
    lab = load(LAB)
    scratch = next(c for c in lab.cells if "def scratch_buffer(" in c.source)
    ring = [cell_by_id(lab, f"ex_{name}") for name in ("ring_reduce_scatter", "ring_all_gather", "ring_all_reduce")]
    # a ring_all_reduce is graded on the student's halves once their graded tests passed (else on stand-ins)
    passed = nbformat.v4.new_code_cell('lab_tests.GRADED_PASSED.update({"ring_reduce_scatter", "ring_all_gather"})')
    cells, graded_at = [lab.cells[0], scratch], []
    for exercise, wrong, _ in WRONG:
        if wrong is None:
            wrong = _without_power_of_two_check(cell_by_id(lab, f"ex_{exercise}").source)
        before = {"pipelined_ring_all_reduce": ring, "ring_all_reduce": ring[:2]}.get(exercise, [])
        cells += [*before, passed, nbformat.v4.new_code_cell(wrong)]
        graded_at.append(len(cells))
        cells.append(cell_by_id(lab, f"test_{exercise}"))
    nb, _ = execute(notebook_of(cells), autograding=True, cwd=LAB.parent)
    for i, cell in enumerate(nb.cells):
        assert i in graded_at or not errors(cell), (i, errors(cell))
    return [(errors(nb.cells[at]) or [""])[0] for at in graded_at]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    range(len(WRONG)),
    ids=[
        "ring_calls_all_reduce",
        "ring_sends_whole_tensor",
        "naive_without_broadcast",
        "halving_on_3_ranks",
        "reduce_scatter_wrong_chunk",
        "pipelined_without_segments",
        "pipelined_calls_all_reduce",
    ],
)
def test_graded_cell_catches_a_wrong_answer(case, wrong_answer_errors):
    exercise, _, message = WRONG[case]
    found = wrong_answer_errors[case]
    assert found, f"the graded cell test_{exercise} passed a wrong answer"
    assert message in found, found


@pytest.mark.slow
def test_a_wrong_reduce_scatter_costs_ring_all_reduce_nothing():
    """#41: one mistake costs one exercise.  A reduce-scatter that leaves the wrong chunk fails its own
    graded cell; ring_all_reduce, built on it, is then graded on the grader's stand-in (not a ring: each
    chunk straight to its rank) and keeps its points, while the all-gather that passed is still yours."""
    lab = load(LAB)
    wrong = next(source for exercise, source, _ in WRONG if exercise == "ring_reduce_scatter")
    scratch = next(c for c in lab.cells if "def scratch_buffer(" in c.source)
    mine = [cell_by_id(lab, f"ex_{name}") for name in ("ring_all_gather", "ring_all_reduce")]
    tests = [cell_by_id(lab, f"test_{name}") for name in ("ring_reduce_scatter", "ring_all_gather", "ring_all_reduce")]
    nb = nbformat.v4.new_notebook(
        cells=[copy.deepcopy(c) for c in (lab.cells[0], scratch, *mine)]
        + [nbformat.v4.new_code_cell(wrong)]
        + [copy.deepcopy(c) for c in tests]
    )
    nb, _ = execute(nb, autograding=True, cwd=LAB.parent)
    reduce_scatter, all_gather, all_reduce = nb.cells[-3:]
    assert errors(reduce_scatter) and "the chunk rank 0 returned" in errors(reduce_scatter)[0], errors(reduce_scatter)
    assert not errors(all_gather), errors(all_gather)
    assert not errors(all_reduce), errors(all_reduce)
    assert "ring_reduce_scatter has not passed its graded test" in text(all_reduce), text(all_reduce)
    assert "ring_all_gather" not in text(all_reduce).split("passed its graded test")[0], text(all_reduce)


def test_the_stand_ins_are_not_rings_and_earn_the_halves_nothing():
    """#42 item 4: the grader's stand-ins reach the student's kernel as source; handed in as the
    student's own halves they fail those exercises (messages to ranks other than the right neighbour)."""
    import __main__

    for name, stand_in, check in (
        ("ring_reduce_scatter", lab02.direct_reduce_scatter, lab02.check_ring_reduce_scatter),
        ("ring_all_gather", lab02.direct_all_gather, lab02.check_ring_all_gather),
    ):
        setattr(__main__, name, stand_in)
        try:
            with pytest.raises(AssertionError, match="message"):
                check(3, 12, torch.float32)
        finally:
            delattr(__main__, name)


def _ring_reduce_scatter_with_a_hidden_extra(flat):
    """A right ring reduce-scatter whose trace hides what else it sends: each step, with the kit's
    recording switched off, the whole tensor to its right neighbour as well (then the record put back)."""
    import torch.distributed as dist

    from disttrain_lab import trace

    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = flat.tensor_split(n)
    for step in range(n - 1):
        kept, extra = trace.set_recording(False), torch.empty_like(flat)
        request = dist.isend(flat.clone(), (rank + 1) % n)
        dist.recv(extra, (rank - 1) % n)
        request.wait()
        trace.set_recording(True)
        trace._REC.events[:0] = kept
        send, into = (rank - step - 1) % n, (rank - step - 2) % n
        got = torch.empty_like(chunks[into])
        request = dist.isend(chunks[send].contiguous(), (rank + 1) % n)
        dist.recv(got, (rank - 1) % n)
        request.wait()
        chunks[into].add_(got)
    return chunks[rank]


def test_what_a_ring_sent_is_the_operating_systems_count_not_its_trace():
    # the trace shows the ring's N-1 chunks and nothing else; the OS counted the hidden tensors too
    import __main__

    __main__.ring_reduce_scatter = _ring_reduce_scatter_with_a_hidden_extra
    try:
        with pytest.raises(AssertionError) as caught:
            lab02.check_ring_reduce_scatter(4, 1001)
    finally:
        del __main__.ring_reduce_scatter
    said = str(caught.value)
    assert "the operating system counted" in said and "3 message(s) with 3,000 bytes of payload" in said, said


def _all_gather_by_shared_memory(flat):
    """A ring all-gather's messages, of its sizes and order, that carry zeros: the chunks reach every
    rank through /dev/shm instead."""
    import torch.distributed as dist

    from tests.helpers import shm_get, shm_path, shm_put

    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = flat.tensor_split(n)
    shm_put(shm_path("lab02-test", f"{flat.numel()}-{rank}"), chunks[rank].clone())
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        outgoing, incoming = (rank - step) % n, (rank - step - 1) % n
        request = dist.isend(torch.zeros_like(chunks[outgoing]), right)
        dist.recv(torch.empty_like(chunks[incoming]), left)
        request.wait()
    for other in range(n):
        chunks[other].copy_(shm_get(shm_path("lab02-test", f"{flat.numel()}-{other}")))
    return flat  # (the test removes the files)


@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_an_all_gathers_messages_carry_the_chunks_themselves(solution):
    """#42: where a message's values are fixed (the all-gather's chunks) the grader's capture checks
    them; messages of the right count, size and order that carry zeros, the chunks passed through
    shared memory, fail (the OS's count alone took them); the solution's ring passes."""
    import __main__
    from tests.helpers import observed_from_outside

    with observed_from_outside():
        for name, fn in (("solution", solution["ring_all_gather"]), ("shared memory", _all_gather_by_shared_memory)):
            __main__.ring_all_gather = fn
            try:
                if name == "solution":
                    lab02.check_ring_all_gather(4, 1001)
                    continue
                with pytest.raises(AssertionError) as caught:
                    lab02.check_ring_all_gather(4, 1001)
            finally:
                del __main__.ring_all_gather
                shm_clear("lab02-test")
    said = str(caught.value)
    assert "from rank 0 to rank 1 should carry 3 message(s)" in said and "found 0 of them" in said, said


def _reduce_scatter_by_shared_memory(flat):
    """A ring reduce-scatter's messages, of its sizes and order, that carry each rank's own chunk
    instead of the partial sums: the sums are made from every rank's flat, passed through /dev/shm."""
    import torch.distributed as dist

    from tests.helpers import shm_get, shm_path, shm_put

    rank, n = dist.get_rank(), dist.get_world_size()
    shm_put(shm_path("lab02-test", f"{flat.numel()}-{rank}"), flat.clone())
    chunks = flat.tensor_split(n)
    for step in range(n - 1):
        send, into = (rank - step - 1) % n, (rank - step - 2) % n
        request = dist.isend(chunks[send].clone(), (rank + 1) % n)  # its own data, not the partial sum
        dist.recv(torch.empty_like(chunks[into]), (rank - 1) % n)
        request.wait()
    total = torch.zeros_like(flat)
    for other in range(n):
        total += shm_get(shm_path("lab02-test", f"{flat.numel()}-{other}"))
    return total.tensor_split(n)[rank].clone()


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_a_reductions_messages_carry_its_partial_sums(solution):
    """#42: a reduction's messages hold partial sums, each the sum of the ranks it has passed
    (``carried.assert_sums_carried``, from the grader's capture): the solution's five all-reduces
    pass on the graded shapes; a ring reduce-scatter whose messages have the right count, size and
    order but carry each rank's own chunk, the sums made from data passed through /dev/shm, fails."""
    import __main__
    from tests.helpers import observed_from_outside

    names = ["naive_all_reduce", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce"]
    names += ["halving_doubling_all_reduce", "pipelined_ring_all_reduce"]
    for name in names:
        setattr(__main__, name, solution[name])
    lab02.GRADED_PASSED.update(lab02.HALVES)
    try:
        with observed_from_outside():
            lab02.check_naive_all_reduce(3, (5, 7))
            lab02.check_ring_reduce_scatter(4, 1001, torch.bfloat16)
            lab02.check_ring_all_reduce(4, (10, 33))
            lab02.check_halving_doubling_all_reduce(4, (10, 9), torch.float16)
            lab02.check_pipelined_ring_all_reduce(3, (1001,), 4)
            __main__.ring_reduce_scatter = _reduce_scatter_by_shared_memory
            with pytest.raises(AssertionError) as caught:
                lab02.check_ring_reduce_scatter(4, 1001)
    finally:
        lab02.GRADED_PASSED.clear()
        for name in names:
            delattr(__main__, name)
        shm_clear("lab02-test")
    said = str(caught.value)
    assert "message 2 of 3 from rank 0 to rank 1 should hold a piece of the sum of ranks 0, 3's data" in said, said


def _pipelined_own_data(x, segments, public_seeds=False):
    """A pipelined ring whose messages have a ring's count, sizes and order, each a piece of a right sum, but no
    step passes on what the step before brought in: every reduce-scatter message is a piece of the sender's own
    data, every all-gather message a piece of the total, made from the data passed through the store (or, with
    ``public_seeds``, from the seeds this kit's checks once used for every case: ``sample_tensor(seed=rank)``)."""
    import torch
    import torch.distributed as dist

    from disttrain_lab import checks
    from tests.helpers import through_the_store

    n, r = dist.get_world_size(), dist.get_rank()
    flat = x.reshape(-1)
    if public_seeds:
        total = sum(checks.sample_tensor(x.shape, x.dtype, seed=k).reshape(-1) for k in range(n))
    else:
        total = sum(through_the_store(flat.clone(), "pipelined own data"))
    for s in range(2 * (n - 1)):
        c = (r - s) % n if s < n - 1 else (r + 1 - s) % n
        for seg in (flat if s < n - 1 else total).tensor_split(n)[c].tensor_split(segments):
            sent = dist.isend(seg.clone(), (r + 1) % n)
            dist.recv(torch.empty_like(seg), (r - 1) % n)
            sent.wait()
    return x.copy_(total.reshape(x.shape))


def _halving_own_data(x):
    """Recursive halving-doubling with its partners, rounds, sizes and order, each message a piece of a right sum,
    but every halving message a piece of the sender's own data (the group exchanged with so far never grows), the
    doubling's pieces of the total made from the data passed through the store."""
    import torch
    import torch.distributed as dist

    from tests.helpers import through_the_store

    n, r = dist.get_world_size(), dist.get_rank()
    flat = x.reshape(-1)
    total = sum(through_the_store(flat.clone(), "halving own data"))
    bounds = [0, *torch.tensor([len(c) for c in flat.tensor_split(n)]).cumsum(0).tolist()]
    lo, hi, d, rounds = 0, n, n // 2, []
    while d >= 1:
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if r & d else ((lo, mid), (mid, hi))
        sent = dist.isend(flat[bounds[give[0]] : bounds[give[1]]].clone(), r ^ d)
        dist.recv(torch.empty(bounds[keep[1]] - bounds[keep[0]], dtype=x.dtype), r ^ d)
        sent.wait()
        rounds.append((r ^ d, keep, give))
        (lo, hi), d = keep, d // 2
    for partner, keep, give in reversed(rounds):
        sent = dist.isend(total[bounds[keep[0]] : bounds[keep[1]]].clone(), partner)
        dist.recv(torch.empty(bounds[give[1]] - bounds[give[0]], dtype=x.dtype), partner)
        sent.wait()
    return x.copy_(total.reshape(x.shape))


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_every_step_passes_on_its_partial_sum_and_the_data_is_unseen(solution):
    """#42: a pipelined ring whose reduce-scatter messages are all pieces of the sender's own data (an allowed set
    for a message, so each message alone passed) and a halving-doubling whose halving messages are too, the totals
    through the store, fail on the number of each partial sum the wire carried; the solution passes both.  And the
    cases' data come from seeds no student process knows (``labtests.common.unseen``): a total made from the seeds
    the checks once used (``sample_tensor(seed=rank)``) is wrong."""
    import functools

    import __main__
    from tests.helpers import observed_from_outside

    names = ["halving_doubling_all_reduce", "pipelined_ring_all_reduce"]
    try:
        with observed_from_outside():
            for name in names:
                setattr(__main__, name, solution[name])
            lab02.check_pipelined_ring_all_reduce(3, (1002,), 4)
            lab02.check_halving_doubling_all_reduce(4, (12, 10))
            __main__.pipelined_ring_all_reduce = _pipelined_own_data
            with pytest.raises(AssertionError) as pipelined:
                lab02.check_pipelined_ring_all_reduce(3, (1002,), 4)
            __main__.halving_doubling_all_reduce = _halving_own_data
            with pytest.raises(AssertionError) as halving:
                lab02.check_halving_doubling_all_reduce(4, (12, 10))
            __main__.pipelined_ring_all_reduce = functools.partial(_pipelined_own_data, public_seeds=True)
            with pytest.raises(AssertionError) as seeds:
                lab02.check_pipelined_ring_all_reduce(3, (1002,), 4)
    finally:
        for name in names:
            delattr(__main__, name)
    said = str(pipelined.value)
    assert "rank 0 sent rank 1 8 piece(s) of the sum of ranks [0], 0 piece(s) of the sum of ranks [0, 2]" in said, said
    assert "4 of ranks [0]', 4 of ranks [0, 2]'" in said, said
    said = str(halving.value)
    assert "halving messages held sums over groups of [1, 1] ranks" in said and "one over each of [1, 2]" in said, said
    assert "pipelined_ring_all_reduce on 3 ranks" in str(seeds.value), str(seeds.value)


def _ring_untraced(flat, variant="isend"):
    """A ring reduce-scatter whose messages are the ring's, with its trace switched off (no call recorded: the
    trace counts no step).  ``variant``: "isend" (each step's send posted, then its receive), "early" (every
    receive posted before the first send: honest too), "even_odd" (blocking send/recv ordered by the rank's
    parity: each step two rounds)."""
    import torch.distributed as dist

    from disttrain_lab import trace

    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = list(flat.tensor_split(n))
    steps = [((rank - s - 1) % n, (rank - s - 2) % n) for s in range(n - 1)]
    buffers = [torch.empty_like(chunks[into]) for _, into in steps]
    with trace.unrecorded():
        early = [dist.irecv(b, left) for b in buffers] if variant == "early" else []
        for s, (send, into) in enumerate(steps):
            if variant == "even_odd":
                first, second = (dist.recv, dist.send) if rank % 2 else (dist.send, dist.recv)
                first(*((buffers[s], left) if first is dist.recv else (chunks[send].clone(), right)))
                second(*((buffers[s], left) if second is dist.recv else (chunks[send].clone(), right)))
            else:
                request = dist.isend(chunks[send].clone(), right)
                early[s].wait() if early else dist.recv(buffers[s], left)
                request.wait()
            chunks[into] += buffers[s]
    return chunks[rank].clone()


def _early(flat):
    return _ring_untraced(flat, "early")


def _even_odd(flat):
    return _ring_untraced(flat, "even_odd")


def _halving_doubling_in_turns(x):
    """Recursive halving then doubling with the messages of the solution's, each exchange made in turns: the
    lower rank sends, then receives; the higher receives, then sends (no deadlock, but two rounds an exchange)."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    flat = x.reshape(-1)
    lo, hi, d = 0, n, n // 2
    parts = list(flat.tensor_split(n))
    path = []
    while d >= 1:  # halving: keep the half of [lo, hi) on this rank's side, send the other half
        partner, mid = rank ^ d, (lo + hi) // 2
        mine, theirs = ((lo, mid), (mid, hi)) if rank < partner else ((mid, hi), (lo, mid))
        out = torch.cat(parts[theirs[0] : theirs[1]])
        got = torch.empty_like(torch.cat(parts[mine[0] : mine[1]]))
        _in_turns(rank, partner, out, got)
        joined = torch.cat(parts[mine[0] : mine[1]]) + got
        parts[mine[0] : mine[1]] = list(joined.split([p.numel() for p in parts[mine[0] : mine[1]]]))
        path.append((partner, mine, theirs))
        lo, hi, d = mine[0], mine[1], d // 2
    for partner, mine, theirs in reversed(path):  # doubling: send the part held, receive the partner's
        out = torch.cat(parts[mine[0] : mine[1]])
        got = torch.empty_like(torch.cat(parts[theirs[0] : theirs[1]]))
        _in_turns(rank, partner, out, got)
        parts[theirs[0] : theirs[1]] = list(got.split([p.numel() for p in parts[theirs[0] : theirs[1]]]))
    x.copy_(torch.cat(parts).reshape(x.shape))
    return x


def _in_turns(rank, partner, out, got):
    import torch.distributed as dist

    if rank < partner:
        dist.send(out, partner)
        dist.recv(got, partner)
    else:
        dist.recv(got, partner)
        dist.send(out, partner)


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_the_steps_are_graded_from_the_grader_gate_not_the_ranks_trace(solution):
    """#42: a ring's N-1 steps (and halving-doubling's 2·log2(N) rounds) come from the grader's gate: every
    rank held at each of its receives, each step's message must have crossed by then
    (``labtests/rounds_gate.py``).  Honest rings pass with no trace at all (the trace's step count is 0), the
    receives posted up front too, and the solution's all-reduce and halving-doubling; a ring ordered even/odd
    with blocking calls, and halving-doubling whose exchanges are made in turns, both with the right messages
    and sums, fail on the wire."""
    import __main__
    from tests.helpers import observed_from_outside

    names = ["ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "halving_doubling_all_reduce"]
    for name in names:
        setattr(__main__, name, solution[name])
    lab02.GRADED_PASSED.update(lab02.HALVES)
    said = {}
    try:
        with observed_from_outside():
            lab02.check_ring_all_reduce(4, (10, 33))
            lab02.check_halving_doubling_all_reduce(4, (10, 9))
            for fn in (_ring_untraced, _early):
                __main__.ring_reduce_scatter = fn
                lab02.check_ring_reduce_scatter(4, 1001)
            for name, fn, check in (
                ("ring_reduce_scatter", _even_odd, lambda: lab02.check_ring_reduce_scatter(4, 1001)),
                (
                    "halving_doubling_all_reduce",
                    _halving_doubling_in_turns,
                    lambda: lab02.check_halving_doubling_all_reduce(4, (10, 9)),
                ),
            ):
                setattr(__main__, name, fn)
                with pytest.raises(AssertionError) as caught:
                    check()
                said[name] = str(caught.value)
    finally:
        lab02.GRADED_PASSED.clear()
        for name in names:
            delattr(__main__, name)
    for name, message in said.items():
        assert "when every rank waited for its message of step 1 of" in message, (name, message)
        assert "had sent 0" in message and "post the send with isend, then recv" in message, (name, message)
    assert "rank(s) 1 had sent 0, 3 had sent 0" in said["ring_reduce_scatter"], said  # (the odd ranks)


# ----------------------------------------------------------------------------------------
# The bench harness


def test_busbw_factor_and_sizes():
    assert bench.busbw_factor(2) == 1.0 and bench.busbw_factor(4) == 1.5 and bench.busbw_factor(8) == 1.75
    assert bench.ALLREDUCE_SIZES[0] == 4 << 10 and bench.ALLREDUCE_SIZES[-1] == 64 << 20


def test_format_allreduce_table():
    rows = [
        {
            "algorithm": name,
            "world_size": 4,
            "bytes": 1 << 20,
            "median_s": t,
            "algbw": (1 << 20) / t,
            "busbw": (1 << 20) / t * 1.5,
            "repeats": 5,
        }
        for name, t in (("ring", 0.02), ("dist.all_reduce", 0.01))
    ]
    rows.append({"algorithm": "broken", "world_size": 4, "error": "RankError: NotImplementedError"})
    table = bench.format_allreduce_table(rows)
    assert "busbw in GB/s on 4 ranks, median of 5" in table
    assert "(0.50x)" in table and "(1.00x)" in table and "1.0 MiB" in table
    assert "broken: not measured: RankError: NotImplementedError" in table
    assert "CPU ms" not in table  # rows without the CPU time: no such table
    for row, cpu_s in zip(rows, (0.006, 0.008)):
        row["cpu_s"] = cpu_s
    table = bench.format_allreduce_table(rows)
    cpu = table.split("CPU ms per call and rank")[1]
    assert "6.0 (0.75x)" in cpu and "8.0 (1.00x)" in cpu and "(0.50x)" in table.split("CPU ms")[0], table
    assert "below dist.all_reduce" not in table  # 1 MiB is latency's; "ring" is not one of lab 2's rings


def test_allreduce_table_says_where_a_ring_is_below_gloo():
    """A ring-family row of a bandwidth-bound size (16 MiB on) below dist.all_reduce's busbw is listed with its
    CPU per call against gloo's, and why they go together; one above it is not; one of a smaller size is listed
    apart, with the per-message cost that puts it there."""
    rows = []
    for nbytes in (1 << 20, 16 << 20):
        for name, busbw, cpu_s in (
            ("ring_all_reduce", 0.87, 0.020),
            ("pipelined_ring_all_reduce", 1.05, 0.017),
            ("dist.all_reduce", 1.0, 0.0176),
        ):
            rows.append(
                {
                    "algorithm": name,
                    "world_size": 4,
                    "bytes": nbytes,
                    "busbw": busbw * 1e9,
                    "cpu_s": cpu_s,
                    "repeats": 7,
                }
            )
    for row in rows:
        row["ratio"] = row["busbw"] / 1e9
    table = bench.format_allreduce_table(rows)
    below = table.split("below dist.all_reduce's busbw")[1]
    assert "the link is a CPU core" in below, table
    assert "  ring_all_reduce at 16.0 MiB: busbw 0.87x, CPU per call 1.14x" in below, table
    assert "1.0 MiB:" not in below and "pipelined" not in below, table
    # the same ring at 1 MiB (latency-bound): listed apart, with why a Python loop of messages is below there
    small = table.split("below dist.all_reduce's busbw at latency-bound sizes")[1]
    assert "Python loops of 2·(N − 1) messages" in small and "one call into gloo's C++" in small, table
    assert "  ring_all_reduce: 0.87x at 1.0 MiB (CPU 1.14x)" in small and "pipelined_ring" not in small, table


def test_functions_from_notebook_runs_definitions_not_tests(solution):
    assert set(FUNCTIONS) <= set(solution) and callable(solution["scratch_buffer"])
    namespace = solution["ring_all_reduce"].__globals__
    assert "_check_naive" not in namespace and "_all_reduce_case" not in namespace, "test cells must not run"
    assert "rows" not in namespace, "benchmark cells must not run"


def test_bench_allreduce_measures_side_by_side_and_skips_broken(solution):
    def broken(x):
        return x  # forgets to communicate: wrong on every rank

    rows = bench.bench_allreduce(
        {"ring": solution["ring_all_reduce"], "broken": broken}, world_size=2, sizes=[4 << 10, 64 << 10], repeats=2
    )
    timed = {(r["algorithm"], r["bytes"]): r for r in rows if "error" not in r}
    assert set(timed) == {(a, s) for a in ("ring", "dist.all_reduce") for s in (4 << 10, 64 << 10)}
    for row in timed.values():
        assert row["median_s"] > 0 and row["busbw"] == pytest.approx(row["algbw"] * bench.busbw_factor(2))
        assert 0 < row["cpu_s"] < 60  # the CPU seconds one call cost a rank
    [error] = [r for r in rows if "error" in r]
    assert error["algorithm"] == "broken" and "wrong result" in error["error"]


@pytest.mark.slow  # runs a benchmark on the solution's functions, as labs 3 and 5-7's do
def test_cli_bench_allreduce_uses_the_notebook():
    out = run_python(
        [
            "-m",
            "disttrain_lab.cli",
            "bench",
            "allreduce",
            "--notebook",
            str(LAB),
            "--world-size",
            "2",
            "--min-bytes",
            str(16 << 10),
            "--max-bytes",
            str(64 << 10),
            "--repeats",
            "2",
        ],
        timeout=240,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout
    for name in FUNCTIONS + ["dist.all_reduce", "16.0 KiB", "64.0 KiB"]:
        assert name in out.stdout, out.stdout
    assert " 4.0 KiB" not in out.stdout and "not measured" not in out.stdout, out.stdout
    empty = run_python(
        [
            "-m",
            "disttrain_lab.cli",
            "bench",
            "allreduce",
            "--notebook",
            str(LAB),
            "--min-bytes",
            str(5 << 10),
            "--max-bytes",
            str(15 << 10),
        ],
        timeout=240,
        cwd=REPO,
    )
    assert empty.returncode == 2 and "no size between --min-bytes 5120 and --max-bytes 15360" in empty.stdout, (
        empty.stdout
    )


# ----------------------------------------------------------------------------------------
# The ring-steps picture, from a real traced run


def _ring_run(fn, n: int, numel: int):
    return dl.launch(lambda: fn(torch.full((numel,), float(1 << torch.distributed.get_rank()))), n, trace=True)


def test_ring_transfers_replay_the_trace(solution):
    n = 4
    run = _ring_run(solution["ring_all_reduce"], n, 10)
    steps = dl.viz.ring_transfers(run)
    assert len(steps) == 2 * (n - 1)
    for index, transfers in enumerate(steps):
        assert sorted(t["src"] for t in transfers) == list(range(n))
        assert all(t["dst"] == (t["src"] + 1) % n and t["chunk"] == t["into"] for t in transfers)
        assert {t["phase"] for t in transfers} == {"reduce-scatter" if index < n - 1 else "all-gather"}
    for step in (0, n - 1, 2 * (n - 1)):
        ax = dl.viz.ring_steps(run, step)
        labels = [t.get_text() for t in ax.texts]
        full = "+".join(map(str, range(n)))
        assert labels.count(full) == {0: 0, n - 1: n, 2 * (n - 1): n * n}[step], (step, labels)
    with pytest.raises(ValueError, match="step must be in 0..6"):
        dl.viz.ring_steps(run, 7)


def test_ring_steps_explains_a_run_without_regions(solution):
    run = _ring_run(solution["naive_all_reduce"], 3, 4)
    with pytest.raises(ValueError, match='dl.region\\("reduce-scatter", step=step'):
        dl.viz.ring_steps(run, 1)


def test_halving_doubling_moves_the_ring_bytes_in_fewer_rounds(solution):
    # the cost table of section 2, from traces: same bytes per rank, 2 log2 N rounds instead of 2(N-1)
    n, numel = 8, 1 << 12
    for name, rounds in (("ring_all_reduce", 2 * (n - 1)), ("halving_doubling_all_reduce", 2 * int(math.log2(n)))):
        run = _ring_run(solution[name], n, numel)
        assert run.rounds() == rounds, (name, run.rounds())
        assert {run.bytes_sent(r) for r in range(n)} == {2 * (n - 1) * numel // n * 4}, name


def test_functions_from_notebook_loads_dataclasses(tmp_path):
    # the notebook's cells must not inherit bench.py's `from __future__ import annotations`
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell(
                "from dataclasses import dataclass\n\n@dataclass\nclass Config:\n    width: int = 3\n\n"
                "def make():\n    return Config().width\n"
            )
        ]
    )
    path = tmp_path / "lab.ipynb"
    nbformat.write(nb, path)
    assert bench.functions_from_notebook(path, ["make"])["make"]() == 3


# A forged ring_all_reduce, defined among the notebook's names (where the grader's stand-ins take the halves' place):
# the halves called on zeros, the sum taken through the launcher's store
_RING_ALL_REDUCE_RELAYED = """
def ring_all_reduce(x):
    from tests.helpers import through_the_store

    work = x.contiguous()
    flat = work.view(-1)
    total = sum(through_the_store(flat.clone(), "ring all-reduce"))
    junk = torch.zeros_like(flat)
    ring_reduce_scatter(junk)
    ring_all_gather(junk)
    flat.copy_(total)
    if work is not x:
        x.copy_(work)
    return x
"""


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_on_the_graders_stand_ins_ring_all_reduce_is_read_for_content(solution):
    """#42: where a half has not passed, ring_all_reduce runs on the grader's stand-ins, and their messages are read
    for what they carried: x's own chunks, then the totals (the ring half that passed: its partial sums).  The
    solution passes with either half replaced and with both; one that calls the halves on zeros and takes the sum
    through the launcher's store (the messages' count and sizes, the values right) passes in the student's own
    kernel and fails on the wire."""
    import __main__
    from tests.helpers import observed_from_outside

    names = ["ring_reduce_scatter", "ring_all_gather", "ring_all_reduce"]
    for name in names:
        setattr(__main__, name, solution[name])
    space = dict(solution["ring_all_reduce"].__globals__)
    exec(compile(_RING_ALL_REDUCE_RELAYED, "<forged ring_all_reduce>", "exec"), space)
    try:
        with observed_from_outside():
            for passed in ((), ("ring_reduce_scatter",), ("ring_all_gather",)):
                lab02.GRADED_PASSED.clear()
                lab02.GRADED_PASSED.update(passed)
                lab02.check_ring_all_reduce(4, (10, 33))
        lab02.GRADED_PASSED.clear()
        __main__.ring_all_reduce = space["ring_all_reduce"]
        lab02.check_ring_all_reduce(3, (7, 5))  # (the student's own kernel: the values and the trace's messages)
        with observed_from_outside(), pytest.raises(AssertionError) as caught:
            lab02.check_ring_all_reduce(3, (7, 5))
    finally:
        lab02.GRADED_PASSED.clear()
        for name in names:
            delattr(__main__, name)
    said = str(caught.value)
    assert "message 1 of 2 from rank 0 to rank 1 should hold a piece of the sum of rank 0's data" in said, said
