"""``disttrain-lab bench memory``: Lab 9's mixed precision, checkpointing and offload beside torch's own.

In one process (a gloo group of one rank: FSDP2 needs it, and ``take_turns`` puts a barrier
before each turn), the versions taking turns step by step so a busy moment of the machine hurts all alike,
each figure beside the formula the lab teaches:

- mixed precision, the same work on both sides: an fp16 model, fp32 master weights stepped by
  ``torch.optim.Adam``, the loss scale starting at 2¹⁶: the lab's ``MixedPrecisionAdam`` with its
  ``DynamicLossScaler``, against the same loop written with torch's pieces (``torch.amp.GradScaler``,
  ``torch.optim.Adam``, ``torch._foreach_copy_``): steps/s (median), the bytes per parameter of the
  state each keeps (``dl.memory.held`` after a backward pass; formula ``2 + 2 + 12``) and the steps each
  skipped on an overflow (the same ones on both sides: the same numbers).  torch's own route, an fp32 model
  under ``torch.autocast(dtype=torch.float16)`` with ``GradScaler``, does other work (no master copy,
  fp32 gradients, the weights cast in every forward; ``4 + 4 + 8`` bytes per parameter): its row is
  shown for reference, its ratio not a like-for-like one;
- checkpointing: every block of a ``models.GPT`` through the lab's ``checkpoint`` against
  ``torch.utils.checkpoint.checkpoint(use_reentrant=True)`` and against none: the bytes autograd keeps
  for the blocks' backward (``dl.memory.SavedActivations`` around the blocks; formula: the block inputs,
  ``4·s·b·h`` each, or without checkpointing the lab's fp32, fused-attention
  ``64·s·b·h + 4·a·s·b + 16·b·s`` per block) and steps/s of forward + backward (median, no hooks);
- offload: the lab's ``OffloadAdam`` (fp16 model, fp32 master weights and Adam on the host) against
  FSDP2, ``fully_shard`` with ``CPUOffloadPolicy`` and an fp16 ``MixedPrecisionPolicy`` on one gloo
  rank, each on its own ``HostLink`` of the same α–β: steps/s, and the bytes per parameter crossing
  the link per step (formula: ``2`` down and ``2`` up for ZeRO-Offload's fp16; ``4`` and ``4`` for
  FSDP2's fp32).  On a CPU FSDP2's host <-> device copies are no-ops (``.to("cpu")``), so the
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

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint

from ..hostlink import HostLink
from ..memory import SavedActivations, held
from ..models import GPT, MLP, GPTConfig, lm_loss, regression_data
from ..network import Network
from ..trace import format_bytes
from .command import Measured, NotMeasured
from .notebook import add_notebook_argument, functions_from_lab
from .tables import chart, mlp_parameters
from .timing import free_port, take_turns

LAB_MIXED = "MixedPrecisionAdam + DynamicLossScaler (lab)"
TORCH_MIXED = "GradScaler + Adam on fp32 masters (torch)"
TORCH_AUTOCAST = "torch.autocast + GradScaler (fp32 model)"
LAB_CHECKPOINT = "checkpoint (lab)"
TORCH_CHECKPOINT = "torch.utils.checkpoint"
NO_CHECKPOINT = "no checkpointing"
LAB_OFFLOAD = "OffloadAdam (lab), overlapped"
TORCH_OFFLOAD = "FSDP2 fully_shard + CPUOffloadPolicy"
TORCH_NAME = {"mixed precision": TORCH_MIXED, "checkpointing": TORCH_CHECKPOINT, "offload": TORCH_OFFLOAD}
MEMORY_MLP = (256, 1024, 1024, 256)
CHECKPOINT_GPT = dict(vocab=32, d_model=64, n_heads=4, n_layers=4)  # and seq_len = the bench's seq
CHECKPOINT_BATCH = 4
SLOW_LINK = (10e-6, 2e7)  # the lab's slow host link (latency s, bytes/s): its time about the step's compute here
FORMULA_TOLERANCE = 0.05  # the issue's: measured memory within 5 % of the formula


def _mixed_precision_rows(found: dict, sizes, batch: int, samples: int) -> list[dict]:
    data = regression_data(batch, sizes[0], sizes[-1], seed=1)
    x16 = data.x.half()
    lab_model = MLP(list(sizes), seed=0).half()
    lab = found["MixedPrecisionAdam"](lab_model, lr=1e-4, scaler=found["DynamicLossScaler"]())
    # torch's pieces doing the same work: the fp16 model, fp32 masters, Adam on them, GradScaler from 2^16
    torch_model = MLP(list(sizes), seed=0).half()
    torch_params = list(torch_model.parameters())
    torch_master = [p.detach().float().requires_grad_() for p in torch_params]
    torch_adam = torch.optim.Adam(torch_master, lr=1e-4)
    torch_scaler = torch.amp.GradScaler("cpu")
    # torch's own route, other work: an fp32 model under autocast, its gradients fp32, no master copy
    autocast_model = MLP(list(sizes), seed=0)
    autocast_adam = torch.optim.Adam(autocast_model.parameters(), lr=1e-4)
    autocast_scaler = torch.amp.GradScaler("cpu")
    state, scales = {}, {LAB_MIXED: [], TORCH_MIXED: [], TORCH_AUTOCAST: []}

    def lab_step(measure=False):
        lab.zero_grad()
        lab.backward(F.mse_loss(lab_model(x16).float(), data.y))
        if measure:
            state[LAB_MIXED] = held(lab_model, lab).total
        lab.step()
        scales[LAB_MIXED].append(lab.scaler.get_scale())

    def torch_step(measure=False):
        torch_model.zero_grad(set_to_none=True)
        torch_scaler.scale(F.mse_loss(torch_model(x16).float(), data.y)).backward()
        if measure:
            state[TORCH_MIXED] = held(torch_model, torch_adam, torch_scaler).total
        for p, m in zip(torch_params, torch_master):
            m.grad = p.grad.float()
        torch_scaler.step(torch_adam)
        torch_scaler.update()
        torch_adam.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(torch_params, torch_master)
        scales[TORCH_MIXED].append(torch_scaler.get_scale())

    def autocast_step(measure=False):
        autocast_adam.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(autocast_model(data.x).float(), data.y)
        autocast_scaler.scale(loss).backward()
        if measure:
            state[TORCH_AUTOCAST] = held(autocast_model, autocast_adam, autocast_scaler).total
        autocast_scaler.step(autocast_adam)
        autocast_scaler.update()
        scales[TORCH_AUTOCAST].append(autocast_scaler.get_scale())

    runners = {LAB_MIXED: lab_step, TORCH_MIXED: torch_step, TORCH_AUTOCAST: autocast_step}
    for _ in range(2):  # Adam's moments exist from the first step on: measure after the second backward
        for run in runners.values():
            run(measure=True)
    seconds = take_turns(runners, samples, warmup=1)  # step by step: a busy moment hurts all versions alike
    psi = mlp_parameters(sizes)
    formula = {LAB_MIXED: 2 + 2 + 12, TORCH_MIXED: 2 + 2 + 12, TORCH_AUTOCAST: 4 + 4 + 8}
    rows = []
    for name in runners:
        skipped = [i for i, (before, after) in enumerate(zip([2.0**16, *scales[name]], scales[name])) if after < before]
        rows.append(
            {
                "part": "mixed precision",
                "version": name,
                "per_s": 1 / statistics.median(seconds[name]),
                "bytes": state[name] / psi,
                "formula": formula[name],
                "skipped": skipped,
                "steps_run": len(scales[name]),
            }
        )
    return rows


def _checkpoint_rows(found: dict, seq: int, batch: int, samples: int) -> list[dict]:
    cfg = GPTConfig(seq_len=seq, **CHECKPOINT_GPT)
    model = GPT(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    versions = {
        LAB_CHECKPOINT: found["checkpoint"],
        TORCH_CHECKPOINT: lambda fn, *args: torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True),
        NO_CHECKPOINT: lambda fn, *args: fn(*args),
    }

    def step(name, saved=None):
        h = model.embed(tokens)
        with saved if saved is not None else contextlib.nullcontext():  # the blocks' part only
            for block in model.blocks:
                h = versions[name](block, h)
        lm_loss(model.logits(h), tokens).backward()
        model.zero_grad(set_to_none=True)

    kept = {}
    for name in versions:
        step(name, saved := SavedActivations(model))
        kept[name] = saved.total
    seconds = take_turns({name: (lambda name=name: step(name)) for name in versions}, samples, warmup=1)
    s, b, h, a, n = seq, batch, cfg.d_model, cfg.n_heads, cfg.n_layers
    inputs = n * 4 * s * b * h  # fp32 block inputs, what a checkpointed block keeps
    whole = n * (64 * s * b * h + 4 * a * s * b + 16 * b * s)  # fp32, no dropout, fused attention (section 1)
    formula = {LAB_CHECKPOINT: inputs, TORCH_CHECKPOINT: inputs, NO_CHECKPOINT: whole}
    return [
        {
            "part": "checkpointing",
            "version": name,
            "per_s": 1 / statistics.median(seconds[name]),
            "bytes": kept[name],
            "formula": formula[name],
        }
        for name in versions
    ]


@contextlib.contextmanager
def _gloo_world_of_one():
    """A gloo process group of one rank (FSDP2 and ``take_turns`` need one), unless one exists already."""
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
    from torch.distributed.fsdp._fully_shard import _fsdp_param  # torch's internals: only where FSDP2 runs

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
    from torch.distributed.device_mesh import init_device_mesh  # FSDP2's pieces: only where it runs
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

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


def _offload_rows(found: dict, sizes, batch: int, samples: int, link) -> list[dict]:
    network = Network(latency=link[0], bandwidth=link[1])
    data = regression_data(batch, sizes[0], sizes[-1], seed=1)
    x16 = data.x.half()
    psi = mlp_parameters(sizes)
    links = {LAB_OFFLOAD: HostLink(network), TORCH_OFFLOAD: HostLink(network)}
    lab_model = MLP(list(sizes), seed=0).half()
    lab = found["OffloadAdam"](lab_model, links[LAB_OFFLOAD], lr=1e-4, overlap=True)

    def lab_step():
        lab.zero_grad()
        F.mse_loss(lab_model(x16).float(), data.y).backward()
        lab.step()

    runners, failed = {LAB_OFFLOAD: lab_step}, None
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(_fsdp2_copies_on(links[TORCH_OFFLOAD]))
            fsdp_model = fsdp2_offload_model(sizes)
            fsdp_opt = torch.optim.Adam(fsdp_model.parameters(), lr=1e-4)
            in_flight = []
            for p in fsdp_model.parameters():  # FSDP2 calls these after it set the sharded (fp32) gradient
                p.register_post_accumulate_grad_hook(
                    lambda p: in_flight.append(links[TORCH_OFFLOAD].copy(p.grad.to_local(), "down"))
                )

            def torch_step():
                fsdp_opt.zero_grad(set_to_none=True)
                F.mse_loss(fsdp_model(data.x).float(), data.y).backward()
                for future in in_flight:
                    future.result()
                in_flight.clear()
                fsdp_opt.step()

            torch_step()
            runners[TORCH_OFFLOAD] = torch_step
        except Exception as e:  # an FSDP2 that does not run on CPU/gloo: its row says why
            failed = f"{type(e).__name__}: {e}"
        lab_step()
        for one in links.values():
            one.reset()  # the warm-up's copies are through: count the timed steps' only
        seconds = take_turns(runners, samples, warmup=0)
    formula = {LAB_OFFLOAD: (2, 2), TORCH_OFFLOAD: (4, 4)}  # fp16 both ways (ZeRO-Offload); FSDP2's fp32
    rows = []
    for name, one in links.items():
        one.close()
        row = {"part": "offload", "version": name, "link": link, "formula": formula[name]}
        if name in seconds:
            row.update(
                per_s=1 / statistics.median(seconds[name]),
                bytes=(one.bytes("down") / samples / psi, one.bytes("up") / samples / psi),
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
    out).  Every step is timed on its own, the versions taking turns step by step, ``repeats × steps``
    steps each after a round that warms up.  Each row: ``per_s`` (steps/s, median), ``bytes`` and the
    ``formula``'s, ``within`` (bytes within 5 % of the formula), ``ratio`` (steps/s ÷ torch's in the same
    part); ``link``: (latency s, bytes/s) of the host link."""
    rows, samples = [], repeats * steps
    with _gloo_world_of_one():
        if "DynamicLossScaler" in found and "MixedPrecisionAdam" in found:
            rows += _mixed_precision_rows(found, sizes, batch, samples)
        if "checkpoint" in found:
            rows += _checkpoint_rows(found, seq, CHECKPOINT_BATCH, samples)
        if "OffloadAdam" in found:
            rows += _offload_rows(found, sizes, batch, samples, link)
    for row in rows:
        row["ratio"] = row["per_s"] / next(r["per_s"] for r in rows if r["version"] == TORCH_NAME[row["part"]])
        pairs = zip(*(x if isinstance(x, tuple) else (x,) for x in (row["bytes"], row["formula"])))
        row["within"] = all(abs(got / want - 1) <= FORMULA_TOLERANCE for got, want in pairs)
        row.update(sizes=tuple(sizes), batch=batch, seq=seq, samples=samples)
    return rows


def format_memory_table(rows: list[dict]) -> str:
    first, lines = rows[0], []
    mlp = f"MLP {' -> '.join(map(str, first['sizes']))}, batch {first['batch']}"
    median = f"median of {first['samples']} steps, in turns"
    offload = next((r["link"] for r in rows if r["part"] == "offload"), None)
    cfg = CHECKPOINT_GPT
    per_param = lambda b: f"{b:.2f}"  # noqa: E731
    both_ways = lambda b: f"{b[0]:.2f}, {b[1]:.2f}"  # noqa: E731
    # each part: its title, its bytes column (heading, width, how a row's bytes and formula read)
    parts = {
        "mixed precision": (
            f"mixed precision: {mlp}, loss scale from 2^16; {median}; skipped: the steps skipped on an overflow",
            "state B/param",
            14,
            per_param,
        ),
        "checkpointing": (
            f"checkpointing every block: GPT of {cfg['n_layers']} blocks, s = {first.get('seq')}, "
            f"b = {CHECKPOINT_BATCH}, h = {cfg['d_model']}, a = {cfg['n_heads']}, fp32; {median}; "
            "bytes the blocks keep for backward",
            "activation bytes",
            17,
            format_bytes,
        ),
        "offload": (
            f"offload: {mlp}, fp16 compute, Adam on the host; host link {offload[1] / 1e6:g} MB/s each way, "
            f"{offload[0] * 1e6:g} µs per copy; {median}"
            if offload
            else "",
            "link B/param down, up",
            22,
            both_ways,
        ),
    }
    for part, (title, heading, width, show) in parts.items():
        mine = [r for r in rows if r["part"] == part]
        if not mine:
            continue
        extra = f" {'skipped':>16}" if part == "mixed precision" else ""
        header = f"{'version':<46} {'steps/s':>9} {heading:>{width}} {'formula':>{width}}{extra} {'vs torch':>9}"
        lines += [title, header]
        for r in mine:
            if "error" in r:
                lines.append(f"{r['version']:<46} cannot run here: {r['error']}")
                continue
            if part == "mixed precision":
                skipped = ",".join(map(str, r["skipped"])) or "none"
                extra = f" {skipped + ' of ' + str(r['steps_run']):>16}"
            lines.append(
                f"{r['version']:<46} {r['per_s']:9.2f} {show(r['bytes']):>{width}} {show(r['formula']):>{width}}"
                f"{extra} {r['ratio']:8.2f}x"
            )
        if part == "checkpointing":
            lines.append(
                "(the lab's checkpoint and torch.utils.checkpoint keep the same inputs and run each block's forward "
                "again in backward; their ratio is the machine's noise, 0.97-1.07x in the runs measured)"
            )
        if part == "mixed precision":
            lines.append(
                "(the lab's and GradScaler's rows do the same arithmetic: fp16 forward and backward, the loss scaled "
                "alike, Adam on fp32 masters; their ratio is the machine's noise, 0.98-1.01x in the runs measured)"
            )
    return "\n".join(lines)


NAME = "memory"
HELP = (
    "lab 9's mixed precision, checkpointing and offload against torch.amp.GradScaler (and torch.autocast), "
    "torch.utils.checkpoint and FSDP2's CPUOffloadPolicy"
)
LAB = os.path.join("09_memory", "09_memory.ipynb")


def add_arguments(parser) -> None:
    add_notebook_argument(parser, LAB)
    parser.add_argument(
        "--steps",
        type=int,
        default=5,
        help="steps per repeat: the medians are of repeats × steps steps, each timed on its own (default 5)",
    )
    parser.add_argument("--seq", type=int, default=128, help="sequence length of the checkpointed GPT (default 128)")
    parser.add_argument(
        "--link-bandwidth",
        type=float,
        default=SLOW_LINK[1],
        help=f"the host link's bytes/s each way for the offload rows (default {SLOW_LINK[1]:g}, the lab's slow link; "
        "PCIe 4.0 x16: 2.5e10)",
    )


QUICK = ["--steps", "2", "--seq", "32"]  # bench all --quick


def measure(args) -> Measured:
    names = ("DynamicLossScaler", "MixedPrecisionAdam", "checkpoint", "OffloadAdam")
    found = functions_from_lab(args, LAB, names, "mixed precision, checkpointing and offload")
    missing = [n for n in names if n not in found]
    if missing:
        raise NotMeasured(f"the notebook does not define {', '.join(missing)}")
    rows = bench_memory(
        found, steps=args.steps, seq=args.seq, repeats=args.repeats, link=(SLOW_LINK[0], args.link_bandwidth)
    )
    pictures = [chart(rows, "Mixed precision, checkpointing and offload", "per_s", "steps/s", series="part")]
    return Measured(rows, format_memory_table(rows), pictures)
