"""What the labs' graded tests share: running on N ranks against a single process, expecting an
error with a message, comparing with a tolerance.  (Add here only what two or more labs use.)"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from .. import checks, exercise

if TYPE_CHECKING:
    from torch import nn


def run_or_fail(
    target: str | Callable, world_size: int, inputs: Sequence, case: str, hint: str, *, timeout: float = 30.0, **options
) -> exercise.ExerciseRun:
    """``exercise.run(target, world_size, inputs, timeout=timeout, **options)``; a run that does not
    finish in time fails the check with ``"{case} did not finish within {timeout} s: {hint}"`` and the
    ranks' own report of where they waited (a deadlock's, usually), instead of ExerciseTimeout."""
    try:
        return exercise.run(target, world_size, inputs, timeout=timeout, **options)
    except exercise.ExerciseTimeout as e:
        raise AssertionError(f"{case} did not finish within {timeout:g} s: {hint}\n{e}") from None


def rank_raised(error: exercise.ExerciseError, exc_type: str, words: str, *, loose: bool = False) -> bool:
    """Whether a rank itself raised ``exc_type`` (e.g. "ValueError", as an exercise may ask) with ``words``
    in its message, rather than failing otherwise.  ``loose``: the message read in lower case, hyphens as
    spaces ("Power-of-two" says "power of two")."""
    said = error.exc_message or ""
    if loose:
        said = said.lower().replace("-", " ")
    return error.exc_type == exc_type and words in said


DEADLOCK_HINT = (
    "does every isend have a matching irecv on the next rank, and do all ranks make the same collective "
    "calls in the same order?"
)


def expect_divisible_error(target: str | Callable, n: int, *args, case: str, timeout: float = 60.0) -> None:
    """``target`` on n ranks must stop with the student's ValueError saying "divisible", as the exercise asks."""
    try:
        exercise.run(target, n, args, timeout=timeout)
    except exercise.ExerciseError as e:
        if rank_raised(e, "ValueError", "divisible", loose=True):
            return
        got = f"{e.exc_type}: {e.exc_message}" if e.exc_type is not None else str(e)
        raise AssertionError(
            f"{case}: expected your ValueError saying the size is not divisible (the exercise "
            f'asks for the word "divisible"); got {got}'
        ) from None
    raise AssertionError(f"{case}: expected a ValueError (not divisible), but it ran without one")


def describe_calls(events: Sequence) -> str:
    """Calls a rank made, for a message: "isend(peer 1) of 512 B, ..." (or "nothing")."""
    return (
        ", ".join(f"{e.op}{'' if e.peer is None else f'(peer {e.peer})'} of {e.bytes} B" for e in events) or "nothing"
    )


def assert_parameters_match(
    per_rank: Sequence[dict[str, torch.Tensor]],
    reference: nn.Module,
    what: Callable[[int, str], str],
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Every rank's parameters (``per_rank[r]``: name -> tensor, as a driver hands them back) against
    ``reference``'s (a model trained in one process, or built as rank 0 builds it), parameter by
    parameter in ``reference.named_parameters()`` order, with ``checks.assert_close`` (``what(rank,
    name)`` says which; ``rtol``/``atol``: the tolerance, e.g. float32 gradients added in another order)."""
    for rank, params in enumerate(per_rank):
        for name, p in reference.named_parameters():
            checks.assert_close(params[name], p.detach(), what=what(rank, name), rtol=rtol, atol=atol)


_UNSEEN_KEY = secrets.token_bytes(16)  # drawn as this kernel imports the checks: the grader kernel's is its own


def unseen(seed: int) -> int:
    """``seed`` turned into one no student process can know: the same in this kernel (a check makes its data again
    where it compares it), another in every kernel, so no rank can make the other ranks' data, or a result, from
    the seeds it can read in this source; each rank gets its own data only, through its inputs."""
    digest = hashlib.blake2b(seed.to_bytes(8, "little", signed=True), key=_UNSEEN_KEY, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def drawn() -> torch.Generator:
    """A generator seeded now, from the OS's randomness (at grading time, in the grader kernel): what it draws no
    student process has before the grader hands it over (a gate's answer)."""
    return torch.Generator().manual_seed(secrets.randbits(63))


def given(name: str):
    """What the lab's notebook defines as ``name`` in its given, locked cells (a reference run a check
    compares with, a driver the self-check shares with the test), as this kernel ran them: in the grader
    kernel, the release's own cells; in the student's notebook, the student's (what its graded cells use)."""
    import sys

    namespace = vars(sys.modules["__main__"])
    if name not in namespace:
        raise NameError(f"name {name!r} is not defined: run the lab's given cell that defines it (above) first")
    return namespace[name]


@contextlib.contextmanager
def standing_in(graders: dict, spaces: list[dict]) -> Iterator[None]:
    """Within: the grader's functions ``graders`` (name -> function) in the place of the notebook's of
    those names, in every namespace of ``spaces`` (where the notebook's code looks them up, in this
    rank); the notebook's put back after."""
    saved = [{name: space[name] for name in graders if name in space} for space in spaces]
    for space in spaces:
        space.update(graders)
    try:
        yield
    finally:
        for space, old in zip(spaces, saved):
            for name in graders:
                space.pop(name, None)
            space.update(old)


_SAID: set[tuple] = set()  # the stand-in notes already printed in this kernel


def say_standing_in(missing: Sequence[str], then: str) -> None:
    """Print, once per kernel, that the exercises ``missing`` have not passed their graded tests and what the
    test does instead (``then``: "X is graded with the grader's ..."), so the feedback names why a later
    exercise ran on the grader's piece."""
    if not missing or (tuple(missing), then) in _SAID:
        return
    _SAID.add((tuple(missing), then))
    verb = "has not passed its graded test" if len(missing) == 1 else "have not passed their graded tests"
    print(f"({' and '.join(missing)} {verb}: {then})")


def sums(g: torch.Tensor) -> tuple[float, float, float]:
    """A gradient's sum, sum of magnitudes and sum of squares, in float64 (a few numbers to relay and compare, where a
    rank's gradients are tens of MiB: labs 9 and 14)."""
    g = g.detach().double()
    return float(g.sum()), float(g.abs().sum()), float(g.square().sum())
