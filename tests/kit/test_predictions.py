"""Graded predictions (disttrain_lab.predictions): the rounding rule, a self-check that checks
the form and knows no answer, and reading a prediction from the notebook as data."""

from __future__ import annotations

import hashlib
import re
import time

import nbformat
import pytest
import torch

import __main__
from disttrain_lab import predictions, withheld
from disttrain_lab.predictions import PredictionError
from tests.helpers import REPO
from tests.notebooks import self_check_problems


def test_rounding_rule_is_three_significant_figures():
    assert predictions.rounded(3 / 11) == "2.73e-01"
    assert predictions.rounded(0.2727) == predictions.rounded(3 / 11)
    assert predictions.rounded(0.2724) != predictions.rounded(3 / 11)
    assert predictions.rounded(-0.0) == predictions.rounded(0) == "0.00e+00"
    assert predictions.rounded(12_582_912) == "1.26e+07"
    assert predictions.rounded(torch.tensor(2.0)) == "2.00e+00"


def test_a_self_check_knows_no_answer(capsys):
    # right and wrong get the same verdict and the same words: only the student's own value differs,
    # written as the graded test will read it; nothing passed to the check could hold the answer
    assert predictions.check("bubble", 0.2727) and predictions.check("bubble", 0.25)
    right, wrong = capsys.readouterr().out.splitlines()
    assert "(2.73e-01)" in right and "(2.50e-01)" in wrong
    assert right.replace("2.73e-01", "X") == wrong.replace("2.50e-01", "X")
    assert not hasattr(predictions, "digest")


def test_function_predictions_are_checked_for_form_case_by_case(capsys):
    cases = [(4, 8), (8, 32)]
    assert predictions.check("bubble_fn", lambda p, m: (p - 1) / (m + p - 1), cases)
    assert predictions.check("bubble_fn", lambda p, m: (p - 1) / m, cases)  # wrong, and in the right form
    right, wrong = capsys.readouterr().out.splitlines()
    assert "(4, 8): 2.73e-01; (8, 32): 1.79e-01" in right and "(4, 8): 3.75e-01; (8, 32): 2.19e-01" in wrong
    assert re.sub(r"\d\.\d\de-\d\d", "X", right) == re.sub(r"\d\.\d\de-\d\d", "X", wrong)
    with pytest.raises(PredictionError, match="should be a function"):
        predictions.check("bubble_fn", 0.3, cases)
    with pytest.raises(PredictionError, match=r"bubble_fn\(8, 32\) should be a finite number"):
        predictions.check("bubble_fn", lambda p, m: float("inf") if p == 8 else 0.5, cases)
    with pytest.raises(TypeError):  # a function of the wrong number of arguments: Python's own words
        predictions.check("bubble_fn", lambda p: p, cases)


def test_an_old_notebooks_self_check_with_a_digest_is_told_to_update():
    # the three shapes older releases wrote: a number, a function with its cases by place or by name
    for args, kwargs in [
        ((0.3, "70a6682af5aeac086691"), {}),
        ((max, "70a6682af5aeac086691", [(4, 8)]), {}),
        ((max, "70a6682af5aeac086691"), {"cases": [(4, 8)]}),
    ]:
        with pytest.raises(PredictionError, match="older release.*disttrain-lab start"):
            predictions.check("bubble", *args, **kwargs)
    assert predictions.check("bubble_fn", max, cases=[(4, 8)]) and predictions.check("bubble_fn", max, [(4, 8)])


def test_a_digest_of_a_three_figure_answer_is_found_by_search_fast():
    # why a self-check holds no digest: every 3-figure number from 1e-10 to 1e10 is hashed in well under a second
    def digest(value):  # the salted digest the kit's self-checks held until they checked only the form
        return hashlib.sha256(f"bubble:{predictions.rounded(value)}".encode()).hexdigest()[:20]

    held = digest(3 / 11)
    start = time.perf_counter()
    found = next(
        f"{m / 100:.2f}e{e:+03d}"
        for e in range(-10, 11)
        for m in range(100, 1000)
        if digest(float(f"{m / 100:.2f}e{e:+03d}")) == held
    )
    assert found == "2.73e-01" and time.perf_counter() - start < 5.0


@pytest.mark.parametrize(
    "value, message",
    [
        (..., "not filled in yet"),
        (None, "not filled in yet"),
        ("0.3", "should be a number"),
        (True, "number"),
        (float("nan"), "finite"),
    ],
)
def test_not_a_number_is_named(value, message):
    with pytest.raises(PredictionError, match=message):
        predictions.check("x", value)


def test_fetch_reads_the_notebook_value_as_data(monkeypatch):
    monkeypatch.setattr(__main__, "PREDICTED_X", 0.2727, raising=False)
    monkeypatch.setattr(__main__, "predicted_f", lambda p, m: (p - 1) / (m + p - 1), raising=False)
    monkeypatch.setattr(__main__, "PREDICTED_BLANK", ..., raising=False)
    monkeypatch.setattr(__main__, "PREDICTED_TEXT", "a lot", raising=False)

    def predicted_stub(p, m):
        raise NotImplementedError()  # what the release leaves in a function prediction's cell

    monkeypatch.setattr(__main__, "predicted_stub", predicted_stub, raising=False)
    value = predictions.fetch("PREDICTED_X")
    predictions.assert_prediction("bubble", value, 3 / 11)
    cases = [(4, 8), (8, 32)]
    values = predictions.fetch("predicted_f", cases)
    predictions.assert_prediction("bubble", values, [3 / 11, 7 / 39], cases)
    with pytest.raises(
        PredictionError, match=r"predicted_f\(8, 32\): predicted 1.79e-01, the cost model gives 2.00e-01"
    ):
        predictions.assert_prediction("predicted_f", values, [3 / 11, 0.2], cases)
    with pytest.raises(PredictionError, match="not filled in yet"):
        predictions.fetch("PREDICTED_BLANK")
    with pytest.raises(PredictionError, match="not filled in yet"):
        predictions.fetch("PREDICTED_NEVER_DEFINED")
    with pytest.raises(PredictionError, match="predicted_never_defined is not filled in yet"):
        predictions.fetch("predicted_never_defined", cases)  # a function prediction left blank
    with pytest.raises(PredictionError, match="predicted_g is not filled in yet"):
        predictions.check("predicted_g", None, cases)
    with pytest.raises(PredictionError, match="should be a number, got str"):
        predictions.fetch("PREDICTED_TEXT")
    with pytest.raises(PredictionError, match="predicted_stub is not filled in yet"):
        predictions.fetch("predicted_stub", cases)


def test_a_failed_predictions_message_can_withhold_every_expected_value():
    # the feedback before the deadline says which cases are wrong and what the student wrote, not the answers
    with pytest.raises(PredictionError) as err:
        predictions.assert_prediction("predicted_f", [0.5, -0.25], [3 / 11, -0.2], [(4, 8), (8, 32)])
    message = str(err.value)
    assert "the cost model gives 2.73e-01" in message and "the cost model gives -2.00e-01" in message
    hidden = withheld.withhold_expected(message, "a different value")
    assert hidden == (
        "the prediction does not match the cost model to 3 significant figures: predicted_f(4, 8): predicted "
        "5.00e-01, the cost model gives a different value; predicted_f(8, 32): predicted -2.50e-01, the cost "
        "model gives a different value"
    )
    assert withheld.withhold_expected(hidden) == hidden  # nothing left to withhold


@pytest.mark.parametrize("lab", sorted(p.parent.name for p in (REPO / "labs").glob("*/*.ipynb")))
def test_no_released_self_check_holds_an_answer(lab):
    # what a student's kernel receives: the released notebook's self-checks pass only the name, the
    # value and the cases, and no code cell holds a hex string that could be a digest
    [path] = (REPO / "labs" / lab).glob("*.ipynb")
    problems, calls = self_check_problems(nbformat.read(path, as_version=4))
    assert problems == [] and calls, (problems, calls)
