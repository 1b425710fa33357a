"""Deterministic models and data: the same on every rank and every run."""
import torch

import disttrain_lab as dl
from disttrain_lab import models


def test_mlp_is_deterministic_and_independent_of_global_rng():
    torch.manual_seed(0)
    a = models.MLP([4, 8, 3], seed=5)
    torch.manual_seed(99)
    b = models.MLP([4, 8, 3], seed=5)
    assert models.parameters_equal(a, b) == []
    assert models.parameters_equal(a, models.MLP([4, 8, 3], seed=6)) != []
    assert a(torch.zeros(2, 4)).shape == (2, 3)


def test_same_weights_on_every_rank():
    out = dl.launch(lambda: models.MLP([4, 8, 3], seed=1)[0].weight.sum().item(), 3)
    assert out[0] == out[1] == out[2]


def test_tied_weight_gets_gradient_from_both_uses():
    m = models.TiedAutoencoder(4, 6, seed=0)
    x = torch.randn(5, 4)
    m(x).pow(2).sum().backward()
    assert m.encoder.weight.grad is not None and m.encoder.weight.grad.abs().sum() > 0
    assert len(list(m.parameters())) == 3  # weight counted once


def test_frozen_layer_has_no_grad():
    m = models.PartlyFrozenMLP([4, 8, 3], seed=0)
    m(torch.randn(2, 4)).sum().backward()
    assert m[0].weight.grad is None and m[2].weight.grad is not None


def test_reference_training_changes_a_copy_only():
    m = models.MLP([4, 8, 2], seed=0)
    data = models.regression_data(16, 4, 2, seed=1)
    before = [p.clone() for p in m.parameters()]
    trained = models.train_single_process(m, [data] * 3, lr=0.1)
    assert all(torch.equal(p, q) for p, q in zip(before, m.parameters()))
    assert models.parameters_equal(m, trained) != []
    adam = models.train_single_process(m, [tuple(data)], optimizer="adam", lr=0.01)
    assert models.parameters_equal(m, adam) != []


def test_data_is_reproducible():
    assert torch.equal(models.regression_data(8, 3, 2, seed=4).x, models.regression_data(8, 3, 2, seed=4).x)
    c = models.classification_data(10, 3, 4, seed=0)
    assert c.y.dtype == torch.int64 and c.y.max() < 4
