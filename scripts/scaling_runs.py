"""Lab 8, section 5: train the kit's small GPT at a few sizes for a few fixed compute budgets.

For each budget C (FLOPs) and each model size N (parameters), the run trains on D = C / (6 N)
tokens (the 6 N D rule: forward 2 N, backward 4 N FLOPs per token) and records the loss on
held-out text.  Small models see many tokens, large ones few: at each budget one size in the
middle does best (Chinchilla's "IsoFLOP" profiles, Hoffmann et al. 2022, approach 2).  The lab
ships the measurements (``solutions/08_capstone/data/scaling_runs.json``); the notebook only fits them.

    python scripts/scaling_runs.py --out solutions/08_capstone/data/scaling_runs.json

Runs on one CPU thread (the machine is shared); ~10 minutes on a 2-core laptop.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

import torch
from tqdm import tqdm

from disttrain_lab import models

SEQ_LEN = 32
BATCH = 32  # sequences per step: 1024 tokens
WIDTHS = (8, 16, 24, 32, 48, 64)  # d_model; 2 layers, 4 heads (2 for d = 8)
BUDGETS = (1e10, 3e10, 1e11)  # FLOPs per run
CORPUS_TOKENS = 400_000
EVAL_SEQUENCES = 256


def config(width: int) -> models.GPTConfig:
    return models.GPTConfig(vocab=32, seq_len=SEQ_LEN, d_model=width, n_heads=2 if width < 16 else 4, n_layers=2)


@torch.no_grad()
def evaluate(model, batch) -> float:
    x, y = batch
    return float(models.lm_loss(model(x), y))


def train(cfg: models.GPTConfig, tokens: int, train_tokens: torch.Tensor, held_out, seed: int = 0) -> dict:
    """Adam with a cosine schedule to 10 % over the run (fitted to its length, as Chinchilla's)."""
    steps = max(1, round(tokens / (BATCH * SEQ_LEN)))
    model = models.GPT(cfg, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    batches = models.lm_batches(train_tokens, BATCH, SEQ_LEN, steps, seed=seed + 1)
    start = time.perf_counter()
    for x, y in batches:
        optimizer.zero_grad()
        models.lm_loss(model(x), y).backward()
        optimizer.step()
        schedule.step()
    return {
        "steps": steps,
        "tokens": steps * BATCH * SEQ_LEN,
        "loss": evaluate(model, held_out),
        "seconds": time.perf_counter() - start,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=os.path.join("solutions", "08_capstone", "data", "scaling_runs.json"),
        help="the JSON file to write the runs to (default %(default)s)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    train_tokens = models.corpus_tokens(CORPUS_TOKENS, seed=0)
    held_out = models.lm_batches(models.corpus_tokens(20_000, seed=1), EVAL_SEQUENCES, SEQ_LEN, 1, seed=2)[0]
    jobs = [(budget, width) for budget in BUDGETS for width in WIDTHS]
    runs = []
    with tqdm(jobs, desc="scaling runs", unit="run") as bar:
        for budget, width in bar:
            cfg = config(width)
            n = cfg.params()
            bar.set_postfix_str(f"C={budget:.0e} N={n}")
            out = train(cfg, budget / (6 * n), train_tokens, held_out)
            runs.append(
                {
                    "budget": budget,
                    "params": n,
                    "d_model": width,
                    "n_layers": cfg.n_layers,
                    "flops": 6 * n * out["tokens"],
                    **out,
                }
            )
    record = {
        "what": "Lab 8 scaling runs: the kit's GPT (2 layers) at several widths, each trained on D = C / (6 N) "
        "tokens of the generated corpus for each budget C; loss = mean cross-entropy (nats/token) "
        f"on {EVAL_SEQUENCES} held-out sequences of {SEQ_LEN} tokens",
        "command": "python " + " ".join(sys.argv),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "optimizer": "AdamW lr 3e-3, betas (0.9, 0.95), cosine to 10 % over the run",
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "corpus_tokens": CORPUS_TOKENS,
        "runs": runs,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(runs)} runs")
    for r in runs:
        print(
            f"C={r['budget']:.0e}  N={r['params']:>7}  D={r['tokens']:>9}  loss {r['loss']:.4f}  ({r['seconds']:.0f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
