"""Small deterministic models and synthetic data for the labs.

The models know nothing about parallelism (a strategy wraps or transforms them).  Every
constructor takes a ``seed`` and builds the same weights on every rank and every run, so
a distributed run can be compared with a single-process one parameter by parameter.

    model = dl.models.MLP([8, 32, 32, 4], seed=0)
    x, y = dl.models.regression_data(64, 8, 4, seed=1)
    reference = dl.models.train_single_process(model, [(x, y)] * 3, lr=0.1)

    gpt = dl.models.GPT(dl.models.GPTConfig(n_layers=2, d_model=32, n_heads=4), seed=0)
    batches = dl.models.lm_batches(dl.models.corpus_tokens(4096), batch_size=8, seq_len=16, steps=3)
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _init_(module: nn.Module, seed: int) -> nn.Module:
    """Re-initialise every parameter from ``seed`` (independent of the global RNG)."""
    gen = _seeded(seed)
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else p.numel()
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / fan_in**0.5)
    return module


class MLP(nn.Sequential):
    """Linear → GELU → ... → Linear, e.g. ``MLP([8, 32, 4])``: (B, 8) -> (B, 4)."""

    def __init__(self, sizes: Sequence[int], seed: int = 0, bias: bool = True):
        if len(sizes) < 2 or any(int(s) < 1 for s in sizes):
            raise ValueError(f"sizes must list at least an input and an output width, all >= 1; got {list(sizes)}")
        layers: list[nn.Module] = []
        for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(d_in, d_out, bias=bias))
            if i < len(sizes) - 2:
                layers.append(nn.GELU())
        super().__init__(*layers)
        _init_(self, seed)


class TiedAutoencoder(nn.Module):
    """x -> tanh(x Wᵀ + b) -> h W: the decoder *shares* the encoder's weight (tied weights).

    Its weight gets gradient from two uses; data parallelism must still average it once.
    (B, d) -> (B, d).
    """

    def __init__(self, d: int = 8, hidden: int = 16, seed: int = 0):
        super().__init__()
        self.encoder = nn.Linear(d, hidden)
        self.decoder_bias = nn.Parameter(torch.zeros(d))
        _init_(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))  # (B, hidden)
        return h @ self.encoder.weight + self.decoder_bias  # (B, d), weight reused


class PartlyFrozenMLP(MLP):
    """An MLP whose first layer is frozen (``requires_grad=False``), as in fine-tuning:
    frozen parameters get no gradient and must not be communicated."""

    def __init__(self, sizes: Sequence[int], seed: int = 0):
        super().__init__(sizes, seed)
        for p in self[0].parameters():
            p.requires_grad_(False)


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor

    def __iter__(self):
        return iter((self.x, self.y))

    def __len__(self) -> int:
        return len(self.x)


def regression_data(n: int, d_in: int, d_out: int, seed: int = 0, dtype=torch.float32) -> Batch:
    """``n`` samples of y = tanh(x A) + noise: x (n, d_in), y (n, d_out), same for a given seed."""
    gen = _seeded(seed)
    x = torch.randn(n, d_in, generator=gen, dtype=dtype)
    a = torch.randn(d_in, d_out, generator=gen, dtype=dtype) / d_in**0.5
    y = torch.tanh(x @ a) + 0.05 * torch.randn(n, d_out, generator=gen, dtype=dtype)
    return Batch(x, y)


def classification_data(n: int, d_in: int, classes: int, seed: int = 0) -> Batch:
    """``n`` samples of a random linear classification problem: x (n, d_in), y (n,) int64."""
    gen = _seeded(seed)
    x = torch.randn(n, d_in, generator=gen)
    w = torch.randn(d_in, classes, generator=gen)
    return Batch(x, (x @ w).argmax(dim=1))


def train_single_process(
    model: nn.Module, batches: Iterable, lr: float = 0.1, optimizer: str = "sgd", loss: str = "mse"
) -> nn.Module:
    """The reference: a copy of ``model`` trained in this one process, one step per batch.

    ``optimizer`` is "sgd" or "adam" (torch.optim, default settings but ``lr``); ``loss`` is
    "mse" or "cross_entropy", averaged over the batch.  The input model is not changed.
    """
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr)
    elif optimizer == "adam":
        opt = torch.optim.Adam(params, lr=lr)
    else:
        raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}")
    loss_fn = loss_function(loss)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return model


def loss_function(name: str):
    if name == "mse":
        return nn.functional.mse_loss
    if name == "cross_entropy":
        return nn.functional.cross_entropy
    raise ValueError(f"loss must be 'mse' or 'cross_entropy', got {name!r}")


def parameters_equal(a: nn.Module, b: nn.Module, rtol: float = 1e-5, atol: float = 1e-6) -> list[str]:
    """Names of the parameters that differ between two models (empty when all match)."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    if pa.keys() != pb.keys():
        return sorted(pa.keys() ^ pb.keys())
    return [n for n in pa if not torch.allclose(pa[n].detach(), pb[n].detach(), rtol=rtol, atol=atol)]


# --------------------------------------------------------------------------------------
# A small GPT (decoder-only transformer) and a generated corpus to train it on
# --------------------------------------------------------------------------------------
@dataclass
class GPTConfig:
    """The shape of a GPT.  ``GPTConfig().params()`` is its parameter count N."""

    vocab: int = 32  # tokens: the corpus' alphabet (28 characters) rounded up to 32
    seq_len: int = 16  # T: the longest context (learned position embeddings)
    d_model: int = 32  # d: the width of the residual stream
    n_heads: int = 4  # attention heads; d_model / n_heads features each
    n_layers: int = 2  # transformer blocks
    d_ff: int = 0  # the MLP's hidden width; 0 means 4 * d_model, as in GPT-2

    def __post_init__(self):
        if self.d_ff == 0:
            self.d_ff = 4 * self.d_model
        sizes = {
            "vocab": self.vocab,
            "seq_len": self.seq_len,
            "d_model": self.d_model,
            "n_heads": self.n_heads,
            "n_layers": self.n_layers,
            "d_ff": self.d_ff,
        }
        bad = {k: v for k, v in sizes.items() if int(v) < 1}
        if bad:
            raise ValueError(f"GPTConfig: every size must be >= 1, got {bad}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
                f"(each head gets d_model / n_heads features); e.g. n_heads in "
                f"{[h for h in range(1, self.d_model + 1) if self.d_model % h == 0]}"
            )

    def block_params(self) -> int:
        """Parameters of one block: two LayerNorms, attention (q, k, v, proj with biases), the MLP."""
        d, h = self.d_model, self.d_ff
        return 2 * 2 * d + 4 * (d * d + d) + (d * h + h) + (h * d + d)

    def params(self) -> int:
        """N: every parameter (embeddings, blocks, final LayerNorm, LM head without bias)."""
        d = self.d_model
        return self.vocab * d + self.seq_len * d + self.n_layers * self.block_params() + 2 * d + d * self.vocab


class CausalSelfAttention(nn.Module):
    """Multi-head attention in which position t sees positions <= t.  (B, T, d) -> (B, T, d).

    Query, key and value are three ``nn.Linear(d, d)`` rather than one fused ``Linear(d, 3d)``:
    the output features of each are the heads side by side, so cutting each into N contiguous
    slices gives every tensor-parallel rank whole heads (a fused weight would have to be cut
    in three first).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.query = nn.Linear(cfg.d_model, cfg.d_model)
        self.key = nn.Linear(cfg.d_model, cfg.d_model)
        self.value = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(attend(self.query(x), self.key(x), self.value(x), self.n_heads))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Causal attention of ``n_heads`` heads: q, k, v (B, T, n_heads * hs) -> (B, T, n_heads * hs)."""
    B, T, C = q.shape
    heads = lambda t: t.view(B, T, n_heads, C // n_heads).transpose(1, 2)  # (B, nh, T, hs)
    y = nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    return y.transpose(1, 2).reshape(B, T, C)  # heads side by side


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(x)).  (B, T, d) -> (B, T, d).

    ``mlp`` is an ``nn.Sequential(Linear(d, d_ff), GELU(), Linear(d_ff, d))``, the shape of
    ``MLP([d, d_ff, d])``, so a tensor-parallel MLP built from an MLP takes it as it is.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer (GPT-2's layout, nanoGPT-sized down): tokens (B, T) -> logits (B, T, vocab).

    The parts are separate attributes so that a pipeline stage can take some of them:
    ``embed`` (first stage), ``blocks[i:j]`` (every stage), ``norm`` and ``head`` (last stage).

    The LM head is NOT tied to the token embedding (GPT-2 ties them).  Tied, the two uses of one
    weight would sit on the first and the last pipeline stage, and every step would need an
    extra all-reduce of its gradient between those two stages (Megatron-LM keeps an "embedding
    group" of exactly those ranks for it); untied, each stage owns its parameters outright.

        >>> gpt = GPT(GPTConfig(), seed=0)
        >>> gpt(torch.zeros(2, 16, dtype=torch.long)).shape
        torch.Size([2, 16, 32])
    """

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.token = nn.Embedding(cfg.vocab, cfg.d_model)
        self.position = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        _init_gpt_(self, seed)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, d): token plus position embedding."""
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"GPT: a sequence of {T} tokens is longer than seq_len={self.cfg.seq_len}")
        return self.token(idx) + self.position(torch.arange(T, device=idx.device))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, T, vocab): final LayerNorm, then the LM head."""
        return self.head(self.norm(h))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.logits(h)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (B, T, vocab), targets (B, T) -> a scalar (nats per token)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _init_gpt_(model: nn.Module, seed: int) -> None:
    """Deterministic GPT initialisation from ``seed`` (independent of the global RNG): weights
    N(0, 1/fan_in), embeddings N(0, 0.1²), small random biases, LayerNorms at (1, 0) as torch makes them."""
    gen = _seeded(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) / module.in_features**0.5)
                if module.bias is not None:  # not zero: a bias added twice must show in a comparison
                    module.bias.copy_(0.02 * torch.randn(module.bias.shape, generator=gen))
            elif isinstance(module, nn.Embedding):
                module.weight.copy_(0.1 * torch.randn(module.weight.shape, generator=gen))
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()


# The corpus: sentences of a small grammar, generated from a seed (nothing is downloaded).
# Subject and verb agree in number ("the cat sees", "two cats see"), so predicting the verb's
# ending needs the subject a few characters back: a job for attention, not only for bigrams.
CORPUS_ALPHABET = " .abcdefghijklmnopqrstuvwxyz"  # token i is CORPUS_ALPHABET[i]; 28 < GPTConfig().vocab
_NOUNS = ["cat", "dog", "bird", "fox", "owl", "frog"]
_VERBS = [("sees", "see"), ("likes", "like"), ("chases", "chase"), ("hears", "hear")]
_DETERMINERS = [("the", "the"), ("a", "two"), ("one", "many")]


def corpus_text(n_chars: int, seed: int = 0) -> str:
    """``n_chars`` characters of generated sentences, e.g. "the owl sees two dogs. many cats hear a fox. "."""
    gen = _seeded(seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]
    parts, total = [], 0
    while total < n_chars:
        plural = bool(torch.randint(2, (1,), generator=gen))
        det = pick(_DETERMINERS)[plural]
        subject = pick(_NOUNS) + ("s" if plural else "")
        verb = pick(_VERBS)[plural]
        obj_plural = bool(torch.randint(2, (1,), generator=gen))
        obj = pick(_DETERMINERS)[obj_plural] + " " + pick(_NOUNS) + ("s" if obj_plural else "")
        sentence = f"{det} {subject} {verb} {obj}. "
        parts.append(sentence)
        total += len(sentence)
    return "".join(parts)[:n_chars]


def corpus_tokens(n_tokens: int, seed: int = 0) -> torch.Tensor:
    """(n_tokens,) int64 token ids of ``corpus_text(n_tokens, seed)`` (one token per character)."""
    return torch.tensor([CORPUS_ALPHABET.index(c) for c in corpus_text(n_tokens, seed)], dtype=torch.long)


def decode(tokens) -> str:
    """Token ids back to text: ``decode(corpus_tokens(20))``."""
    return "".join(CORPUS_ALPHABET[int(t)] for t in tokens)


def lm_batches(tokens: torch.Tensor, batch_size: int, seq_len: int, steps: int, seed: int = 0) -> list:
    """``steps`` batches of ``batch_size`` windows at random offsets of ``tokens``: a list of
    (x, y) pairs, x and y (batch_size, seq_len) int64, y = x shifted by one (the next token)."""
    if len(tokens) < seq_len + 2:
        raise ValueError(f"lm_batches: {len(tokens)} tokens cannot hold a window of seq_len + 1 = {seq_len + 1}")
    gen = _seeded(seed)
    batches = []
    for _ in range(steps):
        starts = torch.randint(len(tokens) - seq_len, (batch_size,), generator=gen)
        windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])  # (B, T + 1)
        batches.append((windows[:, :-1].clone(), windows[:, 1:].clone()))
    return batches
