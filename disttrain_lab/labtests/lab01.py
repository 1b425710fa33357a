"""Lab 1's graded tests (point-to-point messaging): each check runs the student's function on
ranks with ``dl.exercise.run``, compares what every rank returned with the data itself, reads the
bytes between the ranks as the operating system counted them and, under grading, the messages
themselves from the grader's capture of the wire: what each carried, who sent how many to whom
(``_message_counts``), a ping-pong's order, a tree's rounds (``wire_rounds``) and that only send/recv
were used (``checks.assert_point_to_point``: a collective's messages carry its kind in their slot).  The
ranks' calls stand in for the wire only in the student's own kernel."""

from __future__ import annotations

import math

import torch

from .. import carried, checks, exercise, gloo_ops
from ..exercise import ExerciseRun
from . import common

__all__ = [
    "check_broadcast_linear",
    "check_broadcast_tree",
    "check_gather",
    "check_parameter_server_step",
    "check_ping_pong",
    "check_ring_shift",
    "check_scatter",
    "wire_rounds",
]


def check_ping_pong(n: int, numel: int, repeats: int, dtype: torch.dtype) -> None:
    """``ping_pong(x, repeats)``: rank 0's ``x`` goes to rank 1 and back ``repeats`` times, each ping
    waiting for its pong (the order read from the wire under grading); only send/recv; every message
    carries all of ``x``; ranks other than 0 and 1 take no part."""
    case = f"ping_pong on {n} ranks ({numel} x {dtype}, repeats={repeats})"
    data = checks.sample_tensor(numel, dtype, seed=common.unseen(5))
    inputs = [(data.clone() if rank == 0 else torch.zeros(numel, dtype=dtype), repeats) for rank in range(n)]
    run = exercise.run("ping_pong", n, inputs, timeout=30, timeline=True, content=True)
    for rank in (0, 1):
        checks.assert_close(run.results[rank], data, what=f"{case}: rank {rank}'s returned tensor")
    nbytes = numel * data.element_size()
    checks.assert_traffic(run, {(0, 1): repeats * nbytes, (1, 0): repeats * nbytes}, case)
    carried.assert_carried(run, {(0, 1): [data] * repeats, (1, 0): [data] * repeats}, case)
    crossed = run.timeline.directions()  # when the data crossed, between which ranks: the wire, when graded
    assert crossed == [(0, 1), (1, 0)] * repeats, (
        f"{case}: the data should cross as {repeats} round trips, rank 0 to rank 1 and back, each ping waiting "
        f"for its pong; it crossed as {' then '.join(f'{a}->{b}' for a, b in crossed)}"
    )
    checks.assert_point_to_point(run, "ping_pong")
    _assert_message_counts(run, case, {(0, 1): repeats, (1, 0): repeats}, f"{repeats} pings and {repeats} pongs")
    if run.timeline.source != "trace":
        return  # (the order and the sizes are the wire's, above; the calls are the student's own account)
    student = run.trace  # in the student's own kernel: what the ranks say they did, in order
    for me, other, first in ((0, 1, "send"), (1, 0, "recv")):
        p2p = [e for e in student.by_rank(me) if e.kind == "p2p"]
        directions = ["send" if e.op in checks.SEND_OPS else "recv" for e in p2p]
        second = "recv" if first == "send" else "send"
        assert directions == [first, second] * repeats, (
            f"{case}: rank {me} should {first} then {second}, {repeats} times (a ping must wait for "
            f"its pong), but its calls were {[e.describe() for e in p2p]}"
        )
        assert all(e.peer == other and e.bytes == nbytes for e in p2p), (
            f"{case}: every message of rank {me} should go to/come from rank {other} and carry "
            f"{nbytes} bytes, got {[e.describe() for e in p2p]}"
        )


def check_ring_shift(n: int, shape: tuple, dtype: torch.dtype) -> None:
    """``ring_shift(x)``: rank r returns its left neighbour's ``x`` (rank r-1 mod n) and sends its own
    ``x`` once, to rank r+1 mod n, without deadlocking (even at 4 MiB, which no buffer hides)."""
    case = f"ring_shift on {n} ranks ({dtype}, shape {shape})"
    xs = [checks.sample_tensor(shape, dtype, seed=common.unseen(rank)) for rank in range(n)]
    try:
        run = exercise.run("ring_shift", n, [(x.clone(),) for x in xs], timeout=15, content=True)
    except exercise.ExerciseTimeout as e:
        raise AssertionError(
            f"{case} did not finish: a deadlock? If every rank blocks in send at the same time, none is receiving.\n{e}"
        ) from None
    for rank, out in enumerate(run.results):  # rank r gets its left neighbour's x
        checks.assert_close(out, xs[(rank - 1) % n], what=f"{case}: rank {rank}'s result")
    nbytes = xs[0].numel() * xs[0].element_size()
    checks.assert_traffic(run, {(rank, (rank + 1) % n): nbytes for rank in range(n)}, case)
    carried.assert_carried(run, {(rank, (rank + 1) % n): [xs[rank]] for rank in range(n)}, case)
    checks.assert_point_to_point(run, "ring_shift")
    _assert_message_counts(
        run, case, {(rank, (rank + 1) % n): 1 for rank in range(n)}, "each rank sends exactly one message, to its right"
    )


def _message_counts(run: ExerciseRun) -> tuple[dict[tuple[int, int], int], str]:
    """How many messages each rank sent each other rank, (sender, receiver) -> count, and where that was
    read: under grading from the grader's capture (gloo's sends on each connection, ``Timeline.messages``),
    in the student's own kernel from the ranks' calls (the trace: no wire is seen there)."""
    n = run.world_size
    if run.timeline.source != "trace":
        counts = {(a, b): len(run.timeline.messages(a, b) or ()) for a in range(n) for b in range(n) if a != b}
        return {pair: k for pair, k in counts.items() if k}, "the grader's capture of the wire"
    counts: dict[tuple[int, int], int] = {}
    for rank in range(n):
        for e in checks.sends(run.trace, rank):
            counts[(rank, e.peer)] = counts.get((rank, e.peer), 0) + 1
    return counts, "your ranks' calls"


def _assert_message_counts(run: ExerciseRun, case: str, expected: dict[tuple[int, int], int], rule: str) -> None:
    """Fail unless the messages between the ranks are exactly ``expected`` ((sender, receiver) -> count, none
    between a pair not named): ``_message_counts``."""
    counts, source = _message_counts(run)
    wrong = {pair: counts.get(pair, 0) for pair in {*counts, *expected} if counts.get(pair, 0) != expected.get(pair, 0)}
    assert not wrong, (
        f"{case}: {rule}; the messages differ between "
        + ", ".join(f"rank {a} -> rank {b} ({k}, not {expected.get((a, b), 0)})" for (a, b), k in sorted(wrong.items()))
        + f" (from {source})"
    )


def _check_broadcast(name: str, n: int, shape: tuple, dtype: torch.dtype, src: int) -> tuple[str, ExerciseRun]:
    """Run the notebook's ``name`` on n ranks; compare with the data (what dist.broadcast would leave);
    each other rank receives the data once; return (case, run)."""
    case = f"{name} on {n} ranks (src={src}, {dtype}, shape {shape})"
    data = checks.sample_tensor(shape, dtype, seed=common.unseen(100 + src))
    inputs = [(data.clone() if rank == src else torch.full(shape, -7, dtype=dtype), src) for rank in range(n)]
    run = exercise.run(name, n, inputs, timeout=30, content=True)
    for rank, out in enumerate(run.results):  # what dist.broadcast would leave: the data
        checks.assert_close(out, data, what=f"{case}: rank {rank}'s tensor")
    checks.assert_point_to_point(run, name)
    counts, source = _message_counts(run)
    for rank in range(n):
        got = {a: k for (a, b), k in counts.items() if b == rank}
        senders = ", ".join(f"{k} from rank {a}" for a, k in sorted(got.items())) or "none"
        assert rank == src or sum(got.values()) == 1, (
            f"{case}: rank {rank} should receive the data exactly once, it received {sum(got.values())} messages "
            f"({senders}; from {source})"
        )
    nbytes = data.numel() * data.element_size()
    moved = run.traffic
    for rank in range(n):
        assert rank == src or nbytes <= moved.received(rank) <= nbytes + checks.WIRE_SLACK, (
            f"{case}: rank {rank} should receive the {nbytes:,} bytes once, the operating system counted "
            f"{moved.received(rank):,} bytes ({moved.describe()})"
        )
    return case, run


def check_broadcast_linear(n: int, shape: tuple, dtype: torch.dtype, src: int) -> None:
    """``broadcast_linear(x, src)``: every rank ends with the source's ``x``; the source sends one
    message to each other rank, and each other rank receives exactly once."""
    case, run = _check_broadcast("broadcast_linear", n, shape, dtype, src)
    _assert_message_counts(
        run, case, {(src, r): 1 for r in range(n) if r != src}, "the source sends one message to each other rank"
    )
    nbytes = run.results[src].numel() * run.results[src].element_size()
    checks.assert_traffic(run, {(src, r): nbytes for r in range(n) if r != src}, case)
    carried.assert_carried(run, {(src, r): [run.results[src]] for r in range(n) if r != src}, case)


def check_broadcast_tree(n: int, shape: tuple, dtype: torch.dtype, src: int) -> None:
    """``broadcast_tree(x, src)``: every rank ends with the source's ``x``, in a binomial tree: the source
    sends at most ceil(log2 n) messages, and the broadcast takes at most ceil(log2 n) rounds."""
    case, run = _check_broadcast("broadcast_tree", n, shape, dtype, src)
    best = math.ceil(math.log2(n))
    counts, source = _message_counts(run)
    sent = {b: k for (a, b), k in counts.items() if a == src}
    assert sum(sent.values()) <= best, (
        f"{case}: in a binomial tree the source sends at most ceil(log2 {n}) = {best} messages, "
        f"it sent {sum(sent.values())} (to ranks {sorted(sent)}; from {source})"
    )
    nbytes = run.results[src].numel() * run.results[src].element_size()
    counted = run.traffic.sent(src)
    assert counted <= best * nbytes + checks.WIRE_SLACK, (
        f"{case}: the source should send at most {best} × {nbytes:,} bytes, the operating system counted "
        f"{counted:,} ({run.traffic.describe()})"
    )
    carried.assert_carried(run, {(None, r): [run.results[src]] for r in range(n) if r != src}, case)
    rounds = wire_rounds(run)
    source = "its messages on the wire" if rounds is not None else "its calls"
    rounds = run.trace.rounds() if rounds is None else rounds
    assert rounds <= best, (
        f"{case}: a binomial tree needs ceil(log2 {n}) = {best} rounds, this took {rounds} (from {source}; a rank "
        f"sends one message a round, and one that received in round r forwards in round r+1 at the earliest)"
    )


def wire_rounds(run: ExerciseRun) -> int | None:
    """The rounds of a run's point-to-point messages under the one-port model, from the grader's capture (None
    in the student's own kernel, where the trace counts them: ``Run.rounds``).  A message is sent when its data's
    first byte crosses and received when its last byte has; its round is 1 + the larger of its sender's previous
    message's round and the rounds of the messages that sender had received whole by then.  Not when its
    sender's ``NOTIFY_SEND_READY`` note leaves: that note goes out as the send is posted (``gloo_ops.operations``),
    and gloo reads the tensor only once the receiver's note has come, so a rank can post the send of a buffer
    its own receive has not filled yet; the data itself cannot leave before it is in (the messages' bytes are
    checked: ``carried``)."""
    if run.timeline.source == "trace":
        return None
    n = run.world_size
    sent: list[tuple[float, int, int, int]] = []  # (when its data began, sender, receiver, which message that way)
    arrived: dict[tuple[int, int], list[float]] = {}  # each direction's messages, when each was in whole
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            for first, last, opcode, _, _ in run.timeline.operations(a, b) or ():
                if opcode not in (gloo_ops.NOTIFY_SEND_READY, gloo_ops.NOTIFY_RECV_READY):
                    sent.append((first, a, b, len(arrived.setdefault((a, b), []))))
                    arrived[(a, b)].append(last)
    round_of: dict[tuple[int, int, int], int] = {}
    last_sent = [0] * n
    for when, a, b, k in sorted(sent):  # (what a message's sender received whole before it began is placed by then)
        received = [
            round_of[(c, a, i)]
            for (c, d), times in arrived.items()
            if d == a
            for i, t in enumerate(times)
            if t < when and (c, a, i) in round_of
        ]
        round_of[(a, b, k)] = 1 + max([last_sent[a], *received])
        last_sent[a] = round_of[(a, b, k)]
    return max(round_of.values(), default=0)


def check_scatter(n: int, shape: tuple, dtype: torch.dtype, src: int) -> None:
    """``scatter(out, chunks, src)``: rank r ends with ``chunks[r]``; the source sends one message to
    each other rank (its own chunk is a local copy) and each other rank only receives its chunk."""
    case = f"scatter on {n} ranks (src={src}, {dtype}, chunks of shape {shape})"
    chunks = [checks.sample_tensor(shape, dtype, seed=common.unseen(10 * src + i)) for i in range(n)]
    inputs = [
        (torch.full(shape, -7, dtype=dtype), [c.clone() for c in chunks] if rank == src else None, src)
        for rank in range(n)
    ]
    run = exercise.run("scatter", n, inputs, timeout=30, content=True)
    for rank, out in enumerate(run.results):  # what dist.scatter would give: chunks[rank]
        checks.assert_close(out, chunks[rank], what=f"{case}: rank {rank}'s chunk")
    nbytes = chunks[0].numel() * chunks[0].element_size()
    checks.assert_traffic(run, {(src, r): nbytes for r in range(n) if r != src}, case)
    carried.assert_carried(run, {(src, r): [chunks[r]] for r in range(n) if r != src}, case)
    checks.assert_point_to_point(run, "scatter")
    _assert_message_counts(
        run,
        case,
        {(src, r): 1 for r in range(n) if r != src},
        "the source sends one message to each other rank (its own chunk is a local copy), and the others only "
        "receive theirs",
    )


def check_gather(n: int, shape: tuple, dtype: torch.dtype, dst: int) -> None:
    """``gather(x, out, dst)``: rank ``dst`` returns every rank's ``x`` in rank order, the others None;
    each other rank sends its ``x`` once, to ``dst`` only."""
    case = f"gather on {n} ranks (dst={dst}, {dtype}, shape {shape})"
    xs = [checks.sample_tensor(shape, dtype, seed=common.unseen(rank)) for rank in range(n)]
    inputs = [
        (xs[rank].clone(), [torch.full(shape, -7, dtype=dtype) for _ in range(n)] if rank == dst else None, dst)
        for rank in range(n)
    ]
    run = exercise.run("gather", n, inputs, timeout=30, content=True)
    out = run.results[dst]
    assert isinstance(out, (list, tuple)) and len(out) == n, (
        f"{case}: rank {dst} should return a list of {n} tensors, got {type(out).__name__} {out!r:.80}"
    )
    for i in range(n):  # what dist.gather would give: every rank's x
        checks.assert_close(out[i], xs[i], what=f"{case}: chunk {i} on rank {dst}")
    for rank, other in enumerate(run.results):
        assert rank == dst or other is None, f"{case}: rank {rank} is not dst and should return None, got {other!r:.80}"
    nbytes = xs[0].numel() * xs[0].element_size()
    checks.assert_traffic(run, {(r, dst): nbytes for r in range(n) if r != dst}, case)
    carried.assert_carried(run, {(r, dst): [xs[r]] for r in range(n) if r != dst}, case)
    checks.assert_point_to_point(run, "gather")
    _assert_message_counts(
        run,
        case,
        {(r, dst): 1 for r in range(n) if r != dst},
        f"rank {dst} receives one message from each other rank, and the others only send theirs to it",
    )


def _worker_grad(rank: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return checks.sample_tensor(shape, dtype, seed=common.unseen(1000 + rank))


def check_parameter_server_step(n: int, shape: tuple, dtype: torch.dtype, server: int) -> None:
    """``parameter_server_step(grad, server)``: every rank returns the mean of the workers' gradients
    (the server's own is not one); each worker sends its gradient to the server and gets the average
    back, and talks to no one else.  Under grading, what crossed is read on the wire: each worker's
    gradient, byte for byte, to the server, and the server's average (what it returned, held to the mean
    above) back to each worker."""
    case = f"parameter_server_step on {n} ranks (server={server}, {dtype}, shape {shape})"
    inputs = [
        (_worker_grad(rank, shape, dtype) if rank != server else torch.full(shape, float("nan"), dtype=dtype), server)
        for rank in range(n)
    ]
    run = exercise.run("parameter_server_step", n, inputs, timeout=30, content=True)
    # the reference, in one process: the mean of the workers' gradients
    expected = torch.stack([_worker_grad(r, shape, dtype) for r in range(n) if r != server]).mean(dim=0)
    for rank, out in enumerate(run.results):
        checks.assert_close(out, expected, what=f"{case}: rank {rank}'s average")
    size = expected.numel() * expected.element_size()
    # one gradient in from each worker, one average out to each: the OS's count, pair by pair
    workers = [r for r in range(n) if r != server]
    checks.assert_traffic(run, {**{(r, server): size for r in workers}, **{(server, r): size for r in workers}}, case)
    checks.assert_point_to_point(run, "parameter_server_step")
    _assert_message_counts(
        run,
        case,
        {**{(r, server): 1 for r in workers}, **{(server, r): 1 for r in workers}},
        f"each worker sends its gradient to the server {server} once, gets the average back once, and talks to "
        f"no one else",
    )
    carried.assert_carried(
        run,
        {**{(r, server): [inputs[r][0]] for r in workers}, **{(server, r): [run.results[server]] for r in workers}},
        case,
    )
