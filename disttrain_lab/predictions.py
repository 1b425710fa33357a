"""Graded predictions: write down a number before you measure it.

Before a measurement, a lab asks for a prediction: a number (``PREDICTED_BUBBLE = ...``) or a
one-line function of the setting (``def predicted_ring_bytes(n, size): ...``).  The cell after
it measures the same quantity on real ranks and draws the two side by side
(``dl.viz.predicted_vs_measured``).

A prediction is right when it equals the lab's cost model **to three significant figures**
(``SIG``): both are written as ``f"{x:.2e}"`` and compared as text, so a student knows exactly
what counts (the self-check shows a prediction written that way).

The self-check (``check(name, value)``, or ``check(name, fn, cases)`` for a function) checks
only the prediction's **form**: a finite number, or a function that gives one at each of the
settings the graded test uses; it shows the values the graded test will compare, rounded as it
rounds them.  It does not know the answer: a self-check that held one (even as a salted digest
of the rounded value) could be made to tell it: a number to three figures has 900 candidates per
power of ten, and a program tries every one from 1e-10 to 1e10 in well under a second.  The
measurement after a prediction shows how close it is.
The graded test reads the student's value from the student's kernel as data (``fetch``,
through ``dl.exercise.run``) and compares it with the cost model computed in the test itself
(``assert_prediction``); no answer lives in this package or in the student's notebook.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from . import exercise
from .protocol import Driver
from .withheld import GIVES

__all__ = ["SIG", "rounded", "check", "fetch", "assert_prediction", "PredictionError"]

SIG = 3  # significant figures a prediction must get right


class PredictionError(AssertionError):
    """A prediction that is missing, not a number, or does not match the cost model."""


def as_number(value, what: str) -> float:
    """``value`` as a finite float, or a PredictionError saying what is wrong with it (None or ``...``: not
    filled in yet).  Public: a lab's own prediction checks read a number by the same rule."""
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
    value = as_number(value, "the value")
    return f"{value + 0.0:.{sig - 1}e}" if value != 0 else f"{0.0:.{sig - 1}e}"


def _values(name: str, value, cases: Sequence[tuple] | None) -> list[float]:
    """The numbers a prediction stands for: the value itself, or a function's value at each case."""
    __tracebackhide__ = True  # IPython: a student's error in the prediction ends at their line
    if value is None or value is Ellipsis:  # left blank, a number or a function alike
        as_number(value, name)
    if cases is None:
        if callable(value):
            raise PredictionError(f"{name} should be a number, got the function {getattr(value, '__name__', value)!r}")
        return [as_number(value, name)]
    if not callable(value):
        raise PredictionError(f"{name} should be a function of {len(cases[0])} arguments, got {type(value).__name__}")
    numbers = []
    for args in cases:  # (a loop, not a comprehension: its frame would show in the traceback)
        numbers.append(as_number(value(*args), f"{name}{tuple(args)}"))
    return numbers


def check(name: str, value, *args, cases: Sequence[tuple] | None = None) -> bool:
    """``check(name, value)`` or ``check(name, fn, cases)``: a notebook's self-check of a
    prediction's form: ``value`` is a finite number, or (with ``cases``, settings the graded test
    uses) a function that gives one at each case.  Prints the values the graded test will compare
    with the cost model, to ``SIG`` significant figures, and returns True; raises PredictionError,
    saying what is wrong, when the form is not right.  It never says whether a value is right:
    nothing here knows the answer."""
    __tracebackhide__ = True
    if args and isinstance(args[0], str):  # check(name, value, digest[, cases]): a notebook from before
        raise PredictionError(
            f"the self-check of {name} passes a digest of the answer, which this kit no longer reads: the "
            "notebook is from an older release; `disttrain-lab start` updates your copy (your edits are kept)"
        )
    if len(args) > 1 or (args and cases is not None):
        raise TypeError(f"check takes the prediction's name, its value and the cases; got {2 + len(args)} arguments")
    cases = args[0] if args else cases
    cases = None if cases is None else [tuple(c) for c in cases]
    values = _values(name, value, cases)
    if cases is None:
        shown, where = rounded(values[0]), ""
    else:
        shown = "; ".join(f"{tuple(c)}: {rounded(v)}" for c, v in zip(cases, values))
        where = " at these settings (and perhaps others)"
    print(
        f"\N{WHITE HEAVY CHECK MARK} your prediction of {name} is in a form the graded test reads ({shown}); it "
        f"compares it with the cost model to {SIG} significant figures{where}.  This check knows only the form, "
        "not the answer: work it out from the model in the text above; the measurement below shows how close you are."
    )
    return True


def _getter(name: str) -> Driver:
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
    return Driver(name=f"_prediction_{name}", source=source)


def fetch(name: str, cases: Sequence[tuple] | None = None, timeout: float = 30.0) -> list[float] | float:
    """The student's prediction ``name`` as numbers, read from where the student's code runs:
    the value of the notebook's variable, or (``cases``) the notebook's function at each case.
    Under grading this runs in the student's kernel (on one rank) and only numbers come back."""
    if not name.isidentifier():
        raise ValueError(f"name must be a variable or function of the notebook, got {name!r}")
    cases = None if cases is None else [tuple(c) for c in cases]
    result = exercise.run(_getter(name), 1, [(cases,)], timeout=timeout).results[0]
    if cases is None or result is None:  # None: left blank (a function still raising the stub's error too)
        return as_number(result, name)
    if not isinstance(result, list) or len(result) != len(cases):
        raise PredictionError(f"{name} should give one number per case, got {result!r:.80}")
    return [as_number(v, f"{name}{c}") for v, c in zip(result, cases)]


def assert_prediction(name: str, value, reference, cases: Sequence[tuple] | None = None) -> None:
    """A graded test: ``value`` (from ``fetch``) equals ``reference`` (the cost model, computed in
    the test) to ``SIG`` significant figures, case by case."""
    got = value if isinstance(value, list) else [value]
    want = list(reference) if isinstance(reference, (list, tuple)) else [reference]
    labels = [f"{name}{tuple(c)}" for c in cases] if cases is not None else [name]
    wrong = [
        f"{label}: predicted {rounded(g)}, {GIVES} {rounded(w)}"
        for label, g, w in zip(labels, got, want)
        if rounded(g) != rounded(w)
    ]
    if wrong:
        raise PredictionError(
            f"the prediction does not match the cost model to {SIG} significant figures: " + "; ".join(wrong)
        )
