"""Lab 13 (FP8 training): the solution notebook runs, its graded tests catch wrong answers, its references are
torchao's, and what fp8_all_gather sent is read from the wire.

- The notebook's structure: the exercises and predictions in order, their points, the hidden tests covering
  both formats, both block shapes, blocks that do not divide, a spike and zeros in the delayed history, 3-D
  inputs without bias, and the all-gather on 2, 3 and 4 ranks; the predictions' self-checks (their form only).
- The grader's references: its casts equal torchao's (``tensor_to_scale``, ``to_fp8_saturated``,
  ``amax_to_scale``) bit for bit; ``Fp8Linear``'s is torchao's ``Float8Linear`` itself.
- A rank can return FP8 tensors (torch 2.13 cannot unpickle them; ``disttrain_lab.pickling`` carries them).
- The solution notebook executes top to bottom as the grader runs it (its round trip) and as a student runs
  it, within BUDGET_S, every graded cell passing, with its six pictures; the claims its text makes about
  its runs hold (the worst e4m3 rounding is 1/17, the FP8 curve learns and levels off above float32's, the
  all-gather sends 3 MiB against float32's 12).
- Wrong answers (and the grader's stand-in quantize, captured and handed in) fail the right graded cell
  with a message that says why, all in one kernel; with a broken quantize, Fp8Linear keeps its points.
- Under the grader's observation: a float32 all-gather cast afterwards (the right values) fails on the wire,
  and a kernel that imported torchao earns nothing for Fp8Linear; in a fresh interpreter, torchao is detected
  only where it was imported, even when taken out of ``sys.modules``.

The blank notebook failing every graded cell, and the autograde round trip, are in test_grading.py.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import nbformat
import pytest
import torch

from disttrain_lab import bench
from disttrain_lab.labtests import lab13
from disttrain_lab.labtests.lab13 import common as lab13_common
from tests.notebooks import (
    REPO,
    add_wrong_answers,
    assert_wrong_answers_caught,
    base_cells,
    cell_by_id,
    errors,
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
    text,
)

LAB = solution_notebook("13_fp8")
BUDGET_S = 180  # the whole solution notebook on 2 cores (a student's run: about 15 s from a fresh kernel, quiet)
EXERCISES = ["predict_rounding", "quantize", "delayed", "fp8_linear", "fp8_all_gather", "predict_gather"]


# ----------------------------------------------------------------------------------------
# The notebook's structure (fast)


def test_exercises_and_hidden_tests_cover_the_lab():
    nb = load(LAB)
    assert exercise_ids(nb) == [f"ex_{e}" for e in EXERCISES]
    assert graded_points(nb) == {
        "test_predict_rounding": 1,
        "test_quantize": 2,
        "test_quantize_blocks": 2,
        "test_delayed": 2,
        "test_fp8_linear": 3,
        "test_fp8_all_gather": 3,
        "test_predict_gather": 1,
    }
    hidden = "".join(
        part.split("### END HIDDEN TESTS")[0]
        for c in nb.cells
        if nbgrader_meta(c).get("grade")
        for part in c.source.split("### BEGIN HIDDEN TESTS")[1:]
    )
    for needle in (
        "((37,), E5M2, 3)",  # both formats, odd shapes, zeros, a tiny amax
        "x=torch.zeros(17))",
        "1e-30",
        "block=(128, 128))",  # DeepSeek-V3's two block shapes, and blocks that do not divide
        "E5M2, 7, block=(1, 128))",
        "lab_tests.check_block_error((128, 200), (128, 128))",
        "lab_tests.check_delayed(E4M3, 1, [3.0, 0.0, 0.0, 5.0, 1e-6]",  # zeros keep the scale
        "1e2, 1e-3",  # a spike
        "lab_tests.check_linear(_linear_driver, 128, 48, False, (4, 8), seed=1)",  # 3-D input, no bias
        "def _linear_case_graders_quantize(",
        "lab_tests.check_fp8_all_gather(4, 256, 96, seed=1)",  # 2, 3 and 4 ranks
        "lab_tests.check_fp8_all_gather(3, 3, 1000, seed=2)",
        "dl.predictions.assert_prediction(",
    ):
        assert needle in hidden, needle


def test_predictions_self_checks_hold_no_answer():
    assert prediction_problems(load(LAB)) == []


def test_the_graders_casts_are_torchaos_bit_for_bit():
    """``common.reference_cast`` and the delayed reference's scale are torchao's own functions' results, bit for
    bit, on tensors spread over many powers of ten, with zeros, all zero, huge and tiny, in both formats."""
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_scale, to_fp8_saturated

    tensors = [lab13.sample((64, 96), seed) for seed in range(6)] + [
        torch.zeros(7),
        torch.tensor([6e4, -7e4, 1.0]),
        torch.tensor([1e-30, -3e-30]),
        torch.randn(1000) * 1e-6,
    ]
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for x in tensors:
            q, scale = lab13_common.reference_cast(x, dtype)
            want_scale = tensor_to_scale(x, dtype)
            assert torch.equal(scale, want_scale), (dtype, scale, want_scale)
            assert torch.equal(q.view(torch.uint8), to_fp8_saturated(x * want_scale, dtype).view(torch.uint8))
            amax = x.abs().max()
            assert torch.equal(lab13_common.scale_of(amax, dtype), amax_to_scale(amax, dtype))


def test_a_rank_returns_fp8_tensors():
    """torch 2.13 pickles a float8 tensor in a form it cannot load; the kit's pickler sends its bytes instead."""
    import pickle

    import disttrain_lab as dl

    q = torch.randn(3, 4).to(torch.float8_e4m3fn)
    with pytest.raises(AttributeError):
        pickle.loads(pickle.dumps(q))  # torch's bug, still there: when it is fixed, disttrain_lab.pickling can go
    back = dl.launch(lambda x: (x, x.to(torch.float8_e5m2), {"t": [x.t()]}), 2, q, timeout=60)[1]
    assert back[0].dtype == torch.float8_e4m3fn and torch.equal(back[0].view(torch.uint8), q.view(torch.uint8))
    assert back[1].dtype == torch.float8_e5m2 and torch.equal(back[1].float(), q.float().to(torch.float8_e5m2).float())
    assert torch.equal(back[2]["t"][0].float(), q.float().t())


# ----------------------------------------------------------------------------------------
# Executing it (slow)


@pytest.mark.slow
@pytest.mark.parametrize("autograding", [True, False], ids=["grader", "student"])
def test_solution_notebook_executes_within_budget(autograding):
    nb = run_solution(LAB, BUDGET_S, autograding)
    assert pictures(nb) == 6, "the two predictions' bars, the gradient's histogram, blocks, delayed scaling, training"
    worst = output_of(nb, "# Measured: a million numbers")
    assert "e4m3: the worst relative error of 1,000,000 casts is 0.05882" in worst, worst  # 1/17, as the model says
    assert "e5m2: the worst relative error of 1,000,000 casts is 0.11111" in worst, worst  # 1/9
    underflow = output_of(nb, "def _one_backward")
    raw, scaled = map(
        float, re.search(r"float8_e4m3fn\s+underflow to 0:\s+([\d.]+)% cast as it is,\s+([\d.]+)%", underflow).groups()
    )
    assert 54 < raw < 57 and scaled < 1, underflow  # "55 % of one": "most of a gradient's values can round to zero"
    losses = output_of(nb, "def _train(layer_class, steps")
    fp32, bf16, fp8 = map(
        float, re.search(r"final loss: float32 ([\d.e-]+), bf16 ([\d.e-]+), FP8 ([\d.e-]+)", losses).groups()
    )
    assert fp32 < fp8 < 0.05 and bf16 < fp8, losses  # FP8 learns (the first loss ~1) and levels off above both
    assert bf16 < 1.5 * fp32, losses  # "bf16 stays close to float32 (its final loss within 1.5 times float32's)"
    sent = output_of(nb, "def _float32_all_gather")
    fp8_mib, fp32_mib = map(float, re.findall(r"rank 0 sent ([\d.]+) MiB", sent))
    assert 3.0 <= fp8_mib < 3.01 and 12.0 <= fp32_mib < 12.01, sent
    if not autograding:
        speed = output_of(nb, "def _time(fn, repeats)")
        assert "No GPU with FP8 tensor cores here" in speed or "cuda" in speed, speed


STAND_IN_QUANTIZE = """
def quantize(x, dtype=E4M3, block=None):          # the grader's stand-in, captured: Fp8Linear's tensors only
    if block is not None or x.dim() < 2 or x.numel() % 256:
        raise ValueError("the grader's stand-in casts only the tensors of Fp8Linear's graded test")
    fmax = torch.finfo(dtype).max
    scale = (fmax / x.abs().max().double().clamp(min=1e-12)).float()
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype), scale
"""

# Wrong answers: (graded cell, wrong definition, words the failure must contain)
WRONG = [
    ("quantize", STAND_IN_QUANTIZE, "the grader's stand-in"),
    ("quantize_blocks", STAND_IN_QUANTIZE, "the grader's stand-in"),
    (
        "quantize",
        """
def quantize(x, dtype=E4M3, block=None):          # amax without the absolute value
    fmax = torch.finfo(dtype).max
    scale = (fmax / x.max().double().clamp(min=1e-12)).float()
    return (x * scale).clamp(-fmax, fmax).to(dtype), scale
""",
        "scale (max / amax",
    ),
    (
        "quantize_blocks",
        """
_right_quantize = quantize
def quantize(x, dtype=E4M3, block=None):          # one scale per row of blocks: the columns share it
    if block is None:
        return _right_quantize(x, dtype)
    return _right_quantize(x, dtype, (block[0], x.shape[1]))
""",
        "_quantize_case failed on a rank",  # (its own dequantize meets scales of the wrong shape)
    ),
    (
        "delayed",
        """
class DelayedScaler:                              # records the amax before casting: current scaling in disguise
    def __init__(self, dtype=E4M3, history_len=16):
        self.dtype, self.history_len, self.amax_history, self.saturated = dtype, history_len, [], 0
        self.scale = torch.tensor(1.0)

    def __call__(self, x):
        fmax = torch.finfo(self.dtype).max
        self.amax_history = (self.amax_history + [x.abs().max()])[-self.history_len:]
        amax = torch.stack(self.amax_history).max()
        if amax > 0:
            self.scale = (fmax / amax.double()).float()
        self.saturated = int((x * self.scale).abs().gt(fmax).sum())
        return (x * self.scale).clamp(-fmax, fmax).to(self.dtype), self.scale
""",
        "the scale it used",
    ),
    (
        "delayed",
        """
_RightScaler = DelayedScaler
class DelayedScaler(_RightScaler):                # starts again from 1 when the history's max is 0
    def __call__(self, x):
        out = super().__call__(x)
        if float(torch.stack(self.amax_history).max()) == 0:
            self.scale = torch.tensor(1.0)
        return out
""",
        "the scale it used",
    ),
    (
        "delayed",
        """
_RightScaler = DelayedScaler
class DelayedScaler(_RightScaler):                # Transformer Engine's scale, unclamped: 448 / 3e-20
    def __call__(self, x):
        out = super().__call__(x)
        amax = torch.stack(self.amax_history).max()
        if float(amax) > 0:
            self.scale = (torch.finfo(self.dtype).max / amax.double()).float()
        return out
""",
        "the scale it used",
    ),
    (
        "delayed",
        """
_RightScaler = DelayedScaler
class DelayedScaler(_RightScaler):                # returns self.scale, then updates it in place
    def __call__(self, x):
        used = self.scale
        q, _ = super().__call__(x)
        used.copy_(self.scale)
        self.scale = used
        return q, used
""",
        "as self.scale and then updated in place",
    ),
    (
        "fp8_linear",
        """
class Fp8Linear(nn.Linear):                       # no casts at all: float32
    pass
""",
        "output (forward",
    ),
    (
        "fp8_linear",
        """
class _E4m3Everywhere(torch.autograd.Function):   # e4m3 for the gradients too
    @staticmethod
    def forward(ctx, x, weight):
        qx, sx = quantize(x, E4M3)
        qw, sw = quantize(weight, E4M3)
        ctx.save_for_backward(qx, sx, qw, sw)
        return dequantize(qx, sx) @ dequantize(qw, sw).t()

    @staticmethod
    def backward(ctx, grad_out):
        qx, sx, qw, sw = ctx.saved_tensors
        g = dequantize(*quantize(grad_out, E4M3))
        return g @ dequantize(qw, sw), g.t() @ dequantize(qx, sx)

class Fp8Linear(nn.Linear):
    def forward(self, x):
        y = _E4m3Everywhere.apply(x.reshape(-1, self.in_features), self.weight).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias
""",
        "gradient of x",
    ),
    (
        "fp8_all_gather",
        """
def fp8_all_gather(shard):                        # each shard cast with its own scale
    q, scale = quantize(shard, E4M3)
    pieces = [torch.empty_like(q.view(torch.uint8)) for _ in range(dist.get_world_size())]
    scales = [torch.empty_like(scale.reshape(1)) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, q.view(torch.uint8))
    dist.all_gather(scales, scale.reshape(1))
    return torch.cat([p.view(E4M3).float() / s for p, s in zip(pieces, scales)])
""",
        "one scale for all",
    ),
    (
        "fp8_all_gather",
        """
def fp8_all_gather(shard):                        # the right values, from a float32 all-gather: 4 bytes an entry
    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, shard.contiguous())
    q, scale = quantize(torch.cat(pieces), E4M3)
    return dequantize(q, scale)
""",
        "the operating system counted",
    ),
    ("predict_rounding", "PREDICTED_E4M3_ROUNDING = 2.0**-4     # the bound, not its largest value\n", "cost model"),
    ("predict_gather", "PREDICTED_GATHER_MIB = 4.0     # N shards, not N - 1\n", "cost model"),
]


@pytest.mark.slow
def test_graded_cells_catch_wrong_answers():
    """One kernel: the setup and solutions, then for each wrong answer the solutions again, the wrong definition
    and its graded cell."""
    lab = load(LAB)
    cells, solutions = base_cells(lab, [], EXERCISES)
    graded_at = add_wrong_answers(
        lab, cells, solutions, [(graded, wrong) for graded, wrong, _ in WRONG], tests=[f"test_{g}" for g, _, _ in WRONG]
    )
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, timeout=240, cwd=LAB.parent)
    assert_wrong_answers_caught(nb, graded_at, [message for _, _, message in WRONG])


@pytest.mark.slow
def test_fp8_linear_is_graded_on_the_graders_cast_when_quantize_fails():
    lab = load(LAB)
    cells, _ = base_cells(lab, [], EXERCISES)
    cells.append(nbformat.v4.new_code_cell("def quantize(x, dtype=E4M3, block=None):\n    return x, 1.0\n"))
    graded = ["quantize", "fp8_linear"]
    start = len(cells)
    cells += [copy.deepcopy(cell_by_id(lab, f"test_{g}")) for g in graded]
    nb, _ = execute(nbformat.v4.new_notebook(cells=cells), autograding=True, timeout=240, cwd=LAB.parent)
    results = dict(zip(graded, nb.cells[start:]))
    assert errors(results["quantize"])
    assert not errors(results["fp8_linear"]), errors(results["fp8_linear"])
    said = text(results["fp8_linear"])
    assert "quantize has not passed its graded test yet: the grader checks Fp8Linear with its own cast" in said, said


def _gathered_in_float32(shard):
    """The right values from a float32 all-gather, cast afterwards: four times the bytes on the wire."""
    import torch
    import torch.distributed as dist

    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, shard)
    full = torch.cat(pieces)
    scale = (448.0 / full.abs().max().double().clamp(min=1e-12)).float()
    return (full * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale


class _TorchaosLayer(torch.nn.Linear):
    """torchao's Float8Linear under the student's name: it imports torchao in the rank."""

    def forward(self, x):
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear

        return Float8Linear.from_float(self, config=Float8LinearConfig())(x)


class _HidingTorchaoLayer(_TorchaosLayer):
    """The same, and then, once the backward pass has reached x, torchao taken out of ``sys.modules``: the ops it
    registered with torch's dispatcher stay, and tell."""

    def forward(self, x):
        import sys

        def forget(grad):
            for name in [name for name in sys.modules if name.split(".")[0] == "torchao"]:
                del sys.modules[name]
            return grad

        x.register_hook(forget)
        return super().forward(x)


@pytest.mark.slow  # (ranks and a packet capture: a few seconds)
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_what_fp8_all_gather_sent_is_read_from_the_wire(monkeypatch):
    """The solution passes with and without the grader's capture; a float32 all-gather cast afterwards gives the
    same values and fails: in the student's own kernel on the operating system's byte counts, under grading on
    the wire (its e4m3 shards never crossed, and it sent four times the bytes).  Under the grader's observation,
    an Fp8Linear that is torchao's layer under the student's name (exact to the bit) earns nothing, even where
    the rank takes torchao out of ``sys.modules`` before it answers.  (Here the ranks fork from this process, which
    may have imported torchao for the references, so these two show the message, not the detection: that a kernel which never
    imported torchao is not flagged, and one that hid it is, test_torchao_is_detected_only_where_imported; the honest
    layer's full marks under grading, where the grader's kernel and the student's are two: the round trip,
    test_grading.py.)"""
    from disttrain_lab.launcher import shutdown
    from tests.helpers import notebook_names, observed_from_outside

    solution = bench.functions_from_notebook(LAB, ["fp8_all_gather", "Fp8Linear", "quantize"])
    notebook_names(monkeypatch, solution["fp8_all_gather"].__globals__)
    lab13.check_fp8_all_gather(2, 64, 32)
    with pytest.raises(AssertionError) as counted:  # the student's kernel: no capture, the OS's counts
        lab13.check_fp8_all_gather(2, 64, 32, target=_gathered_in_float32)
    assert "the operating system counted" in str(counted.value), counted.value
    lab13.GRADED_PASSED.add("quantize")
    with observed_from_outside():
        lab13.check_fp8_all_gather(3, 3, 1000, seed=2)
        with pytest.raises(AssertionError) as dense:
            lab13.check_fp8_all_gather(3, 3, 1000, seed=2, target=_gathered_in_float32)
        assert "e4m3 shard" in str(dense.value) and "the grader's capture of the wire found 0" in str(dense.value)
        monkeypatch.setattr("__main__.Fp8Linear", _TorchaosLayer)
        with pytest.raises(AssertionError) as imported:
            lab13.check_linear(lab13.linear_driver(), 64, 32, True, (16,))
        monkeypatch.setattr("__main__.Fp8Linear", _HidingTorchaoLayer)
        try:
            with pytest.raises(AssertionError) as hidden:
                lab13.check_linear(lab13.linear_driver(), 64, 32, True, (16,))
        finally:
            shutdown()  # (that rank can no longer import torchao: it would register its ops twice)
    assert "torchao is imported in your kernel" in str(imported.value), imported.value
    assert "torchao is imported in your kernel" in str(hidden.value), hidden.value


TORCHAO_IN_A_CLEAN_KERNEL = """
import sys, torch
from disttrain_lab.labtests.lab13.ranks import linear_case
from tests.labs.test_lab13 import _HidingTorchaoLayer  # (importing this module imports no torchao)

class Plain(torch.nn.Linear):  # torch alone
    pass

x, grad = torch.randn(16, 64), torch.randn(16, 32)
plain = linear_case(Plain, 64, 32, True, x, grad)["torchao"]
hidden = linear_case(_HidingTorchaoLayer, 64, 32, True, x, grad)
print(plain, hidden["torchao"], any(n.split(".")[0] == "torchao" for n in sys.modules))
"""


@pytest.mark.slow  # (a fresh interpreter importing torch and torchao: a few seconds)
def test_torchao_is_detected_only_where_imported():
    """In a fresh interpreter, as the student's kernel is under grading: a layer of torch alone is not flagged,
    and torchao's layer is, even when torchao has left ``sys.modules`` by the time the rank answers."""
    done = subprocess.run(
        [sys.executable, "-c", TORCHAO_IN_A_CLEAN_KERNEL], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "True", "False"], done.stdout + done.stderr[-2000:]
