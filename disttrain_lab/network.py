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

This module is the model: ``Network``, its presets and tiers, and ``collective_time``.  What
runs inside a rank to enforce it (the port clocks, the board, the wrappers around torch's
functions) is ``disttrain_lab.emulation``.

``network=None`` (the default) installs nothing: the launch runs exactly as without an
emulated network.  With a network, ``Run.network`` says which, and every traced communication event
carries ``meta["network_s"]``, the model's time for it (its measured duration is at least that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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

    latency: float  # alpha, seconds every message pays (switch, NIC, software)
    bandwidth: float  # bytes per second through one port in one direction (1 / beta)
    duplex: str = "full"  # "full": send and receive at once; "half": one transfer at a time
    name: str = ""  # shown in plots and tables, e.g. "1 Gbit Ethernet"
    # two tiers (both or neither; see Network.two_tier): the fields above are then the link
    # inside a node, and ranks r and s share a node when r // devices_per_node == s // devices_per_node
    devices_per_node: int | None = None  # ranks per node
    inter: Network | None = None  # the link between nodes (a one-tier Network)

    def __post_init__(self) -> None:
        for field_name, unit in (("latency", "seconds per message"), ("bandwidth", "bytes per second")):
            value = getattr(self, field_name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
            if not ok:
                raise ValueError(
                    f"Network {field_name} must be a finite number > 0 ({unit}), got {value!r}; "
                    f"e.g. Network(latency=50e-6, bandwidth=1.25e8) is 1 Gbit/s Ethernet"
                )
        if self.duplex not in DUPLEX:
            raise ValueError(f"Network duplex must be one of {DUPLEX}, got {self.duplex!r}")
        if not isinstance(self.name, str):
            raise ValueError(f"Network name must be a string, got {self.name!r}")
        if (self.devices_per_node is None) != (self.inter is None):
            raise ValueError(
                f"Network devices_per_node and inter go together (two tiers) or not at all (one link), "
                f"got devices_per_node={self.devices_per_node!r}, inter={self.inter!r}; e.g. "
                f"Network.two_tier(devices_per_node=4, intra='NVLink', inter='100 Gbit InfiniBand')"
            )
        if self.devices_per_node is not None:
            d = self.devices_per_node
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise ValueError(f"Network devices_per_node must be an int >= 1 (ranks per node), got {d!r}")
            if not isinstance(self.inter, Network) or self.inter.devices_per_node is not None:
                raise ValueError(
                    f"Network inter must be a one-tier Network (the link between nodes, e.g. "
                    f"Network.preset('100 Gbit InfiniBand')), got {self.inter!r}"
                )

    @classmethod
    def preset(cls, name: str) -> Network:
        """One of ``PRESETS``: "1 Gbit Ethernet", "10 Gbit Ethernet", "100 Gbit InfiniBand", "NVLink",
        "PCIe 4.0 x16" (a host link, for disttrain_lab.hostlink)."""
        if name in PRESETS:
            return PRESETS[name]
        raise ValueError(
            f"no network preset {name!r}; the presets are {sorted(PRESETS)}, or build one with "
            f"Network(latency=seconds, bandwidth=bytes_per_second)"
        )

    @classmethod
    def gbit(cls, gbits_per_s: float, latency: float = 50e-6, duplex: str = "full") -> Network:
        """A link of ``gbits_per_s`` Gbit/s (network units: 1 Gbit/s = 1.25e8 bytes/s)."""
        if (
            isinstance(gbits_per_s, bool)
            or not isinstance(gbits_per_s, (int, float))
            or not gbits_per_s > 0
            or not math.isfinite(gbits_per_s)
        ):
            raise ValueError(f"Network bandwidth must be a finite number > 0 Gbit/s, got {gbits_per_s!r}")
        return cls(latency=latency, bandwidth=gbits_per_s * 1.25e8, duplex=duplex, name=f"{gbits_per_s:g} Gbit/s")

    @classmethod
    def two_tier(
        cls, devices_per_node: int, intra: Network | str = "NVLink", inter: Network | str = "100 Gbit InfiniBand"
    ) -> Network:
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
                raise ValueError(
                    f"Network.two_tier {field_name} must be a one-tier Network or a preset name "
                    f"({sorted(PRESETS)}), got {link!r}"
                )
            links[field_name] = link
        intra = links["intra"]
        return cls(
            latency=intra.latency,
            bandwidth=intra.bandwidth,
            duplex=intra.duplex,
            name=intra.name,
            devices_per_node=devices_per_node,
            inter=links["inter"],
        )

    @property
    def intra(self) -> Network:
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

    def link(self, *ranks: int) -> Network:
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
        return (
            f"{label}latency {self.latency * 1e6:g} µs, bandwidth {self.bandwidth * 8 / 1e9:g} Gbit/s "
            f"({self.bandwidth / 1e9:g} GB/s), {self.duplex} duplex"
        )


PRESETS = {
    "1 Gbit Ethernet": Network(latency=50e-6, bandwidth=1.25e8, name="1 Gbit Ethernet"),
    "10 Gbit Ethernet": Network(latency=20e-6, bandwidth=1.25e9, name="10 Gbit Ethernet"),
    "100 Gbit InfiniBand": Network(latency=2e-6, bandwidth=1.25e10, name="100 Gbit InfiniBand"),
    # one NVLink 4 direction of a H100 is ~450 GB/s; on CPU this is faster than the real copies
    "NVLink": Network(latency=1e-6, bandwidth=4.5e11, name="NVLink"),
    # host <-> device (Lab 9's offload, disttrain_lab.hostlink): 16 GT/s x 16 lanes, 128b/130b = 31.5 GB/s
    # per direction; pinned-memory copies reach ~25 GB/s; a copy costs ~10 µs to launch and sync
    "PCIe 4.0 x16": Network(latency=10e-6, bandwidth=2.5e10, name="PCIe 4.0 x16"),
}

_RING_OPS = ("all_reduce", "all_reduce_coalesced")
_RING_HALF_OPS = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_coalesced",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
)
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
