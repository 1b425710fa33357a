"""Graded predictions (disttrain_lab.predictions): the rounding rule, the digest a self-check
holds instead of the answer, and reading a prediction from the notebook as data."""

from __future__ import annotations

import pytest
import torch

import __main__
from disttrain_lab import predictions
from disttrain_lab.predictions import PredictionError


def test_rounding_rule_is_three_significant_figures():
    assert predictions.rounded(3 / 11) == "2.73e-01"
    assert predictions.rounded(0.2727) == predictions.rounded(3 / 11)
    assert predictions.rounded(0.2724) != predictions.rounded(3 / 11)
    assert predictions.rounded(-0.0) == predictions.rounded(0) == "0.00e+00"
    assert predictions.rounded(12_582_912) == "1.26e+07"
    assert predictions.rounded(torch.tensor(2.0)) == "2.00e+00"


def test_self_check_says_whether_not_what(capsys):
    d = predictions.digest("bubble", 3 / 11)
    assert "2.73" not in d and len(d) == 20
    assert predictions.check("bubble", 0.2727, d)
    assert not predictions.check("bubble", 0.25, d)
    out = capsys.readouterr().out
    assert "2.73e-01" not in out and "2.50e-01" in out  # the student's own value, never the answer
    # the digest is salted by the name: the same number under another name does not match
    assert predictions.digest("other", 3 / 11) != d


def test_function_predictions_are_checked_case_by_case():
    cases = [(4, 8), (8, 32)]
    d = predictions.digest("bubble_fn", lambda p, m: (p - 1) / (m + p - 1), cases)
    assert predictions.check("bubble_fn", lambda p, m: (p - 1) / (m + p - 1), d, cases)
    assert not predictions.check("bubble_fn", lambda p, m: (p - 1) / m, d, cases)
    with pytest.raises(PredictionError, match="should be a function"):
        predictions.check("bubble_fn", 0.3, d, cases)


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
        predictions.digest("x", value)


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
        predictions.check("predicted_g", None, "0" * 20, cases)
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
    withheld = predictions.withhold_expected(message, "a different value")
    assert withheld == (
        "the prediction does not match the cost model to 3 significant figures: predicted_f(4, 8): predicted "
        "5.00e-01, the cost model gives a different value; predicted_f(8, 32): predicted -2.50e-01, the cost "
        "model gives a different value"
    )
    assert predictions.withhold_expected(withheld) == withheld  # nothing left to withhold
