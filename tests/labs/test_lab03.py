"""Lab 3 (data parallelism): the solution notebook runs, its graded tests can fail, and the
DDP bench harness works.

- The solution notebook executes top to bottom in a real kernel as the grader runs it
  (NBGRADER_EXECUTION set), within the 4-minute budget, every graded cell passing, with its
  timelines, bench table, bucket sweep and async-vs-sync plot.
- (The blank notebook failing every graded cell is checked by the autograde round trip in
  test_grading.py, on every lab.)  Wrong answers (a shard that drops the remainder, a broadcast that
  skips frozen parameters, naive DDP that sums instead of averaging, a hook that waits for its own
  all-reduce, a no_sync() that still communicates) fail the right graded cell with a message that says
  why; so do a wrapper that is not an nn.Module like torch's DDP, buckets filled in forward order, and
  a no_sync() built on a blocking all-reduce; a broken BucketedDDP does not cost AccumulatingDDP its
  points, nor a broken broadcast_parameters average_gradients; and the grader's stand-ins for those two,
  captured and handed in (a broadcast_parameters that rebuilds rank 0's model instead of receiving it,
  a BucketedDDP that knows only 1 KiB and 25 MiB buckets), fail their own graded cells (#42 item 4).
- bench.bench_ddp / format_ddp_table / `disttrain-lab bench ddp`, on the solution's classes.

The notebook helpers come from tests/notebooks.py; the autograde round trip lives in test_grading.py.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
from types import SimpleNamespace

import nbformat
import pytest

from disttrain_lab import bench
from tests import benchreport
from tests.helpers import needs_gpus
from tests.notebooks import (
    add_wrong_answers,
    assert_wrong_answers_caught,
    cell_by_id,
    code_cells_on_device,
    device_setting,
    errors,
    errors_of_graded_predictions,
    execute,
    execute_without_errors,
    load,
    output_of,
    pictures,
    prediction_problems,
    run_solution,
    solution_notebook,
    text,
)

LAB = solution_notebook("03_data_parallel")
BUDGET_S = 240  # the issue's budget for the whole solution notebook on 2 cores
EXERCISES = {
    "shard": "def shard(",
    "broadcast_parameters": "def broadcast_parameters(",
    "average_gradients": "def average_gradients(",
    "overlapped_ddp": "class OverlappedDDP",
    "bucketed_ddp": "class BucketedDDP",
    "no_sync": "class AccumulatingDDP",
}
CLASSES = ["NaiveDDP", "OverlappedDDP", "BucketedDDP", "AccumulatingDDP"]


@pytest.fixture(scope="module")
def solution() -> dict:
    """The solution notebook's classes, as `disttrain-lab bench ddp` loads them."""
    return bench.functions_from_notebook(LAB, CLASSES + ["shard", "shard_loss"])


# ----------------------------------------------------------------------------------------
# The notebook's structure (fast)


def test_prediction_self_checks_hold_no_answer():
    assert prediction_problems(load(LAB)) == []


def test_hidden_tests_cover_the_issue():
    # N = 2, 3, 4; tied and frozen models; batches that do not divide by N
    nb = load(LAB)
    hidden = "".join(
        "".join(cell_by_id(nb, f"test_{e}").source.split("### BEGIN HIDDEN TESTS")[1:])
        for e in EXERCISES
        if e != "shard"
    )
    for needle in ('"tied", 4', '"frozen", 3', '"mlp", 3', '("tied", 4, 9)', '("frozen", 3, 7)'):
        assert needle in hidden, needle


# ----------------------------------------------------------------------------------------
# Executing it (slow)


@pytest.mark.slow
def test_solution_notebook_executes_within_budget():
    nb = run_solution(LAB, BUDGET_S)
    table = output_of(nb, "bench.format_ddp_table(rows)")
    for name in ("naive", "overlapped", "bucketed (25 MiB)", bench.TORCH_DDP):
        assert name in table, table
    assert "rank 1 slower by  50 ms" in output_of(nb, "def _timed_steps")
    assert pictures(nb) >= 3, (
        f"expected the three timelines, the bucket sweep and the async/sync plot, got {pictures(nb)}"
    )
    # the predictions: each self-check reads the solution's value (its form; no answer), and the
    # measurement on 4 real ranks agrees with the cost model (gloo's headers add well under 1 %)
    for marker in ('dl.predictions.check("BucketedDDP', 'dl.predictions.check("predicted_bytes_sent'):
        assert "is in a form the graded test reads" in output_of(nb, marker), output_of(nb, marker)
    measured = output_of(nb, "def _bucketed_steps(")
    match = re.search(
        r"measured: (\S+) all-reduces per step; the busiest rank sent [\d,]+ B per step \(([\d.]+) ×", measured
    )
    assert match and float(match[1]) == 5 and 1.5 <= float(match[2]) < 1.5 * 1.01, measured


# Wrong answers the graded tests must catch: (graded cell, wrong solution, words the failure must contain)
FORWARD_ORDER_BUCKETS = """
class BucketedDDP(nn.Module):                 # fills its buckets in forward order
    def __init__(self, module, bucket_mb=25.0):
        super().__init__()
        self.module, self.world_size, self.buckets, self.pending = module, dist.get_world_size(), [], {}
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        cap, used = bucket_mb * 2**20, 0
        for p in [p for p in module.parameters() if p.requires_grad]:
            if not self.buckets or used + p.numel() * p.element_size() > cap:
                self.buckets.append([])
                used = 0
            self.buckets[-1].append(p)
            used += p.numel() * p.element_size()
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self.grad_ready)

    def forward(self, x):
        return self.module(x)

    def grad_ready(self, param):
        i = self.bucket_of[param]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])
            self.pending[i] = (flat, dist.all_reduce(flat, async_op=True))

    def finish_gradient_synchronization(self):
        for i, (flat, work) in sorted(self.pending.items()):
            work.wait()
            for p, g in zip(self.buckets[i], flat.div_(self.world_size).split([p.numel() for p in self.buckets[i]])):
                p.grad.copy_(g.view_as(p))
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
"""

# the grader's stand-in for BucketedDDP (test_no_sync's hidden block), captured: the rule's reverse order, but only
# 1 KiB and 25 MiB buckets
GRADERS_STAND_IN_BUCKETS = (
    FORWARD_ORDER_BUCKETS.replace(
        "# fills its buckets in forward order", "# the grader's stand-in: 1 KiB or 25 MiB buckets"
    )
    .replace("cap, used = bucket_mb * 2**20, 0", "cap, used = (2**10 if bucket_mb < 1 else 25 * 2**20), 0")
    .replace(
        "for p in [p for p in module.parameters() if p.requires_grad]:",
        "for p in reversed([p for p in module.parameters() if p.requires_grad]):",
    )
)
assert GRADERS_STAND_IN_BUCKETS.count("reversed(") == 1 and "2**10 if" in GRADERS_STAND_IN_BUCKETS

WRONG = [
    (
        "shard",
        """
def shard(x, rank, world_size):               # drops the len(x) % world_size last rows
    size = len(x) // world_size
    return x[rank * size:(rank + 1) * size]
""",
        "none dropped",
    ),
    (
        "broadcast_parameters",
        """
def broadcast_parameters(model):              # the grader's stand-in, captured: rank 0's model rebuilt, not received
    from disttrain_lab.labtests.lab03.common import graded_model
    shapes = [p.shape for p in model.parameters()]
    rank0 = next(m for m in (graded_model(k, seed=0) for k in ("mlp", "tied", "frozen"))
                 if [p.shape for p in m.parameters()] == shapes)
    with torch.no_grad():
        for p, q in zip(model.parameters(), rank0.parameters()):
            p.copy_(q)
""",
        "is not a broadcast",
    ),
    (
        "average_gradients",
        """
def average_gradients(model):                 # sums, forgets to divide by N
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
""",
        "against one process training on the whole batch",
    ),
    (
        "overlapped_ddp",
        """
class OverlappedDDP(nn.Module):               # waits inside each hook: no overlap
    def __init__(self, module):
        super().__init__()
        self.module, self.world_size = module, dist.get_world_size()
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.grad_ready)

    def forward(self, x):
        return self.module(x)

    def grad_ready(self, param):
        dist.all_reduce(param.grad, async_op=True).wait()
        param.grad /= self.world_size

    def finish_gradient_synchronization(self):
        pass
""",
        "(no overlap)",
    ),
    (
        "overlapped_ddp",
        """
class OverlappedDDP:                          # right numbers, but not an nn.Module like DDP
    def __init__(self, model):
        self.model, self.world_size, self.pending = model, dist.get_world_size(), []
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.grad_ready)

    def grad_ready(self, param):
        self.pending.append((param, dist.all_reduce(param.grad, async_op=True)))

    def finish_gradient_synchronization(self):
        for param, work in self.pending:
            work.wait()
            param.grad /= self.world_size
        self.pending.clear()
""",
        "should be an nn.Module whose .module is the model it wraps",
    ),
    (
        "bucketed_ddp",
        """
_RightBuckets = BucketedDDP
class BucketedDDP(_RightBuckets):             # right numbers, but its hooks bypass self.grad_ready (#41)
    def __init__(self, module, bucket_mb=25.0):
        self.grad_ready = lambda p: _RightBuckets.grad_ready(self, p)   # what the hooks get: not the method
        super().__init__(module, bucket_mb)
""",
        "route every hook through it",
    ),
    (
        "bucketed_ddp",
        GRADERS_STAND_IN_BUCKETS,
        "B: the bucket rule's: fill buckets",
    ),
    (
        "no_sync",
        """
class AccumulatingDDP(BucketedDDP):           # no_sync() that changes nothing
    @contextlib.contextmanager
    def no_sync(self):
        yield
""",
        "under no_sync()",
    ),
    (
        "no_sync",
        """
class AccumulatingDDP(BucketedDDP):           # no_sync() right, but a blocking all-reduce inside the hook
    require_sync = True

    @contextlib.contextmanager
    def no_sync(self):
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True

    def grad_ready(self, param):
        if self.require_sync:
            i = self.bucket_of[param]
            self.ready[i] += 1
            if self.ready[i] == len(self.buckets[i]):
                flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])
                dist.all_reduce(flat)
                for p, g in zip(self.buckets[i], flat.div_(self.world_size).split([p.numel() for p in self.buckets[i]])):
                    p.grad.copy_(g.view_as(p))
                self.pending[i] = None

    def finish_gradient_synchronization(self):
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
""",
        "blocking all-reduce call(s)",
    ),
    (
        "no_sync",
        """
class AccumulatingDDP(BucketedDDP):           # no try/finally: an exception inside no_sync() leaves it off
    require_sync = True

    @contextlib.contextmanager
    def no_sync(self):
        self.require_sync = False
        yield
        self.require_sync = True

    def grad_ready(self, param):
        if self.require_sync:
            super().grad_ready(param)
""",
        "no_sync() left require_sync False",
    ),
    (
        "no_sync",
        """
class AccumulatingDDP(BucketedDDP):           # restores True, not the previous state: a nested no_sync() ends the outer
    require_sync = True

    @contextlib.contextmanager
    def no_sync(self):
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True

    def grad_ready(self, param):
        if self.require_sync:
            super().grad_ready(param)
""",
        "a no_sync() opened and closed inside each no_sync()",
    ),
]


def _notebook(lab, replaced: str, wrong: str, tests: list[str]) -> nbformat.NotebookNode:
    """The setup cell, the given code, every solution but ``replaced``'s, the wrong code in its place,
    and the graded cells ``tests``."""
    given = next(c for c in lab.cells if "def shard_loss(" in c.source)
    cells = [lab.cells[0], given]
    for e in EXERCISES:
        cells.append(nbformat.v4.new_code_cell(wrong) if e == replaced else cell_by_id(lab, f"ex_{e}"))
    cells += [cell_by_id(lab, f"test_{t}") for t in tests]
    return nbformat.v4.new_notebook(cells=[copy.deepcopy(c) for c in cells])


@pytest.mark.slow
def test_graded_cells_catch_wrong_answers():
    """One kernel: for each wrong answer (a shard that drops the remainder, gradients summed, an overlap
    that waits in the hook, a wrapper that is no module, no_sync that communicates, blocks or forgets its
    finally), the solutions with the wrong one in its place, then its graded cell."""
    lab = load(LAB)
    given = next(c for c in lab.cells if "def shard_loss(" in c.source)
    solutions = [cell_by_id(lab, f"ex_{e}") for e in EXERCISES]
    cells = [copy.deepcopy(c) for c in (lab.cells[0], given, *solutions)]
    wrong = [(exercise, source) for exercise, source, _ in WRONG]
    graded_at = add_wrong_answers(lab, cells, solutions, wrong, replace=True)
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, timeout=240, cwd=LAB.parent)
    assert_wrong_answers_caught(nb, graded_at, [message for _, _, message in WRONG])


BROADCAST_SKIPS_FROZEN = """
def broadcast_parameters(model):              # forgets the frozen parameters
    for p in model.parameters():
        if p.requires_grad:
            dist.broadcast(p.data, src=0)
"""


@pytest.mark.slow
def test_broadcast_skipping_frozen_fails_and_costs_average_gradients_nothing():
    # one execution: the broadcast test names the rule (its hidden frozen case); average_gradients, graded
    # through NaiveDDP (which broadcasts), is graded with the grader's broadcast instead and keeps its points
    nb, _ = execute(
        _notebook(
            load(LAB), "broadcast_parameters", BROADCAST_SKIPS_FROZEN, ["broadcast_parameters", "average_gradients"]
        ),
        autograding=True,
        cwd=LAB.parent,
    )
    for cell in nb.cells[:-2]:
        assert not errors(cell), errors(cell)
    broadcast, average = nb.cells[-2:]
    assert errors(broadcast) and "frozen ones too, is copied from rank 0" in errors(broadcast)[0], errors(broadcast)
    assert not errors(average) and "the grader checks average_gradients with its own" in text(average), (
        errors(average),
        text(average),
    )


@pytest.mark.slow
def test_forward_order_buckets_fail_and_cost_no_sync_nothing():
    # one execution: the bucketed test names the rule; no_sync, built on this BucketedDDP, is graded on the
    # grader's own BucketedDDP instead and keeps its points (dependent exercises do not chain losses).  The
    # no_sync self-check runs just before its graded cell, as in the lab: the warm ranks then already hold
    # AccumulatingDDP on the student's BucketedDDP when the graded cell rebases it on the grader's
    lab = load(LAB)
    nb = _notebook(lab, "bucketed_ddp", FORWARD_ORDER_BUCKETS, ["bucketed_ddp", "no_sync"])
    self_check = lab.cells[lab.cells.index(cell_by_id(lab, "ex_no_sync")) + 1]
    assert self_check.source.startswith("# Self-check") and "AccumulatingDDP" in self_check.source
    nb.cells.insert(len(nb.cells) - 1, copy.deepcopy(self_check))
    nb, _ = execute(nb, autograding=True, cwd=LAB.parent)
    for cell in nb.cells[:-3]:
        assert not errors(cell), errors(cell)
    # the self-check ran AccumulatingDDP on the ranks (its buckets hold one parameter each: the order is not seen)
    assert "no_sync: only the last micro-step all-reduces" in text(nb.cells[-2]), (
        errors(nb.cells[-2]),
        text(nb.cells[-2]),
    )
    bucketed, no_sync = nb.cells[-3], nb.cells[-1]
    assert errors(bucketed) and "in *reverse* order of model.parameters()" in errors(bucketed)[0], errors(bucketed)
    assert "[1356, 384] B" in errors(bucketed)[0], errors(bucketed)
    assert not errors(no_sync) and "the grader checks no_sync() on its own BucketedDDP" in text(no_sync), (
        errors(no_sync),
        text(no_sync),
    )


@needs_gpus(2)
def test_exercises_and_graded_cells_pass_on_gpus():
    # DEVICE = "cuda": every cell up to the last graded one (solutions, self-checks, graded tests) on 2 GPUs
    execute_without_errors(code_cells_on_device(load(LAB), "test_no_sync", "cuda"), LAB.parent)


ONE_RANK_CHECKS = """
# every exercise on ONE rank of DEVICE (world_size=1: each collective is still a real call of the backend),
# with the graded cells' own checks (trace, overlap, buckets, single-process reference)
for kind in ("mlp", "tied", "frozen"):
    _buckets = lab_tests.bucket_sizes(lab_tests.graded_model(kind, 0), 1 / 1024)
    _calls = lab_tests.per_parameter(kind)
    _runs = [
        lab_tests.check_ddp("NaiveDDP", "NaiveDDP", kind, 1, batch=8, all_reduces=_calls),
        lab_tests.check_ddp("OverlappedDDP", "OverlappedDDP", kind, 1, batch=8, all_reduces=_calls, overlap=True),
        lab_tests.check_ddp("BucketedDDP", "BucketedDDP", kind, 1, batch=8, bucket_mb=1 / 1024, buckets=_buckets,
                            overlap=True),
        lab_tests.check_ddp("AccumulatingDDP", "AccumulatingDDP", kind, 1, batch=12, micro_steps=3, bucket_mb=1 / 1024,
                            buckets=_buckets, overlap=True)]
    print("backends:", sorted({run.backend for run in _runs}))
print("rank device:", dl.launch(lambda: str(dl.device()), 1, device=DEVICE))
"""


def _one_rank_notebook(device: str) -> nbformat.NotebookNode:
    """The setup cell (it imports the graded tests' module), ``DEVICE = device``, the given code, every
    solution, then ONE_RANK_CHECKS.  (tests.notebooks.one_rank_notebook adds a test_helpers cell: this lab's
    helpers are its module's, disttrain_lab.labtests.lab03.)"""
    lab = load(LAB)
    given = next(c for c in lab.cells if "def shard_loss(" in c.source)
    cells = [lab.cells[0], device_setting(lab, device), given, *(cell_by_id(lab, f"ex_{e}") for e in EXERCISES)]
    return nbformat.v4.new_notebook(
        cells=[copy.deepcopy(c) for c in cells] + [nbformat.v4.new_code_cell(ONE_RANK_CHECKS)]
    )


def check_exercises_on_one_rank(device: str, backend: str, rank_device: str) -> None:
    nb = execute_without_errors(_one_rank_notebook(device), LAB.parent)
    out = text(nb.cells[-1])
    assert out.count(f"backends: ['{backend}']") == 3 and f"rank device: ['{rank_device}']" in out, out


@pytest.mark.slow
def test_exercises_on_one_cpu_rank():
    check_exercises_on_one_rank("cpu", "gloo", "cpu")


@needs_gpus(1)
def test_exercises_on_one_gpu():
    # a machine with ONE GPU: every exercise with DEVICE = "cuda" on one NCCL rank, against one process on the CPU
    # (the 2-GPU test above needs two); the same body runs with device="cpu" (gloo) where there is no GPU
    check_exercises_on_one_rank("cuda", "nccl", "cuda:0")


# ----------------------------------------------------------------------------------------
# The bench harness


def test_bench_ddp_measures_side_by_side(solution):
    versions = {"naive": solution["NaiveDDP"], "bucketed": functools.partial(solution["BucketedDDP"], bucket_mb=0.01)}
    rows = bench.bench_ddp(versions, world_size=2, sizes=(32, 64, 8), steps=2, repeats=2, warmup=1)
    assert [r["version"] for r in rows] == ["naive", "bucketed", bench.TORCH_DDP]
    for row in rows:
        assert row["steps_per_s"] > 0 and row["parameters"] == 32 * 64 + 64 + 64 * 8 + 8
    assert rows[-1]["ratio"] == 1.0


@pytest.mark.slow
@pytest.mark.bench_report
def test_cli_bench_ddp_uses_the_notebook():
    out = benchreport.quick_report().printed_by("ddp", ["--repeats", "1", "--bucket-mb", "4"])
    assert f"data-parallel wrappers from solutions/{LAB.parent.name}" in out, out
    for name in ("naive", "overlapped", "bucketed (4 MiB)", bench.TORCH_DDP, "vs torch DDP"):
        assert name in out, out


# Predictions: (PREDICTED_BUCKETS, predicted_bytes_sent) as a student might get them wrong, and the words the
# graded cells must say.  10 MiB / 4 MiB rounded up is not the bucket rule; 2S is the all-reduce of section 2
# of Lab 4's accounting, not the bytes a rank sends on a ring.
WRONG_PREDICTIONS = """
PREDICTED_BUCKETS = 3
def predicted_bytes_sent(n, num_parameters):
    return 2 * 4 * num_parameters
"""


@pytest.mark.slow
@pytest.mark.parametrize("prediction", [WRONG_PREDICTIONS, "# left blank"], ids=["wrong", "blank"])
def test_graded_predictions_fail_a_wrong_or_blank_prediction(prediction):
    buckets, ring = errors_of_graded_predictions(LAB, prediction, ["test_predict_buckets", "test_predict_ring_bytes"])
    if prediction == WRONG_PREDICTIONS:
        assert buckets and "predicted 3.00e+00, the cost model gives 5.00e+00" in buckets[0], buckets
        assert (
            ring and "predicted_bytes_sent(4, 2624768): predicted 2.10e+07, the cost model gives 1.57e+07" in ring[0]
        ), ring
    else:
        assert buckets and "PREDICTED_BUCKETS is not filled in yet" in buckets[0], buckets
        assert ring and "predicted_bytes_sent is not filled in yet" in ring[0], ring


# ----------------------------------------------------------------------------------------
# Overlap from the grader's gate, not the ranks' trace (#42)

_LATE_OVERLAP = """
class OverlappedDDP(NaiveDDP):  # every all-reduce posted after backward returned: nothing overlaps
    def __init__(self, module):
        super().__init__(module)

    def finish_gradient_synchronization(self):
        works = [(p, dist.all_reduce(p.grad, async_op=True)) for p in self.module.parameters() if p.requires_grad]
        for p, work in works:
            work.wait()
            p.grad.div_(dist.get_world_size())
"""

_JUNK_DURING_BACKWARD = """
class OverlappedDDP(NaiveDDP):  # junk of a gradient's size sent from the hooks; the real all-reduces after backward
    def __init__(self, module):
        super().__init__(module)
        self.works = []
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda p: self.works.append(dist.all_reduce(torch.rand_like(p.grad), async_op=True))
                )

    def finish_gradient_synchronization(self):
        for work in self.works:
            work.wait()
        self.works.clear()
        average_gradients(self.module)
"""

_TWICE = """
class OverlappedDDP(SolutionsOverlappedDDP):  # right values, every gradient all-reduced a second time in finish
    def finish_gradient_synchronization(self):
        super().finish_gradient_synchronization()
        for p in self.module.parameters():
            if p.requires_grad:
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())
"""

_NO_WAIT_AT_THE_GATE = """
class OverlappedDDP(SolutionsOverlappedDDP):  # tells the grader's gate it is held, and runs on without its answer
    def __init__(self, module):                # (read and dropped at the next mark, so that the run ends)
        import struct

        import disttrain_lab.gate as gates

        theirs = (gates.Gate.wait, gates.Gate.start)

        def drain(gate):  # (the answer it did not wait for, read before the gate's next message)
            if getattr(gate, "pending", 0):
                gates._exactly(gate.sock, gate.pending)
                gate.pending = 0
                gates.Gate.wait, gates.Gate.start = theirs  # (once: the rank serves later runs)

        def wait(gate, shape):
            if shape.numel() == 1:  # (the grader's holds around each backward: waited for)
                drain(gate)
                return theirs[0](gate, shape)
            gate.sock.sendall(gates.HOLD + struct.pack("<I", shape.numel()))
            gate.pending = 4 * shape.numel()
            return torch.zeros(shape)

        def start(gate):
            drain(gate)
            return theirs[1](gate)

        gates.Gate.wait, gates.Gate.start = wait, start
        super().__init__(module)
"""

# after backward, and tells the gate it is held without waiting there, so that what it sends after backward may
# cross before the grader answers
_NO_WAIT_LATE = _LATE_OVERLAP + "\nSolutionsOverlappedDDP = OverlappedDDP\n" + _NO_WAIT_AT_THE_GATE

_STORE_JUNK = """
class OverlappedDDP(NaiveDDP):  # late: junk of the small bucket's size from its hook, its real average via the store
    def __init__(self, module):
        super().__init__(module)
        nonce = torch.randint(0, 2**30, (1,))
        dist.broadcast(nonce, 0)
        self.nonce, self.step, self.works = int(nonce), 0, []
        n = dist.get_world_size()
        self.small = [p for p in module.parameters() if p.requires_grad and p.numel() < 4 * n]
        for p in self.small:
            p.register_post_accumulate_grad_hook(
                lambda p: self.works.append(dist.all_reduce(torch.zeros_like(p.grad), async_op=True)))

    def finish_gradient_synchronization(self):
        import torch.distributed.distributed_c10d as c10d
        store = c10d._get_default_store()
        r, n = dist.get_rank(), dist.get_world_size()
        for w in self.works:
            w.wait()
        self.works.clear()
        for i, p in enumerate(self.small):
            store.set(f"j{self.nonce}-{self.step}-{i}-{r}", p.grad.detach().cpu().numpy().tobytes())
        big = [(p, dist.all_reduce(p.grad, async_op=True)) for p in self.module.parameters()
               if p.requires_grad and all(p is not q for q in self.small)]
        for i, p in enumerate(self.small):
            tot = sum(torch.frombuffer(bytearray(store.get(f"j{self.nonce}-{self.step}-{i}-{k}")), dtype=torch.float32)
                      for k in range(n))
            p.grad.copy_(tot.view_as(p))
            p.grad.div_(n)
        for p, w in big:
            w.wait()
            p.grad.div_(n)
        self.step += 1
"""

_SMALL_ONLY = """
class OverlappedDDP(NaiveDDP):  # only the tiny parameters (fewer than 4 values a rank) posted from hooks; the rest after backward
    def __init__(self, module):
        super().__init__(module)
        self.works = []
        n = dist.get_world_size()
        self.small = [p for p in module.parameters() if p.requires_grad and p.numel() < 4 * n]
        for p in self.small:
            p.register_post_accumulate_grad_hook(lambda p: self.works.append((p, dist.all_reduce(p.grad, async_op=True))))

    def finish_gradient_synchronization(self):
        n = dist.get_world_size()
        late = [(p, dist.all_reduce(p.grad, async_op=True)) for p in self.module.parameters()
                if p.requires_grad and all(p is not q for q in self.small)]
        for p, w in self.works + late:
            w.wait()
            p.grad.div_(n)
        self.works.clear()
"""

_TENSOR_HOOK = """
class OverlappedDDP(SolutionsOverlappedDDP):  # Tensor.register_hook on each parameter, all-reduces a copy, SUM then divide
    def __init__(self, module):
        nn.Module.__init__(self)
        self.module, self.world_size, self.pending = module, dist.get_world_size(), []
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
            if p.requires_grad:
                p.register_hook(lambda g, p=p: self._post(p, g))

    def _post(self, p, g):
        buf = g.detach().clone()
        self.pending.append((p, buf, dist.all_reduce(buf, async_op=True)))

    def finish_gradient_synchronization(self):
        for p, buf, w in self.pending:
            w.wait()
            p.grad.copy_(buf / self.world_size)
        self.pending.clear()
"""

_BLOCKING_LATER = """
class OverlappedDDP(NaiveDDP):  # async in the first step (where the grader's probe once was), blocking after
    def __init__(self, module):
        super().__init__(module)
        self.step, self.works = 0, []
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.hook)

    def hook(self, p):
        if self.step == 0:
            self.works.append(dist.all_reduce(p.grad, async_op=True))
        else:
            dist.all_reduce(p.grad)

    def finish_gradient_synchronization(self):
        for work in self.works:
            work.wait()
        self.works.clear()
        self.step += 1
        for p in self.module.parameters():
            if p.requires_grad:
                p.grad.div_(dist.get_world_size())
"""

_IN_ORDER = """
class BucketedDDP(SolutionsBucketedDDP):  # posts its buckets in the rule's order, as torch's DDP
    # does: a ready bucket waits for those before it
    def grad_ready(self, param):
        i = self.bucket_of[param]
        self.ready[i] += 1
        nxt = getattr(self, "next_bucket", 0)
        while nxt < len(self.buckets) and self.ready[nxt] == len(self.buckets[nxt]):
            self.post_bucket(nxt)
            nxt += 1
        self.next_bucket = nxt

    def finish_gradient_synchronization(self):
        super().finish_gradient_synchronization()
        self.next_bucket = 0
"""

_BLOCKING_IN_HOOKS = """
class OverlappedDDP(NaiveDDP):  # a blocking all-reduce in each hook: right values, backward stops at every hook
    def __init__(self, module):
        super().__init__(module)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(p.grad))

    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            if p.requires_grad:
                p.grad.div_(dist.get_world_size())
"""

_FORWARD_WITHIN_BUCKETS = """
class BucketedDDP(SolutionsBucketedDDP):  # right: the rule's buckets, each flattened in forward order inside
    def __init__(self, module, bucket_mb=25.0):
        super().__init__(module, bucket_mb)
        self.buckets = [list(reversed(bucket)) for bucket in self.buckets]
"""

_ONE_FLAT = """
class NaiveDDP(SolutionsNaiveDDP):  # right values: every gradient in one flat all-reduce, not one per parameter
    def finish_gradient_synchronization(self):
        grads = [p.grad for p in self.module.parameters() if p.requires_grad]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))
"""

_PARTLY_REAL = """
class NaiveDDP(SolutionsNaiveDDP):  # each all-reduce's first values real, the rest zeros; the average via the store
    def finish_gradient_synchronization(self):
        import torch.distributed.distributed_c10d as c10d
        store = c10d._get_default_store()
        r, n = dist.get_rank(), dist.get_world_size()
        self.calls = getattr(self, "calls", 0) + 1
        for i, p in enumerate(q for q in self.module.parameters() if q.requires_grad):
            shown = p.grad.detach().clone()
            shown.view(-1)[8:] = 0
            dist.all_reduce(shown)
            store.set(f"partly-{self.calls}-{i}-{r}", p.grad.detach().cpu().numpy().tobytes())
            total = sum(torch.frombuffer(bytearray(store.get(f"partly-{self.calls}-{i}-{k}")), dtype=torch.float32)
                        for k in range(n))
            p.grad.copy_(total.view_as(p.grad) / n)
"""

_SYNC_ALWAYS = """
import contextlib


class AccumulatingDDP(SolutionsAccumulatingDDP):  # no_sync() that switches nothing off: right values, every
    @contextlib.contextmanager                    # micro-step all-reduced
    def no_sync(self):
        yield
"""


@pytest.mark.slow
def test_overlap_is_graded_from_the_grader_gate_not_the_ranks_trace(solution, monkeypatch):
    """Under the grader's evidence (packet capture, ``ss``, its gate in the backward: tests/helpers.py), the
    solution's OverlappedDDP, BucketedDDP and AccumulatingDDP pass with the trace's checks made to fail if
    called (a forged trace would pass them); a wrapper that all-reduces only after backward, one that sends junk
    from its hooks and the real gradients later, one with the right values that all-reduces every gradient a
    second time, and one that tells the gate it is held and runs on without the grader's answer (what it sends
    of the layers below is not their gradient), each fail.  Every step's all-reduces are read off the wire
    between the grader's marks, in the cases with no gate too (NaiveDDP): with the trace's counts unread,
    one flat all-reduce where one per parameter is asked for, and a no_sync() that switches nothing off (both
    with the right values), fail.  A blocking all-reduce in each hook fails from the grader's probe around a
    backward, on the tied model too.  On the tied model on 2 ranks
    the gate is at the encoder's output (the decoder's bias, 6 values, crosses in pieces too short for a window:
    each value is read): the solution and a wrapper on Tensor.register_hook pass; all-reduces posted after
    backward fail from what crossed (nothing) while it held, and so do they from a rank that tells the gate it is
    held there without waiting (what it sends of the layers below is not their gradient), and zeros all-reduced
    for the bias while held, its average passed through the store.  Only the small biases posted from hooks
    (the rest after backward) fail on the MLP: the larger bucket above the gate must cross.  The step in which the
    grader keeps a rank behind before its backward is drawn and told to no rank: a wrapper that posts async in the
    first step only and blocks in its hooks after fails where the draw is the second step.  Buckets posted in the
    rule's order, as torch's DDP does, pass (on the tied model the rule's first bucket is the last ready).  A
    frozen first layer under 1 KiB buckets has no gate (every bucket is ready only as backward ends), and the
    solution passes there.  Under grading the ranks' trace is never read: its check raises here if called."""
    import __main__
    from disttrain_lab.grading import gatekeeper
    from disttrain_lab.labtests import lab03
    from disttrain_lab.labtests.lab03 import checks as lab03_checks
    from tests.helpers import notebook_names, observed_from_outside

    notebook_names(monkeypatch, solution["shard_loss"].__globals__)  # (torch, nn, dist, its classes)

    def trace_read(*args, **kwargs):  # (a forged trace would pass its rules: under grading none is read)
        raise AssertionError("the ranks' trace was read under grading")

    monkeypatch.setattr(lab03_checks, "_check_step", trace_read)

    @contextlib.contextmanager
    def using(source: str, name: str):
        """Within: the notebook's class ``name`` as ``source`` defines it (over the solution's, ``Solutions<name>``)."""
        space = dict(solution["shard_loss"].__globals__, **{f"Solutions{n}": solution[n] for n in CLASSES})
        exec(source, space)
        monkeypatch.setattr(__main__, name, space[name])
        try:
            yield
        finally:
            monkeypatch.setattr(__main__, name, solution[name])

    with observed_from_outside():
        lab03.check_overlapped_ddp("mlp", 2, batch=8)
        lab03.check_overlapped_ddp("tied", 2, batch=8)  # (the gate at the encoder's output)
        lab03.check_bucketed_ddp("frozen", 2, 9, 1 / 1024)  # (no gate: every bucket is ready as backward ends)
        lab03.check_average_gradients("mlp", 2, batch=8)
        lab03.check_bucketed_ddp("mlp", 3, 10, 300 / 2**20)
        lab03.check_no_sync("mlp", 2, 12, 3)
        # alternative-correct: on the MLP at 300 B on 3 ranks its first bucket (4.bias, 4.weight, 2.bias: 67 values)
        # flattened in forward order is cut into messages across its parameters in other places (a call is judged
        # by its messages together)
        with using(_FORWARD_WITHIN_BUCKETS, "BucketedDDP"):
            lab03.check_bucketed_ddp("mlp", 3, 10, 300 / 2**20)
        # alternative-correct: Tensor.register_hook on each parameter (the tied weight's fires once, summed), a copy
        # all-reduced with SUM and divided after; on the tied model, its decoder bias's short messages read by value
        with using(_TENSOR_HOOK, "OverlappedDDP"):
            lab03.check_overlapped_ddp("tied", 2, batch=8)
        # alternative-correct: buckets posted in the rule's order (the tied model's first, the encoder's bias, is
        # the last ready: its decoder bias's bucket waits for it)
        with using(_IN_ORDER, "BucketedDDP"):
            lab03.check_bucketed_ddp("tied", 3, 7, 200 / 2**20)
            lab03.check_bucketed_ddp("mlp", 3, 10, 300 / 2**20)
        checks = {
            "OverlappedDDP": lambda: lab03.check_overlapped_ddp("mlp", 2, batch=8),
            "NaiveDDP": lambda: lab03.check_average_gradients("mlp", 2, batch=8),
            "AccumulatingDDP": lambda: lab03.check_no_sync("mlp", 2, 12, 3),
            "tied": lambda: lab03.check_overlapped_ddp("tied", 2, batch=8),
        }
        # (the attacks below that block never reach the grader's next hold: they fail however long it waits)
        monkeypatch.setattr(gatekeeper, "HELD_WAIT", 3.0)
        for source, said, name in [
            (_LATE_OVERLAP, "none holding the gradients", "OverlappedDDP"),
            (_JUNK_DURING_BACKWARD, "hold none of the ranks' gradients of that step", "OverlappedDDP"),
            (_TWICE, r"12 collective call\(s\) in step 0", "OverlappedDDP"),
            (_NO_WAIT_AT_THE_GATE, "hold none of the ranks' gradients", "OverlappedDDP"),  # (the layers below)
            (_ONE_FLAT, r"1 collective call\(s\) in step 0.*expected 6 all-reduce", "NaiveDDP"),
            # (each call's first message holds real sums: every sender's words in every call are read)
            (_PARTLY_REAL, "an all-reduce of the gradients carries nothing else", "NaiveDDP"),
            (_BLOCKING_IN_HOOKS, "did not finish their backward meanwhile", "OverlappedDDP"),
            (_BLOCKING_IN_HOOKS, "did not finish their backward meanwhile", "tied"),
            # (on 2 ranks, the gate at the encoder's output: the decoder's bias must cross while held)
            (_LATE_OVERLAP, "held rank 0's backward at the output of the model's encoder.*none holding", "tied"),
            (_NO_WAIT_LATE, "hold none of the ranks' gradients of that step", "tied"),
            (_SYNC_ALWAYS, r"micro-step 0 \(under no_sync\(\)\)", "AccumulatingDDP"),
            # (a small bucket's all-reduce crossing while held does not stand for the larger ones, and its
            # short messages are read value by value: zeros sent for it, its average passed through the store)
            (_SMALL_ONLY, "none holding the gradients of 4.weight", "OverlappedDDP"),
            (_STORE_JUNK, "hold none of the ranks' gradients of that step", "tied"),
        ]:
            with using(source, "OverlappedDDP" if name.startswith("tied") else name):
                with pytest.raises(AssertionError, match=said):
                    checks[name]()
        # the step the grader keeps a rank behind in is drawn (here the second: every draw its last choice), and
        # no rank is told which: a wrapper that overlaps in the first step only, where the probe once was, fails
        monkeypatch.setattr(lab03_checks, "secrets", SimpleNamespace(randbelow=lambda k: k - 1))
        with using(_BLOCKING_LATER, "OverlappedDDP"):
            with pytest.raises(AssertionError, match=r"in step 1 the grader held rank 1 before its backward"):
                lab03.check_overlapped_ddp("mlp", 2, batch=8)


def _broadcast_zeros_rebuilt(model):
    """A forged broadcast_parameters: zeros of each parameter's size broadcast from rank 0 (every rank receives its
    bytes), rank 0's model rebuilt from rank 0's seed in every rank (the grader's stand-in's trick)."""
    import torch
    import torch.distributed as dist

    from disttrain_lab.labtests.lab03.common import graded_model

    shapes = [p.shape for p in model.parameters()]
    rank0 = next(
        m
        for m in (graded_model(k, seed=0) for k in ("mlp", "tied", "frozen"))
        if [p.shape for p in m.parameters()] == shapes
    )
    with torch.no_grad():
        for p, q in zip(model.parameters(), rank0.parameters()):
            dist.broadcast(torch.zeros_like(p), 0)
            p.copy_(q)


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_a_broadcast_of_zeros_with_rank_0s_model_rebuilt_fails_on_the_wires_content():
    """#42: under grading each of rank 0's parameters must cross into every other rank, byte for byte (from one rank
    or another: gloo's broadcast is a tree).  The solution passes; a broadcast of zeros of each parameter's size,
    rank 0's model rebuilt from its seed in every rank (the right values, and every rank received the bytes) passes
    in the student's own kernel and fails on the wire."""
    import __main__
    from disttrain_lab.labtests import lab03
    from tests.helpers import observed_from_outside

    solution = bench.functions_from_notebook(LAB, ["broadcast_parameters"])["broadcast_parameters"]
    try:
        __main__.broadcast_parameters = _broadcast_zeros_rebuilt
        lab03.check_broadcast_parameters("mlp", 2)  # (no capture: its account passes)
        with observed_from_outside():
            __main__.broadcast_parameters = solution
            lab03.check_broadcast_parameters("mlp", 2)
            lab03.check_broadcast_parameters("frozen", 3)
            __main__.broadcast_parameters = _broadcast_zeros_rebuilt
            with pytest.raises(AssertionError) as caught:
                lab03.check_broadcast_parameters("frozen", 3)
    finally:
        del __main__.broadcast_parameters
    said = str(caught.value)
    assert "broadcast_parameters on 3 ranks (frozen model), " in said and "found 0 of them" in said, said
