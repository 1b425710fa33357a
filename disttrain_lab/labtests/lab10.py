"""Lab 10's graded tests (context and expert parallelism): each check runs the student's code with
``exercise.run``, by name or through a *driver* (a ``_..._in_rank`` function below: its source is sent to
the student's kernel, defined there among the notebook's names, calls the notebook's code on every rank and
returns data), compares every rank's tensors with one process (torch's causal attention, the dense MoE, the
dense block), and reads the calls each rank made (``run.trace``) and the bytes the operating system counted
(``run.traffic``).  A driver uses only the notebook's names (the student's functions and classes, the given
``RingAttention``, ``MoE``, ``transformer_block``, and ``torch``, ``dist``, ``dl`` of the setup cell).

Nothing here is a solution or a graded answer.  The references that compute an exercise's own answer stay in
the notebook and are handed to the checks: torch's attention over a block with its log-sum-exp and the
layouts' positions (the lab's helper cell, :func:`use_references`), the mesh's groups and the memory model
(their graded cells, ``reference=``).  What only the grader holds stays in the graded cells' hidden tests:
the grader's own blocks and router (drivers that a later exercise is graded with when an earlier one failed:
:func:`ring_driver`, :func:`moe_driver`), the router's and the capacity-limited MoE's references, and the
predictions' cost models.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import checks, exercise, memory
from ..exercise import ExerciseRun
from . import common

__all__ = [
    "check_5d",
    "check_5d_error",
    "check_block",
    "check_expert_grid",
    "check_groups",
    "check_merge",
    "check_moe",
    "check_moe_bytes",
    "check_moe_error",
    "check_positions",
    "check_positions_error",
    "check_ring",
    "check_ring_traffic",
    "check_router",
    "check_router_literal",
    "check_sp",
    "check_sp_error",
    "check_ulysses",
    "check_ulysses_error",
    "describe",
    "every_token_to_every_expert",
    "moe_driver",
    "ring_driver",
    "use_references",
]

TIMEOUT = 60  # seconds a test's run may take
_DEADLOCK_HINT = (
    "does every isend have a matching irecv on the next rank, and do all ranks make the same collective "
    "calls in the same order?"
)
_REFERENCES: dict[str, Callable] = {}  # the notebook's references (use_references)


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


def _notebook(name: str):
    """The notebook's given (locked) ``name``: the dense MoE, transformer_block, which the references run."""
    return vars(sys.modules["__main__"])[name]


def _qkv(heads: int, seq_len: int, dim: int, seed: int) -> tuple:
    """q, k, v and the gradient of the output: the same tensors in the ranks and in the reference (float64)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(heads, seq_len, dim, generator=g, dtype=torch.float64) for _ in range(4))


def _expect_value_error(target: str | Callable, n: int, *args, case: str) -> None:
    """``target`` on n ranks must stop with the student's ValueError saying "divisible", as the exercise asks."""
    try:
        exercise.run(target, n, args, timeout=TIMEOUT)
    except exercise.ExerciseError as e:
        if common.rank_raised(e, "ValueError", "divisible", loose=True):
            return
        got = f"{e.exc_type}: {e.exc_message}" if e.exc_type is not None else str(e)
        raise AssertionError(
            f"{case}: expected your ValueError saying the size is not divisible (the exercise "
            f'asks for the word "divisible"); got {got}'
        ) from None
    raise AssertionError(f"{case}: expected a ValueError (not divisible), but it ran without one")


def describe(events: Sequence, world_size: int) -> str:
    """Calls a rank made, for a message: "isend(peer 1) of 512 B, ..." (or "nothing")."""
    return (
        ", ".join(f"{e.op}{'' if e.peer is None else f'(peer {e.peer})'} of {e.bytes} B" for e in events) or "nothing"
    )


def _forward_phase(run: ExerciseRun, rank: int) -> tuple[list, list]:
    """``rank``'s events before the driver's barrier (the forward pass), and its "block" regions there."""
    events = sorted(run.trace.by_rank(rank), key=lambda e: e.start)
    cut = next((e.start for e in events if e.op == "barrier"), float("inf"))
    before = [e for e in events if e.start < cut]
    return (
        [e for e in before if e.kind in ("p2p", "collective", "wait")],
        [e for e in before if e.kind == "region" and e.name == "block"],
    )


# --------------------------------------------------------------------------------------
# Exercise 1: block_attention and merge_attention (on one rank)
# --------------------------------------------------------------------------------------
def check_block(
    heads: int, q_positions: Sequence[int], k_positions: Sequence[int], dim: int = 4, seed: int = 0
) -> None:
    """block_attention of queries at ``q_positions`` over keys at ``k_positions``: out equals torch's causal
    attention over this block (0, never NaN, for a query that sees no key), and lse is -inf exactly for those
    queries and the log-sum-exp of the visible scores for the others."""
    q_pos, k_pos = torch.as_tensor(q_positions), torch.as_tensor(k_positions)
    case = f"block_attention of queries at {q_pos.tolist()} over keys at {k_pos.tolist()} ({heads} heads, d={dim})"
    q, k, v, _ = _qkv(heads, max(len(q_pos), len(k_pos)), dim, seed)
    q, k, v = q[:, : len(q_pos)], k[:, : len(k_pos)], v[:, : len(k_pos)]
    out, lse = exercise.run("block_attention", 1, (q, k, v, q_pos, k_pos), timeout=TIMEOUT).results[0]
    want_out, want_lse = _reference("attention")(q, k, v, q_pos, k_pos)
    assert not torch.as_tensor(out).isnan().any(), f"{case}: the output holds NaN (a query that sees no key gets 0)"
    checks.assert_close(out, want_out, what=f"{case}: out, against torch's causal attention over this block")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)), (
        f"{case}: lse must be -inf exactly for the queries that see no key of the block "
        f"(expected at {torch.isneginf(want_lse).nonzero().tolist()[:6]}, "
        f"got at {torch.isneginf(lse).nonzero().tolist()[:6]})"
    )
    seen = ~torch.isneginf(want_lse)
    checks.assert_close(lse[seen], want_lse[seen], what=f"{case}: lse, the log-sum-exp of the visible scores")


def check_merge(heads: int, seq_len: int, cuts: Sequence[int], dim: int = 4, seed: int = 1) -> None:
    """merge_attention, folding the blocks of ``seq_len`` keys cut at ``cuts`` (each block's (out, lse) from
    torch), gives torch's causal attention over the whole sequence and its log-sum-exp, without NaN."""
    case = f"merge_attention of the blocks {cuts} of {seq_len} keys ({heads} heads)"
    q, k, v, _ = _qkv(heads, seq_len, dim, seed)
    pos = torch.arange(seq_len)
    bounds = [0, *cuts, seq_len]
    attention = _reference("attention")
    blocks = [attention(q, k[:, a:b], v[:, a:b], pos, pos[a:b]) for a, b in zip(bounds, bounds[1:])]
    out, lse = blocks[0]
    for nxt in blocks[1:]:
        out, lse = exercise.run("merge_attention", 1, (out, lse, *nxt), timeout=TIMEOUT).results[0]
    assert not torch.as_tensor(out).isnan().any(), f"{case}: the merged output holds NaN"
    want_out, want_lse = attention(q, k, v, pos, pos)
    checks.assert_close(
        out, want_out, what=f"{case}: the merged output, against F.scaled_dot_product_attention(is_causal=True)"
    )
    checks.assert_close(lse, want_lse, what=f"{case}: the merged log-sum-exp")


# --------------------------------------------------------------------------------------
# Exercise 2: ring attention
# --------------------------------------------------------------------------------------
def _ring_in_rank(heads, seq_len, dim, layout, seed, positions, backward, groups_of):
    """The test's driver: your ring attention on this rank's tokens (the positions the test gives);
    a barrier, then the given backward.  Returns the output and the gradients of q, k, v."""
    group = None if groups_of == dist.get_world_size() else dist.new_subgroups(groups_of)[0]
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(heads, seq_len, dim, generator=g, dtype=torch.float64) for _ in range(4))
    mine = [t[:, positions].clone().requires_grad_() for t in (q, k, v)]
    out = RingAttention.apply(*mine, layout, group)  # noqa: F821  (the notebook's)
    if not backward:
        return out.detach(), None
    dist.barrier()
    out.backward(dout[:, positions])
    return out.detach(), [t.grad for t in mine]


def ring_driver(graders: Callable | None = None) -> Callable:
    """The driver ring attention is graded with: the lab's own (your ring on your blocks) where your
    block_attention and merge_attention pass exercise 1's check, else ``graders`` (your ring on the grader's
    blocks, defined in the graded cell's hidden tests: None in your notebook), so that a mistake in exercise 1
    does not cost exercise 2's points.  Decided once per run of the graded cell."""
    try:
        check_block(2, [0, 1, 6, 7], [2, 3, 4, 5])
        check_merge(2, 8, [3])
        return _ring_in_rank
    except Exception as e:
        if graders is None:
            raise AssertionError(
                f"ring attention builds on your block_attention and merge_attention, which do not "
                f"pass exercise 1's check yet; fix exercise 1 first (the grader grades the ring with "
                f"its own blocks).\n{e}"
            ) from None
        return graders


def check_ring(
    driver: Callable,
    n: int,
    heads: int,
    seq_len: int,
    dim: int,
    layout: str,
    seed: int = 0,
    groups_of: int | None = None,
) -> None:
    """Ring attention of ``seq_len`` tokens in ``layout`` on ``n`` ranks (in rings of ``groups_of``), in
    float64: each rank's output and the gradients of its q, k, v (the given backward uses your lse) equal
    torch's causal attention on the whole sequence to 1e-9; in forward it only isends to the next rank and
    irecvs from the previous one, N - 1 key/value blocks, one dl.region("block") per ring step, the next
    block's isend and irecv posted before a block's computation and waited for after it."""
    groups_of = groups_of or n
    case = (
        f"ring attention, {layout} layout, {seq_len} tokens on {n} ranks"
        + (f" in groups of {groups_of}" if groups_of != n else "")
        + f" ({heads} heads, d={dim}, float64)"
    )
    positions = [_reference("positions")(seq_len, groups_of, rank % groups_of, layout) for rank in range(n)]
    inputs = [(heads, seq_len, dim, layout, seed, positions[r], True, groups_of) for r in range(n)]
    run = common.run_or_fail(driver, n, inputs, case, _DEADLOCK_HINT, timeout=TIMEOUT)
    q, k, v, dout = (t.requires_grad_() for t in _qkv(heads, seq_len, dim, seed))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    want.backward(dout)
    block_bytes = 2 * heads * (seq_len // groups_of) * dim * 8
    for rank, (out, grads) in enumerate(run.results):
        pos = positions[rank]
        checks.assert_close(
            out,
            want.detach()[:, pos],
            rtol=1e-9,
            atol=1e-9,
            what=(
                f"{case}: rank {rank}'s output (tokens {pos.tolist()}), against "
                "F.scaled_dot_product_attention(is_causal=True) on the whole sequence"
            ),
        )
        for name, got, ref in zip("qkv", grads, (q, k, v)):
            checks.assert_close(
                got,
                ref.grad[:, pos],
                rtol=1e-9,
                atol=1e-9,
                what=f"{case}: rank {rank}'s gradient of {name} (the given backward uses your lse)",
            )
        calls, blocks = _forward_phase(run, rank)
        start = rank - rank % groups_of
        nxt, prev = start + (rank + 1) % groups_of, start + (rank - 1) % groups_of
        assert len(blocks) == groups_of, (
            f"{case}: rank {rank} marked {len(blocks)} dl.region('block') in forward; "
            f"the exercise asks for one per ring step: {groups_of}"
        )
        other = [
            e
            for e in calls
            if e.kind != "wait" and not (e.op == "isend" and e.peer == nxt) and not (e.op == "irecv" and e.peer == prev)
        ]
        assert not other, (
            f"{case}: in forward rank {rank} may only isend to the next rank ({nxt}) and irecv from the previous "
            f"({prev}); it also made: {describe(other, n)}"
        )
        sent = sum(e.bytes for e in calls if e.op == "isend")
        assert sent == (groups_of - 1) * block_bytes, (
            f"{case}: in forward rank {rank} sent {sent} B; N - 1 = {groups_of - 1} ring steps of one key/value block "
            f"({block_bytes} B) each make {(groups_of - 1) * block_bytes} B"
        )
        for step, block in enumerate(blocks[:-1]):
            posted = [e for e in calls if e.kind == "p2p" and e.start < block.start]
            waited = [e for e in calls if e.kind == "wait" and e.end <= block.start]
            assert {"isend", "irecv"} <= {e.op for e in posted} and len(posted) - len(waited) >= 2, (
                f"{case}: rank {rank}, ring step {step}: the next block's isend and irecv must be posted before this "
                f"block's computation (dl.region('block')) and waited for after it; when the block started, "
                f"{len(posted)} isend/irecv had been posted and {len(waited)} waited for"
            )


def check_ring_traffic(driver: Callable, n: int, heads: int, seq_len: int, dim: int, layout: str) -> None:
    """Ring attention's forward on ``n`` ranks: by the operating system's count, each rank sends the next one
    N - 1 key/value blocks and nothing else."""
    case = f"ring attention's forward, {layout} layout, {seq_len} tokens on {n} ranks ({heads} heads, d={dim}, float64)"
    positions = [_reference("positions")(seq_len, n, rank, layout) for rank in range(n)]
    inputs = [(heads, seq_len, dim, layout, 0, positions[r], False, n) for r in range(n)]
    run = common.run_or_fail(driver, n, inputs, case, _DEADLOCK_HINT, timeout=TIMEOUT)
    block_bytes = 2 * heads * (seq_len // n) * dim * 8
    checks.assert_traffic(
        run,
        {(r, (r + 1) % n): (n - 1) * block_bytes for r in range(n)},
        f"{case}: each rank sends N - 1 = {n - 1} key/value blocks of {block_bytes} B to the next rank",
    )


def check_positions_error(seq_len: int, world_size: int, rank: int, layout: str) -> None:
    """sequence_positions(seq_len, world_size, rank, layout) where the layout's chunks do not divide the
    sequence raises a ValueError saying "divisible"."""
    bad = (seq_len, world_size, rank, layout)
    _expect_value_error("sequence_positions", 1, *bad, case=f"sequence_positions{bad}")


def check_positions(seq_len: int, world_size: int, rank: int, layout: str) -> None:
    """sequence_positions(seq_len, world_size, rank, layout) gives the positions section 3's text asks for:
    zig-zag, chunks rank and 2N - 1 - rank of 2N; naive, chunk rank of N."""
    got = exercise.run("sequence_positions", 1, (seq_len, world_size, rank, layout), timeout=TIMEOUT).results[0]
    chunks = (
        f"chunks {rank} and {2 * world_size - 1 - rank} of {2 * world_size}"
        if layout == "zigzag"
        else f"chunk {rank} of {world_size}"
    )
    assert torch.equal(torch.as_tensor(got), _reference("positions")(seq_len, world_size, rank, layout)), (
        f"sequence_positions({seq_len}, {world_size}, {rank}, {layout!r}) should be {chunks}, "
        f"got {torch.as_tensor(got).tolist()}"
    )


# --------------------------------------------------------------------------------------
# Exercise 4: the router (on one rank)
# --------------------------------------------------------------------------------------
def check_router_literal() -> None:
    """top_k_route (k = 1, capacity factor 1) on 5 tokens and 3 experts: each token's most probable expert,
    its softmax probability as the gate, and capacity 2 served in order (the third token wanting expert 1 is
    dropped); load_balancing_loss: E · Σ f_e · P_e."""
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.5, 0.0, 3.0], [1.0, 2.0, 0.0], [2.5, 0.0, 0.1], [0.0, 1.5, 0.2]])
    # k = 1, factor 1: C = ceil(5/3) = 2; first choices 1, 2, 1, 0, 1 -> token 4 finds expert 1 full
    experts, gates, kept = exercise.run("top_k_route", 1, (logits, 1, 1.0), timeout=TIMEOUT).results[0]
    assert torch.as_tensor(experts).tolist() == [[1], [2], [1], [0], [1]], (
        f"top_k_route(k=1): the experts, got {torch.as_tensor(experts).tolist()}"
    )
    checks.assert_close(
        gates, torch.softmax(logits, -1).max(-1, keepdim=True).values, what="top_k_route(k=1): the gates"
    )
    assert torch.as_tensor(kept).tolist() == [[True], [True], [True], [True], [False]], (
        f"top_k_route(k=1, capacity_factor=1.0) on 5 tokens, 3 experts: capacity 2, the third token wanting expert 1 "
        f"is dropped; got kept={torch.as_tensor(kept).tolist()}"
    )
    chosen = torch.tensor([[1], [2], [1], [0], [1]])
    loss = exercise.run("load_balancing_loss", 1, (logits, chosen), timeout=TIMEOUT).results[0]
    want = 3 * (torch.tensor([1 / 5, 3 / 5, 1 / 5]) * torch.softmax(logits, -1).mean(0)).sum()
    checks.assert_close(torch.as_tensor(loss), want, what="load_balancing_loss: E * sum_e f_e P_e")


def _aux_grad_driver(logits, experts):
    """The test's driver: your loss's gradient with respect to the logits."""
    logits = logits.clone().requires_grad_()
    loss = load_balancing_loss(logits, experts)  # noqa: F821  (the notebook's)
    loss.backward()
    return loss.detach(), logits.grad


def check_router(
    tokens: int, n_experts: int, k: int, factor: float, seed: int, *, route: Callable, aux: Callable
) -> None:
    """top_k_route on random float64 logits: the chosen experts (most probable first), the gates and the
    choices kept (capacity ceil(factor · k · tokens / n_experts), served choice-major) equal ``route(logits, k,
    factor)``; load_balancing_loss and its gradient with respect to the logits equal ``aux(logits, experts)``'s
    (both references held by the graded cell's hidden tests)."""
    case = f"top_k_route on {tokens} tokens, {n_experts} experts, k={k}, capacity_factor={factor}"
    logits = torch.randn(tokens, n_experts, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    experts, gates, kept = exercise.run("top_k_route", 1, (logits, k, factor), timeout=TIMEOUT).results[0]
    want = route(logits, k, factor)
    assert torch.equal(torch.as_tensor(experts), want[0]), f"{case}: the chosen experts differ (most probable first)"
    checks.assert_close(gates, want[1], what=f"{case}: the gates")
    kept = torch.as_tensor(kept)
    assert kept.dtype == torch.bool and torch.equal(kept, want[2]), (
        f"{case}: kept differs: {int(kept.sum())} choices kept, expected {int(want[2].sum())} (capacity "
        f"{math.ceil(factor * k * tokens / n_experts)}, served choice-major)"
    )
    loss, grad = exercise.run(_aux_grad_driver, 1, (logits, want[0]), timeout=TIMEOUT).results[0]
    ref_logits = logits.clone().requires_grad_()
    ref = aux(ref_logits, want[0])
    ref.backward()
    checks.assert_close(loss, ref.detach(), what=f"{case}: load_balancing_loss")
    checks.assert_close(
        grad, ref_logits.grad, what=f"{case}: the gradient of load_balancing_loss with respect to the logits"
    )


# --------------------------------------------------------------------------------------
# Exercise 5: the expert-parallel MoE layer
# --------------------------------------------------------------------------------------
def _moe_in_rank(d, hidden, n_experts, k, factor, tokens, seed, backward):
    """The test's driver: your layer built from MoE(..., seed) on this rank's tokens; a barrier, then backward
    of sum(y * dy) + aux.  Returns the output, the aux loss, and the gradients of x and of its parameters."""
    g = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    x, dy = (
        torch.randn(tokens, d, generator=g, dtype=torch.float64),
        torch.randn(tokens, d, generator=g, dtype=torch.float64),
    )
    x.requires_grad_()
    layer = ExpertParallelMoE(MoE(d, hidden, n_experts, k, factor, seed=seed).double())  # noqa: F821  (the notebook's)
    y, aux = layer(x)
    if not backward:
        return None
    dist.barrier()
    ((y * dy).sum() + aux).backward()
    return y.detach(), aux.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters()}


def _build_moe(n_experts):
    """The test's driver: your layer built from a dense MoE with n_experts."""
    ExpertParallelMoE(MoE(4, 4, n_experts))  # noqa: F821  (the notebook's)


def moe_driver(graders: Callable | None = None) -> Callable:
    """The driver the expert-parallel layer is graded with: the lab's own (your layer on your router) where
    your top_k_route and load_balancing_loss pass exercise 4's check, else ``graders`` (your layer on the
    grader's router, defined in the graded cell's hidden tests: None in your notebook).  Decided once per run
    of the graded cell."""
    try:
        check_router_literal()
        return _moe_in_rank
    except Exception as e:
        if graders is None:
            raise AssertionError(
                f"ExpertParallelMoE builds on your top_k_route and load_balancing_loss, which do not "
                f"pass exercise 4's check yet; fix exercise 4 first (the grader grades the layer with "
                f"its own router).\n{e}"
            ) from None
        return graders


def _tokens(rank: int, tokens: int, d: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return (
        torch.randn(tokens, d, generator=g, dtype=torch.float64),
        torch.randn(tokens, d, generator=g, dtype=torch.float64),
    )


def every_token_to_every_expert(dense: nn.Module, x: torch.Tensor) -> tuple:
    """The reference when k = E and nothing is dropped: y = sum_e p_e * expert_e(x) (no router needed);
    (y, aux, rows each expert received)."""
    logits = dense.router(x)
    p = torch.softmax(logits, -1)
    y = sum(p[:, e : e + 1] * expert(x) for e, expert in enumerate(dense.experts))
    load = [x.shape[0]] * len(dense.experts)
    n = len(dense.experts)
    return y, n * ((torch.ones(n, dtype=x.dtype) / n) * p.mean(0)).sum(), load


def check_moe(
    driver: Callable,
    n: int,
    d: int,
    hidden: int,
    n_experts: int,
    k: int,
    factor: float,
    tokens: int,
    seed: int,
    *,
    reference: Callable,
) -> None:
    """ExpertParallelMoE of MoE(d, hidden, n_experts, k, factor) on ``n`` ranks, ``tokens`` float64 tokens per
    rank: each rank's output, load-balancing loss, input gradient and router gradient equal one process on its
    tokens (``reference(dense, x) -> (y, aux, rows per expert)``); each rank holds its E/N experts, whose
    gradients come from every rank's tokens; the ranks only call all_to_all_single."""
    case = (
        f"ExpertParallelMoE: {n_experts} experts on {n} ranks, k={k}, capacity factor {factor}, "
        f"{tokens} tokens per rank, d={d}"
    )
    run = common.run_or_fail(
        driver, n, (d, hidden, n_experts, k, factor, tokens, seed, True), case, _DEADLOCK_HINT, timeout=TIMEOUT
    )
    dense = _notebook("MoE")(d, hidden, n_experts, k, factor, seed=seed).double()
    per = n_experts // n
    for rank, (y, aux, x_grad, grads) in enumerate(run.results):
        x, dy = _tokens(rank, tokens, d, seed)
        x.requires_grad_()
        dense.router.zero_grad()
        want_y, want_aux, _ = reference(dense, x)
        ((want_y * dy).sum() + want_aux).backward()
        checks.assert_close(
            y,
            want_y.detach(),
            what=f"{case}: rank {rank}'s output, against one process on its tokens (dropped choices add 0)",
        )
        checks.assert_close(aux, want_aux.detach(), what=f"{case}: rank {rank}'s load-balancing loss")
        checks.assert_close(x_grad, x.grad, what=f"{case}: rank {rank}'s gradient of its tokens")
        expected = {"router.weight"} | {
            f"experts.{i}.{name}" for i in range(per) for name, _ in dense.experts[0].named_parameters()
        }
        assert set(grads) == expected, (
            f"{case}: rank {rank}'s parameters should be {sorted(expected)}, got {sorted(grads)}"
        )
        checks.assert_close(
            grads["router.weight"],
            dense.router.weight.grad,
            what=f"{case}: rank {rank}'s router gradient (from its own tokens)",
        )
    for rank, (_, _, _, grads) in enumerate(run.results):
        for i in range(per):
            for name, p in dense.experts[rank * per + i].named_parameters():
                got, want = grads[f"experts.{i}.{name}"], p.grad  # an expert nobody chose: no gradient, or zeros
                got, want = (torch.zeros_like(p) if t is None else t for t in (got, want))
                checks.assert_close(
                    got,
                    want,
                    what=(
                        f"{case}: rank {rank}'s experts.{i}.{name} gradient: expert {rank * per + i} gets the tokens "
                        "of every rank"
                    ),
                )
    for rank in range(n):
        calls = [e for e in run.trace.by_rank(rank) if e.kind in ("collective", "p2p") and e.op != "barrier"]
        other = [e for e in calls if e.op != "all_to_all_single"]
        assert not other, f"{case}: rank {rank} should only call all_to_all_single; it also made: {describe(other, n)}"


def check_moe_bytes(
    driver: Callable,
    n: int,
    d: int,
    hidden: int,
    n_experts: int,
    k: int,
    factor: float,
    tokens: int,
    seed: int,
    *,
    reference: Callable,
) -> None:
    """ExpertParallelMoE's forward on ``n`` ranks: by the operating system's count, rank s sends rank t its
    kept choices' rows for t's experts (dispatch, as ``reference`` routes them), t's rows back (combine), and
    the E/N counts, nothing else."""
    case = (
        f"ExpertParallelMoE's forward: {n_experts} experts on {n} ranks, k={k}, capacity factor {factor}, "
        f"{tokens} tokens per rank, d={d}"
    )
    run = common.run_or_fail(
        driver, n, (d, hidden, n_experts, k, factor, tokens, seed, False), case, _DEADLOCK_HINT, timeout=TIMEOUT
    )
    dense, per = _notebook("MoE")(d, hidden, n_experts, k, factor, seed=seed).double(), n_experts // n
    rows = torch.zeros(n, n, dtype=torch.long)  # rows[src, dst]: kept choices src sends dst
    for src in range(n):
        load = reference(dense, _tokens(src, tokens, d, seed)[0])[2]
        for dst in range(n):
            rows[src, dst] = sum(load[dst * per : (dst + 1) * per])
    expected = {(s, t): int(rows[s, t] + rows[t, s]) * d * 8 + per * 8 for s in range(n) for t in range(n) if s != t}
    checks.assert_traffic(
        run,
        expected,
        f"{case}: rank s sends rank t its kept choices' rows for t's experts (dispatch), "
        f"t's rows back (combine), and {per} counts",
    )


def check_moe_error(world_size: int, n_experts: int) -> None:
    """ExpertParallelMoE of a MoE whose ``n_experts`` the ``world_size`` ranks do not divide raises a
    ValueError saying "divisible"."""
    case = f"ExpertParallelMoE(MoE(4, 4, n_experts={n_experts})) on {world_size} ranks"
    _expect_value_error(_build_moe, world_size, n_experts, case=case)


# --------------------------------------------------------------------------------------
# Exercise 6: sequence parallelism
# --------------------------------------------------------------------------------------
_SP_PARTS = {
    "query": ("attn.query", 0),
    "key": ("attn.key", 0),
    "value": ("attn.value", 0),
    "fc1": ("mlp.0", 0),
    "proj": ("attn.proj", 1),
    "fc2": ("mlp.2", 1),
}


def _sp_in_rank(d, heads, tokens, batch, seed):
    """The test's driver: your SequenceParallelBlock on this rank's contiguous tokens; SavedActivations over its
    forward, a barrier, then backward of sum(y * dy).  Returns y, the gradients of x and the parameters, the bytes
    saved."""
    n, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(seed + 1)
    x, dy = (torch.randn(batch, tokens, d, generator=g, dtype=torch.float64) for _ in range(2))
    mine = slice(rank * tokens // n, (rank + 1) * tokens // n)
    layer = SequenceParallelBlock(transformer_block(d, heads, seed))  # noqa: F821  (the notebook's)
    x = x[:, mine].clone().requires_grad_()
    with dl.memory.SavedActivations(layer) as saved:  # noqa: F821  (the notebook's dl)
        y = layer(x)
    dist.barrier()
    (y * dy[:, mine]).sum().backward()
    return y.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters()}, saved.total


def _build_sp(heads):
    """The test's driver: your block from a models.Block with this many heads."""
    SequenceParallelBlock(transformer_block(12, heads, 0))  # noqa: F821  (the notebook's)


def check_sp(t: int, d: int, heads: int, tokens: int, batch: int, seed: int) -> None:
    """SequenceParallelBlock on ``t`` ranks, float64: each rank's output and input gradient equal the block's on
    its tokens, its linears' gradients are its slices of the block's (a row-parallel bias on rank 0 only), the
    LayerNorms' gradients summed over the ranks equal the block's; it saves 1/t of the block's activations; it
    only all-gathers and reduce-scatters (no all-reduce), tensor parallelism's bytes forward and those plus
    gather_linear's second all-gather of its input backward."""
    case = f"SequenceParallelBlock on {t} ranks (d={d}, {heads} heads, {tokens} tokens, batch {batch}, float64)"
    run = common.run_or_fail(_sp_in_rank, t, (d, heads, tokens, batch, seed), case, _DEADLOCK_HINT, timeout=TIMEOUT)
    block = _notebook("transformer_block")(d, heads, seed)  # the block, in one process (the notebook's given one)
    g = torch.Generator().manual_seed(seed + 1)
    x, dy = (torch.randn(batch, tokens, d, generator=g, dtype=torch.float64) for _ in range(2))
    x.requires_grad_()
    with memory.SavedActivations(block) as saved:
        y = block(x)
    (y * dy).sum().backward()
    full = dict(block.named_parameters())
    per = tokens // t
    for rank, (out, dx, grads, nbytes) in enumerate(run.results):
        mine = slice(rank * per, (rank + 1) * per)
        checks.assert_close(
            out,
            y.detach()[:, mine],
            what=f"{case}: rank {rank}'s output (tokens {rank * per}..{(rank + 1) * per - 1}), against the "
            "single-process block",
        )
        checks.assert_close(dx, x.grad[:, mine], what=f"{case}: rank {rank}'s gradient of its tokens")
        for name, (source, cut) in _SP_PARTS.items():
            checks.assert_close(
                grads.get(f"{name}.weight"),
                full[f"{source}.weight"].grad.chunk(t, dim=cut)[rank],
                what=f"{case}: rank {rank}'s {name}.weight gradient, its slice of the block's {source}.weight",
            )
            bias = full[f"{source}.bias"].grad
            want = bias.chunk(t)[rank] if cut == 0 else (bias if rank == 0 else None)
            got = grads.get(f"{name}.bias")
            if want is None:
                assert got is None or not got.abs().any(), (
                    f"{case}: rank {rank}'s {name}.bias: RowParallelLinear keeps the bias on rank 0 only"
                )
            else:
                checks.assert_close(got, want, what=f"{case}: rank {rank}'s {name}.bias gradient")
        assert nbytes * t == saved.total, (
            f"{case}: rank {rank} saved {nbytes} B of activations for backward (dl.memory.SavedActivations); "
            f"1/t of the single-process block's {saved.total} B is {saved.total / t:.0f} B.  gather_linear must save "
            f"this rank's slice and all-gather it again in backward, not save the gathered input"
        )
    for part in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"):
        checks.assert_close(
            sum(r[2][part] for r in run.results),
            full[part].grad,
            what=f"{case}: {part}'s gradient summed over the ranks (each rank's part is from its tokens)",
        )
    tensor = batch * tokens * d * 8
    for rank in range(t):
        calls, _ = _forward_phase(run, rank)
        forward = {id(e) for e in calls}
        every = [e for e in run.trace.by_rank(rank) if e.kind == "collective" and e.op != "barrier"]
        wrong = [e for e in every if not e.op.startswith(("all_gather", "reduce_scatter"))]
        assert not wrong, (
            f"{case}: rank {rank} may only all-gather and reduce-scatter (no all-reduce); it made {describe(wrong, t)}"
        )
        wire = lambda events: sum((t - 1) / t * e.bytes for e in events)  # a ring all-gather / reduce-scatter
        fwd, bwd = wire(e for e in every if id(e) in forward), wire(e for e in every if id(e) not in forward)
        tp = 2 * 2 * (t - 1) / t * tensor  # tensor parallelism: two ring all-reduces
        assert abs(fwd - tp) < 1, (
            f"{case}: rank {rank}'s forward moved {fwd:.0f} B (ring cost of its collectives); tensor "
            f"parallelism's two all-reduces of {tensor} B move {tp:.0f} B: two all-gathers and two reduce-scatters"
        )
        assert abs(bwd - tp - 2 * (t - 1) / t * tensor) < 1, (
            f"{case}: rank {rank}'s backward moved {bwd:.0f} B; tensor parallelism's backward moves {tp:.0f} B, and "
            f"gather_linear's second all-gather of its input adds {2 * (t - 1) / t * tensor:.0f} B (two calls)"
        )


def check_sp_error(world_size: int, heads: int) -> None:
    """SequenceParallelBlock of a block of width 12 whose ``heads`` the ``world_size`` ranks do not divide
    raises a ValueError saying "divisible"."""
    case = f"SequenceParallelBlock of a {heads}-head block of width 12 on {world_size} ranks"
    _expect_value_error(_build_sp, world_size, heads, case=case)


# --------------------------------------------------------------------------------------
# Exercise 7: Ulysses
# --------------------------------------------------------------------------------------
def _ulysses_in_rank(heads, seq_len, dim, seed, positions):
    """The test's driver: your ulysses_attention on this rank's tokens, then backward of sum(out * dout)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(heads, seq_len, dim, generator=g, dtype=torch.float64) for _ in range(4))
    mine = [t[:, positions].clone().requires_grad_() for t in (q, k, v)]
    out = ulysses_attention(*mine)  # noqa: F821  (the notebook's)
    dist.barrier()
    out.backward(dout[:, positions])
    return out.detach(), [t.grad for t in mine]


def _ulysses_heads(heads):
    """The test's driver: your ulysses_attention with a head count the group may not divide."""
    ulysses_attention(*(torch.zeros(heads, 4, 2) for _ in range(3)))  # noqa: F821  (the notebook's)


def check_ulysses(n: int, heads: int, seq_len: int, dim: int, seed: int = 0) -> None:
    """ulysses_attention of ``seq_len`` contiguous tokens on ``n`` ranks, float64: each rank's output and the
    gradients of its q, k, v equal torch's causal attention to 1e-9; it only calls all_to_all_single, whose
    bytes are the cost model's: q, k, v and the output, (N - 1)/N of a block each, forward, the same backward."""
    case = f"ulysses_attention, {seq_len} tokens on {n} ranks ({heads} heads, d={dim}, float64)"
    positions = [_reference("positions")(seq_len, n, rank, "naive") for rank in range(n)]
    inputs = [(heads, seq_len, dim, seed, positions[r]) for r in range(n)]
    run = common.run_or_fail(_ulysses_in_rank, n, inputs, case, _DEADLOCK_HINT, timeout=TIMEOUT)
    q, k, v, dout = (t.requires_grad_() for t in _qkv(heads, seq_len, dim, seed))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    want.backward(dout)
    block = (seq_len // n) * heads * dim * 8
    for rank, (out, grads) in enumerate(run.results):
        pos = positions[rank]
        checks.assert_close(
            out,
            want.detach()[:, pos],
            rtol=1e-9,
            atol=1e-9,
            what=(
                f"{case}: rank {rank}'s output (tokens {pos.tolist()}), against "
                "F.scaled_dot_product_attention(is_causal=True)"
            ),
        )
        for name, got, ref in zip("qkv", grads, (q, k, v)):
            checks.assert_close(
                got, ref.grad[:, pos], rtol=1e-9, atol=1e-9, what=f"{case}: rank {rank}'s gradient of {name}"
            )
        calls, _ = _forward_phase(run, rank)
        every = [e for e in run.trace.by_rank(rank) if e.kind in ("collective", "p2p") and e.op != "barrier"]
        other = [e for e in every if e.op != "all_to_all_single"]
        assert not other, f"{case}: rank {rank} may only call all_to_all_single; it also made: {describe(other, n)}"
        forward = sum((n - 1) / n * e.bytes for e in calls if e.op == "all_to_all_single")
        total = sum((n - 1) / n * e.bytes for e in every)
        assert abs(forward - 4 * (n - 1) / n * block) < 1 and abs(total - 8 * (n - 1) / n * block) < 1, (
            f"{case}: rank {rank}'s all-to-alls moved {forward:.0f} B forward and {total:.0f} B in all; the cost "
            f"model: q, k, v and the output, (N - 1)/N of a {block} B block each, "
            f"{4 * (n - 1) / n * block:.0f} B forward, the same again backward"
        )


def check_ulysses_error(world_size: int, heads: int) -> None:
    """ulysses_attention with ``heads`` heads that the ``world_size`` ranks do not divide raises a ValueError
    saying "divisible"."""
    _expect_value_error(
        _ulysses_heads, world_size, heads, case=f"ulysses_attention with {heads} heads on {world_size} ranks"
    )


# --------------------------------------------------------------------------------------
# Exercise 8: mesh_groups (on one rank)
# --------------------------------------------------------------------------------------
def check_groups(sizes: dict, dims: str | Sequence[str], *, reference: Callable) -> None:
    """mesh_groups(sizes, dims) equals ``reference(sizes, dims)`` (the graded cell's: the grid torch's
    DeviceMesh builds, row-major, its groups along ``dims``), each group sorted, sorted by their first rank."""
    case = f"mesh_groups({sizes}, {dims!r})"
    got = exercise.run("mesh_groups", 1, (sizes, dims), timeout=TIMEOUT).results[0]
    want = reference(sizes, dims)
    assert isinstance(got, list) and [list(g) for g in got] == want, (
        f"{case}: got {got}; the grid is torch.arange({math.prod(sizes.values())}).view{tuple(sizes.values())} "
        f"(row-major, the last dimension fastest), and the groups of {dims!r} are the ranks differing there only, "
        f"each sorted, sorted by their first rank: {want}"
    )


def check_expert_grid(pp: int, dp: int, cp: int, tp: int, ep: int, *, reference: Callable) -> None:
    """The dense grid pp × dp × cp × tp and the experts' view of the same ranks, pp × (dp·cp/ep) × ep × tp:
    your groups of both (against ``reference``), and each of your ep groups inside one of your dp·cp groups."""
    dense, expert = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}, {"pp": pp, "edp": dp * cp // ep, "ep": ep, "tp": tp}
    for sizes, dims in ((dense, ("dp", "cp")), (expert, "ep"), (expert, "edp"), (expert, "pp")):
        check_groups(sizes, dims, reference=reference)
    dp_cp = exercise.run("mesh_groups", 1, (dense, ("dp", "cp")), timeout=TIMEOUT).results[0]
    for group in exercise.run("mesh_groups", 1, (expert, "ep"), timeout=TIMEOUT).results[0]:
        assert any(set(group) <= set(g) for g in dp_cp), (
            f"pp={pp}, dp={dp}, cp={cp}, tp={tp}, ep={ep}: the ep group {group} is not inside one dp·cp group {dp_cp}"
        )


# --------------------------------------------------------------------------------------
# Exercise 9: memory_per_device_5d (on one rank)
# --------------------------------------------------------------------------------------
_DEFAULTS = dict(experts=1, dp=1, tp=1, pp=1, cp=1, ep=1, micro_batches=1, zero=0, sp=False)


def _memory_5d_of(config):
    """The test's driver: your memory_per_device_5d on this configuration, as a plain number."""
    got = memory_per_device_5d(**config)  # noqa: F821  (the notebook's)
    return float(got) if isinstance(got, (int, float)) or hasattr(got, "__float__") else repr(got)


def check_5d(model: dict, reference: Callable, lab8_reference: Callable, **grid) -> None:
    """memory_per_device_5d(world=dp·tp·pp·cp, **model, **grid) equals ``reference(config)`` (the graded cell's
    formulas), which reduces to Lab 8's memory_per_device (``lab8_reference``) where cp = ep = experts = 1:
    states zero(Ψ_dense, dp·cp) + zero(Ψ_expert, dp·cp/ep), activations of s/cp tokens per layer."""
    config = {**_DEFAULTS, **model, **grid}
    config["world"] = config["dp"] * config["tp"] * config["pp"] * config["cp"]
    shown = ", ".join(
        f"{k}={config[k]}" for k in ("world", "experts", "dp", "tp", "pp", "cp", "ep", "micro_batches", "zero", "sp")
    )
    try:
        got = exercise.run(_memory_5d_of, 1, (config,), timeout=TIMEOUT).results[0]
    except exercise.ExerciseError as e:
        raise AssertionError(
            f"memory_per_device_5d({shown}) raised {e.exc_type}: {e.exc_message}"
            if e.exc_type
            else f"memory_per_device_5d({shown}): {e}"
        ) from None
    want = reference(config)
    lab8 = config["cp"] == config["ep"] == config["experts"] == 1
    if lab8:
        assert math.isclose(want, lab8_reference(config), rel_tol=1e-12)  # the reference reduces to Lab 8's
    assert isinstance(got, float) and math.isclose(got, want, rel_tol=1e-6), (
        f"memory_per_device_5d({shown}) with L={config['layers']}, h={config['hidden']}, s={config['seq']}, "
        f"B={config['batch']}, V={config['vocab']}: expected {want / 1e9:.4f} GB, got "
        f"{got / 1e9 if isinstance(got, float) else got} GB.  States: zero(Ψ_dense, dp·cp) + zero(Ψ_expert, dp·cp/ep), "
        f"Ψ_dense = (4Lh² + 2Vh)/(tp·pp), Ψ_expert = 8Lh²·E/(tp·pp·ep); activations of s/cp tokens per layer, times "
        f"L/pp layers and min(pp, m) micro-batches"
        + ("; with cp = ep = experts = 1 this is Lab 8's memory_per_device" if lab8 else "")
    )


def check_5d_error(model: dict, world: int, needles: Sequence[Sequence[str]], rule: str, **grid) -> None:
    """memory_per_device_5d(world=world, **model, **grid) on an invalid grid (``rule``) raises a ValueError
    naming the rule and the values: for each group of ``needles``, one of them in its message."""
    config = {**_DEFAULTS, **model, **grid, "world": world}
    case = f"memory_per_device_5d(world={world}, " + ", ".join(f"{k}={v}" for k, v in grid.items()) + f") ({rule})"
    try:
        exercise.run(_memory_5d_of, 1, (config,), timeout=TIMEOUT)
    except exercise.ExerciseError as e:
        message = e.exc_message or ""
        if e.exc_type == "ValueError" and all(any(n in message for n in alternatives) for alternatives in needles):
            return
        got = f"{e.exc_type}: {message}" if e.exc_type is not None else str(e)
        raise AssertionError(
            f"{case}: expected a ValueError naming the rule and the values "
            f"({' and '.join(' or '.join(map(repr, a)) for a in needles)}); got {got}"
        ) from None
    raise AssertionError(f"{case}: expected a ValueError ({rule}), but it returned a number")
