"""Lab 10's exercises 1-2: ``block_attention``/``merge_attention`` (one rank) and ring attention
across ranks, against torch's causal attention in one process; the ring's traffic, and under grading what its
messages carried (the grader's capture of the wire)."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import carried, checks, exercise, gloo_ops, wire
from .. import common
from .common import GRADED_PASSED, TIMEOUT, _forward_phase, _qkv, _reference
from .ring_gate import HOLDS


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
def _ring_in_rank(heads, seq_len, dim, layout, seed, positions, backward, groups_of, held=None):
    """The test's driver: your ring attention on this rank's tokens (the positions the test gives);
    a barrier, then the given backward.  Returns the output and the gradients of q, k, v.  ``held``: under
    grading, the rank the grader's gate holds before its ring starts (``lab10.ring_gate``)."""
    from disttrain_lab.labtests.lab10.ring_gate import gated

    group = None if groups_of == dist.get_world_size() else dist.new_subgroups(groups_of)[0]
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(heads, seq_len, dim, generator=g, dtype=torch.float64) for _ in range(4))
    mine = [t[:, positions].clone().requires_grad_() for t in (q, k, v)]
    with gated(ring_attention_forward.__globals__, held):  # noqa: F821  (the notebook's)
        out = RingAttention.apply(*mine, layout, group)  # noqa: F821
    if not backward:
        return out.detach(), None
    dist.barrier()
    out.backward(dout[:, positions])
    return out.detach(), [t.grad for t in mine]


def ring_driver(graders: Callable | None = None) -> Callable:
    """The driver ring attention is graded with: the lab's own (your ring on your blocks) where your
    block_attention and merge_attention passed exercise 1's graded test (``GRADED_PASSED``: every case of it,
    not one) or, in your notebook (no ``graders``), pass exercise 1's check; else ``graders`` (your ring on the
    grader's blocks, defined in the graded cell's hidden tests), so that a mistake in exercise 1 does not cost
    exercise 2's points.  Decided once per run of the graded cell."""
    if "online_softmax" in GRADED_PASSED:
        return _ring_in_rank
    try:
        if graders is not None:
            raise AssertionError("exercise 1 has not passed its graded test")
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
) -> tuple[int, float | None] | None:
    """Ring attention of ``seq_len`` tokens in ``layout`` on ``n`` ranks (in rings of ``groups_of``), in
    float64: each rank's output and the gradients of its q, k, v (the given backward uses your lse) equal
    torch's causal attention on the whole sequence to 1e-9; in forward it only isends to the next rank and
    irecvs from the previous one, N - 1 key/value blocks, one dl.region("block") per ring step, the next
    block's isend and irecv posted before a block's computation and waited for after it: under grading, as
    the grader's gate and capture observe it (``ring_gate``: a rank drawn now is held before its ring starts,
    and the next one must still reach its first block's computation, with block_attention; then the drawn
    rank is held at its own first block_attention, and its first key/value block must cross to the next rank
    before the grader lets it go on, ``_assert_first_block_crossed``), else from the trace.  Returns, under
    grading, the margin the overlap left (``_assert_first_block_crossed``'s), else None.
    Under grading (2 ranks a ring or more: the gate makes the run keep what crossed the wire) the grader also
    reads the messages themselves: point-to-point only, each rank's to the next rank of its ring alone, the
    forward's and the given backward's bytes (``_ring_on_the_wire``), and in them every row of the keys and
    values the ring passes, twice (``_ring_blocks_on_the_wire``); in the student's own kernel there is no
    capture and the trace's account stands alone."""
    groups_of = groups_of or n
    case = (
        f"ring attention, {layout} layout, {seq_len} tokens on {n} ranks"
        + (f" in groups of {groups_of}" if groups_of != n else "")
        + f" ({heads} heads, d={dim}, float64)"
    )
    positions = [_reference("positions")(seq_len, groups_of, rank % groups_of, layout) for rank in range(n)]
    held = secrets.randbelow(n) if groups_of > 1 else None  # the rank the grader holds (drawn now)
    inputs = [(heads, seq_len, dim, layout, seed, positions[r], True, groups_of, held) for r in range(n)]
    gate = None if held is None else [[None] * n for _ in range(HOLDS)]  # (``ring_gate``: two holds)
    run = common.run_or_fail(driver, n, inputs, case, common.DEADLOCK_HINT, timeout=TIMEOUT, gate=gate)
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
            f"({prev}); it also made: {common.describe_calls(other)}"
        )
        sent = sum(e.bytes for e in calls if e.op == "isend")
        assert sent == (groups_of - 1) * block_bytes, (
            f"{case}: in forward rank {rank} sent {sent} B; N - 1 = {groups_of - 1} ring steps of one key/value block "
            f"({block_bytes} B) each make {(groups_of - 1) * block_bytes} B"
        )
        if gate is not None and run.gate.source != "none":
            continue  # (the overlap as the grader observed it: below)
        for step, block in enumerate(blocks[:-1]):
            posted = [e for e in calls if e.kind == "p2p" and e.start < block.start]
            waited = [e for e in calls if e.kind == "wait" and e.end <= block.start]
            assert {"isend", "irecv"} <= {e.op for e in posted} and len(posted) - len(waited) >= 2, (
                f"{case}: rank {rank}, ring step {step}: the next block's isend and irecv must be posted before this "
                f"block's computation (dl.region('block')) and waited for after it; when the block started, "
                f"{len(posted)} isend/irecv had been posted and {len(waited)} waited for"
            )
    if gate is not None and run.gate.source != "none":
        _assert_reached_while_held(run, case, held, groups_of)
    sent = carried.sends(run, case) if gate is not None else None  # under grading: the grader's capture of the wire
    if sent is not None:
        _ring_on_the_wire(sent, n, groups_of, block_bytes, case)
        _ring_blocks_on_the_wire(sent, positions, (k.detach(), v.detach()), groups_of, case)
    if gate is not None and run.gate.source != "none":
        return _assert_first_block_crossed(run, case, held, groups_of, positions[held], (k.detach(), v.detach()))
    return None


def _ring_on_the_wire(sent: list, n: int, groups_of: int, block_bytes: int, case: str) -> None:
    """What the grader's capture saw of a ring attention run, forward and the given backward: point-to-point
    messages only (the driver's barrier aside; a slot's top byte names a collective's kind, ``carried.kind``),
    each rank's to the next rank of its ring alone, and ``block_bytes`` B (one key/value block, k and v) times
    N − 1 forward and 2N − 1 in the given backward ((k, v) before each of its N − 1 passes, (dk, dv) after each
    of its N blocks): (3N − 2) blocks in all.  The trace's account of the forward's calls and bytes is the rank's
    own; this one is the wire's, so traffic a rank leaves out of its trace (a collective made aside) fails."""
    other: dict[str, set] = {}
    for src, _, slot, _ in sent:
        kind = carried.kind(slot)
        if kind not in ("barrier", "send/recv"):
            other.setdefault(kind, set()).add(src)
    assert not other, (
        f"{case}: ring attention's ranks may only isend and irecv (the given backward too); the grader's capture of "
        "the wire shows messages of "
        + "; ".join(f"{kind} from rank(s) {', '.join(map(str, sorted(r)))}" for kind, r in sorted(other.items()))
    )
    want = (3 * groups_of - 2) * block_bytes
    for rank in range(n):
        start = rank - rank % groups_of
        nxt = start + (rank + 1) % groups_of
        to: dict[int, int] = {}
        for src, dst, slot, payload in sent:
            if src == rank and carried.kind(slot) == "send/recv":
                to[dst] = to.get(dst, 0) + len(payload)
        elsewhere = {dst: got for dst, got in to.items() if dst != nxt}
        assert not elsewhere, (
            f"{case}: rank {rank} may only send to the next rank of its ring ({nxt}); the grader's capture of the wire "
            "shows point-to-point messages from it to "
            + ", ".join(f"rank {dst} ({got} B)" for dst, got in sorted(elsewhere.items()))
        )
        got = to.get(nxt, 0)
        assert got == want, (
            f"{case}: rank {rank}'s point-to-point messages to rank {nxt} carried {got} B on the wire (the grader's "
            f"capture); the forward's N - 1 = {groups_of - 1} key/value blocks of {block_bytes} B and the given "
            f"backward's 2N - 1 = {2 * groups_of - 1} ((k, v) N - 1 times, (dk, dv) N times) make {want} B"
        )


def _ring_blocks_on_the_wire(sent: list, positions: list, kv: tuple, groups_of: int, case: str) -> None:
    """What the ring's messages carried, from the grader's capture: at ring step s = 0..N − 2 rank r passes the
    next rank of its ring the keys and values of the block it attends to, rank (r − s) mod N's (of its ring), so
    what r sent that rank holds every row of those blocks (one head, one token: d float64 values), byte for byte,
    whatever the packing (k and v stacked, or one message each).  The grader knows them: its driver's seed gives
    the whole sequence's k and v (``kv``, made in the grader kernel) and ``positions`` each rank's tokens.  The
    given backward passes the same blocks round once more, each before its block's backward, so every such row
    must cross from r to the next rank twice (counted row by row, ``_copies``): once in the student's forward,
    once in the given backward.  Keys and values that reach the ranks some other way (the launcher's store, the
    whole sequence the driver builds in every rank), with zeros of a block's size in the forward's isends, are
    found once, and fail."""
    d = kv[0].shape[-1]
    by_link: dict[tuple[int, int], list[bytes]] = {}
    for src, dst, slot, payload in sent:
        if carried.kind(slot) == "send/recv":
            by_link.setdefault((src, dst), []).append(payload)
    for rank in range(len(positions)):
        start = rank - rank % groups_of
        nxt = start + (rank + 1) % groups_of
        sources = [start + (rank - s) % groups_of for s in range(groups_of - 1)]
        rows = torch.cat([t[:, torch.as_tensor(positions[j])].reshape(-1, d) for j in sources for t in kv])
        payloads = by_link.get((rank, nxt), [])
        copies = _copies(payloads, rows)
        twice, once = sum(c >= 2 for c in copies), sum(c == 1 for c in copies)
        assert twice == len(rows), (
            f"{case}: rank {rank} should pass the next rank of its ring ({nxt}) the keys and values of the blocks it "
            f"attends to at ring steps 0 to N - 2, those of rank(s) {', '.join(map(str, sources))}: "
            f"{len(rows)} rows of {8 * d} bytes (one head, one token) as they are, each twice, once in your forward "
            f"and once in the given backward, which passes them round again; the grader's capture of the wire found "
            f"{twice} of them twice, {once} once and {len(rows) - twice - once} not at all in the "
            f"{sum(map(len, payloads)):,} bytes rank {rank} sent rank {nxt}. The keys and values must travel in the "
            "forward's isends themselves"
        )


def _copies(payloads: Sequence[bytes], rows: torch.Tensor) -> list[int]:
    """How many times each row of ``rows`` appears, byte for byte, in ``payloads`` joined (``carried.rows_whole``
    counts them all together; here each row is counted on its own, so rows sent many times cannot make up for
    rows never sent)."""
    there = b"".join(payloads)
    return [there.count(row.contiguous().numpy().tobytes()) for row in rows]


def _assert_reached_while_held(run: exercise.ExerciseRun, case: str, held: int, groups_of: int) -> None:
    """Fail unless every rank was held at the grader's gate at once (``ring_gate``): the rank after ``held``
    among its ring reached its first block's computation while ``held`` had posted nothing."""
    n = run.world_size
    start = held - held % groups_of
    after = start + (held + 1 - start) % groups_of
    missing = sorted(set(range(n)) - set(run.gate.ranks_held()))
    assert not missing, (
        f"{case}: the grader held rank {held} before its ring started, so it posted nothing, and rank(s) "
        f"{missing} did not reach their first block's computation (a call of block_attention) meanwhile"
        + (
            f": rank {after}'s first transfer waits on rank {held}, so it reached its first block only if it "
            f"computes before that transfer is done. Post the next block's isend and irecv, compute the block "
            f"you hold with block_attention, then wait"
            if after in missing
            else ""
        )
    )


def _assert_first_block_crossed(
    run: exercise.ExerciseRun, case: str, held: int, groups_of: int, mine: torch.Tensor, kv: tuple
) -> tuple[int, float | None]:
    """Fail unless, under grading, the drawn rank's first key/value block (its own k and v, at its positions
    ``mine``; ``kv``: the whole sequence's) crossed to the next rank of its ring while the grader held it at its
    first block's computation (``ring_gate``'s second hold, until the grader's answer: ``Seen.cuts[1]``, on the
    capture's clock): every row of it (one head, one token) found, byte for byte, in the point-to-point messages
    that surely crossed by then (``_surely_crossed``).  Returns the margin an honest run left: the bytes that
    surely crossed after the message that completed the block, and the seconds from its last byte to the answer
    (None where the direction has several connections); ``Unobserved`` where the capture does not say."""
    seen = run.gate
    start = held - held % groups_of
    nxt = start + (held + 1 - start) % groups_of
    cut = seen.cuts[1] if seen.source == "wire" and len(seen.cuts) > 1 else None
    if cut is None:
        raise wire.Unobserved(
            f"the grader could not see when it let rank {held} go on from its first block's computation "
            f"({seen.why or 'no answer seen'}), so the ring's overlap, graded by what crossed meanwhile, fails "
            "rather than take the ranks' own clocks"
        )
    d = kv[0].shape[-1]
    rows = [row.contiguous().numpy().tobytes() for t in kv for row in t[:, torch.as_tensor(mine)].reshape(-1, d)]
    advice = (
        "Post the next block's isend and irecv, compute the block you hold with block_attention, then wait for "
        "the transfer"
    )
    there = seen.ranks_held(1)
    assert held in there, (
        f"{case}: the grader held rank {held} before its ring started, then waited for it to begin its first "
        f"block's computation (a call of block_attention, its first transfer posted) while every other rank began "
        f"its second; rank {held} was not held there (the ranks held: {', '.join(map(str, there)) or 'none'}), so "
        f"the overlap of its first transfer with its first block is not seen. {advice}"
    )
    sends, total, connections = _surely_crossed(run, case, held, nxt, cut)
    found, surely, margin = set(), 0, None
    for _, end, here, payload in sends:  # (in order on each connection)
        if end > here:
            continue
        surely += len(payload)
        found |= {row for row in rows if row in payload}  # (gloo sends a tensor whole: a row is never cut)
        if margin is None and len(found) == len(set(rows)):
            placed = run.timeline.passed(held, nxt, end - 1) if connections == 1 else None
            margin = (here - end, None if placed is None else cut - placed)
    missing = sum(row not in found for row in rows)
    assert not missing, (
        f"{case}: rank {held}'s first key/value block (its own k and v: {len(rows)} rows of {8 * d} bytes, one "
        f"head, one token) must cross to the next rank of its ring ({nxt}) while rank {held} computes its first "
        f"block: the grader held rank {held} at its first call of block_attention until {cut * 1e3:.1f} ms into "
        f"the run (its capture's clock), and by then the capture of the wire shows {surely} B of rank {held}'s "
        f"point-to-point messages to rank {nxt} surely crossed ({total} B from rank {held} to rank {nxt} in all, "
        f"gloo's notes and handshakes included), holding {len(rows) - missing} of those {len(rows)} rows; all "
        f"{len(rows)} should be there. An overlapped ring posts the next block's isend and irecv before it "
        f"computes the block it holds, so that block crosses during the computation; a ring that computes first "
        f"sends nothing until it has. {advice}"
    )
    return margin


def _surely_crossed(run: exercise.ExerciseRun, case: str, src: int, dst: int, cut: float) -> tuple[list, int, int]:
    """``src``'s point-to-point messages to ``dst``, each as (its connection, the position in that connection's
    bytes where it ends, the least of that connection's bytes that had surely crossed by ``cut``, its payload), in
    order on each connection; the bytes from ``src`` to ``dst`` that had crossed by ``cut`` in all (the capture's
    clock); and how many connections carried them.  A message surely crossed where it ends within that least:
    TCP keeps a connection's bytes in order (``Timeline.crossed``).  Where ``src`` sent ``dst`` over several
    connections (a ring of a subgroup: its process group's connection beside the default group's), the
    capture's times count them together, so a connection is given what crossed less the most the others can
    have carried by then: all their bytes but those of the last barrier seen on each (the driver's
    ``dist.barrier()``, which ``src`` enters only after its forward, so after ``cut``).  For an honest ring the
    bounds are exact (the default group's connection had carried gloo's handshake alone by then: an honest ring
    passes whatever the timing, its first block having crossed before the next rank could reach its hold);
    otherwise they err towards fewer bytes crossed, never more.  ``Unobserved`` where the capture does not say."""
    timeline = run.timeline
    total = timeline.crossed(src, dst, cut)  # (``Unobserved`` where nothing was captured)
    data, links = timeline.data, timeline.links or {}
    streams = None if data is None else data.get((src, dst), [])
    back = [] if data is None else data.get((dst, src), [])
    if streams is None or back is None:
        raise wire.Unobserved(
            f"the grader's capture did not keep all the data between rank {src} and rank {dst} (past its limits, "
            f"or not kept), so a test that reads what crossed while it held rank {src} fails"
        )
    names = links.get((src, dst)) or [f"{src}>{dst}#{i}" for i in range(len(streams))]
    try:
        ops = [gloo_ops.operations(stream) for stream in streams]
        ops_back = {name: gloo_ops.operations(stream) for name, stream in zip(links.get((dst, src)) or [], back)}
        sends = [gloo_ops.sends(stream) for stream in streams]
    except gloo_ops.NotGloo as e:
        raise AssertionError(
            f"{case}: the bytes between rank {src} and rank {dst} are not gloo's messages ({e}); the ranks must "
            "talk through torch.distributed alone"
        ) from None
    notes = (gloo_ops.NOTIFY_SEND_READY, gloo_ops.NOTIFY_RECV_READY)

    def at_most(i: int) -> int:  # the most of connection i's bytes that can have crossed by ``cut``
        barriers = [slot for _, _, slot, _ in ops[i] + ops_back.get(names[i], []) if carried.kind(slot) == "barrier"]
        last = max(barriers, key=lambda slot: slot & carried.CALL_BITS, default=None)
        later = [(opcode, length) for _, opcode, slot, length in ops[i] if slot == last]
        return len(streams[i]) - sum(wire.GLOO_PREAMBLE + (0 if op in notes else n) for op, n in later)

    placed = []
    for i, stream_sends in enumerate(sends):
        here = total - sum(at_most(j) for j in range(len(streams)) if j != i)
        placed += [
            (names[i], at + wire.GLOO_PREAMBLE + len(payload), here, payload)
            for at, slot, payload in stream_sends
            if carried.kind(slot) == "send/recv"
        ]
    return placed, total, len(streams)


def check_ring_traffic(driver: Callable, n: int, heads: int, seq_len: int, dim: int, layout: str) -> None:
    """Ring attention's forward on ``n`` ranks: by the operating system's count, each rank sends the next one
    N - 1 key/value blocks and nothing else."""
    case = f"ring attention's forward, {layout} layout, {seq_len} tokens on {n} ranks ({heads} heads, d={dim}, float64)"
    positions = [_reference("positions")(seq_len, n, rank, layout) for rank in range(n)]
    inputs = [(heads, seq_len, dim, layout, 0, positions[r], False, n) for r in range(n)]
    run = common.run_or_fail(driver, n, inputs, case, common.DEADLOCK_HINT, timeout=TIMEOUT)
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
    common.expect_divisible_error("sequence_positions", 1, *bad, case=f"sequence_positions{bad}")


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
