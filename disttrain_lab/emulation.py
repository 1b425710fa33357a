"""The emulated network inside a rank: what makes ``dl.launch(..., network=...)`` slow.

``disttrain_lab.network`` holds the model (``dl.Network``: α, β, the tiers and what each
collective costs); this module is what runs inside a launched rank to make every
``torch.distributed`` call on CPU tensors take at least the model's time.  The rank side of
a launch calls, on every rank:

    emulation.begin(network, world_size)   # clocks, the shared board, trace.install(emulate=wrap, ...)
    fn(*args, **kwargs)                    # the student's code: every call is slowed
    emulation.end(network)                 # trace.install(): torch's own functions, traced

``begin`` hands the tracer the wrappers (``wrap``) and the hook that tells it each call's
model time (``take_last_cost``); the tracer never imports this module.  How the time is
enforced (two port clocks per rank and tier, a board of arrival times in shared memory) is
described in ``disttrain_lab.network``'s docstring and beside the classes below.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import mmap
import os
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from . import callargs, trace
from .network import Network

__all__ = ["begin", "end", "wrap", "take_last_cost"]


# --------------------------------------------------------------------------------------
# The board: when each message in flight arrives, shared by the ranks of a launch
# --------------------------------------------------------------------------------------
_SLOTS = 256  # per (sender, receiver) pair: messages in flight whose arrival time is kept


class _Board:
    """Shared memory of all ranks of a launch: when each message in flight arrives.

    ``times[src, dst, slot] = (tag, sequence number, arrival)``; only ``src`` writes its row,
    only ``dst`` reads it.  The sender hands its data to gloo at once and writes when the
    emulated link will have carried it; the receiver waits until then.  So the real copy
    overlaps the emulated transfer, and nothing is seen early.  Rank 0 creates the memory
    (a memfd: no file anywhere, gone with the last rank); the others open it through /proc.
    Must be created on all ranks.
    """

    def __init__(self, world_size: int) -> None:
        # torch's own barrier: neither traced nor emulated (this is the emulation's set-up)
        barrier = trace.genuine_of(dist.barrier)
        store = dist.distributed_c10d._get_default_store()
        nbytes = world_size * world_size * _SLOTS * 3 * 8
        rank = dist.get_rank()
        if rank == 0:
            fd = os.memfd_create("disttrain-lab-network")
            os.ftruncate(fd, nbytes)
            store.set("disttrain-lab/network-board", f"{os.getpid()}:{fd}")
        else:
            pid, theirs = store.get("disttrain-lab/network-board").decode().split(":")
            fd = os.open(f"/proc/{pid}/fd/{theirs}", os.O_RDWR)
        try:
            self.memory = mmap.mmap(fd, nbytes)
        finally:
            barrier()  # everyone has it mapped: the fd may go
            os.close(fd)
        self.times = np.ndarray((world_size, world_size, _SLOTS, 3), dtype=np.float64, buffer=self.memory)
        if rank == 0:
            self.times[..., 1] = -1.0  # no message in any slot
        barrier()
        self.rank = rank
        self.sent: dict[tuple, int] = {}  # (dst, tag) -> messages sent
        self.posted: dict[int, int] = {}  # dst -> slots used
        self.received: dict[tuple, int] = {}  # (src, tag) -> messages received

    def post(self, dst: int, tag: int, arrival: float) -> None:
        seq = self.sent.get((dst, tag), 0)
        self.sent[(dst, tag)] = seq + 1
        slot = self.posted.get(dst, 0)
        self.posted[dst] = slot + 1
        entry = self.times[self.rank, dst, slot % _SLOTS]
        entry[1] = -1.0  # invalid while being written
        entry[0], entry[2] = tag, arrival
        entry[1] = seq

    def expect(self, src: int, tag: int) -> int:
        """The sequence number of the next receive from ``src`` with ``tag``: taken when the
        receive is posted (gloo pairs receives with sends in the order they are posted, so
        irecvs waited in another order still get their own message's arrival)."""
        seq = self.received.get((src, tag), 0)
        self.received[(src, tag)] = seq + 1
        return seq

    def arrival(self, src: int, tag: int, seq: int) -> float:
        """When message number ``seq`` from ``src`` with ``tag`` arrives (0.0 if it was not posted)."""
        row = self.times[src, self.rank]
        hits = np.flatnonzero((row[:, 1] == seq) & (row[:, 0] == tag))
        return float(row[hits[0], 2]) if len(hits) else 0.0

    def close(self) -> None:
        del self.times
        self.memory.close()


# --------------------------------------------------------------------------------------
# The ports: this rank's clocks, one per tier of the network
# --------------------------------------------------------------------------------------
class _Clock:
    """One port of this rank (one tier's link): perf_counter seconds at which each direction is free."""

    def __init__(self, duplex: str) -> None:
        self.half = duplex == "half"
        self.out_free = self.in_free = 0.0


class _Ports:
    """This rank's ports, one per tier of the network, and the call in progress."""

    def __init__(self, network: Network, world_size: int, board: _Board | None, rank: int) -> None:
        self.network, self.world_size, self.board, self.rank = network, world_size, board, rank
        self.clocks = {"intra": _Clock(network.duplex)}
        if network.inter is not None:
            self.clocks["inter"] = _Clock(network.inter.duplex)
        self.lock = threading.Lock()  # futures of async collectives complete on gloo's threads
        self.last_cost = None  # the model time of the call in progress, for the tracer
        self.depth = 0  # > 0 inside torch's function: calls it makes are not charged again

    @contextlib.contextmanager
    def inside(self):
        # torch's send is isend(...).wait(), recv is irecv(...).wait(): charge the outer call only
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def message_time(self, peer: int | None, nbytes: int) -> float:
        """The model's seconds for a message to or from ``peer`` (None, any source: the link inside a node)."""
        return self.network.link(self.rank, peer).time(nbytes) if peer is not None else self.network.time(nbytes)

    def reserve_out(self, cost: float, tier: str) -> float:
        """Hold the out-port of ``tier`` for ``cost`` seconds from when it is free; return when that ends."""
        with self.lock:
            c = self.clocks[tier]
            start = max(time.perf_counter(), c.out_free, c.in_free if c.half else 0.0)
            c.out_free = start + cost
            if c.half:
                c.in_free = c.out_free
            return c.out_free

    def take_in(self, cost: float, arrival: float, tier: str) -> float:
        """A message of model time ``cost`` that its sender's link finished at ``arrival`` is
        complete no earlier than then, nor than ``cost`` after the in-port's previous message
        (half duplex: after the port's previous transfer)."""
        with self.lock:
            c = self.clocks[tier]
            busy_until = max(c.in_free, c.out_free if c.half else 0.0)
            end = max(time.perf_counter(), arrival, busy_until + cost)
            c.in_free = end
            if c.half:
                c.out_free = end
            return end

    def received(self, src: int | None, tag: int, seq: int | None, cost: float) -> float:
        """When the message ``seq`` from ``src`` is complete here: its arrival on the board
        (none without a board or a known sender), then through this rank's in-port."""
        arrival = self.board.arrival(src, tag, seq) if seq is not None else 0.0
        tier = self.network.tier(self.rank, src) if src is not None else "intra"
        return self.take_in(cost, arrival, tier)

    def reserve_both(self, cost: float, since: float, tier: str) -> float:
        """A collective holds both directions of ``tier`` for ``cost`` from max(since, ports free)."""
        with self.lock:
            c = self.clocks[tier]
            start = max(since, c.out_free, c.in_free)
            c.out_free = c.in_free = start + cost
            return start + cost

    def collective_cost(self, op: str, nbytes: int, group) -> tuple[str, float]:
        """(tier, seconds) of collective ``op`` on ``nbytes`` over ``group`` (None: the world)."""
        world = dist.get_world_size(group) if group is not None else dist.get_world_size()
        ranks = None
        if self.network.inter is not None:  # two tiers: which ranks the group holds decides its tier
            ranks = dist.get_process_group_ranks(group) if group is not None else range(world)
        return self.network.collective_tier(op, nbytes, world, ranks)


_STATE: _Ports | None = None  # this rank's ports while a network is emulated (begin .. end)


# --------------------------------------------------------------------------------------
# Waiting for the model's time
# --------------------------------------------------------------------------------------
def _sleep_until(deadline: float) -> None:
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left)


class _DelayedWork:
    """The Work of an emulated async call: ``wait()``/``get_future()`` finish at the model's time."""

    def __init__(self, work, finish) -> None:
        self._work, self._finish = work, finish  # finish(): the emulated end (called after the real end)

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        _sleep_until(self._finish())
        return out

    def get_future(self):
        delayed = torch.futures.Future()

        def arrived(fut):
            # runs on a gloo worker thread: never sleep there (callbacks chained on the future,
            # PowerSGD's among them, wait for further collectives that need those threads);
            # a timer thread completes the future at the emulated end instead
            def complete():
                try:
                    delayed.set_result(fut.value())
                except Exception as exc:  # noqa: BLE001  (the collective's error, passed on)
                    delayed.set_exception(exc)

            wait = self._finish() - time.perf_counter()
            if wait <= 0:
                complete()
            else:
                timer = threading.Timer(wait, complete)
                timer.daemon = True
                timer.start()

        self._work.get_future().add_done_callback(arrived)
        return delayed

    def is_completed(self) -> bool:
        return self._work.is_completed() and time.perf_counter() >= self._finish()

    def __getattr__(self, name):
        return getattr(self._work, name)


def _once(compute):
    """``compute()`` on the first call, the same value after (a port is charged once)."""
    memo = []

    def get():
        if not memo:
            memo.append(compute())
        return memo[0]

    return get


# --------------------------------------------------------------------------------------
# The wrappers around torch's functions: send, receive, collective
# --------------------------------------------------------------------------------------
def _is_cpu(tensors) -> bool:
    for t in tensors:
        device = getattr(t, "device", None)
        if device is not None and device.type != "cpu":
            return False
    return True


def _global_peer(bound: dict, key: str):
    peer = bound.get(key)
    if peer is None and bound.get("group_" + key) is not None:
        peer = dist.get_global_rank(bound.get("group") or dist.group.WORLD, bound["group_" + key])
    return peer


def _emulated_send(op: str, fn, params: list[str]):
    """``send``/``isend`` (torch's ``fn``): book the out-port, post the arrival, hand gloo the data."""

    @functools.wraps(fn)
    def send(*args, **kwargs):
        ports = _STATE
        bound = {**dict(zip(params, args)), **kwargs}
        tensor = bound.get("tensor")
        if ports is None or ports.depth or not _is_cpu([tensor]):
            return fn(*args, **kwargs)
        dst = _global_peer(bound, "dst")
        cost = ports.message_time(dst, callargs.payload_bytes(tensor))
        ports.last_cost = cost
        arrival = ports.reserve_out(cost, ports.network.tier(ports.rank, dst))
        if ports.board is None:  # no shared board (torchrun): the data leaves late
            _sleep_until(arrival)
            with ports.inside():
                return fn(*args, **kwargs)
        ports.board.post(dst, bound.get("tag") or 0, arrival)
        with ports.inside():
            out = fn(*args, **kwargs)
        if op == "send":
            _sleep_until(arrival)
            return out
        return _DelayedWork(out, lambda: arrival)

    return send


def _emulated_recv(op: str, fn, params: list[str]):
    """``recv``/``irecv`` (torch's ``fn``): done no earlier than the message's arrival on the board."""

    @functools.wraps(fn)
    def recv(*args, **kwargs):
        ports = _STATE
        bound = {**dict(zip(params, args)), **kwargs}
        tensor = bound.get("tensor")
        if ports is None or ports.depth or not _is_cpu([tensor]):
            return fn(*args, **kwargs)
        src, tag = _global_peer(bound, "src"), bound.get("tag") or 0
        nbytes = callargs.payload_bytes(tensor)
        # the sequence number of an irecv is taken now, when it is posted, not at its wait()
        seq = ports.board.expect(src, tag) if ports.board is not None and src is not None else None
        cost = ports.message_time(src, nbytes)
        ports.last_cost = cost
        with ports.inside():
            out = fn(*args, **kwargs)
        if op == "irecv":
            if out is None:
                return out
            return _DelayedWork(out, _once(lambda: ports.received(src, tag, seq, cost)))
        if src is None and out is not None and out >= 0:  # recv from any source returns the sender
            src = out
            seq = ports.board.expect(src, tag) if ports.board is not None else None
            cost = ports.message_time(src, nbytes)
            ports.last_cost = cost
        _sleep_until(ports.received(src, tag, seq, cost))
        return out

    return recv


def _emulated_collective(op: str, fn, params: list[str]):
    """A collective (torch's ``fn``): its textbook algorithm's time, from when this rank calls
    it (or its port is free), and no earlier than gloo's real collective ends."""
    buffers = trace.IN_ARGS + trace.OUT_ARGS

    @functools.wraps(fn)
    def collective(*args, **kwargs):
        ports = _STATE
        bound = {**dict(zip(params, args)), **kwargs}
        present = [bound.get(k) for k in buffers if bound.get(k) is not None]
        tensors = [t for x in present for t in (x if isinstance(x, (list, tuple)) else [x])]
        if ports is None or ports.depth or not _is_cpu(tensors):
            return fn(*args, **kwargs)
        nbytes = max([callargs.payload_bytes(bound.get(k)) for k in buffers] + [0])
        tier, cost = ports.collective_cost(op, nbytes, bound.get("group"))
        ports.last_cost = cost
        called = time.perf_counter()
        with ports.inside():
            out = fn(*args, **kwargs)
        if out is not None and hasattr(out, "wait"):  # async_op=True: it ends at wait / the future
            return _DelayedWork(out, _once(lambda: ports.reserve_both(cost, called, tier)))
        _sleep_until(ports.reserve_both(cost, called, tier))
        return out

    return collective


def wrap(op: str, fn):
    """The wrapper ``trace.install(emulate=wrap)`` puts between the tracer and torch's ``fn``."""
    if op in trace.SETUP_OPS:
        return fn  # making a group moves no data worth a model
    params = list(inspect.signature(fn).parameters)
    if op in ("send", "isend"):
        slowed = _emulated_send(op, fn, params)
    elif op in ("recv", "irecv"):
        slowed = _emulated_recv(op, fn, params)
    elif op in trace.COLLECTIVE_OPS:
        slowed = _emulated_collective(op, fn, params)
    else:
        raise ValueError(
            f"no emulation for torch.distributed.{op}; the emulated ops are {trace.P2P_OPS + trace.COLLECTIVE_OPS}"
        )
    del slowed.__wrapped__  # like the tracer's wrappers: no way around the emulation
    return slowed


# --------------------------------------------------------------------------------------
# Begin and end, on every rank of a launch
# --------------------------------------------------------------------------------------
def begin(network: Network | None, world_size: int, shared: bool = True) -> None:
    """Start emulating ``network`` in this rank (nothing at all when ``network`` is None).

    Must be called on all ranks.  ``shared``: the ranks share a host and can share the
    board of arrival times (the warm pool); otherwise a sender holds its data back instead.
    """
    global _STATE
    if network is None:
        return
    board = _Board(world_size) if shared and world_size > 1 else None
    _STATE = _Ports(network, world_size, board, dist.get_rank() if dist.is_initialized() else 0)
    trace.install(emulate=wrap, last_cost=take_last_cost)


def end(network: Network | None) -> None:
    """Stop emulating: torch's functions are traced, and no longer slowed.  Must be called on all ranks."""
    global _STATE
    if network is None:
        return
    ports, _STATE = _STATE, None
    trace.install()
    if ports is not None and ports.board is not None:
        ports.board.close()


def take_last_cost() -> float | None:
    """The model time of the call that just ended (the tracer's ``last_cost`` hook, given by ``begin``)."""
    ports = _STATE
    if ports is None:
        return None
    cost, ports.last_cost = ports.last_cost, None
    return cost
