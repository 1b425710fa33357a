"""The status slot: what each rank is blocked in, readable by the launcher at any time.

A few bytes per rank of memory shared with the launcher: the recorder writes the call a rank
enters (``write_status``) and clears it when the call returns, so a launch that times out can
say ``rank 0: recv(src=1) for 30 s`` (``read_status``).  It also counts the calls a rank has
entered (``read_calls``): read twice, a moment apart, the count tells a rank that is still
making calls (a loop that never ends) from one stuck in a call (a deadlock).
Layout per rank: [float64 since][uint64 calls][uint16 length][utf-8 text]; since == 0 means idle;
after the first ``TEXT_BYTES``, the rank's call log of its last collectives (``matching.py``).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

from .events import describe_call

SLOT_BYTES = 1024  # per rank
TEXT_BYTES = 256  # of which the status (the rest: matching.py's)
_HEAD = struct.Struct("=dQH")  # since, calls entered so far, length of the text


def write_status(buf, rank: int, text: str | None) -> None:
    """The rank enters the call ``text`` (``status_text``), or (None) has left it.  Only the
    rank writes its slot; the launcher reads it from another process at any time."""
    off = rank * SLOT_BYTES
    _, calls, length = _HEAD.unpack_from(buf, off)
    if text is None:
        _HEAD.pack_into(buf, off, 0.0, calls, length)
        return
    raw = text.encode()[: TEXT_BYTES - _HEAD.size]
    buf[off + _HEAD.size : off + _HEAD.size + len(raw)] = raw
    _HEAD.pack_into(buf, off, time.perf_counter(), calls + 1, len(raw))


def read_calls(buf, rank: int) -> int:
    """How many torch.distributed calls the rank has entered (in this pool's life)."""
    return _HEAD.unpack_from(buf, rank * SLOT_BYTES)[1]


@dataclass
class Blocked:
    """What a rank is blocked in, read from its status slot."""

    op: str  # "recv", "send", "all_reduce", or "wait:irecv" for a wait on an irecv
    peer: int | None
    tag: int
    text: str  # human form: "recv(src=1, 16 B)"
    since: float  # perf_counter when it started
    group: tuple[int, ...] | None = None  # the ranks of its group; None: the whole world


def status_text(op: str, peer, tag, nbytes, group) -> str:
    # raw fields only: formatting happens in read_status, off the hot path
    return f"{op}\t{'' if peer is None else peer}\t{tag or 0}\t{nbytes}\t{','.join(map(str, group or ()))}"


def read_status(buf, rank: int) -> Blocked | None:
    """What the rank is blocked in, or None when it is not inside a torch.distributed call."""
    off = rank * SLOT_BYTES
    since, _, n = _HEAD.unpack(bytes(buf[off : off + _HEAD.size]))
    if since == 0:
        return None
    raw = bytes(buf[off + _HEAD.size : off + _HEAD.size + n]).decode(errors="replace")
    try:
        op, peer, tag, nbytes, group = raw.split("\t", 4)
        peer = int(peer) if peer else None
        group = tuple(int(g) for g in group.split(",")) if group else None
        text = describe_call(op.split(":")[-1], peer, int(tag), int(nbytes), group)
        if op.startswith("wait:"):
            text = f"wait on {text}"
        return Blocked(op, peer, int(tag), text, since, group)
    except ValueError:
        return Blocked("?", None, 0, raw, since)
