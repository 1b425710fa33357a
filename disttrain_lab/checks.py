"""Checks that notebook self-checks and graded tests share, for every lab.

Each check either returns quietly or raises ``AssertionError`` with a message that
states the rule, what was seen, and what would be right, so a student can act on it:

    >>> from disttrain_lab import checks
    >>> checks.assert_close(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0]), what="rank 1's result")
    AssertionError: rank 1's result: values differ from the expected ones: max abs diff 0.5
    at index (1,) (got 2.5, expected 2.0); 1 of 2 elements differ ...

Reference answers never come from here: a graded test computes them with torch itself
(``dist.broadcast`` on the same ranks) or in a single process.  What lives here is how to
compare, how to read a trace (``within``, ``assert_only_p2p``, ``sends``), and the guard
against a notebook that replaced the functions grading relies on.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence

import torch

from . import integrity, wire
from .events import P2P_OPS, Event, Run
from .integrity import TamperingError

SEND_OPS = ("send", "isend")
RECV_OPS = ("recv", "irecv")

# Default tolerances per dtype (rtol, atol): a sum of a few values in another order
# differs by a few ulps, which these allow; integers must match exactly.
TOLERANCES = {
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}

__all__ = [
    "TOLERANCES",
    "passed",
    "assert_close",
    "assert_sum_close",
    "sample_tensor",
    "within",
    "assert_only_p2p",
    "assert_point_to_point",
    "COLLECTIVE_SLOTS",
    "sends",
    "receives",
    "assert_traffic",
    "assert_messages",
    "WIRE_SLACK",
    "verify_untampered",
    "TamperingError",
    "SEND_OPS",
    "RECV_OPS",
]


def passed(message: str) -> None:
    """Print a friendly success line: ``passed("ring_shift works on 3 ranks")``."""
    print(f"\N{WHITE HEAVY CHECK MARK} {message}")


# --------------------------------------------------------------------------------------
# Comparing tensors
# --------------------------------------------------------------------------------------
def assert_close(
    actual, expected: torch.Tensor, what: str = "result", *, rtol: float | None = None, atol: float | None = None
) -> None:
    """Assert ``actual`` is a tensor like ``expected``: same shape, dtype and values.

    Floats are compared with a tolerance (defaults per dtype, above); integers exactly.

        >>> assert_close(torch.ones(3), torch.ones(3), what="rank 0's output")   # passes
        >>> assert_close(torch.ones(3), torch.ones(4))
        AssertionError: result: expected shape (4,), got shape (3,)
    """
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(
            f"{what}: expected a torch.Tensor of shape {tuple(expected.shape)} and "
            f"dtype {_dtype(expected)}, got {type(actual).__name__} {_short(actual)}"
        )
    if type(actual) is not torch.Tensor and not isinstance(actual, torch.nn.Parameter):
        # a subclass can redefine comparisons (__torch_function__): compare plain data
        raise AssertionError(
            f"{what}: expected a plain torch.Tensor, got the subclass {type(actual).__name__}; "
            f"return the tensor itself (e.g. x.detach() or torch.as_tensor(x))"
        )
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: expected shape {tuple(expected.shape)}, got shape {tuple(actual.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(
            f"{what}: expected dtype {_dtype(expected)}, got {_dtype(actual)} "
            f"(keep the dtype of the input; torch's own op does)"
        )
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.is_floating_point() or a.is_complex():
        default_rtol, default_atol = TOLERANCES.get(a.dtype, (1e-6, 1e-6))
        rtol = default_rtol if rtol is None else rtol
        atol = default_atol if atol is None else atol
        bad = ~torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
        rule = f"tolerance rtol={rtol:g}, atol={atol:g}"
    else:
        bad = a != e
        rule = "integers must match exactly"
    message = _mismatch(a, e, bad, what, rule)
    if message:  # (raised here: the student's traceback shows one frame of the kit)
        raise AssertionError(message)


def assert_sum_close(actual, terms: Sequence[torch.Tensor], what: str = "result") -> None:
    """Assert ``actual`` is the sum of ``terms`` (tensors of one shape and dtype), added in any order in their dtype.

    Each element may differ from the exact sum (computed in float64, rounded to the dtype) by the dtype's
    tolerance (``TOLERANCES``) plus what rounding after each of the N-1 additions can add up to in the worst
    order: (N-1) u sum_i |x_i|, u the dtype's unit roundoff (Higham, *Accuracy and Stability of Numerical
    Algorithms*, 2nd ed., section 4.2).  A ring adds in another order than one process does; in bfloat16
    (u = 2**-8) with cancellation that alone can exceed the default tolerance.  Integers must match exactly.

        >>> xs = [sample_tensor(8, torch.bfloat16, seed=s) for s in range(4)]
        >>> assert_sum_close(xs[0] + xs[1] + xs[2] + xs[3], xs)   # passes, whatever the order of the additions
    """
    stacked = torch.stack([t.detach().cpu() for t in terms])
    expected = stacked.double().sum(dim=0).to(stacked.dtype) if stacked.is_floating_point() else stacked.sum(dim=0)
    plain = type(actual) is torch.Tensor or isinstance(actual, torch.nn.Parameter)
    if not (stacked.is_floating_point() and plain and (actual.shape, actual.dtype) == (expected.shape, expected.dtype)):
        assert_close(actual, expected, what)  # integers exactly; a wrong type, shape or dtype: its own message
        return
    rtol, atol = TOLERANCES.get(expected.dtype, (1e-6, 1e-6))
    unit = torch.finfo(expected.dtype).eps / 2
    bound = (len(terms) - 1) * unit * stacked.double().abs().sum(dim=0)
    a, e = actual.detach().cpu(), expected
    diff = (a.double() - e.double()).abs()
    bad = ~((diff <= atol + rtol * e.double().abs() + bound) | (a.isnan() & e.isnan()))
    rule = (
        f"tolerance rtol={rtol:g}, atol={atol:g}, plus {len(terms) - 1} x {unit:g} (the dtype's unit roundoff) x "
        "the sum of the terms' magnitudes: the rounding of N-1 additions in any order"
    )
    message = _mismatch(a, e, bad, what, rule)
    if message:
        raise AssertionError(message)


def _mismatch(a: torch.Tensor, e: torch.Tensor, bad: torch.Tensor, what: str, rule: str) -> str:
    """What is wrong, naming the worst and the first element of ``a`` that ``bad`` marks; '' where none is marked."""
    count = int(bad.sum())
    if count == 0:
        return ""
    diff = (a.double() - e.double()).abs().masked_fill(~bad, 0)  # worst among the bad ones
    worst = _index(int(diff.argmax()), a.shape)
    first = _index(int(bad.flatten().nonzero()[0]), a.shape)
    return (
        f"{what}: values differ from the expected ones: max abs diff {float(diff.max()):.6g} at index "
        f"{worst} (got {a[worst].item()}, expected {e[worst].item()}); {count} of {a.numel()} elements "
        f"differ, the first at index {first}; dtype {_dtype(a)}, shape {tuple(a.shape)}; {rule}"
    )


def _index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _short(obj) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


def sample_tensor(shape: Sequence[int] | int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Deterministic test data: the same ``(shape, dtype, seed)`` gives the same tensor on any rank.

    Floats are standard normal; integers lie in [-1000, 1000) so sums cannot overflow.

        >>> sample_tensor((2, 3), torch.int64, seed=1).shape
        torch.Size([2, 3])
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int64).to(dtype)


# --------------------------------------------------------------------------------------
# Reading a trace
# --------------------------------------------------------------------------------------
def within(run: Run, region: str) -> Run:
    """The part of ``run`` that happened inside the regions named ``region``, rank by rank.

    A graded test marks the student's call with ``dl.region("student")`` and computes
    torch's reference after it; ``within(run, "student")`` then holds only the student's
    communication, so a reference ``dist.broadcast`` does not count against them.

        >>> student = within(run, "student")
        >>> student.rounds(), student.bytes_sent(0)
    """
    windows: dict[int, list[tuple[float, float]]] = {}
    for e in run.events:
        if e.kind == "region" and e.name == region:
            windows.setdefault(e.rank, []).append((e.start, e.end))
    if not windows:
        raise ValueError(
            f"the run has no region named {region!r}; regions seen: "
            f"{sorted({e.name for e in run.events if e.kind == 'region'}) or 'none'}. "
            f"Mark the code with `with dl.region({region!r}):` inside the launched function"
        )
    inside = [
        e
        for e in run.events
        if e.kind != "region" and any(start <= e.start <= end for start, end in windows.get(e.rank, ()))
    ]
    return Run(
        results=run.results, events=inside, world_size=run.world_size, backend=run.backend, wall_time=run.wall_time
    )


def sends(run: Run, rank: int, peer: int | None = None) -> list[Event]:
    """The messages ``rank`` sent (``send`` and ``isend``), optionally only those to ``peer``."""
    return [e for e in run.events if e.rank == rank and e.op in SEND_OPS and (peer is None or e.peer == peer)]


def receives(run: Run, rank: int, peer: int | None = None) -> list[Event]:
    """The messages ``rank`` received (``recv`` and ``irecv``), optionally only those from ``peer``."""
    return [e for e in run.events if e.rank == rank and e.op in RECV_OPS and (peer is None or e.peer == peer)]


def assert_only_p2p(run: Run, exercise: str) -> None:
    """Fail if ``run`` used any communication other than send/recv/isend/irecv (and wait).

    >>> assert_only_p2p(within(run, "student"), exercise="broadcast_tree")
    AssertionError: broadcast_tree must be built from point-to-point calls only
    (send, recv, isend, irecv), but it called broadcast on rank 0 (1×), rank 1 (1×) ...
    """
    used = Counter((e.op, e.rank) for e in run.events if e.kind == "collective")
    if not used:
        return
    by_op: dict[str, list[str]] = {}
    for (op, rank), n in sorted(used.items()):
        by_op.setdefault(op, []).append(f"rank {rank} ({n}×)")
    found = "; ".join(f"{op} on {', '.join(where)}" for op, where in by_op.items())
    raise AssertionError(
        f"{exercise} must be built from point-to-point calls only ({', '.join(P2P_OPS)}), "
        f"but it called the collective {found}. Replace it with sends and receives."
    )


# gloo's collectives mark each message's slot with their kind in its top byte (gloo/common/utils.h: the
# Slot prefixes); torch's send/recv use the caller's tag, a 32-bit number, as the slot, its top byte 0
COLLECTIVE_SLOTS = {
    1: "gather",
    2: "all_gather",
    3: "reduce",
    4: "all_reduce",
    5: "scatter",
    6: "broadcast",
    7: "barrier",
    8: "all_to_all",
}


def assert_point_to_point(run, exercise: str) -> None:
    """Fail if a ``dl.exercise.run`` used any communication other than send/recv: under grading from the
    grader's capture of the wire (every operation of gloo's between the ranks, notes too, must carry a
    point-to-point slot: a collective's carries its kind in the slot's top byte, ``COLLECTIVE_SLOTS``), in the
    student's own kernel from the ranks' calls (``assert_only_p2p`` on the trace: no wire is seen there).  Under
    grading a run that was not captured raises ``wire.Unobserved``: it never falls back on the trace."""
    timeline = run.timeline
    if timeline.source == "trace":
        assert_only_p2p(run.trace, exercise)
        return
    n, found = run.world_size, {}
    for a in range(n):
        for b in range(n):
            if a != b:
                for _, _, _, slot, _ in timeline.operations(a, b) or ():
                    kind = COLLECTIVE_SLOTS.get(slot >> 56, f"a collective (slot prefix {slot >> 56:#x})")
                    if slot >> 56:
                        found.setdefault(kind, set()).add(a)
    if found:
        calls = "; ".join(f"{kind} from rank(s) {', '.join(map(str, sorted(r)))}" for kind, r in sorted(found.items()))
        raise AssertionError(
            f"{exercise} must be built from point-to-point calls only ({', '.join(P2P_OPS)}), but the grader's "
            f"capture of the wire shows a collective's messages: {calls}. Replace it with sends and receives."
        )


# What a run may move beyond its payload: gloo's header per message (72 B on torch 2.13) and
# its hand-shake per connection (8 B), for the few messages of a test
WIRE_SLACK = 4096


def assert_traffic(run, expected: dict[tuple[int, int], int], case: str) -> None:
    """Fail unless the bytes each rank sent each other rank, as the operating system counted
    them (``run.traffic`` of a ``dl.exercise.run``), are the payload ``expected[(src, dst)]``
    (0 for a pair not named) plus at most ``WIRE_SLACK`` of message headers.

    >>> assert_traffic(run, {(0, 1): 4096, (1, 0): 4096}, "ping_pong on 2 ranks")
    AssertionError: ping_pong on 2 ranks: rank 0 should send rank 1 4,096 bytes (its payload),
    but the operating system counted 8 bytes ...
    """
    traffic = run.traffic
    n = traffic.world_size
    for src in range(n):
        for dst in range(n):
            if src == dst:
                continue
            want, got = expected.get((src, dst), 0), traffic.between(src, dst)
            if want <= got <= want + WIRE_SLACK + want // 100:
                continue
            what = f"{want:,} bytes (its payload)" if want else "nothing"
            raise AssertionError(
                f"{case}: rank {src} should send rank {dst} {what}, but {_counted_by(traffic)} "
                f"{got:,} bytes between them (all pairs: {traffic.describe()}). "
                + (
                    "Data that is returned without being sent does not count."
                    if got < want
                    else "Something moved that the exercise does not need."
                )
            )


def assert_messages(run, expected: dict[tuple[int, int], tuple[int, ...]], case: str, hint: str = "") -> None:
    """Fail unless each connection carried exactly the point-to-point messages an algorithm sends,
    as the operating system counted the bytes (``run.traffic`` of a ``dl.exercise.run``):
    ``expected[(src, dst)]`` is ``(messages, payload bytes)``, or ``(messages, least, most)`` where
    uneven chunks leave the payload a range; pairs not named carry nothing.

    Gloo's protocol adds 96 bytes to each message and 48 the other way (``wire.protocol_bytes``),
    so the count pins 144 bytes per message plus the payload: one message more, or the whole tensor
    where a chunk was due, shows (where the payload is a range, within it).  The ranks' own trace only
    helps say what differs.

    >>> assert_messages(run, {(0, 1): (3, 4096), (1, 0): (3, 4096)}, "ping_pong on 2 ranks")
    """
    traffic = run.traffic
    n = traffic.world_size
    for src in range(n):
        for dst in range(n):
            if src == dst:
                continue
            count, *payload = expected.get((src, dst), (0, 0))
            least, most = payload[0], payload[-1]
            back = expected.get((dst, src), (0, 0))[0]
            overhead = 2 * wire.GLOO_PREAMBLE * count + wire.GLOO_PREAMBLE * back
            got = traffic.between(src, dst)
            if least + overhead <= got <= most + overhead + wire.HANDSHAKE_BYTES:
                continue
            size = f"{least:,}" if least == most else f"{least:,}–{most:,}"
            if count or back:
                want = (
                    f"{count} message(s) from rank {src} to rank {dst} with {size} bytes of payload in all, and "
                    f"{back} the other way, put {least + overhead:,}"
                    + ("" if least == most else f"–{most + overhead:,}")
                    + f" bytes there (gloo adds 96 bytes to each message: a 48-byte note when the send is posted "
                    f"and the message's 48-byte preamble; and 48 for each message rank {dst} sends rank {src}: "
                    f"the note that the receive is posted), or {wire.HANDSHAKE_BYTES} more (gloo's handshake as the "
                    f"launch opens the connection)"
                )
            else:
                want = f"these ranks do not talk here (at most gloo's {wire.HANDSHAKE_BYTES}-byte handshake)"
            trace = getattr(run, "trace", None)
            said = ""
            if trace is not None:
                mine = sends(trace, src, dst)
                said = (
                    f" The ranks' own trace says rank {src} sent rank {dst} {len(mine)} message(s) with "
                    f"{sum(e.bytes for e in mine):,} bytes of payload."
                )
            raise AssertionError(
                f"{case}: {_counted_by(traffic)} {got:,} bytes from rank {src} to rank {dst}; {want}.{said}"
                + (f" {hint}" if hint else "")
            )


def _counted_by(traffic) -> str:
    return "the operating system counted" if traffic.source == "os" else f"the ranks' own trace says ({traffic.source})"


# --------------------------------------------------------------------------------------
# Tampering
# --------------------------------------------------------------------------------------
def verify_untampered() -> None:
    """Raise TamperingError if torch.distributed, torch's comparisons or these checks were replaced.

    Graded test cells call this first: a notebook that assigned ``dist.broadcast = ...``,
    ``torch.allclose = ...`` or ``checks.assert_close = ...`` fails that exercise, saying what
    was replaced.  The genuine objects are remembered when ``disttrain_lab`` is imported.
    """
    integrity.verify()


# Remember this module's own functions too, so replacing a check is caught like replacing
# dist.broadcast.  (integrity.watch_defaults() covers torch; it ran when the package loaded.)
integrity.watch(
    sys.modules[__name__],
    [name for name in __all__ if callable(globals()[name]) and not isinstance(globals()[name], type)],
)
