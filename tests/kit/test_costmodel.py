"""disttrain_lab.costmodel: the alpha-beta model and its fit."""

from __future__ import annotations

import numpy as np
import pytest

from disttrain_lab.costmodel import AlphaBeta, fit_alpha_beta

# ----------------------------------------------------------------------------------------
# costmodel.py


def test_fit_alpha_beta_recovers_the_model():
    sizes = [1, 100, 10_000, 1_000_000, 4_000_000]
    truth = AlphaBeta(alpha=50e-6, beta=0.5e-9)
    model = fit_alpha_beta(sizes, truth.predict(sizes))
    assert model.alpha == pytest.approx(50e-6, rel=1e-6) and model.beta == pytest.approx(0.5e-9, rel=1e-6)
    assert model.bandwidth == pytest.approx(2e9) and model.crossover_bytes == pytest.approx(1e5)
    assert "alpha = 50.0 µs" in str(model) and "2 GB/s" in str(model)


def test_fit_alpha_beta_weights_small_messages():
    # a 10 % error on the largest point must not swamp alpha (a plain least squares fit would)
    sizes = np.array([1, 10, 100, 1000, 10_000_000])
    seconds = 50e-6 + 1e-9 * sizes
    seconds[-1] *= 1.1
    assert fit_alpha_beta(sizes, seconds).alpha == pytest.approx(50e-6, rel=0.05)


@pytest.mark.parametrize(
    "nbytes, seconds, words",
    [
        ([1, 1, 1], [1e-5, 1e-5, 1e-5], "at least two different message sizes"),
        ([1, 2], [1e-5], "the same length"),
        ([1, 2], [1e-5, 0.0], "every time must be > 0"),
    ],
)
def test_fit_alpha_beta_rejects_bad_input(nbytes, seconds, words):
    with pytest.raises(ValueError, match=words):
        fit_alpha_beta(nbytes, seconds)
