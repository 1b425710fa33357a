"""What every check of lab 2 shares: its constants, the data a case runs on and the bytes it makes, running
the notebook's all-reduce (or one of its halves) on ranks and comparing it with the sum in one process, and
the steps it took."""

from __future__ import annotations

import torch

from ... import checks, exercise
from ...exercise import ExerciseRun
from .. import common, rounds_gate
from .ranks import _held_at_receives, _ring_all_reduce_standing_in

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
    data = [checks.sample_tensor(shape, dtype, seed=common.unseen(rank)) for rank in range(n)]
    xs = [d.clone() if contiguous else torch.empty(shape[::-1], dtype=dtype).t().copy_(d) for d in data]
    return data, xs


def _ring(rank: int, step: int, n: int) -> frozenset[int]:
    """The ranks whose data a ring's partial sum holds when ``rank`` sends it at ``step`` of the
    reduce-scatter: its own and the ``step`` ranks before it (a chunk moves one rank right per step)."""
    return frozenset((rank - j) % n for j in range(step + 1))


def _flats(n: int, shape: tuple, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each rank's data as one flat tensor, in x's logical order (``_all_reduce_inputs``)."""
    return [checks.sample_tensor(shape, dtype, seed=common.unseen(rank)).reshape(-1) for rank in range(n)]


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
    check_summed_in_place(run, data, case, name)
    return case, run


def check_summed_in_place(run: ExerciseRun, data: list[torch.Tensor], case: str, name: str) -> None:
    """Every rank's x after the call and the tensor it returned are the sum of ``data`` (the ranks' inputs, summed
    by the grader in any order: an all-reduce works in place), and the ranks talked by send/recv alone."""
    for rank in range(run.world_size):
        checks.assert_sum_close(
            run.inputs_after[rank][0],
            data,
            what=f"{case}: rank {rank}'s x after the call (all-reduce works in place)",
        )
        checks.assert_sum_close(run.results[rank], data, what=f"{case}: the tensor rank {rank} returned")
    checks.assert_point_to_point(run, name)


def _run_held(name: str, n: int, inputs: list[tuple], case: str, hint: str, rounds: int) -> ExerciseRun:
    """The notebook's ``name`` on n ranks (``inputs``: each rank's arguments), its contents captured; with
    ``rounds``, under grading every rank held at each of its first ``rounds`` receives (``_held_at_receives``)."""
    if not rounds:
        return common.run_or_fail(name, n, inputs, case, hint, timeout=30, content=True)
    held = [(args[0], name, rounds, *args[1:]) for args in inputs]
    gate = [[None] * n for _ in range(rounds)]
    return common.run_or_fail(_held_at_receives, n, held, case, hint, timeout=30, content=True, gate=gate)


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


def _ring_all_reduce_messages(n: int, numel: int, dtype: torch.dtype, per_step: int = 1) -> dict:
    """A ring all-reduce's messages: 2(N-1) steps of one chunk each (``per_step`` messages per step), every
    rank to its right neighbour only; which two chunks a rank does not send depends on where the
    reduce-scatter leaves each rank's chunk, so the payload is a range."""
    chunks = _chunks(n, numel, dtype)
    least, most = 2 * (sum(chunks) - max(chunks)), 2 * (sum(chunks) - min(chunks))
    return {(rank, (rank + 1) % n): (2 * (n - 1) * per_step, least, most) for rank in range(n)}
