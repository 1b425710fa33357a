"""A connection's bytes read as gloo's operations: which messages of data it carried.

Gloo's TCP pairs (``gloo/transport/tcp/pair.h``, ``Op``) put a 48-byte preamble before every
operation, six native 64-bit integers::

    nbytes   the operation's size on the wire: the preamble, plus the payload for a send
    opcode   0 SEND_BUFFER, 1 SEND_UNBOUND_BUFFER (what torch's send/isend use),
             2 NOTIFY_SEND_READY, 3 NOTIFY_RECV_READY (notes, the preamble alone)
    slot, offset, length, roffset
             where the data goes; ``length`` is the payload's size (a note says the size it is about)

and the side that opens a connection first sends its 8-byte sequence number (the handshake).
A point-to-point message of P bytes is therefore, from its sender, a note (48) and then
preamble + P, and from its receiver a note (48): ``wire.protocol_bytes``.

The bytes come from the student's processes, so they are read as untrusted data: every size is
checked against what is left, and a stream that is not gloo's framing, whole, is refused
(``NotGloo``): the test that reads it fails, it is never read in part.  Nothing here is
evaluated; a payload is returned as bytes for the grader to compare.
"""

from __future__ import annotations

import struct

__all__ = [
    "NOTIFY_RECV_READY",
    "NOTIFY_SEND_READY",
    "PREAMBLE",
    "HANDSHAKE",
    "NotGloo",
    "messages",
    "operations",
    "sends",
]

PREAMBLE = 48  # bytes before every operation of gloo's TCP pairs (gloo/transport/tcp/pair.h: Op::preamble)
HANDSHAKE = 8  # gloo opens each connection as a launch's process group is made: 8 bytes one way
# (gloo/transport/tcp: the initiator sends its sequence number), before the ranks' function runs
_SENDS = (0, 1)  # SEND_BUFFER, SEND_UNBOUND_BUFFER: a payload follows
NOTIFY_SEND_READY, NOTIFY_RECV_READY = 2, 3  # the notes: the preamble alone
_NOTES = (NOTIFY_SEND_READY, NOTIFY_RECV_READY)
_FIELDS = struct.Struct("<6Q")


class NotGloo(ValueError):
    """A connection's bytes are not a whole sequence of gloo's operations."""


def _read(stream: bytes, start: int, notes: list | None = None) -> list[tuple[int, int, bytes]]:
    """The sends from ``start`` on: (offset, slot, payload); each note too, into ``notes`` where given:
    (offset, opcode, slot, length)."""
    payloads, at = [], start
    while at < len(stream):
        if len(stream) - at < PREAMBLE:
            raise NotGloo(f"{len(stream) - at} bytes at offset {at} are too few for a {PREAMBLE}-byte preamble")
        nbytes, opcode, slot, _offset, length, _roffset = _FIELDS.unpack_from(stream, at)
        if opcode in _SENDS:
            if nbytes != PREAMBLE + length or length > len(stream) - at - PREAMBLE:
                raise NotGloo(
                    f"a send at offset {at} says {nbytes} bytes with a payload of {length}; "
                    f"{len(stream) - at} bytes are left"
                )
            payloads.append((at, slot, stream[at + PREAMBLE : at + nbytes]))
            at += nbytes
        elif opcode in _NOTES and nbytes == PREAMBLE:
            if notes is not None:
                notes.append((at, opcode, slot, length))
            at += PREAMBLE
        else:
            raise NotGloo(f"no gloo operation at offset {at} (opcode {opcode}, {nbytes} bytes)")
    return payloads


def messages(stream: bytes) -> list[bytes]:
    """The payload of every send in one direction of a connection, in the order they crossed
    (``stream``: that direction's bytes, whole, as ``wiretimeline.Timeline.data`` joins them).  The
    handshake, where the stream begins with it, and the notes are skipped.  Raises ``NotGloo``
    if the bytes are not gloo's operations from the first to the last byte.

    >>> note = _FIELDS.pack(48, 2, 0, 0, 4, 0)
    >>> messages(note + _FIELDS.pack(52, 1, 0, 0, 4, 0) + b"abcd")
    [b'abcd']
    """
    return [payload for _, _, payload in sends(stream)]


def sends(stream: bytes) -> list[tuple[int, int, bytes]]:
    """``messages``, each as (the offset in ``stream`` where its operation's preamble begins, its slot,
    its payload).  A test that reads what crossed between two moments keeps the sends whose bytes lie
    between the stream's positions then (``wiretimeline.Timeline.sends_between``).  The slot names the
    operation a message belongs to: torch's gloo process group gives each collective call a tag of its
    own, and every message of that call carries a slot made from it (measured on torch 2.13: the
    messages of one all-reduce of B bytes on N ranks carry 2·(N − 1)·B bytes of payload in all)."""
    try:
        return _read(stream, 0)
    except NotGloo as e:
        if len(stream) < HANDSHAKE:
            raise
        try:
            return _read(stream, HANDSHAKE)
        except NotGloo:
            raise e from None


def operations(stream: bytes) -> list[tuple[int, int, int, int]]:
    """Every operation in one direction of a connection, notes too, in order: (the offset of its preamble,
    its opcode, its slot, its payload's length: a note's, the length it is about).  A sender posts a send with
    a ``NOTIFY_SEND_READY`` note at once, whether or not its receiver is ready (its data follows once the
    receiver's ``NOTIFY_RECV_READY`` has come), so a note's time on the wire is when the rank posted that
    send (lab 1's tree rounds).  Raises ``NotGloo`` as :func:`messages` does.

    >>> note = _FIELDS.pack(48, 2, 7, 0, 4, 0)
    >>> operations(note + _FIELDS.pack(52, 1, 7, 0, 4, 0) + b"abcd")
    [(0, 2, 7, 4), (48, 1, 7, 4)]
    """
    for start in (0, HANDSHAKE):
        notes: list = []
        try:
            sent = _read(stream, start, notes)
        except NotGloo:
            if start or len(stream) < HANDSHAKE:
                raise
            continue
        ops = notes + [(at, _FIELDS.unpack_from(stream, at)[1], slot, len(payload)) for at, slot, payload in sent]
        return sorted(ops)
    raise AssertionError("unreachable")
