"""A ``torch.distributed`` call read from its arguments: what it is, with whom, and how many bytes.

The tracer's wrappers (``disttrain_lab.trace``) bind each call's arguments to the names of
torch's own parameters and hand them here.  :func:`call_info` says what the call is: its kind
(``p2p``, ``collective`` or ``setup``, from the op tables in ``disttrain_lab.events``), its
peer as a global rank (``group_dst``/``group_src`` translated through the group; a rooted
collective's root), its group's ranks, the bytes of its payload, its tag, and, when a launch
is traced, what an ``Event`` keeps beside them in ``meta`` (the reduce op, a tensor's dtype
and shape, the memory a message's buffer lies in, a collective's input and output bytes where
they differ).  :func:`check_peer` refuses a send or receive to a rank that does not exist,
before gloo would wait for it forever.  The emulated network (``disttrain_lab.emulation``)
sizes its messages with :func:`payload_bytes`.

Every function here reads its arguments and returns: nothing is recorded, nothing wrapped,
no state is kept.  The recorder and the wrappers that call these are ``disttrain_lab.trace``.
"""

from __future__ import annotations

import operator

from .events import IN_ARGS, OUT_ARGS, P2P_OPS, SETUP_OPS


def payload_bytes(x) -> int:
    """The logical payload of a call's argument: bytes of a tensor or a list of tensors (0 for anything else)."""
    if x is None:
        return 0
    if isinstance(x, (list, tuple)):
        return sum(payload_bytes(t) for t in x)
    try:
        return x.numel() * x.element_size()
    except AttributeError:
        return 0


def buffer_span(t) -> tuple[int, int, int] | None:
    """(storage address, first byte, end byte) of a tensor: which messages share memory."""
    try:
        start = t.storage_offset() * t.element_size()
        return t.untyped_storage().data_ptr(), start, start + t.numel() * t.element_size()
    except (AttributeError, RuntimeError):
        return None


def group_ranks(group) -> tuple[int, ...] | None:
    """The global ranks of a call's group, in the group's order: None for the world group (its
    ranks are the global ones) and for an object torch does not know as a group."""
    if group is None:
        return None
    import torch.distributed as dist

    if group is dist.GroupMember.WORLD:
        return None
    try:
        return tuple(dist.get_process_group_ranks(group))
    except Exception:
        return None


def call_info(op: str, bound: dict, full: bool) -> tuple:
    """(kind, peer, group, nbytes, tag, meta) of one call from its bound arguments."""
    kind = "p2p" if op in P2P_OPS else "setup" if op in SETUP_OPS else "collective"
    group = group_ranks(bound.get("group"))
    peer = None
    for key in ("dst", "src"):
        if bound.get(key) is not None:
            peer = bound[key]
    if peer is None:
        for key in ("group_dst", "group_src"):
            if bound.get(key) is not None:
                peer = group[bound[key]] if group else bound[key]
    if peer is None and op in ("broadcast", "reduce", "scatter", "gather"):
        peer = 0
    nin = max((payload_bytes(bound.get(k)) for k in IN_ARGS), default=0)
    nout = max((payload_bytes(bound.get(k)) for k in OUT_ARGS), default=0)
    meta = {}
    if not full:  # status only: the fields a deadlock report needs
        return kind, peer, group, max(nin, nout), bound.get("tag"), meta
    if kind == "p2p":
        meta["buffer"] = buffer_span(bound.get("tensor"))
    if bound.get("op") is not None:
        meta["reduce_op"] = str(bound["op"]).split(".")[-1]
    if nin and nout and nin != nout:
        meta["in_bytes"], meta["out_bytes"] = nin, nout
    tensor = bound.get("tensor")
    if tensor is not None and hasattr(tensor, "dtype"):
        meta["dtype"] = str(tensor.dtype).replace("torch.", "")
        meta["shape"] = tuple(tensor.shape)
    return kind, peer, group, max(nin, nout), bound.get("tag"), meta


def check_peer(op: str, peer, group) -> None:
    """Refuse a point-to-point call to a rank that is not there (``group``: the ranks of
    :func:`group_ranks`, or None for the world): gloo would wait for it forever."""
    import torch.distributed as dist

    valid = list(group) if group is not None else list(range(dist.get_world_size()))
    try:
        ok = operator.index(peer) in valid  # numpy integers are fine ranks too
    except TypeError:
        ok = False
    if not ok:
        side = "dst" if op in ("send", "isend") else "src"
        raise ValueError(
            f"{op}({side}={peer!r}): there is no rank {peer!r} to talk to; valid ranks are "
            f"{valid[0]}..{valid[-1]}"
            + (f" (the group {valid})" if group is not None else f" (world_size={len(valid)})")
        )
