"""Lab 2's graded tests (all-reduce): each check runs the student's all-reduce (or one of its halves)
on ranks with ``dl.exercise.run``, compares every rank's tensor with the sum of every rank's data
computed in one process (what ``dist.all_reduce`` gives), and reads what the algorithm sent: the
bytes between the ranks as the operating system counted them, and the calls the ranks say they
made (``run.trace``) for the rules the text states (only send/recv, who talks to whom, how many
steps, how many bytes per rank).  The predictions' cost model stays in the notebook's hidden tests."""

from __future__ import annotations

import math

import torch

from .. import checks, exercise
from ..exercise import ExerciseRun
from . import common

__all__ = [
    "check_halving_doubling_all_reduce",
    "check_halving_doubling_not_a_power_of_two",
    "check_naive_all_reduce",
    "check_pipelined_ring_all_reduce",
    "check_ring_all_gather",
    "check_ring_all_reduce",
    "check_ring_reduce_scatter",
]

_DEADLOCK = "a deadlock, or a rank waiting for a message nobody sends?"
_TWO_ROUNDS = (
    "(Blocking send/recv ordered even/odd turns every step into two rounds under the one-port model: "
    "post the send with isend, then recv.)"
)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _all_reduce_inputs(
    n: int, shape: tuple, dtype: torch.dtype, contiguous: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each rank's data, and the x it gets: the data itself, or a non-contiguous copy of it."""
    data = [checks.sample_tensor(shape, dtype, seed=rank) for rank in range(n)]
    xs = [d.clone() if contiguous else torch.empty(shape[::-1], dtype=dtype).t().copy_(d) for d in data]
    return data, xs


def _check_all_reduce(
    name: str, n: int, shape: tuple, dtype: torch.dtype = torch.float32, contiguous: bool = True
) -> tuple[str, ExerciseRun | None]:
    """Run the notebook's ``name`` on n ranks and compare with the sum of every rank's data (what
    dist.all_reduce gives), in place and returned; only point-to-point calls.  Returns (case, the
    run), or (case, None) if it refused a non-contiguous input with a clear error."""
    case = f"{name} on {n} ranks ({_dtype(dtype)}, shape {shape}" + (")" if contiguous else ", non-contiguous)")
    data, xs = _all_reduce_inputs(n, shape, dtype, contiguous)
    try:
        run = common.run_or_fail(name, n, [(x,) for x in xs], case, _DEADLOCK, timeout=30)
    except exercise.ExerciseError as e:
        if not contiguous and common.rank_raised(e, "ValueError", "contiguous"):
            return case, None  # the student's own clear error is accepted
        raise
    expected = torch.stack(data).sum(dim=0).to(dtype)  # the reference, in one process
    for rank in range(n):
        checks.assert_close(
            run.inputs_after[rank][0],
            expected,
            what=f"{case}: rank {rank}'s x after the call (all-reduce works in place)",
        )
        checks.assert_close(run.results[rank], expected, what=f"{case}: the tensor rank {rank} returned")
    checks.assert_only_p2p(run.trace, name)
    return case, run


def _check_optimal_bytes(
    case: str,
    run: ExerciseRun,
    n: int,
    numel: int,
    element_size: int,
    phases: int = 2,
    hint: str = "Send one chunk of S/N per step, not the whole tensor",
) -> None:
    """Each rank sends (N-1)/N of the data per phase, give or take chunk rounding: as the
    operating system counted it (plus gloo's message headers), and as the rank's trace says."""
    low, high = (phases * (n - 1) * (numel // n) * element_size, phases * (n - 1) * -(-numel // n) * element_size)
    for rank in range(n):
        for sent, by in (
            (run.traffic.sent(rank), "the operating system counted"),
            (run.trace.bytes_sent(rank), "its trace says"),
        ):
            slack = checks.WIRE_SLACK if by.startswith("the operating") else 0
            assert low <= sent <= high + slack, (
                f"{case}: rank {rank} sent {sent} bytes ({by}); this algorithm sends {phases}·(N-1)/N · S = "
                f"{phases * (n - 1) / n * numel * element_size:.0f} bytes per rank (between {low} and {high} "
                f"with chunks of uneven size). {hint}"
            )


def _check_ring_neighbours(case: str, run: ExerciseRun, n: int) -> None:
    """In a ring, rank r sends only to r+1 and receives only from r-1 (its trace), and the operating
    system saw nothing beyond headers between any other pair."""
    student = run.trace
    for rank in range(n):
        to = {e.peer for e in checks.sends(student, rank)}
        frm = {e.peer for e in checks.receives(student, rank)}
        assert to <= {(rank + 1) % n} and frm <= {(rank - 1) % n}, (
            f"{case}: in a ring, rank {rank} sends only to its right neighbour {(rank + 1) % n} and receives "
            f"only from its left neighbour {(rank - 1) % n}; it sent to {sorted(to)} and received from {sorted(frm)}"
        )
        others = {peer: run.traffic.between(rank, peer) for peer in range(n) if peer not in (rank, (rank + 1) % n)}
        assert all(nbytes <= checks.WIRE_SLACK for nbytes in others.values()), (
            f"{case}: in a ring, rank {rank} sends only to its right neighbour {(rank + 1) % n}; the operating "
            f"system counted {run.traffic.describe()}"
        )


def check_naive_all_reduce(n: int, shape: tuple, dtype: torch.dtype = torch.float32, contiguous: bool = True) -> None:
    """``naive_all_reduce(x)`` (exercise 1): every rank's ``x`` holds the sum, in place, and is returned
    (any shape and dtype; a non-contiguous ``x`` summed too, or refused with a ValueError that says
    "contiguous"); only send/recv; every other rank sends ``x`` to rank 0 and receives the sum back,
    rank 0 receives N-1 tensors and sends N-1 sums, and no one else talks."""
    case, run = _check_all_reduce("naive_all_reduce", n, shape, dtype, contiguous)
    if run is None:
        return
    size = math.prod(shape) * _element_size(dtype)
    student = run.trace
    for rank in range(n):
        moved = (student.bytes_sent(rank), student.bytes_received(rank))
        want = ((n - 1) * size, (n - 1) * size) if rank == 0 else (size, size)
        assert moved == want, (
            f"{case}: rank {rank} should send and receive {want} bytes "
            f"({'N-1 tensors of' if rank == 0 else 'one tensor of'} "
            f"{size} B: {'the root gathers and sends back' if rank == 0 else 'to and from rank 0'}), it sent "
            f"{moved[0]} and received {moved[1]}"
        )
        peers = {e.peer for e in student.by_rank(rank) if e.kind == "p2p"}
        assert rank == 0 or peers == {0}, (
            f"{case}: rank {rank} should talk only to rank 0, it talked to {sorted(peers)}"
        )
    checks.assert_traffic(run, {**{(r, 0): size for r in range(1, n)}, **{(0, r): size for r in range(1, n)}}, case)


def check_ring_reduce_scatter(n: int, numel: int, dtype: torch.dtype = torch.float32) -> None:
    """``ring_reduce_scatter(flat)`` (exercise 2): rank r returns chunk r of ``flat.tensor_split(N)``,
    summed over all ranks; only send/recv, to the right neighbour, from the left; (N-1)/N of the data
    sent per rank; N-1 steps (when every chunk has an element)."""
    case = f"ring_reduce_scatter on {n} ranks ({numel} x {_dtype(dtype)})"
    flats = [checks.sample_tensor(numel, dtype, seed=rank) for rank in range(n)]
    run = common.run_or_fail("ring_reduce_scatter", n, [(f.clone(),) for f in flats], case, "a deadlock?", timeout=30)
    total = torch.stack(flats).sum(dim=0).to(dtype)  # what dist.all_reduce gives, in one process
    for rank, out in enumerate(run.results):
        checks.assert_close(
            out, total.tensor_split(n)[rank], what=f"{case}: the chunk rank {rank} returned (chunk {rank}, summed)"
        )
    student = run.trace
    checks.assert_only_p2p(student, "ring_reduce_scatter")
    _check_ring_neighbours(case, run, n)
    _check_optimal_bytes(case, run, n, numel, _element_size(dtype), phases=1)
    if numel >= n:
        assert student.rounds() == n - 1, (
            f"{case}: reduce-scatter on a ring takes N-1 = {n - 1} steps, this took {student.rounds()} "
            f"(one chunk out and one in per step, on every rank at once).  {_TWO_ROUNDS}"
        )


def _piece(rank: int, n: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return checks.sample_tensor(numel, dtype, seed=rank).tensor_split(n)[rank]


def check_ring_all_gather(n: int, numel: int, dtype: torch.dtype = torch.float32) -> None:
    """``ring_all_gather(flat)`` (exercise 3): from chunk r of rank r's ``flat``, every rank's ``flat``
    ends up (in place, and returned) holding every rank's chunk in place; only send/recv, to the
    right neighbour, from the left; (N-1)/N of the data sent per rank; N-1 steps."""
    case = f"ring_all_gather on {n} ranks ({numel} x {_dtype(dtype)})"
    flats = []
    for rank in range(n):
        flat = torch.full((numel,), -7, dtype=dtype)
        flat.tensor_split(n)[rank].copy_(_piece(rank, n, numel, dtype))
        flats.append((flat,))
    run = common.run_or_fail("ring_all_gather", n, flats, case, "a deadlock?", timeout=30)
    expected = torch.cat([_piece(r, n, numel, dtype) for r in range(n)])  # in one process
    for rank, out in enumerate(run.results):
        checks.assert_close(run.inputs_after[rank][0], expected, what=f"{case}: rank {rank}'s flat after the call")
        checks.assert_close(out, expected, what=f"{case}: the tensor rank {rank} returned")
    student = run.trace
    checks.assert_only_p2p(student, "ring_all_gather")
    _check_ring_neighbours(case, run, n)
    _check_optimal_bytes(case, run, n, numel, _element_size(dtype), phases=1)
    if numel >= n:
        assert student.rounds() == n - 1, (
            f"{case}: all-gather on a ring takes N-1 = {n - 1} steps, this took {student.rounds()}.  {_TWO_ROUNDS}"
        )


def check_ring_all_reduce(n: int, shape: tuple, dtype: torch.dtype = torch.float32, contiguous: bool = True) -> None:
    """``ring_all_reduce(x)`` (exercise 4): the sum, in place and returned, as ``naive_all_reduce``'s;
    only send/recv, to the right neighbour, from the left; 2(N-1)/N of the data sent per rank, in
    2(N-1) steps (when every chunk has an element)."""
    case, run = _check_all_reduce("ring_all_reduce", n, shape, dtype, contiguous)
    numel = math.prod(shape)
    if run is None or numel < n:
        return  # empty chunks: steps and bytes are not compared
    _check_ring_neighbours(case, run, n)
    _check_optimal_bytes(case, run, n, numel, _element_size(dtype))
    assert run.trace.rounds() == 2 * (n - 1), (
        f"{case}: a ring all-reduce takes 2(N-1) = {2 * (n - 1)} steps (N-1 of reduce-scatter, N-1 of "
        f"all-gather), this took {run.trace.rounds()}.  {_TWO_ROUNDS}"
    )


def check_halving_doubling_all_reduce(
    n: int, shape: tuple, dtype: torch.dtype = torch.float32, contiguous: bool = True
) -> None:
    """``halving_doubling_all_reduce(x)`` (exercise 5), N a power of two: the sum, in place and
    returned; only send/recv; 2(N-1)/N of the data sent per rank, in 2·log2(N) rounds, each an
    exchange with the partner whose rank differs in one bit (rank XOR distance), and no other."""
    case, run = _check_all_reduce("halving_doubling_all_reduce", n, shape, dtype, contiguous)
    numel = math.prod(shape)
    if run is None or numel < n:
        return
    _check_optimal_bytes(
        case,
        run,
        n,
        numel,
        _element_size(dtype),
        hint="Exchange half of your current part with each partner (S/2, then S/4, ...), not the whole tensor",
    )
    best = 2 * int(math.log2(n))
    assert run.trace.rounds() == best, (
        f"{case}: recursive halving then doubling takes 2·log2({n}) = {best} rounds, this took {run.trace.rounds()}"
        f" (one exchange with one partner per round: distances N/2, ..., 1, then 1, ..., N/2)"
    )
    for rank in range(n):
        partners = [e.peer for e in checks.sends(run.trace, rank)]
        assert len(partners) == best and all(bin(rank ^ p).count("1") == 1 for p in partners), (
            f"{case}: rank {rank} should exchange once per round with a partner whose rank differs in one "
            f"bit (rank XOR distance), {best} messages in all; it sent to {partners}"
        )
        far = {p: run.traffic.between(rank, p) for p in range(n) if p != rank and bin(rank ^ p).count("1") != 1}
        assert all(nbytes <= checks.WIRE_SLACK for nbytes in far.values()), (
            f"{case}: rank {rank} should only exchange with partners whose rank differs in one bit; the "
            f"operating system counted {run.traffic.describe()}"
        )


def check_halving_doubling_not_a_power_of_two(n: int) -> None:
    """``halving_doubling_all_reduce(x)`` on N ranks, N not a power of two (exercise 5): either every
    rank raises a ValueError whose message says "power of two" (so that torch's own error about a
    partner rank that does not exist is not taken for it), or a fallback gives the right sum."""
    case = f"halving_doubling_all_reduce on {n} ranks (not a power of two)"
    try:
        _check_all_reduce("halving_doubling_all_reduce", n, (6,))
    except exercise.ExerciseError as e:
        if e.exc_type is None:  # not a rank's own exception: a failed check
            raise AssertionError(
                f"{case}: either raise ValueError (N must be a power of two) on every rank "
                f"before communicating, or fall back to a correct algorithm. Instead: {e}"
            ) from None
        # the exercise asks for the words "power of two"
        assert common.rank_raised(e, "ValueError", "power of two", loose=True), (
            f"{case}: raise ValueError saying N must be a power of two (or fall back to a correct algorithm); "
            f"it raised {e.exc_type}: {e.exc_message}"
        )
    except AssertionError as e:
        raise AssertionError(
            f"{case}: either raise ValueError (N must be a power of two) on every rank "
            f"before communicating, or fall back to a correct algorithm. Instead: {e}"
        ) from None


def check_pipelined_ring_all_reduce(
    n: int, shape: tuple, segments: int, dtype: torch.dtype = torch.float32, contiguous: bool = True
) -> None:
    """``pipelined_ring_all_reduce(x, segments)`` (exercise 6, optional): the sum, in place and
    returned; only point-to-point messages, to the right neighbour, from the left; 2(N-1)/N of the
    data sent per rank; and, when every chunk has at least ``segments`` elements, each of the 2(N-1)
    steps sends its chunk as ``segments`` messages."""
    case = f"pipelined_ring_all_reduce on {n} ranks ({_dtype(dtype)}, shape {shape}, segments={segments}" + (
        ")" if contiguous else ", non-contiguous)"
    )
    data, xs = _all_reduce_inputs(n, shape, dtype, contiguous)
    run = common.run_or_fail(
        "pipelined_ring_all_reduce",
        n,
        [(x, segments) for x in xs],
        case,
        "a deadlock, or a receive whose message is never sent (are the segments received in the order they are sent?)",
        timeout=30,
    )
    expected = torch.stack(data).sum(dim=0).to(dtype)  # what dist.all_reduce gives, in one process
    for rank in range(n):
        checks.assert_close(
            run.inputs_after[rank][0],
            expected,
            what=f"{case}: rank {rank}'s x after the call (all-reduce works in place)",
        )
        checks.assert_close(run.results[rank], expected, what=f"{case}: the tensor rank {rank} returned")
    checks.assert_only_p2p(run.trace, "pipelined_ring_all_reduce")
    for rank in range(n):  # a ring: right neighbour only
        to = {e.peer for e in checks.sends(run.trace, rank)}
        frm = {e.peer for e in checks.receives(run.trace, rank)}
        # each receive gloo posts sends its sender a small "ready" note: a header per receive
        slack = checks.WIRE_SLACK + 256 * len(checks.receives(run.trace, rank))
        others = {peer: run.traffic.between(rank, peer) for peer in range(n) if peer not in (rank, (rank + 1) % n)}
        assert to <= {(rank + 1) % n} and frm <= {(rank - 1) % n} and all(b <= slack for b in others.values()), (
            f"{case}: in a ring, rank {rank} sends only to its right neighbour {(rank + 1) % n} and receives only "
            f"from its left neighbour {(rank - 1) % n}; it sent to {sorted(to)} and received from {sorted(frm)}, "
            f"and the operating system counted {run.traffic.describe()}"
        )
    numel, size = math.prod(shape), _element_size(dtype)
    low, high = 2 * (n - 1) * (numel // n) * size, 2 * (n - 1) * -(-numel // n) * size
    for rank in range(n):
        messages = len(checks.sends(run.trace, rank))
        for sent, by, slack in (
            (run.trace.bytes_sent(rank), "its trace says", 0),  # gloo adds a header per message
            (run.traffic.sent(rank), "the operating system counted", checks.WIRE_SLACK + 256 * messages),
        ):
            assert low <= sent <= high + slack, (
                f"{case}: rank {rank} sent {sent} bytes ({by}); a ring sends 2·(N-1)/N · S = "
                f"{2 * (n - 1) / n * numel * size:.0f} bytes per rank (between {low} and {high} with chunks of "
                f"uneven size). Each step sends one chunk of S/N, in segments"
            )
    if numel >= n * segments:  # every chunk has `segments` non-empty segments
        for rank in range(n):
            sent = checks.sends(run.trace, rank)
            assert len(sent) == 2 * (n - 1) * segments, (
                f"{case}: each of the 2(N-1) = {2 * (n - 1)} steps sends its chunk as segments = {segments} "
                f"messages, {2 * (n - 1) * segments} in all; rank {rank} sent {len(sent)}"
            )
