"""Lab 7's exercises 1-3: ``topk_compress``/``topk_decompress``, ``sparse_all_reduce`` and
``ErrorFeedback``, against the top-k of the same data and sums in rank order."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ... import carried, checks, exercise
from .common import GRADED_PASSED, TIMEOUT, _assert_pieces_sent, _check_topk_of, _integers, _run, _spread
from .ranks import _feedback_steps, _topk_round_trip


# --------------------------------------------------------------------------------------
# Exercise 1: topk_compress, topk_decompress
# --------------------------------------------------------------------------------------
def check_topk(numel: int, density: float, flat: torch.Tensor | None = None) -> None:
    """Exercise 1: ``topk_compress(flat, density)`` keeps k = ceil(density × numel) entries of largest
    magnitude (at most numel) as ``(values, indices)``, indices 1-D int64, distinct and increasing,
    values = flat[indices], flat unchanged; ``topk_decompress`` puts them back in zeros.  ``flat``:
    integer-valued data of ``numel`` entries unless given (ties may be broken either way)."""
    flat = _integers(numel, seed=numel) if flat is None else flat
    case = f"topk_compress of {numel} entries at density {density}"
    run = _run(_topk_round_trip, 1, (flat.clone(), density), case)
    values, indices, decompressed = run.results[0]
    checks.assert_close(run.inputs_after[0][0], flat, what=f"{case}: the input must not change")
    _check_topk_of(flat, values, indices, density, case)
    dense = torch.zeros(numel)
    dense[indices] = flat[indices]
    checks.assert_close(decompressed, dense, what=f"{case}: topk_decompress of it")


def check_density_error(density) -> None:
    """Exercise 1: a density outside (0, 1] makes ``topk_compress(torch.ones(4), density)`` raise a
    ValueError that says "density"."""
    case = f"density {density}"
    try:
        exercise.run("topk_compress", 1, (torch.ones(4), density), timeout=TIMEOUT)
    except exercise.ExerciseError as e:
        if e.exc_type != "ValueError":  # NotImplementedError, a timeout, ...: as it is
            raise
        assert "density" in e.exc_message.lower(), (
            f"{case}: the ValueError should say 'density', it says: {e.exc_message}"
        )
        return
    raise AssertionError(f"{case}: expected a ValueError saying the density must be in (0, 1]")


# --------------------------------------------------------------------------------------
# Exercise 2: sparse_all_reduce
# --------------------------------------------------------------------------------------
def _sparse_pieces(n, numel, density, seed):
    """Each rank's (values, indices): k = ceil(density * numel) distinct increasing positions out of a pool of
    about 2k that all ranks draw from (so many are shared), with values whose fp32 sum depends on the order."""
    k = min(numel, math.ceil(density * numel))
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(numel, generator=gen)[: min(numel, 2 * k)]
    pieces = []
    for rank in range(n):
        indices = pool[torch.randperm(pool.numel(), generator=gen)[:k]].sort().values
        pieces.append((_spread(k, seed + 1 + rank), indices))
    return pieces


def check_sparse_all_reduce(n: int, numel: int, density: float) -> None:
    """Exercise 2: ``sparse_all_reduce``, given the grader's own top-k pieces on n ranks (many indices
    shared, values whose fp32 sum depends on the order), returns on every rank the float32 sum of every
    rank's decompressed piece added in rank order (shared indices added, not overwritten), and each rank
    sends only its compressed piece, k values + k indices."""
    case = f"sparse_all_reduce of {numel} entries at density {density} on {n} ranks"
    pieces = _sparse_pieces(n, numel, density, seed=100 + numel)
    run = _run("sparse_all_reduce", n, [(v.clone(), i.clone(), numel) for v, i in pieces], case, content=True)
    expected = torch.zeros(numel)  # the reference: rank 0's values first, then rank 1's, ...
    for values, indices in pieces:
        expected.index_add_(0, indices, values)
    exact = torch.zeros(numel, dtype=torch.float64)
    for values, indices in pieces:
        exact.index_add_(0, indices, values.double())
    picked = torch.zeros(numel)
    for _, indices in pieces:
        picked[indices] += 1
    for rank, total in enumerate(run.results):
        assert isinstance(total, torch.Tensor) and total.shape == (numel,) and total.dtype == torch.float32, (
            f"{case}: rank {rank} must return a float32 tensor of {numel} entries, got "
            f"{total.dtype if isinstance(total, torch.Tensor) else type(total).__name__} "
            f"{tuple(getattr(total, 'shape', ()))}"
        )
        wrong = (total != expected).nonzero().flatten()
        if wrong.numel():
            j = int(wrong[0])
            shared = [int(i) for i in wrong if picked[i] > 1]
            kept_one = shared and all(
                any(
                    float(total[i]) == float(v[(ind == i).nonzero()[0, 0]])
                    for v, ind in pieces
                    if bool((ind == i).any())
                )
                for i in shared
            )
            if kept_one and len(shared) == wrong.numel():
                raise AssertionError(
                    f"{case}: rank {rank}'s result at index {shared[0]}, which {int(picked[shared[0]])} ranks "
                    f"picked, is {float(total[shared[0]]):.9g}: one rank's value, not their sum "
                    f"{float(expected[shared[0]]):.9g}. "
                    f"Add every rank's values (index_add_), do not overwrite them (scatter_, dense[indices] = values)"
                )
            order = float((total.double() - exact).abs().max()) <= 1e-6 * float(exact.abs().max()) + 1e-6
            if order:
                raise AssertionError(
                    f"{case}: rank {rank}'s result differs from the sum in rank order at {wrong.numel()} entries "
                    f"(index {j}: {float(total[j]):.9g} instead of {float(expected[j]):.9g}), yet it is the right sum "
                    f"up to fp32 rounding: add in rank order (rank 0's values, then rank 1's, ...), so every rank gets "
                    f"the identical result"
                )
        checks.assert_close(
            total,
            expected,
            what=f"{case}: rank {rank}'s result, against the sum of every rank's decompressed top-k in rank order",
            rtol=0,
            atol=0,
        )
        values, indices = pieces[rank]
        compressed = values.numel() * (values.element_size() + indices.element_size())
        _assert_pieces_sent(run, rank, compressed, "k values + k indices", numel, case)
    # every rank's values and indices themselves reach every other rank (the grader's capture; none in yours)
    for rank, (values, indices) in enumerate(pieces):
        for other in range(n):
            if other != rank:
                carried.assert_carried(run, {(None, other): [values]}, f"{case}: rank {rank}'s values")
                carried.assert_carried(run, {(None, other): [indices]}, f"{case}: rank {rank}'s indices")


# --------------------------------------------------------------------------------------
# Exercise 3: ErrorFeedback
# --------------------------------------------------------------------------------------
def feedback_driver(graders: Callable | None = None) -> Callable:
    """The driver ``check_error_feedback`` runs, decided once per graded cell: ErrorFeedback on the
    notebook's topk_compress where that passed its graded test, else on ``graders`` (the grader's own
    top-k, in the cell's hidden tests; the student's own where there is none)."""
    if "topk" in GRADED_PASSED:
        return _feedback_steps
    print("(topk_compress has not passed its graded test yet: the grader checks ErrorFeedback with its own top-k)")
    return graders or _feedback_steps


def check_error_feedback(driver: Callable, numel: int, density: float, steps: int) -> None:
    """Exercise 3: one ``ErrorFeedback(density)`` compressing ``steps`` gradients of ``numel`` entries (run
    by ``driver``, ``feedback_driver``) sends at each step a valid top-k of gradient + residual, leaves
    grad unchanged, keeps as ``residual`` the corrected gradient with the sent entries set to 0, and
    loses nothing: everything sent plus the residual is the sum of the gradients."""
    case = f"ErrorFeedback({density}) on {steps} gradients of {numel} entries"
    grads = [_integers(numel, seed=step) for step in range(steps)]
    run = _run(driver, 1, (density, [grad.clone() for grad in grads]), case)
    residual = torch.zeros(numel)  # the reference, kept here
    sent_total = torch.zeros(numel)
    for step, (original, (values, indices, ef_residual)) in enumerate(zip(grads, run.results[0])):
        checks.assert_close(
            run.inputs_after[0][1][step], original, what=f"{case}, step {step}: compress must not change grad"
        )
        corrected = original + residual
        _check_topk_of(corrected, values, indices, density, f"{case}, step {step}: the top-k of gradient + residual")
        residual = corrected.clone()
        residual[indices] = 0
        checks.assert_close(
            ef_residual,
            residual,
            what=f"{case}, step {step}: ef.residual (gradient + old residual, sent entries set to 0)",
        )
        sent_total.index_add_(0, indices, values)
    checks.assert_close(
        sent_total + ef_residual,
        sum(grads),
        what=f"{case}: everything sent + the residual, against the sum of the gradients",
    )


def check_feedback_afresh(driver: Callable) -> None:
    """Exercise 3: ``ErrorFeedback`` given a gradient of 4 entries, then one of 6, starts afresh with a
    residual of zeros of the new size (and then keeps what it did not send)."""
    case = "ErrorFeedback on gradients of 4, then 6 entries"
    try:
        afresh = _run(driver, 1, (0.5, [torch.ones(4), torch.ones(6)]), case)
    except exercise.ExerciseError as e:
        raise AssertionError(
            f"ErrorFeedback given a gradient of 4 entries, then one of 6, raised {e.exc_type}: "
            f"{e.exc_message}.  When a gradient of a different size comes, start afresh with a "
            f"residual of zeros of its size"
        ) from None
    values, indices, residual = afresh.results[0][1]  # a new size: start afresh
    _check_topk_of(torch.ones(6), values, indices, 0.5, "ErrorFeedback after a gradient of another size")
    fresh = torch.ones(6)
    fresh[indices] = 0
    checks.assert_close(
        residual,
        fresh,
        what="ErrorFeedback after gradients of 4, then 6 entries: the residual must start afresh "
        "(zeros) for the new size, then keep what was not sent",
    )
