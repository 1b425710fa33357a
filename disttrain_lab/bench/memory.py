"""``disttrain-lab bench memory``: Lab 9's mixed precision, checkpointing and offload beside torch's own.

In one process, taking turns so a busy moment of the machine hurts both alike:

- mixed precision: the lab's ``MixedPrecisionAdam`` (fp16 model, fp32 master weights) with its
  ``DynamicLossScaler``, against an fp32 model under ``torch.autocast(dtype=torch.float16)`` with
  ``torch.amp.GradScaler`` and ``torch.optim.Adam``: steps/s (median), and the bytes per parameter
  of the state each keeps (``dl.memory.held`` after a backward pass);
- checkpointing: every block of a ``models.GPT`` through the lab's ``checkpoint`` against
  ``torch.utils.checkpoint.checkpoint(use_reentrant=True)`` and against none: the bytes autograd
  keeps for backward (``dl.memory.SavedActivations``) and ms per step (median);
- offload: the lab's ``OffloadAdam`` (fp16 model, fp32 master weights and Adam on the host) against
  FSDP2, ``fully_shard`` with ``CPUOffloadPolicy`` and an fp16 ``MixedPrecisionPolicy`` on one gloo
  rank, each on its own ``HostLink`` of the same α–β: steps/s, and the bytes per parameter crossing
  the link per step.  On a CPU FSDP2's host <-> device copies are no-ops (``.to("cpu")``), so the
  bench puts them on the link where torch makes them (torch 2.13, ``_fully_shard``): the sharded
  fp32 parameter before each all-gather (``FSDPParam.all_gather_inputs``: up), and each sharded
  gradient after the reduce-scatter, which FSDP2 casts back to fp32 before its copy to the host and
  hands to the parameter's post-accumulate-grad hooks (down; the optimizer step waits for it, as
  FSDP2's ``grad_offload_event`` makes it).  ``CPUOffloadPolicy()``'s default ``pin_memory=True``
  needs an accelerator; the bench passes ``pin_memory=False``.  If FSDP2 cannot run, its row says why,
  with the error torch raised.

    >>> found = bench.functions_from_notebook("solutions/09_memory/09_memory.ipynb",
    ...                                       ["DynamicLossScaler", "MixedPrecisionAdam", "checkpoint", "OffloadAdam"])
    >>> print(format_memory_table(bench_memory(found)))
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

from .common import add_notebook_argument, free_port, functions_from_lab

LAB_MIXED = "MixedPrecisionAdam + DynamicLossScaler (lab)"
TORCH_MIXED = "torch.autocast + GradScaler + Adam"
LAB_CHECKPOINT = "checkpoint (lab)"
TORCH_CHECKPOINT = "torch.utils.checkpoint"
NO_CHECKPOINT = "no checkpointing"
LAB_OFFLOAD = "OffloadAdam (lab), overlapped"
TORCH_OFFLOAD = "FSDP2 fully_shard + CPUOffloadPolicy"
MEMORY_MLP = (256, 1024, 1024, 256)
SLOW_LINK = (10e-6, 2e7)  # the lab's slow host link (latency s, bytes/s): its time about the step's compute here


def _turns(runners: dict, repeats: int, warmup: int = 1) -> dict:
    """Seconds of each ``runners[name]()`` call, the names taking turns; ``warmup`` rounds left out."""
    names, seconds = list(runners), {}
    for i in range(warmup + repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            runners[name]()
            if i >= warmup:
                seconds.setdefault(name, []).append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def _mixed_precision_rows(found: dict, sizes, batch: int, steps: int, repeats: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from ..memory import held
    from ..models import MLP, regression_data

    data = regression_data(batch, sizes[0], sizes[-1], seed=1)
    lab_model = MLP(list(sizes), seed=0).half()
    lab = found["MixedPrecisionAdam"](lab_model, lr=1e-4, scaler=found["DynamicLossScaler"]())
    torch_model = MLP(list(sizes), seed=0)
    torch_opt = torch.optim.Adam(torch_model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    state = {}

    def lab_steps(measure=False):
        for _ in range(steps):
            lab.zero_grad()
            lab.backward(F.mse_loss(lab_model(data.x.half()).float(), data.y))
            if measure:
                state[LAB_MIXED] = held(lab_model, lab).total
            lab.step()

    def torch_steps(measure=False):
        for _ in range(steps):
            torch_opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(torch_model(data.x).float(), data.y)
            scaler.scale(loss).backward()
            if measure:
                state[TORCH_MIXED] = held(torch_model, torch_opt, scaler).total
            scaler.step(torch_opt)
            scaler.update()

    lab_steps(measure=True)
    torch_steps(measure=True)  # Adam's moments exist from here on
    lab_steps(measure=True)
    torch_steps(measure=True)
    seconds = _turns({LAB_MIXED: lab_steps, TORCH_MIXED: torch_steps}, repeats)
    psi = sum(p.numel() for p in torch_model.parameters())
    return [
        {"part": "mixed precision", "version": name, "per_s": steps / seconds[name], "bytes": state[name] / psi}
        for name in (LAB_MIXED, TORCH_MIXED)
    ]


def _checkpoint_rows(found: dict, seq: int, batch: int, repeats: int) -> list[dict]:
    import torch
    import torch.utils.checkpoint

    from ..memory import SavedActivations
    from ..models import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(vocab=32, seq_len=seq, d_model=64, n_heads=4, n_layers=4)
    model = GPT(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    versions = {
        LAB_CHECKPOINT: found["checkpoint"],
        TORCH_CHECKPOINT: lambda fn, *args: torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True),
        NO_CHECKPOINT: lambda fn, *args: fn(*args),
    }
    kept = {}

    def step(name, measure=False):
        with SavedActivations(model) as saved:
            h = model.embed(tokens)
            for block in model.blocks:
                h = versions[name](block, h)
            loss = lm_loss(model.logits(h), tokens)
        if measure:
            kept[name] = saved.total
        loss.backward()
        model.zero_grad(set_to_none=True)

    for name in versions:
        step(name, measure=True)
    seconds = _turns({name: (lambda name=name: step(name)) for name in versions}, repeats)
    return [
        {"part": "checkpointing", "version": name, "per_s": 1 / seconds[name], "bytes": kept[name]} for name in versions
    ]


@contextlib.contextmanager
def _gloo_world_of_one():
    """A gloo process group of one rank (FSDP2 needs one), unless one exists already."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _fsdp2_copies_on(link):
    """FSDP2's host -> device copy of each sharded parameter (before its all-gather) over ``link``, "up"."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    original = _fsdp_param.FSDPParam.all_gather_inputs

    def all_gather_inputs(self):
        if self.offload_to_cpu and self.sharded_state == _fsdp_param.ShardedState.SHARDED:
            link.copy(self._sharded_param_data, "up").result()  # torch: .to(self.device, non_blocking=True)
        return original.fget(self)

    _fsdp_param.FSDPParam.all_gather_inputs = property(all_gather_inputs)
    try:
        yield
    finally:
        _fsdp_param.FSDPParam.all_gather_inputs = original


def fsdp2_offload_model(sizes, seed: int = 0):
    """An fp32 ``models.MLP`` under FSDP2 on one gloo rank (the process group must exist): ``fully_shard``
    on each Linear and the root, ``CPUOffloadPolicy(pin_memory=False)``, fp16 compute
    (``MixedPrecisionPolicy(param_dtype=torch.float16)``), parameters kept unsharded from forward to
    backward (``reshard_after_forward=False``, as ZeRO-Offload keeps its fp16 weights on the device)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from ..models import MLP

    model = MLP(list(sizes), seed=seed)
    options = dict(
        mesh=init_device_mesh("cpu", (1,)),
        offload_policy=CPUOffloadPolicy(pin_memory=False),
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16),
        reshard_after_forward=False,
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **options)
    return fully_shard(model, **options)


def _offload_rows(found: dict, sizes, batch: int, steps: int, repeats: int, link) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from ..hostlink import HostLink
    from ..models import MLP, regression_data
    from ..network import Network

    network = Network(latency=link[0], bandwidth=link[1])
    data = regression_data(batch, sizes[0], sizes[-1], seed=1)
    x16 = data.x.half()
    psi = sum(p.numel() for p in MLP(list(sizes), seed=0).parameters())
    links = {LAB_OFFLOAD: HostLink(network), TORCH_OFFLOAD: HostLink(network)}
    lab_model = MLP(list(sizes), seed=0).half()
    lab = found["OffloadAdam"](lab_model, links[LAB_OFFLOAD], lr=1e-4, overlap=True)

    def lab_steps():
        for _ in range(steps):
            lab.zero_grad()
            F.mse_loss(lab_model(x16).float(), data.y).backward()
            lab.step()

    runners, failed = {LAB_OFFLOAD: lab_steps}, None
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(_gloo_world_of_one())
            stack.enter_context(_fsdp2_copies_on(links[TORCH_OFFLOAD]))
            fsdp_model = fsdp2_offload_model(sizes)
            fsdp_opt = torch.optim.Adam(fsdp_model.parameters(), lr=1e-4)
            in_flight = []
            for p in fsdp_model.parameters():  # FSDP2 calls these after it set the sharded (fp32) gradient
                p.register_post_accumulate_grad_hook(
                    lambda p: in_flight.append(links[TORCH_OFFLOAD].copy(p.grad.to_local(), "down"))
                )

            def torch_steps():
                for _ in range(steps):
                    fsdp_opt.zero_grad(set_to_none=True)
                    F.mse_loss(fsdp_model(data.x).float(), data.y).backward()
                    for future in in_flight:
                        future.result()
                    in_flight.clear()
                    fsdp_opt.step()

            torch_steps()
            runners[TORCH_OFFLOAD] = torch_steps
        except Exception as e:  # an FSDP2 that does not run on CPU/gloo: its row says why
            failed = f"{type(e).__name__}: {e}"
        lab_steps()
        for one in links.values():
            one.reset()
        seconds = _turns(runners, repeats, warmup=0)
    rows = []
    for name, one in links.items():
        one.close()
        samples = repeats * steps
        row = {"part": "offload", "version": name, "link": link}
        if name in seconds:
            row.update(
                per_s=steps / seconds[name], bytes=(one.bytes("down") / samples / psi, one.bytes("up") / samples / psi)
            )
        else:
            row.update(per_s=float("nan"), bytes=(float("nan"), float("nan")), error=failed)
        rows.append(row)
    return rows


def bench_memory(
    found: dict,
    sizes=MEMORY_MLP,
    batch: int = 64,
    steps: int = 5,
    seq: int = 128,
    repeats: int = 5,
    link=SLOW_LINK,
):
    """Rows of the three comparisons (see the module docstring); ``found``: the lab's ``DynamicLossScaler``,
    ``MixedPrecisionAdam``, ``checkpoint`` and ``OffloadAdam`` (a part whose pieces are missing is left
    out).  ``ratio``: steps/s ÷ torch's in the same part; ``link``: (latency s, bytes/s) of the host link."""
    rows = []
    if "DynamicLossScaler" in found and "MixedPrecisionAdam" in found:
        rows += _mixed_precision_rows(found, sizes, batch, steps, repeats)
    if "checkpoint" in found:
        rows += _checkpoint_rows(found, seq, 4, repeats)
    if "OffloadAdam" in found:
        rows += _offload_rows(found, sizes, batch, steps, repeats, link)
    torch_name = {"mixed precision": TORCH_MIXED, "checkpointing": TORCH_CHECKPOINT, "offload": TORCH_OFFLOAD}
    for row in rows:
        row["ratio"] = row["per_s"] / next(r["per_s"] for r in rows if r["version"] == torch_name[row["part"]])
        row.update(sizes=tuple(sizes), batch=batch, seq=seq, repeats=repeats)
    return rows


def format_memory_table(rows: list[dict]) -> str:
    from ..trace import format_bytes

    first, lines = rows[0], []
    mlp = f"MLP {' -> '.join(map(str, first['sizes']))}, batch {first['batch']}, fp16"
    median = f"median of {first['repeats']}"
    offload = next((r["link"] for r in rows if r["part"] == "offload"), None)
    # each part: its title, its bytes column (heading, width) and how a row's bytes read
    parts = {
        "mixed precision": (f"mixed precision: {mlp}; {median}", "state B/param", 14, lambda b: f"{b:.2f}"),
        "checkpointing": (
            f"checkpointing every block: GPT of 4 blocks, s = {first.get('seq')}, b = 4, h = 64; {median}",
            "activation bytes",
            17,
            format_bytes,
        ),
        "offload": (
            f"offload: {mlp}, Adam on the host; host link {offload[1] / 1e6:g} MB/s each way, "
            f"{offload[0] * 1e6:g} µs per copy; {median}"
            if offload
            else "",
            "link B/param down, up",
            22,
            lambda b: f"{b[0]:.2f}, {b[1]:.2f}",
        ),
    }
    for part, (title, heading, width, show) in parts.items():
        mine = [r for r in rows if r["part"] == part]
        if not mine:
            continue
        lines += [title, f"{'version':<46} {'steps/s':>9} {heading:>{width}} {'vs torch':>9}"]
        for r in mine:
            if "error" in r:
                lines.append(f"{r['version']:<46} cannot run here: {r['error']}")
            else:
                lines.append(f"{r['version']:<46} {r['per_s']:9.2f} {show(r['bytes']):>{width}} {r['ratio']:8.2f}x")
    return "\n".join(lines)


NAME = "memory"
HELP = (
    "lab 9's mixed precision, checkpointing and offload against torch.autocast + GradScaler, "
    "torch.utils.checkpoint and FSDP2's CPUOffloadPolicy"
)
LAB = os.path.join("09_memory", "09_memory.ipynb")


def add_arguments(parser) -> None:
    add_notebook_argument(parser, LAB)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per timed sample (default 5)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length of the checkpointed GPT (default 128)")
    parser.add_argument(
        "--link-bandwidth",
        type=float,
        default=SLOW_LINK[1],
        help=f"the host link's bytes/s each way for the offload rows (default {SLOW_LINK[1]:g}, the lab's slow link; "
        "PCIe 4.0 x16: 2.5e10)",
    )


def run(args) -> int:
    names = ("DynamicLossScaler", "MixedPrecisionAdam", "checkpoint", "OffloadAdam")
    found = functions_from_lab(args, LAB, names, "mixed precision, checkpointing and offload")
    if found is None:
        return 2
    missing = [n for n in names if n not in found]
    if missing:
        return 2
    rows = bench_memory(
        found, steps=args.steps, seq=args.seq, repeats=args.repeats, link=(SLOW_LINK[0], args.link_bandwidth)
    )
    print(format_memory_table(rows))
    return 0
