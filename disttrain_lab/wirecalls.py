"""The collective calls a run's process groups made, as the grader's capture of the wire shows them.

A process group opens connections of its own between its ranks, and torch counts its calls' tags per group:
each message's connection (``wiretimeline.Timeline.links``) and slot (its call) say which call of which group it
belongs to (``carried.sends_by_connection``).  One call is one slot among a group's ranks; gloo's ring sends
each call's messages to one neighbour, so each rank sends in each call on one connection (measured: groups of
2 and 4).  An all-reduce of B bytes on t ranks puts 2·(t − 1)·B bytes of payload on the wire
(``carried.all_reduce_sizes``).  The calls are counted and ordered within their group (the slots count up), not
placed in time: a direction of several connections is not one stream.

Each function reads a run of ``dl.exercise.run(..., content=True)`` under grading; in the student's own kernel
there is no capture (``observed(run)`` is False) and a check reads the ranks' trace instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import carried

__all__ = [
    "observed",
    "data_sends",
    "group_calls",
    "call_payloads",
    "assert_all_reduces_carried",
    "assert_gathered_carried",
    "assert_stays_in",
    "assert_group_calls",
    "describe",
]

# kinds that are not a group's collective calls: the drivers' barriers (phase marks, no data) and point-to-point
# messages (their slot is the caller's tag, 0: not one call each)
NOT_CALLS = ("barrier", "send/recv")


def observed(run) -> bool:
    """Whether the grader captured the run's wire (grading); in the student's own kernel it did not."""
    return run.timeline.source != "trace"


def data_sends(run, case: str) -> list[tuple[int, int, str, int, bytes]]:
    """Every message of the run but the barriers (the drivers' phase marks carry no data), from the grader's
    capture: (sender, receiver, its connection, its slot, its payload)."""
    return [s for s in carried.sends_by_connection(run, case) or [] if carried.kind(s[3]) != "barrier"]


def group_calls(run, group: Sequence[int], case: str) -> tuple[dict[int, int], list[tuple[str, int]]]:
    """The collective calls the ranks of ``group`` made among themselves: (rank -> how many calls it sent messages
    in, each call's kind and its tensor's bytes in the order the group made them; another kind than an all-reduce
    gives its messages' payload)."""
    per_rank: dict[int, set] = {rank: set() for rank in group}
    totals: dict[int, int] = {}
    for src, dst, link, slot, payload in data_sends(run, case):
        if src in per_rank and dst in per_rank and carried.kind(slot) not in NOT_CALLS:
            per_rank[src].add((link, slot))
            totals[slot] = totals.get(slot, 0) + len(payload)
    made = sorted(totals.items(), key=lambda call: call[0] & carried.CALL_BITS)
    sizes = iter(carried.all_reduce_sizes(made, len(group), case))
    found = [(carried.kind(slot), next(sizes) if carried.kind(slot) == "all_reduce" else total) for slot, total in made]
    return {rank: len(sent) for rank, sent in per_rank.items()}, found


def call_payloads(run, group: Sequence[int], case: str) -> list[tuple[str, dict[int, list[bytes]]]]:
    """What each collective call the ranks of ``group`` made among themselves carried, in the order the group made
    them (as ``group_calls``): its kind, and each rank's payloads in it, in the order they crossed."""
    members = set(group)
    calls: dict[int, dict[int, list[bytes]]] = {}
    for src, dst, _, slot, payload in data_sends(run, case):
        if src in members and dst in members and carried.kind(slot) not in NOT_CALLS:
            calls.setdefault(slot, {}).setdefault(src, []).append(payload)
    return [(carried.kind(slot), calls[slot]) for slot in sorted(calls, key=lambda slot: slot & carried.CALL_BITS)]


def assert_all_reduces_carried(run, group: Sequence[int], inputs: Sequence, whats: Sequence[str], case: str) -> None:
    """The all-reduces the ranks of ``group`` made among themselves (in order, as ``group_calls`` found them) carried
    their data: call i's messages hold pieces of sums of ``inputs[i](rank)`` (what that rank's input may be: a
    list of alternatives) over sets of the group's ranks (``carried.assert_reduced_carried``); ``whats[i]`` names
    the call.  A call that is an all-gather instead (the grader's stand-ins sum that way) carried each rank's input
    whole among what that rank sent in it (a ring sends its own piece first: ``assert_gathered_carried``).  A group
    of one rank sends nothing; in the student's own kernel there is no capture."""
    if len(group) == 1 or not observed(run):
        return
    for (kind, payloads), expected, what in zip(call_payloads(run, group, case), inputs, whats):
        partials = {rank: expected(rank) for rank in group}
        if kind == "all_reduce":
            carried.assert_reduced_carried(payloads, partials, case, f"{what} over ranks {tuple(group)}")
        elif kind == "all_gather":
            assert_gathered_carried(payloads, partials, case, f"{what} over ranks {tuple(group)}")


def assert_gathered_carried(payloads: dict, partials: dict, case: str, what: str) -> None:
    """Every rank's input to one all-gather call (``partials[rank]``: its alternatives, float32, recomputed by the
    grader in one process) among the fp32 words it sent in that call (``payloads[rank]``), every nonzero entry,
    within 1e-4 relative or 1e-6 of its largest entry: an all-gather carries each rank's piece as it is.  A rank
    that gathers something else (zeros) and sums some other way fails."""
    for rank, alternatives in sorted(partials.items()):
        pool = carried.words_sent([b"".join(payloads.get(rank, []))])  # (gloo cuts a piece where a word may straddle)
        best = None
        for want in alternatives:
            want = want.detach().float().reshape(-1).numpy()
            want = want[want != 0]
            if not want.size:
                best = (0, 0)
                break
            found = carried.words_found(pool, want, rtol=1e-4, atol=1e-6 * float(abs(want).max()))
            if best is None or want.size - found < best[0] - best[1]:
                best = (want.size, found)
        total, found = best or (0, 0)
        assert found == total, (
            f"{case}: {what}: rank {rank} should send its own input to the all-gather whole (the grader's, computed in "
            f"one process: {total} nonzero entries); the grader's capture of the wire found {found} of them in what "
            "it sent in that call. What a rank gathers must be the data itself: values that arrive some other way, "
            "with other bytes sent in their place, do not count"
        )


def assert_stays_in(run, rank: int, allowed: set, what: str, case: str) -> None:
    """``rank`` sent data (anything but a barrier) only to ranks of ``allowed`` (``what`` names them)."""
    sent = {(dst, carried.kind(slot)) for src, dst, _, slot, _ in data_sends(run, case) if src == rank}
    stray = sorted((dst, kind) for dst, kind in sent if dst not in allowed)
    assert not stray, (
        f"{case}: rank {rank}'s communication must stay inside {what}; the grader's capture of the wire shows it "
        f"sent {', '.join(f'{kind} messages to rank {dst}' for dst, kind in stray)}"
    )


def describe(made: Sequence[tuple[str, int | None]]) -> str:
    """Calls as "all-reduce of 96 B, ..." (a size None: "all-reduce")."""
    return ", ".join(k.replace("_", "-") + (f" of {b} B" if b is not None else "") for k, b in made) or "nothing"


def assert_group_calls(run, group: Sequence[int], expected: list, what: str, case: str, outside: set = frozenset()):
    """The ranks of ``group`` made exactly the calls ``expected`` among themselves ((kind, bytes or None: any
    size), in order), each rank sending in each once, and sent nothing to a rank beyond the group but those of
    ``outside`` (a pipeline's neighbours, say)."""
    for rank in group:
        assert_stays_in(run, rank, {*group, *outside}, f"its group {tuple(group)}", case)
    per_rank, found = group_calls(run, group, case)
    same = len(found) == len(expected) and all(
        kind == want and size in (None, got) for (want, size), (kind, got) in zip(expected, found)
    )
    assert same, (
        f"{what}: ranks {tuple(group)} should make exactly {describe(expected)} among themselves (nothing else); "
        f"the grader's capture of the wire shows {describe(found)}"
    )
    assert all(count == len(expected) for count in per_rank.values()), (
        f"{what}: each of ranks {tuple(group)} should send in each of its {len(expected)} call(s), once; the "
        f"grader's capture of the wire shows, per rank, the calls it sent in: {per_rank}"
    )
