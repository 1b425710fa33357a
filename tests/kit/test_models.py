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


def test_gpt_counts_its_parameters_and_is_deterministic():
    cfg = models.GPTConfig(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=3)
    a, b = models.GPT(cfg, seed=3), models.GPT(cfg, seed=3)
    assert sum(p.numel() for p in a.parameters()) == cfg.params()
    assert models.parameters_equal(a, b) == [] and models.parameters_equal(a, models.GPT(cfg, seed=4)) != []
    assert a.head.weight.data_ptr() != a.token.weight.data_ptr()  # untied: each stage owns its own
    assert a(torch.zeros(5, 8, dtype=torch.long)).shape == (5, 8, 32)


def test_gpt_is_causal():
    """Changing token t changes no logit before t."""
    gpt = models.GPT(models.GPTConfig(seq_len=8), seed=0)
    x = models.corpus_tokens(8).unsqueeze(0)
    changed = x.clone()
    changed[0, 5] = (changed[0, 5] + 1) % 28
    a, b = gpt(x), gpt(changed)
    assert torch.allclose(a[0, :5], b[0, :5]) and not torch.allclose(a[0, 5:], b[0, 5:])


def test_gpt_config_says_what_is_valid():
    try:
        models.GPTConfig(d_model=30, n_heads=4)
    except ValueError as e:
        assert "d_model=30" in str(e) and "n_heads=4" in str(e)
    else:
        raise AssertionError("d_model=30 with 4 heads should raise ValueError")


def test_corpus_and_batches_are_reproducible_next_token_pairs():
    text = models.corpus_text(200, seed=1)
    assert len(text) == 200 and set(text) <= set(models.CORPUS_ALPHABET) and text == models.corpus_text(200, seed=1)
    tokens = models.corpus_tokens(500, seed=1)
    assert models.decode(tokens[:200]) == text
    batches = models.lm_batches(tokens, batch_size=4, seq_len=8, steps=3, seed=2)
    assert len(batches) == 3
    for x, y in batches:
        assert x.shape == y.shape == (4, 8) and x.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])
    again = models.lm_batches(tokens, batch_size=4, seq_len=8, steps=3, seed=2)
    assert all(torch.equal(x, x2) for (x, _), (x2, _) in zip(batches, again))


def test_gpt_learns_the_corpus():
    """The grammar is learnable: 60 SGD steps take the loss well below a uniform guess (ln 32)."""
    cfg = models.GPTConfig()
    gpt = models.GPT(cfg, seed=0)
    batches = models.lm_batches(models.corpus_tokens(8000), 32, cfg.seq_len, 60, seed=1)
    optimizer = torch.optim.SGD(gpt.parameters(), lr=0.5)
    losses, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small: a second thread only spins on a loaded machine
    try:
        for x, y in batches:
            optimizer.zero_grad()
            loss = models.lm_loss(gpt(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert losses[0] > 3.0 and sum(losses[-5:]) / 5 < 2.0, losses
