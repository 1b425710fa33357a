"""Lab 1's graded tests (point-to-point messaging): each check runs the student's function on
ranks with ``dl.exercise.run``, compares what every rank returned with the data itself, reads the
bytes between the ranks as the operating system counted them, and reads the calls the ranks say
they made (``run.trace``) for the rules the text states (only send/recv, who sends to whom, how
many rounds)."""

from __future__ import annotations

import math

import torch

from .. import carried, checks, exercise
from ..exercise import ExerciseRun

__all__ = [
    "check_broadcast_linear",
    "check_broadcast_tree",
    "check_gather",
    "check_parameter_server_step",
    "check_ping_pong",
    "check_ring_shift",
    "check_scatter",
]


def check_ping_pong(n: int, numel: int, repeats: int, dtype: torch.dtype) -> None:
    """``ping_pong(x, repeats)``: rank 0's ``x`` goes to rank 1 and back ``repeats`` times, each ping
    waiting for its pong (the order read from the wire under grading); only send/recv; every message
    carries all of ``x``; ranks other than 0 and 1 take no part."""
    case = f"ping_pong on {n} ranks ({numel} x {dtype}, repeats={repeats})"
    data = checks.sample_tensor(numel, dtype, seed=5)
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
    student = run.trace  # what the ranks say they did, in order
    checks.assert_only_p2p(student, "ping_pong")
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
    xs = [checks.sample_tensor(shape, dtype, seed=rank) for rank in range(n)]
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
    checks.assert_only_p2p(run.trace, "ring_shift")
    for rank in range(n):
        sent = checks.sends(run.trace, rank)
        assert len(sent) == 1 and sent[0].peer == (rank + 1) % n and sent[0].bytes == nbytes, (
            f"{case}: rank {rank} should send exactly one message of {nbytes} bytes, to rank "
            f"{(rank + 1) % n}; it sent {[e.describe() for e in sent]}"
        )


def _check_broadcast(name: str, n: int, shape: tuple, dtype: torch.dtype, src: int) -> tuple[str, ExerciseRun]:
    """Run the notebook's ``name`` on n ranks; compare with the data (what dist.broadcast would leave);
    each other rank receives the data once; return (case, run)."""
    case = f"{name} on {n} ranks (src={src}, {dtype}, shape {shape})"
    data = checks.sample_tensor(shape, dtype, seed=100 + src)
    inputs = [(data.clone() if rank == src else torch.full(shape, -7, dtype=dtype), src) for rank in range(n)]
    run = exercise.run(name, n, inputs, timeout=30, content=True)
    for rank, out in enumerate(run.results):  # what dist.broadcast would leave: the data
        checks.assert_close(out, data, what=f"{case}: rank {rank}'s tensor")
    checks.assert_only_p2p(run.trace, name)
    for rank in range(n):
        got = [e.describe() for e in checks.receives(run.trace, rank)]
        assert rank == src or len(got) == 1, (
            f"{case}: rank {rank} should receive the data exactly once, it received {got}"
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
    sent = sorted(e.peer for e in checks.sends(run.trace, src))
    assert sent == [r for r in range(n) if r != src], (
        f"{case}: the source should send one message to each other rank, {sorted(set(range(n)) - {src})}, "
        f"it sent to {sent}"
    )
    nbytes = run.results[src].numel() * run.results[src].element_size()
    checks.assert_traffic(run, {(src, r): nbytes for r in range(n) if r != src}, case)
    carried.assert_carried(run, {(src, r): [run.results[src]] for r in range(n) if r != src}, case)


def check_broadcast_tree(n: int, shape: tuple, dtype: torch.dtype, src: int) -> None:
    """``broadcast_tree(x, src)``: every rank ends with the source's ``x``, in a binomial tree: the source
    sends at most ceil(log2 n) messages, and the broadcast takes at most ceil(log2 n) rounds."""
    case, run = _check_broadcast("broadcast_tree", n, shape, dtype, src)
    best = math.ceil(math.log2(n))
    sent = checks.sends(run.trace, src)
    assert len(sent) <= best, (
        f"{case}: in a binomial tree the source sends at most ceil(log2 {n}) = {best} messages, "
        f"it sent {len(sent)}: {[e.describe() for e in sent]}"
    )
    nbytes = run.results[src].numel() * run.results[src].element_size()
    counted = run.traffic.sent(src)
    assert counted <= best * nbytes + checks.WIRE_SLACK, (
        f"{case}: the source should send at most {best} × {nbytes:,} bytes, the operating system counted "
        f"{counted:,} ({run.traffic.describe()})"
    )
    carried.assert_carried(run, {(None, r): [run.results[src]] for r in range(n) if r != src}, case)
    assert run.trace.rounds() <= best, (
        f"{case}: a binomial tree needs ceil(log2 {n}) = {best} rounds, this took {run.trace.rounds()} "
        f"(a rank that received in round r should forward in round r+1)"
    )


def check_scatter(n: int, shape: tuple, dtype: torch.dtype, src: int) -> None:
    """``scatter(out, chunks, src)``: rank r ends with ``chunks[r]``; the source sends one message to
    each other rank (its own chunk is a local copy) and each other rank only receives its chunk."""
    case = f"scatter on {n} ranks (src={src}, {dtype}, chunks of shape {shape})"
    chunks = [checks.sample_tensor(shape, dtype, seed=10 * src + i) for i in range(n)]
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
    student = run.trace
    checks.assert_only_p2p(student, "scatter")
    sent = sorted(e.peer for e in checks.sends(student, src))
    assert sent == [r for r in range(n) if r != src], (
        f"{case}: the source should send one message to each other rank (its own chunk is a local copy), "
        f"it sent to {sent}"
    )
    for rank in range(n):
        p2p = [e for e in student.by_rank(rank) if e.kind == "p2p"]
        assert rank == src or (len(p2p) == 1 and p2p[0].op in checks.RECV_OPS and p2p[0].peer == src), (
            f"{case}: rank {rank} should only receive its chunk from rank {src}, "
            f"it called {[e.describe() for e in p2p]}"
        )


def check_gather(n: int, shape: tuple, dtype: torch.dtype, dst: int) -> None:
    """``gather(x, out, dst)``: rank ``dst`` returns every rank's ``x`` in rank order, the others None;
    each other rank sends its ``x`` once, to ``dst`` only."""
    case = f"gather on {n} ranks (dst={dst}, {dtype}, shape {shape})"
    xs = [checks.sample_tensor(shape, dtype, seed=rank) for rank in range(n)]
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
    student = run.trace
    checks.assert_only_p2p(student, "gather")
    got = sorted(e.peer for e in checks.receives(student, dst))
    assert got == [r for r in range(n) if r != dst], (
        f"{case}: rank {dst} should receive one message from each other rank, it received from {got}"
    )
    for rank in range(n):
        if rank != dst:
            sent = [e.describe() for e in student.by_rank(rank) if e.kind == "p2p"]
            assert len(sent) == 1 and checks.sends(student, rank, dst), (
                f"{case}: rank {rank} should only send its tensor to rank {dst}, it called {sent}"
            )


def _worker_grad(rank: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return checks.sample_tensor(shape, dtype, seed=1000 + rank)


def check_parameter_server_step(n: int, shape: tuple, dtype: torch.dtype, server: int) -> None:
    """``parameter_server_step(grad, server)``: every rank returns the mean of the workers' gradients
    (the server's own is not one); each worker sends its gradient to the server and gets the average
    back, and talks to no one else."""
    case = f"parameter_server_step on {n} ranks (server={server}, {dtype}, shape {shape})"
    inputs = [
        (_worker_grad(rank, shape, dtype) if rank != server else torch.full(shape, float("nan"), dtype=dtype), server)
        for rank in range(n)
    ]
    run = exercise.run("parameter_server_step", n, inputs, timeout=30)
    # the reference, in one process: the mean of the workers' gradients
    expected = torch.stack([_worker_grad(r, shape, dtype) for r in range(n) if r != server]).mean(dim=0)
    for rank, out in enumerate(run.results):
        checks.assert_close(out, expected, what=f"{case}: rank {rank}'s average")
    size = expected.numel() * expected.element_size()
    # one gradient in from each worker, one average out to each: the OS's count, pair by pair
    workers = [r for r in range(n) if r != server]
    checks.assert_traffic(run, {**{(r, server): size for r in workers}, **{(server, r): size for r in workers}}, case)
    student = run.trace
    checks.assert_only_p2p(student, "parameter_server_step")
    for rank in range(n):
        if rank != server:
            peers = {e.peer for e in student.by_rank(rank) if e.kind == "p2p"}
            assert peers == {server}, (
                f"{case}: worker {rank} should talk only to the server {server}, it talked to {sorted(peers)}"
            )
