"""An emulated network for ``dl.launch``: make loopback "links" behave like a cluster's.

On one machine the links between ranks are memory copies, so the α–β model's lessons
(a slow link makes the root of a naive all-reduce the bottleneck; compression pays off
on a slow link and not on a fast one) do not show.  With a network the launcher slows
every transfer down to at least what a real link would take:

    >>> slow = dl.Network(latency=50e-6, bandwidth=1.25e8)          # 1 Gbit/s Ethernet
    >>> dl.launch(train_step, 4, network=slow)
    >>> dl.launch(train_step, 4, network=dl.Network.preset("100 Gbit InfiniBand"))

A cluster has two tiers of links: the GPUs of one node talk over NVLink, nodes over
InfiniBand or Ethernet.  ``Network.two_tier`` builds that network:

    >>> dgx = dl.Network.two_tier(devices_per_node=4, intra="NVLink", inter="100 Gbit InfiniBand")
    >>> dl.launch(train_step, 8, network=dgx)          # ranks 0-3 are node 0, ranks 4-7 node 1

The node of a rank is ``rank // devices_per_node``.  A send between two ranks of one node
pays the intra-node link, between nodes the inter-node link; a collective on a group pays
its algorithm (below) on the slowest tier the group spans: a group inside one node the
intra-node link, a group across nodes the slower of the two (a ring across nodes goes at
the pace of its slowest hop).  Each tier is a port of its own (a GPU's NVLink and its
node's network card carry traffic at the same time).

The model (the one of labs 1 and 2):

- A message of ``n`` bytes over one link takes ``alpha + beta * n`` seconds
  (``alpha = latency``, ``beta = 1 / bandwidth``).
- Every rank has one port to a non-blocking switch.  ``duplex="full"`` (default, as
  Ethernet, InfiniBand and NVLink are): a rank sends one message at a time and receives
  one at a time, both at once; ``duplex="half"``: one transfer at a time, in or out.
  Transfers of different ranks run in parallel.
- How it is enforced, per rank, with two clocks (when its out-port and its in-port are free):
  a ``send``/``isend`` books its out-port for ``alpha + beta * n`` from when the port is free,
  hands the data to gloo at once, and writes the moment the link will have carried it on a
  board of arrival times shared by the ranks of the launch; the ``recv`` (or the ``wait`` of
  the ``irecv``) returns no earlier than that moment, nor earlier than ``alpha + beta * n``
  after the previous message its in-port carried.  A blocking ``send`` returns when its
  transfer ends; the ``wait`` of an ``isend`` too, so computation between them overlaps the
  transfer.  Every emulated time is a lower bound: the real copy runs meanwhile, and the
  scheduling of processes comes on top.  (Under ``torchrun`` the ranks may be on several
  hosts and share no board: a sender then holds its data back for the transfer time.)
- Collectives cost their textbook algorithm under the same model (``collective_time``;
  two tiers: on the slowest tier the group spans):
  all-reduce a ring, ``2(N-1)(alpha + beta*n/N)``; all-gather, reduce-scatter and all-to-all
  a ring, ``(N-1)(alpha + beta*n/N)`` with ``n`` the larger buffer; broadcast and reduce a
  binomial tree, ``ceil(log2 N)(alpha + beta*n)``; scatter and gather the root's port,
  ``(N-1)(alpha + beta*n/N)``; barrier ``ceil(log2 N) alpha``.  A half-duplex port pays the
  ring and all-to-all steps twice (each step sends and receives).  A collective ends no
  earlier than this time after the later of its call and the moment the rank's port is free,
  nor before gloo's real collective ends (so a rank that enters early is charged from its
  own call: a late peer delays it only through gloo's real wait).  ``async_op=True`` collectives run meanwhile: their
  ``wait()`` and ``get_future()`` complete at that time, so they overlap with computation.
- Only CPU tensors are slowed; GPU tensors travel over NCCL at the real speed.
- Only calls made through ``torch.distributed``'s Python functions are slowed.  Not slowed:
  methods called on a ``ProcessGroup`` object directly, collectives torch issues from C++
  (DDP's built-in all-reduce when no communication hook is registered, its constructor's
  broadcast), and an ``irecv`` from any source (``src=None``), which has no known sender.

``network=None`` (the default) installs nothing: the launch runs exactly as without this
module.  With a network, ``Run.network`` says which, and every traced communication event
carries ``meta["network_s"]``, the model's time for it (its measured duration is at least that).
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass

import numpy as np

from .costmodel import AlphaBeta

__all__ = ["Network", "PRESETS", "collective_time"]

DUPLEX = ("full", "half")


@dataclass(frozen=True)
class Network:
    """An emulated link: ``latency`` α (seconds per message) and ``bandwidth`` 1/β (bytes/s).

        >>> net = Network(latency=50e-6, bandwidth=1.25e8)     # 1 Gbit/s = 125 MB/s
        >>> net.time(2**20)                                    # one 1 MiB message, seconds
        0.008438...
    """
    latency: float              # alpha, seconds every message pays (switch, NIC, software)
    bandwidth: float            # bytes per second through one port in one direction (1 / beta)
    duplex: str = "full"        # "full": send and receive at once; "half": one transfer at a time
    name: str = ""              # shown in plots and tables, e.g. "1 Gbit Ethernet"
    # two tiers (both or neither; see Network.two_tier): the fields above are then the link
    # inside a node, and ranks r and s share a node when r // devices_per_node == s // devices_per_node
    devices_per_node: int | None = None   # ranks per node
    inter: "Network | None" = None        # the link between nodes (a one-tier Network)

    def __post_init__(self) -> None:
        for field_name, unit in (("latency", "seconds per message"), ("bandwidth", "bytes per second")):
            value = getattr(self, field_name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
            if not ok:
                raise ValueError(f"Network {field_name} must be a finite number > 0 ({unit}), got {value!r}; "
                                 f"e.g. Network(latency=50e-6, bandwidth=1.25e8) is 1 Gbit/s Ethernet")
        if self.duplex not in DUPLEX:
            raise ValueError(f"Network duplex must be one of {DUPLEX}, got {self.duplex!r}")
        if not isinstance(self.name, str):
            raise ValueError(f"Network name must be a string, got {self.name!r}")
        if (self.devices_per_node is None) != (self.inter is None):
            raise ValueError(f"Network devices_per_node and inter go together (two tiers) or not at all (one link), "
                             f"got devices_per_node={self.devices_per_node!r}, inter={self.inter!r}; e.g. "
                             f"Network.two_tier(devices_per_node=4, intra='NVLink', inter='100 Gbit InfiniBand')")
        if self.devices_per_node is not None:
            d = self.devices_per_node
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise ValueError(f"Network devices_per_node must be an int >= 1 (ranks per node), got {d!r}")
            if not isinstance(self.inter, Network) or self.inter.devices_per_node is not None:
                raise ValueError(f"Network inter must be a one-tier Network (the link between nodes, e.g. "
                                 f"Network.preset('100 Gbit InfiniBand')), got {self.inter!r}")

    @classmethod
    def preset(cls, name: str) -> "Network":
        """One of ``PRESETS``: "1 Gbit Ethernet", "10 Gbit Ethernet", "100 Gbit InfiniBand", "NVLink"."""
        if name in PRESETS:
            return PRESETS[name]
        raise ValueError(f"no network preset {name!r}; the presets are {sorted(PRESETS)}, or build one with "
                         f"Network(latency=seconds, bandwidth=bytes_per_second)")

    @classmethod
    def gbit(cls, gbits_per_s: float, latency: float = 50e-6, duplex: str = "full") -> "Network":
        """A link of ``gbits_per_s`` Gbit/s (network units: 1 Gbit/s = 1.25e8 bytes/s)."""
        if isinstance(gbits_per_s, bool) or not isinstance(gbits_per_s, (int, float)) or not gbits_per_s > 0 \
                or not math.isfinite(gbits_per_s):
            raise ValueError(f"Network bandwidth must be a finite number > 0 Gbit/s, got {gbits_per_s!r}")
        return cls(latency=latency, bandwidth=gbits_per_s * 1.25e8, duplex=duplex, name=f"{gbits_per_s:g} Gbit/s")

    @classmethod
    def two_tier(cls, devices_per_node: int, intra: "Network | str" = "NVLink",
                 inter: "Network | str" = "100 Gbit InfiniBand") -> "Network":
        """Nodes of ``devices_per_node`` ranks: ``intra`` links the ranks of a node, ``inter`` the nodes.

            >>> net = Network.two_tier(4, intra="NVLink", inter="100 Gbit InfiniBand")
            >>> net.link(0, 3).name, net.link(3, 4).name          # rank 3 is on node 0, rank 4 on node 1
            ('NVLink', '100 Gbit InfiniBand')

        ``intra`` and ``inter`` are one-tier Networks or names of ``PRESETS``."""
        links = {}
        for field_name, link in (("intra", intra), ("inter", inter)):
            if isinstance(link, str):
                link = cls.preset(link)
            if not isinstance(link, Network) or link.devices_per_node is not None:
                raise ValueError(f"Network.two_tier {field_name} must be a one-tier Network or a preset name "
                                 f"({sorted(PRESETS)}), got {link!r}")
            links[field_name] = link
        intra = links["intra"]
        return cls(latency=intra.latency, bandwidth=intra.bandwidth, duplex=intra.duplex, name=intra.name,
                   devices_per_node=devices_per_node, inter=links["inter"])

    @property
    def intra(self) -> "Network":
        """The link inside a node (a one-tier network: the whole network when it has one tier)."""
        if self.inter is None:
            return self
        return Network(latency=self.latency, bandwidth=self.bandwidth, duplex=self.duplex, name=self.name)

    def node(self, rank: int) -> int:
        """The node of global ``rank`` (0 for every rank of a one-tier network)."""
        return rank // self.devices_per_node if self.devices_per_node else 0

    def tier(self, *ranks: int) -> str:
        """``"intra"`` when ``ranks`` share a node (always, with one tier), else ``"inter"``."""
        return "intra" if len({self.node(r) for r in ranks}) <= 1 else "inter"

    def link(self, *ranks: int) -> "Network":
        """The link a message between ``ranks`` (a sender and a receiver) pays."""
        return self.intra if self.tier(*ranks) == "intra" else self.inter

    @property
    def alpha(self) -> float:
        return self.latency

    @property
    def beta(self) -> float:
        return 1.0 / self.bandwidth

    def alpha_beta(self) -> AlphaBeta:
        """The same link as the cost model of lab 1 (``costmodel.AlphaBeta``)."""
        return AlphaBeta(alpha=self.alpha, beta=self.beta)

    def time(self, nbytes: float) -> float:
        """Seconds for one message of ``nbytes`` over one link: alpha + beta * n."""
        return self.latency + nbytes / self.bandwidth

    def collective_time(self, op: str, nbytes: float, world_size: int, ranks=None) -> float:
        """Seconds the model gives collective ``op`` on ``nbytes`` (see the module docstring).

        ``ranks``: the group's global ranks (two tiers: the group pays the slowest tier it spans;
        without them, the link inside a node)."""
        return self.collective_tier(op, nbytes, world_size, ranks)[1]

    def collective_tier(self, op: str, nbytes: float, world_size: int, ranks=None) -> tuple[str, float]:
        """(tier, seconds) of collective ``op`` on the group of global ``ranks``: the slowest tier it spans."""
        intra = collective_time(self.intra, op, nbytes, world_size)
        if ranks is None or self.tier(*ranks) == "intra":
            return "intra", intra
        inter = collective_time(self.inter, op, nbytes, world_size)
        return ("inter", inter) if inter >= intra else ("intra", intra)

    def __str__(self) -> str:
        if self.inter is not None:
            return f"nodes of {self.devices_per_node} ranks; inside a node {self.intra}; across nodes {self.inter}"
        label = f"{self.name}: " if self.name else ""
        return (f"{label}latency {self.latency * 1e6:g} µs, bandwidth {self.bandwidth * 8 / 1e9:g} Gbit/s "
                f"({self.bandwidth / 1e9:g} GB/s), {self.duplex} duplex")


PRESETS = {
    "1 Gbit Ethernet": Network(latency=50e-6, bandwidth=1.25e8, name="1 Gbit Ethernet"),
    "10 Gbit Ethernet": Network(latency=20e-6, bandwidth=1.25e9, name="10 Gbit Ethernet"),
    "100 Gbit InfiniBand": Network(latency=2e-6, bandwidth=1.25e10, name="100 Gbit InfiniBand"),
    # one NVLink 4 direction of a H100 is ~450 GB/s; on CPU this is faster than the real copies
    "NVLink": Network(latency=1e-6, bandwidth=4.5e11, name="NVLink"),
}

_RING_OPS = ("all_reduce", "all_reduce_coalesced")
_RING_HALF_OPS = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_coalesced",
                  "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                  "all_to_all", "all_to_all_single")
_TREE_OPS = ("broadcast", "reduce")
_ROOT_OPS = ("scatter", "gather")
_SYNC_OPS = ("barrier", "monitored_barrier")


def collective_time(net: Network, op: str, nbytes: float, world_size: int) -> float:
    """The model's seconds for one collective of ``nbytes`` (its larger buffer) on ``world_size`` ranks."""
    n = world_size
    if n <= 1:
        return 0.0
    steps_twice = 2 if net.duplex == "half" else 1
    if op in _RING_OPS:
        return 2 * (n - 1) * steps_twice * net.time(nbytes / n)
    if op in _RING_HALF_OPS:
        return (n - 1) * steps_twice * net.time(nbytes / n)
    if op in _TREE_OPS:
        return math.ceil(math.log2(n)) * net.time(nbytes)
    if op in _ROOT_OPS:
        return (n - 1) * net.time(nbytes / n)
    if op in _SYNC_OPS:
        return math.ceil(math.log2(n)) * net.latency
    raise ValueError(f"no cost model for collective {op!r}")


# --------------------------------------------------------------------------------------
# Inside a rank: port clocks, the board of arrival times, and the wrappers around torch
# --------------------------------------------------------------------------------------
_SLOTS = 256   # per (sender, receiver) pair: messages in flight whose arrival time is kept


class _Board:
    """Shared memory of all ranks of a launch: when each message in flight arrives.

    ``times[src, dst, slot] = (tag, sequence number, arrival)``; only ``src`` writes its row,
    only ``dst`` reads it.  The sender hands its data to gloo at once and writes when the
    emulated link will have carried it; the receiver waits until then.  So the real copy
    overlaps the emulated transfer, and nothing is seen early.  Rank 0 creates the memory
    (a memfd: no file anywhere, gone with the last rank); the others open it through /proc.
    """

    def __init__(self, world_size: int) -> None:
        import mmap
        import os

        import numpy as np
        import torch.distributed as dist
        from .trace import _ORIGINALS
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
            _ORIGINALS["barrier"]()      # everyone has it mapped: the fd may go (untraced, not emulated)
            os.close(fd)
        self.times = np.ndarray((world_size, world_size, _SLOTS, 3), dtype=np.float64, buffer=self.memory)
        if rank == 0:
            self.times[..., 1] = -1.0    # no message in any slot
        _ORIGINALS["barrier"]()
        self.rank = rank
        self.sent: dict[tuple, int] = {}      # (dst, tag) -> messages sent
        self.posted: dict[int, int] = {}      # dst -> slots used
        self.received: dict[tuple, int] = {}  # (src, tag) -> messages received

    def post(self, dst: int, tag: int, arrival: float) -> None:
        seq = self.sent.get((dst, tag), 0)
        self.sent[(dst, tag)] = seq + 1
        slot = self.posted.get(dst, 0)
        self.posted[dst] = slot + 1
        entry = self.times[self.rank, dst, slot % _SLOTS]
        entry[1] = -1.0                  # invalid while being written
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


class _Clock:
    """One port of this rank (one tier's link): perf_counter seconds at which each direction is free."""

    def __init__(self, duplex: str) -> None:
        self.half = duplex == "half"
        self.out_free = self.in_free = 0.0


class _Ports:
    """This rank's ports, one per tier of the network, and the call in progress."""

    def __init__(self, net: Network, world_size: int, board: _Board | None, rank: int) -> None:
        self.net, self.world_size, self.board, self.rank = net, world_size, board, rank
        self.clocks = {"intra": _Clock(net.duplex)}
        if net.inter is not None:
            self.clocks["inter"] = _Clock(net.inter.duplex)
        self.lock = threading.Lock()   # futures of async collectives complete on gloo's threads
        self.last_cost = None          # the model time of the call in progress, for the tracer
        self.depth = 0                 # > 0 inside torch's function: calls it makes are not charged again

    @contextlib.contextmanager
    def inside(self):
        # torch's send is isend(...).wait(), recv is irecv(...).wait(): charge the outer call only
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

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

    def reserve_both(self, cost: float, since: float, tier: str) -> float:
        """A collective holds both directions of ``tier`` for ``cost`` from max(since, ports free)."""
        with self.lock:
            c = self.clocks[tier]
            start = max(since, c.out_free, c.in_free)
            c.out_free = c.in_free = start + cost
            return start + cost


def _sleep_until(deadline: float) -> None:
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left)


def _is_cpu(tensors) -> bool:
    for t in tensors:
        device = getattr(t, "device", None)
        if device is not None and device.type != "cpu":
            return False
    return True


_STATE: _Ports | None = None


class _DelayedWork:
    """The Work of an emulated async call: ``wait()``/``get_future()`` finish at the model's time."""

    def __init__(self, work, finish) -> None:
        self._work, self._finish = work, finish  # finish(): the emulated end (called after the real end)

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        _sleep_until(self._finish())
        return out

    def get_future(self):
        import torch
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


def _global_peer(bound: dict, key: str):
    import torch.distributed as dist
    peer = bound.get(key)
    if peer is None and bound.get("group_" + key) is not None:
        peer = dist.get_global_rank(bound.get("group") or dist.group.WORLD, bound["group_" + key])
    return peer


def _emulated(op: str, fn, params: list[str]):
    """``fn`` (a genuine torch function) slowed down to the model's time for ``op``."""
    import functools
    from .trace import _IN_ARGS, _OUT_ARGS, _nbytes

    def bound_of(args, kwargs):
        bound = dict(zip(params, args))
        bound.update(kwargs)
        return bound

    if op in ("send", "isend"):
        @functools.wraps(fn)
        def send(*args, **kwargs):
            ports = _STATE
            bound = bound_of(args, kwargs)
            tensor = bound.get("tensor")
            if ports is None or ports.depth or not _is_cpu([tensor]):
                return fn(*args, **kwargs)
            dst = _global_peer(bound, "dst")
            tier = ports.net.tier(ports.rank, dst)
            cost = ports.net.link(ports.rank, dst).time(_nbytes(tensor))
            ports.last_cost = cost
            arrival = ports.reserve_out(cost, tier)
            if ports.board is None:          # no shared board (torchrun): the data leaves late
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

    if op in ("recv", "irecv"):
        @functools.wraps(fn)
        def recv(*args, **kwargs):
            ports = _STATE
            bound = bound_of(args, kwargs)
            tensor = bound.get("tensor")
            if ports is None or ports.depth or not _is_cpu([tensor]):
                return fn(*args, **kwargs)
            src, tag = _global_peer(bound, "src"), bound.get("tag") or 0
            nbytes = _nbytes(tensor)
            # the sequence number of an irecv is taken now, when it is posted, not at its wait()
            seq = ports.board.expect(src, tag) if ports.board is not None and src is not None else None
            cost = ports.net.link(ports.rank, src).time(nbytes) if src is not None else ports.net.time(nbytes)
            ports.last_cost = cost
            with ports.inside():
                out = fn(*args, **kwargs)
            if op == "recv":
                if src is None and out is not None and out >= 0:   # recv from any source returns the sender
                    src = out
                    seq = ports.board.expect(src, tag) if ports.board is not None else None
                    cost = ports.net.link(ports.rank, src).time(nbytes)
                    ports.last_cost = cost
                arrival = ports.board.arrival(src, tag, seq) if seq is not None else 0.0
                tier = ports.net.tier(ports.rank, src) if src is not None else "intra"
                _sleep_until(ports.take_in(cost, arrival, tier))
                return out
            if out is None:
                return out
            tier = ports.net.tier(ports.rank, src) if src is not None else "intra"

            def finish():
                arrival = ports.board.arrival(src, tag, seq) if seq is not None else 0.0
                return ports.take_in(cost, arrival, tier)
            return _DelayedWork(out, _once(finish))
        return recv

    # a collective: its cost starts when this rank calls it (or its port is free)
    @functools.wraps(fn)
    def collective(*args, **kwargs):
        ports = _STATE
        bound = bound_of(args, kwargs)
        tensors = [bound.get(k) for k in _IN_ARGS + _OUT_ARGS if bound.get(k) is not None]
        flat = [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x])]
        if ports is None or ports.depth or not _is_cpu(flat):
            return fn(*args, **kwargs)
        nbytes = max([_nbytes(bound.get(k)) for k in _IN_ARGS + _OUT_ARGS] + [0])
        group = bound.get("group")
        import torch.distributed as dist
        world = dist.get_world_size(group) if group is not None else dist.get_world_size()
        ranks = None
        if ports.net.inter is not None:   # two tiers: which ranks the group holds decides its tier
            ranks = dist.get_process_group_ranks(group) if group is not None else range(world)
        tier, cost = ports.net.collective_tier(op, nbytes, world, ranks)
        ports.last_cost = cost
        called = time.perf_counter()
        with ports.inside():
            out = fn(*args, **kwargs)
        if out is not None and hasattr(out, "wait"):  # async_op=True: it ends at wait / the future
            return _DelayedWork(out, _once(lambda: ports.reserve_both(cost, called, tier)))
        _sleep_until(ports.reserve_both(cost, called, tier))
        return out
    return collective


def emulator(op: str, fn):
    """The wrapper ``trace.install(emulate=...)`` puts between the tracer and torch's ``fn``."""
    import inspect
    from .trace import SETUP_OPS
    if op in SETUP_OPS:
        return fn
    slowed = _emulated(op, fn, list(inspect.signature(fn).parameters))
    del slowed.__wrapped__  # like the tracer's wrappers: no way around the emulation
    return slowed


def begin(net: Network | None, world_size: int, shared: bool = True) -> None:
    """Start emulating ``net`` in this rank (nothing at all when ``net`` is None).

    Must be called on all ranks.  ``shared``: the ranks share a host and can share the
    board of arrival times (the warm pool); otherwise a sender holds its data back instead.
    """
    global _STATE
    if net is None:
        return
    from . import trace
    import torch.distributed as dist
    board = _Board(world_size) if shared and world_size > 1 else None
    _STATE = _Ports(net, world_size, board, dist.get_rank() if dist.is_initialized() else 0)
    trace.install(emulate=emulator)


def end(net: Network | None) -> None:
    """Stop emulating: torch's functions are traced, and no longer slowed."""
    global _STATE
    if net is None:
        return
    from . import trace
    ports, _STATE = _STATE, None
    trace.install()
    if ports is not None and ports.board is not None:
        ports.board.close()


def take_last_cost() -> float | None:
    """The model time of the call that just ended (the tracer stores it in the event)."""
    ports = _STATE
    if ports is None:
        return None
    cost, ports.last_cost = ports.last_cost, None
    return cost
