"""What crossed between the ranks, and when: the grader's packet capture of their connections, as a Timeline.

``wire`` counts the bytes each connection carried over a whole run; the order of the messages (who
sends before receiving, a pipeline schedule's order, a collective's rounds) and what they carried need
the segments themselves.  Under grading the grader captures them on the student's loopback
(``grading/capture.py``: each TCP segment's time, its two addresses and its length, and, for a run of
``dl.exercise.run(..., content=True)``, its payload, copied, never parsed).  ``timeline`` keeps the
segments between two ranks' sockets (a ``wire.snapshot``'s, each owned by a rank: ``wire.owners``) and
joins each connection's payloads by their sequence numbers, so a segment TCP sent again is not counted
twice.  A ``Timeline`` answers in ranks: which way the data went, in turn (``directions``); how many
bytes a direction had carried by a time (``crossed``) and when it passed a byte (``passed``: TCP keeps
a direction's bytes in order, so a byte's position says which of gloo's operations it belongs to);
and what it carried, read as gloo's operations (``gloo_ops``: ``messages``, ``sends_between``,
``sends_by_connection``, ``operations``, ``carries``).

Where the grader could not capture, the timeline is unobserved and every read raises
``wire.Unobserved``; in the student's own kernel it is the ranks' own trace (``source="trace"``), for
pictures and self-checks, and nothing read of what crossed is checked there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from . import gloo_ops
from .wire import GLOO_PREAMBLE, SUBMISSION_CHANGED_THE_RANKS, Socket, Unobserved

__all__ = ["Timeline", "timeline"]

# what an Unobserved message tells its reader to do where the host could not capture the wire (the
# instructor); where the submission made the run unobservable, wire.SUBMISSION_CHANGED_THE_RANKS (the student)
_HOST_CAPTURES = (
    "For the instructor: grade as root, where a packet socket may be opened in the student's network "
    "namespace (grader/README.md)"
)


@dataclass
class Timeline:
    """The data segments that crossed between the ranks, in the order they crossed: ``segments``
    holds (seconds since the run's first segment, sending rank, receiving rank, payload bytes).

    Under grading the grader captures them from the wire (``grading/capture.py``): ``source`` is
    ``"wire"``.  Where it could not, ``"unobserved"``: every read raises ``Unobserved``.  In the
    student's own kernel (``dl.exercise.run(..., timeline=True)`` for a self-check) it is the
    ranks' own trace, ``"trace"``: one segment per traced send, of its payload and gloo's preamble."""

    segments: list[tuple[float, int, int, int]] | None
    source: str = "wire"
    why: str = ""
    # what each connection between two ranks carried, in the order it crossed: (sender, receiver) ->
    # one bytes per connection (the captured payloads; None where they were not kept)
    data: dict[tuple[int, int], list[bytes]] | None = field(default=None, repr=False, compare=False)
    by_submission: bool = False  # unobserved because of what the submission did, not the host
    origin: float = 0.0  # the capture's clock (time.monotonic) at the first segment: the segments' zero
    # which connection each of ``data``'s streams is: (sender, receiver) -> one name per stream, the same for
    # both directions of one connection (its two addresses); a process group opens connections of its own
    links: dict[tuple[int, int], list[str]] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def unobserved(cls, why: str, by_submission: bool = False) -> Timeline:
        return cls(segments=None, source="unobserved", why=why, by_submission=by_submission)

    def _all(self) -> list[tuple[float, int, int, int]]:
        if self.segments is None:
            to_do = SUBMISSION_CHANGED_THE_RANKS if self.by_submission else _HOST_CAPTURES
            raise Unobserved(
                f"the grader could not capture when the ranks' data crossed ({self.why}), so a test that grades "
                f"it fails rather than take the ranks' own clocks. {to_do}"
            )
        return self.segments

    def directions(self, min_bytes: int = GLOO_PREAMBLE + 1) -> list[tuple[int, int]]:
        """(sender, receiver) of each run of consecutive segments in one direction, in order,
        counting only segments of at least ``min_bytes``: by default those that carry data, for
        gloo's own control messages (ready to send, ready to receive) are its 48-byte preamble
        alone, and a message of data is that preamble and the payload.  A ping-pong of 3 round
        trips is ``[(0, 1), (1, 0)] * 3``."""
        runs: list[tuple[int, int]] = []
        for _, src, dst, size in self._all():
            if size < min_bytes:
                continue
            if not runs or runs[-1] != (src, dst):
                runs.append((src, dst))
        return runs

    def bytes(self, src: int, dst: int) -> int:
        return sum(n for _, a, b, n in self._all() if (a, b) == (src, dst))

    def carries(self, src: int, dst: int, messages: Sequence[bytes]) -> int:
        """How many of ``messages`` (each one message's payload as bytes, e.g. a tensor's
        ``numpy().tobytes()``) the data from ``src`` to ``dst`` carried, in that order: each found
        whole in a connection's data (its sends' payloads, ``gloo_ops.messages``, joined) after the
        one before it; bytes that are not gloo's operations raise ``gloo_ops.NotGloo``.  A rank
        that passes its data some other way and sends junk of the right size carries none.  In the
        student's own kernel (``source="trace"``) no wire is seen: every message counts, and only
        grading checks it."""
        if self.source == "trace":
            return len(messages)
        # the payloads of each connection's sends, joined: gloo may cut one tensor into several sends
        # (its all-gather ring sends each piece in two), with its preambles between them
        streams = [b"".join(gloo_ops.messages(stream)) for stream in self._streams(src, dst)]
        at = [0] * len(streams)
        found = 0
        for message in messages:
            if not message:  # (an empty tensor: nothing had to cross)
                found += 1
                continue
            for i, stream in enumerate(streams):
                where = stream.find(message, at[i])
                if where >= 0:
                    at[i], found = where + len(message), found + 1
                    break
        return found

    def _streams(self, src: int, dst: int) -> list[bytes]:
        self._all()
        if self.data is None:
            raise Unobserved(f"the grader did not keep what the connections carried ({self.why or 'not captured'})")
        streams = self.data.get((src, dst), [])
        if streams is None:
            raise Unobserved(
                f"the grader's capture could not keep all the data from rank {src} to rank {dst} (past its "
                "limits), so a test that reads what it carried fails"
            )
        return streams

    def _one_stream(self, src: int, dst: int) -> list[bytes]:
        """``_streams``, where a direction's bytes are to be placed in time: a direction of more than one
        connection cannot be (its positions are not one stream's), and raises ``Unobserved``."""
        streams = self._streams(src, dst)
        if len(streams) > 1:
            raise Unobserved(
                f"rank {src} sent rank {dst} data over {len(streams)} connections, so the grader cannot tell which "
                "of their bytes crossed when"
            )
        return streams

    def messages(self, src: int, dst: int) -> list[bytes] | None:
        """The payload of each message ``src`` sent ``dst``, in the order they crossed, read from what
        the grader's capture kept (gloo's framing: ``gloo_ops.messages``); a connection whose bytes are
        not gloo's operations raises ``gloo_ops.NotGloo``.  None in the student's own kernel
        (``source="trace"``), where no wire is seen."""
        if self.source == "trace":
            return None
        return [payload for stream in self._streams(src, dst) for payload in gloo_ops.messages(stream)]

    def sends_between(self, src: int, dst: int, start: float, cut: float = math.inf) -> list[tuple[int, bytes]] | None:
        """(slot, payload) of each message ``src`` sent ``dst`` whose bytes all crossed after ``start`` and
        before ``cut`` (seconds of ``segments``), in order (``gloo_ops.sends``): by position in the
        connection's bytes, which TCP keeps in order (``crossed``), so a message cut across several segments
        is one.  None in the student's own kernel (no wire).  A direction of more than one connection cannot
        be placed (its positions are not one stream's): it raises ``Unobserved``."""
        if self.source == "trace":
            return None
        streams = self._one_stream(src, dst)
        begin = self.crossed(src, dst, start)
        end = sum(n for t, a, b, n in self._all() if (a, b) == (src, dst) and t < cut)
        return [
            (slot, payload)
            for at, slot, payload in (gloo_ops.sends(streams[0]) if streams else [])
            if at >= begin and at + GLOO_PREAMBLE + len(payload) <= end
        ]

    def sends_by_connection(self, src: int, dst: int) -> list[tuple[str, int, bytes]] | None:
        """(its connection, slot, payload) of each message ``src`` sent ``dst``, over every connection between them
        (each process group has its own: ``links`` names them, the same name both ways), each connection's in the
        order they crossed; not placed in time.  None in the student's own kernel (no wire); bytes that are not
        gloo's operations raise ``gloo_ops.NotGloo``."""
        if self.source == "trace":
            return None
        streams = self._streams(src, dst)
        names = (self.links or {}).get((src, dst)) or [f"{src}>{dst}#{i}" for i in range(len(streams))]
        return [(name, slot, data) for name, stream in zip(names, streams) for _, slot, data in gloo_ops.sends(stream)]

    def operations(self, src: int, dst: int) -> list[tuple[float, float, int, int, int]] | None:
        """Each of gloo's operations from ``src`` to ``dst``, notes too (``gloo_ops.operations``), in order:
        (when its first byte crossed, when its last did, its opcode, its slot, its payload's length), placed by
        position in the connection's bytes (``passed``).  None in the student's own kernel (no wire).  A direction of
        more than one connection cannot be placed: it raises ``Unobserved``."""
        if self.source == "trace":
            return None
        streams = self._one_stream(src, dst)
        found = []
        for at, opcode, slot, length in gloo_ops.operations(streams[0]) if streams else []:
            size = GLOO_PREAMBLE + (
                length if opcode not in (gloo_ops.NOTIFY_SEND_READY, gloo_ops.NOTIFY_RECV_READY) else 0
            )
            first, last = self.passed(src, dst, at), self.passed(src, dst, at + size - 1)
            if first is None or last is None:
                raise Unobserved(f"the capture's times do not cover what rank {src} sent rank {dst}")
            found.append((first, last, opcode, slot, length))
        return found

    def crossed(self, src: int, dst: int, by: float) -> int:
        """Bytes from ``src`` to ``dst`` that had crossed by time ``by`` (that time's segments included)."""
        return sum(n for t, a, b, n in self._all() if (a, b) == (src, dst) and t <= by)

    def passed(self, src: int, dst: int, position: int) -> float | None:
        """When the data from ``src`` to ``dst`` first went past its ``position``-th byte (the time of
        the segment that carried byte ``position + 1``), or None if it never did.  TCP keeps a
        direction's bytes in order, so a byte's position says which of gloo's operations it belongs
        to whatever the segments were cut or packed into."""
        total = 0
        for t, a, b, n in self._all():
            if (a, b) == (src, dst):
                total += n
                if total > position:
                    return t
        return None


def _plain(address: str) -> str:
    """An IPv4-mapped IPv6 address as the IPv4 one it travels as (``[::ffff:1.2.3.4]:5`` -> ``1.2.3.4:5``)."""
    return address[8:].replace("]:", ":", 1) if address.startswith("[::ffff:") and "." in address else address


def timeline(
    segments, after: dict[tuple[str, str], Socket], pids: list[int], owner: dict[int, int], payloads=None
) -> Timeline:
    """The segments a capture saw (time, source address, destination address, bytes), kept where
    both ends are ranks' sockets in ``after`` (``snapshot``, by ``owner``: inode -> pid), as a
    Timeline of ranks; with ``payloads`` (each segment's (sequence number, data), in the same order), what each
    connection carried too (``Timeline.data``)."""
    rank_of = {pid: r for r, pid in enumerate(pids)}
    sender = {(_plain(s.local), _plain(s.peer)): rank_of.get(owner.get(s.inode)) for s in after.values()}
    kept, carried = [], {}
    for i, (t, src, dst, size) in enumerate(segments):
        a, b = sender.get((src, dst)), sender.get((dst, src))
        if a is not None and b is not None and a != b:
            kept.append((t, a, b, size))
            if payloads is not None:
                carried.setdefault((a, b), {}).setdefault((src, dst), []).append(payloads[i])
    start = kept[0][0] if kept else 0.0
    data = links = None
    if payloads is not None:  # (a pair one of whose segments' data was not kept: what it carried is unobserved)
        data = {
            pair: [_joined(parts) for parts in by_connection.values()]
            for pair, by_connection in carried.items()
            if all(p is not None for parts in by_connection.values() for _, p in parts)
        }
        data = {**dict.fromkeys(carried), **data}
        links = {pair: ["|".join(sorted(ends)) for ends in by_connection] for pair, by_connection in carried.items()}
    segments = [(round(t - start, 6), a, b, n) for t, a, b, n in kept]
    return Timeline(segments=segments, data=data, origin=start, links=links)


def _joined(parts: list[tuple[int, bytes]]) -> bytes:
    """A connection's bytes from its segments' (sequence number, payload), each put where its
    sequence number says (relative to the first segment seen, modulo 2**32): a segment TCP sent
    again, whole or from its middle (a retransmission after part of it was acknowledged), lands on
    the bytes it repeats instead of being appended twice."""
    base, placed = parts[0][0], []
    for seq, payload in parts:
        offset = (seq - base) & 0xFFFFFFFF
        if offset < 1 << 31:  # (at or after the first segment seen: never before it, for a new connection)
            placed.append((offset, payload))
    joined = bytearray(max(offset + len(payload) for offset, payload in placed))
    for offset, payload in placed:
        joined[offset : offset + len(payload)] = payload
    return bytes(joined)
