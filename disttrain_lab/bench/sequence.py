"""``disttrain-lab bench sequence``: lab 10's ring attention, side by side with the all-gather
baseline it replaces, with torch's own context parallelism where it runs, and with the lab's Ulysses
attention on an emulated link.

Attention (forward and backward of causal attention over a sequence split in zig-zag chunks):
the lab's ``ring_attention``; **all-gather K/V**, every rank gathering the whole sequence's keys
and values and reduce-scattering their gradients (torch's default ``_RotateMethod.ALL_GATHER``,
and Llama 3's); and ``torch.distributed.tensor.experimental.context_parallel`` around
``F.scaled_dot_product_attention``.  torch's runs on GPUs only (``device="cuda"``): its dispatcher
(``_context_parallel/_attention.py``, ``_sdpa_handler``) shards SDPA's CUDA kernels, flash,
memory-efficient and cuDNN; on the CPU SDPA calls ``aten._scaled_dot_product_flash_attention_for_cpu``,
which has no sharding rule, so there it raises ``NotImplementedError`` and the table says why.

The attention part runs on ``device`` (``"cuda"``: rank k on the k-th GPU, NCCL); the long-sequence
part runs on the CPU, where the emulated link slows the transfers (it delays CPU tensors only).

Long sequences (forward and backward on an emulated link, default 10 Gbit Ethernet, at several
sequence lengths): the lab's ``ring_attention`` (zig-zag) against its ``ulysses_attention``
(contiguous tokens, an all-to-all to a head split and back), side by side in one launch; then one more
traced step of the ring per length, for what its transfers left exposed: per pass, the time the slowest
rank spent in its sends, receives and waits, against what the emulated link took for what it sent
(``exposed_per_pass``).

Lab 11's expert-parallel MoE has its own benchmark: ``disttrain-lab bench experts`` (experts.py).
"""

from __future__ import annotations

import functools
import os

from .. import trace
from ..devices import device as rank_device
from ..events import Event, to_events
from ..launcher import launch
from ..network import Network
from .collectives import GatherRows
from .command import Measured, add_device_argument, add_world_size_argument, chosen_device, over_world_sizes
from .notebook import add_notebook_argument, functions_from_lab
from .stats import slowest_median
from .tables import Chart, chart, step_rows, step_table, version_width
from .timing import OPS_SIZES, step_times

TORCH_CP = "torch context_parallel"
ALL_GATHER_KV = "all-gather K/V"
LONG = "long sequences"  # the part of the table: ring against Ulysses on an emulated link
LINK = "10 Gbit Ethernet"
SEQ_LENS = (1024, 2048, 4096)
CPU_CANNOT = (
    "context_parallel shards SDPA's CUDA kernels only (flash, efficient, cuDNN); on the CPU SDPA runs "
    "aten._scaled_dot_product_flash_attention_for_cpu, which it cannot shard (use --device cuda)"
)
ATTENTION = {"seq_len": 4096, "heads": 8, "dim": 64}  # one sequence, float32


def _zigzag(seq_len: int, n: int, rank: int):
    import torch

    chunk, tail = seq_len // (2 * n), 2 * n - 1 - rank
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk), torch.arange(tail * chunk, (tail + 1) * chunk)])


def _attention_runners(versions: dict, seq_len: int, heads: int, dim: int) -> tuple[dict, dict]:
    """In a rank: name -> a forward+backward of causal attention over this rank's zig-zag tokens."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    n, rank, dev = dist.get_world_size(), dist.get_rank(), rank_device()
    pos = _zigzag(seq_len, n, rank)
    everyone = torch.cat([_zigzag(seq_len, n, r) for r in range(n)])
    g = torch.Generator().manual_seed(0)  # drawn on the CPU: the same numbers on every device
    q, k, v = (torch.randn(heads, seq_len, dim, generator=g)[:, pos].contiguous().to(dev) for _ in range(3))
    runners, unavailable = {}, {}

    def leaves():
        return [t.clone().requires_grad_() for t in (q, k, v)]

    if "ring_attention" in versions:
        ring = versions["ring_attention"]

        def run_ring():
            out = ring(*leaves(), "zigzag")
            out.backward(torch.ones_like(out))

        runners["ring_attention"] = run_ring

    mask = (pos[:, None] >= everyone[None, :]).to(dev)

    def run_all_gather():
        mq, mk, mv = leaves()
        # (H, S, d): every rank's chunks, in rank order (the order of `everyone`)
        keys, values = (GatherRows.apply(t.transpose(0, 1)).transpose(0, 1) for t in (mk, mv))
        out = F.scaled_dot_product_attention(mq, keys, values, attn_mask=mask)
        out.backward(torch.ones_like(out))

    runners[ALL_GATHER_KV] = run_all_gather
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh(dev.type, (n,))
        whole = [torch.randn(1, heads, seq_len, dim, generator=g).to(dev) for _ in range(3)]

        def run_torch():
            buffers = [t.clone() for t in whole]
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
                tq, tk, tv = (t.detach().requires_grad_() for t in buffers)  # the buffers themselves are resharded
                out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
                out.backward(torch.ones_like(out))

        run_torch()
        runners[TORCH_CP] = run_torch
    except Exception as exc:  # not on this backend/device: say why, measure the others
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
        unavailable[TORCH_CP] = f"{CPU_CANNOT}: {why}" if dev.type == "cpu" else why
    return runners, unavailable


def _long_sequence_times(versions: dict, seq_lens, heads: int, dim: int, repeats: int, warmup: int) -> dict:
    """In each rank: per sequence length, seconds per forward+backward of the ring (zig-zag tokens) and of
    Ulysses (contiguous tokens), interleaved, and rank 0's bytes per step."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for seq_len in seq_lens:
        g = torch.Generator().manual_seed(0)
        whole = [torch.randn(heads, seq_len, dim, generator=g) for _ in range(3)]
        chunk = seq_len // n
        layouts = {
            "ring_attention": _zigzag(seq_len, n, rank),
            "ulysses_attention": torch.arange(rank * chunk, (rank + 1) * chunk),
        }
        runners = {}
        for name, pos in layouts.items():

            def run(fn=versions[name], pos=pos, whole=whole):
                out = fn(*(t[:, pos].clone().requires_grad_() for t in whole))
                out.backward(torch.ones_like(out))

            runners[f"{name}, S={seq_len}"] = run
        out[seq_len] = times = step_times(runners, repeats, warmup)
        trace.set_recording(True)  # one more step of the ring, traced: where its transfers were exposed
        try:
            runners[f"ring_attention, S={seq_len}"]()
        finally:
            times["exposed"] = exposed_per_pass(to_events(trace.set_recording(False)))
        if times["counted"] == OPS_SIZES:  # an all-to-all keeps 1/N of its tensor: what it sends, as the ring's isends
            times["bytes"] = {
                name: sent * ((n - 1) / n if name.startswith("ulysses") else 1) for name, sent in times["bytes"].items()
            }
    return out


def exposed_per_pass(events: list[Event]) -> dict:
    """From one rank's trace of one ring-attention step: per pass (``"forward"``, then ``"backward"`` from the
    end of the forward's last ``block`` region on), the seconds the rank spent in its sends, receives and waits
    for them (``exposed``: not computing), and the seconds the emulated link gave what it sent (``link``: the
    network model's, 0 without one)."""
    backward = max((e.end for e in events if e.kind == "region" and e.name == "block"), default=float("inf"))
    passes = {"forward": {"exposed": 0.0, "link": 0.0}, "backward": {"exposed": 0.0, "link": 0.0}}
    for e in events:
        if e.kind not in ("p2p", "wait"):
            continue
        one = passes["backward" if e.start >= backward else "forward"]
        one["exposed"] += e.duration
        if e.kind == "p2p" and e.op in ("send", "isend"):
            one["link"] += e.meta.get("network_s") or 0.0
    return passes


def _attention_times(versions: dict, attention: dict, repeats: int, warmup: int) -> dict:
    """In each rank: per version, seconds per step (interleaved), rank 0's bytes per step, and why torch's
    could not run, if it could not."""
    runners, unavailable = _attention_runners(versions, **attention)
    return {**step_times(runners, repeats, warmup), "unavailable": unavailable}


def bench_sequence(
    versions: dict,
    world_size: int = 4,
    seq_len: int = ATTENTION["seq_len"],
    heads: int = ATTENTION["heads"],
    dim: int = ATTENTION["dim"],
    repeats: int = 5,
    warmup: int = 1,
    timeout: float = 600.0,
    seq_lens=SEQ_LENS,
    network: Network | None = None,
    device: str = "cpu",
) -> list[dict]:
    """Forward+backward time (median of the slowest rank) and rank 0's bytes per step of the lab's
    ``ring_attention`` (``versions``: the notebook's ``ring_attention`` and ``ulysses_attention``; either
    may be missing) beside the baselines, in one launch.  ``ratio``: the baseline's time / this one's
    (above 1: faster than the baseline; the baseline is torch's context parallelism where it ran, else
    all-gather K/V).  ``device``: where the attention part runs, ``"cpu"`` (gloo) or ``"cuda"`` (rank k
    on the k-th GPU, NCCL; torch's context parallelism runs only there).  With both ``ring_attention``
    and ``ulysses_attention`` in ``versions``, a second launch, on the CPU over ``network`` (default
    10 Gbit Ethernet), adds the "long sequences" rows: the two at each of ``seq_lens``, the ratio being
    the ring's time / this one's.

        >>> print(format_sequence_table(bench_sequence({"ring_attention": ring_attention})))
    """
    if seq_len % (2 * world_size):
        raise ValueError(f"seq_len={seq_len} is not divisible by 2 x world_size = {2 * world_size} (zig-zag chunks)")
    attention = {"seq_len": seq_len, "heads": heads, "dim": dim}
    per_rank = launch(
        _attention_times, world_size, versions, attention, repeats, warmup, timeout=timeout, device=device
    )
    row = {"part": "attention", "world_size": world_size, "size": attention, "repeats": repeats, "device": device}
    rows = step_rows(per_rank, row, (TORCH_CP, ALL_GATHER_KV))
    if "ring_attention" in versions and "ulysses_attention" in versions:
        rows += _long_sequence_rows(versions, world_size, seq_lens, heads, dim, repeats, warmup, timeout, network)
    return rows


def _long_sequence_rows(versions, world_size, seq_lens, heads, dim, repeats, warmup, timeout, network) -> list[dict]:
    """The "long sequences" rows: ring and Ulysses per sequence length on ``network`` (one launch, on
    the CPU: the emulated link delays CPU tensors); ``ratio``: the ring's time / this one's at the same length."""
    network = network or Network.preset(LINK)
    if heads % world_size:
        raise ValueError(f"heads={heads} is not divisible by world_size={world_size} (Ulysses splits the heads)")
    bad = [s for s in seq_lens if s % (2 * world_size)]
    if bad:
        raise ValueError(f"seq_lens {bad} are not divisible by 2 x world_size = {2 * world_size} (zig-zag chunks)")
    picked = {name: versions[name] for name in ("ring_attention", "ulysses_attention")}
    per_rank = launch(
        _long_sequence_times,
        world_size,
        picked,
        tuple(seq_lens),
        heads,
        dim,
        repeats,
        warmup,
        timeout=timeout,
        network=network,
        device="cpu",
    )
    rows = []
    size = {"heads": heads, "dim": dim, "link": network.name}
    for seq_len in seq_lens:
        first = per_rank[0][seq_len]
        names = [f"{name}, S={seq_len}" for name in picked]  # the ring first, then Ulysses
        ms = {name: 1e3 * slowest_median([rank[seq_len]["seconds"][name] for rank in per_rank]) for name in names}
        ring = ms[f"ring_attention, S={seq_len}"]
        for name, value in ms.items():
            rows.append(
                {
                    "part": LONG,
                    "version": name,
                    "world_size": world_size,
                    "device": "cpu",
                    "size": dict(size),
                    "repeats": repeats,
                    "ms": value,
                    "bytes": first["bytes"][name],
                    "counted": first["counted"],
                    "baseline": "ring_attention",
                    "ratio": ring / value,
                }
            )
            if name.startswith("ring_attention"):  # per pass, the rank that waited least: the slowest, whose
                # waits lie on the step's critical path (the others' include waiting for it)
                waits = [rank[seq_len]["exposed"] for rank in per_rank]
                rows[-1]["exposed_ms"] = {
                    step: {
                        what: 1e3 * min(waits, key=lambda w: w[step]["exposed"])[step][what]
                        for what in ("exposed", "link")
                    }
                    for step in ("forward", "backward")
                }
    return rows


def format_sequence_table(rows: list[dict]) -> str:
    """One line per (part, version): ms per forward+backward, rank 0's bytes, the ratio to the baseline."""
    width = version_width(rows, 24)
    lines = []
    for part in ("attention", LONG):
        mine = [r for r in rows if r["part"] == part]
        if mine:
            lines += step_table(mine, width)
    exposed = [r for r in rows if "exposed_ms" in r]
    if exposed:
        lines.append(
            "ring_attention's communication in one more traced step, per pass, on the rank that waited least (the "
            "slowest: its waits lie on the step's critical path): exposed, its time in sends, receives and waits, "
            "not computing; link, what the emulated link took for what it sent"
        )
        for r in exposed:
            passes = ", ".join(
                f"{step} {e['exposed']:.1f} ms exposed of {e['link']:.1f} ms on the link"
                for step, e in r["exposed_ms"].items()
            )
            lines.append(f"  {r['version']:<{width}} {passes}")
    return "\n".join(lines)


NAME = "sequence"
HELP = "lab 10's ring attention against all-gathered K/V and torch's context_parallel, and against Ulysses on a link"
LAB = os.path.join("10_context_parallel", "10_context_parallel.ipynb")


def add_arguments(parser) -> None:
    add_notebook_argument(parser, LAB)
    add_world_size_argument(parser, (4,))
    parser.add_argument("--seq-len", type=int, default=ATTENTION["seq_len"], help="tokens in the sequence")
    parser.add_argument("--heads", type=int, default=ATTENTION["heads"], help="attention heads")
    parser.add_argument("--dim", type=int, default=ATTENTION["dim"], help="head dimension")
    parser.add_argument(
        "--seq-lens",
        default=",".join(map(str, SEQ_LENS)),
        help="sequence lengths of the ring-against-Ulysses rows, comma-separated (default %(default)s)",
    )
    parser.add_argument(
        "--link", default=LINK, help="the emulated link of those rows, a network preset (default %(default)s)"
    )
    add_device_argument(parser, "the attention part runs (torch's context_parallel only on cuda)")


QUICK = ["--world-size", "2", "--seq-len", "64", "--heads", "2", "--dim", "8", "--seq-lens", "32,64"]  # --quick


def measure(args) -> Measured:
    names = ["ring_attention", "ulysses_attention"]
    found = functions_from_lab(args, LAB, names, "ring and Ulysses attention", given=True)  # ring_attention: given
    return over_world_sizes(args, functools.partial(_measure, found), keys=("part", "version"))


def _measure(found: dict, args) -> Measured:
    rows = bench_sequence(
        found,
        world_size=args.world_size,
        seq_len=args.seq_len,
        heads=args.heads,
        dim=args.dim,
        repeats=args.repeats,
        seq_lens=[int(s) for s in args.seq_lens.split(",") if s.strip()],
        network=Network.preset(args.link),
        device=chosen_device(args),
    )
    attention = [r for r in rows if r["part"] == "attention"]
    pictures = [
        chart(attention, f"Attention of one sequence on {args.world_size} ranks", "ms", "ms per forward+backward")
    ]
    longer: dict[str, list[tuple]] = {}
    for r in rows:
        if r["part"] == LONG and "ms" in r:
            name, length = r["version"].split(", S=")
            longer.setdefault(name, []).append((int(length), r["ms"]))
    if longer:
        pictures.append(
            Chart(
                f"Ring against Ulysses on a link ({args.link}), {args.world_size} ranks",
                "ms per forward+backward",
                longer,
                xlabel="sequence length",
                log_x=True,
            )
        )
    return Measured(rows, format_sequence_table(rows), pictures)
