"""Pipeline schedules as orders, and a simulator that times them: the grader's reference for lab 14.

An *order* holds, for each rank, the list of actions that rank runs, one after another: an ``Action(kind,
stage, microbatch)`` with kind "F" (forward), "B" (full backward), "I" (backward for the input only) or "W"
(backward for the weights only).  Stages are numbered 0 .. p·v − 1 along the model; a *placement* says which
rank holds which stage: "loop" (interleaved, Narayanan et al. 2021 §2.2.2: stage s on rank s % p, as its
chunk s // p) or "v" (ZB-V and DualPipeV, Qi et al. 2024 §6: rank r holds stages r and 2p − 1 − r).

Here, top to bottom: placements; the textbook orders (GPipe; 1F1B, Narayanan et al. 2021 §2.2.1); torch's
own orders, read from ``torch.distributed.pipelining.schedules`` without a process group (the schedules
compute ``pipeline_order`` in their constructor from a few attributes of their stages, so stub stages do);
the check that an order does every piece of work once; the simulator (each action starts when its rank is
free and the actions it needs are done, messages take no time), which gives the makespan and the bubble;
the activations a rank holds; and the textbook bubble formulas the simulator is tested against.

    >>> sim = simulate(one_f_one_b_order(4, 8), p=4, v=1, m=8)    # F = 1, B = 2
    >>> sim.makespan, sim.busy[0], sim.bubble                     # (p − 1)(F + B) idle beside m(F + B)
    (33, 24, 0.375)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import NamedTuple

from torch.distributed.pipelining import schedules as torch_schedules

KINDS = ("F", "B", "I", "W")
PLACEMENTS = ("loop", "v")
DEFAULT_COSTS = {"F": 1, "B": 2, "I": 1, "W": 1}  # a backward is about two forwards; I and W one each

# torch's schedules this module reads, with the placement each assumes
SCHEDULES = {
    "GPipe": "loop",
    "1F1B": "loop",
    "Interleaved1F1B": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}


class Action(NamedTuple):
    """One piece of work of one rank: ``kind`` ("F", "B", "I" or "W") of ``stage`` on micro-batch ``microbatch``."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"  # torch's spelling: "4B0" is stage 4's backward of 0


Order = Sequence[Sequence[Action]]  # order[rank]: that rank's actions, in the order it runs them


# Placements ------------------------------------------------------------------------------------------------


def _check_placement(p: int, v: int, placement: str) -> None:
    if placement == "loop":
        ok = p >= 1 and v >= 1
    elif placement == "v":
        ok = p >= 1 and v == 2
    else:
        raise ValueError(f"placement {placement!r}: valid placements are {PLACEMENTS}")
    if not ok:
        raise ValueError(f"placement {placement!r} with p={p}, v={v}: needs p ≥ 1 and v ≥ 1 (v = 2 for 'v')")


def stage_of(rank: int, chunk: int, p: int, placement: str = "loop") -> int:
    """The stage that ``rank`` holds as its ``chunk``-th (``stage_of(1, 1, 4, "loop") == 5``;
    ``stage_of(1, 1, 4, "v") == 6``: the V comes back down the ranks)."""
    if not (0 <= rank < p and chunk >= 0):
        raise ValueError(f"rank {rank}, chunk {chunk}: needs 0 ≤ rank < p = {p} and chunk ≥ 0")
    if placement == "loop":
        return chunk * p + rank
    elif placement == "v":
        if chunk not in (0, 1):
            raise ValueError(f"chunk {chunk}: the 'v' placement has chunks 0 and 1")
        return rank if chunk == 0 else 2 * p - 1 - rank
    else:
        raise ValueError(f"placement {placement!r}: valid placements are {PLACEMENTS}")


def rank_and_chunk(stage: int, p: int, placement: str = "loop") -> tuple[int, int]:
    """The rank that holds ``stage`` and which of its chunks it is: the inverse of :func:`stage_of`."""
    if stage < 0:
        raise ValueError(f"stage {stage}: stages are numbered from 0")
    if placement == "loop":
        return stage % p, stage // p
    elif placement == "v":
        if stage >= 2 * p:
            raise ValueError(f"stage {stage}: the 'v' placement has stages 0 .. 2p − 1 = {2 * p - 1}")
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    else:
        raise ValueError(f"placement {placement!r}: valid placements are {PLACEMENTS}")


# The textbook orders (one stage per rank) ----------------------------------------------------------------------


def gpipe_order(p: int, m: int) -> list[list[Action]]:
    """GPipe (Huang et al. 2019): every rank runs all m forwards, then all m backwards; rank 0 holds all
    m micro-batches' activations at the turn."""
    return [[Action("F", r, j) for j in range(m)] + [Action("B", r, j) for j in range(m)] for r in range(p)]


def one_f_one_b_order(p: int, m: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush; Narayanan et al. 2021 §2.2.1): rank r runs p − r − 1 warm-up forwards, then
    one forward and one backward in turn, then the backwards left (the cool-down); rank r holds at most
    p − r micro-batches' activations, where GPipe holds m."""
    order = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        actions = [Action("F", r, j) for j in range(warmup)]
        for j in range(warmup, m):
            actions += [Action("F", r, j), Action("B", r, j - warmup)]
        order.append(actions + [Action("B", r, j) for j in range(m - warmup, m)])
    return order


# torch's orders ------------------------------------------------------------------------------------------------


@dataclass
class _StubStage:
    """What torch's schedule constructors read of a ``PipelineStage`` to compute ``pipeline_order``; no model,
    no process group."""

    stage_index: int  # this stage's place in the model
    num_stages: int  # p·v: read by PipelineScheduleSingle/Multi.__init__
    group_rank: int  # the rank holding it: PipelineScheduleMulti.__init__ (self.rank)
    group_size: int  # p: PipelineScheduleMulti.__init__ and the subclasses (self.pp_group_size)
    submod: object = None  # not an nn.Module, so _check_torch_compile_compatibility skips it
    stage_index_to_group_rank: dict = field(default_factory=dict)  # written by PipelineScheduleMulti, never read


_KIND = {
    torch_schedules.FORWARD: "F",
    torch_schedules.FULL_BACKWARD: "B",
    torch_schedules.BACKWARD_INPUT: "I",
    torch_schedules.BACKWARD_WEIGHT: "W",
}


def _computations(action) -> list[Action]:
    """torch's ``_Action`` as ours: None (an idle slot, for torch's own drawings) and REDUCE_GRAD (the
    end-of-step gradient work, FSDP's post-backward, after a stage's last backward) are no pipeline compute; DualPipeV's
    OVERLAP_F_B runs a forward and a backward together (one's compute hides the other's messages), here one
    after the other."""
    if action is None or action.computation_type == torch_schedules.REDUCE_GRAD:
        return []
    if action.computation_type == torch_schedules.OVERLAP_F_B:
        return [a for sub in action.sub_actions for a in _computations(sub)]
    if action.computation_type not in _KIND:
        raise ValueError(f"torch's action {action}: not a computation this module knows ({list(_KIND)})")
    return [Action(_KIND[action.computation_type], action.stage_index, action.microbatch_index)]


def torch_pipeline_order(schedule: str, p: int, v: int, m: int) -> list[list[Action]]:
    """The order torch's ``schedule`` class keeps in ``pipeline_order`` (its schedule IR) for p ranks, v stages
    each and m micro-batches, exactly as torch writes it; built from stub stages of rank 0 (each schedule
    computes every rank's order), without torch.distributed being initialised."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: valid schedules are {list(SCHEDULES)}")
    placement = SCHEDULES[schedule]
    _check_placement(p, v, placement)
    cls = torch_schedules.get_schedule_class(schedule)
    stages = [_StubStage(stage_of(0, c, p, placement), p * v, 0, p) for c in range(v)]
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        if v != 1:
            raise ValueError(f"{schedule} runs one stage per rank: v must be 1, not {v}")
        ir = cls(stages[0], m).pipeline_order
    else:
        ir = cls(stages, m).pipeline_order
    return [[a for action in ir[r] for a in _computations(action)] for r in range(p)]


def torch_order(schedule: str, p: int, v: int, m: int) -> list[list[Action]]:
    """torch's order of ``schedule``: its ``pipeline_order``, but the textbook's for "1F1B".

    Schedule1F1B's ``pipeline_order`` (torch 2.13) is wrong on the last rank: with no warm-up forward there,
    its steady state starts at ``forward_mb + 1`` = 1, so that rank runs F1, B0, F2, B1, ... F{m}: micro-batch
    0's forward never, micro-batch m's (which does not exist) instead.  Schedule1F1B's ``step`` does not
    read it (its own loop is right: p − r forwards before rank r's first backward), torch's schedule
    visualiser (``_schedule_visualizer``) does; :func:`check_order` refuses it."""
    if schedule == "1F1B":
        if v != 1:
            raise ValueError(f"1F1B runs one stage per rank: v must be 1, not {v}")
        return one_f_one_b_order(p, m)
    return torch_pipeline_order(schedule, p, v, m)


# Every piece of work once ------------------------------------------------------------------------------------


def check_order(orders: Order, p: int, v: int, m: int, placement: str = "loop") -> None:
    """Raise ValueError unless each of the p ranks runs, for each of its stages and each micro-batch, one F
    and either one B or one I and one W, and nothing else (no stage of another rank, no micro-batch ≥ m)."""
    _check_placement(p, v, placement)
    if len(orders) != p:
        raise ValueError(f"the order has {len(orders)} ranks' lists, not p = {p}")
    for r, actions in enumerate(orders):
        for a in actions:
            if a.kind not in KINDS or not (0 <= a.stage < p * v and 0 <= a.microbatch < m):
                raise ValueError(
                    f"rank {r}'s action {a!r}: needs kind in {KINDS}, 0 ≤ stage < p·v = {p * v}, "
                    f"0 ≤ micro-batch < m = {m}"
                )
            if rank_and_chunk(a.stage, p, placement)[0] != r:
                holder = rank_and_chunk(a.stage, p, placement)[0]
                raise ValueError(f"rank {r}'s action {a}: stage {a.stage} is on rank {holder} ({placement!r})")
        seen = Counter(actions)
        twice = [str(a) for a, n in seen.items() if n > 1]
        if twice:
            raise ValueError(f"rank {r} runs {', '.join(twice)} more than once")
        for s in (stage_of(r, c, p, placement) for c in range(v)):
            for j in range(m):
                has = {k for k in KINDS if Action(k, s, j) in seen}
                if has not in ({"F", "B"}, {"F", "I", "W"}):
                    raise ValueError(
                        f"rank {r}, stage {s}, micro-batch {j}: runs {sorted(has) or 'nothing'}; "
                        "needs F and B, or F, I and W"
                    )


# The simulator ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Simulated:
    """An order as the simulator ran it: when each action started and ended, and what that adds up to."""

    start: dict[Action, float]  # every action's start (an action names its stage, so its rank)
    end: dict[Action, float]
    makespan: float  # when the last rank finished
    busy: list[float]  # per rank, the time it computed
    bubble: float  # (makespan − max(busy)) / max(busy): idle time beside the busiest rank's work


def _needs(a: Action, last: int, backward_of: Mapping[tuple[int, int], Action]) -> list[Action]:
    """What must be done before ``a`` (its own forward first, so that a deadlock names the nearest cause)."""
    if a.kind == "F":
        return [Action("F", a.stage - 1, a.microbatch)] if a.stage > 0 else []
    elif a.kind in ("B", "I"):  # the gradient of this stage's output comes from the next stage's B or I
        later = [backward_of[a.stage + 1, a.microbatch]] if a.stage < last else []
        return [Action("F", a.stage, a.microbatch), *later]
    elif a.kind == "W":  # the weights' gradient needs the output's gradient, which I received
        return [Action("I", a.stage, a.microbatch)]
    else:
        raise ValueError(f"action {a!r}: kind must be one of {KINDS}")


def _cost_of(costs) -> Callable[[int, Action], float]:
    if costs is None or isinstance(costs, Mapping):
        unknown = set(costs or {}) - set(KINDS)
        if unknown:
            raise ValueError(f"costs for {sorted(unknown)}: kinds are {KINDS}")
        table = {**DEFAULT_COSTS, **(costs or {})}
        return lambda rank, a: table[a.kind]
    elif callable(costs):
        return costs
    else:
        raise ValueError(f"costs {costs!r}: give None, a dict by kind or a function (rank, action) -> time")


def simulate(orders: Order, p: int, v: int, m: int, costs=None, placement: str = "loop") -> Simulated:
    """Time ``orders`` (checked by :func:`check_order` first): each rank runs its actions strictly in its
    list's order, each starting when the rank is free and what it needs is done: F of stage s, micro-batch j
    needs F of stage s − 1, j; B or I of s, j needs F of s, j and the B or I of s + 1, j; W of s, j needs
    I of s, j.  A message between ranks takes no time.  ``costs``: by kind (default F = 1, B = 2, I = W = 1,
    merged under a dict given) or a function ``(rank, action) -> time``.  Raises ValueError where no rank
    can go on (a deadlock), naming each rank's blocked action and what it waits for."""
    check_order(orders, p, v, m, placement)
    cost = _cost_of(costs)
    last = p * v - 1
    backward_of = {(a.stage, a.microbatch): a for actions in orders for a in actions if a.kind in ("B", "I")}
    start, end = {}, {}
    free, busy, next_ = [0] * p, [0] * p, [0] * p
    left = sum(len(actions) for actions in orders)
    while left:
        ran = 0
        for r, actions in enumerate(orders):
            while next_[r] < len(actions):
                a = actions[next_[r]]
                needs = _needs(a, last, backward_of)
                if any(d not in end for d in needs):
                    break
                start[a] = max([free[r], *(end[d] for d in needs)])
                end[a] = free[r] = start[a] + cost(r, a)
                busy[r] += end[a] - start[a]
                next_[r], ran = next_[r] + 1, ran + 1
        if not ran:
            raise ValueError(_deadlock(orders, next_, end, last, backward_of, p, placement))
        left -= ran
    makespan, most = max(free), max(busy)
    return Simulated(start, end, makespan, busy, (makespan - most) / most if most else 0.0)


def _deadlock(orders, next_, end, last, backward_of, p, placement) -> str:
    """Each blocked rank, the action it is stuck at and the first thing that action waits for."""
    heads = {r: actions[next_[r]] for r, actions in enumerate(orders) if next_[r] < len(actions)}
    why = []
    for r, a in heads.items():
        d = next(d for d in _needs(a, last, backward_of) if d not in end)
        q = rank_and_chunk(d.stage, p, placement)[0]
        where = (
            "which comes later in its own order"
            if q == r
            else f"which rank {q} has not run (it is stuck at {heads[q]})"
        )
        why.append(f"rank {r} is stuck at {a}: it waits for {d}, {where}")
    return (
        "deadlock: no rank can run its next action (each runs its list in order; F of stage s needs F of s − 1, "
        "B or I of s needs F of s and B or I of s + 1, W needs I): " + "; ".join(why)
    )


# Memory: activations held ------------------------------------------------------------------------------------


def held(order: Sequence[Action], until: int | None = None, v: int | None = None) -> float:
    """The most activations one rank's ``order`` holds at once, in micro-batches of its whole share of the
    model: a forward of a chunk keeps 1/v of them, its B (or W, after a split backward: I still needs them
    for W) frees them.  ``v``: the rank's chunks, by default the stages its order runs; ``until``: only its
    first ``until`` actions.  1F1B on rank 0: p; GPipe: m; torch's interleaved 1F1B: p + (p − 1)/v."""
    chunk = Fraction(1, v or len({a.stage for a in order}))
    now = most = Fraction(0)
    for a in list(order)[:until]:
        if a.kind == "F":
            now += chunk
        elif a.kind in ("B", "W"):
            now -= chunk
        elif a.kind != "I":
            raise ValueError(f"action {a!r}: kind must be one of {KINDS}")
        most = max(most, now)
    return float(most)


# The textbook bubbles ------------------------------------------------------------------------------------------


def bubble_formula(schedule: str, p: int, v: int, m: int) -> Fraction:
    """The bubble fraction (idle time over compute time) that Narayanan et al. 2021 give: (p − 1)/m for GPipe
    and 1F1B (§2.2.1), (p − 1)/(v·m) for interleaved 1F1B with v chunks per rank (§2.2.2, m a multiple of p).
    The zero-bubble schedules have none in closed form here: simulate their order."""
    if schedule in ("GPipe", "1F1B"):
        if v != 1:
            raise ValueError(f"{schedule} runs one stage per rank: v must be 1, not {v}")
        return Fraction(p - 1, m)
    elif schedule == "Interleaved1F1B":
        return Fraction(p - 1, v * m)
    else:
        raise ValueError(
            f"schedule {schedule!r}: formulas for 'GPipe', '1F1B' and 'Interleaved1F1B'; "
            "for a zero-bubble schedule, simulate(torch_order(...))"
        )
