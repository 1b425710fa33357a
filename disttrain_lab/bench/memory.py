"""``disttrain-lab bench memory``: Lab 9's mixed precision and checkpointing beside torch's own.

In one process, taking turns so a busy moment of the machine hurts both alike:

- mixed precision: the lab's ``MixedPrecisionAdam`` (fp16 model, fp32 master weights) with its
  ``DynamicLossScaler``, against an fp32 model under ``torch.autocast(dtype=torch.float16)`` with
  ``torch.amp.GradScaler`` and ``torch.optim.Adam``: steps/s (median), and the bytes per parameter
  of the state each keeps (``dl.memory.held`` after a backward pass);
- checkpointing: every block of a ``models.GPT`` through the lab's ``checkpoint`` against
  ``torch.utils.checkpoint.checkpoint(use_reentrant=True)`` and against none: the bytes autograd
  keeps for backward (``dl.memory.SavedActivations``) and ms per step (median).

    >>> found = bench.functions_from_notebook("solutions/09_memory/09_memory.ipynb",
    ...                                       ["DynamicLossScaler", "MixedPrecisionAdam", "checkpoint"])
    >>> print(format_memory_table(bench_memory(found)))
"""

from __future__ import annotations

import os
import statistics
import time

from .common import add_notebook_argument, functions_from_lab

LAB_MIXED = "MixedPrecisionAdam + DynamicLossScaler (lab)"
TORCH_MIXED = "torch.autocast + GradScaler + Adam"
LAB_CHECKPOINT = "checkpoint (lab)"
TORCH_CHECKPOINT = "torch.utils.checkpoint"
NO_CHECKPOINT = "no checkpointing"
MEMORY_MLP = (256, 1024, 1024, 256)


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


def bench_memory(found: dict, sizes=MEMORY_MLP, batch: int = 64, steps: int = 5, seq: int = 128, repeats: int = 5):
    """Rows of both comparisons (see the module docstring); ``found``: the lab's ``DynamicLossScaler``,
    ``MixedPrecisionAdam`` and ``checkpoint``.  ``ratio``: steps/s ÷ torch's in the same part."""
    rows = _mixed_precision_rows(found, sizes, batch, steps, repeats) + _checkpoint_rows(found, seq, 4, repeats)
    for row in rows:
        torch_name = TORCH_MIXED if row["part"] == "mixed precision" else TORCH_CHECKPOINT
        row["ratio"] = row["per_s"] / next(r["per_s"] for r in rows if r["version"] == torch_name)
        row.update(sizes=tuple(sizes), batch=batch, seq=seq, repeats=repeats)
    return rows


def format_memory_table(rows: list[dict]) -> str:
    from ..trace import format_bytes

    first = rows[0]
    lines = [
        f"mixed precision: MLP {' -> '.join(map(str, first['sizes']))}, batch {first['batch']}, fp16; "
        f"median of {first['repeats']}",
        f"{'version':<46} {'steps/s':>9} {'state B/param':>14} {'vs torch':>9}",
    ]
    for r in rows:
        if r["part"] == "mixed precision":
            lines.append(f"{r['version']:<46} {r['per_s']:9.2f} {r['bytes']:14.2f} {r['ratio']:8.2f}x")
    lines += [
        f"checkpointing every block: GPT of 4 blocks, s = {first['seq']}, b = 4, h = 64; median of {first['repeats']}",
        f"{'version':<46} {'steps/s':>9} {'activation bytes':>17} {'vs torch':>9}",
    ]
    for r in rows:
        if r["part"] == "checkpointing":
            lines.append(f"{r['version']:<46} {r['per_s']:9.2f} {format_bytes(r['bytes']):>17} {r['ratio']:8.2f}x")
    return "\n".join(lines)


NAME = "memory"
HELP = "lab 9's mixed precision and checkpointing against torch.autocast + GradScaler and torch.utils.checkpoint"
LAB = os.path.join("09_memory", "09_memory.ipynb")


def add_arguments(parser) -> None:
    add_notebook_argument(parser, LAB)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per timed sample (default 5)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length of the checkpointed GPT (default 128)")


def run(args) -> int:
    names = ("DynamicLossScaler", "MixedPrecisionAdam", "checkpoint")
    found = functions_from_lab(args, LAB, names, "mixed precision and checkpointing")
    if found is None:
        return 2
    missing = [n for n in names if n not in found]
    if missing:
        return 2
    rows = bench_memory(found, steps=args.steps, seq=args.seq, repeats=args.repeats)
    print(format_memory_table(rows))
    return 0
