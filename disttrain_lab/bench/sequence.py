"""``disttrain-lab bench sequence``: lab 10's ring attention and expert-parallel MoE, side by side
with the baselines they replace and with torch's own context parallelism where it runs.

Attention (forward and backward of causal attention over a sequence split in zig-zag chunks):
the lab's ``ring_attention``; **all-gather K/V**, every rank gathering the whole sequence's keys
and values and reduce-scattering their gradients (torch's default ``_RotateMethod.ALL_GATHER``,
and Llama 3's); and ``torch.distributed.tensor.experimental.context_parallel`` around
``F.scaled_dot_product_attention``.  torch's runs on GPUs only (``device="cuda"``): its dispatcher
(``_context_parallel/_attention.py``, ``_sdpa_handler``) shards SDPA's CUDA kernels, flash,
memory-efficient and cuDNN; on the CPU SDPA calls ``aten._scaled_dot_product_flash_attention_for_cpu``,
which has no sharding rule, so there it raises ``NotImplementedError`` and the table says why.

The attention and expert parts run on ``device`` (``"cuda"``: rank k on the k-th GPU, NCCL);
the long-sequence part runs on the CPU, where the emulated link slows the transfers (it delays
CPU tensors only).

Experts (forward and backward of one MoE layer): the lab's ``ExpertParallelMoE``; **all-gather
dispatch**, every rank gathering every rank's tokens, running its experts on those routed to
them and reduce-scattering the outputs; and the lab's dense ``MoE`` on one rank's tokens in one
process (all experts on one device).

Long sequences (forward and backward on an emulated link, default 10 Gbit Ethernet, at several
sequence lengths): the lab's ``ring_attention`` (zig-zag) against its ``ulysses_attention``
(contiguous tokens, an all-to-all to a head split and back), side by side in one launch.
"""

from __future__ import annotations

import os

from ..devices import device as rank_device
from ..launcher import launch
from ..network import Network
from ..trace import format_bytes
from .common import (
    add_notebook_argument,
    collective_bytes_counter,
    functions_from_lab,
    slowest_median,
    take_turns,
)

TORCH_CP = "torch context_parallel"
ALL_GATHER_KV = "all-gather K/V"
ALL_GATHER_DISPATCH = "all-gather dispatch"
ONE_PROCESS_MOE = "MoE, one process"
LONG = "long sequences"  # the part of the table: ring against Ulysses on an emulated link
LINK = "10 Gbit Ethernet"
SEQ_LENS = (1024, 2048, 4096)
DEVICES = ("auto", "cpu", "cuda")  # the command line's --device; auto: cuda when every rank has a GPU
CPU_CANNOT = (
    "context_parallel shards SDPA's CUDA kernels only (flash, efficient, cuDNN); on the CPU SDPA runs "
    "aten._scaled_dot_product_flash_attention_for_cpu, which it cannot shard (use --device cuda)"
)
ATTENTION = {"seq_len": 4096, "heads": 8, "dim": 64}  # one sequence, float32
EXPERTS = {"tokens": 2048, "d": 256, "n_experts": 8, "k": 2, "capacity_factor": 1.25}  # tokens per rank


def _row_collectives():
    """(GatherRows, ScatterRows): all_gather_single and reduce_scatter_single over the first
    dimension as autograd Functions, each the other's backward."""
    import torch
    import torch.distributed as dist

    def gather_rows(x):
        out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous())  # all_gather_into_tensor, renamed in torch 2.13
        return out

    def scatter_rows(x):
        out = x.new_empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]))
        dist.reduce_scatter_single(out, x.contiguous())
        return out

    class GatherRows(torch.autograd.Function):
        forward = staticmethod(lambda ctx, x: gather_rows(x))
        backward = staticmethod(lambda ctx, grad: scatter_rows(grad))

    class ScatterRows(torch.autograd.Function):
        forward = staticmethod(lambda ctx, x: scatter_rows(x))
        backward = staticmethod(lambda ctx, grad: gather_rows(grad))

    return GatherRows, ScatterRows


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
    gather, _ = _row_collectives()
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
        keys, values = (gather.apply(t.transpose(0, 1)).transpose(0, 1) for t in (mk, mv))
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


def _expert_runners(versions: dict, tokens: int, d: int, n_experts: int, k: int, capacity_factor: float) -> dict:
    """In a rank: name -> a forward+backward of one MoE layer on this rank's tokens."""
    import torch
    import torch.distributed as dist

    moe, parallel, route = versions.get("MoE"), versions.get("ExpertParallelMoE"), versions.get("top_k_route")
    if moe is None:
        return {}
    n, rank, dev = dist.get_world_size(), dist.get_rank(), rank_device()
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(rank)).to(dev)
    dense = moe(d, 2 * d, n_experts, k, capacity_factor).to(dev)
    runners = {}

    def step(layer):
        def run():
            y, aux = layer(x.clone().requires_grad_())
            (y.sum() + aux).backward()

        return run

    if parallel is not None:
        runners["ExpertParallelMoE"] = step(parallel(dense))
    runners[ONE_PROCESS_MOE] = step(dense)
    if route is not None:
        (gather, scatter), per = _row_collectives(), n_experts // n
        mine = range(rank * per, (rank + 1) * per)

        def all_gather_dispatch():
            xs = x.clone().requires_grad_()
            every = gather.apply(xs)  # (N*T, d): every rank's tokens
            y = torch.zeros_like(every)
            for source in range(n):  # each rank routes its own tokens, capacity per rank
                rows = slice(source * tokens, (source + 1) * tokens)
                experts, gates, kept = route(dense.router(every[rows]), k, capacity_factor)
                for e in mine:
                    token, choice = ((experts == e) & kept).nonzero(as_tuple=True)
                    out = gates[token, choice, None] * dense.experts[e](every[rows][token])
                    y = y.index_add(0, token + source * tokens, out)
            scatter.apply(y).sum().backward()  # this rank's tokens: the sum of every rank's experts' outputs

        runners[ALL_GATHER_DISPATCH] = all_gather_dispatch
    return runners


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
        communicated = {}
        for name, run in runners.items():
            counter = collective_bytes_counter()
            with counter:
                run()
            # an all-to-all keeps 1/N of its tensor: count what it sends, as the ring's isends count theirs
            communicated[name] = counter.bytes * ((n - 1) / n if name.startswith("ulysses") else 1)
        out[seq_len] = {"seconds": take_turns(runners, repeats, warmup), "bytes": communicated}
    return out


def _finished(run):
    """``run``, returning only when the rank's GPU has finished its work (kernels are asynchronous)."""
    import torch

    dev = rank_device()
    if dev.type != "cuda":
        return run

    def synchronized():
        run()
        torch.cuda.synchronize(dev)

    return synchronized


def _sequence_times(versions: dict, attention: dict, experts: dict, repeats: int, warmup: int) -> dict:
    """In each rank: per part and version, seconds per step (interleaved), rank 0's bytes per step, errors."""
    out = {}
    for part, (runners, unavailable) in {
        "attention": _attention_runners(versions, **attention),
        "experts": (_expert_runners(versions, **experts), {}),
    }.items():
        runners = {name: _finished(run) for name, run in runners.items()}
        communicated = {}
        for name, run in runners.items():
            counter = collective_bytes_counter()
            with counter:
                run()
            communicated[name] = counter.bytes
        seconds = take_turns(runners, repeats, warmup) if runners else {}
        out[part] = {"seconds": seconds, "bytes": communicated, "unavailable": unavailable}
    return out


def bench_sequence(
    versions: dict,
    world_size: int = 4,
    seq_len: int = ATTENTION["seq_len"],
    heads: int = ATTENTION["heads"],
    dim: int = ATTENTION["dim"],
    tokens: int = EXPERTS["tokens"],
    d: int = EXPERTS["d"],
    n_experts: int = EXPERTS["n_experts"],
    k: int = EXPERTS["k"],
    capacity_factor: float = EXPERTS["capacity_factor"],
    repeats: int = 5,
    warmup: int = 1,
    timeout: float = 600.0,
    seq_lens=SEQ_LENS,
    network: Network | None = None,
    device: str = "cpu",
) -> list[dict]:
    """Forward+backward time (median of the slowest rank) and rank 0's bytes per step of the lab's
    ``ring_attention`` and ``ExpertParallelMoE`` (``versions``: the notebook's ``ring_attention``,
    ``ExpertParallelMoE``, ``MoE``, ``top_k_route``; any may be missing) beside the baselines, in one
    launch.  ``ratio``: the baseline's time / this one's (above 1: faster than the baseline; the
    baseline is torch's context parallelism where it ran, else all-gather K/V; all-gather dispatch
    for the experts).  ``device``: where the attention and expert parts run, ``"cpu"`` (gloo) or
    ``"cuda"`` (rank k on the k-th GPU, NCCL; torch's context parallelism runs only there).  With both
    ``ring_attention`` and ``ulysses_attention`` in ``versions``, a second launch, on the CPU over
    ``network`` (default 10 Gbit Ethernet), adds the "long sequences" rows: the two at each of
    ``seq_lens``, the ratio being the ring's time / this one's.

        >>> print(format_sequence_table(bench_sequence({"ring_attention": ring_attention, "MoE": MoE})))
    """
    if seq_len % (2 * world_size):
        raise ValueError(f"seq_len={seq_len} is not divisible by 2 x world_size = {2 * world_size} (zig-zag chunks)")
    if n_experts % world_size:
        raise ValueError(f"n_experts={n_experts} is not divisible by world_size={world_size}")
    attention = {"seq_len": seq_len, "heads": heads, "dim": dim}
    experts = {"tokens": tokens, "d": d, "n_experts": n_experts, "k": k, "capacity_factor": capacity_factor}
    per_rank = launch(
        _sequence_times, world_size, versions, attention, experts, repeats, warmup, timeout=timeout, device=device
    )
    rows = []
    for part, size in (("attention", attention), ("experts", experts)):
        first = per_rank[0][part]
        names = [*first["seconds"], *first["unavailable"]]
        part_rows = []
        for name in names:
            row = {"part": part, "version": name, "world_size": world_size, "size": dict(size), "repeats": repeats}
            row["device"] = device
            if name in first["unavailable"]:
                row["error"] = first["unavailable"][name]
            else:
                row["ms"] = 1e3 * slowest_median([rank[part]["seconds"][name] for rank in per_rank])
                row["bytes"] = first["bytes"][name]
            part_rows.append(row)
        measured = {r["version"]: r for r in part_rows if "error" not in r}
        baseline = measured.get(TORCH_CP) or measured.get(ALL_GATHER_KV) or measured.get(ALL_GATHER_DISPATCH)
        for row in part_rows:
            if baseline is not None and "error" not in row:
                row["baseline"], row["ratio"] = baseline["version"], baseline["ms"] / row["ms"]
        rows += part_rows
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
                    "baseline": "ring_attention",
                    "ratio": ring / value,
                }
            )
    return rows


def format_sequence_table(rows: list[dict]) -> str:
    """One line per (part, version): ms per forward+backward, rank 0's bytes, the ratio to the baseline."""
    width = max(24, *(len(r["version"]) for r in rows)) + 2
    lines = []
    for part in ("attention", "experts", LONG):
        mine = [r for r in rows if r["part"] == part]
        if not mine:
            continue
        size = ", ".join(f"{key} {value}" for key, value in mine[0]["size"].items())
        base = next((r["baseline"] for r in mine if "baseline" in r), "-")
        where = f"{mine[0]['world_size']} ranks, {mine[0].get('device', 'cpu')}"
        lines += [
            f"{part} on {where} ({size}); forward + backward, median of {mine[0]['repeats']}, "
            f"slowest rank; bytes: rank 0's communication per step; ratio: {base}'s time / this one's",
            f"  {'version':<{width}} {'ms':>9} {'bytes':>11} {'ratio':>7}",
        ]
        for r in mine:
            if "error" in r:
                lines.append(f"  {r['version']:<{width}} not measured: {r['error']}")
            else:
                ratio = f"{r['ratio']:>6.2f}x" if "ratio" in r else f"{'-':>7}"
                lines.append(f"  {r['version']:<{width}} {r['ms']:>9.1f} {format_bytes(r['bytes']):>11} {ratio}")
    return "\n".join(lines)


NAME = "sequence"
HELP = "lab 10's ring attention and expert-parallel MoE against all-gather baselines and torch's context_parallel"
LAB = os.path.join("10_sequence_experts", "10_sequence_experts.ipynb")


def add_arguments(parser) -> None:
    add_notebook_argument(parser, LAB)
    parser.add_argument("--world-size", type=int, default=4, help="ranks (default %(default)s)")
    parser.add_argument("--seq-len", type=int, default=ATTENTION["seq_len"], help="tokens in the sequence")
    parser.add_argument("--heads", type=int, default=ATTENTION["heads"], help="attention heads")
    parser.add_argument("--dim", type=int, default=ATTENTION["dim"], help="head dimension")
    parser.add_argument("--tokens", type=int, default=EXPERTS["tokens"], help="MoE tokens per rank")
    parser.add_argument("--d", type=int, default=EXPERTS["d"], help="MoE width")
    parser.add_argument("--experts", type=int, default=EXPERTS["n_experts"], help="number of experts")
    parser.add_argument(
        "--seq-lens",
        default=",".join(map(str, SEQ_LENS)),
        help="sequence lengths of the ring-against-Ulysses rows, comma-separated (default %(default)s)",
    )
    parser.add_argument(
        "--link", default=LINK, help="the emulated link of those rows, a network preset (default %(default)s)"
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="where the attention and expert parts run: cpu (gloo), cuda (one GPU per rank, NCCL: torch's "
        "context_parallel runs only there), auto (cuda when every rank has a GPU; default)",
    )


def pick_device(asked: str, world_size: int) -> tuple[str, str]:
    """(``"cpu"`` or ``"cuda"``, why) for ``--device asked`` on ``world_size`` ranks."""
    import torch

    gpus = torch.cuda.device_count()  # asks NVML: CUDA stays uninitialised for the ranks
    if asked == "auto":
        chosen = "cuda" if gpus >= world_size else "cpu"
        return chosen, f"auto: {gpus} GPU(s) visible for {world_size} ranks"
    if asked in ("cpu", "cuda"):
        return asked, "asked"
    raise ValueError(f"device must be one of {DEVICES}, got {asked!r}")


def run(args) -> int:
    names = ["ring_attention", "ExpertParallelMoE", "MoE", "top_k_route", "ulysses_attention"]
    found = functions_from_lab(args, LAB, names, "ring attention and MoE", given=True)  # the given MoE, ring_attention
    if found is None:
        return 2
    device, why = pick_device(args.device, args.world_size)
    print(f"device: {device} ({why})")
    rows = bench_sequence(
        found,
        world_size=args.world_size,
        seq_len=args.seq_len,
        heads=args.heads,
        dim=args.dim,
        tokens=args.tokens,
        d=args.d,
        n_experts=args.experts,
        repeats=args.repeats,
        seq_lens=[int(s) for s in args.seq_lens.split(",") if s.strip()],
        network=Network.preset(args.link),
        device=device,
    )
    print(format_sequence_table(rows))
    return 0
