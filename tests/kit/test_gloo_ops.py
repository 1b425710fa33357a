"""gloo_ops: a connection's captured bytes read as gloo's operations (the payload of each send),
the handshake and notes skipped, and anything else refused whole: the bytes come from the
student's processes."""

from __future__ import annotations

import struct

import pytest

from disttrain_lab import gloo_ops


def _op(opcode: int, payload: bytes = b"", length: int | None = None) -> bytes:
    length = len(payload) if length is None else length
    nbytes = gloo_ops.PREAMBLE + len(payload) if opcode in (0, 1) else gloo_ops.PREAMBLE
    return struct.pack("<6Q", nbytes, opcode, 0, 0, length, 0) + payload


def test_sends_are_read_and_notes_and_the_handshake_skipped():
    stream = _op(2, length=4) + _op(1, b"abcd") + _op(3, length=2) + _op(0, b"xy") + _op(1, b"")
    assert gloo_ops.messages(stream) == [b"abcd", b"xy", b""]
    assert gloo_ops.messages(struct.pack("<Q", 1) + stream) == [b"abcd", b"xy", b""]  # the initiator's handshake
    assert gloo_ops.messages(struct.pack("<Q", 0)) == []  # a connection that carried nothing else
    assert gloo_ops.messages(b"") == []


def test_operations_keep_the_notes_in_order_with_their_offsets():
    """``operations``: the notes too (when a send or a receive was posted: lab 1's tree rounds), each at the
    offset of its preamble in the connection's bytes, past the handshake where the stream begins with it."""
    stream = _op(2, length=4) + _op(1, b"abcd") + _op(3, length=2)
    expected = [(0, 2, 0, 4), (48, 1, 0, 4), (100, 3, 0, 2)]
    assert gloo_ops.operations(stream) == expected
    assert gloo_ops.operations(struct.pack("<Q", 1) + stream) == [(at + 8, *rest) for at, *rest in expected]
    with pytest.raises(gloo_ops.NotGloo):
        gloo_ops.operations(stream[:-1])


@pytest.mark.parametrize(
    "stream",
    [
        _op(1, b"abcd")[:-1],  # a payload cut short
        _op(1, b"abcd") + b"\0" * 20,  # bytes after the last operation
        struct.pack("<6Q", 2**62, 1, 0, 0, 2**62 - 48, 0),  # a size far past what is there
        struct.pack("<6Q", 48, 7, 0, 0, 0, 0),  # no such opcode
        struct.pack("<6Q", 60, 1, 0, 0, 4, 0) + b"abcdefgh",  # nbytes and length disagree
        struct.pack("<6Q", 52, 2, 0, 0, 4, 0) + b"abcd",  # a note with a payload
        b"\xff" * 200,
    ],
    ids=["cut", "trailing", "huge", "opcode", "sizes", "note_with_data", "junk"],
)
def test_anything_but_gloos_operations_whole_is_refused(stream):
    with pytest.raises(gloo_ops.NotGloo):
        gloo_ops.messages(stream)
