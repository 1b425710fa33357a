"""Lab 10 (context and expert parallelism): the solution notebook runs, its graded tests catch wrong
answers, later exercises are graded on their own, and the sequence benchmark works.

- The notebook's structure: the exercises and predictions in order, the hidden tests covering what
  the issue asks (N = 1, 2, 3, 4, groups, both layouts, float64 at 1e-9; k = 1 and 2, capacity
  factors that drop tokens, the bytes counted by the OS; sequence parallelism on t = 1, 2, 3, 4; Ulysses
  on N = 1 … 4; the five-dimensional memory with cp and ep up to 16, and the invalid grids), the
  predictions' self-checks (their form only).
- The solution notebook executes top to bottom in a real kernel, as the grader runs it (its round
  trip: NBGRADER_EXECUTION set) and as a student runs it (the full benchmark), each within the
  4-minute budget (BUDGET_S), every graded cell passing, with its pictures and the benchmark table;
  section 7's activations equal the formulas to the byte; the dropped tokens follow the capacity rule.
- Wrong answers (a merge that averages, a ring that waits before it computes, a ring that makes N
  steps, a router that serves capacity token by token, an expert-parallel layer that ships the
  dropped tokens too, predictions off the cost model (a capacity rounded down among them), a sequence-parallel block that keeps the gathered
  input or reduce-scatters with an all-reduce, Ulysses without its all-to-all in backward, a
  column-major grid, a five-dimensional memory that shards ZeRO over dp only or does not divide the
  activations by cp) fail the right graded cell with a message that says why; all in one kernel, to
  keep the suite's time down.
- The ring is graded with the grader's blocks when exercise 1 fails, the expert-parallel layer
  with the grader's router when exercise 4 fails (one kernel).
- bench.format_sequence_table (its long-sequence rows: ring against Ulysses on an emulated link), and
  `disttrain-lab bench sequence` with tiny options.

The blank notebook failing every graded cell, and the autograde round trip, are in test_grading.py.
"""

from __future__ import annotations

import copy
import inspect
import math
import re

import nbformat
import pytest

from disttrain_lab import bench
from disttrain_lab.labtests import lab10
from tests.helpers import run_python
from tests.notebooks import (
    REPO,
    add_wrong_answers,
    assert_prediction_verdicts,
    assert_wrong_answers_caught,
    cell_by_id,
    errors,
    execute,
    load,
    nbgrader_meta,
    output_of,
    pictures,
    prediction_problems,
    run_solution,
    solution_notebook,
    text,
)

LAB = solution_notebook("10_sequence_experts")
BUDGET_S = 240  # the issue's budget for the whole solution notebook on 2 cores (measured as a student runs it: 43 s, load 2.5-5.8)
EXERCISES = [
    "online_softmax",
    "ring_attention",
    "predict_ring_bytes",
    "router",
    "predict_dropped_tokens",
    "expert_parallel",
    "predict_moe_bytes",
    "sequence_parallel",
    "ulysses",
    "mesh_groups",
    "planner_5d",
]
GIVEN = ["given_ring_backward", "given_moe", "given_sp_pieces"]
# the graded predictions: (the cost model, written here; wrong formulas the graded cell must fail)
PREDICTIONS = {
    "predict_ring_bytes": (
        lambda n, s, w: (n - 1) * 2 * (s // n) * w * 4,
        [lambda n, s, w: 2 * s * w * 4, lambda n, s, w: (n - 1) * (s // n) * w * 4],
    ),
    "predict_moe_bytes": (
        lambda n, t, k, d: 2 * t * k * (n - 1) / n * d * 4,
        [lambda n, t, k, d: t * k * (n - 1) / n * d * 4, lambda n, t, k, d: 2 * t * k * d * 4],
    ),
    "predict_dropped_tokens": (  # C = ceil(cf * k * T / E); an expert wanted by w choices keeps min(w, C)
        lambda t, e, k, f, w: max(0, w - math.ceil(f * k * t / e)),
        [
            lambda t, e, k, f, w: max(0, w - math.floor(f * k * t / e)),  # capacity rounded down
            lambda t, e, k, f, w: w - math.ceil(f * k * t / e),  # a negative count when it fits
            lambda t, e, k, f, w: max(0, w - math.ceil(f * t / e)),  # k left out of the capacity
        ],
    ),
}


# ----------------------------------------------------------------------------------------
# The notebook's structure (fast)


def test_exercises_and_hidden_tests_cover_the_issue():
    nb = load(LAB)
    ids = [nbgrader_meta(c).get("grade_id") for c in nb.cells if nbgrader_meta(c)]
    assert [i for i in ids if i.startswith("ex_")] == [f"ex_{e}" for e in EXERCISES]
    points = {
        nbgrader_meta(c)["grade_id"]: nbgrader_meta(c)["points"] for c in nb.cells if nbgrader_meta(c).get("grade")
    }
    assert points == {
        "test_online_softmax": 2,
        "test_ring_attention": 4,
        "test_predict_ring_bytes": 1,
        "test_router": 2,
        "test_predict_dropped_tokens": 1,
        "test_expert_parallel": 4,
        "test_predict_moe_bytes": 1,
        "test_sequence_parallel": 3,
        "test_ulysses": 2,
        "test_mesh_groups": 2,
        "test_planner_5d": 2,
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
        "lab_tests.check_router(33, 8, 2, 0.5,",  # k = 2, tokens dropped
        "lab_tests.check_router(10, 5, 1, 2.0,",
        "lab_tests.check_moe(_moe, 4, 5, 7, 8, 2, 0.5,",
        "lab_tests.check_moe(_moe, 3, 4, 5, 6, 1, 0.75,",
        "lab_tests.check_moe_bytes(_moe, 4,",
        "lab_tests.check_moe_error(4, 6)",
        "def _ring_with_graders_blocks(",
        "def _moe_with_graders_router(",
        "def _reference_route(",  # the router's and the capacity-limited MoE's references stay hidden
        "def _reference_moe(",
        "dl.predictions.assert_prediction(",
        "lab_tests.check_sp(4, 16, 4, 8, 1, 1)",  # t = 4, 3 (6 heads), 1; a head count that does not split
        "lab_tests.check_sp(3, 12, 6, 9, 2, 2)",
        "lab_tests.check_sp(1, 8, 2, 4, 2, 3)",
        "lab_tests.check_sp_error(3, 4)",
        "lab_tests.check_ulysses(4, 4, 16, 3,",  # N = 4, 3, 1, 2 ranks; heads the group does not divide
        "lab_tests.check_ulysses(3, 6, 12, 2,",
        "lab_tests.check_ulysses(1, 2, 6, 4,",
        "lab_tests.check_ulysses_error(4, 6)",
        # five dimensions: the experts' view of pp·dp·cp·tp
        "lab_tests.check_expert_grid(pp=2, dp=2, cp=2, tp=2, ep=2, reference=_reference_groups)",
        "lab_tests.check_expert_grid(pp=1, dp=4, cp=2, tp=2, ep=4, reference=_reference_groups)",
        'lab_tests.check_groups({"pp": 2, "dp": 3, "cp": 2, "tp": 2}, "cp", reference=_reference_groups)',
        "dict(dp=128, tp=8, micro_batches=12, zero=3)",  # cp = ep = 1: Lab 8's memory_per_device, on GPT-3
        "dict(tp=8, cp=16, zero=1, sp=True)",  # cp up to 16, ep up to 16, ZeRO 0-3, sp both ways
        "dict(dp=4, cp=4, ep=16, zero=3)",
        "dict(dp=2, tp=2, pp=2, cp=2, ep=4, micro_batches=8, zero=2, sp=True)",
        "is not the world size 16",  # the four invalid grids
        '"12 heads not divisible by tp = 8"',
        '"6 experts not divisible by ep = 4"',
        '"dp·cp = 12 not divisible by ep = 16"',
    ):
        assert needle in hidden, needle
    ring = inspect.getsource(lab10.check_ring) + inspect.getsource(lab10._ring_in_rank)
    assert ring.count("rtol=1e-9") == ring.count("atol=1e-9") == 2 and "dtype=torch.float64" in ring  # output, grads
    planner = inspect.getsource(lab10.check_5d)  # its reference reduces to Lab 8's where cp = ep = 1
    assert "math.isclose(want, lab8_reference(config), rel_tol=1e-12)" in planner
    assert "lab_tests.check_5d(_LAB8, _ref_memory_5d, _lab8_memory," in cell_by_id(nb, "test_planner_5d").source
    helpers = inspect.getsource(lab10._expect_value_error)
    assert 'common.rank_raised(e, "ValueError", "divisible", loose=True)' in helpers
    # the graded cells reach the notebook only through dl.exercise.run (or dl.predictions.fetch): the module's
    # checks they call run the student's code with exercise.run (run_or_fail and _expect_value_error run it)
    runs = ("exercise.run(", "common.run_or_fail(", "_expect_value_error(", "check_groups(")
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
        "checks.assert_traffic(_run",  # the bytes of the MoE, counted by the OS
        "ExpertParallelMoE(MoE(4, 4, 6))",  # not divisible
        "top_k_route(_logits, 2, 0.5)",  # k = 2, capacity served choice-major
        'dl.predictions.check("ring bytes"',
        'dl.predictions.check("moe bytes"',
        'dl.predictions.check("dropped tokens"',
        "with dl.memory.SavedActivations(layer) as saved:",  # sequence parallelism: 1/t of the activations
        '"all_reduce" in op',  # no all-reduce
        '[2]["ln1.weight"]',  # a LayerNorm's gradient summed over the ranks
        "dl.launch(_self_check_ulysses, _n, 4, 16, device=DEVICE, trace=True)",  # Ulysses on 2 and 4 ranks, its bytes
        "dl.launch(_three_heads, 2, device=DEVICE)",
        "dl.launch(_torch_mesh_groups, 8)",  # against torch's DeviceMesh
        'world._unflatten(0, (4 // ep, ep, 2), ("edp", "ep", "tp"))',  # torchtitan's expert view of the same ranks
        "# Lab 8's grid_groups(dp=2, tp=2, pp=2)",
        "memory_per_device_5d(world=16, **_lab8, dp=16, micro_batches=4, zero=1)",  # Lab 8's worked example
        "memory_per_device_5d(world=16, **_lab8, dp=4, cp=4, micro_batches=16, zero=1)",  # cp
        "memory_per_device_5d(world=16, **_lab8, experts=8, dp=16, ep=4, micro_batches=4)",  # ep
        "memory_per_device_5d(**_args)",  # the invalid grids
    ):
        assert needle in visible, needle
    text_cells = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for rule in (
        "**not divisible**",
        "**before**",
        "choice-major",
        "`N − 1`",
        "three significant figures",
        "**all-gathers `x` again**",
        "(no all-reduce)",
        "exactly `1/t`",
        "**no other communication**",
        "`heads` is **not divisible** by `tp`",
        "`experts` is **not divisible** by `ep`",
        "`dp · cp` is **not divisible** by `ep`",
        "differs from `world` (say both numbers)",
        "**Expert parallelism is not a fifth factor of the world.**",
        "`(256, 8, 2, 1.0, 96)`, `(1000, 16, 1, 1.25, 150)` and `(4096, 64, 2, 1.5, 100)`",
        "each measurement equals its formula plus those two terms,\nto the byte",
    ):
        assert rule in text_cells, rule


def test_predictions_self_checks_hold_no_answer_and_use_the_graded_cases():
    nb = load(LAB)
    assert prediction_problems(nb) == []
    ring = [(4, 8192, 1024), (8, 65536, 512)]
    moe = [(4, 4096, 2, 768), (8, 1000, 1, 512)]
    dropped = [(256, 8, 2, 1.0, 96), (1000, 16, 1, 1.25, 150), (4096, 64, 2, 1.5, 100)]
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    for cases in (ring, moe, dropped):  # the self-checks use the graded cases
        assert source.count(f"cases={cases!r}") == 1 and source.count(f"_cases = {cases!r}") == 1, cases
    for value in (50331648, 234881024, 37748736, 3584000, 32, 71):  # not within 1e-6 of a rounding boundary
        mantissa = value / 10 ** len(str(value)[1:])
        assert abs(round(mantissa * 100) - mantissa * 100 - 0.5) % 1 > 1e-4


@pytest.mark.parametrize("grade_id", list(PREDICTIONS))
def test_graded_prediction_passes_the_right_formula_and_fails_wrong_ones(grade_id):
    assert_prediction_verdicts(load(LAB), grade_id, *PREDICTIONS[grade_id])


# ----------------------------------------------------------------------------------------
# Executing it (slow)


def _activations_match_the_formulas(printed: str) -> None:
    """Section 7's measurement (fp32, s = 64, b = 2, h = 32, a = 4 on t = 2 and 4 ranks): each layout's bytes per
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
        "ExpertParallelMoE",
        bench.ALL_GATHER_DISPATCH,
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
    dropped = output_of(nb, "# Measured: the skewed router above")
    for factor, wanted, capacity, drops in re.findall(
        r"factor ([\d.]+): expert 0 wants (\d+) choices, capacity (\d+), drops (\d+)", dropped
    ):
        assert int(capacity) == math.ceil(float(factor) * 2 * 256 / 8) and int(drops) == max(
            0, int(wanted) - int(capacity)
        )
    assert dropped.count("expert 0 wants") == 6 and "drops 0" not in dropped.splitlines()[0], dropped
    assert pictures(nb) >= 5, "the prediction bars (3), the timelines, the router's picture"


def _ships_dropped_choices() -> str:
    """The solution's ExpertParallelMoE, dispatching every choice (dropped ones too, their gate zeroed):
    the same output, more bytes."""
    source = cell_by_id(load(LAB), "ex_expert_parallel").source
    for right, wrong in (
        ("token, choice = kept.nonzero(as_tuple=True)", "token, choice = torch.ones_like(kept).nonzero(as_tuple=True)"),
        ("gates[token, choice, None] * back", "(gates * kept)[token, choice, None] * back"),
    ):
        assert right in source, right
        source = source.replace(right, wrong)
    return source


def _wrong_planner_5d(right: str, wrong: str) -> str:
    """The solution's memory_per_device_5d with ``right`` replaced by ``wrong``."""
    source = cell_by_id(load(LAB), "ex_planner_5d").source
    assert right in source, right
    return source.replace(right, wrong)


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
        "router",
        """
def top_k_route(logits, k, capacity_factor):        # the grader's stand-in, captured: float64 whatever comes in
    tokens, n = logits.shape
    gates, experts = torch.softmax(logits.double(), -1).topk(k, -1)
    capacity = math.ceil(capacity_factor * k * tokens / n)
    load, kept = [0] * n, torch.zeros(tokens, k, dtype=torch.bool)
    for c in range(k):
        for t in range(tokens):
            e = int(experts[t, c])
            if load[e] < capacity:
                load[e] += 1
                kept[t, c] = True
    return experts, gates, kept
""",
        "top_k_route(k=1): the gates",
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
        "router",
        """
def top_k_route(logits, k, capacity_factor):           # capacity served token by token, not choice-major
    tokens, n_experts = logits.shape
    gates, experts = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    capacity = math.ceil(capacity_factor * k * tokens / n_experts)
    order = experts.reshape(-1)
    one_hot = F.one_hot(order, n_experts)
    place = (one_hot.cumsum(0) * one_hot).sum(-1) - 1
    return experts, gates, (place < capacity).view(tokens, k)
""",
        "served choice-major",
    ),
    ("expert_parallel", _ships_dropped_choices(), "Something moved that the exercise does not need"),
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
        "mesh_groups",
        """
def mesh_groups(sizes, dims):                          # column-major: the first dimension changes fastest
    names, dims = list(sizes), (dims,) if isinstance(dims, str) else tuple(dims)
    grid = torch.arange(math.prod(sizes.values())).view(*reversed(list(sizes.values())))
    grid = grid.permute(*reversed(range(len(names))))
    kept = [names.index(d) for d in dims]
    rest = [i for i in range(len(names)) if i not in kept]
    groups = grid.permute(*rest, *kept).reshape(-1, math.prod(sizes[d] for d in dims))
    return sorted(sorted(g) for g in groups.tolist())
""",
        "row-major, the last dimension fastest",
    ),
    (
        "planner_5d",  # ZeRO shards the dense states over dp only, not over the dp · cp ranks that reduce them
        _wrong_planner_5d("states(dense, dp * cp)", "states(dense, dp)"),
        "States: zero(Ψ_dense, dp·cp)",
    ),
    (
        "planner_5d",  # context parallelism does not split the activations
        _wrong_planner_5d("sbh = seq / cp * b * hidden", "sbh = seq * b * hidden"),
        "activations of s/cp tokens",
    ),
    (
        "predict_ring_bytes",
        "def predicted_ring_attention_bytes(n, seq_len, width):\n    return 2 * seq_len * width * 4\n",
        "does not match the cost model",
    ),
    (
        "predict_moe_bytes",
        "def predicted_moe_bytes(n, tokens, k, d):\n    return tokens * k * (n - 1) / n * d * 4\n",
        "does not match the cost model",
    ),
    (
        "predict_dropped_tokens",  # the capacity rounded down: 1000 tokens, 16 experts, cf 1.25 give C = 78, not 79
        "def predicted_dropped_tokens(tokens, n_experts, k, capacity_factor, wanted):\n"
        "    return max(0, wanted - int(capacity_factor * k * tokens / n_experts))\n",
        "does not match the cost model",
    ),
]


def _base_cells(lab):
    """The setup, the solutions, the given definitions and the test helpers, in the notebook's order."""
    wanted = {"setup", "test_helpers", *GIVEN, *(f"ex_{e}" for e in EXERCISES)}
    cells = [copy.deepcopy(c) for c in lab.cells if nbgrader_meta(c).get("grade_id") in wanted]
    return cells, [c for c in cells if nbgrader_meta(c).get("grade_id", "").startswith("ex_")]


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
    # a top_k_route that keeps everything fails exercise 4; the MoE layer is graded with the grader's router.
    lab = load(LAB)
    cells, _ = _base_cells(lab)
    broken_blocks = "def block_attention(q, k, v, q_pos, k_pos):\n    return q * 0, q[..., 0] * 0\n"
    broken_router = (
        "def top_k_route(logits, k, capacity_factor):\n"
        "    gates, experts = torch.softmax(logits, -1).topk(k, -1)\n"
        "    return experts, gates, torch.ones_like(experts, dtype=torch.bool)\n"
    )
    cells += [nbformat.v4.new_code_cell(broken_blocks), nbformat.v4.new_code_cell(broken_router)]
    graded = ["online_softmax", "ring_attention", "router", "expert_parallel"]
    start = len(cells)
    cells += [copy.deepcopy(cell_by_id(lab, f"test_{g}")) for g in graded]
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, timeout=240, cwd=LAB.parent)
    results = dict(zip(graded, nb.cells[start:]))
    assert errors(results["online_softmax"]) and errors(results["router"])
    for passing in ("ring_attention", "expert_parallel"):
        assert not errors(results[passing]), errors(results[passing])
        assert "\N{WHITE HEAVY CHECK MARK}" in text(results[passing]), text(results[passing])


TOKEN_MAJOR_ROUTER = """
def top_k_route(logits, k, capacity_factor):      # serves capacity token by token (both choices of token 0 first)
    tokens, n_experts = logits.shape
    gates, experts = torch.softmax(logits, -1).topk(k, -1)
    capacity = math.ceil(capacity_factor * k * tokens / n_experts)
    load, kept = [0] * n_experts, torch.zeros(tokens, k, dtype=torch.bool)
    for token in range(tokens):
        for choice in range(k):
            e = int(experts[token, choice])
            if load[e] < capacity:
                load[e] += 1
                kept[token, choice] = True
    return experts, gates, kept
"""


@pytest.mark.slow
def test_a_router_that_passes_the_visible_case_only_costs_expert_parallelism_nothing():
    # #41: the gate was exercise 4's visible 5-token case (k = 1); a token-major router passes it, fails the graded
    # test's k = 2 cases, and used to cost the expert-parallel layer its points on the student's router.  The layer
    # is now graded on the student's router only once exercise 4's graded test passed, else on the grader's.
    lab = load(LAB)
    cells, _ = _base_cells(lab)
    cells.append(nbformat.v4.new_code_cell(TOKEN_MAJOR_ROUTER))
    start = len(cells)
    cells += [copy.deepcopy(cell_by_id(lab, f"test_{g}")) for g in ("router", "expert_parallel")]
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, timeout=240, cwd=LAB.parent)
    router, layer = nb.cells[start:]
    assert errors(router), "the token-major router should fail exercise 4's graded test"
    assert not errors(layer), errors(layer)
    assert "\N{WHITE HEAVY CHECK MARK}" in text(layer), text(layer)


# ----------------------------------------------------------------------------------------
# disttrain-lab bench sequence


def test_format_sequence_table():
    size = {"seq_len": 64, "heads": 2, "dim": 8}
    rows = [
        {
            "part": "attention",
            "version": bench.ALL_GATHER_KV,
            "world_size": 2,
            "size": size,
            "repeats": 3,
            "ms": 4.0,
            "bytes": 4096,
            "baseline": bench.ALL_GATHER_KV,
            "ratio": 1.0,
        },
        {
            "part": "attention",
            "version": "ring_attention",
            "world_size": 2,
            "size": size,
            "repeats": 3,
            "ms": 2.0,
            "bytes": 8192,
            "baseline": bench.ALL_GATHER_KV,
            "ratio": 2.0,
        },
        {
            "part": "attention",
            "version": bench.TORCH_CP,
            "world_size": 2,
            "size": size,
            "repeats": 3,
            "error": "NotImplementedError: no CPU",
        },
    ]
    long = {
        "part": bench.LONG,
        "world_size": 2,
        "size": {"heads": 2, "dim": 8, "link": "10 Gbit Ethernet"},
        "repeats": 3,
    }
    rows += [
        {
            **long,
            "version": "ring_attention, S=64",
            "ms": 6.0,
            "bytes": 2048,
            "baseline": "ring_attention",
            "ratio": 1.0,
        },
        {
            **long,
            "version": "ulysses_attention, S=64",
            "ms": 2.0,
            "bytes": 1024,
            "baseline": "ring_attention",
            "ratio": 3.0,
        },
    ]
    table = bench.format_sequence_table(rows)
    assert "long sequences on 2 ranks, cpu (heads 2, dim 8, link 10 Gbit Ethernet)" in table, table
    assert "ratio: ring_attention's time / this one's" in table and "3.00x" in table, table
    assert "ratio: all-gather K/V's time / this one's" in table
    assert "ring_attention" in table and "2.00x" in table and "8.0 KiB" in table
    assert f"{bench.TORCH_CP}" in table and "not measured: NotImplementedError: no CPU" in table


@pytest.mark.slow
def test_cli_bench_sequence_with_tiny_options():
    args = ["--world-size", "2", "--seq-len", "64", "--heads", "2", "--dim", "8"]
    args += ["--tokens", "16", "--d", "8", "--experts", "2", "--repeats", "1", "--seq-lens", "32,64"]
    done = run_python(["-m", "disttrain_lab.cli", "bench", "sequence", *args], timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout
    out = done.stdout
    for line in (
        "ring_attention",
        bench.ALL_GATHER_KV,
        "ExpertParallelMoE",
        bench.ALL_GATHER_DISPATCH,
        bench.ONE_PROCESS_MOE,
        "ring_attention, S=32",
        "ulysses_attention, S=64",
    ):
        assert f"  {line} " in out, out
    unmeasured = [line for line in out.splitlines() if "not measured" in line]
    assert all(line.strip().startswith(bench.TORCH_CP) for line in unmeasured), out  # only torch's, where it cannot run
    if "device: cpu" in out:  # --device auto on a machine without a GPU per rank: torch's says why, from torch itself
        assert "device: cpu (auto: " in out and "attention on 2 ranks, cpu" in out, out
        assert unmeasured and "aten._scaled_dot_product_flash_attention_for_cpu" in unmeasured[0], out
        assert "NotImplementedError" in unmeasured[0], out


def test_bench_sequence_picks_its_device():
    from disttrain_lab.bench.sequence import pick_device

    assert pick_device("cpu", 4) == ("cpu", "asked") and pick_device("cuda", 2) == ("cuda", "asked")
    chosen, why = pick_device("auto", 10_000)  # more ranks than any machine's GPUs: the CPU
    assert chosen == "cpu" and why.startswith("auto: ") and "for 10000 ranks" in why
    with pytest.raises(ValueError, match="auto"):
        pick_device("tpu", 2)
