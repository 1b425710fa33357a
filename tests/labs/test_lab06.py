"""Lab 6 (tensor parallelism): the solution notebook runs, its graded tests can fail, and the
tensor-parallel bench harness works.

- The solution notebook executes top to bottom in a real kernel as the grader runs it
  (NBGRADER_EXECUTION set), within the 4-minute budget, every graded cell passing, with its
  weight-slice picture, forward/backward timeline and bench table.
- The blank notebook (solutions cleared the way nbgrader releases it) fails every graded
  cell, quickly.  Wrong answers (f and g swapped, an all-reduce between the two linears, a
  row-parallel layer that adds the bias on every rank, a layer that keeps views of the full
  weight, 2D training that uses the world group for tensor parallelism) fail the right graded
  cell with a message that says why.  train_2d is graded on its own: with a broken
  TensorParallelMLP the grader trains with its own (hidden) one.
- viz.weight_slices, and bench.bench_tp / format_tp_table / `disttrain-lab bench tp`, on the
  solution's class.

The notebook helpers come from tests/notebooks.py; the autograde round trip lives in test_grading.py.
"""

from __future__ import annotations

import copy

import nbformat
import pytest
import torch

from disttrain_lab import bench, viz, wire
from disttrain_lab.exercise import ExerciseError
from disttrain_lab.labtests import common, lab06
from tests import benchreport
from tests.helpers import gpu_count, needs_gpus, source_of
from tests.notebooks import (
    add_wrong_answers,
    assert_prediction_verdicts,
    assert_wrong_answers_caught,
    cell_by_id,
    errors,
    execute,
    load,
    output_of,
    prediction_cells_problems,
    run_solution,
    solution_notebook,
    text,
)

LAB = solution_notebook("06_tensor_parallel")
BUDGET_S = 240  # the issue's budget for the whole solution notebook on 2 cores
EXERCISES = {
    "parallel_linear": "class ColumnParallelLinear(",
    "f_and_g": "class CopyToTensorParallel(",
    "tp_mlp": "class TensorParallelMLP(",
    "2d": "def train_2d(",
}
# The graded predictions: (grade id, the right one-line function, wrong ones a student may write)
PREDICTIONS = {
    "predict_parameters": (
        lambda rank, d, h, t: 2 * d * h // t + h // t + (d if rank == 0 else 0),
        [
            lambda rank, d, h, t: 2 * d * h // t + h // t + d,  # the row bias on every rank
            lambda rank, d, h, t: (2 * d * h + h + d) // t,  # everything split t ways
            lambda rank, d, h, t: 2 * d * h // t,  # the weights only
        ],
    ),
    "predict_allreduce_bytes": (
        lambda B, d, h, t: 8 * B * d,
        [
            lambda B, d, h, t: 4 * B * d,  # forward only (g), not f's backward
            lambda B, d, h, t: 8 * B * h // t,  # the hidden activation
            lambda B, d, h, t: 2 * 2 * (t - 1) / t * 4 * B * d,  # what a ring sends, not the payload
        ],
    ),
}


# ----------------------------------------------------------------------------------------
# The notebook's structure (fast)


def test_hidden_tests_cover_the_issue():
    # N = 2, 3 and 4; groups inside the world; sizes that do not divide by N raise ValueError
    nb = load(LAB)
    hidden = "".join(
        part.split("### END HIDDEN TESTS")[0]
        for e in EXERCISES
        for part in cell_by_id(nb, f"test_{e}").source.split("### BEGIN HIDDEN TESTS")[1:]
    )
    for needle in (
        "check_tp_mlp(4,",
        "tp_size=2)",
        "check_tp_mlp(3,",
        "check_2d(_train_2d, 4, 4",
        "check_2d(_train_2d, 4, 1",
        "check_mlp_not_divisible(4, [4, 6, 4])",
        "bias=False",
    ):
        assert needle in hidden, needle
    # the tests are the kit's (disttrain_lab/labtests/lab06/): only the word the exercise asks for
    # ("divisible") is matched, so that torch's own errors do not pass
    helpers = source_of(lab06)
    assert 'common.rank_raised(e, "ValueError", "divisible", loose=True)' in helpers
    said = lambda exc_type, message: common.rank_raised(
        ExerciseError("", exc_type, message), "ValueError", "divisible", loose=True
    )
    assert said("ValueError", "out_features=10 is not Divisible by 4") and not said("RuntimeError", "not divisible")
    assert not said("ValueError", "10 does not divide by 4")
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "**not divisible**" in text and "not **divisible**" in text


def test_groups_and_errors_are_exercised_visibly():
    # every requirement a hidden case checks is exercised at least once where the student sees it
    nb = load(LAB)
    visible = "\n".join(c.source.split("### BEGIN HIDDEN TESTS")[0] for c in nb.cells if c.cell_type == "code")
    assert visible.count("dist.new_subgroups(") >= 3, "groups in the self-checks of exercises 1-3"
    assert "ColumnParallelLinear(nn.Linear(4, 5))" in visible and "parallel_groups(3)" in visible
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert text.index("**Process groups.**") < text.index("### Exercise 1")


def test_predictions_self_checks_hold_no_answer():
    # each self-check checks the form at graded cases; it holds no answer (nor any digest of one)
    assert prediction_cells_problems(load(LAB), PREDICTIONS) == []


@pytest.mark.parametrize("grade_id", list(PREDICTIONS))
def test_graded_prediction_passes_the_right_formula_and_fails_wrong_ones(grade_id):
    assert_prediction_verdicts(load(LAB), grade_id, *PREDICTIONS[grade_id])


# ----------------------------------------------------------------------------------------
# Executing it (slow)


@pytest.mark.slow
def test_solution_notebook_executes_within_budget():
    nb = run_solution(LAB, BUDGET_S)
    table = output_of(nb, "bench.format_tp_table(rows)")
    for line in (" 1 TensorParallelMLP", " 2 TensorParallelMLP", " 4 TensorParallelMLP", f" 4 {bench.TORCH_TP}"):
        assert line in table, table
    assert "not measured" not in table, table
    drawn = " ".join(
        c.source for c in nb.cells if c.cell_type == "code" and any("image/png" in o.get("data", {}) for o in c.outputs)
    )
    assert "dl.viz.weight_slices(" in drawn and "dl.viz.timeline(" in drawn, (
        "expected the slice picture and the timeline"
    )


# Wrong answers the graded tests must catch: (graded cell, wrong solution, words the failure must contain)
WRONG = [
    (
        "parallel_linear",
        """
class RowParallelLinear(nn.Module):           # every rank adds the bias: the all-reduce sums it in N times
    def __init__(self, full, group=None):
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        part = full.in_features // size
        self.weight = nn.Parameter(full.weight.detach()[:, rank * part:(rank + 1) * part].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x_part):
        return F.linear(x_part, self.weight, self.bias)
""",
        "the bias must be added exactly once",
    ),
    (
        "parallel_linear",
        """
class ColumnParallelLinear(nn.Module):        # views into the full weight: nothing saved
    def __init__(self, full, group=None):
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        part = full.out_features // size
        self.weight = nn.Parameter(full.weight.detach()[rank * part:(rank + 1) * part])
        self.bias = nn.Parameter(full.bias.detach()[rank * part:(rank + 1) * part])

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)
""",
        "not a view into the full weight",
    ),
    (
        "f_and_g",
        """
class CopyToTensorParallel(ReduceFromTensorParallel):   # f and g swapped
    pass

class ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
""",
        "did you swap f and g?",
    ),
    (
        "tp_mlp",
        """
class TensorParallelMLP(nn.Module):           # gathers the hidden activations: communication between the linears
    def __init__(self, dense, group=None):
        super().__init__()
        self.group = group
        self.column = ColumnParallelLinear(dense[0], group)
        self.row = RowParallelLinear(dense[2], group)

    def forward(self, x):
        hidden = F.gelu(self.column(f(x, self.group)))
        hidden = g(hidden, self.group) / dist.get_world_size(self.group)
        return g(self.row(hidden), self.group)
""",
        "none between the two layers",
    ),
    (
        "2d",
        """
def train_2d(dense, batches, tp_size, lr):   # tensor parallelism over the world group (and so no DP group)
    model = TensorParallelMLP(dense)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return model
""",
        "must stay inside its TP group (0, 1)",
    ),
]


@pytest.mark.slow
def test_graded_cells_catch_wrong_answers():
    """One kernel: for each wrong answer (a bias on every rank, views kept, f and g swapped, an all-reduce
    between the linears, the world group for TP), the solutions, the wrong definition, then its graded cell."""
    lab = load(LAB)
    solutions = [cell_by_id(lab, f"ex_{e}") for e in EXERCISES]
    cells = [copy.deepcopy(c) for c in (lab.cells[0], *solutions, cell_by_id(lab, "test_helpers"))]
    graded_at = add_wrong_answers(lab, cells, solutions, [(exercise, wrong) for exercise, wrong, _ in WRONG])
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, timeout=240, cwd=LAB.parent)
    assert_wrong_answers_caught(nb, graded_at, [message for _, _, message in WRONG])


@pytest.mark.slow
def test_train_2d_is_graded_on_its_own():
    # a TensorParallelMLP without g fails exercise 3; the grader grades the correct train_2d with its own MLP
    lab = load(LAB)
    broken = cell_by_id(lab, "ex_tp_mlp").source.replace(
        "        return g(self.row(hidden), self.group)", "        return self.row(hidden)"
    )
    assert broken != cell_by_id(lab, "ex_tp_mlp").source
    cells = [
        copy.deepcopy(c)
        for c in (
            lab.cells[0],
            cell_by_id(lab, "ex_parallel_linear"),
            cell_by_id(lab, "ex_f_and_g"),
            cell_by_id(lab, "ex_2d"),
            cell_by_id(lab, "test_helpers"),
            cell_by_id(lab, "test_tp_mlp"),
            cell_by_id(lab, "test_2d"),
        )
    ]
    cells.insert(3, nbformat.v4.new_code_cell(broken))
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, cwd=LAB.parent)
    assert errors(nb.cells[-2]), "exercise 3's graded cell should fail without g"
    assert not errors(nb.cells[-1]), errors(nb.cells[-1])
    assert "\N{WHITE HEAVY CHECK MARK}" in text(nb.cells[-1]), text(nb.cells[-1])


@pytest.mark.slow
def test_a_wrong_layer_costs_the_tensor_parallel_mlp_nothing():
    # #41: TensorParallelMLP is built on exercise 1's layers; a RowParallelLinear that adds the bias on every rank
    # fails exercise 1, and exercise 3, graded with the grader's stand-in layers in their place, keeps its points
    # (f and g, which passed, are the student's own)
    lab = load(LAB)
    wrong = next(source for exercise, source, _ in WRONG if exercise == "parallel_linear")
    cells = [copy.deepcopy(c) for c in (lab.cells[0], *(cell_by_id(lab, f"ex_{e}") for e in EXERCISES))]
    cells += [nbformat.v4.new_code_cell(wrong), copy.deepcopy(cell_by_id(lab, "test_helpers"))]
    cells += [copy.deepcopy(cell_by_id(lab, f"test_{e}")) for e in ("parallel_linear", "f_and_g", "tp_mlp")]
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, cwd=LAB.parent)
    linear, f_and_g, mlp = nb.cells[-3:]
    assert errors(linear) and "the bias must be added exactly once" in errors(linear)[0], errors(linear)
    assert not errors(f_and_g), errors(f_and_g)
    assert not errors(mlp), errors(mlp)
    said = text(mlp)
    assert "parallel_linear has not passed its graded test" in said and "CopyToTensorParallel" not in said, said


# a ColumnParallelLinear whose slices are right copies, and which keeps the full weight beside them in a list (no
# parameter, no submodule): the storage under its parameters, which its rank reports, is its slices alone
_FULL_WEIGHT_KEPT = """
class ColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, full, group=None):
        super().__init__(full, group)
        self.kept = [full.weight.detach()]
"""


@pytest.mark.slow
def test_a_layer_keeping_the_full_weight_fails_on_the_os_count():
    """#42: "holds only its slices" is graded on each rank's private memory read from the OS at the driver's pause
    (labtests/lab06/held.py): the solution passes, and a column layer that keeps the full weight beside its slices,
    which passes the check on the storage its rank reports, fails on what the OS counts."""
    lab = load(LAB)
    cells = [
        copy.deepcopy(c) for c in (lab.cells[0], cell_by_id(lab, "ex_parallel_linear"), cell_by_id(lab, "test_helpers"))
    ]
    cells += [nbformat.v4.new_code_cell("lab_tests.check_slices_held()"), nbformat.v4.new_code_cell(_FULL_WEIGHT_KEPT)]
    cells += [nbformat.v4.new_code_cell(f"lab_tests.check_parallel_linear({args})") for args in ("2, 4, 6", "4, 8, 12")]
    cells += [nbformat.v4.new_code_cell("lab_tests.check_slices_held()")]
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, cwd=LAB.parent)
    assert all(not errors(c) for c in nb.cells[:-1]), [errors(c) for c in nb.cells]
    failure = "\n".join(errors(nb.cells[-1]))
    assert "the test allows 24 MiB more" in failure and "rank 0 held" in failure, failure


def test_the_stand_ins_earn_exercises_1_and_2_nothing(monkeypatch):
    """#42 item 4: the grader's stand-ins reach the student's kernel as source; handed in as exercises 1 and 2
    they fail them (whole weights, not slices; all-gathers, not the all-reduces f and g make)."""
    from torch import nn

    import __main__
    import disttrain_lab as dl
    from disttrain_lab.labtests.lab06 import ranks

    for name, value in {
        "nn": nn,
        "dist": torch.distributed,
        "torch": torch,
        "models": dl.models,
        "checks": dl.checks,
    }.items():
        monkeypatch.setattr(__main__, name, value, raising=False)
    for name, stand_in in ranks.STAND_INS.items():
        monkeypatch.setattr(__main__, name, stand_in, raising=False)
    with pytest.raises(AssertionError, match="expected shape"):
        lab06.check_parallel_linear(2, 4, 6)
    with pytest.raises(AssertionError, match="should make exactly 1 all-reduce"):
        lab06.check_f_and_g(2, 3, 4)


@pytest.mark.slow  # (ranks and a packet capture: about a minute)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_the_calls_a_tensor_parallel_run_made_are_read_from_the_wire(monkeypatch):
    """#42: f and g's, TensorParallelMLP's and train_2d's calls come from the grader's capture (each message's
    connection and slot: its process group and its call), not from the ranks' trace.  The solution passes every
    graded case with and without a capture; its MLP with one more all-reduce between the two linears, hidden from
    the trace, passes on the trace alone and fails on the wire; so does a train_2d whose extra all-reduce over all
    ranks is hidden, and a g that shows the trace an all-reduce of zeros and sums what a hidden all-gather
    brought (the right values, the right calls on the trace)."""
    import torch.distributed as dist

    from disttrain_lab import trace
    from disttrain_lab.labtests.lab06 import ranks
    from tests.helpers import notebook_names, observed_from_outside

    solution = bench.functions_from_notebook(LAB, ["TensorParallelMLP", "train_2d"], given=True)
    notebook_names(monkeypatch, solution["TensorParallelMLP"].__init__.__globals__)
    monkeypatch.setattr("disttrain_lab.labtests.lab06.checks._standing_in", lambda own=False: ())  # (own layers)
    driver = ranks._train_2d_in_rank

    def graded_cases():
        lab06.check_f_and_g(2, 3, 4)
        lab06.check_f_and_g(4, 2, 7, tp_size=2)
        lab06.check_tp_mlp(3, [3, 12, 3], batch=2)
        lab06.check_tp_mlp(4, [8, 8, 3], batch=3, tp_size=2)
        lab06.check_2d(driver, 4, 2)
        lab06.check_2d(driver, 4, 1, sizes=(4, 12, 4))

    class Between(solution["TensorParallelMLP"]):  # one more all-reduce (of 48 B), off the trace
        def forward(self, x):
            with trace.unrecorded():
                hidden = torch.zeros(x.shape[0], 4)
                dist.all_reduce(hidden, group=self.group)
            return super().forward(x)

    def hidden_world_all_reduce(dense, batches, tp_size, lr):  # the solution, and an all-reduce of all ranks
        with trace.unrecorded():
            dist.all_reduce(torch.zeros(4))
        return solution["train_2d"](dense, batches, tp_size, lr)

    class Gathered(torch.autograd.Function):  # g: an all-reduce of zeros for the trace, the sum from an all-gather
        @staticmethod
        def forward(ctx, x, group):
            dist.all_reduce(torch.zeros_like(x), group=group)
            with trace.unrecorded():
                pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
                dist.all_gather(pieces, x.detach().contiguous(), group=group)
            return torch.stack(pieces).sum(0)

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    graded_cases()
    with observed_from_outside():
        graded_cases()
        monkeypatch.setattr("__main__.ReduceFromTensorParallel", Gathered)
        with pytest.raises(AssertionError) as gathered:
            lab06.check_f_and_g(4, 2, 7, tp_size=2)
        monkeypatch.setattr(
            "__main__.ReduceFromTensorParallel",
            solution["TensorParallelMLP"].__init__.__globals__["ReduceFromTensorParallel"],
        )
        monkeypatch.setattr("__main__.TensorParallelMLP", Between)
        with pytest.raises(AssertionError) as between:
            lab06.check_tp_mlp(4, [8, 8, 3], batch=3, tp_size=2)
        monkeypatch.setattr("__main__.train_2d", hidden_world_all_reduce)
        with pytest.raises(AssertionError) as in_2d:
            lab06.check_2d(driver, 4, 2)
    lab06.check_tp_mlp(4, [8, 8, 3], batch=3, tp_size=2)  # (the student's own kernel: the trace's account, fooled)
    monkeypatch.setattr("__main__.ReduceFromTensorParallel", Gathered)
    lab06.check_f_and_g(4, 2, 7, tp_size=2)  # (the same: the trace shows g's all-reduce, the values are right)
    said = str(gathered.value)
    assert "ranks (0, 1) should make exactly all-reduce of 56 B, all-reduce of 56 B among themselves" in said, said
    assert "the grader's capture of the wire shows all-reduce of 56 B, all-reduce of 56 B, all-gather of" in said, said
    said = str(between.value)
    assert (
        "none between the two layers" in said
        and "the grader's capture of the wire shows all-reduce of 48 B, all-reduce of 36 B, all-reduce of 96 B" in said
    ), said
    said = str(in_2d.value)
    assert "rank 0's communication must stay inside its TP group (0, 1)" in said, said
    assert "the grader's capture of the wire shows it sent all_reduce messages to rank 3" in said, said
    lab06.check_2d(driver, 4, 2)  # (the trace's account, fooled)


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
@pytest.mark.parametrize("relayed", ["g", "f"])
def test_sums_passed_through_the_store_with_zeros_on_the_wire_fail_on_the_wires_content(monkeypatch, relayed):
    """g (or f) that passes each rank's data through the launcher's store and sums it there, while its
    all-reduce, the one the exercise asks for, sums zeros of the same size: the calls and bytes are the
    solution's, the values right, and it passes in the student's own kernel; under the grader's capture every
    message of that all-reduce holds no piece of a sum of the ranks' data, and f and g's check and
    TensorParallelMLP's fail.  The solution's own f and g pass both with the capture."""

    from tests.helpers import notebook_names, observed_from_outside, relayed_f_and_g

    solution = bench.functions_from_notebook(LAB, ["TensorParallelMLP"], given=True)
    names = solution["TensorParallelMLP"].__init__.__globals__
    notebook_names(monkeypatch, names)
    monkeypatch.setattr("disttrain_lab.labtests.lab06.checks._standing_in", lambda own=False: ())  # (own layers)

    F, G = relayed_f_and_g()

    def graded_cases():
        lab06.check_f_and_g(4, 2, 7, tp_size=2)
        lab06.check_tp_mlp(4, [8, 8, 3], batch=3, tp_size=2)

    with observed_from_outside():
        graded_cases()  # (the solution's own f and g: their all-reduces carry the data)
        name, relaying = ("ReduceFromTensorParallel", G) if relayed == "g" else ("CopyToTensorParallel", F)
        monkeypatch.setitem(names, name, relaying)  # (where TensorParallelMLP finds it)
        monkeypatch.setattr(f"__main__.{name}", relaying)  # (where the f and g driver does)
        with pytest.raises(AssertionError) as f_and_g:
            lab06.check_f_and_g(4, 2, 7, tp_size=2)
        with pytest.raises(AssertionError) as mlp:
            lab06.check_tp_mlp(4, [8, 8, 3], batch=3, tp_size=2)
    graded_cases()  # (the student's own kernel: the values and the trace's calls are right)
    step = "g's forward" if relayed == "g" else "f's backward"
    said = str(f_and_g.value)
    assert f"{step}, of each rank's" in said and "holds no piece of a sum of the ranks' inputs" in said, said
    said = str(mlp.value)
    step = "the forward's all-reduce (g)" if relayed == "g" else "the backward's all-reduce (f)"
    assert step in said and "What a rank all-reduces must be the data itself" in said, said


def _train_2d_through_the_store(dense, batches, tp_size, lr):
    """A forged train_2d: the solution's, but each gradient averaged over the DP group through the launcher's store
    (a few hundred bytes a step) while its all-reduce sums zeros of the same size."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from tests.helpers import through_the_store

    tp_group, dp_group = parallel_groups(tp_size)  # noqa: F821  (the notebook's)
    dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    model = TensorParallelMLP(dense, tp_group)  # noqa: F821  (the notebook's)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        x, y = x.tensor_split(dp_size)[dp_rank], y.tensor_split(dp_size)[dp_rank]
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(torch.zeros_like(p.grad), group=dp_group)
            everyone = through_the_store(p.grad.clone(), "dp", among=dist.get_process_group_ranks(dp_group))
            p.grad.copy_(sum(everyone) / dp_size)
        optimizer.step()
    return model


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_train_2d_averaging_through_the_store_fails_on_the_wires_content(monkeypatch):
    """train_2d's data-parallel all-reduces must carry each rank's own gradients (the grader's training in one
    process, each rank's slices on its shard): the solution passes with the capture; one averaging through the
    launcher's store, its all-reduces summing zeros of the same size, trains right with the right calls and bytes,
    passes in the student's own kernel, and fails on the wire's content."""
    import types

    from disttrain_lab.labtests.lab06 import ranks
    from tests.helpers import notebook_names, observed_from_outside

    solution = bench.functions_from_notebook(LAB, ["TensorParallelMLP", "train_2d", "parallel_groups"], given=True)
    notebook_names(monkeypatch, solution["train_2d"].__globals__)
    monkeypatch.setattr("disttrain_lab.labtests.lab06.checks._standing_in", lambda own=False: ())  # (own layers)
    driver = ranks._train_2d_in_rank
    with observed_from_outside():
        lab06.check_2d(driver, 4, 2)
        lab06.check_2d(driver, 4, 1, sizes=(4, 12, 4))
        forged = types.FunctionType(_train_2d_through_the_store.__code__, solution["train_2d"].__globals__)
        monkeypatch.setattr("__main__.train_2d", forged)  # (among the notebook's names)
        with pytest.raises(AssertionError) as relayed:
            lab06.check_2d(driver, 4, 2)
    lab06.check_2d(driver, 4, 2)  # (the student's own kernel: values, the trace's calls and bytes)
    said = str(relayed.value)
    assert "all-reduces with ranks (0, 2) should carry each of its own gradients" in said, said
    assert "must travel in the all-reduce itself" in said, said


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_train_2d_summing_its_tp_outputs_through_the_store_fails_on_the_wires_content(monkeypatch):
    """train_2d's tensor-parallel all-reduces must carry, at each step, each rank's partial output on its shard (the
    grader's along the dense training in one process), on a grid of one DP group too (no DP all-reduce to read
    there).  The solution passes on 4 ranks as 4 × 1 and as 2 × 2; with g summing through the launcher's store and
    all-reduce zeros, train_2d trains right with the right calls, passes in the student's own kernel, and fails."""
    from disttrain_lab.labtests.lab06 import ranks
    from tests.helpers import notebook_names, observed_from_outside, relayed_f_and_g

    solution = bench.functions_from_notebook(LAB, ["TensorParallelMLP", "train_2d", "parallel_groups"], given=True)
    names = solution["train_2d"].__globals__
    notebook_names(monkeypatch, names)
    monkeypatch.setattr("disttrain_lab.labtests.lab06.checks._standing_in", lambda own=False: ())  # (own layers)
    driver = ranks._train_2d_in_rank
    with observed_from_outside():
        lab06.check_2d(driver, 4, 4, sizes=(5, 8, 3), batch=6)
        lab06.check_2d(driver, 4, 2, sizes=(7, 20, 5), batch=4, steps=4)
    _, relaying = relayed_f_and_g()
    monkeypatch.setitem(names, "ReduceFromTensorParallel", relaying)  # (where TensorParallelMLP finds it)
    lab06.check_2d(driver, 4, 4, sizes=(5, 8, 3), batch=6)  # (the student's own kernel: values and calls right)
    with observed_from_outside(), pytest.raises(AssertionError) as relayed:
        lab06.check_2d(driver, 4, 4, sizes=(5, 8, 3), batch=6)
    said = str(relayed.value)
    assert "at step 1, ranks (0, 1, 2, 3) (a TP group) should all-reduce each rank's partial output" in said, said


# ----------------------------------------------------------------------------------------
# The slice picture and the bench harness


def test_weight_slices_locates_what_each_rank_holds():
    import matplotlib

    matplotlib.use("Agg")
    w, b = torch.arange(24.0).view(6, 4), torch.arange(4.0)
    held = [{"w": w[:3], "b": b}, {"w": w[3:], "b": b}]
    axes = viz.weight_slices({"w": w, "b": b}, held)
    owners = axes[0].images[0].get_array()
    assert (owners[:3] == 2).all() and (owners[3:] == 3).all()  # rank r is drawn as r + 2
    assert (axes[1].images[0].get_array() == 0).all()  # held by both ranks: "several"
    with pytest.raises(ValueError, match="not a contiguous block"):
        viz.weight_slices({"w": w}, [{"w": w[:3] + 1}])


@pytest.mark.slow
def test_bench_tp_measures_side_by_side():
    found = bench.functions_from_notebook(LAB, ["TensorParallelMLP"])
    rows = bench.bench_tp(found, world_sizes=(1, 2), sizes=(16, 64, 16), batch=8, steps=1, repeats=2, warmup=1)
    assert [(r["world_size"], r["version"]) for r in rows] == [
        (1, "TensorParallelMLP"),
        (1, bench.TORCH_TP),
        (2, "TensorParallelMLP"),
        (2, bench.TORCH_TP),
    ]
    for row in rows:
        assert "error" not in row, row
        assert row["ms_per_step"] > 0
    # two all-reduces of a (8, 16) fp32 activation per step on 2 ranks, for both, as the OS counts what rank 0
    # sends: a ring all-reduce sends 2 (N - 1) / N of the 512 bytes, here as 4 messages of 128 (gloo's ring
    # chunks them), each with gloo's headers (96 bytes from the sender, 48 from the receiver: wire.protocol_bytes)
    per_all_reduce = wire.protocol_bytes({(0, 1): [128] * 4, (1, 0): [128] * 4}, 2)[0][1]
    assert per_all_reduce == 512 + 4 * 96 + 4 * 48
    assert [(r["bytes_per_step"], r["calls_per_step"]) for r in rows[2:]] == [(2 * per_all_reduce, 2)] * 2
    assert {r["counted"] for r in rows} == {bench.SENT_ON_THE_WIRE}
    with pytest.raises(ValueError, match="divisible"):
        bench.bench_tp(found, world_sizes=(3,), sizes=(16, 64, 16))


@pytest.mark.slow
@pytest.mark.bench_report
def test_cli_bench_tp_uses_the_notebook():
    out = benchreport.quick_report().printed_by("tp", ["--repeats", "1", "--world-size", "2"])
    assert f"tensor-parallel MLP from solutions/{LAB.parent.name}" in out, out
    for words in (" 2 TensorParallelMLP", f" 2 {bench.TORCH_TP}", "vs torch"):
        assert words in out, out


# ----------------------------------------------------------------------------------------
# On GPUs (device="cuda", NCCL): skipped, saying why, where fewer than 2 GPUs are visible


def _tp_mlp_on_device(tp_mlp):
    import disttrain_lab as dl
    from disttrain_lab import models

    dense = models.MLP([8, 32, 8], seed=0).to(dl.device())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to(dl.device()).requires_grad_()
    y = tp_mlp(dense)(x)
    y.backward(torch.ones_like(y))
    return str(y.device), y.detach().cpu(), x.grad.cpu()


@needs_gpus(1)
def test_tensor_parallel_mlp_on_gpus():
    world = min(gpu_count(), 2)  # one GPU: one NCCL rank holding the whole layer
    import disttrain_lab as dl
    from disttrain_lab import models

    found = bench.functions_from_notebook(LAB, ["TensorParallelMLP"])
    results = dl.launch(_tp_mlp_on_device, world, found["TensorParallelMLP"], device="cuda", timeout=120)
    dense = models.MLP([8, 32, 8], seed=0)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
    y = dense(x)
    y.backward(torch.ones_like(y))
    assert [device for device, _, _ in results] == [f"cuda:{k}" for k in range(world)]
    for _, got, grad in results:
        torch.testing.assert_close(got, y.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grad, x.grad, rtol=1e-4, atol=1e-5)


# A forged g for the run where the grader's stand-ins replace f and g, defined among the notebook's names (where
# TensorParallelMLP finds g, and the stand-in in the place of ReduceFromTensorParallel): the stand-in made to
# all-gather zeros, the sum taken through the launcher's store, the gradient passed straight through as g's is
_G_SUMMING_THROUGH_THE_STORE = """
def g(x, group=None):
    from tests.helpers import through_the_store

    junk = ReduceFromTensorParallel.apply(torch.zeros_like(x), group)
    among = dist.get_process_group_ranks(group) if group is not None else None
    total = sum(through_the_store(x.detach().clone(), "g", among=among))
    return x + (total - x).detach() + 0 * junk
"""


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_on_the_graders_stand_ins_the_all_gathers_are_read_for_content(monkeypatch):
    """Where exercises 1 and 2 have not passed, TensorParallelMLP runs on the grader's stand-ins, whose f and g sum
    with an all-gather: each rank's partial output (g) and partial input gradient (f) must be what it sent in them.
    The solution's MLP passes on the stand-ins for f and g, and for all four classes; one whose g makes the
    stand-in all-gather zeros and sums through the launcher's store passes in the student's own kernel and fails."""
    from tests.helpers import notebook_names, observed_from_outside

    solution = bench.functions_from_notebook(LAB, ["TensorParallelMLP"], given=True)
    names = solution["TensorParallelMLP"].__init__.__globals__
    notebook_names(monkeypatch, names)
    f_and_g = ("CopyToTensorParallel", "ReduceFromTensorParallel")
    every = ("ColumnParallelLinear", "RowParallelLinear", *f_and_g)
    standing = "disttrain_lab.labtests.lab06.checks._standing_in"
    with observed_from_outside():
        monkeypatch.setattr(standing, lambda own=False: f_and_g)
        lab06.check_tp_mlp(4, [8, 8, 3], batch=3, tp_size=2)
        monkeypatch.setattr(standing, lambda own=False: every)
        lab06.check_tp_mlp(2, [6, 10, 4], batch=2)
    monkeypatch.setattr(standing, lambda own=False: f_and_g)
    monkeypatch.setitem(names, "g", names["g"])  # (put back after)
    exec(compile(_G_SUMMING_THROUGH_THE_STORE, "<forged g>", "exec"), names)
    lab06.check_tp_mlp(4, [8, 8, 3], batch=3, tp_size=2)  # (the student's own kernel: values and calls right)
    with observed_from_outside(), pytest.raises(AssertionError) as caught:
        lab06.check_tp_mlp(4, [8, 8, 3], batch=3, tp_size=2)
    said = str(caught.value)
    assert "the forward's all-reduce (g), of each rank's partial output" in said, said
    assert "should send its own input to the all-gather whole" in said and "found 0 of them" in said, said
