"""What every check of lab 13 shares: its constants, which earlier exercises passed their graded cells
(``GRADED_PASSED``), the grader's reference (torchao's FP8 recipe), and running a case."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import torch

from ... import exercise
from ...exercise import ExerciseRun
from .. import common

# the exercises whose graded cell passed (in this kernel): a later exercise runs on the student's earlier
# piece only then, else on the grader's own (one mistake costs one exercise's points)
GRADED_PASSED: set[str] = set()

TIMEOUT = 60  # seconds a test's run may take
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_HINT = "do all ranks make the same collective calls, with tensors of the same sizes?"


def run(target: str | Callable, n: int, inputs, case: str, **options) -> ExerciseRun:
    """``target`` on n ranks; ranks that do not finish fail the test, saying which case."""
    return common.run_or_fail(target, n, inputs, case, _HINT, timeout=TIMEOUT, **options)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Within: torchao's notes on its import and first use (which of its CUDA kernels it could not load, torch's
    pytree deprecation of an Enum it registers) go nowhere; nbgrader zeroes a test cell that writes to stderr."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            for logger in loggers:
                logger.setLevel(logging.ERROR)
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def torchao() -> SimpleNamespace:
    """The reference of ``Fp8Linear``: torchao's float8 training recipe (``torchao.float8``), imported where
    the check runs (the grader's kernel; the student's, when a graded cell is run there).  Without it that
    check cannot be decided, and it fails, saying so (the instructor's ``grader`` extra installs it)."""
    try:
        with quiet():
            from torchao.float8 import Float8LinearConfig
            from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:
        if exercise.graded():
            raise AssertionError(
                "the grader cannot check Fp8Linear: torchao, its reference (torchao.float8.Float8Linear), is not "
                f"installed in the grader's environment ({e}); the instructor installs it with "
                "`pip install 'disttrain-lab[grader]'`"
            ) from None
        raise AssertionError(
            "this graded test compares your Fp8Linear with torchao's Float8Linear, and torchao is not installed in "
            "this kernel: the grader has it, and `pip install torchao` runs the test here too (then restart the "
            "kernel before grading: a kernel that imported torchao earns no points for Fp8Linear)"
        ) from None
    return SimpleNamespace(Float8Linear=Float8Linear, Float8LinearConfig=Float8LinearConfig)


def scale_of(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale of current scaling, as torchao's ``float8_utils.amax_to_scale`` makes it: the format's largest
    value over amax (at least 1e-12), divided in float64, then float32."""
    return (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()


def saturated_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's ``float8_utils.to_fp8_saturated``: clamp to the format's range, then cast."""
    fmax = torch.finfo(dtype).max
    return x.clamp(-fmax, fmax).to(dtype)


def reference_cast(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Current (dynamic) tensorwise scaling of ``x``, as torchao's ``tensor_to_scale`` and ``to_fp8_saturated``
    cast it (tests/labs/test_lab13.py holds the two equal, bit for bit): (the FP8 tensor, its scale)."""
    scale = scale_of(x.abs().max(), dtype)
    return saturated_cast(x.float() * scale, dtype), scale


def reference_blocks(x: torch.Tensor, dtype: torch.dtype, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's tensorwise cast applied to each ``block`` of ``x`` on its own: (the FP8 tensor, the scale of
    each block, a (rows / block rows, cols / block cols) tensor)."""
    br, bc = block
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=dtype)
    scales = torch.empty(rows // br, cols // bc)
    for i in range(rows // br):
        for j in range(cols // bc):
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc], scales[i, j] = reference_cast(
                x[i * br : (i + 1) * br, j * bc : (j + 1) * bc], dtype
            )
    return q, scales


def assert_bits(got, want: torch.Tensor, what: str, source: tuple | None = None) -> None:
    """``got`` is an FP8 tensor of ``want``'s dtype and shape, equal to it bit for bit; else say where it
    first differs and how many entries do, and, given ``source = (x, scale)`` (the scale per entry, or one),
    what was cast there."""
    assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: expected a {want.dtype} tensor of shape {tuple(want.shape)}, got "
        + (f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__)
    )
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    if bool(differ.any()):
        first = tuple(int(i) for i in differ.nonzero()[0])
        cast = ""
        if source is not None:
            x, scale = source
            at = float(x[first]) if x.dim() else float(x)
            s = float(scale.expand(x.shape)[first]) if scale.dim() else float(scale)
            cast = (
                f" (x there is {at:.6g}, x · scale = {at * s:.6g} with scale {s:.6g}: the expected value is that"
                f" product clamped to ±{torch.finfo(want.dtype).max:g}, rounded to the nearest {want.dtype},"
                " ties to even)"
            )
        raise AssertionError(
            f"{what}: {int(differ.sum())} of {want.numel()} entries differ from the reference cast; the first at "
            f"{first}: {float(got[first].float()):g}, expected {float(want[first].float()):g}{cast}"
        )
