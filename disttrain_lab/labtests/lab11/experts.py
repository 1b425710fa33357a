"""Lab 11's exercises 1 and 3 (and 2 and 4, the predictions, are in their graded cells): the router (one
rank) and the expert-parallel MoE layer against the dense MoE in one process; its all-to-all's bytes."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ... import carried, checks, exercise
from .. import common
from .common import GRADED_PASSED, TIMEOUT


# --------------------------------------------------------------------------------------
# Exercise 1: the router (on one rank)
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
# Exercise 3: the expert-parallel MoE layer
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
    your top_k_route and load_balancing_loss passed exercise 1's graded test (``GRADED_PASSED``: every case of
    it, not one) or, in your notebook (no ``graders``), pass exercise 1's check; else ``graders`` (your layer on
    the grader's router, defined in the graded cell's hidden tests).  Decided once per run of the graded cell."""
    if "router" in GRADED_PASSED:
        return _moe_in_rank
    try:
        if graders is not None:
            raise AssertionError("exercise 1 has not passed its graded test")
        check_router_literal()
        return _moe_in_rank
    except Exception as e:
        if graders is None:
            raise AssertionError(
                f"ExpertParallelMoE builds on your top_k_route and load_balancing_loss, which do not "
                f"pass exercise 1's check yet; fix exercise 1 first (the grader grades the layer with "
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
    gradients come from every rank's tokens; the ranks only call all_to_all_single.  Under grading, what those
    carried is read from the grader's capture, forward (``_assert_rows_on_the_wire``) and backward
    (``_assert_gradient_rows_on_the_wire``)."""
    case = (
        f"ExpertParallelMoE: {n_experts} experts on {n} ranks, k={k}, capacity factor {factor}, "
        f"{tokens} tokens per rank, d={d}"
    )
    run = common.run_or_fail(
        driver,
        n,
        (d, hidden, n_experts, k, factor, tokens, seed, True),
        case,
        common.DEADLOCK_HINT,
        timeout=TIMEOUT,
        content=True,  # (the grader reads which calls the ranks made from what crossed)
    )
    dense = common.given("MoE")(d, hidden, n_experts, k, factor, seed=seed).double()
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
    _assert_rows_on_the_wire(run, case, dense, tokens, d, seed, reference)
    _assert_gradient_rows_on_the_wire(run, case, dense, tokens, d, seed, reference)
    made = carried.calls_made(run, case)  # under grading: the grader's capture of the wire
    if made is not None:
        other = {kind: ranks for kind, ranks in made.items() if kind not in ("all_to_all", "barrier")}
        assert not other, (
            f"{case}: the ranks should only call all_to_all_single; the grader's capture of the wire shows messages "
            "of "
            + "; ".join(f"{kind} from rank(s) {', '.join(map(str, sorted(r)))}" for kind, r in sorted(other.items()))
        )
        return
    for rank in range(n):  # the student's own kernel: the ranks' trace
        calls = [e for e in run.trace.by_rank(rank) if e.kind in ("collective", "p2p") and e.op != "barrier"]
        other = [e for e in calls if e.op != "all_to_all_single"]
        assert not other, (
            f"{case}: rank {rank} should only call all_to_all_single; it also made: {common.describe_calls(other)}"
        )


def _assert_rows_on_the_wire(run, case: str, dense: nn.Module, tokens: int, d: int, seed: int, reference: Callable):
    """Under grading, what the ranks' all-to-alls carried, from the grader's capture: from rank s to rank t, the
    kept choices of s's tokens routed to t's experts (``reference``'s rows per expert), each as its token's row,
    byte for byte (dispatch); from t back to s as many rows that are one of t's experts' outputs on one of s's
    tokens, within float64's rounding (combine), computed here in one process.  Rows passed some other way
    (the launcher's store) with zeros of the right sizes on the wire fail; so do rows sent in another dtype."""
    sent = carried.sends_by_connection(run, case)
    if sent is None:  # (the student's own kernel: no capture)
        return
    n = run.world_size
    streams: dict[tuple[int, int], list[bytes]] = {}
    for src, dst, _, _, payload in sent:
        streams.setdefault((src, dst), []).append(payload)
    per = len(dense.experts) // n
    for s in range(n):
        x = _tokens(s, tokens, d, seed)[0]
        with torch.no_grad():
            load = reference(dense, x)[2]
            outputs = [torch.cat([dense.experts[e](x) for e in range(t * per, (t + 1) * per)]) for t in range(n)]
        for t in range(n):
            want = int(sum(load[t * per : (t + 1) * per]))
            if t == s or want == 0:
                continue
            found = carried.rows_whole(streams.get((s, t), []), x)
            assert found >= want, (
                f"{case}: rank {s} routes {want} kept choice(s) to rank {t}'s experts, so its dispatch should carry "
                f"as many rows of its tokens, as they are (float64, {8 * d} bytes each); the grader's capture of the "
                f"wire found {found} in the {sum(map(len, streams.get((s, t), []))):,} bytes rank {s} sent rank {t}. "
                "The rows must travel in the all-to-all itself"
            )
            found = carried.rows_close(carried.rows_sent(streams.get((t, s), []), d), outputs[t], rtol=1e-6, atol=1e-9)
            assert found >= want, (
                f"{case}: rank {t} should send rank {s} back its experts' outputs on the {want} row(s) it received "
                f"from rank {s} (the combine, float64); the grader's capture of the wire found {found} "
                f"such row(s) in what rank {t} sent rank {s}. The rows must travel in the all-to-all itself"
            )


def _assert_gradient_rows_on_the_wire(
    run, case: str, dense: nn.Module, tokens: int, d: int, seed: int, reference: Callable
) -> None:
    """Under grading, what the ranks' all-to-alls carried in backward, from the grader's capture: the all-to-alls
    after the driver's barrier (the first barrier on the wire; the forward's calls come before it).  Backward runs
    the combine and the dispatch again with the splits swapped: from rank s to rank t, as many rows that are the
    gradient of one of s's combined rows as s's kept choices routed to t's experts (``reference``'s rows per
    expert), each its token's dy times its gate, the router's probability of that expert (the gate is applied back
    home: the combine's backward); and from t back to s as many rows that are one of t's experts' input gradients
    on one of s's tokens, given that gradient at its output (the dispatch's backward).  Both within float64's
    rounding (rtol 1e-6, atol 1e-9), computed here in one process with autograd on the dense MoE's router and
    experts.  Gradients put in place some other way (the launcher's store, or each rank's own computation from the
    seeded x and dy) with zeros of the right sizes in the backward's all-to-alls fail."""
    sent = carried.sends(run, case)
    if sent is None:  # (the student's own kernel: no capture)
        return
    n = run.world_size
    barriers = sorted(slot & carried.CALL_BITS for _, _, slot, _ in sent if carried.kind(slot) == "barrier")
    assert barriers or not sent, (
        f"{case}: the grader's capture of the wire shows no barrier between forward and backward (the driver calls "
        "dist.barrier() between them)"
    )
    streams: dict[tuple[int, int], list[bytes]] = {}
    for src, dst, slot, payload in sent:
        if carried.kind(slot) == "all_to_all" and slot & carried.CALL_BITS > barriers[0]:
            streams.setdefault((src, dst), []).append(payload)
    per = len(dense.experts) // n
    for s in range(n):
        x, dy = _tokens(s, tokens, d, seed)
        with torch.no_grad():
            load = reference(dense, x)[2]
            p = torch.softmax(dense.router(x), -1)  # a kept choice's gate: its expert's probability
        for t in range(n):
            want = int(sum(load[t * per : (t + 1) * per]))
            if t == s or want == 0:
                continue
            gated = [p[:, e : e + 1] * dy for e in range(t * per, (t + 1) * per)]  # d(sum(y * dy)) / d(its output)
            inputs = []
            for e, grad in zip(range(t * per, (t + 1) * per), gated):
                tokens_in = x.clone().requires_grad_()
                inputs += torch.autograd.grad(dense.experts[e](tokens_in), tokens_in, grad_outputs=grad)
            payloads = streams.get((s, t), [])
            found = carried.rows_close(carried.rows_sent(payloads, d), torch.cat(gated), rtol=1e-6, atol=1e-9)
            assert found >= want, (
                f"{case}: rank {s} routes {want} kept choice(s) to rank {t}'s experts, so in backward it should send "
                f"rank {t} the gradients of the {want} row(s) its combine received from rank {t} (the combine's "
                f"backward: each its token's dy times its gate, the router's probability of that expert; float64, "
                f"{8 * d} bytes a row); the grader's capture of the wire found {found} in the "
                f"{sum(map(len, payloads)):,} bytes rank {s} sent rank {t} in all-to-alls after the driver's "
                "barrier. The gradients must travel in the all-to-all itself"
            )
            payloads = streams.get((t, s), [])
            found = carried.rows_close(carried.rows_sent(payloads, d), torch.cat(inputs), rtol=1e-6, atol=1e-9)
            assert found >= want, (
                f"{case}: in backward rank {t} should send rank {s} the gradients of the {want} token row(s) it "
                f"received from rank {s} (the dispatch's backward: its experts' input gradients, float64); the "
                f"grader's capture of the wire found {found} such row(s) in the {sum(map(len, payloads)):,} bytes "
                f"rank {t} sent rank {s} in all-to-alls after the driver's barrier. The gradients must travel in the "
                "all-to-all itself"
            )


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
        driver, n, (d, hidden, n_experts, k, factor, tokens, seed, False), case, common.DEADLOCK_HINT, timeout=TIMEOUT
    )
    dense, per = common.given("MoE")(d, hidden, n_experts, k, factor, seed=seed).double(), n_experts // n
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
    common.expect_divisible_error(_build_moe, world_size, n_experts, case=case)
