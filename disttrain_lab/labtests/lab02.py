"""Lab 2's graded tests (all-reduce): each check runs the student's all-reduce (or one of its halves)
on ranks with ``dl.exercise.run``, compares every rank's tensor with the sum of every rank's data
computed in one process (what ``dist.all_reduce`` gives), and reads what the algorithm sent from
the operating system: the bytes on each connection, which under gloo's protocol fix how many
messages crossed and how big they were (``checks.assert_messages``), and what each message held,
from the grader's capture of the wire: a ring's partial sums, each the sum of the ranks it has
passed (``carried.assert_sums_carried``), an all-gather's chunks whole (``carried.assert_carried``).
The number of
steps comes from the grader's gate (``rounds_gate``): every rank held at each of its receives, each
step's message must have crossed by then.  That only send/recv were
called is the wire's too (``checks.assert_point_to_point``: gloo's collectives mark their messages'
slots).  The
predictions' cost model stays in the notebook's hidden tests."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import carried, checks, exercise, wire
from ..exercise import ExerciseRun
from . import common, rounds_gate

__all__ = [
    "GRADED_PASSED",
    "direct_all_gather",
    "direct_reduce_scatter",
    "check_halving_doubling_all_reduce",
    "check_halving_doubling_not_a_power_of_two",
    "check_naive_all_reduce",
    "check_pipelined_ring_all_reduce",
    "check_ring_all_gather",
    "check_ring_all_reduce",
    "check_ring_reduce_scatter",
]

_DEADLOCK = "a deadlock, or a rank waiting for a message nobody sends?"
GRADED_PASSED: set[str] = set()  # the exercises whose graded cell passed (ring_all_reduce is built on two of them)
HALVES = ("ring_reduce_scatter", "ring_all_gather")
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


def _ring(rank: int, step: int, n: int) -> frozenset[int]:
    """The ranks whose data a ring's partial sum holds when ``rank`` sends it at ``step`` of the
    reduce-scatter: its own and the ``step`` ranks before it (a chunk moves one rank right per step)."""
    return frozenset((rank - j) % n for j in range(step + 1))


def _cosets(rank: int, n: int, partner: int) -> list[frozenset[int]]:
    """The ranks whose data a halving message to ``partner`` can hold: ``rank``'s group over the distances
    exchanged before (any order of them), never the partner's."""
    distances = [d for d in (2**k for k in range(int(math.log2(n)))) if d != rank ^ partner]
    groups = []
    for mask in range(2 ** len(distances)):
        group = {rank}
        for k, d in enumerate(distances):
            if mask >> k & 1:
                group |= {g ^ d for g in group}
        groups.append(frozenset(group))
    return groups


def _flats(n: int, shape: tuple, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each rank's data as one flat tensor, in x's logical order (``_all_reduce_inputs``)."""
    return [checks.sample_tensor(shape, dtype, seed=rank).reshape(-1) for rank in range(n)]


def _check_all_reduce(
    name: str,
    n: int,
    shape: tuple,
    dtype: torch.dtype = torch.float32,
    contiguous: bool = True,
    replace: tuple = (),
    rounds: int = 0,
) -> tuple[str, ExerciseRun | None]:
    """Run the notebook's ``name`` on n ranks and compare with the sum of every rank's data (what
    dist.all_reduce gives), in place and returned; only point-to-point calls.  ``replace``: the halves
    of the ring that the grader's stand-ins replace (``_ring_all_reduce_standing_in``).  ``rounds``: under
    grading, the grader holds every rank at each of its first ``rounds`` receives (``rounds_gate``).
    Returns (case, the run), or (case, None) if it refused a non-contiguous input with a clear error."""
    case = f"{name} on {n} ranks ({_dtype(dtype)}, shape {shape}" + (")" if contiguous else ", non-contiguous)")
    if replace:
        case = case[:-1] + f", with the grader's stand-in for {' and '.join(replace)})"
    data, xs = _all_reduce_inputs(n, shape, dtype, contiguous)
    try:
        if replace:
            run = common.run_or_fail(
                _ring_all_reduce_standing_in,
                n,
                [(x, list(replace)) for x in xs],
                case,
                _DEADLOCK,
                timeout=30,
                content=True,
            )
        else:
            run = _run_held(name, n, [(x,) for x in xs], case, _DEADLOCK, rounds)
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
    checks.assert_point_to_point(run, name)
    return case, run


def _run_held(name: str, n: int, inputs: list[tuple], case: str, hint: str, rounds: int) -> ExerciseRun:
    """The notebook's ``name`` on n ranks (``inputs``: each rank's arguments), its contents captured; with
    ``rounds``, under grading every rank held at each of its first ``rounds`` receives (``_held_at_receives``)."""
    if not rounds:
        return common.run_or_fail(name, n, inputs, case, hint, timeout=30, content=True)
    held = [(args[0], name, rounds, *args[1:]) for args in inputs]
    gate = [[None] * n for _ in range(rounds)]
    return common.run_or_fail(_held_at_receives, n, held, case, hint, timeout=30, content=True, gate=gate)


def _held_at_receives(x, name, rounds, *rest):
    """Driver (runs in your kernel): your ``name(x, *rest)`` on this rank; under grading the grader holds
    it at each of its first ``rounds`` receives (``rounds_gate``), and in your own notebook nothing changes."""
    from disttrain_lab.labtests.rounds_gate import held_at_receives

    # (each named where it is called: the ranks get the names a driver's code mentions, not the whole notebook)
    if name == "ring_reduce_scatter":
        fn = ring_reduce_scatter  # noqa: F821  (the notebook's)
    elif name == "ring_all_gather":
        fn = ring_all_gather  # noqa: F821
    elif name == "ring_all_reduce":
        fn = ring_all_reduce  # noqa: F821
    else:
        fn = halving_doubling_all_reduce  # noqa: F821
    with held_at_receives(fn.__globals__, rounds):
        return fn(x, *rest)


def _steps(run: ExerciseRun, case: str, rounds: int, why: str) -> None:
    """The algorithm's steps: from the grader's gate under grading (``rounds_gate.assert_rounds``), from the
    ranks' trace in the student's own notebook (where it counts them from the calls' times)."""
    if rounds_gate.assert_rounds(run, case, rounds, why):
        return
    took = run.trace.rounds()
    assert took == rounds, f"{case}: {why} takes {rounds} steps, this took {took}.  {_TWO_ROUNDS}"


def _chunks(n: int, numel: int, dtype: torch.dtype) -> list[int]:
    """The bytes of each of the N chunks ``flat.tensor_split(N)`` makes of ``numel`` elements."""
    return [len(c) * _element_size(dtype) for c in torch.empty(numel).tensor_split(n)]


def check_naive_all_reduce(n: int, shape: tuple, dtype: torch.dtype = torch.float32, contiguous: bool = True) -> None:
    """``naive_all_reduce(x)`` (exercise 1): every rank's ``x`` holds the sum, in place, and is returned
    (any shape and dtype; a non-contiguous ``x`` summed too, or refused with a ValueError that says
    "contiguous"); only send/recv; every other rank sends ``x`` to rank 0 in one message and receives
    the sum back in one, and no one else talks (the operating system's count of each connection)."""
    case, run = _check_all_reduce("naive_all_reduce", n, shape, dtype, contiguous)
    if run is None:
        return
    size = math.prod(shape) * _element_size(dtype)
    checks.assert_messages(
        run,
        {**{(r, 0): (1, size) for r in range(1, n)}, **{(0, r): (1, size) for r in range(1, n)}},
        case,
        "Rank 0 receives each other rank's whole tensor once and sends each the sum once; the others talk only "
        "to rank 0.",
    )
    if contiguous:  # (a non-contiguous x's bytes may cross in its memory's order or in its own)
        flats, everyone = _flats(n, shape, dtype), frozenset(range(n))
        carried.assert_carried(run, {(r, 0): [flats[r]] for r in range(1, n)}, case)
        carried.assert_sums_carried(run, flats, {(0, r): [[everyone]] for r in range(1, n)}, case)


def check_ring_reduce_scatter(n: int, numel: int, dtype: torch.dtype = torch.float32) -> None:
    """``ring_reduce_scatter(flat)`` (exercise 2): rank r returns chunk r of ``flat.tensor_split(N)``,
    summed over all ranks; only send/recv; N-1 messages to the right neighbour, one chunk each (every
    chunk but its own: (N-1)/N of the data), and nothing to anyone else (the operating system's count,
    when every chunk has an element); N-1 steps."""
    case = f"ring_reduce_scatter on {n} ranks ({numel} x {_dtype(dtype)})"
    flats = [checks.sample_tensor(numel, dtype, seed=rank) for rank in range(n)]
    rounds = n - 1 if numel >= n else 0  # (empty chunks: a rank may skip their messages)
    run = _run_held("ring_reduce_scatter", n, [(f.clone(),) for f in flats], case, "a deadlock?", rounds)
    total = torch.stack(flats).sum(dim=0).to(dtype)  # what dist.all_reduce gives, in one process
    for rank, out in enumerate(run.results):
        checks.assert_close(
            out, total.tensor_split(n)[rank], what=f"{case}: the chunk rank {rank} returned (chunk {rank}, summed)"
        )
    checks.assert_point_to_point(run, "ring_reduce_scatter")
    if numel >= n:
        chunks = _chunks(n, numel, dtype)
        checks.assert_messages(
            run,
            {(r, (r + 1) % n): (n - 1, sum(chunks) - chunks[r]) for r in range(n)},
            case,
            "In each of the N-1 steps a rank sends one chunk (S/N, not the whole tensor) to its right neighbour "
            "only: every chunk but its own.",
        )
        # step s: rank r passes on the chunk it has just added its own to, the sum of ranks r-s, ..., r
        ring = {(r, (r + 1) % n): [[_ring(r, s, n)] for s in range(n - 1)] for r in range(n)}
        carried.assert_sums_carried(run, flats, ring, case)
        _steps(
            run,
            case,
            n - 1,
            "reduce-scatter on a ring: N-1 steps, one chunk out and one in per step, on every rank at once",
        )


def _piece(rank: int, n: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return checks.sample_tensor(numel, dtype, seed=rank).tensor_split(n)[rank]


def check_ring_all_gather(n: int, numel: int, dtype: torch.dtype = torch.float32) -> None:
    """``ring_all_gather(flat)`` (exercise 3): from chunk r of rank r's ``flat``, every rank's ``flat``
    ends up (in place, and returned) holding every rank's chunk in place; only send/recv; N-1 messages
    to the right neighbour, one chunk each (every chunk but the one its right neighbour owns: (N-1)/N
    of the data), and nothing to anyone else (the operating system's count, when every chunk has an
    element); each message carries its chunk's own values (the grader's capture); N-1 steps."""
    case = f"ring_all_gather on {n} ranks ({numel} x {_dtype(dtype)})"
    flats = []
    for rank in range(n):
        flat = torch.full((numel,), -7, dtype=dtype)
        flat.tensor_split(n)[rank].copy_(_piece(rank, n, numel, dtype))
        flats.append((flat,))
    rounds = n - 1 if numel >= n else 0  # (empty chunks: a rank may skip their messages)
    run = _run_held("ring_all_gather", n, flats, case, "a deadlock?", rounds)
    expected = torch.cat([_piece(r, n, numel, dtype) for r in range(n)])  # in one process
    for rank, out in enumerate(run.results):
        checks.assert_close(run.inputs_after[rank][0], expected, what=f"{case}: rank {rank}'s flat after the call")
        checks.assert_close(out, expected, what=f"{case}: the tensor rank {rank} returned")
    checks.assert_point_to_point(run, "ring_all_gather")
    if numel >= n:
        chunks = _chunks(n, numel, dtype)
        checks.assert_messages(
            run,
            {(r, (r + 1) % n): (n - 1, sum(chunks) - chunks[(r + 1) % n]) for r in range(n)},
            case,
            "In each of the N-1 steps a rank passes one chunk (S/N) to its right neighbour only: its own first, "
            "then the one it has just received.",
        )
        # step s: rank r passes chunk r - s (its own first, then each one it has just received)
        pieces = [_piece(r, n, numel, dtype) for r in range(n)]
        carried.assert_carried(
            run, {(r, (r + 1) % n): [pieces[(r - s) % n] for s in range(n - 1)] for r in range(n)}, case
        )
        _steps(run, case, n - 1, "all-gather on a ring: N-1 steps, one chunk out and one in per step")


def direct_reduce_scatter(flat: torch.Tensor) -> torch.Tensor:
    """The grader's stand-in for ``ring_reduce_scatter`` (public: a driver imports it in the ranks):
    the same result, chunk ``rank`` of ``flat`` summed over all ranks and returned, but **not a ring**:
    each rank sends chunk c straight to rank c.  ``ring_all_reduce`` is graded on it where the
    student's reduce-scatter did not pass its graded test; handed in as ``ring_reduce_scatter`` it
    fails that test (messages to ranks other than the right neighbour)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = flat.tensor_split(n)
    incoming = {peer: torch.empty_like(chunks[rank]) for peer in range(n) if peer != rank}
    if chunks[rank].numel():
        requests = [dist.irecv(buffer, src=peer) for peer, buffer in incoming.items()]
    else:
        requests = []
    requests += [dist.isend(chunks[peer], dst=peer) for peer in range(n) if peer != rank and chunks[peer].numel()]
    for request in requests:
        request.wait()
    for buffer in incoming.values():
        chunks[rank].add_(buffer)
    return chunks[rank]


def direct_all_gather(flat: torch.Tensor) -> torch.Tensor:
    """The grader's stand-in for ``ring_all_gather`` (as ``direct_reduce_scatter``): every rank sends
    its chunk straight to every other rank; not a ring."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = flat.tensor_split(n)
    requests = [dist.irecv(chunks[peer], src=peer) for peer in range(n) if peer != rank and chunks[peer].numel()]
    if chunks[rank].numel():
        requests += [dist.isend(chunks[rank], dst=peer) for peer in range(n) if peer != rank]
    for request in requests:
        request.wait()
    return flat


def _ring_all_reduce_standing_in(x, replace):
    """Driver (runs in your kernel): your ring_all_reduce, with the grader's stand-ins
    (``direct_reduce_scatter``, ``direct_all_gather``) in the place of the halves named in ``replace``."""
    from disttrain_lab.labtests.common import standing_in
    from disttrain_lab.labtests.lab02 import direct_all_gather, direct_reduce_scatter

    graders = {"ring_reduce_scatter": direct_reduce_scatter, "ring_all_gather": direct_all_gather}
    with standing_in({name: graders[name] for name in replace}, [ring_all_reduce.__globals__]):  # noqa: F821
        return ring_all_reduce(x)  # noqa: F821  (the notebook's)


def _stand_in_messages(n: int, numel: int, dtype: torch.dtype, replace: tuple) -> dict:
    """ring_all_reduce's messages where the stand-ins replace the halves in ``replace``: a replaced
    reduce-scatter sends chunk c from every rank to rank c, a replaced all-gather rank r's chunk to every
    rank; a half that passed its graded test sends every chunk but one to the right neighbour."""
    chunks = _chunks(n, numel, dtype)
    messages: dict[tuple[int, int], list[int]] = {}
    for r in range(n):
        right = (r + 1) % n
        # (half, the chunk the stand-in sends each rank s: None for chunk s itself, the chunk the ring keeps back)
        for half, sent, kept in (("ring_reduce_scatter", None, r), ("ring_all_gather", r, right)):
            if half in replace:
                sends = [(s, 1, chunks[s if sent is None else sent]) for s in range(n) if s != r]
            else:
                sends = [(right, n - 1, sum(chunks) - chunks[kept])]
            for dst, count, payload in sends:
                total = messages.setdefault((r, dst), [0, 0])
                total[0], total[1] = total[0] + count, total[1] + payload
    return {pair: tuple(v) for pair, v in messages.items()}


def _ring_all_reduce_messages(n: int, numel: int, dtype: torch.dtype, per_step: int = 1) -> dict:
    """A ring all-reduce's messages: 2(N-1) steps of one chunk each (``per_step`` messages per step), every
    rank to its right neighbour only; which two chunks a rank does not send depends on where the
    reduce-scatter leaves each rank's chunk, so the payload is a range."""
    chunks = _chunks(n, numel, dtype)
    least, most = 2 * (sum(chunks) - max(chunks)), 2 * (sum(chunks) - min(chunks))
    return {(rank, (rank + 1) % n): (2 * (n - 1) * per_step, least, most) for rank in range(n)}


def check_ring_all_reduce(n: int, shape: tuple, dtype: torch.dtype = torch.float32, contiguous: bool = True) -> None:
    """``ring_all_reduce(x)`` (exercise 4): the sum, in place and returned, as ``naive_all_reduce``'s;
    only send/recv; 2(N-1) messages to the right neighbour, one chunk each (2(N-1)/N of the data), and
    nothing to anyone else (the operating system's count, when every chunk has an element), in 2(N-1)
    steps.  Where ring_reduce_scatter or ring_all_gather has not passed its graded test (``GRADED_PASSED``),
    the grader's stand-in replaces it (``direct_reduce_scatter``, ``direct_all_gather``: not rings), and
    the messages are those the two halves make."""
    replace = tuple(half for half in HALVES if half not in GRADED_PASSED)
    common.say_standing_in(
        replace,
        "ring_all_reduce is graded on the grader's stand-in, which sends each chunk straight to its rank, so that "
        "a mistake there does not cost this exercise too",
    )
    numel = math.prod(shape)
    case, run = _check_all_reduce(
        "ring_all_reduce", n, shape, dtype, contiguous, replace, rounds=2 * (n - 1) if numel >= n else 0
    )
    if run is None or numel < n:
        return  # empty chunks: steps and bytes are not compared
    if replace:  # the stand-ins' messages, and those of the half that passed: ring_all_reduce calls both
        checks.assert_messages(
            run,
            _stand_in_messages(n, numel, dtype, replace),
            case,
            "ring_all_reduce calls ring_reduce_scatter, then ring_all_gather, on x's data as one flat tensor.",
        )
        return
    checks.assert_messages(
        run,
        _ring_all_reduce_messages(n, numel, dtype),
        case,
        "Each of the 2(N-1) steps sends one chunk of S/N, not the whole tensor, to the right neighbour only.",
    )
    if contiguous:  # the reduce-scatter's partial sums (the ranks passed so far), then the all-gather's totals
        everyone = frozenset(range(n))
        sums = [[[_ring(r, s, n)] for s in range(n - 1)] + [[everyone]] * (n - 1) for r in range(n)]
        carried.assert_sums_carried(run, _flats(n, shape, dtype), {(r, (r + 1) % n): sums[r] for r in range(n)}, case)
    _steps(run, case, 2 * (n - 1), "a ring all-reduce: 2(N-1) steps, N-1 of reduce-scatter, N-1 of all-gather")


def check_halving_doubling_all_reduce(
    n: int, shape: tuple, dtype: torch.dtype = torch.float32, contiguous: bool = True
) -> None:
    """``halving_doubling_all_reduce(x)`` (exercise 5), N a power of two: the sum, in place and
    returned; only send/recv; 2(N-1)/N of the data sent per rank, in 2·log2(N) rounds, each an
    exchange of one message with the partner whose rank differs in one bit (rank XOR distance): with
    the partner at distance d, one message of d chunks while halving and one while doubling, and
    nothing with anyone else (the operating system's count, when every chunk has an element)."""
    numel = math.prod(shape)
    best = 2 * int(math.log2(n))
    case, run = _check_all_reduce(
        "halving_doubling_all_reduce", n, shape, dtype, contiguous, rounds=best if numel >= n else 0
    )
    if run is None or numel < n:
        return
    chunks = _chunks(n, numel, dtype)
    checks.assert_messages(
        run,
        {
            (rank, rank ^ d): (2, 2 * d * min(chunks), 2 * d * max(chunks))
            for rank in range(n)
            for d in (2**k for k in range(int(math.log2(n))))
        },
        case,
        "Exchange with the partner rank XOR d, for d = N/2, ..., 1 and back: half of your current part (S/2, "
        "then S/4, ...) while halving, your whole part while doubling, one message each, and nothing else.",
    )
    if contiguous:  # halving: a sum over the group exchanged with so far; doubling: the total
        everyone = frozenset(range(n))
        partners = [(rank, rank ^ d) for rank in range(n) for d in (2**k for k in range(int(math.log2(n))))]
        sums = {(a, b): [_cosets(a, n, b), [everyone]] for a, b in partners}
        carried.assert_sums_carried(run, _flats(n, shape, dtype), sums, case)
    _steps(
        run,
        case,
        best,
        f"recursive halving then doubling: 2·log2({n}) = {best} rounds, one exchange with one partner per round "
        f"(distances N/2, ..., 1, then 1, ..., N/2)",
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
        content=True,
    )
    expected = torch.stack(data).sum(dim=0).to(dtype)  # what dist.all_reduce gives, in one process
    for rank in range(n):
        checks.assert_close(
            run.inputs_after[rank][0],
            expected,
            what=f"{case}: rank {rank}'s x after the call (all-reduce works in place)",
        )
        checks.assert_close(run.results[rank], expected, what=f"{case}: the tensor rank {rank} returned")
    checks.assert_point_to_point(run, "pipelined_ring_all_reduce")
    numel = math.prod(shape)
    if numel >= n * segments:  # every chunk has `segments` non-empty segments
        checks.assert_messages(
            run,
            _ring_all_reduce_messages(n, numel, dtype, per_step=segments),
            case,
            f"Each of the 2(N-1) steps sends its chunk of S/N to the right neighbour only, as segments = {segments} "
            f"messages.",
        )
        if contiguous:  # each segment a piece of a partial sum of the ranks passed so far, or of the total
            sums = [[_ring(r, s, n) for s in range(n - 1)] + [frozenset(range(n))] for r in range(n)]
            per_rank = 2 * (n - 1) * segments  # (a step's segments may cross before the step before has ended)
            expected = {(r, (r + 1) % n): [sums[r]] * per_rank for r in range(n)}
            carried.assert_sums_carried(run, _flats(n, shape, dtype), expected, case)
    else:  # empty segments: a rank may send them or not, so the messages' number is a range
        chunks = _chunks(n, numel, dtype)
        least, most = 2 * (sum(chunks) - max(chunks)), 2 * (sum(chunks) - min(chunks))
        messages = 2 * (n - 1) * segments  # at most: every segment, empty ones too
        for rank in range(n):
            right, left = (rank + 1) % n, (rank - 1) % n
            others = {peer: run.traffic.between(rank, peer) for peer in range(n) if peer not in (rank, right, left)}
            notes = run.traffic.between(rank, left) if left != right else 0  # its receives' notes, to its left
            quiet = all(b <= wire.HANDSHAKE_BYTES for b in others.values())
            assert quiet and notes <= wire.GLOO_PREAMBLE * messages + wire.HANDSHAKE_BYTES, (
                f"{case}: in a ring, rank {rank} sends only to its right neighbour {right} (and gloo's 48-byte "
                f"notes of its receives to its left neighbour {left}); the operating system counted "
                f"{run.traffic.describe()}"
            )
            sent = run.traffic.between(rank, right)
            high = most + 3 * wire.GLOO_PREAMBLE * messages + wire.HANDSHAKE_BYTES
            assert least <= sent <= high, (
                f"{case}: rank {rank} sent its right neighbour {sent:,} bytes (the operating system counted); a "
                f"ring sends 2·(N-1)/N of the data, {least:,}…{most:,} bytes per rank, and gloo's 96 bytes with "
                f"each of at most {messages} messages. Each step sends one chunk of S/N, in segments"
            )
