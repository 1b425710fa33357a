"""What a launch recorded, and the questions the labs ask of it.

Every ``torch.distributed`` call a rank makes (``disttrain_lab.trace`` records them) comes back
to the notebook as an :class:`Event`; ``dl.launch(..., trace=True)`` returns them in a
:class:`Run`, which answers what the labs grade: bytes sent per rank, calls per op, which
collectives ran, and how many communication rounds a point-to-point algorithm took.

The op tables say which functions of ``torch.distributed`` are communication, and which of a
call's arguments hold its tensors (the recorder and the emulated network read them).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

P2P_OPS = ("send", "recv", "isend", "irecv")
COLLECTIVE_OPS = (
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "gather",
    "barrier",
    "all_to_all",
    "all_to_all_single",
    "monitored_barrier",
    # torch >= 2.13 names for the *_tensor collectives, and the coalesced variants
    "all_gather_single",
    "reduce_scatter_single",
    "all_reduce_coalesced",
    "all_gather_coalesced",
)
# Group set-up: every rank must call these too, so a rank stuck in one is worth reporting.
SETUP_OPS = ("new_group", "new_subgroups", "new_subgroups_by_enumeration")
TRACED_OPS = P2P_OPS + COLLECTIVE_OPS + SETUP_OPS

# Argument names that hold the tensors of a call, and which side (in/out) they are
# (the emulated network reads a call's size with them too).
IN_ARGS = ("tensor", "input_tensor", "input", "input_list", "input_tensor_list", "scatter_list")
OUT_ARGS = ("output_tensor", "output", "tensor_list", "output_tensor_list", "gather_list")


@dataclass
class Event:
    """One thing a rank did: a communication call, a wait on one, or a marked region.

    ``bytes`` is the logical payload: the tensor for send/recv/broadcast/all_reduce,
    the larger of the input and output buffers for gather/scatter-like collectives
    (an all_gather of S bytes in total counts S, as a reduce_scatter of S bytes does).
    Times are seconds since the launch began, on one clock for all ranks of a host.
    """

    rank: int
    op: str
    kind: str  # "p2p" | "collective" | "wait" | "region"
    start: float
    end: float
    peer: int | None = None  # dst of a send, src of a recv, root of broadcast/reduce/scatter/gather
    group: tuple[int, ...] | None = None  # global ranks of the group; None = the whole world
    bytes: int = 0
    tag: int | None = None
    name: str = ""  # region name, or for a wait the op it waits on ("irecv")
    meta: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start

    def describe(self) -> str:
        return describe_call(
            self.op if self.kind != "wait" else f"wait({self.name})", self.peer, self.tag, self.bytes, self.group
        )


def describe_call(op: str, peer, tag, nbytes, group) -> str:
    parts = []
    if peer is not None:
        parts.append(
            (
                "dst="
                if op in ("send", "isend", "reduce", "gather")
                else "src="
                if op in ("recv", "irecv", "broadcast", "scatter")
                else "peer="
            )
            + str(peer)
        )
    if tag:
        parts.append(f"tag={tag}")
    if group is not None:
        parts.append(f"group={list(group)}")
    if nbytes:
        parts.append(format_bytes(nbytes))
    return f"{op}({', '.join(parts)})"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _overlap(a: tuple | None, b: tuple | None) -> bool:
    """Whether two buffer spans (address, start, end), as the recorder notes them, share memory."""
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def to_events(raw: list[tuple]) -> list[Event]:
    return [
        Event(rank=r, op=op, kind=k, start=s, end=e, peer=p, group=g, bytes=b, tag=t, name=n, meta=m)
        for (r, op, k, s, e, p, g, b, t, n, m) in raw
    ]


# --------------------------------------------------------------------------------------
# What the notebook gets back
# --------------------------------------------------------------------------------------
@dataclass
class Run:
    """The outcome of ``dl.launch(..., trace=True)``: each rank's return value and events."""

    results: list
    events: list[Event]
    world_size: int
    backend: str = "gloo"
    wall_time: float = 0.0
    network: Any = None  # the emulated dl.Network the launch ran on, or None (real links)

    def by_rank(self, rank: int) -> list[Event]:
        return [e for e in self.events if e.rank == rank]

    def select(
        self,
        op: str | None = None,
        rank: int | None = None,
        peer: int | None = None,
        kind: str | None = None,
        name: str | None = None,
    ) -> list[Event]:
        """Events matching every given field, in start order."""
        return [
            e
            for e in self.events
            if (op is None or e.op == op)
            and (rank is None or e.rank == rank)
            and (peer is None or e.peer == peer)
            and (kind is None or e.kind == kind)
            and (name is None or e.name == name)
        ]

    def bytes_sent(self, rank: int) -> int:
        """Point-to-point payload bytes this rank sent (send + isend)."""
        return sum(e.bytes for e in self.events if e.rank == rank and e.op in ("send", "isend"))

    def bytes_received(self, rank: int) -> int:
        return sum(e.bytes for e in self.events if e.rank == rank and e.op in ("recv", "irecv"))

    def calls(self, rank: int | None = None) -> Counter:
        """How many times each communication op was called (waits and regions excluded)."""
        return Counter(
            e.op for e in self.events if e.kind in ("p2p", "collective") and (rank is None or e.rank == rank)
        )

    def collectives(self, rank: int | None = None) -> list[Event]:
        return [e for e in self.events if e.kind == "collective" and (rank is None or e.rank == rank)]

    def messages(self) -> list[tuple[Event, Event]]:
        """Matched (send, recv) pairs: the k-th send from a to b with tag t matches the
        k-th receive at b from a with tag t (messages between a pair do not overtake)."""
        sends: dict[tuple, deque] = defaultdict(deque)
        for e in self.events:
            if e.op in ("send", "isend") and e.peer is not None:
                sends[(e.rank, e.peer, e.tag or 0)].append(e)
        pairs = []
        for e in self.events:
            if e.op in ("recv", "irecv") and e.peer is not None:
                queue = sends.get((e.peer, e.rank, e.tag or 0))
                if queue:
                    pairs.append((queue.popleft(), e))
        return pairs

    def rounds(self) -> int:
        """Communication rounds of the point-to-point traffic under the one-port model.

        Each rank sends at most one message per round, and data that arrives in round r
        can be forwarded in round r + 1 at the earliest.  A message's round is therefore
        1 + max(the round of the sender's previous send, the latest round it has received).
        Linear broadcast on N ranks takes N - 1 rounds, a binomial tree ceil(log2 N),
        a ring all-reduce 2(N - 1).
        """
        pairs = self.messages()
        recv_of_send = {id(s): r for s, r in pairs}
        send_of_recv = {id(r): s for s, r in pairs}
        # a receive is complete when its data is there: the end of recv, or of irecv's wait
        wait_end = {e.meta["request"]: e.end for e in self.events if e.kind == "wait" and "request" in e.meta}
        actions = defaultdict(list)  # rank -> [(time, "send"|"recv", event)]
        posted = defaultdict(list)  # rank -> irecvs, to catch forwarding a buffer before its wait
        for e in self.events:
            if e.op in ("send", "isend") and id(e) in recv_of_send:
                actions[e.rank].append((e.start, "send", e))
            elif e.op in ("recv", "irecv") and id(e) in send_of_recv:
                done = wait_end.get(e.meta.get("request"), e.end) if e.op == "irecv" else e.end
                actions[e.rank].append((done, "recv", e))
                if e.op == "irecv":
                    posted[e.rank].append(e)
        for seq in actions.values():
            seq.sort(key=lambda a: (a[0], a[1] == "send"))
        round_of: dict[int, int] = {}
        pos = {r: 0 for r in actions}
        last_send = defaultdict(int)
        seen = defaultdict(int)
        progress = True
        while progress:
            progress = False
            for rank, seq in actions.items():
                while pos[rank] < len(seq):
                    _, what, e = seq[pos[rank]]
                    if what == "send":
                        # sending from a buffer an irecv is still filling forwards that message
                        # (racing its wait): the send depends on it all the same
                        deps = [
                            send_of_recv[id(r)]
                            for r in posted[rank]
                            if r.start < e.start and _overlap(r.meta.get("buffer"), e.meta.get("buffer"))
                        ]
                        if any(id(d) not in round_of for d in deps):
                            break
                        needed = max((round_of[id(d)] for d in deps), default=0)
                        round_of[id(e)] = max(last_send[rank], seen[rank], needed) + 1
                        last_send[rank] = round_of[id(e)]
                    else:
                        sender = send_of_recv[id(e)]
                        if id(sender) not in round_of:
                            break  # wait until the sender's side has been numbered
                        seen[rank] = max(seen[rank], round_of[id(sender)])
                    pos[rank] += 1
                    progress = True
        return max(round_of.values(), default=0)

    def summary(self) -> Summary:
        """Per-rank table: bytes sent/received point-to-point and calls per op."""
        rows = []
        for r in range(self.world_size):
            rows.append(
                {
                    "rank": r,
                    "sent": self.bytes_sent(r),
                    "received": self.bytes_received(r),
                    "calls": dict(sorted(self.calls(r).items())),
                }
            )
        return Summary(rows)

    def __repr__(self) -> str:
        return (
            f"Run(world_size={self.world_size}, backend={self.backend!r}, "
            f"events={len(self.events)}, wall_time={self.wall_time:.3f}s, results={self.results!r})"
        )


class Summary(list):
    """A list of per-rank rows that prints as a table."""

    def __repr__(self) -> str:
        lines = [f"{'rank':>4}  {'sent':>10}  {'received':>10}  calls"]
        for row in self:
            calls = ", ".join(f"{op}×{n}" for op, n in row["calls"].items()) or "-"
            lines.append(
                f"{row['rank']:>4}  {format_bytes(row['sent']):>10}  {format_bytes(row['received']):>10}  {calls}"
            )
        return "\n".join(lines)

    _repr_pretty_ = lambda self, p, cycle: p.text(repr(self))  # noqa: E731  (IPython display)


def ceil_log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0
