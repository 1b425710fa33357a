"""Lab 10's exercises 4-5: sequence parallelism and Ulysses against the dense block in one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import carried, checks, memory
from .. import common, tp_partials
from .common import TIMEOUT, _forward_phase, _qkv, _reference

# --------------------------------------------------------------------------------------
# Exercise 4: sequence parallelism
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
    LayerNorms' gradients summed over the ranks equal the block's; tensor parallelism's bytes forward and those
    plus gather_linear's second all-gather of its input backward, in all-gathers and reduce-scatters.  Under
    grading the calls and bytes come from the grader's capture of the wire (``_sp_on_the_wire``); in the
    student's own kernel from the trace, which also says that it saves 1/t of the block's activations (its own
    count, which no capture can tell)."""
    case = f"SequenceParallelBlock on {t} ranks (d={d}, {heads} heads, {tokens} tokens, batch {batch}, float64)"
    run = common.run_or_fail(
        _sp_in_rank, t, (d, heads, tokens, batch, seed), case, common.DEADLOCK_HINT, timeout=TIMEOUT, content=True
    )
    block = common.given("transformer_block")(d, heads, seed)  # the block, in one process (the notebook's given one)
    g = torch.Generator().manual_seed(seed + 1)
    x, dy = (torch.randn(batch, tokens, d, generator=g, dtype=torch.float64) for _ in range(2))
    x.requires_grad_()
    normed: dict[str, torch.Tensor] = {}  # what each LayerNorm gave: what the forward's all-gathers must carry
    hooks = [
        getattr(block, name).register_forward_hook(lambda _m, _i, out, name=name: normed.__setitem__(name, out))
        for name in ("ln1", "ln2")
    ]
    into: dict[str, torch.Tensor] = {}  # attention's and the MLP's outputs: their gradients, what backward's carry
    hooks += [
        getattr(block, name).register_forward_hook(lambda _m, _i, out, name=name: into.__setitem__(name, out))
        for name in ("attn", "mlp")
    ]
    with memory.SavedActivations(block) as saved:
        y = block(x)
    for hook in hooks:
        hook.remove()
    for out in into.values():
        out.retain_grad()
    (y * dy).sum().backward()
    full = dict(block.named_parameters())
    per = tokens // t
    observed = carried.sends(run, case) is not None  # under grading: the grader's capture of the wire
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
        # what a rank saved is its own count (SavedActivations, in the rank): the student's self-check; the
        # grader reads that gather_linear gathers its input again instead (backward's all-gathers, on the wire)
        assert observed or nbytes * t == saved.total, (
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
    if observed:
        _sp_on_the_wire(run, t, tensor, case)
        _sp_rows_on_the_wire(run, case, normed, per)
        _sp_sums_on_the_wire(run, case, block, normed, {name: out.grad for name, out in into.items()}, per)
        return
    for rank in range(t):  # the ranks' trace: in the student's own kernel
        calls, _ = _forward_phase(run, rank)
        forward = {id(e) for e in calls}
        every = [e for e in run.trace.by_rank(rank) if e.kind == "collective" and e.op != "barrier"]
        scatters = ("all_to_all",) if run.backend == "gloo" else ("all_to_all", "reduce_scatter")
        wrong = [e for e in every if not e.op.startswith(("all_gather", *scatters))]
        assert not wrong, (
            f"{case}: rank {rank} may only all-gather and reduce-scatter (no all-reduce), and on the CPU a "
            "reduce-scatter is one all-to-all and a sum (gloo's own all-reduces the whole input, and the grader's "
            f"capture of the wire sees an all-reduce); it made {common.describe_calls(wrong)}"
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


# what each pass of a SequenceParallelBlock calls, as (kind on the wire, how many), every call of the whole
# sequence's tensor: on the CPU a reduce-scatter is one all-to-all (gloo's own would send an all-reduce's
# messages, which the wire cannot tell from an all-reduce, so it fails here as one)
_SP_CALLS = {
    "forward": {"all_gather": 2, "all_to_all": 2},  # before the column-parallel linears; after the row-parallel ones
    "backward": {"all_gather": 4, "all_to_all": 2},  # their mirror images, and gather_linear's input gathered again
}


def _sp_on_the_wire(run, t: int, tensor: int, case: str) -> None:
    """check_sp's calls from the grader's capture: every call is the world group's, one slot each, counted up in
    the order the ranks made them, so the driver's barrier's slot splits the forward pass from the backward;
    each call's bytes from its messages (an all-gather of a B-byte output: (t − 1)·B in all; a reduce-scatter, one
    all-to-all, of a B-byte input: (t − 1)·B too), its kind from its slot: an all-reduce fails, gloo's own
    reduce-scatter with it (it all-reduces the whole input and keeps the rank's chunk: an all-reduce's messages).
    What a rank saved for backward the wire cannot tell: that is the self-check's, from the rank's own count,
    and not graded; backward's four all-gathers are gather_linear gathering its input again, what saving only
    the slice costs.  One rank sends nothing."""
    if t == 1:
        return
    payload: dict[int, int] = {}
    for _, _, _, slot, data in carried.sends_by_connection(run, case):
        payload[slot] = payload.get(slot, 0) + len(data)
    made = sorted(payload.items(), key=lambda call: call[0] & carried.CALL_BITS)
    barriers = [i for i, (slot, _) in enumerate(made) if carried.kind(slot) == "barrier"]
    assert barriers, f"{case}: the grader's capture of the wire shows no barrier between forward and backward"
    data = lambda calls: [c for c in calls if carried.kind(c[0]) != "barrier"]  # noqa: E731  (marks carry no data)
    phases = {"forward": data(made[: barriers[0]]), "backward": data(made[barriers[0] + 1 :])}
    per_call = {"all_gather": t - 1, "all_to_all": t - 1}
    for phase, calls in phases.items():
        other = sorted({carried.kind(slot) for slot, _ in calls} - set(per_call))
        assert not other, (
            f"{case}: the ranks may only all-gather and reduce-scatter (on the CPU one all-to-all and a sum); in the "
            f"{phase} pass the grader's capture of the wire shows messages of {', '.join(other)}"
            + (
                " (gloo's own reduce-scatter all-reduces the whole input and keeps the rank's chunk: on the wire it is "
                "an all-reduce)"
                if "all_reduce" in other
                else ""
            )
        )
        found = {kind: 0 for kind in per_call}
        for slot, total in calls:
            kind = carried.kind(slot)
            found[kind] += 1
            size = total / per_call[kind]
            assert size == tensor, (
                f"{case}: every call of the {phase} pass gathers or scatters the whole sequence's activations, "
                f"{tensor} B; the grader's capture of the wire shows "
                + ("an all-gather" if kind == "all_gather" else "a reduce-scatter (an all-to-all)")
                + f" of {size:.0f} B"
            )
        want = _SP_CALLS[phase]
        assert found == want, (
            f"{case}: the {phase} pass makes {want['all_gather']} all-gathers and {want['all_to_all']} "
            f"reduce-scatters of {tensor} B (tensor parallelism's two all-reduces, split"
            + (", and gather_linear's input gathered again" if phase == "backward" else "")
            + f"); the grader's capture of the wire shows {found['all_gather']} all-gathers and "
            f"{found['all_to_all']} reduce-scatters (all-to-alls)"
        )


def _sp_rows_on_the_wire(run, case: str, normed: dict[str, torch.Tensor], per: int) -> None:
    """What the forward's all-gathers carried, from the grader's capture: each rank's LayerNorm outputs of its own
    tokens (``ln1``'s before attention, ``ln2``'s before the MLP: rows of d float64 values, the single-process
    block's within 1e-9), every row of them in what it sent in all-gathers.  Activations passed some other way
    (the launcher's store) with zeros of the right sizes in the all-gathers fail."""
    sent = carried.sends(run, case) or []
    for rank in range(run.world_size if run.world_size > 1 else 0):  # (one rank sends nothing)
        for name, out in normed.items():
            d = out.shape[-1]
            rows = out.detach()[:, rank * per : (rank + 1) * per].reshape(-1, d)
            gathered = [p for src, _, slot, p in sent if src == rank and carried.kind(slot) == "all_gather"]
            found = carried.rows_close(rows, carried.rows_sent(gathered, d), rtol=1e-9, atol=1e-9)
            assert found == len(rows), (
                f"{case}: rank {rank}'s all-gathers should carry {name}'s output on its {len(rows)} token rows (the "
                f"sequence-parallel region's activations, gathered before the column-parallel linears); the grader's "
                f"capture of the wire found {found} of them in what rank {rank} sent. The activations must travel in "
                "the all-gathers themselves"
            )


def _sp_sums_on_the_wire(run, case: str, block, normed: dict[str, torch.Tensor], grads: dict, per: int) -> None:
    """What the reduce-scatters carried, from the grader's capture: on the CPU each is one all-to-all, in which rank r
    sends rank s the rows of its partial sum on s's tokens.  Forward, after attention (its heads through its columns
    of ``proj``) and the MLP (its hidden features through its columns of ``fc2``), on the LayerNorms' outputs
    (rank 0's with the row-parallel bias or without); backward, gather_linear's, the gradient of each LayerNorm's
    output through the rank's heads (through its rows of ``fc1``), from the gradient of attention's (the MLP's)
    output (``grads``).  All computed in one process (``tp_partials``); every such row must be among what r sent in
    all-to-alls (float64, 1e-9).  Partial sums added up some other way (the launcher's store) with zeros of the right
    sizes in the all-to-alls fail."""
    t = run.world_size
    if t == 1:
        return
    with torch.no_grad():
        attention, _ = tp_partials.attention_partials(block.attn, normed["ln1"], None, t)
        mlp, _ = tp_partials.mlp_partials(block.mlp, normed["ln2"], None, t)
    _, attention_back = tp_partials.attention_partials(block.attn, normed["ln1"], grads["attn"], t)
    _, mlp_back = tp_partials.mlp_partials(block.mlp, normed["ln2"], grads["mlp"], t)
    sent = carried.sends(run, case) or []
    for rank in range(t):
        scattered = [p for src, _, slot, p in sent if src == rank and carried.kind(slot) == "all_to_all"]
        for what, partials in (
            ("reduce-scatter after attention's output projection", attention),
            ("reduce-scatter after the MLP's fc2", mlp),
            ("backward reduce-scatter of ln1's output gradient through its heads", attention_back),
            ("backward reduce-scatter of ln2's output gradient through its rows of fc1", mlp_back),
        ):
            d = partials[rank][0].shape[-1]
            rows = carried.rows_sent(scattered, d)
            theirs = [s for s in range(t) if s != rank]
            want = [
                torch.cat([p.detach()[:, s * per : (s + 1) * per].reshape(-1, d) for s in theirs])
                for p in partials[rank]
            ]
            found = max(carried.rows_close(w, rows, rtol=1e-9, atol=1e-9) for w in want)
            assert found == len(want[0]), (
                f"{case}: rank {rank}'s {what} should send each other rank the rows of its partial sum on that "
                f"rank's tokens ({len(want[0])} rows of {d} values); the grader's capture of the wire found {found} "
                f"of them in what rank {rank} sent in all-to-alls. The partial sums must travel in the reduce-scatter "
                "itself"
            )


def check_sp_error(world_size: int, heads: int) -> None:
    """SequenceParallelBlock of a block of width 12 whose ``heads`` the ``world_size`` ranks do not divide
    raises a ValueError saying "divisible"."""
    case = f"SequenceParallelBlock of a {heads}-head block of width 12 on {world_size} ranks"
    common.expect_divisible_error(_build_sp, world_size, heads, case=case)


# --------------------------------------------------------------------------------------
# Exercise 5: Ulysses
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
    run = common.run_or_fail(_ulysses_in_rank, n, inputs, case, common.DEADLOCK_HINT, timeout=TIMEOUT, content=True)
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
    sent = carried.sends(run, case)  # under grading: the grader's capture of the wire
    if sent is not None:
        _ulysses_on_the_wire(sent, n, block, case)
        _ulysses_rows_on_the_wire(sent, positions, (q, k, v), want, case)
        _ulysses_grads_on_the_wire(sent, positions, dout, (q.grad, k.grad, v.grad), case)
        return
    for rank in range(n):  # the student's own kernel: the ranks' trace
        calls, _ = _forward_phase(run, rank)
        every = [e for e in run.trace.by_rank(rank) if e.kind in ("collective", "p2p") and e.op != "barrier"]
        other = [e for e in every if e.op != "all_to_all_single"]
        assert not other, (
            f"{case}: rank {rank} may only call all_to_all_single; it also made: {common.describe_calls(other)}"
        )
        forward = sum((n - 1) / n * e.bytes for e in calls if e.op == "all_to_all_single")
        total = sum((n - 1) / n * e.bytes for e in every)
        assert abs(forward - 4 * (n - 1) / n * block) < 1 and abs(total - 8 * (n - 1) / n * block) < 1, (
            f"{case}: rank {rank}'s all-to-alls moved {forward:.0f} B forward and {total:.0f} B in all; the cost "
            f"model: q, k, v and the output, (N - 1)/N of a {block} B block each, "
            f"{4 * (n - 1) / n * block:.0f} B forward, the same again backward"
        )


def _ulysses_on_the_wire(sent: list, n: int, block: int, case: str) -> None:
    """What the grader's capture saw of a Ulysses run: all-to-alls only (the driver's barrier aside), and each rank
    sent (N − 1)/N of a block for each of q, k, v and the output, forward and backward: 8 in all (its own piece of
    each stays)."""
    other: dict[str, set] = {}
    by_rank = [0] * n
    for src, _, slot, payload in sent:
        kind = carried.kind(slot)
        if kind == "all_to_all":
            by_rank[src] += len(payload)
        elif kind != "barrier":
            other.setdefault(kind, set()).add(src)
    assert not other, (
        f"{case}: the ranks may only call all_to_all_single; the grader's capture of the wire shows messages of "
        + "; ".join(f"{kind} from rank(s) {', '.join(map(str, sorted(r)))}" for kind, r in sorted(other.items()))
    )
    want = 8 * (n - 1) * block // n
    for rank, got in enumerate(by_rank):
        assert got == want, (
            f"{case}: rank {rank}'s all-to-alls put {got} B on the wire; the cost model: q, k, v and the output, "
            f"(N - 1)/N of a {block} B block each, forward and backward: {want} B"
        )


def _ulysses_rows_on_the_wire(sent: list, positions: list, qkv: tuple, out: torch.Tensor, case: str) -> None:
    """What Ulysses' all-to-alls carried, from the grader's capture: each rank sends the others the rows of q, k
    and v (one head, one token: d float64 values) of its tokens for every head but its own N/H, byte for byte,
    3·(H − H/N) of them a token; and of the output (the grader's ``F.scaled_dot_product_attention``, within
    1e-9) its own heads' rows of the others' tokens, (H/N)·(S − its tokens).  Rows passed some other way (the
    launcher's store) with zeros of the right sizes in the all-to-alls fail."""
    heads, seq_len, d = out.shape
    mine = heads // len(positions)
    by_rank: dict[int, list[bytes]] = {}
    for src, _, slot, payload in sent:
        if carried.kind(slot) == "all_to_all":
            by_rank.setdefault(src, []).append(payload)
    for s, pos in enumerate(positions):
        payloads = by_rank.get(s, [])
        inputs = torch.cat([t.detach()[:, torch.as_tensor(pos)].reshape(-1, d) for t in qkv])
        found, want = carried.rows_whole(payloads, inputs), 3 * (heads - mine) * len(pos)
        assert found >= want, (
            f"{case}: rank {s} should carry to the others the rows of q, k and v of its {len(pos)} tokens for the "
            f"heads it does not keep, {want} rows of {8 * d} bytes (one head, one token), as they are; the grader's "
            f"capture of the wire found {found} in the {sum(map(len, payloads)):,} bytes its all-to-alls sent. The "
            "rows must travel in the all-to-alls themselves"
        )
        found = carried.rows_close(carried.rows_sent(payloads, d), out.detach().reshape(-1, d), rtol=1e-9, atol=1e-9)
        want = mine * (seq_len - len(pos))
        assert found >= want, (
            f"{case}: rank {s} should carry back to the others its {mine} head(s)' output rows of their tokens, "
            f"{want} rows (one head, one token: F.scaled_dot_product_attention's, float64); the grader's capture of "
            f"the wire found {found}. The rows must travel in the all-to-alls themselves"
        )


def _ulysses_grads_on_the_wire(sent: list, positions: list, dout: torch.Tensor, grads: tuple, case: str) -> None:
    """What Ulysses' backward all-to-alls carried, from the grader's capture: the output's all-to-all mirrored, each
    rank sends the others the rows of the output's gradient (the driver's ``dout``, byte for byte) of its tokens for
    every head but its own H/N, (H − H/N) of them a token; then the q, k, v all-to-all's mirrored, its own heads'
    rows of the gradients of q, k and v (the grader's ``F.scaled_dot_product_attention`` backward, within 1e-9) of
    the others' tokens, 3·(H/N)·(S − its tokens).  A backward that sends zeros of the right sizes and puts gradients
    made some other way in place fails."""
    heads, seq_len, d = dout.shape
    mine = heads // len(positions)
    by_rank: dict[int, list[bytes]] = {}
    for src, _, slot, payload in sent:
        if carried.kind(slot) == "all_to_all":
            by_rank.setdefault(src, []).append(payload)
    every = torch.cat([g.detach().reshape(-1, d) for g in grads])
    for s, pos in enumerate(positions):
        payloads = by_rank.get(s, [])
        rows = dout.detach()[:, torch.as_tensor(pos)].reshape(-1, d)
        found, want = carried.rows_whole(payloads, rows), (heads - mine) * len(pos)
        assert found >= want, (
            f"{case}: in backward rank {s} should carry to the others the rows of the output's gradient of its "
            f"{len(pos)} tokens for the heads it does not keep, {want} rows of {8 * d} bytes (one head, one token), as "
            f"they are; the grader's capture of the wire found {found} in the {sum(map(len, payloads)):,} bytes its "
            "all-to-alls sent. The backward's gradients must travel in the all-to-alls themselves"
        )
        found = carried.rows_close(carried.rows_sent(payloads, d), every, rtol=1e-9, atol=1e-9)
        want = 3 * mine * (seq_len - len(pos))
        assert found >= want, (
            f"{case}: in backward rank {s} should carry back to the others its {mine} head(s)' rows of the gradients "
            f"of q, k and v of their tokens, {want} rows (one head, one token: the backward of "
            f"F.scaled_dot_product_attention, float64); the grader's capture of the wire found {found}. The backward's "
            "gradients must travel in the all-to-alls themselves"
        )


def check_ulysses_error(world_size: int, heads: int) -> None:
    """ulysses_attention with ``heads`` heads that the ``world_size`` ranks do not divide raises a ValueError
    saying "divisible"."""
    common.expect_divisible_error(
        _ulysses_heads, world_size, heads, case=f"ulysses_attention with {heads} heads on {world_size} ranks"
    )
