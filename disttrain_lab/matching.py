"""The call log: the last collectives each rank entered, compared across ranks by the launcher.

Every rank of a group must call the same collectives in the same order, each with the same
root and dtype and, for most, the same size.  gloo does not check: an ``all_reduce`` of 4
floats on one rank against 3 on another returns on one rank (with a wrong result) and blocks
the other until the timeout; float32 against float16 aborts the process from C++
(``gloo::EnforceNotMet``).  torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks by running an
extra collective before each one.  The kit checks without one: each rank notes every
collective it enters (:func:`note`, a few bytes in its status slot, the memory it shares with
the launcher), and the launcher compares the ranks' notes (:func:`find_mismatch`) as soon as
one rank has been inside a collective for a second, or has died, and names each rank's call,
values and line.

Layout: after a slot's status text (``status.py``), ``ENTRIES`` entries, the n-th collective a
rank entered in this launch at index n % ENTRIES::

    [uint32 n (0: empty)][uint32 k: its place among its group's collectives][uint64 group]
    [op][dtype][int64 elements, -1: not compared][int32 root, -1: none][function][uint32 line]
"""

from __future__ import annotations

import functools
import hashlib
import struct
import sys
from dataclasses import dataclass

from .codemap import is_library
from .status import SLOT_BYTES, TEXT_BYTES

ENTRIES = 8
_N = struct.Struct("=I")
_ENTRY = struct.Struct("=IIQ24s12sqi28sI")
assert TEXT_BYTES + ENTRIES * _ENTRY.size <= SLOT_BYTES

# the tensor whose size every rank must match, by op (the others: all_to_all's splits, a
# scatter's or gather's list on the root only, may differ between ranks)
SAME_SIZE = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "reduce_scatter": "output",
    "reduce_scatter_tensor": "output",
}
ROOTED = ("broadcast", "reduce", "scatter", "gather")
_DTYPE_ARGS = ("tensor", "input_tensor", "output", "input", "output_tensor")


@dataclass(frozen=True)
class Call:
    """One collective a rank entered, as its call log keeps it."""

    rank: int
    n: int  # the rank's n-th collective in this launch (1-based)
    k: int  # the k-th of its group (1-based)
    group: int  # hash of the group's ranks (0: the whole world)
    op: str
    dtype: str
    elements: int  # -1: not compared for this op
    root: int  # -1: no root
    function: str  # the student's function that called it ("" if none)
    line: int


@functools.lru_cache(maxsize=256)
def group_key(group: tuple | None) -> int:
    """The same number in every rank for the same group, None for the whole world (a tuple of
    the group's ranks and its name: ints' and strs' hashes differ between processes, so blake2b)."""
    if group is None:
        return 0
    digest = hashlib.blake2b(repr(group).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def clear(buf, rank: int) -> None:
    """Forget the rank's collectives (at the start of each launch)."""
    off = rank * SLOT_BYTES + TEXT_BYTES
    buf[off : off + ENTRIES * _ENTRY.size] = bytes(ENTRIES * _ENTRY.size)


def _caller() -> tuple[str, int]:
    """The innermost function outside torch, the kit and other libraries on this stack."""
    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            break
        if not is_library(frame.f_code.co_filename):
            return frame.f_code.co_name, frame.f_lineno
        frame = frame.f_back
    return "", 0


def note(buf, rank: int, n: int, k: int, group: tuple | None, op: str, bound: dict, root) -> None:
    """Record that ``rank`` enters its ``n``-th collective, the ``k``-th of ``group``, ``op``
    with the arguments ``bound`` (by name) and ``root`` (src or dst of a rooted op)."""
    same = SAME_SIZE.get(op)
    tensor = bound.get(same) if same else None
    elements = tensor.numel() if tensor is not None and hasattr(tensor, "numel") else -1
    dtype = ""
    for name in _DTYPE_ARGS:
        t = bound.get(name)
        if t is not None and hasattr(t, "dtype"):
            dtype = str(t.dtype).replace("torch.", "")
            break
    root = root if op in ROOTED and isinstance(root, int) else -1
    function, line = _caller()
    off = rank * SLOT_BYTES + TEXT_BYTES + (n % ENTRIES) * _ENTRY.size
    # the entry first, then its number: a reader never takes a half-written entry for a whole one
    _ENTRY.pack_into(
        buf,
        off,
        0,
        k,
        group_key(group),
        op.encode()[:24],
        dtype.encode()[:12],
        elements,
        root,
        function.encode()[:28],
        line,
    )
    _N.pack_into(buf, off, n)


def calls(buf, rank: int) -> list[Call]:
    """The collectives the rank's call log holds, in the order entered.  The slot is written by
    the rank's own process: whatever is there is read as data, never trusted to be well-formed."""
    out = []
    base = rank * SLOT_BYTES + TEXT_BYTES
    for i in range(ENTRIES):
        off = base + i * _ENTRY.size
        raw = bytes(buf[off : off + _ENTRY.size])
        if len(raw) < _ENTRY.size:
            break
        n, k, group, op, dtype, elements, root, function, line = _ENTRY.unpack(raw)
        if n == 0 or _N.unpack_from(buf, off)[0] != n:
            continue

        def text(b: bytes) -> str:
            return b.rstrip(b"\0").decode(errors="replace")

        out.append(Call(rank, n, k, group, text(op), text(dtype), elements, root, text(function), line))
    return sorted(out, key=lambda c: c.n)


@dataclass(frozen=True)
class Mismatch:
    """Ranks whose calls of one collective (the same place in the same group) cannot match:
    ``what`` is "ops", "sizes", "dtypes" or "roots", or "missing" when ``returned`` ranks
    returned without calling it.  (Data: ``reports.mismatch_error`` says it to the student.)"""

    calls: list[Call]
    what: str
    returned: tuple[int, ...] = ()


def _differ(a: Call, b: Call) -> str | None:
    if a.op != b.op:
        return "ops"
    if a.dtype and b.dtype and a.dtype != b.dtype:
        return "dtypes"
    if a.elements >= 0 and b.elements >= 0 and a.elements != b.elements:
        return "sizes"
    if a.root != b.root:
        return "roots"
    return None


def find_mismatch(slots, ranks: list[int], stuck: list[int], returned: list[int] = ()) -> Mismatch | None:
    """The first mismatch between the collective each rank of ``stuck`` is in (its latest) and
    the same collective (same group, same place in it) of every other rank of ``ranks``; or, for
    a collective of the whole world, ranks of ``returned`` (those that returned) that never called it.
    ``slots[r]``: rank r's status mapping (each rank has its own)."""
    logs = {r: calls(slots[r], r) for r in ranks}
    for r in stuck:
        if not logs.get(r):
            continue
        mine = logs[r][-1]
        same = [mine]
        for other in ranks:
            if other == r:
                continue
            theirs = next((c for c in logs[other] if (c.group, c.k) == (mine.group, mine.k)), None)
            if theirs is None:
                continue
            same.append(theirs)
            what = _differ(mine, theirs)
            if what is not None:
                found = [c for o in ranks for c in logs[o] if (c.group, c.k) == (mine.group, mine.k)]
                return Mismatch(sorted(found, key=lambda c: c.rank), what)
        if mine.group == 0:
            never = [
                o
                for o in returned
                if o != r
                and not any(c.k >= mine.k for c in logs[o] if c.group == 0)
                and (not logs[o] or logs[o][0].n == 1)  # all it entered is still in its call log
            ]
            if never:
                return Mismatch(sorted(same, key=lambda c: c.rank), "missing", tuple(never))
    return None
