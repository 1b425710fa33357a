"""Lab 8 (capstone): the solution notebook runs, and its graded tests catch wrong answers.

- The notebook's structure: ten exercises (sections 2-5), each followed by its graded cell; the hidden tests
  cover several grids (1 × 2 × 4, 4 × 1 × 2, ...), uneven micro-batches, 3 and 4 ranks, the
  errors each exercise must raise; the kit's Lab 6 pieces ship with Lab 8 (data/) and not in
  the package students install.
- ONE kernel (a module fixture) executes the solution notebook as the grader runs it
  (NBGRADER_EXECUTION set), within its 5-minute budget, every graded cell passing, with its
  pictures; the planner ranks the measured runs of data/step_times.json and finds GPT-3's
  8-way tensor parallelism; the scaling-law fit and Chinchilla's table are printed; then, in the same kernel, wrong answers (Megatron's order mixed up, attention
  without f, blocks keyed by their place in the stage, gradients summed instead of averaged,
  LARS without its trust ratio or moving no zero weight, the planner ignoring the TP tier, keeping plans that
  do not fit or ignoring ``sp``, a log10 power-law fit, a wrong compute-optimal Ψ) each fail their graded cell
  saying why, and the Lab 6 pieces
  fall back on the reference ones when the Lab 6 notebook is missing or blank; a correct grid built
  another way (``new_subgroups_by_enumeration``) passes; and a later exercise keeps its points when
  the earlier ones it builds on fail (graded on the grader's own pieces).
- The statements issue 25 found wrong are gone from the instructor notebook (each old phrase, in its
  text and its code), its symbols keep one meaning (`N` ranks, `Ψ` parameters, `D` tokens, `t` the
  TP degree), and its two graded predictions are there, each with a measurement beside it.
- A submission whose ``grid_groups`` spins, autograded: the spin costs one cell's limit, every later
  cell that meets it fails at once, and only ``grid_groups``'s points are lost.

The blank notebook failing every graded cell, and the autograde round trip, are in test_grading.py.
"""

from __future__ import annotations

import ast
import copy
import inspect
import json
import math
import re

import nbformat
import pytest

from disttrain_lab import bench, grading
from disttrain_lab.grading import cell_times
from disttrain_lab.grading.execute import NOTES_FILE
from disttrain_lab.labtests import lab08
from tests.helpers import source_of
from tests.notebooks import (
    REPO,
    SLOWDOWN,
    cell_by_id,
    errors,
    execute,
    graded_cells,
    load,
    nbgrader_meta,
    output_of,
    pictures,
    prediction_problems,
    solution_notebook,
    text,
)
from tests.roundtrip import Course, submit, with_solution

LAB = solution_notebook("08_capstone")
BUDGET_S = 300  # the issue's budget for the whole solution notebook on 2 cores
EXERCISES = [
    "grid_groups",
    "tp_attention",
    "pipeline_stage",
    "three_d",  # section 2
    "planner_memory",
    "planner_step_time",
    "planner_plans",  # section 3
    "lars",
    "scaling_fit",
    "scaling_optimal",
]  # sections 4, 5


# ----------------------------------------------------------------------------------------
# The notebook's structure (fast)

LAB6_PIECES = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "f",
    "g",
    "TensorParallelMLP",
]  # (lab 6's, as the lab loads)


def _solution_over_lab6(monkeypatch, names: list[str]) -> tuple[dict, dict, dict]:
    """The solution's ``names`` (the given cells too) over lab 6's solution pieces, made the notebook's names:
    returns (the solution's pieces, their namespace, lab 6's pieces)."""
    from tests.helpers import notebook_names

    solution = bench.functions_from_notebook(LAB, names, given=True)
    last = solution[names[-1]]
    space = (last.forward if isinstance(last, type) else last).__globals__
    lab6 = bench.functions_from_notebook(solution_notebook("06_tensor_parallel"), LAB6_PIECES)
    space.update(lab6)
    notebook_names(monkeypatch, space)
    return solution, space, lab6


def test_exercises_and_hidden_tests_cover_the_issue():
    nb = load(LAB)
    ids = [nbgrader_meta(c).get("grade_id") for c in nb.cells if nbgrader_meta(c)]
    assert [i for i in ids if i.startswith("ex_") and not i.startswith("ex_predict_")] == [f"ex_{e}" for e in EXERCISES]
    hidden = "".join(
        part.split("### END HIDDEN TESTS")[0]
        for e in EXERCISES
        for part in cell_by_id(nb, f"test_{e}").source.split("### BEGIN HIDDEN TESTS")[1:]
    )
    for needle in (
        "lab_tests.check_grid(1, 2, 4)",
        "lab_tests.check_grid(4, 1, 2)",
        "lab_tests.check_grid(3, 2, 1)",
        "lab_tests.check_grid_error(8, (3, 2, 2)",
        "lab_tests.check_attention(4, models.GPTConfig(seq_len=7, d_model=24, n_heads=6), batch=1, tp=2)",
        "lab_tests.check_attention(3,",
        "lab_tests.check_attention_error(4, 8, 2)",
        "lab_tests.check_stage(1, 1, 3,",
        "lab_tests.check_stage(2, 2, 2,",
        "lab_tests.check_stage_error(2, 3, 1, 1, 2)",
        "lab_tests.check_3d(1, 2, 2, micro_batches=3, batch=10",
        "lab_tests.check_3d(1, 2, 4,",
        "lab_tests.check_3d(2, 1, 2,",
        "lab_tests.check_3d_error(batch=5, dp=2)",
        "zero_grad=1",
        "groups=[",
        "lrs=[0.1, 0.2, 0.3, 0.4]",
        "def _graders_pieces(graders)",  # the grader's own earlier pieces, hidden, handed to the module at run time
        'lab_tests.GRADERS["pieces"] = _graders_pieces',
        "lab_tests.check_lars_without_grad()",
        'float("inf")',
        "sp=True",
    ):
        assert needle in hidden, needle
    # the traffic the graded test expects comes from the configuration, not from the solution
    traffic = inspect.getsource(lab08._expected_traffic)
    assert traffic.startswith("def _expected_traffic(cfg, batch, dp, tp, pp, micro_batches, rank)")
    assert "train_3d(" not in traffic
    # the grader's own pieces (solutions of earlier exercises) stay in the hidden tests, never in the kit
    kit = source_of(lab08)
    assert "def _graders_pieces" not in kit and "def _graders_planner" not in kit
    assert "def grid_groups(" not in kit and "class PipelineStage3D(" not in kit
    assert (
        "def train_3d(cfg: models.GPTConfig, batches: list, *, dp: int, tp: int, pp: int, micro_batches: int,"
        in cell_by_id(nb, "ex_three_d").source
    )
    for cell in graded_cells(nb):
        assert nbgrader_meta(cell)["locked"] and nbgrader_meta(cell)["points"] > 0


# Statements issue 25 found wrong (and notation it changed): none of these phrases may come back
OLD_PHRASES = [
    "GPT-3 (175 B parameters) was trained with",  # OpenAI did not publish GPT-3's layout
    "The published\nrecipe (Megatron-LM, Narayanan et al., 2021; the lecture's",
    "split by TP: `34 s b h / tp`",  # plain TP keeps s·b·h·(10 + 24/t)
    "34 · s · b · h · (L / pp) · min(pp, m) / tp",
    "per_layer = 34 * model.seq * b * model.hidden / plan.tp",
    "ZeRO 3 all-gathers the weights once more\n(1.5 times the all-reduce)",  # gathered per micro-batch
    "dp_comm *= 1.5",
    "Without ZeRO, 80 GB\n  needs `pp ≥ 8`",  # only at tp = 8
    "the lecture's 64-way pipeline\n  does not even divide 96 layers evenly here — Megatron's interleaved schedule",
    "found, for each budget, the size with the lowest loss:\nthe loss falls as a **power law** in parameters and in tokens, "
    "and the compute-optimal model\ngrows as `N_opt ∝ C^0.5`",  # Kaplan: C^0.73
    "check the lecture's table (Hoffmann et al., 2022, table 3",  # the table is Chinchilla's
    "# The lecture's table (Chinchilla, table 3)",
    "would grow nearly linearly with dp while the global batch stays below the critical batch size",
    "LARS comes closest to the small-batch curve",  # no test checks it
    "must be positive numbers (a `ValueError` otherwise)",  # inf too: finite positive numbers
    "**The cluster**: `D` devices",  # D is tokens, never devices
    "`N = 12 L h² + 2 V h` parameters",  # N is ranks; parameters are Ψ
    "training costs **`6 N` FLOPs per\ntoken**",
    "compute `C ≈ 6 N D`",
    'made = {len(run.trace.select(op="new_group"',  # a grid built another way made no new_group calls
    # symbols: N is ranks, Ψ parameters, D tokens, t the TP degree (in the code as in the text)
    '"""N = 12 L h^2 + 2 V h',
    "devices: int             # D",
    'xlabel="parameters N"',
    "best N = ",
    "D/N = ",
    "N_EXPONENT",
    "LOSS_EXPONENT_N",
    "(N, D, loss)",
    "_RUNS_NDL",
    "(N, loss)",
    "cutting them into `N` contiguous",
    "each of the `N` ranks of the\nTP group",
    "n_heads / N",
    "d/N",
    "\\nN = {CFG.params():,} parameters",
]

# Where a bare N or D may stand in the instructor notebook (text and code): N a number of ranks, or
# naming the papers' N (our Ψ); D a number of tokens (a line that says so: it names Ψ or tokens)
N_ALLOWED = (
    "`N` is a number of ranks",
    "write `N` for it",
    "who write `N`",
    "write `N` for `Ψ`",
    "their `N` our `Ψ`",
    "`N` devices in nodes",
    "`dp · tp · pp = N`",
    "devices: int             # N",
)


def test_old_statements_are_gone_and_the_new_ones_are_there():
    source = "\n".join(c.source for c in load(LAB).cells)
    found = [phrase for phrase in OLD_PHRASES if phrase in source]
    assert not found, f"statements issue 25 found wrong are back: {found}"
    lines = source.splitlines()
    bare_n = [
        line for line in lines if re.search(r"(?<![\w\\])N(?!\w)", line) and not any(a in line for a in N_ALLOWED)
    ]
    assert not bare_n, f"N is a number of ranks (Ψ parameters, t the TP degree), yet: {bare_n}"
    bare_d = [
        line
        for line in lines
        if re.search(r"(?<![\w\\-])D(?!\w)", line) and not re.search(r"Ψ|token|\(D, loss\)", line)
    ]
    assert not bare_d, f"D is a number of tokens, yet: {bare_d}"
    for phrase in (
        "s · b · h · (10 + 24 / t)",  # Korthikanti et al., Table 2, plain TP
        "34 · s · b · h / t",  # with sequence parallelism
        "C^0.73",  # Kaplan et al.
        "4.2 × 10²³",  # the lecture's 70 B / 1 T row against 6ΨD
        "t = 8, p = 64",  # the 64-way pipeline is the 1 T model's
        "OpenAI did not\npublish",
        "`(1 + 2m) / 2` times the all-reduce",
        "**at `tp = 8`**",
        "finite positive numbers",
        "given **no state**",
        "`step_time` has no `sp` switch",  # sequence parallelism: the same bytes, the same step time
        "plan_parallelism(model, cluster, sp=False)",
    ):
        assert phrase in source, phrase


def test_two_graded_predictions_each_with_a_measurement():
    nb = load(LAB)
    for name, variable, measured in (
        ("training_flops", "predicted_training_flops", "FlopCounterMode"),
        ("bubble", "predicted_bubble", "measured_bubble(_run)"),
    ):
        solution, graded = cell_by_id(nb, f"ex_predict_{name}"), cell_by_id(nb, f"test_predict_{name}")
        assert nbgrader_meta(solution)["solution"] and nbgrader_meta(graded)["points"] == 1
        assert f'dl.predictions.fetch("{variable}"' in graded.source
        visible = graded.source.split("### BEGIN HIDDEN TESTS")[0]
        assert "assert_prediction" not in visible and "assert_prediction" in graded.source  # the reference is hidden
        later = nb.cells[nb.cells.index(solution) :]
        check = next(c for c in later if "dl.predictions.check(" in c.source)
        assert f'globals().get("{variable}")' in check.source
        measure = next(c for c in later if measured in c.source and "predicted_vs_measured" in c.source)
        assert nb.cells.index(check) < nb.cells.index(measure) < nb.cells.index(graded)
    assert prediction_problems(nb) == []  # each self-check checks the form, at graded cases, and holds no answer


def test_reference_pieces_ship_with_lab_8_only():
    pieces = REPO / "solutions" / "08_capstone" / "data" / "reference_pieces.py"
    released = REPO / "labs" / "08_capstone" / "data" / "reference_pieces.py"
    assert released.read_bytes() == pieces.read_bytes()
    package = "\n".join(p.read_text() for p in (REPO / "disttrain_lab").rglob("*.py"))
    for name in ("ColumnParallelLinear", "RowParallelLinear", "TensorParallelMLP"):
        assert f"class {name}(" in pieces.read_text() and f"class {name}(" not in package, name


# ----------------------------------------------------------------------------------------
# Executing it, then wrong answers in the same kernel (slow)


def exercise_cells(exercise: str) -> tuple[str, str]:
    """(grade id of the exercise's cell, grade id of its graded cell)."""
    return f"ex_{exercise}", f"test_{exercise}"


def _replaced(exercise: str, right: str, wrong: str) -> str:
    """The solution cell of ``exercise`` with one line changed."""
    source = cell_by_id(load(LAB), exercise_cells(exercise)[0]).source
    assert right in source, right
    return source.replace(right, wrong)


# Wrong answers: (exercise, wrong definition, words the graded cell's failure must contain); the
# exercise's cell is ex_<exercise> and its graded cell test_<exercise>
WRONG = [
    (
        "grid_groups",
        _replaced(
            "grid_groups",  # dp fastest: not Megatron's order
            "tp_rank, dp_rank, pp_rank = rank % tp, rank // tp % dp, rank // (tp * dp)",
            "dp_rank, tp_rank, pp_rank = rank % dp, rank // dp % tp, rank // (tp * dp)",
        ),
        "tp_rank = 0, expected 1",
    ),
    (
        "tp_attention",
        _replaced("tp_attention", "x = f(x, self.group)", "x = x"),  # no all-reduce backward
        "backward: one all-reduce, f's",
    ),
    (
        "pipeline_stage",
        _replaced(
            "pipeline_stage",  # blocks keyed by their place in the stage
            "self.blocks[str(i)] = block",
            "self.blocks[str(len(self.blocks))] = block",
        ),
        "holds blocks ['0'], expected ['1']",
    ),
    # the grader's stand-ins (#42 item 4), captured and handed in: their ValueErrors name neither values nor rule
    (
        "grid_groups",
        _replaced(
            "grid_groups",
            'raise ValueError(f"dp · tp · pp = {dp} · {tp} · {pp} = {dp * tp * pp} must equal the world size "\n'
            '                         f"{world_size}, each at least 1 (e.g. dp=2, tp=2, pp=2 for 8 ranks)")',
            'raise ValueError("no such grid here")',
        ),
        "expected your ValueError naming 12, 8; got ValueError: no such grid here",
    ),
    (
        "tp_attention",
        _replaced(
            "tp_attention",
            'raise ValueError(f"TensorParallelAttention: n_heads={attn.n_heads} is not divisible by the {size} ranks "\n'
            '                             f"of the group; every rank needs whole heads (n_heads a multiple of {size})")',
            'raise ValueError("these heads do not split over this group")',
        ),
        "got ValueError: these heads do not split over this group",
    ),
    (
        "pipeline_stage",
        _replaced(
            "pipeline_stage",
            'raise ValueError(f"PipelineStage3D: n_layers={layers} is not divisible by pp={pp}; every stage "\n'
            '                             f"needs the same number of blocks (pp must divide {layers})")',
            'raise ValueError("these layers do not split into these stages")',
        ),
        "got ValueError: these layers do not split into these stages",
    ),
    (
        "three_d",
        _replaced("three_d", "            flat /= dp\n", ""),  # the sum, not the average
        "the sum divided by dp",
    ),
    (
        "lars",
        _replaced(
            "lars",
            'trust = group["trust_coefficient"] * w_norm / (g_norm + group["weight_decay"] * w_norm + group["eps"])',
            "trust = 1.0",
        ),  # momentum SGD
        "LARS({'lr': 0.5, 'weight_decay': 0.01, 'trust_coefficient': 0.02}) after 3 step(s)",
    ),
    (
        "planner_step_time",  # the grader's stand-in, captured: 1.5 times the formula (the planner reads its order)
        _replaced("planner_step_time", "    return pipeline + dp_comm", "    return 1.5 * (pipeline + dp_comm)"),
        "step_time(dp=",
    ),
    (
        "planner_step_time",
        _replaced("planner_step_time", "ranks=range(plan.tp))", ")"),  # TP tier ignored
        "step_time(dp=1    tp=8   pp=1",
    ),
    (
        "planner_plans",
        _replaced("planner_plans", "if memory <= cluster.memory:", "if True:"),  # keeps what does not fit
        "not valid or not fitting",
    ),
    (
        "scaling_fit",
        _replaced(
            "scaling_fit",
            "np.polyfit(np.log(x), np.log(y), 1)",  # log10 fit, exp back
            "np.polyfit(np.log10(x), np.log10(y), 1)",
        ),
        "fit_power_law on y = 3 x^2: expected (c, e) = (3, 2)",
    ),
    (
        "scaling_optimal",
        _replaced(
            "scaling_optimal", "math.sqrt(flops / (6 * tokens_per_param))", "math.sqrt(flops / 6) / tokens_per_param"
        ),
        "compute_optimal(5.76e+23): expected",
    ),
    (
        "tp_attention",  # every rank attends over all n_heads of its d/N features
        _replaced(
            "tp_attention",
            "self.value(x), self.n_heads)",
            "self.value(x), self.n_heads * dist.get_world_size(self.group))",
        ),
        "attends over its own 2 of the 4 heads",
    ),
    (
        "three_d",  # the mean of the micro-batch means: right only when they are of equal sizes
        _replaced(
            "three_d", "models.lm_loss(outputs, yi) * (len(yi) / len(y))", "models.lm_loss(outputs, yi) / micro_batches"
        ),
        "not the mean of the micro-batch means",
    ),
    (
        "planner_memory",  # all of 34 sbh split by tp: sequence parallelism's count, not plain TP's
        _replaced("planner_memory", "per_layer = sbh * (10 + 24 / plan.tp)", "per_layer = 34 * sbh / plan.tp"),
        "s·b·h·(10 + 24/tp) per layer",
    ),
    (
        "planner_step_time",  # ZeRO 3's weights gathered once per step
        _replaced("planner_step_time", "dp_comm *= (1 + 2 * plan.micro_batches) / 2", "dp_comm *= 1.5"),
        "ZeRO 3's DP is (1 + 2m)/2 all-reduces",
    ),
    (
        "lars",  # a momentum buffer for a parameter without a gradient
        _replaced(
            "lars",
            "if p.grad is None:\n                    continue",
            "if p.grad is None:\n                    self.state[p]['momentum_buffer'] = torch.zeros_like(p)\n"
            "                    continue",
        ),
        "gets no state",
    ),
    (
        "scaling_fit",  # no check of the lengths: numpy's TypeError
        _replaced("scaling_fit", "x.shape != y.shape or ", ""),
        "x and y of different lengths) should raise a ValueError",
    ),
    (
        "scaling_optimal",  # inf accepted
        _replaced("scaling_optimal", " or not math.isfinite(value)", ""),
        "must be finite positive numbers",
    ),
    (
        "lars",  # no special case for a zero weight: its trust ratio 0, so it never moves
        _replaced("lars", "if w_norm > 0 and g_norm > 0:", "if g_norm > 0:"),
        "a zero weight: ‖w‖ = 0, so its trust ratio is 1",
    ),
    (
        "planner_plans",  # sp ignored: plain TP's memory whatever the switch
        _replaced(
            "planner_plans",
            "memory = memory_per_device(model, cluster, plan, sp=sp)",
            "memory = memory_per_device(model, cluster, plan)",
        ),
        "12.9 B on 32 devices of 16 GB, sp=True: (dp, tp, pp, m, zero) missing",
    ),
]

# Correct answers written another way: each passes its graded cell
RIGHT = [
    (
        "grid_groups",  # one call per kind of group: torch's new_subgroups_by_enumeration
        """def grid_groups(dp: int, tp: int, pp: int) -> Grid:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if min(dp, tp, pp) < 1 or dp * tp * pp != world_size:
        raise ValueError(f"dp · tp · pp = {dp * tp * pp} must equal the world size {world_size}")
    tp_group, _ = dist.new_subgroups_by_enumeration([list(range(s, s + tp)) for s in range(0, world_size, tp)])
    dp_group, _ = dist.new_subgroups_by_enumeration(
        [[(s * dp + d) * tp + t for d in range(dp)] for s in range(pp) for t in range(tp)])
    tp_rank, dp_rank, pp_rank = rank % tp, rank // tp % dp, rank // (tp * dp)
    return Grid(dp, tp, pp, dp_rank, tp_rank, pp_rank, tp_group, dp_group,
                rank - dp * tp if pp_rank > 0 else None, rank + dp * tp if pp_rank < pp - 1 else None)
""",
    ),
]

BROKEN = "    raise NotImplementedError('broken on purpose')\n"
# A later exercise keeps its points when the earlier ones it builds on fail: (cells to define, graded cells
# to run, whether each must pass); run in order, in the same kernel, then the solutions again
CHAIN = [
    (
        [
            "def grid_groups(dp, tp, pp):\n" + BROKEN,
            "class TensorParallelAttention(nn.Module):\n    def __init__(self, attn, group=None):\n    " + BROKEN,
            "class PipelineStage3D(nn.Module):\n    def __init__(self, gpt, grid):\n    " + BROKEN,
        ],
        [
            ("test_grid_groups", False),
            ("test_tp_attention", False),
            ("test_pipeline_stage", False),
            ("test_three_d", True),
        ],
    ),
    (["ex_pipeline_stage"], [("test_pipeline_stage", True)]),  # your stage, on the grader's grid and attention
    (["ex_grid_groups", "ex_tp_attention"], [("test_grid_groups", True), ("test_tp_attention", True)]),
    (
        [
            "def memory_per_device(model, cluster, plan, sp=False):\n" + BROKEN,
            "def step_time(model, cluster, plan):\n" + BROKEN,
        ],
        [("test_planner_memory", False), ("test_planner_plans", True)],
    ),
    (["ex_planner_memory", "ex_planner_step_time"], [("test_planner_memory", True)]),
    (  # a step_time without the bubble passes its visible ranking, not its formula: the plans on the grader's
        [
            _replaced(
                "planner_step_time",
                "pipeline = (plan.pp * (forward + backward) + 2 * (plan.pp - 1) * message",
                "pipeline = ((forward + backward) + 2 * (plan.pp - 1) * message",
            )
        ],
        [("test_planner_plans", True), ("test_planner_step_time", False)],
    ),
]


CATCH = """
import linecache
_source = {source!r}
linecache.cache["<graded cell {grade_id}>"] = (len(_source), None, _source.splitlines(True), "<graded cell {grade_id}>")
try:  # (linecache: the cell's functions keep their source, as a cell's do; a driver is sent by its source)
    exec(compile(_source, "<graded cell {grade_id}>", "exec"), globals())
except Exception as _error:
    print("FAILED:", type(_error).__name__, _error)
else:
    print("PASSED")
"""


@pytest.fixture(scope="module")
def executed():
    """The solution notebook, then each wrong answer and its graded cell, then the solution again;
    then the Lab 6 pieces loaded from a missing and from the blank Lab 6 notebook.  One kernel."""
    lab = load(LAB)
    cells = [copy.deepcopy(c) for c in lab.cells]
    solution_end = len(cells)
    wrong_at = []
    for exercise, wrong, _ in WRONG:
        solution, graded = exercise_cells(exercise)
        cells.append(nbformat.v4.new_code_cell(wrong))
        wrong_at.append(len(cells))  # the cell running the graded cell
        cells.append(nbformat.v4.new_code_cell(CATCH.format(source=cell_by_id(lab, graded).source, grade_id=graded)))
        cells.append(copy.deepcopy(cell_by_id(lab, solution)))
    right_at = []
    for exercise, right in RIGHT:
        cells.append(nbformat.v4.new_code_cell(right))
        right_at.append(len(cells))
        graded = exercise_cells(exercise)[1]
        cells.append(nbformat.v4.new_code_cell(CATCH.format(source=cell_by_id(lab, graded).source, grade_id=graded)))
        cells.append(copy.deepcopy(cell_by_id(lab, exercise_cells(exercise)[0])))
    chain_at = []
    for defined, graded_cells_run in CHAIN:
        for source in defined:
            cells.append(
                copy.deepcopy(cell_by_id(lab, source))
                if source.startswith("ex_")
                else nbformat.v4.new_code_cell(source)
            )
        for graded, _ in graded_cells_run:
            chain_at.append(len(cells))
            cells.append(
                nbformat.v4.new_code_cell(CATCH.format(source=cell_by_id(lab, graded).source, grade_id=graded))
            )
    fallback_at = len(cells)
    blank_lab6 = REPO / "labs" / "06_tensor_parallel" / "06_tensor_parallel.ipynb"
    cells.append(
        nbformat.v4.new_code_cell(
            f"_found = [load_tp_pieces(path) for path in ('../no_such_lab/06_tensor_parallel.ipynb', {str(blank_lab6)!r})]\n"
            "print(repr([(sorted(pieces), pieces['f'].__module__, why) for pieces, why in _found]))\n"
        )
    )
    for i, cell in enumerate(cells[solution_end:]):
        cell.id = f"extra-{i}"  # copies of solution cells: ids must stay unique
    nb, seconds = execute(
        nbformat.v4.new_notebook(cells=cells, metadata=lab.metadata), autograding=True, timeout=300, cwd=LAB.parent
    )
    return nb, seconds, solution_end, wrong_at, fallback_at, right_at, chain_at


@pytest.mark.slow
def test_solution_notebook_executes_within_budget(executed):
    nb, seconds, solution_end, *_ = executed
    failed = {i: errors(c) for i, c in enumerate(nb.cells) if c.cell_type == "code" and errors(c)}
    assert not failed, f"cells raised: {failed}"
    for cell in graded_cells(nbformat.v4.new_notebook(cells=nb.cells[:solution_end])):
        assert "\N{WHITE HEAVY CHECK MARK}" in text(cell), (nbgrader_meta(cell)["grade_id"], text(cell))
        assert not [o for o in cell.outputs if o.get("name") == "stderr"], nbgrader_meta(cell)["grade_id"]
    assert seconds < BUDGET_S * SLOWDOWN, (
        f"the solution notebook (and the wrong answers after it) took {seconds:.0f} s, "
        f"the budget is {BUDGET_S} s (x{SLOWDOWN:g} allowed for a loaded machine)"
    )
    assert pictures(nb) == 7, (
        "expected the single-process loss curve, the FLOPs predicted against counted, the 2 × 2 × 2 timeline, "
        "the bubble predicted against measured, the planner's predicted against measured step times, the "
        "large-batch curves and the IsoFLOP profiles"
    )
    # run beside the Lab 6 solution, the lab takes its pieces from there
    assert output_of(nb, "_pieces, _source = load_tp_pieces()").startswith(
        "tensor-parallel pieces: your Lab 6 (../06_tensor_parallel/06_tensor_parallel.ipynb)"
    )
    # the 2 × 2 × 2 self-check: 8 TP all-reduces + 1 DP all-reduce, 2 sends and 2 receives, per step (3 steps)
    printed = output_of(nb, "# Self-check: 8 ranks, 2 × 2 × 2")
    assert "rank 0, 3 steps: 27 all_reduce, 6 isend, 6 recv" in printed, printed
    # the large-batch picture: × 8 from step 0 diverges, LARS ends below plain SGD at the same rate
    printed = output_of(nb, "LARGE_BATCH_RUNS = {")
    final = {name.strip(): value for name, value in re.findall(r"^(.+?)\s+final loss\s+(\S+)$", printed, re.M)}
    assert final["SGD, lr 2.4 (× 8) from step 0"] == "nan", printed
    warm = float(final["SGD, lr 2.4 (× 8), 15 warm-up steps"])  # "warm-up rescues it": finite, below a uniform guess
    assert math.isfinite(warm) and warm < math.log(32), printed
    assert float(final["LARS, lr 1, η 0.01, 5 warm-up steps"]) < float(final["SGD, lr 0.3 (not scaled)"]), printed
    assert float(final["1 rank, batch 8"]) < float(final["LARS, lr 1, η 0.01, 5 warm-up steps"]), printed


@pytest.mark.slow
def test_planner_ranks_the_measured_runs_and_finds_gpt3s_tensor_parallelism(executed):
    nb = executed[0]
    printed = output_of(nb, "_pred = [step_time(_bench_model")
    rho = float(re.search(r"Spearman rank correlation (-?\d\.\d+)", printed).group(1))
    assert rho >= 0.7, printed
    assert "dp=2    tp=2   pp=2" in printed and "dp=8    tp=1   pp=1" in printed and "dp=1    tp=8   pp=1" in printed
    gpt3 = output_of(nb, "plans1024 = plan_parallelism(")
    assert "GPT-3 (175.2 B parameters) on 1024 GPUs" in gpt3, gpt3
    best = re.search(r"plans fit\n\s+dp=(\d+)\s+tp=(\d+)\s+pp=(\d+)", gpt3)
    assert best and int(best.group(2)) == 8, gpt3  # the published 8-way tensor parallelism, inside a node
    assert int(best.group(3)) == 16, gpt3  # and its 16 stages (the text says so)
    worst = float(re.search(r"the largest residual: (\d+\.\d)%", printed).group(1))
    assert worst <= 20, printed  # issue 39: the planner within 20 % of every measured shape


@pytest.mark.slow
def test_scaling_laws_fit_and_check_chinchillas_table(executed):
    nb = executed[0]
    printed = output_of(nb, "_cn, PSI_EXPONENT = fit_power_law")
    exponent = float(re.search(r"Ψ_opt ∝ C\^(-?\d\.\d+)", printed).group(1))
    assert 0 < exponent < 1.5, printed  # bigger budgets, bigger optimal models
    table = output_of(nb, "CHINCHILLA_TABLE = [")
    assert "10T" not in table and len(table.strip().splitlines()) >= 10, table


@pytest.mark.slow
def test_graded_cells_catch_wrong_answers(executed):
    nb, _, _, wrong_at, *_ = executed
    missed = {}
    for (exercise, _, message), at in zip(WRONG, wrong_at):
        printed = text(nb.cells[at])  # a graded cell may print its visible checks' ✅ before failing
        if "FAILED: AssertionError" not in printed or message not in printed.split("FAILED: AssertionError", 1)[1]:
            missed[exercise] = printed[:2000]
    assert not missed, f"graded cells that passed a wrong answer, or failed without saying why: {missed}"


@pytest.mark.slow
def test_lab6_pieces_fall_back_on_the_reference(executed):
    nb, _, _, _, fallback_at, *_ = executed
    (missing, blank) = ast.literal_eval(text(nb.cells[fallback_at]).splitlines()[-1])
    names = ["ColumnParallelLinear", "RowParallelLinear", "TensorParallelMLP", "f", "g"]
    assert missing[:2] == blank[:2] == (names, "<run_path>"), (missing, blank)  # data/reference_pieces.py's
    assert missing[2].startswith("the kit's reference pieces (data/reference_pieces.py): no Lab 6 notebook at"), missing
    assert (
        blank[2].startswith(
            "the kit's reference pieces (data/reference_pieces.py): your Lab 6 pieces did not run (RankError"
        )
        and "NotImplementedError" in blank[2]
    ), blank


@pytest.mark.slow
def test_a_correct_grid_built_another_way_passes(executed):
    nb, *_, right_at, _ = executed
    for (exercise, _), at in zip(RIGHT, right_at):
        assert "PASSED" in text(nb.cells[at]).splitlines()[-1], (exercise, text(nb.cells[at])[-2000:])


@pytest.mark.slow
def test_a_later_exercise_keeps_its_points_when_an_earlier_one_fails(executed):
    nb, *_, chain_at = executed
    runs = [(graded, passes) for _, graded_cells_run in CHAIN for graded, passes in graded_cells_run]
    wrong = {}
    for (graded, passes), at in zip(runs, chain_at):
        last = text(nb.cells[at]).strip().splitlines()[-1] if text(nb.cells[at]).strip() else ""
        if passes != (last == "PASSED"):
            wrong[f"{graded} at cell {at}"] = text(nb.cells[at])[-1500:]
    assert not wrong, f"graded cells that should {'pass' if passes else 'fail'}: {wrong}"


# ----------------------------------------------------------------------------------------
# A submission whose grid_groups spins, autograded as `disttrain-lab grade` does it (slow)

# a student's endless loop; it sleeps rather than spins: what the test is about is the time the grader waits
# for it (one cell's limit), and spinning ranks would only take the cores from the rest of the suite (#35)
SPINS = """
def grid_groups(dp: int, tp: int, pp: int) -> Grid:
    while True:          # a student's infinite loop
        __import__("time").sleep(0.05)
"""


@pytest.fixture(scope="module")
def spinning(tmp_path_factory):
    """Lab 8 autograded with a grid_groups that spins: the scores, the autograded notebook, and each
    cell's seconds (the grader's notes)."""
    lab = LAB.parent.name
    course = Course(tmp_path_factory.mktemp("spins"), lab, REPO / "solutions", None)
    course.do_release()
    submit(course.course, "spins", lab, with_solution(course.solution, "ex_grid_groups", SPINS))
    course.results = course.grade(["spins"], feedback=False)  # (its page is not read: an nbgrader process less)
    course.table = grading.scores(lab, course.course)
    course.nb = course.autograded("spins")
    notes = course.course / "autograded" / "spins" / lab / NOTES_FILE
    notes = json.loads(notes.read_text())
    course.seconds = notes["cell_seconds"]
    course.limits = cell_times.limits_for(lab, notes["cell_limit_factor"])  # (as this host stretched them)
    return course


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_spinning_grid_costs_its_own_points_and_one_cells_limit(spinning):
    assert spinning.results["spins"].returncode == 0, spinning.results["spins"].output[-3000:]
    # only grid_groups's points: the later exercises built on it are graded on the grader's grid
    lost = {cell for cell, points in spinning.table["spins"].items() if cell != "total" and points == 0}
    assert lost == {"test_grid_groups"}, spinning.table["spins"]
    # the spin is waited for once: the first cell that calls grid_groups (the self-check of Exercise 1) runs
    # into a time limit, and no other cell does; every later cell that calls it stops at once, saying what
    # happened then (not "did not finish within 120 s": it was not waited for)
    code = [c for c in spinning.nb.cells if c.cell_type == "code"]
    timed_out = ("CellTimeoutError", "KeyboardInterrupt", "LaunchTimeout")  # a cell's limit, or a launch's timeout
    waited = [c for c in code if any(e.startswith(timed_out) for e in errors(c))]
    assert len(waited) == 1 and "_grid_in_rank" in waited[0].source, [cell_times.cell_key(c) for c in waited]
    key = cell_times.cell_key(waited[0])
    limit = spinning.limits.get(key, cell_times.FLOOR)
    assert spinning.seconds[key] <= limit + 15, (key, spinning.seconds[key], limit)
    # ... and it ends with the launcher's own report inside the cell's limit (its timeout capped to what was
    # left of the limit), not with the cell's interrupt
    told = "\n".join(errors(waited[0]))
    assert told.startswith("LaunchTimeout") and "KeyboardInterrupt" not in told and "CellTimeoutError" not in told, told
    assert "running Python code" in told and "→ grid_groups (line" in told, told
    # the launch's timeout is capped to what is left of the cell's limit; on a host loaded enough that the
    # cell's limit (stretched by the host's factor) is longer than the launch's own timeout, that one ends it
    own = re.search(r"within the timeout of (\d+(?:\.\d+)?) s", told)
    assert "time limit when graded" in told or (own and limit >= float(own.group(1))), (limit, told)
    later = [c for c in code if "grid_groups is not run again" in "\n".join(errors(c))]
    keys = [cell_times.cell_key(c) for c in later]
    assert "test_grid_groups" in keys and len(later) >= 3, keys  # and the self-checks of Exercises 3 and 4
    assert all(code.index(c) > code.index(waited[0]) for c in later), keys
    for cell in later:
        told = "\n".join(errors(cell))
        assert "in _grid_in_rank (line" in told and "→ grid_groups (line" in told, told  # where each rank was
        assert "did not finish within 120 s" not in told, told
        assert spinning.seconds[cell_times.cell_key(cell)] < 10, (cell_times.cell_key(cell), spinning.seconds)


@pytest.mark.slow  # (ranks and a packet capture: about half a minute)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_the_calls_of_the_grid_are_read_from_the_wire(monkeypatch):
    """#42: TensorParallelAttention's, PipelineStage3D's and train_3d's calls come from the grader's capture (each
    message's connection and slot: its process group and its call), not from the ranks' trace.  The solution
    passes graded cases with and without a capture; each of the three with one more all-reduce over its TP group,
    hidden from the trace, passes on the trace alone and fails on the wire."""
    import torch
    import torch.distributed as dist

    from disttrain_lab import models, trace
    from tests.helpers import observed_from_outside

    solution, _, _ = _solution_over_lab6(
        monkeypatch, ["grid_groups", "TensorParallelAttention", "PipelineStage3D", "train_3d"]
    )

    def graded_cases():
        lab08.check_attention(4, models.GPTConfig(seq_len=5, d_model=16, n_heads=4), tp=2)
        lab08.check_stage(2, 2, 2, models.GPTConfig(seq_len=5, d_model=16, n_heads=2, n_layers=2))
        lab08.check_3d(2, 2, 1, micro_batches=1, batch=6, steps=2)
        lab08.check_3d(1, 2, 2, micro_batches=3, batch=7, steps=2)

    train_3d = solution["train_3d"]

    def one_more(*args, **kwargs):  # the solution, and an all-reduce over this rank's TP pair, off the trace
        tp_pair = dist.new_subgroups(2)[0]
        with trace.unrecorded():
            dist.all_reduce(torch.zeros(3), group=tp_pair)
        return train_3d(*args, **kwargs)

    class Whispering(solution["TensorParallelAttention"]):  # the solution, and 8 B more in its group, off the trace
        def forward(self, x):
            with trace.unrecorded():
                dist.all_reduce(torch.zeros(2), group=self.group)
            return super().forward(x)

    class Stage(solution["PipelineStage3D"]):  # the solution, and 8 B more in its TP group, off the trace
        def forward(self, x):
            with trace.unrecorded():
                dist.all_reduce(torch.zeros(2), group=next(iter(self.blocks.values())).attn.group)
            return super().forward(x)

    small = models.GPTConfig(seq_len=5, d_model=16, n_heads=2, n_layers=2)
    forged = {
        "TensorParallelAttention": (
            Whispering,
            lambda: lab08.check_attention(4, models.GPTConfig(seq_len=5, d_model=16, n_heads=4), tp=2),
        ),
        "PipelineStage3D": (Stage, lambda: lab08.check_stage(1, 2, 2, small)),
        "train_3d": (one_more, lambda: lab08.check_3d(2, 2, 1, micro_batches=1, batch=6, steps=2)),
    }
    graded_cases()
    caught = {}
    with observed_from_outside():
        graded_cases()
        for name, (forgery, check) in forged.items():
            monkeypatch.setattr(f"__main__.{name}", forgery)
            with pytest.raises(AssertionError) as caught[name]:
                check()
            monkeypatch.setattr(f"__main__.{name}", solution[name])
    for name, (forgery, check) in forged.items():  # (the student's own kernel: the trace, fooled)
        monkeypatch.setattr(f"__main__.{name}", forgery)
        check()
        monkeypatch.setattr(f"__main__.{name}", solution[name])
    said = str(caught["TensorParallelAttention"].value)
    assert (
        "one all-reduce forward (g's), one backward (f's): ranks (0, 1) should make exactly all-reduce of 960 B, "
        in said
    ), said
    assert (
        "the grader's capture of the wire shows all-reduce of 8 B, all-reduce of 960 B, all-reduce of 960 B" in said
    ), said
    said = str(caught["PipelineStage3D"].value)
    assert (
        "g of attention and MLP in each block: ranks (0, 1) should make exactly all-reduce of 640 B, all-reduce of 640 B among"
        in said
    ), said
    assert (
        "the grader's capture of the wire shows all-reduce of 8 B, all-reduce of 640 B, all-reduce of 640 B" in said
    ), said
    said = str(caught["train_3d"].value)
    assert "over its TP group" in said and "the grader's capture of the wire shows" in said, said


def _grid_made_up(dp, tp, pp):
    """A forged grid_groups: Megatron's ranks computed, no process group made.  Each "group" is an object of its own
    that torch's all_reduce calls (``group.allreduce``: duck-typed) and that torch's table of groups maps to the
    right ranks (``get_process_group_ranks`` reads it): its all-reduce writes the right sum and all-reduces zeros
    over the world, so that the wire is not silent.  No function of torch's is replaced."""
    import types

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    rank = dist.get_rank()
    tp_rank, dp_rank, pp_rank = rank % tp, rank // tp % dp, rank // (tp * dp)

    class MadeUp:
        def __init__(self, ranks):
            self.ranks = ranks
            _world.pg_group_ranks[self] = {r: i for i, r in enumerate(ranks)}

        def allreduce(self, tensors, opts):
            dist.all_reduce(torch.zeros_like(tensors[0]))
            tensors[0].copy_(torch.tensor([float(len(self.ranks)), float(sum(self.ranks))]))

    return types.SimpleNamespace(
        tp_rank=tp_rank,
        dp_rank=dp_rank,
        pp_rank=pp_rank,
        tp_group=MadeUp([(pp_rank * dp + dp_rank) * tp + t for t in range(tp)]),
        dp_group=MadeUp([(pp_rank * dp + d) * tp + tp_rank for d in range(dp)]),
        prev_rank=rank - dp * tp if pp_rank > 0 else None,
        next_rank=rank + dp * tp if pp_rank < pp - 1 else None,
        dp=dp,
        tp=tp,
        pp=pp,
    )


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_groups_made_up_with_their_sums_fail_on_the_wire(monkeypatch):
    """#42: grid_groups' groups are graded on the wire: each TP and DP group's all-reduce of (1, rank) among exactly
    its ranks, its messages pieces of those sums.  The solution passes with a capture; a grid_groups that makes no
    group and fakes the members and sums in its ranks passes in the student's own kernel and fails on the wire."""
    from tests.helpers import observed_from_outside

    solution, _, _ = _solution_over_lab6(monkeypatch, ["grid_groups"])
    with observed_from_outside():
        for sizes in ((2, 2, 1), (1, 2, 4), (4, 1, 2), (3, 2, 1)):  # (the graded cell's)
            lab08.check_grid(*sizes)
        monkeypatch.setattr("__main__.grid_groups", _grid_made_up)
        with pytest.raises(AssertionError) as caught:
            lab08.check_grid(2, 2, 1)
    lab08.check_grid(2, 2, 1)  # (the student's own kernel: the ranks' word, fooled)
    said = str(caught.value)
    assert (
        "the DP group of ranks (0, 2) should all-reduce the driver's (1, rank), 8 B, among exactly its ranks" in said
    ), said


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
@pytest.mark.parametrize("relayed", ["g", "f"])
def test_attention_summing_through_the_store_fails_on_the_wires_content(monkeypatch, relayed):
    """The solution's TensorParallelAttention whose g (or f) sums the ranks' data through the launcher's store while
    its all-reduce sums zeros of the same size: values, calls and bytes right, and it passes in the student's own
    kernel; under the grader's capture no message of that all-reduce holds a piece of a sum of the ranks' partial
    outputs (input gradients), and it fails; so does PipelineStage3D built on it (g: its forward's all-reduces in
    each block, attention's and the MLP's).  The solution passes with the capture."""

    from disttrain_lab import models
    from tests.helpers import observed_from_outside, relayed_f_and_g

    _, names, lab6 = _solution_over_lab6(monkeypatch, ["grid_groups", "TensorParallelAttention", "PipelineStage3D"])

    F, G = relayed_f_and_g()

    def check():
        lab08.check_attention(4, models.GPTConfig(seq_len=5, d_model=16, n_heads=4), tp=2)

    def check_stage():
        lab08.check_stage(1, 2, 2, models.GPTConfig(seq_len=5, d_model=16, n_heads=2, n_layers=2))

    with observed_from_outside():
        check()
        check_stage()
        for space in (names, lab6["TensorParallelMLP"].forward.__globals__):  # (the attention's and the MLP's)
            monkeypatch.setitem(space, relayed, G.apply if relayed == "g" else F.apply)
        with pytest.raises(AssertionError) as failed:
            check()
        if relayed == "g":  # (the stage's check runs forward only: g's all-reduces)
            with pytest.raises(AssertionError) as stage:
                check_stage()
    check()  # (the student's own kernel: values and the trace's calls)
    said = str(failed.value)
    step = "the forward's all-reduce (g)" if relayed == "g" else "the backward's all-reduce (f)"
    assert step in said and "What a rank all-reduces must be the data itself" in said, said
    if relayed == "g":
        check_stage()
        said = str(stage.value)
        assert "g of a block's attention, each rank's partial output over ranks" in said, said


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_train_3d_averaging_through_the_store_fails_on_the_wires_content(monkeypatch):
    """train_3d's data-parallel all-reduce must carry each rank's own gradients (the grader's training in one
    process: its stage's slices on its shard): the solution passes with the capture; the solution averaging through
    the launcher's store, its all-reduce summing zeros of the same size, trains right with the right calls and
    bytes, passes in the student's own kernel, and fails on the wire's content."""
    from disttrain_lab import models
    from tests.helpers import observed_from_outside

    _, space, _ = _solution_over_lab6(
        monkeypatch, ["grid_groups", "TensorParallelAttention", "PipelineStage3D", "train_3d"]
    )
    code = next(c.source for c in load(LAB).cells if "def train_3d" in c.source)
    code = code[code.index("def train_3d") :]
    honest = "            dist.all_reduce(flat, group=grid.dp_group)\n"
    assert honest in code, code
    relay = (
        "            dist.all_reduce(torch.zeros_like(flat), group=grid.dp_group)\n"
        "            from tests.helpers import through_the_store\n"
        "            flat.copy_(sum(through_the_store(flat.clone(), 'dp3', among=dist.get_process_group_ranks(grid.dp_group))))\n"
    )
    forged: dict = dict(space)
    exec(code.replace(honest, relay), forged)
    small = models.GPTConfig(vocab=32, seq_len=4, d_model=8, n_heads=2, n_layers=2)  # (the lab's tokens: 32)
    check = lambda: lab08.check_3d(2, 1, 1, micro_batches=1, cfg=small, batch=4, steps=2)  # noqa: E731
    with observed_from_outside():
        check()
        monkeypatch.setattr("__main__.train_3d", forged["train_3d"])  # (defined among the notebook's names)
        with pytest.raises(AssertionError) as relayed:
            check()
    check()  # (the student's own kernel: values, the trace's calls and bytes)
    said = str(relayed.value)
    assert "all-reduces with ranks (0, 1) should carry each of its own gradients" in said, said


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
@pytest.mark.parametrize("relayed", ["g", "f"])
def test_train_3d_summing_through_the_store_fails_on_the_wires_content(monkeypatch, relayed):
    """train_3d's all-reduces in each TP group must carry each rank's partial outputs of every block's attention and
    MLP on every micro-batch (g, forward) and its partial input gradients (f, backward), the grader's dense GPT along
    the single-process training: the solution passes with the capture, uneven micro-batches too; with g (or f)
    summing through the launcher's store and all-reducing zeros of the same size, it trains right with the right
    calls and bytes, passes in the student's own kernel, and fails on the wire's content."""
    from disttrain_lab import models
    from tests.helpers import observed_from_outside, relayed_f_and_g

    _, names, lab6 = _solution_over_lab6(
        monkeypatch, ["grid_groups", "TensorParallelAttention", "PipelineStage3D", "train_3d"]
    )
    F, G = relayed_f_and_g()
    small = models.GPTConfig(vocab=32, seq_len=4, d_model=8, n_heads=2, n_layers=2)  # (the lab's tokens: 32)
    check = lambda: lab08.check_3d(1, 2, 2, micro_batches=3, cfg=small, batch=7, steps=2)  # noqa: E731
    with observed_from_outside():
        check()
        lab08.check_3d(2, 2, 1, micro_batches=1, cfg=small, batch=6, steps=2)
        for space in (names, lab6["TensorParallelMLP"].forward.__globals__):  # (the attention's and the MLP's)
            monkeypatch.setitem(space, relayed, G.apply if relayed == "g" else F.apply)
        with pytest.raises(AssertionError) as failed:
            check()
    check()  # (the student's own kernel: values, the trace's calls and bytes)
    said = str(failed.value)
    assert "should all-reduce each rank's partial output of every block's attention and MLP" in said, said
    missing = "g of block 0's attention on micro-batch 0" if relayed == "g" else "f of block 0's attention on micro"
    assert f"no all-reduce of theirs at that step carried the {missing}" in said, said


def _relayed_stage_messages(code: str, which: str) -> str:
    """train_3d's code with the stages' activations (``which``: "activations"), their gradients ("gradients") or
    both ("both") passed through the launcher's store, zeros of the same size sent in their place: the receiver
    takes the real tensor from the store after its recv."""
    put = (
        "{pad}_st, _src, _dst = dist.distributed_c10d._get_default_store(), dist.get_rank(), {dst}\n"
        "{pad}_st.set(f'{tag}/{{_src}}/{{_dst}}/{{_st.add(f\"{tag}s/{{_src}}/{{_dst}}\", 1)}}', "
        "{tensor}.detach().contiguous().numpy().tobytes())\n"
        "{pad}sends.append(dist.isend(torch.zeros_like({tensor}), dst={dst}))\n"
    )
    take = (
        "{pad}dist.recv({into}, src={src})\n"
        "{pad}_st, _src, _dst = dist.distributed_c10d._get_default_store(), {src}, dist.get_rank()\n"
        "{pad}_got = _st.get(f'{tag}/{{_src}}/{{_dst}}/{{_st.add(f\"{tag}r/{{_src}}/{{_dst}}\", 1)}}')\n"
        "{pad}{into}.copy_(torch.frombuffer(bytearray(_got), dtype=torch.float32).view_as({into}))\n"
    )
    pad = " " * 16
    edits = {
        "activations": [
            (
                pad + "sends.append(dist.isend(outputs.detach(), dst=grid.next_rank))\n",
                put.format(pad=pad, tag="act", dst="grid.next_rank", tensor="outputs"),
            ),
            (
                pad + "dist.recv(inputs, src=grid.prev_rank)\n",
                take.format(pad=pad, tag="act", src="grid.prev_rank", into="inputs"),
            ),
        ],
        "gradients": [
            (
                pad + "sends.append(dist.isend(inputs.grad, dst=grid.prev_rank))\n",
                put.format(pad=pad, tag="grad", dst="grid.prev_rank", tensor="inputs.grad"),
            ),
            (
                pad + "dist.recv(grad, src=grid.next_rank)\n",
                take.format(pad=pad, tag="grad", src="grid.next_rank", into="grad"),
            ),
        ],
    }
    for honest, relay in edits["activations"] * (which != "gradients") + edits["gradients"] * (which != "activations"):
        assert honest in code, code
        code = code.replace(honest, relay)
    return code


@pytest.mark.slow  # (ranks and a packet capture: under a minute)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
@pytest.mark.parametrize("which", ["both", "gradients"])
def test_train_3d_sending_between_stages_through_the_store_fails_on_the_wires_content(monkeypatch, which):
    """train_3d's point-to-point messages between stages must carry each micro-batch's activation (the dense GPT's
    output of the stage's last block, the grader's single-process training) and, back, the gradient of the loss
    with respect to it: the solution passes with the capture (TP inside the stages, uneven micro-batches, two DP
    replicas); with the activations and their gradients (or the gradients alone) passed through the launcher's
    store and zeros of the same size sent in their place, it trains right with the right calls and bytes, passes in
    the student's own kernel and, the stage messages' content unread, under the capture too; read, it fails."""
    from disttrain_lab import models
    from disttrain_lab.labtests.lab08 import three_d
    from tests.helpers import observed_from_outside

    _, space, _ = _solution_over_lab6(
        monkeypatch, ["grid_groups", "TensorParallelAttention", "PipelineStage3D", "train_3d"]
    )
    code = next(c.source for c in load(LAB).cells if "def train_3d" in c.source)
    forged: dict = dict(space)
    exec(_relayed_stage_messages(code[code.index("def train_3d") :], which), forged)
    small = models.GPTConfig(vocab=32, seq_len=4, d_model=8, n_heads=2, n_layers=2)  # (the lab's tokens: 32)
    check = lambda: lab08.check_3d(1, 2, 2, micro_batches=3, cfg=small, batch=7, steps=2)  # noqa: E731
    read = three_d._stage_messages_on_the_wire
    with observed_from_outside():
        check()
        lab08.check_3d(2, 1, 2, micro_batches=2, cfg=small, batch=8, steps=2)
        monkeypatch.setattr("__main__.train_3d", forged["train_3d"])  # (defined among the notebook's names)
        monkeypatch.setattr(three_d, "_stage_messages_on_the_wire", lambda *args: None)
        check()  # (the gap: unread, the stages' messages were only counted and sized)
        monkeypatch.setattr(three_d, "_stage_messages_on_the_wire", read)
        with pytest.raises(AssertionError) as relayed:
            check()
    check()  # (the student's own kernel: values, the trace's calls and bytes)
    said = str(relayed.value)
    what = "activation (stage 0's output)" if which == "both" else "gradient of the loss with respect to the activ"
    assert f"to rank {2 if which == 'both' else 0} should hold the {what}" in said, said
    assert "values in [0, 0]" in said and "What a stage sends must be the data itself" in said, said


def _hidden_functions(grade_id: str, names: list[str], space: dict) -> None:
    """The functions ``names`` of the cell ``grade_id`` (a graded cell's hidden tests' too), defined in ``space``
    with their source kept (a stand-in crosses as its source)."""
    import linecache

    source = cell_by_id(load(LAB), grade_id).source
    found = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name in names]
    code = "\n\n".join(ast.get_source_segment(source, n) for n in found) + "\n"
    filename = f"<hidden tests of {grade_id}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    exec(compile(code, filename, "exec"), space)


@pytest.mark.slow  # (the planner's drivers in this process, one rank each: under a minute)
def test_the_planners_step_time_stand_in_earns_step_time_nothing(monkeypatch):
    """plan_parallelism graded on the grader's step_time where yours is wrong (issue item "borrowed pieces earn
    nothing"): what crosses to the kernel is a table of the formula's ranks for the plans of each case, no formula.
    The solution's plan_parallelism passes its cases on it with a wrong step_time; the stand-in captured from the
    kernel (as the driver's source in linecache) and handed in as step_time, as it is or rescaled, fails
    step_time's graded checks, where the old stand-in (1.5 times the formula) divided by 1.5 passed them."""
    import linecache
    from dataclasses import replace

    import __main__
    from disttrain_lab import exercise
    from disttrain_lab.labtests.lab08 import common
    from tests.helpers import notebook_names

    names = ["ModelSpec", "ClusterSpec", "Plan", "a100_cluster", "memory_per_device", "step_time"]
    solution = bench.functions_from_notebook(LAB, [*names, "plan_parallelism"], given=True)
    space = solution["plan_parallelism"].__globals__
    monkeypatch.setitem(space, "__name__", "__main__")  # (a notebook's names: the driver puts stand-ins there)
    _hidden_functions("planner_measured_helpers", ["bench_specs"], space)
    _hidden_functions("test_planner_plans", ["_graders_planner"], space)
    _hidden_functions("test_planner_memory", ["_ref_memory"], space)
    _hidden_functions("test_planner_step_time", ["_ref_step"], space)
    notebook_names(monkeypatch, space)
    monkeypatch.setitem(common.GRADERS, "planner", space["_graders_planner"])
    monkeypatch.setitem(common.PASSED, "planner_memory", True)
    Plan, ModelSpec, a100 = space["Plan"], space["ModelSpec"], space["a100_cluster"]
    example = ModelSpec(layers=24, hidden=2048, heads=16, seq=2048, batch=512, vocab=50304)  # the graded cells'
    big = ModelSpec(layers=40, hidden=5120, heads=40, seq=2048, batch=256, vocab=50304)
    cluster16 = a100(16)
    bench_model, bench_cluster = space["bench_specs"](lab08.MEASURED)
    measured = [Plan(r["dp"], r["tp"], r["pp"], r["micro_batches"], r["zero"]) for r in lab08.MEASURED["runs"]]
    step_cases = [(bench_model, bench_cluster, p) for p in measured] + [
        (example, cluster16, Plan(*fields)) for fields in ((16, 1, 1, 4, 1), (2, 8, 1, 4, 0), (1, 16, 1, 4, 0))
    ]
    step_cases += [(example, cluster16, Plan(*fields)) for fields in ((4, 2, 2, 8, 3), (1, 2, 8, 16, 0))]

    def step_time_earns(fn) -> bool:
        """Whether ``fn`` handed in as step_time passes step_time's graded checks (the ranking, then the formula)."""
        monkeypatch.setattr(__main__, "step_time", fn)
        try:
            lab08.check_step_time_ranking(bench_model, bench_cluster, measured)
            for model, cluster, plan in step_cases:
                lab08.check_step_time(model, cluster, plan, reference=space["_ref_step"])
        except (AssertionError, exercise.ExerciseError):
            return False
        return True

    old = space["_graders_planner"](["step_time"])["step_time"]  # (what used to cross: the formula, times 1.5)
    assert step_time_earns(lambda model, cluster, plan: old(model, cluster, plan) / 1.5)
    assert step_time_earns(solution["step_time"])

    # a wrong step_time (no bubble: its ranking passes, its formula not): plan_parallelism on the grader's
    wrong = lambda model, cluster, plan: solution["step_time"](model, cluster, plan) / plan.pp  # noqa: E731
    monkeypatch.setattr(__main__, "step_time", wrong)
    assert lab08.choose_planner_graders(example, cluster16, Plan(16, 1, 1, 4, 1)) == ["step_time"]
    small = lab08.check_plans(example, a100(8), "1.4 B on one node of 8", reference=space["_ref_memory"])
    assert (small[0].dp, small[0].tp, small[0].pp) == (8, 1, 1), small[0]
    plans = lab08.check_plans(big, a100(32), "12.9 B on 32 devices", reference=space["_ref_memory"])
    assert plans[0].tp <= 8, plans[0]
    lab08.check_plans(example, cluster16, "1.4 B on 2 nodes of 8", reference=space["_ref_memory"])
    shipped = "".join(linecache.cache["<test driver _plans_of>"][2])  # (captured: the last case's, 1.4 B on 16)
    assert "collective_time" not in shipped and "flops" not in shipped, shipped[:2000]
    captured: dict = {}
    exec(shipped, captured)
    stand_in = captured["_graders_planner"](["step_time"])["step_time"]

    # handed in as step_time, as it is, divided by 1.5, or scaled to the formula on one plan of its own table
    scale = space["_ref_step"](example, cluster16.network, cluster16.flops, Plan(16, 1, 1, 4, 1)) / stand_in(
        example, cluster16, Plan(16, 1, 1, 4, 1)
    )
    for factor in (1.0, 1 / 1.5, scale):
        assert not step_time_earns(lambda model, cluster, plan, k=factor: k * stand_in(model, cluster, plan))
    monkeypatch.setattr(__main__, "step_time", lambda model, cluster, plan: scale * stand_in(model, cluster, plan))
    lab08.check_step_time(example, cluster16, Plan(16, 1, 1, 4, 1), reference=space["_ref_step"])  # (its anchor)
    with pytest.raises(AssertionError) as off:  # (on its own table's model and cluster, another plan)
        lab08.check_step_time(example, cluster16, Plan(2, 8, 1, 4, 0), reference=space["_ref_step"])
    assert "step_time(dp=2    tp=8   pp=1   m=4    zero=0) on nodes of 8 ranks" in str(off.value), off.value
    ratios = {
        fields: stand_in(example, cluster16, Plan(*fields))
        / space["_ref_step"](example, cluster16.network, cluster16.flops, Plan(*fields))
        for fields in ((16, 1, 1, 4, 1), (2, 8, 1, 4, 0), (1, 16, 1, 4, 0), (4, 2, 2, 8, 3), (1, 2, 8, 16, 0))
    }
    assert max(ratios.values()) > 1.5 * min(ratios.values()), ratios  # (no one factor makes it the formula)

    # memory_per_device failed too: the grader's memory formula crosses, and still no step time
    monkeypatch.setitem(common.PASSED, "planner_memory", False)
    monkeypatch.setattr(__main__, "memory_per_device", lambda *args, **kwargs: 0.0)
    assert lab08.choose_planner_graders(example, cluster16, Plan(16, 1, 1, 4, 1)) == ["memory_per_device", "step_time"]
    lab08.check_plans(big, replace(a100(32), memory=16e9), "12.9 B on 16 GB", sp=True, reference=space["_ref_memory"])
    shipped = "".join(linecache.cache["<test driver _plans_of>"][2])
    assert "def memory_per_device" in shipped and "collective_time" not in shipped, shipped[:2000]
