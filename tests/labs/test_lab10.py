"""Lab 10 (context and sequence parallelism): the solution notebook runs, its graded tests catch wrong
answers, and the ring is graded on its own.

- The notebook's structure: the exercises and the prediction in order, the hidden tests covering what
  the issue asks (N = 1, 2, 3, 4, groups, both layouts, float64 at 1e-9; sequence parallelism on
  t = 1, 2, 3, 4; Ulysses on N = 1 … 4), the prediction's self-check (its form only).
- The solution notebook executes top to bottom in a real kernel, as the grader runs it (its round
  trip: NBGRADER_EXECUTION set) and as a student runs it (the full benchmark), each within the
  budget (BUDGET_S), every graded cell passing, with its pictures and the benchmark table;
  section 5's activations equal the formulas to the byte.
- Wrong answers (a merge that averages, the grader's stand-in block, a ring that waits before it
  computes, a ring that makes N steps, a prediction off the cost model, a sequence-parallel block
  that keeps the gathered input or reduce-scatters with an all-reduce, Ulysses without its
  all-to-all in backward) fail the right graded cell with a message that says why; all in one
  kernel, to keep the suite's time down.
- The ring is graded with the grader's blocks when exercise 1 fails.
- The given block backward (torch's fused CPU kernel) equals torch's autograd, summed over the blocks.

The benchmark (`disttrain-lab bench sequence`) is tested in test_bench_sequence.py; the blank notebook
failing every graded cell, and the autograde round trip, in test_grading.py.  Lab 11 (expert
parallelism, the five-dimensional grid) was this lab's second half: test_lab11.py.
"""

from __future__ import annotations

import copy
import inspect
import re

import nbformat
import pytest

from disttrain_lab import bench
from disttrain_lab.labtests import common, lab10
from tests.notebooks import (
    add_wrong_answers,
    assert_prediction_verdicts,
    assert_wrong_answers_caught,
    base_cells,
    cell_by_id,
    errors,
    execute,
    exercise_ids,
    graded_points,
    load,
    output_of,
    pictures,
    prediction_problems,
    run_solution,
    solution_notebook,
    text,
)

LAB = solution_notebook("10_context_parallel")
BUDGET_S = 180  # the whole solution notebook on 2 cores (measured as a student runs it: 40 s from a fresh kernel, load 0.2-2.4)
EXERCISES = ["online_softmax", "ring_attention", "predict_ring_bytes", "sequence_parallel", "ulysses"]
GIVEN = ["given_ring_backward", "given_sp_pieces"]
# the graded prediction: (the cost model, written here; wrong formulas the graded cell must fail)
PREDICTIONS = {
    "predict_ring_bytes": (
        lambda n, s, w: (n - 1) * 2 * (s // n) * w * 4,
        [lambda n, s, w: 2 * s * w * 4, lambda n, s, w: (n - 1) * (s // n) * w * 4],
    ),
}


# ----------------------------------------------------------------------------------------
# The notebook's structure (fast)


def test_exercises_and_hidden_tests_cover_the_issue():
    nb = load(LAB)
    assert exercise_ids(nb) == [f"ex_{e}" for e in EXERCISES]
    assert graded_points(nb) == {
        "test_online_softmax": 2,
        "test_ring_attention": 4,
        "test_predict_ring_bytes": 1,
        "test_sequence_parallel": 3,
        "test_ulysses": 2,
    }
    hidden = "".join(
        part.split("### END HIDDEN TESTS")[0]
        for e in EXERCISES
        for part in cell_by_id(nb, f"test_{e}").source.split("### BEGIN HIDDEN TESTS")[1:]
    )
    for needle in (
        'lab_tests.check_ring(_ring, 4, 1, 24, 3, "zigzag"',  # N = 4, 3, 1, naive and zig-zag, groups of 2
        'lab_tests.check_ring(_ring, 3, 2, 18, 4, "zigzag"',
        'lab_tests.check_ring(_ring, 3, 3, 9, 2, "naive"',
        'lab_tests.check_ring(_ring, 1, 2, 6, 4, "zigzag"',
        "groups_of=2)",
        "lab_tests.check_ring_traffic(_ring, 3,",
        'lab_tests.check_positions_error(10, 2, 0, "zigzag")',
        'lab_tests.check_positions(24, 3, 1, "zigzag")',
        "def _ring_with_graders_blocks(",
        "dl.predictions.assert_prediction(",
        "lab_tests.check_sp(4, 16, 4, 8, 1, 1)",  # t = 4, 3 (6 heads), 1; a head count that does not split
        "lab_tests.check_sp(3, 12, 6, 9, 2, 2)",
        "lab_tests.check_sp(1, 8, 2, 4, 2, 3)",
        "lab_tests.check_sp_error(3, 4)",
        "lab_tests.check_ulysses(4, 4, 16, 3,",  # N = 4, 3, 1, 2 ranks; heads the group does not divide
        "lab_tests.check_ulysses(3, 6, 12, 2,",
        "lab_tests.check_ulysses(1, 2, 6, 4,",
        "lab_tests.check_ulysses_error(4, 6)",
    ):
        assert needle in hidden, needle
    ring = inspect.getsource(lab10.check_ring) + inspect.getsource(lab10._ring_in_rank)
    assert ring.count("rtol=1e-9") == ring.count("atol=1e-9") == 2 and "dtype=torch.float64" in ring  # output, grads
    helpers = inspect.getsource(common.expect_divisible_error)
    assert 'rank_raised(e, "ValueError", "divisible", loose=True)' in helpers
    # the graded cells reach the notebook only through dl.exercise.run (or dl.predictions.fetch): the module's
    # checks they call run the student's code with exercise.run (run_or_fail and expect_divisible_error run it)
    runs = ("exercise.run(", "common.run_or_fail(", "common.expect_divisible_error(")
    for e in EXERCISES:
        source = cell_by_id(nb, f"test_{e}").source
        called = set(re.findall(r"lab_tests\.(check_\w+)\(", source))
        assert called or "dl.predictions.fetch(" in source, e
        for name in called:
            assert any(r in inspect.getsource(getattr(lab10, name)) for r in runs), name


def test_visible_self_checks_exercise_every_hidden_requirement():
    nb = load(LAB)
    visible = "\n".join(c.source.split("### BEGIN HIDDEN TESTS")[0] for c in nb.cells if c.cell_type == "code")
    for needle in (
        'dl.region("block")',  # the overlap rule, one region per ring step
        "dist.new_subgroups(2)",  # groups
        "sequence_positions(_bad[0], _bad[1], 0, _bad[2])",  # not divisible
        'dl.predictions.check("ring bytes"',
        "with dl.memory.SavedActivations(layer) as saved:",  # sequence parallelism: 1/t of the activations
        '"all_reduce" in op',  # no all-reduce
        'op.startswith("reduce_scatter")',  # ... nor gloo's own reduce-scatter (an all-reduce on the wire)
        '[2]["ln1.weight"]',  # a LayerNorm's gradient summed over the ranks
        "dl.launch(_self_check_ulysses, _n, 4, 16, device=DEVICE, trace=True)",  # Ulysses on 2 and 4 ranks, its bytes
        "dl.launch(_three_heads, 2, device=DEVICE)",
    ):
        assert needle in visible, needle
    text_cells = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for rule in (
        "**not divisible**",
        "**before**",
        "`N − 1`",
        "three significant figures",
        "**all-gathers `x` again**",
        "(no all-reduce)",
        "exactly `1/t`",
        "**no other communication**",
        "each measurement equals its formula plus those two terms,\nto the byte",
    ):
        assert rule in text_cells, rule


def test_predictions_self_checks_hold_no_answer_and_use_the_graded_cases():
    nb = load(LAB)
    assert prediction_problems(nb) == []
    ring = [(4, 8192, 1024), (8, 65536, 512)]
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    # the self-check uses the graded cases
    assert source.count(f"cases={ring!r}") == 1 and source.count(f"_cases = {ring!r}") == 1, ring
    for value in (50331648, 234881024):  # not within 1e-6 of a rounding boundary
        mantissa = value / 10 ** len(str(value)[1:])
        assert abs(round(mantissa * 100) - mantissa * 100 - 0.5) % 1 > 1e-4


@pytest.mark.parametrize("grade_id", list(PREDICTIONS))
def test_graded_prediction_passes_the_right_formula_and_fails_wrong_ones(grade_id):
    assert_prediction_verdicts(load(LAB), grade_id, *PREDICTIONS[grade_id])


# ----------------------------------------------------------------------------------------
# Executing it (slow)


def _activations_match_the_formulas(printed: str) -> None:
    """Section 5's measurement (fp32, s = 64, b = 2, h = 32, a = 4 on t = 2 and 4 ranks): each layout's bytes per
    rank equal its formula, sbh(16 + 48/t) or 64·sbh/t, plus the fused kernel's log-sum-exp 4·asb/t and the
    LayerNorms' statistics 16·bs (split by t under sequence parallelism), to the byte, as the text states."""
    s, b, h, a = 64, 2, 32, 4
    measured = {
        (kind, int(t)): int(x) for kind, t, x in re.findall(r"(TP|SP) t=(\d): formula \d+ B, measured (\d+) B", printed)
    }
    assert set(measured) == {("TP", 2), ("SP", 2), ("TP", 4), ("SP", 4)}, printed
    for t in (2, 4):
        tp = s * b * h * (16 + 48 / t) + 4 * a * s * b / t + 16 * b * s
        sp = 64 * s * b * h / t + 4 * a * s * b / t + 16 * b * s / t
        assert measured["TP", t] == tp and measured["SP", t] == sp, (t, tp, sp, printed)
        assert measured["SP", t] < measured["TP", t], printed  # sequence parallelism splits the 10 as well


@pytest.mark.slow
@pytest.mark.parametrize("autograding", [True, False], ids=["grader", "student"])
def test_solution_notebook_executes_within_budget(autograding):
    nb = run_solution(LAB, BUDGET_S, autograding)
    table = output_of(nb, "bench.format_sequence_table(rows)")
    for line in (
        "ring_attention",
        bench.ALL_GATHER_KV,
        bench.TORCH_CP,
        "ulysses_attention, S=256" if autograding else "ulysses_attention, S=2048",
        "link 10 Gbit Ethernet",
        "_scaled_dot_product_flash_attention_for_cpu",  # why torch's context parallelism does not run here
    ):
        assert line in table, table
    balance = output_of(nb, "_balance_run")
    assert "naive: query-key pairs 0.062·S², 0.125·S², 0.188·S², 0.250·S²" in balance, balance
    assert "zigzag: query-key pairs 0.156·S², 0.156·S², 0.156·S², 0.156·S²" in balance, balance
    _activations_match_the_formulas(output_of(nb, "def _saved_per_rank("))
    assert pictures(nb) >= 4, "the prediction's bars, the load balance's timelines, the activations, Ulysses' bytes"


# Wrong answers the graded tests must catch: (graded cell, wrong definition, words the failure must contain)
WRONG = [
    (
        "online_softmax",
        """
def merge_attention(out_a, lse_a, out_b, lse_b):      # averages the blocks instead of weighting them
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)
""",
        "the merged output",
    ),
    (
        "online_softmax",
        """
def block_attention(q, k, v, q_pos, k_pos):          # the grader's stand-in, captured: -1e30 where no key is seen
    out = q.new_zeros(q.shape[:-1] + v.shape[-1:])
    lse = q.new_full(q.shape[:-1], -1e30)
    mask = q_pos[:, None] >= k_pos[None, :]
    rows = mask.any(-1)
    if rows.any():
        scores = (q[..., rows, :] @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask[rows], float("-inf"))
        lse[..., rows] = torch.logsumexp(scores, -1)
        out[..., rows, :] = torch.softmax(scores, -1) @ v
    return out, lse
""",
        "lse must be -inf exactly",
    ),
    (
        "ring_attention",
        """
def ring_attention_forward(q, k, v, layout="zigzag", group=None):   # waits for the transfer before computing
    rank, n = dist.get_rank(), dist.get_world_size()
    seq_len = q.shape[-2] * n
    q_pos = sequence_positions(seq_len, n, rank, layout)
    held, out, lse = torch.stack([k, v]), None, None
    for step in range(n):
        if step < n - 1:
            incoming = torch.empty_like(held)
            for request in [dist.isend(held, (rank + 1) % n), dist.irecv(incoming, (rank - 1) % n)]:
                request.wait()
        with dl.region("block"):
            block = block_attention(q, held[0], held[1], q_pos, sequence_positions(seq_len, n, (rank - step) % n, layout))
            out, lse = block if out is None else merge_attention(out, lse, *block)
        if step < n - 1:
            held = incoming
    return out, lse
""",
        "must be posted before this block's computation",
    ),
    (
        "ring_attention",
        """
def ring_attention_forward(q, k, v, layout="zigzag", group=None):   # N transfers: the last block goes round again
    rank, n = dist.get_rank(), dist.get_world_size()
    seq_len = q.shape[-2] * n
    q_pos = sequence_positions(seq_len, n, rank, layout)
    held, out, lse = torch.stack([k, v]), None, None
    for step in range(n):
        incoming = torch.empty_like(held)
        pending = [dist.isend(held, (rank + 1) % n), dist.irecv(incoming, (rank - 1) % n)]
        with dl.region("block"):
            block = block_attention(q, held[0], held[1], q_pos, sequence_positions(seq_len, n, (rank - step) % n, layout))
            out, lse = block if out is None else merge_attention(out, lse, *block)
        for request in pending:
            request.wait()
        held = incoming
    return out, lse
""",
        "N - 1 = 1 ring steps",
    ),
    (
        "sequence_parallel",
        """
class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sequence(grad.contiguous(), ctx.group), None

def gather_linear(x, linears, group=None):             # the linears keep the gathered input
    full = _Gather.apply(x, group)
    return tuple(linear(full) for linear in linears)
""",
        "not save the gathered input",
    ),
    (
        "sequence_parallel",
        """
class _AllReduceSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):                          # an all-reduce, then this rank's tokens
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad.contiguous(), ctx.group), None

def reduce_scatter_sequence(x, group=None):
    return _AllReduceSlice.apply(x, group)
""",
        "(no all-reduce)",
    ),
    (
        "ulysses",
        """
class _AllToAll(torch.autograd.Function):              # backward passes the gradient through: no all-to-all back
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None
""",
        "'s gradient of q",
    ),
    (
        "predict_ring_bytes",
        "def predicted_ring_attention_bytes(n, seq_len, width):\n    return 2 * seq_len * width * 4\n",
        "does not match the cost model",
    ),
]


def _base_cells(lab):
    return base_cells(lab, GIVEN, EXERCISES)


@pytest.mark.slow
def test_graded_cells_catch_wrong_answers():
    """One kernel: the setup, solutions, given code and test helpers, then for each wrong answer the
    solutions again, the wrong definition and its graded cell."""
    lab = load(LAB)
    cells, solutions = _base_cells(lab)
    graded_at = add_wrong_answers(lab, cells, solutions, [(graded, wrong) for graded, wrong, _ in WRONG])
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, timeout=240, cwd=LAB.parent)
    assert_wrong_answers_caught(nb, graded_at, [message for _, _, message in WRONG])


@pytest.mark.slow
def test_later_exercises_are_graded_on_the_graders_pieces():
    # a block_attention that returns no lse fails exercise 1; the ring is graded with the grader's blocks.
    lab = load(LAB)
    cells, _ = _base_cells(lab)
    broken_blocks = "def block_attention(q, k, v, q_pos, k_pos):\n    return q * 0, q[..., 0] * 0\n"
    cells.append(nbformat.v4.new_code_cell(broken_blocks))
    graded = ["online_softmax", "ring_attention"]
    start = len(cells)
    cells += [copy.deepcopy(cell_by_id(lab, f"test_{g}")) for g in graded]
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, timeout=240, cwd=LAB.parent)
    results = dict(zip(graded, nb.cells[start:]))
    assert errors(results["online_softmax"])
    assert not errors(results["ring_attention"]), errors(results["ring_attention"])
    assert "\N{WHITE HEAVY CHECK MARK}" in text(results["ring_attention"]), text(results["ring_attention"])


@pytest.mark.parametrize("layout", ["zigzag", "naive"])
def test_given_block_backward_is_torchs_on_every_block(layout):
    """The given ``block_attention_backward`` calls torch's fused CPU FlashAttention backward
    (``FUSED_BACKWARD``).  On a 3-rank split, summed over the blocks, its dq of each rank's queries and its
    dk, dv of each rank's keys equal torch's autograd of the whole causal attention (SDPA); and on every
    block its unfused lines give the same numbers."""
    import torch
    import torch.nn.functional as F

    lab = bench.functions_from_notebook(LAB, ["block_attention_backward", "sequence_positions"], given=True)
    backward, positions = lab["block_attention_backward"], lab["sequence_positions"]
    names = backward.__globals__
    heads, seq_len, dim, n = 2, 24, 4, 3
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(heads, seq_len, dim, generator=g, dtype=torch.float64) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(dout)
    scores = (q @ k.transpose(-1, -2)).detach() * dim**-0.5
    lse = torch.logsumexp(scores.masked_fill(~torch.ones(seq_len, seq_len).bool().tril(), float("-inf")), -1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(n):
        for source in range(n):
            qp, kp = positions(seq_len, n, rank, layout), positions(seq_len, n, source, layout)
            args = (q[:, qp], k[:, kp], v[:, kp], qp, kp, out[:, qp], lse[:, qp], dout[:, qp])
            args = tuple(a.detach() for a in args)
            fused = backward(*args)
            names["FUSED_BACKWARD"] = False
            try:
                lines = backward(*args)
            finally:
                names["FUSED_BACKWARD"] = True
            for name, a, b in zip(("dq", "dk", "dv"), fused, lines):
                assert torch.allclose(a, b, atol=1e-12), (layout, rank, source, name)
            dq[:, qp] += fused[0]
            dk[:, kp] += fused[1]
            dv[:, kp] += fused[2]
    for name, got, want in (("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv, v.grad)):
        assert torch.allclose(got, want, atol=1e-12), (layout, name, (got - want).abs().max())


@pytest.mark.slow
def test_ring_overlap_is_graded_from_the_grader_gate_not_the_ranks_trace(monkeypatch):
    """Under the grader's evidence (packet capture, ``ss``, its gate: tests/helpers.py), the ring's overlap
    is the gate's (``lab10.ring_gate``), the trace's overlap rule unread: the solution passes on 2 ranks
    and in two rings of 2 on 4, whichever rank the grader holds; the ring that waits for each transfer before
    it computes (the wrong answer above, whose trace the self-check fails) fails, told which rank did not
    reach its first block while its neighbour was held."""
    import __main__
    from tests.helpers import notebook_names, observed_from_outside

    names = ["ring_attention_forward", "block_attention", "merge_attention", "sequence_positions", "RingAttention"]
    space = bench.functions_from_notebook(LAB, names, given=True)["ring_attention_forward"].__globals__
    notebook_names(monkeypatch, space)
    monkeypatch.setitem(
        lab10.common._REFERENCES, "positions", space["sequence_positions"]
    )  # (the helper cell's: the layout's positions)
    [waiting] = [wrong for graded, wrong, said in WRONG if "waits for the transfer before computing" in wrong]
    with observed_from_outside():
        lab10.check_ring(lab10._ring_in_rank, 2, 2, 16, 4, "zigzag")
        lab10.check_ring(lab10._ring_in_rank, 4, 2, 16, 4, "zigzag", seed=5, groups_of=2)
        exec(waiting, space)  # (the notebook's namespace: RingAttention calls the wrong ring)
        monkeypatch.setattr(__main__, "ring_attention_forward", space["ring_attention_forward"])
        with pytest.raises(AssertionError, match=r"did not reach their first block's computation"):
            lab10.check_ring(lab10._ring_in_rank, 2, 2, 16, 4, "zigzag")


# A ring that never overlaps: each step computes the block it holds, then passes it on (isend, irecv, both waited
# for), the solution's pieces otherwise, so its values are right.  Every rank calls block_attention before it posts
# anything, so the gate's first hold (the drawn rank held before its ring, every other rank at its first block) holds
# them all at once, and the trace's overlap rule is not read under grading: it passed the check as it was.
_COMPUTE_THEN_PASS_RING = """
def ring_attention_forward(q, k, v, layout="zigzag", group=None):   # computes each block, then passes it on
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    nxt, prev = ranks[(rank + 1) % n], ranks[(rank - 1) % n]
    seq_len = q.shape[-2] * n
    q_pos = sequence_positions(seq_len, n, rank, layout)
    held, out, lse = torch.stack([k, v]), None, None
    for step in range(n):
        with dl.region("block"):
            block = block_attention(q, held[0], held[1], q_pos, sequence_positions(seq_len, n, (rank - step) % n, layout))
            out, lse = block if out is None else merge_attention(out, lse, *block)
        if step < n - 1:
            incoming = torch.empty_like(held)
            for request in [dist.isend(held, nxt, group=group), dist.irecv(incoming, prev, group=group)]:
                request.wait()
            held = incoming
    return out, lse
"""

# the graded cell's ring cases the grader holds a gate in (2 ranks a ring or more): (args, keywords)
GATED_RING_CASES = [
    ((2, 2, 16, 4, "zigzag"), {}),
    ((4, 2, 16, 4, "naive"), {}),
    ((4, 1, 24, 3, "zigzag"), {"seed": 1}),
    ((3, 2, 18, 4, "zigzag"), {"seed": 2}),
    ((3, 3, 9, 2, "naive"), {"seed": 3}),
    ((4, 2, 16, 4, "zigzag"), {"seed": 5, "groups_of": 2}),
]


@pytest.mark.slow  # (ranks and a packet capture, three runs of which wait out the gate's HELD_WAIT: about 40 s)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_ring_that_computes_before_it_transfers_fails_on_the_wire(monkeypatch):
    """Under the grader's evidence the solution's ring passes every gated case of the graded cell, its drawn
    rank's first key/value block found on the wire before the grader let that rank go on from its first
    block_attention (``lab10.attention._assert_first_block_crossed``: on one connection, at least 10 ms
    before); a ring that computes each block before it passes it on (``_COMPUTE_THEN_PASS_RING``: values right,
    every rank held at once at the gate's first hold; its own trace fails it in the student's kernel, where the
    ranks' account is all there is) passes every other check under grading, as it passed the whole check before,
    and fails there, on 2 ranks and in two rings of 2 on 4, saying what crossed."""
    import __main__
    from tests.helpers import notebook_names, observed_from_outside

    names = ["ring_attention_forward", "block_attention", "merge_attention", "sequence_positions", "RingAttention"]
    space = bench.functions_from_notebook(LAB, names, given=True)["ring_attention_forward"].__globals__
    notebook_names(monkeypatch, space)
    monkeypatch.setitem(lab10.common._REFERENCES, "positions", space["sequence_positions"])
    with observed_from_outside():
        for args, kwargs in GATED_RING_CASES:
            after, seconds = lab10.check_ring(lab10._ring_in_rank, *args, **kwargs)
            assert after >= 0 and (seconds is None or seconds > 0.01), (args, kwargs, after, seconds)
    exec(_COMPUTE_THEN_PASS_RING, space)  # (the notebook's namespace: RingAttention calls the ring that never overlaps)
    monkeypatch.setattr(__main__, "ring_attention_forward", space["ring_attention_forward"])
    with pytest.raises(AssertionError, match=r"must be posted before this block's computation"):
        lab10.check_ring(lab10._ring_in_rank, 2, 2, 16, 4, "zigzag")  # (the student's own kernel: the trace's rule)
    with observed_from_outside():
        with monkeypatch.context() as before:  # the check as it was: every check but the wire's overlap
            before.setattr(lab10.attention, "_assert_first_block_crossed", lambda *args: None)
            lab10.check_ring(lab10._ring_in_rank, 2, 2, 16, 4, "zigzag")
        for args, kwargs in (GATED_RING_CASES[0], GATED_RING_CASES[-1]):
            with pytest.raises(AssertionError) as computed_first:
                lab10.check_ring(lab10._ring_in_rank, *args, **kwargs)
            said = str(computed_first.value)
            assert "first key/value block (its own k and v: 32 rows of 32 bytes" in said, said
            assert "surely crossed" in said and "holding 0 of those 32 rows; all 32 should be there" in said, said
            assert "posts the next block's isend and irecv before it computes the block it holds" in said, said


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_ulysses_calls_and_bytes_are_read_from_the_wire(monkeypatch):
    """#42: Ulysses' "only all_to_all_single" and its bytes come from the grader's capture: each message's slot
    names its call's kind, its payload the bytes.  The solution passes with and without a capture; the
    solution with every rank's q all-gathered beside it, off the trace, passes on the trace alone and fails on
    the wire; so does the solution with one more all-to-all (the right kind, more bytes than the cost model)."""
    import torch
    import torch.distributed as dist

    from disttrain_lab import trace
    from tests.helpers import notebook_names, observed_from_outside

    space = bench.functions_from_notebook(LAB, ["ulysses_attention", "sequence_positions"], given=True)
    notebook_names(monkeypatch, space["ulysses_attention"].__globals__)
    monkeypatch.setitem(lab10.common._REFERENCES, "positions", space["sequence_positions"])
    ulysses = space["ulysses_attention"]

    def gathering(q, k, v, *args, **kwargs):  # the solution, every rank's q gathered aside
        with trace.unrecorded():
            dist.all_gather([torch.empty_like(q) for _ in range(dist.get_world_size())], q.detach().contiguous())
        return ulysses(q, k, v, *args, **kwargs)

    def check():
        lab10.check_ulysses(2, 4, 16, 4)
        lab10.check_ulysses(4, 4, 16, 3, seed=1)

    def padded(q, k, v, *args, **kwargs):  # the solution, and one more all-to-all of q, off the trace
        with trace.unrecorded():
            flat = q.detach().reshape(-1).contiguous()  # (its elements split evenly between the ranks)
            dist.all_to_all_single(torch.empty_like(flat), flat)
        return ulysses(q, k, v, *args, **kwargs)

    check()
    with observed_from_outside():
        check()
        monkeypatch.setattr("__main__.ulysses_attention", gathering)
        with pytest.raises(AssertionError) as gathered:
            lab10.check_ulysses(2, 4, 16, 4)
        monkeypatch.setattr("__main__.ulysses_attention", padded)
        with pytest.raises(AssertionError) as more:
            lab10.check_ulysses(2, 4, 16, 4)
    lab10.check_ulysses(2, 4, 16, 4)  # (the student's own kernel: the trace's account, fooled)
    said = str(more.value)
    assert "rank 0's all-to-alls put" in said and "the cost model: q, k, v and the output" in said, said
    monkeypatch.setattr("__main__.ulysses_attention", gathering)
    lab10.check_ulysses(2, 4, 16, 4)
    said = str(gathered.value)
    assert "may only call all_to_all_single; the grader's capture of the wire shows messages of all_gather" in said, (
        said
    )


def _relayed_ulysses(q, k, v):
    """A forged ulysses_attention: every rank's q, k, v (and backward's output gradient) passed through the launcher's
    store (a few KiB: under what the grader allows a rank to exchange with processes that are not ranks), causal
    attention computed whole in each rank, and four all-to-alls of zeros of a block each way, as the cost model's."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from tests.helpers import through_the_store

    rank = dist.get_rank()

    def everyone(t):
        return through_the_store(t.detach().clone(), "ulysses")

    def zeros_on_the_wire(like):
        for _ in range(4):
            flat = torch.zeros(like.numel(), dtype=like.dtype)
            dist.all_to_all_single(torch.empty_like(flat), flat)

    class Relayed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            whole = [torch.cat(everyone(t), dim=1) for t in (q, k, v)]  # (contiguous blocks, in rank order)
            zeros_on_the_wire(q)
            ctx.save_for_backward(*whole)
            ctx.mine = slice(rank * q.shape[1], (rank + 1) * q.shape[1])
            return F.scaled_dot_product_attention(*whole, is_causal=True)[:, ctx.mine]

        @staticmethod
        def backward(ctx, dout):
            whole = [t.detach().requires_grad_() for t in ctx.saved_tensors]
            with torch.enable_grad():  # (a Function's backward runs without grad mode)
                out = F.scaled_dot_product_attention(*whole, is_causal=True)
                out.backward(torch.cat(everyone(dout), dim=1))
            zeros_on_the_wire(dout)
            return tuple(t.grad[:, ctx.mine] for t in whole)

    return Relayed.apply(q, k, v)


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_ulysses_with_qkv_through_the_store_and_zeros_on_the_wire_fails_on_the_wires_content(monkeypatch):
    """The right values, all-to-alls only, the cost model's bytes, but q, k and v passed through the store and the
    all-to-alls carrying zeros: it passes in the student's own kernel and fails where the grader looks for the rows
    of q, k, v (and of the output) in what each rank sent."""
    from tests.helpers import notebook_names, observed_from_outside

    space = bench.functions_from_notebook(LAB, ["ulysses_attention", "sequence_positions"], given=True)
    notebook_names(monkeypatch, space["ulysses_attention"].__globals__)
    monkeypatch.setitem(lab10.common._REFERENCES, "positions", space["sequence_positions"])
    monkeypatch.setattr("__main__.ulysses_attention", _relayed_ulysses)
    lab10.check_ulysses(2, 4, 16, 4)  # (the student's own kernel: values, the trace's calls and bytes)
    with observed_from_outside(), pytest.raises(AssertionError) as relayed:
        lab10.check_ulysses(2, 4, 16, 4)
    said = str(relayed.value)
    assert "should carry" in said and "must travel in the all-to-alls themselves" in said, said


def _backward_relayed_all_to_all():
    """A forged ``_AllToAll`` for the solution's ulysses_attention: its forward the solution's, its backward an
    all-to-all of zeros of the gradient's size on the wire, the right blocks taken through the launcher's store."""
    import torch
    import torch.distributed as dist

    from tests.helpers import through_the_store

    class _AllToAll(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            x = x.contiguous()
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x, group=group)
            return out

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            n, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
            everyone = through_the_store(grad.detach().clone(), "a2a backward")
            dist.all_to_all_single(torch.empty_like(grad), torch.zeros_like(grad), group=ctx.group)
            return torch.cat([g.chunk(n)[rank] for g in everyone]), None

    return _AllToAll


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_ulysses_with_its_backward_through_the_store_fails_on_the_wires_content(monkeypatch):
    """The solution's Ulysses with its forward as it is and a backward all-to-all of zeros, the gradients' blocks
    passed through the store: the right values and bytes, the forward's rows on the wire; it passes in the student's
    own kernel and fails where the grader looks for the output's gradient and q, k and v's in what each rank sent."""
    from tests.helpers import notebook_names, observed_from_outside

    space = bench.functions_from_notebook(LAB, ["ulysses_attention", "sequence_positions"], given=True)
    notebook_names(monkeypatch, space["ulysses_attention"].__globals__)
    monkeypatch.setitem(lab10.common._REFERENCES, "positions", space["sequence_positions"])
    with observed_from_outside():
        lab10.check_ulysses(2, 4, 16, 4)
        lab10.check_ulysses(4, 8, 32, 2)
    monkeypatch.setitem(space["ulysses_attention"].__globals__, "_AllToAll", _backward_relayed_all_to_all())
    lab10.check_ulysses(2, 4, 16, 4)  # (the student's own kernel: values, the trace's calls and bytes)
    with observed_from_outside(), pytest.raises(AssertionError) as relayed:
        lab10.check_ulysses(2, 4, 16, 4)
    said = str(relayed.value)
    assert "in backward rank 0 should carry to the others the rows of the output's gradient" in said, said


# A forged ring_attention_forward: N - 1 isend/irecv of zeros of a key/value block's size round the ring, each posted
# before its step's dl.region("block") and waited for after it (the trace's rules), block_attention called first (the
# grader's gate holds a rank there), then every rank's k and v taken through the launcher's store and attended to whole
_RELAYED_RING = """
def ring_attention_forward(q, k, v, layout="zigzag", group=None):
    from tests.helpers import through_the_store

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    nxt, prev = ranks[(rank + 1) % n], ranks[(rank - 1) % n]
    seq_len = q.shape[-2] * n
    q_pos = sequence_positions(seq_len, n, rank, layout)
    zeros = torch.zeros((2, *k.shape), dtype=k.dtype)
    for step in range(n):
        if step < n - 1:
            pending = [dist.isend(zeros, nxt, group=group), dist.irecv(torch.empty_like(zeros), prev, group=group)]
        with dl.region("block"):
            if step == 0:
                block_attention(q, k, v, q_pos, q_pos)
        if step < n - 1:
            for request in pending:
                request.wait()
    blocks = through_the_store([k.detach().clone(), v.detach().clone()], "ring", among=ranks)
    keys, values = (torch.cat([b[i] for b in blocks], dim=1) for i in (0, 1))
    k_pos = torch.cat([sequence_positions(seq_len, n, r, layout) for r in range(n)])
    return block_attention(q, keys, values, q_pos, k_pos)
"""


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_ring_with_kv_through_the_store_and_zeros_on_the_wire_fails_on_the_wires_content(monkeypatch):
    """#42: under the grader's evidence the solution's ring passes (2 ranks, and two rings of 2 on 4); a ring that
    sends zeros of a key/value block's size round the ring and takes k and v through the store (``_RELAYED_RING``:
    values, the trace's calls, bytes and overlap right, the gate's hold reached) passes in the student's own kernel
    and fails where the grader looks for the rows of the blocks the ring passes in what each rank sent the next
    (``lab10.attention._ring_blocks_on_the_wire``): found once, in the given backward, not twice."""
    import __main__
    from tests.helpers import notebook_names, observed_from_outside

    names = ["ring_attention_forward", "block_attention", "merge_attention", "sequence_positions", "RingAttention"]
    space = bench.functions_from_notebook(LAB, names, given=True)["ring_attention_forward"].__globals__
    notebook_names(monkeypatch, space)
    monkeypatch.setitem(lab10.common._REFERENCES, "positions", space["sequence_positions"])
    with observed_from_outside():
        lab10.check_ring(lab10._ring_in_rank, 2, 2, 16, 4, "zigzag")
        lab10.check_ring(lab10._ring_in_rank, 4, 2, 16, 4, "zigzag", seed=5, groups_of=2)
    exec(_RELAYED_RING, space)  # (the notebook's namespace: RingAttention calls the forged ring)
    monkeypatch.setattr(__main__, "ring_attention_forward", space["ring_attention_forward"])
    lab10.check_ring(lab10._ring_in_rank, 3, 2, 18, 4, "zigzag", seed=2)  # (the student's own kernel: the trace's)
    with observed_from_outside(), pytest.raises(AssertionError) as relayed:
        lab10.check_ring(lab10._ring_in_rank, 3, 2, 18, 4, "zigzag", seed=2)
    said = str(relayed.value)
    assert "should pass the next rank of its ring" in said and "found 0 of them twice, 48 once" in said, said
    assert "must travel in the forward's isends themselves" in said, said


def _solution_sp_block(monkeypatch):
    """The solution's SequenceParallelBlock, its namespace (the given transformer_block among it) made the
    notebook's for the test's runs."""
    from tests.helpers import notebook_names

    block = bench.functions_from_notebook(LAB, ["SequenceParallelBlock"], given=True)["SequenceParallelBlock"]
    given = next(c.source for c in load(LAB).cells if "def transformer_block" in c.source)  # (it runs Lab 6's file)
    exec(
        given.replace('"data/reference_pieces.py"', repr(str(LAB.parent / "data" / "reference_pieces.py"))),
        block.__init__.__globals__,
    )
    notebook_names(monkeypatch, block.__init__.__globals__)
    return block


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
@pytest.mark.parametrize("relayed", ["all-gathers", "reduce-scatters", "backward-reduce-scatters"])
def test_a_sequence_parallel_block_moving_its_data_through_the_store_fails_on_the_wires_content(monkeypatch, relayed):
    """The solution's block whose all-gathers (forward and backward) take every rank's slice from the launcher's store
    and gather zeros of the same size, or whose reduce-scatters (forward and backward, or backward's alone) add up the
    partial sums from the store and send zeros in their all-to-alls: the values, the calls and their bytes are right,
    and it passes in the student's own kernel; the grader finds no LayerNorm output of a rank's tokens (no partial
    sum, forward or backward) in what it sent, and fails it."""
    import torch
    import torch.distributed as dist

    from tests.helpers import observed_from_outside, through_the_store

    block = _solution_sp_block(monkeypatch)

    def gathered(x, group):  # (B, T/t, d) -> (B, T, d) through the store; zeros on the wire
        n = dist.get_world_size()
        everyone = through_the_store(x.detach().clone(), "sp")
        dist.all_gather_single(x.new_empty((n * x.shape[0],) + x.shape[1:]), torch.zeros_like(x), group=group)
        return torch.cat(everyone, dim=1)

    def scattered(x, group):  # (B, T, d) partial sums -> (B, T/t, d) of their sum through the store; zeros on the wire
        n, rank = dist.get_world_size(), dist.get_rank()
        everyone = through_the_store(x.detach().clone(), "sp")
        chunks = torch.zeros_like(torch.cat(x.chunk(n, dim=1)))
        dist.all_to_all_single(torch.empty_like(chunks), chunks, group=group)
        return sum(everyone).chunk(n, dim=1)[rank].contiguous()

    space = block.__init__.__globals__
    if relayed == "all-gathers":
        monkeypatch.setitem(space, "_gather_sequence", gathered)
    elif relayed == "reduce-scatters":
        monkeypatch.setitem(space, "_reduce_scatter_sequence", scattered)
    else:  # (gather_linear's backward's alone: the forward's reduce-scatter stays the solution's)
        honest = space["_reduce_scatter_sequence"]

        def forward(ctx, x, group):
            ctx.group = group
            return honest(x, group)

        monkeypatch.setattr(space["_ReduceScatterSequence"], "forward", staticmethod(forward))
        monkeypatch.setitem(space, "_reduce_scatter_sequence", scattered)
    lab10.check_sp(2, 8, 2, 8, 2, 0)  # (the student's own kernel: values, the trace's calls and bytes)
    with observed_from_outside(), pytest.raises(AssertionError) as failed:
        lab10.check_sp(2, 8, 2, 8, 2, 0)
    said = str(failed.value)
    if relayed == "all-gathers":
        assert "all-gathers should carry ln1's output" in said and "must travel in the all-gathers themselves" in said
    elif relayed == "reduce-scatters":
        assert "reduce-scatter after attention's output projection should send" in said, said
        assert "must travel in the reduce-scatter itself" in said, said
    else:
        assert "backward reduce-scatter of ln1's output gradient through its heads should send" in said, said
        assert "must travel in the reduce-scatter itself" in said, said


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_sequence_parallel_calls_and_bytes_are_read_from_the_wire(monkeypatch):
    """#42: SequenceParallelBlock's calls (all-gathers and reduce-scatters, how many in each pass, of which
    sizes) come from the grader's capture: each call's slot, counted up in the world's group, places it before or
    after the driver's barrier, its payload gives its bytes.  The solution passes with and without a capture; the
    solution with one more all-gather of its input in forward, off the trace, passes on the trace alone and
    fails on the wire; so does one whose reduce-scatter is an all-reduce off the trace (an all-to-all of zeros on
    it), and one calling gloo's own reduce-scatter (an all-reduce on the wire), which the student's own kernel
    refuses too."""
    import torch
    import torch.distributed as dist

    from disttrain_lab import trace
    from tests.helpers import observed_from_outside

    block = _solution_sp_block(monkeypatch)

    class Gathering(block):  # the solution, and every rank's input all-gathered once more in forward
        def forward(self, x):
            with trace.unrecorded():
                dist.all_gather([torch.empty_like(x) for _ in range(dist.get_world_size())], x.detach().contiguous())
            return super().forward(x)

    def check():
        lab10.check_sp(2, 16, 4, 8, 2, 0)
        lab10.check_sp(3, 12, 6, 9, 2, 2)
        lab10.check_sp(1, 8, 2, 4, 2, 3)

    check()
    with observed_from_outside():
        check()
        monkeypatch.setattr("__main__.SequenceParallelBlock", Gathering)
        with pytest.raises(AssertionError) as more:
            lab10.check_sp(2, 16, 4, 8, 2, 0)
    lab10.check_sp(2, 16, 4, 8, 2, 0)  # (the student's own kernel: the trace's account, fooled)
    said = str(more.value)
    assert (
        "the forward pass makes 2 all-gathers and 2 reduce-scatters of 2048 B (tensor parallelism's two all-reduces, "
        "split); the grader's capture of the wire shows 3 all-gathers and 2 reduce-scatters (all-to-alls)"
    ) in said, said
    monkeypatch.setattr("__main__.SequenceParallelBlock", block)
    space = block.__init__.__globals__

    def all_reduced(x, group):  # the right values by an all-reduce off the trace; an all-to-all of zeros on it
        n = dist.get_world_size(group)
        chunks = torch.cat(x.chunk(n, dim=1))
        dist.all_to_all_single(torch.empty_like(chunks), torch.zeros_like(chunks), group=group)
        with trace.unrecorded():
            dist.all_reduce(chunks, group=group)
        return chunks.chunk(n)[dist.get_rank(group)].clone()

    def glooss(x, group):  # gloo's own reduce-scatter: on the trace a reduce-scatter, on the wire an all-reduce
        n = dist.get_world_size(group)
        out = x.new_empty((x.shape[0], x.shape[1] // n) + x.shape[2:])
        dist.reduce_scatter_single(out, torch.cat(x.chunk(n, dim=1)), group=group)
        return out

    for scatter in (glooss, all_reduced):
        monkeypatch.setitem(space, "_reduce_scatter_sequence", scatter)
        with observed_from_outside(), pytest.raises(AssertionError, match=r"shows messages of all_reduce \(gloo's own"):
            lab10.check_sp(2, 16, 4, 8, 2, 0)
    lab10.check_sp(2, 16, 4, 8, 2, 0)  # the all-reduce off the trace passes on the trace alone
    monkeypatch.setitem(space, "_reduce_scatter_sequence", glooss)
    with pytest.raises(AssertionError, match=r"on the CPU a reduce-scatter is one all-to-all"):
        lab10.check_sp(2, 16, 4, 8, 2, 0)  # gloo's own the student's kernel refuses too, as the grader will
