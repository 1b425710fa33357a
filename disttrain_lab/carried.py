"""What crossed the wire: checks that the data the ranks sent each other was the data itself.

The bytes the operating system counts on a connection say how much crossed (``checks.assert_messages``);
these say *what* did, from the payloads the grader's packet capture kept (``run.timeline`` of a
``dl.exercise.run(..., content=True)``, read as gloo's operations: ``gloo_ops``).  Data passed some
other way (a file, shared memory), with junk of the right size on the wire, fails them.  Three kinds of
message, three checks:

- ``assert_carried``: a message whose bytes are fixed (a tensor passed on unchanged), looked for whole;
- ``assert_sums_carried``: a reduction's partial sum, held to a piece of the sum of the ranks it has
  passed (floats within the dtype's tolerance for that many terms);
- ``assert_values_carried``: values the grader recomputes but not to the bit (a pipeline's
  activations), within a stated tolerance.

A call of torch's own ``dist.all_reduce`` (gloo's algorithm, not the student's) is held by
``assert_reduced_carried``: every message a rank sent in it is a piece of a sum of the ranks'
inputs over a set of ranks that includes the sender, whatever the algorithm's steps.

Where a collective's messages carry rows in an order the student chooses (tokens routed to experts,
heads handed over), ``rows_whole``, ``rows_sent`` and ``rows_close`` count the rows found, byte for
byte or within a tolerance.

In the student's own notebook there is no capture (``run.timeline.source == "trace"``): nothing is
checked there, and only grading holds a run to these.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import checks, gloo_ops

__all__ = [
    "assert_carried",
    "assert_sums_carried",
    "assert_values_carried",
    "assert_reduced_carried",
    "messages",
    "sends",
    "sends_by_connection",
    "kind",
    "collective_payloads",
    "calls_made",
    "all_reduce_sizes",
    "words_sent",
    "words_found",
    "sums_found",
    "assert_gradients_all_reduced",
]

CALL_BITS = (1 << 56) - 1  # a slot's bits below its kind: torch's tag for the call, counted up call by call


def messages(run, src: int, dst: int, case: str, count: int | None = None, what: str = "message") -> list[bytes] | None:
    """The payload of each message ``src`` sent ``dst`` as the grader's capture read them (None where there
    is no capture), failing unless they are gloo's operations (and, given ``count``, there are that many)."""
    try:
        got = run.timeline.messages(src, dst)
    except gloo_ops.NotGloo as e:
        raise AssertionError(
            f"{case}: the bytes from rank {src} to rank {dst} are not gloo's messages ({e}); the ranks must talk "
            "through torch.distributed alone"
        ) from None
    if got is not None and count is not None and len(got) != count:
        raise AssertionError(
            f"{case}: rank {src} should send rank {dst} {count} {what}(s); the grader's capture of the wire found "
            f"{len(got)}"
        )
    return got


def sends(run, case: str) -> list[tuple[int, int, int, bytes]] | None:
    """Every message the ranks sent each other, as (sender, receiver, its slot, its payload), read from the
    grader's capture as gloo's sends (None in the student's own kernel, where there is none); bytes that are
    not gloo's fail the test.  A slot names the call a message belongs to: a gloo collective's kind in its top
    byte (``checks.COLLECTIVE_SLOTS``), below it torch's tag for the call, counted up call by call; torch's
    point-to-point has 0 there (the caller's tag).  (``sends_by_connection`` says on which connection.)"""
    sent = sends_by_connection(run, case)
    return None if sent is None else [(src, dst, slot, payload) for src, dst, _, slot, payload in sent]


def sends_by_connection(run, case: str) -> list[tuple[int, int, str, int, bytes]] | None:
    """``sends``, over every connection between two ranks (a process group opens its own), not placed in time:
    (sender, receiver, its connection's name, the same both ways, its slot, its payload), each connection's in
    the order they crossed (None in the student's own kernel, where there is none); bytes that are not gloo's
    fail the test.  Slots count up per process group: one call is one slot on its group's connections."""
    if run.timeline.source == "trace":
        return None
    found = []
    for src in range(run.world_size):
        for dst in range(run.world_size):
            if src == dst:
                continue
            try:
                sent = run.timeline.sends_by_connection(src, dst) or []
            except gloo_ops.NotGloo as e:
                raise AssertionError(
                    f"{case}: the bytes from rank {src} to rank {dst} are not gloo's messages ({e}); the ranks must "
                    "talk through torch.distributed alone"
                ) from None
            found += [(src, dst, link, slot, payload) for link, slot, payload in sent]
    return found


def kind(slot: int) -> str:
    """The kind of call a message's ``slot`` names: a gloo collective's from its top byte (``checks.COLLECTIVE_SLOTS``:
    "all_reduce", "all_gather", ...), "send/recv" for torch's point-to-point (top byte 0)."""
    prefix = slot >> 56
    return checks.COLLECTIVE_SLOTS.get(prefix, f"slot prefix {prefix:#x}") if prefix else "send/recv"


def collective_payloads(run, case: str) -> list[tuple[int, int]] | None:
    """Each collective call the ranks made, in the order they made it, as (its slot, the bytes of payload all
    its messages carried), from ``sends`` (None in the student's own kernel)."""
    sent = sends(run, case)
    if sent is None:
        return None
    totals: dict[int, int] = {}
    for _, _, slot, payload in sent:
        if slot >> 56:
            totals[slot] = totals.get(slot, 0) + len(payload)
    return sorted(totals.items(), key=lambda call: call[0] & CALL_BITS)  # (in call order, whatever the kind)


def calls_made(run, case: str) -> dict[str, set[int]] | None:
    """The kinds of communication each rank sent messages in, from ``sends`` (None in the student's own kernel):
    a gloo collective's kind from its slot's top byte (``checks.COLLECTIVE_SLOTS``), "send/recv" for torch's
    point-to-point (top byte 0); kind -> the ranks that sent in it."""
    sent = sends(run, case)
    if sent is None:
        return None
    made: dict[str, set[int]] = {}
    for src, _, slot, _ in sent:
        made.setdefault(kind(slot), set()).add(src)
    return made


def all_reduce_sizes(calls: list[tuple[int, int]], world_size: int, case: str) -> list[int]:
    """The size in bytes of each all-reduce among ``calls`` (``collective_payloads``), in order: gloo's ring
    puts 2·(N − 1)·B bytes of payload on the wire for an all-reduce of B bytes on N ranks, whatever its
    pieces (each of the N − 1 steps of its reduce-scatter and of its all-gather moves every piece once).  An
    all-reduce whose payload is not a whole multiple of 2·(N − 1) raises."""
    sizes = []
    for slot, total in calls:
        if kind(slot) != "all_reduce":
            continue
        size, left = divmod(total, 2 * (world_size - 1))
        if left:
            raise AssertionError(
                f"{case}: an all-reduce's messages (slot {slot:#x}) carried {total:,} bytes in all, not 2·(N − 1) = "
                f"{2 * (world_size - 1)} times a tensor's bytes, as gloo's all-reduce does: the ranks must talk "
                "through torch.distributed alone"
            )
        sizes.append(size)
    return sizes


def assert_carried(run, expected: dict[tuple[int | None, int], list], case: str) -> None:
    """Fail unless the data from rank ``src`` to rank ``dst`` carried each tensor of
    ``expected[(src, dst)]``, whole and in that order (``src`` None: from one rank or another, as in
    a tree): its bytes as the grader's packet capture saw
    them cross (``run.timeline`` of a ``dl.exercise.run(..., content=True)``).  The bytes counted
    on a connection say how much crossed; this says *what* did, so data passed some other way
    (a file, shared memory) with junk of the right size on the wire fails.  In the student's own
    notebook there is no capture: nothing is checked there (``wiretimeline.Timeline.carries``).

    >>> assert_carried(run, {(0, 1): [x], (1, 0): [x]}, "ping_pong on 2 ranks")
    """
    for (src, dst), tensors in expected.items():
        messages = [t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors]
        senders = [src] if src is not None else [r for r in range(run.world_size) if r != dst]
        try:
            found = max(run.timeline.carries(a, dst, messages) for a in senders)
        except gloo_ops.NotGloo as e:
            raise AssertionError(
                f"{case}: the bytes to rank {dst} are not gloo's messages ({e}); the ranks must talk through "
                "torch.distributed alone"
            ) from None
        if found < len(messages):
            sender = f"rank {src}" if src is not None else "the other ranks"
            raise AssertionError(
                f"{case}: the data from {sender} to rank {dst} should carry {len(messages)} message(s) of the "
                f"tensor's own bytes ({len(messages[0]):,} each), in order; the grader's capture of the wire found "
                f"{found} of them. What a rank sends must be the data itself: values that arrive some other way, "
                "with other bytes sent in their place, do not count"
            )


def _piece_of(
    values: torch.Tensor, total: torch.Tensor, terms: int, tolerance: tuple[float, float] | None = None
) -> bool:
    """Whether ``values`` equal ``total[o:o + len(values)]`` for some offset o, within the dtype's
    tolerance for a sum of ``terms`` values added in any order (integers exactly), or within ``tolerance``
    (rtol, atol) where given."""
    length = values.numel()
    if length == 0:
        return True
    if length > total.numel():
        return False
    if values.dtype.is_floating_point:
        rtol, atol = tolerance or tuple(terms * t for t in checks.TOLERANCES.get(values.dtype, (1e-6, 1e-6)))
        a, e = values.double(), total.double()
    else:
        rtol = atol = 0.0
        a, e = values.long(), total.long()
    windows = e.unfold(0, length, 1)  # (offsets, length): a view, nothing copied
    head = min(length, 4)
    near = torch.isclose(windows[:, :head], a[:head].expand(windows.shape[0], head), rtol=rtol, atol=atol)
    for offset in near.all(dim=1).nonzero().flatten()[:64].tolist():
        if bool(torch.isclose(windows[offset], a, rtol=rtol, atol=atol).all()):
            return True
    return False


def _ranks(ranks: frozenset[int]) -> str:
    return "rank " + str(min(ranks)) if len(ranks) == 1 else "ranks " + ", ".join(map(str, sorted(ranks)))


def assert_sums_carried(
    run, flats: Sequence[torch.Tensor], expected: dict[tuple[int, int], list[list[frozenset[int]]]], case: str
) -> dict[tuple[int, int], list[frozenset[int]]]:
    """Fail unless every message rank ``src`` sent rank ``dst`` held, value for value, a piece (a run
    of consecutive elements) of a sum of the ranks' ``flats``: message i the sum over one of the
    sets of ranks ``expected[(src, dst)][i]`` lists, as the grader's packet capture saw it cross
    (``run.timeline`` of a ``dl.exercise.run(..., content=True)``).  A reduction's messages carry
    partial sums whose values depend on the algorithm, so ``assert_carried`` cannot look for them
    whole; this holds each to the sum it must be (floats within the dtype's tolerance for that many
    terms, added in any order), so junk of the right size, with the data passed some other way,
    fails.  In the student's own notebook there is no capture: nothing is checked there.  Returns, for each
    direction read, the set each message was found a piece of (the first of its ``sets`` that fits), so that a
    check can hold the steps to their number (each partial sum as often as the algorithm sends it).

    >>> assert_sums_carried(run, flats, {(0, 1): [[frozenset({0})], [frozenset({0, 2})]]}, "ring on 3 ranks")
    """
    flat = [f.detach().cpu().reshape(-1) for f in flats]
    sums: dict[frozenset[int], torch.Tensor] = {}
    found: dict[tuple[int, int], list[frozenset[int]]] = {}
    for (src, dst), allowed in expected.items():
        got = messages(run, src, dst, case, len(allowed))
        if got is None:
            continue
        found[(src, dst)] = []
        for i, (payload, sets) in enumerate(zip(got, allowed)):
            size = flat[0].element_size()
            values = None if len(payload) % size else torch.frombuffer(bytearray(payload), dtype=flat[0].dtype)
            for ranks in sets:
                if ranks not in sums:
                    sums[ranks] = torch.stack([flat[r].double() for r in sorted(ranks)]).sum(0).to(flat[0].dtype)
                if values is not None and _piece_of(values, sums[ranks], len(ranks)):
                    found[(src, dst)].append(ranks)
                    break
            else:
                want = " or ".join(f"{_ranks(r)}" for r in sets)
                shown = "not a whole number of elements" if values is None else f"{values.numel():,} values"
                raise AssertionError(
                    f"{case}: message {i + 1} of {len(allowed)} from rank {src} to rank {dst} should hold a piece of "
                    f"the sum of {want}'s data (that step's partial sum); the grader's capture of the wire found "
                    f"{len(payload):,} bytes that are no such piece ({shown}). What a rank sends must be the data "
                    "itself: values that arrive some other way, with other bytes sent in their place, do not count"
                )
    return found


def assert_reduced_carried(
    payloads: dict[int, list[bytes]],
    partials: dict[int, list[torch.Tensor]],
    case: str,
    what: str,
    *,
    tolerance: tuple[float, float] | None = None,
    magnitudes: bool = False,
) -> None:
    """Fail unless every message a rank sent in one all-reduce call (``payloads``: rank -> its messages' bytes in
    that call, ``wirecalls.call_payloads``) held a piece of the sum, over a set of the call's ranks that includes
    the sender, of their inputs: ``partials[r]`` lists what rank r's input may be (one tensor, or the
    alternatives an exercise allows).  Every step of gloo's all-reduce, ring or another, sends what the
    sender has summed so far, its own input among it; a rank that passes its data some other way and
    all-reduces anything else (zeros, a copy of the answer) sends no such piece.  ``tolerance`` (rtol, atol)
    replaces the dtype's for a sum (values the grader recomputes along another rounding); with ``magnitudes``
    the messages' absolute values are held to the sums' (inputs known up to signs that every rank shares, such
    as the columns of an orthogonalised factor)."""
    ranks = sorted(partials)
    flat = {r: [t.detach().cpu().reshape(-1).double() for t in partials[r]] for r in ranks}
    dtype = partials[ranks[0]][0].dtype
    size = torch.empty((), dtype=dtype).element_size()
    sums: dict[tuple, list[torch.Tensor]] = {}

    def sums_over(members: tuple) -> list[torch.Tensor]:
        if members not in sums:
            totals = [torch.zeros_like(flat[members[0]][0])]
            for r in members:
                totals = [total + choice for total in totals for choice in flat[r]]
            sums[members] = totals
        return sums[members]

    for src, sent in sorted(payloads.items()):
        others = [r for r in ranks if r != src]
        sets = [
            tuple(sorted((src, *(o for k, o in enumerate(others) if mask >> k & 1))))
            for mask in sorted(range(1 << len(others)), key=int.bit_count)
        ]
        for i, payload in enumerate(sent):
            if len(payload) % size == 0:
                values = torch.frombuffer(bytearray(payload), dtype=dtype)
                if magnitudes:
                    values = values.abs()
                if any(
                    _piece_of(values, total.abs() if magnitudes else total, len(s), tolerance)
                    for s in sets
                    for total in sums_over(s)
                ):
                    continue
            raise AssertionError(
                f"{case}: {what}: message {i + 1} of {len(sent)} rank {src} sent in that all-reduce ({len(payload):,} "
                f"bytes) holds no piece of a sum of the ranks' inputs that includes rank {src}'s, as the grader "
                "computed them in one process. What a rank all-reduces must be the data itself: values that arrive "
                "some other way, with other bytes sent in their place, do not count"
            )


def assert_values_carried(
    run,
    expected: dict[tuple[int, int], list[list[torch.Tensor]]],
    case: str,
    *,
    rtol: float,
    atol: float,
    what: str = "message",
) -> None:
    """Fail unless message i that rank ``src`` sent rank ``dst`` held, value for value (within ``rtol``
    and ``atol``), one of the tensors ``expected[(src, dst)][i]`` lists, as the grader's packet capture
    saw it cross (``run.timeline`` of a ``dl.exercise.run(..., content=True)``).  For messages whose
    values the grader can recompute but not to the bit (a pipeline's activations, computed in another
    order of adding); ``assert_carried`` looks for exact bytes.  In the student's own notebook there is
    no capture: nothing is checked there.

    >>> assert_values_carried(run, {(0, 1): [[a0, a1], [a0, a1]]}, "gpipe", rtol=1e-4, atol=1e-5)
    """
    for (src, dst), allowed in expected.items():
        got = messages(run, src, dst, case, len(allowed), what)
        if got is None:
            continue
        for i, (payload, candidates) in enumerate(zip(got, allowed)):
            for want in candidates:
                flat = want.detach().cpu().reshape(-1)
                if len(payload) != flat.numel() * flat.element_size():
                    continue
                values = torch.frombuffer(bytearray(payload), dtype=flat.dtype)
                if bool(torch.isclose(values, flat, rtol=rtol, atol=atol).all()):
                    break
            else:
                raise AssertionError(
                    f"{case}: {what} {i + 1} of {len(allowed)} from rank {src} to rank {dst} ({len(payload):,} bytes) "
                    f"holds none of the values it must (rtol={rtol:g}, atol={atol:g}), as the grader recomputed them "
                    "in one process. What a rank sends must be the data itself: values that arrive some other way, "
                    "with other bytes sent in their place, do not count"
                )


def rows_sent(payloads: Sequence[bytes], width: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The messages among ``payloads`` whose length is a whole number of rows of ``width`` values of ``dtype``,
    read as such rows and stacked, ``(rows, width)``: a collective's message carries whole rows of a tensor whose
    last dimension is ``width`` (a token's, a head's), whatever their order.  The others are left out."""
    row = width * torch.empty(0, dtype=dtype).element_size()
    found = [torch.frombuffer(bytearray(p), dtype=dtype).view(-1, width) for p in payloads if p and not len(p) % row]
    return torch.cat(found) if found else torch.empty(0, width, dtype=dtype)


def rows_close(rows: torch.Tensor, candidates: torch.Tensor, *, rtol: float, atol: float) -> int:
    """How many of ``rows`` equal one of ``candidates`` (both ``(n, width)``), value for value within ``rtol`` and
    ``atol``: rows the grader recomputes but not to the bit."""
    if not len(rows) or not len(candidates):
        return 0
    close = torch.isclose(rows[:, None, :], candidates[None, :, :], rtol=rtol, atol=atol)
    return int(close.all(-1).any(-1).sum())


def rows_whole(payloads: Sequence[bytes], rows: torch.Tensor) -> int:
    """How many times the rows of ``rows`` (each distinct row once) appear byte for byte in ``payloads`` joined: rows
    a message must carry as they are (a token's, a head's inputs)."""
    there = b"".join(payloads)
    return sum(there.count(r) for r in {row.detach().cpu().contiguous().numpy().tobytes() for row in rows})


def words_sent(payloads: Sequence[bytes]) -> np.ndarray:
    """Every fp32 word of ``payloads`` (each read from its start: a call's messages joined first keep their
    alignment), finite ones only, sorted: what ``words_found`` looks in, where values travel in an order and a
    flattening the student chooses (a bucket, padded shards)."""
    words = [np.frombuffer(p[: len(p) // 4 * 4], dtype=np.float32) for p in payloads]
    pool = np.sort(np.concatenate(words)) if words else np.empty(0, dtype=np.float32)
    return pool[np.isfinite(pool)]


def words_found(pool: np.ndarray, want: np.ndarray, *, rtol: float, atol: float) -> int:
    """How many of the values ``want`` have a word of the sorted ``pool`` (``words_sent``) within ``rtol`` of
    themselves plus ``atol``."""
    if pool.size == 0 or want.size == 0:
        return 0
    return int((_nearest(pool, want) <= rtol * np.abs(want) + atol).sum())


def _nearest(pool: np.ndarray, want: np.ndarray) -> np.ndarray:
    """How far each of ``want`` is from the nearest word of the sorted, nonempty ``pool``."""
    at = np.clip(np.searchsorted(pool, want), 1, pool.size - 1)
    return np.minimum(np.abs(pool[at] - want), np.abs(pool[at - 1] - want))


def sums_found(
    pool: np.ndarray, own: np.ndarray, others: Sequence[np.ndarray], *, rtol: float, atol: float
) -> np.ndarray:
    """Which entries of ``own`` (a rank's input to a reduction, flat) the sorted ``pool`` (``words_sent``: what the
    rank sent) holds as a partial sum that includes it: ``own[j]`` plus the entry ``j`` of any subset of ``others``
    (the other ranks' inputs, in the same layout), as it is or divided by the number of ranks (an average), within
    ``rtol`` of the sum of the terms' magnitudes plus ``atol``.  Every step of a ring, or of halving and doubling,
    sends each entry of the sender's input once in a sum it has made so far, its own term among it (the all-gather
    phase sends the totals); a rank that reduces some share of its input and passes the rest another way does not."""
    n = len(others) + 1
    found = np.zeros(own.shape, dtype=bool)
    if pool.size == 0 or own.size == 0:
        return found
    terms = [o.astype(np.float64) for o in others]
    for mask in range(1 << len(terms)):
        total, size = own.astype(np.float64), np.abs(own.astype(np.float64))
        for k, term in enumerate(terms):
            if mask >> k & 1:
                total, size = total + term, size + np.abs(term)
        for scale in (1, n):
            found |= _nearest(pool, total / scale) <= rtol * size / scale + atol
    return found


def assert_gradients_all_reduced(
    run, rank: int, group: Sequence[int], local: dict[int, Sequence], case: str, rtol: float
) -> None:
    """Under grading (nothing in the student's own kernel): at each step, what ``rank`` sent the ranks of ``group``
    in all-reduces holds every nonzero entry of its own gradients in a partial sum of the group's (``sums_found``;
    ``local[r][step]``, rank r's gradients flat, computed by the grader in one process, for each rank r of
    ``group``), whatever the order, the flattening or the algorithm.  A share of the gradients all-reduced (the
    share a ring's first step sends as it is: it once passed) and the rest averaged some other way (the launcher's
    store), or zeros of the right size all-reduced, fail."""
    sent = sends(run, case)
    if sent is None:
        return
    pool = words_sent([p for src, dst, slot, p in sent if src == rank and dst in group and kind(slot) == "all_reduce"])
    for step, grads in enumerate(local[rank]):
        grads = np.asarray(grads)
        nonzero = grads != 0
        others = [np.asarray(local[r][step])[nonzero] for r in group if r != rank]
        found = sums_found(pool, grads[nonzero], others, rtol=rtol, atol=1e-7)
        missing = np.flatnonzero(~found)
        assert not missing.size, (
            f"{case}: at step {step + 1} rank {rank}'s all-reduces with ranks {tuple(group)} should carry each of "
            f"its own gradients' {found.size} nonzero entries (the grader's training in one process), as it is or in "
            f"a sum with the other ranks' (every step of an all-reduce sends what the sender has summed so far); "
            f"the grader's capture of the wire found {int(found.sum())}, not entry {int(missing[0])} "
            f"({float(grads[nonzero][missing[0]]):.6g}) among {missing.size} missing. The gradients must travel in "
            "the all-reduce itself"
        )
