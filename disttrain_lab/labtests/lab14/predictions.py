"""Lab 14's graded predictions: a schedule's bubble, and the activations a rank holds at its peak, each written
down before the notebook simulates it.

As every prediction of the kit (``disttrain_lab.predictions``): the graded cell reads the student's number from
the student's kernel as data (``dl.predictions.fetch("PREDICTED_BUBBLE")``) and hands it to a check here, which
computes the answer itself from torch's own order (``orders.torch_order``) and this lab's simulator; no answer
lives in this package or in the notebook.  A wrong prediction's message says the value seen and how the
quantity is defined, never the answer.  The notebook's self-check is the kit's (``dl.predictions.check``: the
form only), and the comparison is the kit's too: equal to three significant figures (``predictions.rounded``).

    >>> check_bubble_prediction(0.125, "Interleaved1F1B", p=4, v=2, m=12)     # passes: torch's order, F=1, B=2
"""

from __future__ import annotations

from ...predictions import SIG, PredictionError, as_number, rounded
from .orders import SCHEDULES, held, simulate, torch_order

_BUBBLE = (
    "the bubble is the time the step's ranks stand idle beside the busiest rank's work, as a fraction of that "
    "work: (makespan − busiest rank's compute) / busiest rank's compute, with F = 1 and B = 2 (F = I = W = 1 "
    "for a split backward), messages taking no time"
)
_HELD = (
    "the activations a rank holds at its peak are counted in micro-batches of its whole share of the model: "
    "each forward of one of its v chunks keeps 1/v of one, its B (or W, after I) frees them"
)


def _order(schedule: str, p: int, v: int, m: int):
    """torch's order (a case torch refuses is the grader's mistake: ValueError, torch's message)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: valid schedules are {list(SCHEDULES)}")
    return torch_order(schedule, p, v, m)


def check_bubble_prediction(predicted, schedule: str, p: int, v: int, m: int) -> None:
    """The graded prediction of ``schedule``'s bubble on p ranks, v stages each, m micro-batches: to three
    significant figures, the simulated bubble of torch's order (``orders.simulate(...).bubble``; F = 1, B = 2,
    or F = I = W = 1 where the schedule splits its backward).  ``predicted``: the student's number, as
    ``dl.predictions.fetch`` gives it."""
    what = f"your prediction of the bubble of {schedule} (p = {p}, v = {v}, m = {m})"
    got = as_number(predicted, what)
    # orders.DEFAULT_COSTS: F = 1, B = 2, I = W = 1
    want = simulate(_order(schedule, p, v, m), p, v, m, placement=SCHEDULES[schedule]).bubble
    if rounded(got) != rounded(want):
        raise PredictionError(
            f"{what} is {got:g}, which is not the simulated schedule's to {SIG} significant figures: {_BUBBLE}.  "
            "Draw the schedule's first ranks (or run the simulator cell below) and count"
        )


def check_held_prediction(predicted, schedule: str, p: int, v: int, m: int, rank: int = 0) -> None:
    """The graded prediction of the activations ``rank`` holds at its peak under ``schedule`` (torch's order),
    in micro-batches of its whole share of the model (``orders.held``), to three significant figures."""
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank}: needs 0 ≤ rank < p = {p}")
    what = (
        f"your prediction of the activations rank {rank} holds at its peak under {schedule} (p = {p}, v = {v}, m = {m})"
    )
    got = as_number(predicted, what)
    want = held(_order(schedule, p, v, m)[rank], v=v)
    if rounded(got) != rounded(want):
        raise PredictionError(
            f"{what} is {got:g}, which is not what rank {rank}'s order holds to {SIG} significant figures: {_HELD}.  "
            f"Walk rank {rank}'s actions in order and keep the running count"
        )
