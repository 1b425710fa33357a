"""``disttrain-lab bench 3d``: Lab 8's DP x TP x PP composition, configuration against configuration.

The lab's ``train_3d`` (loaded from the lab notebook) trains the same small GPT on the same
batches on 8 ranks in several shapes — 2 x 2 x 2, pure data parallel (8 x 1 x 1), pure tensor
parallel (1 x 8 x 1, where the heads divide), and the others that fit — side by side, one
launch per run, taking turns (as ``bench.take_turns`` does) so a busy moment of the machine hurts
them alike.
Per configuration: the median step time of the slowest rank, tokens per second, and the
planner's prediction (the lab's ``step_time``, when the notebook defines it) with its residual.
The planner's ``F`` is measured here as well (``COMPUTE``): the FLOP/s one rank reaches
while all 8 train the whole model on their share of the batch at once, as a planner for a real
cluster takes a device's achieved rate from a profiled run.

The ranks run on a two-tier emulated network (``dl.Network.two_tier``: 2 nodes of 4 ranks)
whose links are slow on purpose (``BENCH_INTRA``, ``BENCH_INTER``): 8 ranks on a 2-core laptop
share 2 cores, so their compute is serialized as it never is on a cluster, and a fast emulated
link would leave that artefact to decide the ranking.  With links this slow the emulated
communication (a lower bound that a loaded machine cannot shorten) is most of every step, so
the ranking is the network's and holds on a busy machine.  The measurements can be written as
JSON (``--write``), the file Lab 8's planner checks its ranking against:

    $ disttrain-lab bench 3d --write solutions/08_capstone/data/step_times.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys

from ..network import Network
from .command import Measured, NotMeasured
from .notebook import functions_from_notebook
from .tables import Chart

NAME = "3d"
HELP = "Lab 8: train_3d in several DP x TP x PP shapes on a two-tier emulated network, with the planner's predictions"

LAB = os.path.join("08_capstone", "08_capstone.ipynb")
# the bench's GPT: section 2's, with 8 heads so that pure tensor parallelism on 8 ranks fits
BENCH_MODEL = {"vocab": 32, "seq_len": 16, "d_model": 32, "n_heads": 8, "n_layers": 2}
BENCH_BATCH = 64  # sequences per step (global)
DEVICES_PER_NODE = 4
# slow links (see the module docstring): 10 MB/s inside a node, 1 MB/s across.  The latencies are
# long too (2 ms, 5 ms): an emulated call ends no earlier than gloo's real one, so a latency longer
# than the real cost of a collective among 8 processes on 2 cores (~1 ms) absorbs that cost
BENCH_INTRA = Network(latency=2e-3, bandwidth=10e6, name="bench intra-node link (10 MB/s, 2 ms)")
BENCH_INTER = Network(latency=5e-3, bandwidth=1e6, name="bench inter-node link (1 MB/s, 5 ms)")
# (dp, tp, pp, micro-batches); ranks in Megatron's order: tp fastest, then dp, then pp
CONFIGS = [(2, 2, 2, 2), (8, 1, 1, 1), (1, 8, 1, 1), (4, 2, 1, 1), (2, 4, 1, 1), (4, 1, 2, 2), (1, 4, 2, 2)]


def bench_network() -> Network:
    return Network.two_tier(DEVICES_PER_NODE, intra=BENCH_INTRA, inter=BENCH_INTER)


def _label(config) -> str:
    dp, tp, pp, m = config
    return f"dp={dp} tp={tp} pp={pp} m={m}"


def _one_run(train_3d, cfg, batches, config, lr: float) -> list[float]:
    """In each rank: one run of ``train_3d`` in ``config``; this rank's seconds per step."""
    dp, tp, pp, m = config
    return list(train_3d(cfg, batches, dp=dp, tp=tp, pp=pp, micro_batches=m, lr=lr)["step_s"])


def planner_params(cfg) -> int:
    """The bench GPT's parameters as Lab 8's planner counts them (``ModelSpec.params``: 12 L h² + 2 V h, no
    biases or layer norms), so that its compute term, 6 Ψ per token over ``flops``, is the time measured."""
    return 12 * cfg.n_layers * cfg.d_model**2 + 2 * cfg.vocab * cfg.d_model


def _compute_alone(cfg, x, y, steps: int) -> list[float]:
    """In each rank: seconds of each of ``steps`` training steps of the whole bench GPT on (x, y), SGD, no
    communication."""
    import time

    import torch

    from .. import models

    model = models.GPT(cfg, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        models.lm_loss(model(x), y).backward()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    return seconds


# the planner's F, measured among the configurations (one more entry of each round, so the machine's busy
# moments hurt it as they hurt them): the FLOP/s one rank reaches training the whole bench GPT while all the
# ranks do the same on their share of the batch (pure data parallelism's compute, without its all-reduce).  A
# cluster's planner takes a device's achieved rate from a profiled run, not its peak; here the ranks share this
# machine's cores, as in every configuration (one process alone runs several times faster), and at these small
# batches a step's fixed cost per operation, not its FLOPs, is most of it
COMPUTE = "compute alone"


def _run_entry(entry, train_3d, cfg, batches, lr: float) -> list[float]:
    """In each rank: this rank's seconds per step of one run of ``entry``, a configuration or ``COMPUTE``."""
    if entry == COMPUTE:
        import torch.distributed as dist

        x, y = batches[0]
        rows = len(x) // dist.get_world_size()
        return _compute_alone(cfg, x[:rows], y[:rows], len(batches))
    return _one_run(train_3d, cfg, batches, entry, lr)


def _slowest_steps(runs: list) -> list[float]:
    """Each step's seconds on its slowest rank (a step ends when its slowest rank does), over ``runs`` (each a
    launch's ranks' seconds per step)."""
    return [max(step) for per_rank in runs for step in zip(*per_rank)]


def bench_3d(
    train_3d,
    configs=CONFIGS,
    steps: int = 3,
    repeats: int = 3,
    warmup: int = 1,
    lr: float = 0.5,
    network: Network | None = None,
    timeout: float = 1200.0,
    progress: bool = True,
) -> dict:
    """Median step time (slowest rank) and tokens/s of ``train_3d`` in each configuration, on
    ``network`` (default: ``bench_network()``), one launch per run, the configurations taking
    turns.  Returns the JSON record (``--write`` saves it)."""
    import torch

    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with the kit's `grader` extra (the instructor's tools)
        from contextlib import nullcontext

        def tqdm(*args, **kwargs):
            return nullcontext(
                type("NoBar", (), {"update": lambda self, n=1: None, "set_postfix_str": lambda self, s: None})()
            )

    from .. import models
    from ..launcher import launch

    network = network or bench_network()
    world = {dp * tp * pp for dp, tp, pp, _ in configs}
    if len(world) != 1:
        raise ValueError(f"every configuration must use the same number of ranks, got dp*tp*pp = {sorted(world)}")
    cfg = models.GPTConfig(**BENCH_MODEL)
    batches = models.lm_batches(models.corpus_tokens(20_000), BENCH_BATCH, cfg.seq_len, steps, seed=1)
    ranks = world.pop()
    # taking turns as bench.take_turns does, one launch per run (the warm ranks stay up, and
    # the progress bar can move): round i starts at configuration i, so none always goes first
    entries = [*configs, COMPUTE]
    measured = {entry: [] for entry in entries}  # entry -> runs -> ranks -> steps
    rounds = [entries[i % len(entries) :] + entries[: i % len(entries)] for i in range(warmup + repeats)]
    with tqdm(total=sum(map(len, rounds)), desc="bench 3d", unit="run", disable=not progress, file=sys.stderr) as bar:
        for i, order in enumerate(rounds):
            for entry in order:
                bar.set_postfix_str(entry if entry == COMPUTE else _label(entry))
                net = None if entry == COMPUTE else network
                per_rank = launch(_run_entry, ranks, entry, train_3d, cfg, batches, lr, network=net, timeout=timeout)
                if i >= warmup:
                    measured[entry].append(per_rank)
                bar.update()
    compute_s = statistics.median(_slowest_steps(measured[COMPUTE]))
    flops = 6 * planner_params(cfg) * (BENCH_BATCH // ranks) * cfg.seq_len / compute_s
    runs = []
    for config in configs:
        dp, tp, pp, m = config
        slowest = _slowest_steps(measured[config])
        median = statistics.median(slowest)
        runs.append(
            {
                "dp": dp,
                "tp": tp,
                "pp": pp,
                "micro_batches": m,
                "zero": 0,
                "median_step_s": median,
                "tokens_per_s": BENCH_BATCH * cfg.seq_len / median,
                "step_s": slowest,
            }
        )
    return {
        "what": "Lab 8: train_3d step times on the two-tier emulated network (median of the slowest rank)",
        "command": _command(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "steps": steps,
        "repeats": repeats,
        "warmup": warmup,
        "model": {
            "layers": cfg.n_layers,
            "hidden": cfg.d_model,
            "heads": cfg.n_heads,
            "seq": cfg.seq_len,
            "batch": BENCH_BATCH,
            "vocab": cfg.vocab,
            "bytes_per_value": 4,
        },
        "gpt_config": dict(BENCH_MODEL),
        "parameters": cfg.params(),
        "cluster": {
            "devices": ranks,
            "devices_per_node": network.devices_per_node,
            "intra": {
                "latency": network.intra.latency,
                "bandwidth": network.intra.bandwidth,
                "name": network.intra.name,
            },
            "inter": {
                "latency": network.inter.latency,
                "bandwidth": network.inter.bandwidth,
                "name": network.inter.name,
            },
            "memory": 1e9,
            "flops": flops,
            "flops_note": f"one rank's training FLOP/s (6 x {planner_params(cfg)} parameters per token) while all "
            f"{ranks} train the whole model on {BENCH_BATCH // ranks} sequences each at once, without communication "
            f"(measured as the configurations are, taking turns with them): {compute_s * 1e3:.1f} ms a step, "
            f"on {os.cpu_count()} cores",
        },
        "runs": runs,
    }


def _command() -> str:
    """How this process was started, as a person would type it again."""
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    return " ".join([program or "disttrain-lab"] + sys.argv[1:])


def predictions(record: dict, planner: dict) -> list[float] | None:
    """The planner's predicted seconds per step for each run of ``record`` (None without a planner)."""
    names = ("ModelSpec", "ClusterSpec", "Plan", "step_time")
    if not all(name in planner for name in names):
        return None
    c = record["cluster"]
    net = Network.two_tier(c["devices_per_node"], intra=Network(**c["intra"]), inter=Network(**c["inter"]))
    model = planner["ModelSpec"](**record["model"])
    cluster = planner["ClusterSpec"](devices=c["devices"], network=net, memory=c["memory"], flops=c["flops"])
    return [
        planner["step_time"](model, cluster, planner["Plan"](r["dp"], r["tp"], r["pp"], r["micro_batches"], r["zero"]))
        for r in record["runs"]
    ]


def format_table(record: dict, predicted: list[float] | None) -> str:
    c = record["cluster"]
    net = Network.two_tier(c["devices_per_node"], intra=Network(**c["intra"]), inter=Network(**c["inter"]))
    lines = [
        f"Lab 8 train_3d, GPT of {record['parameters']} parameters, batch {record['model']['batch']} x "
        f"{record['model']['seq']} tokens, {c['devices']} ranks; {net}",
        f"median of {record['repeats']} x {record['steps']} steps, slowest rank",
        f"{'configuration':<24} {'s/step':>8} {'tokens/s':>9} {'predicted':>10} {'residual':>9}",
    ]
    for r in sorted(record["runs"], key=lambda r: r["median_step_s"]):
        j = record["runs"].index(r)
        guess = f"{predicted[j]:9.3f}s" if predicted else "      n/a"
        off = f"{predicted[j] / r['median_step_s'] - 1:+9.1%}" if predicted else "      n/a"
        lines.append(
            f"{_label((r['dp'], r['tp'], r['pp'], r['micro_batches'])):<24} {r['median_step_s']:8.3f} "
            f"{r['tokens_per_s']:9.0f} {guess:>10} {off:>9}"
        )
    if predicted:
        worst = max(abs(p / r["median_step_s"] - 1) for p, r in zip(predicted, record["runs"]))
        lines.append(f"the planner's largest residual (predicted / measured - 1): {worst:.1%}")
    return "\n".join(lines)


def lab_functions(path: str, names) -> dict:
    """``names`` as the notebook at ``path`` defines them, read-only given cells included: Lab 8's
    planner needs ``ModelSpec``, ``ClusterSpec`` and ``Plan``, which the lab gives in locked cells."""
    return functions_from_notebook(path, names, given=True)


def _with_reference_pieces(fn, notebook: str) -> None:
    """Lab 8 takes Lab 6's tensor-parallel pieces from the student's Lab 6 or, failing that, from
    the kit's ``data/reference_pieces.py`` beside it, in a cell that runs checks (which
    ``functions_from_notebook`` does not run): the benchmark gives ``fn`` the kit's pieces."""
    pieces = os.path.join(os.path.dirname(notebook), "data", "reference_pieces.py")
    if os.path.exists(pieces):
        given: dict = {"__name__": "__lab_notebook__"}
        with open(pieces) as f:
            exec(compile(f.read(), pieces, "exec", dont_inherit=True), given)
        for name, value in given.items():
            if not name.startswith("__"):
                fn.__globals__.setdefault(name, value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--notebook",
        help="the lab notebook defining train_3d and the planner (default "
        f"{os.path.join('solutions', LAB)}, else the same under labs/)",
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps per run of a configuration")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="rounds of every configuration run first and not "
        "timed (default 1; 0 for a quick look, whose steps are then timed cold)",
    )
    parser.add_argument("--write", metavar="JSON", help="write the measurements there (Lab 8's step_times.json)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(repeats=3)


def _lab_path(args) -> str | None:
    return args.notebook or next(
        (p for p in (os.path.join("solutions", LAB), os.path.join("labs", LAB)) if os.path.exists(p)), None
    )


QUICK = ["--steps", "1", "--warmup", "0", "--no-progress"]  # bench all --quick


def measure(args) -> Measured:
    path = _lab_path(args)
    if path is None or not os.path.exists(path):
        raise NotMeasured(
            f"no notebook to take train_3d from: pass --notebook PATH (looked for solutions/{LAB}, labs/{LAB})"
        )
    found = lab_functions(path, ["train_3d", "ModelSpec", "ClusterSpec", "Plan", "step_time"])
    if "train_3d" not in found:
        raise NotMeasured(f"{path} does not define train_3d")
    _with_reference_pieces(found["train_3d"], path)
    planner = found
    record = bench_3d(
        found["train_3d"],
        steps=args.steps,
        repeats=args.repeats,
        warmup=args.warmup,
        progress=not getattr(args, "no_progress", False),
    )
    record["notebook"] = path
    predicted = predictions(record, planner)
    table = format_table(record, predicted)
    if args.write:
        with open(args.write, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        table += f"\nwrote {args.write}"
    rows = [dict(r, predicted_s=p) for r, p in zip(record["runs"], predicted or [None] * len(record["runs"]))]
    shapes = [_label((r["dp"], r["tp"], r["pp"], r["micro_batches"])) for r in rows]
    series = {"measured": [(x, r["median_step_s"]) for x, r in zip(shapes, rows)]}
    if predicted:
        series["the planner's prediction"] = list(zip(shapes, predicted))
    picture = Chart("Lab 8: 3D shapes, step time measured and predicted", "s per step", series)
    about = {k: v for k, v in record.items() if k != "runs"}
    return Measured(rows, table, [picture], about)
