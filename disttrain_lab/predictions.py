"""Graded predictions: write down a number before you measure it.

Before a measurement, a lab asks for a prediction: a number (``PREDICTED_BUBBLE = ...``) or a
one-line function of the setting (``def predicted_ring_bytes(n, size): ...``).  The cell after
it measures the same quantity on real ranks and draws the two side by side
(``dl.viz.predicted_vs_measured``).

A prediction is right when it equals the lab's cost model **to three significant figures**
(``SIG``): both are written as ``f"{x:.2e}"`` and compared as text, so the self-check and the
graded test apply the same rule and a student knows exactly what counts.

The self-check never shows the answer: the notebook holds only a salted digest of the
rounded answer (``check(name, value, digest)``), and says whether the prediction matches it.
The graded test reads the student's value from the student's kernel as data (``fetch``,
through ``dl.exercise.run``) and compares it with the cost model computed in the test itself
(``assert_prediction``); no answer lives in this package.

An author makes the digest of an answer with ``digest(name, value)``::

    >>> digest("bubble p=4 m=8", 3 / 11)
    '...'
"""

from __future__ import annotations

import hashlib
import math
import numbers
import re
from collections.abc import Sequence

import torch

from . import exercise

__all__ = ["SIG", "rounded", "digest", "check", "fetch", "assert_prediction", "withhold_expected", "PredictionError"]

SIG = 3  # significant figures a prediction must get right


class PredictionError(AssertionError):
    """A prediction that is missing, not a number, or does not match the cost model."""


def _number(value, what: str) -> float:
    """``value`` as a finite float, or a PredictionError saying what is wrong with it."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if value is None or value is Ellipsis:
        raise PredictionError(
            f"{what} is not filled in yet: in its cell, replace `raise NotImplementedError()` with your "
            "prediction (a number) and run the cell"
        )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PredictionError(f"{what} should be a number, got {type(value).__name__} {value!r:.60}")
    value = float(value)
    if not math.isfinite(value):
        raise PredictionError(f"{what} should be a finite number, got {value}")
    return value


def rounded(value: float, sig: int = SIG) -> str:
    """``value`` to ``sig`` significant figures, as the text both checks compare:
    ``rounded(3 / 11) == '2.73e-01'``; ``rounded(-0.0) == rounded(0) == '0.00e+00'``."""
    value = _number(value, "the value")
    return f"{value + 0.0:.{sig - 1}e}" if value != 0 else f"{0.0:.{sig - 1}e}"


def _values(name: str, value, cases: Sequence[tuple] | None) -> list[float]:
    """The numbers a prediction stands for: the value itself, or a function's value at each case."""
    __tracebackhide__ = True  # IPython: a student's error in the prediction ends at their line
    if value is None or value is Ellipsis:  # left blank, a number or a function alike
        _number(value, name)
    if cases is None:
        if callable(value):
            raise PredictionError(f"{name} should be a number, got the function {getattr(value, '__name__', value)!r}")
        return [_number(value, name)]
    if not callable(value):
        raise PredictionError(f"{name} should be a function of {len(cases[0])} arguments, got {type(value).__name__}")
    numbers = []
    for args in cases:  # (a loop, not a comprehension: its frame would show in the traceback)
        numbers.append(_number(value(*args), f"{name}{tuple(args)}"))
    return numbers


def digest(name: str, value, cases: Sequence[tuple] | None = None) -> str:
    """The salted digest of ``value`` rounded to ``SIG`` figures (or of ``value(*c)`` for each
    case ``c``), as a notebook's self-check holds it instead of the answer."""
    __tracebackhide__ = True
    text = name + ":" + ",".join(rounded(v) for v in _values(name, value, cases))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def check(name: str, value, expected_digest: str, cases: Sequence[tuple] | None = None) -> bool:
    """A notebook's self-check: print whether ``value`` (or the function ``value`` at each of
    ``cases``) equals the cost model to ``SIG`` significant figures, without saying the answer.
    Returns whether it does.  Raises PredictionError when the prediction is not a number."""
    __tracebackhide__ = True
    ok = digest(name, value, cases) == expected_digest
    if ok:
        print(
            f"\N{WHITE HEAVY CHECK MARK} your prediction of {name} matches the cost model to {SIG} significant figures"
        )
    else:
        shown = ", ".join(rounded(v) for v in _values(name, value, cases))
        print(
            f"\N{CROSS MARK} your prediction of {name} ({shown}) does not match the cost model to {SIG} "
            "significant figures. Work it out again from the model in the text above (the graded test "
            "applies the same rule); the measurement below shows how close you are."
        )
    return ok


def _getter(name: str) -> dict:
    """A driver for ``dl.exercise.run`` that reads the notebook's ``name``: the variable's value,
    or the function's value at each case.  What crosses back is numbers, as data."""
    source = (
        f"def _prediction_{name}(cases):\n"
        "    def plain(v):  # a number, None for a blank, else its repr (the test says what is wrong)\n"
        "        if v is None or v is Ellipsis:\n"
        "            return None\n"
        "        try:\n"
        "            return v if isinstance(v, (int, float)) else float(v)\n"
        "        except Exception:\n"
        "            return repr(v)[:80]\n"
        "    try:\n"
        f"        value = {name}\n"
        "    except NameError:  # the prediction's cell has not run: the same as left blank\n"
        "        value = None\n"
        "    if value is None or value is Ellipsis:\n"
        "        return None\n"
        "    try:\n"
        "        return plain(value) if cases is None else [plain(value(*case)) for case in cases]\n"
        "    except NotImplementedError:  # the prediction's function is still the release's stub: blank\n"
        "        return None\n"
    )
    return {"name": f"_prediction_{name}", "source": source}


def fetch(name: str, cases: Sequence[tuple] | None = None, timeout: float = 30.0) -> list[float] | float:
    """The student's prediction ``name`` as numbers, read from where the student's code runs:
    the value of the notebook's variable, or (``cases``) the notebook's function at each case.
    Under grading this runs in the student's kernel (on one rank) and only numbers come back."""
    if not name.isidentifier():
        raise ValueError(f"name must be a variable or function of the notebook, got {name!r}")
    cases = None if cases is None else [tuple(c) for c in cases]
    result = exercise.run(_getter(name), 1, [(cases,)], timeout=timeout).results[0]
    if cases is None or result is None:  # None: left blank (a function still raising the stub's error too)
        return _number(result, name)
    if not isinstance(result, list) or len(result) != len(cases):
        raise PredictionError(f"{name} should give one number per case, got {result!r:.80}")
    return [_number(v, f"{name}{c}") for v, c in zip(result, cases)]


def assert_prediction(name: str, value, reference, cases: Sequence[tuple] | None = None) -> None:
    """A graded test: ``value`` (from ``fetch``) equals ``reference`` (the cost model, computed in
    the test) to ``SIG`` significant figures, case by case."""
    got = value if isinstance(value, list) else [value]
    want = list(reference) if isinstance(reference, (list, tuple)) else [reference]
    labels = [f"{name}{tuple(c)}" for c in cases] if cases is not None else [name]
    wrong = [
        f"{label}: predicted {rounded(g)}, {_GIVES} {rounded(w)}"
        for label, g, w in zip(labels, got, want)
        if rounded(g) != rounded(w)
    ]
    if wrong:
        raise PredictionError(
            f"the prediction does not match the cost model to {SIG} significant figures: " + "; ".join(wrong)
        )


_GIVES = "the cost model gives"  # before each expected value in assert_prediction's message
_EXPECTED = re.compile(re.escape(_GIVES) + r" [-+]?\d\.\d+e[-+]\d+")


def withhold_expected(message: str, instead: str = "a different value") -> str:
    """``message`` with every expected value of ``assert_prediction``'s replaced by ``instead``:
    feedback that says a prediction is wrong without saying what is right (the grader's feedback
    before the deadline, where a student may still resubmit).

        >>> withhold_expected("bubble: predicted 2.00e-01, the cost model gives 2.73e-01")
        'bubble: predicted 2.00e-01, the cost model gives a different value'
    """
    return _EXPECTED.sub(lambda _: f"{_GIVES} {instead}", message)
