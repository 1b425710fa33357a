"""What every check of lab 10 shares: the references the notebook hands in, the tensors a case
runs on, the forward pass's calls of a rank."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...exercise import ExerciseRun

TIMEOUT = 60  # seconds a test's run may take
_REFERENCES: dict[str, Callable] = {}  # the notebook's references (use_references)
GRADED_PASSED: set[str] = set()  # the exercises whose graded cell passed, for the exercises built on them


def use_references(*, attention: Callable, positions: Callable) -> None:
    """The references the checks compare with, written in the lab's helper cell (they compute exercises' own
    answers, so they are not here): ``attention(q, k, v, q_pos, k_pos) -> (out, lse)``, torch's causal attention
    of q over (k, v) at those positions (rows that see no key: 0 and -inf), and ``positions(seq_len, n, rank,
    layout)``, the positions section 3's text asks rank ``rank`` of ``n`` to hold."""
    _REFERENCES.update(attention=attention, positions=positions)


def _reference(name: str) -> Callable:
    if name not in _REFERENCES:
        raise RuntimeError("run the lab's helper cell (it hands the tests their references: lab_tests.use_references)")
    return _REFERENCES[name]


def _qkv(heads: int, seq_len: int, dim: int, seed: int) -> tuple:
    """q, k, v and the gradient of the output: the same tensors in the ranks and in the reference (float64)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(heads, seq_len, dim, generator=g, dtype=torch.float64) for _ in range(4))


def _forward_phase(run: ExerciseRun, rank: int) -> tuple[list, list]:
    """``rank``'s events before the driver's barrier (the forward pass), and its "block" regions there."""
    events = sorted(run.trace.by_rank(rank), key=lambda e: e.start)
    cut = next((e.start for e in events if e.op == "barrier"), float("inf"))
    before = [e for e in events if e.start < cut]
    return (
        [e for e in before if e.kind in ("p2p", "collective", "wait")],
        [e for e in before if e.kind == "region" and e.name == "block"],
    )
