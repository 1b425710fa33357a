"""``disttrain-lab bench checkpoint``: lab 12's checkpoints, what a save costs and what a failure costs.

**Saving** (FSDP2 on ``world_size`` ranks, a two-layer MLP of ``width`` in fp32 with Adam's state): the
lab's ``save_checkpoint`` beside torch's own ``dcp.save`` of the same state and ``dcp.async_save`` (its
own gloo group: on the training's, its background collectives collide with the step's), timed as the
step is blocked (the asynchronous save also to when its writing ends); the bytes each rank's file
holds, against 12·Ψ/N.

**Recovering** (the lab's ``train_with_checkpoints``, ``save_checkpoint`` and ``load_checkpoint`` on 2
ranks of FSDP, the lab's wide MLP, a checkpoint every ``every`` steps, rank 1 killed with ``SIGKILL`` as
it begins step ``kill_at + 1``): started again by the kit's launcher (``dl.launch`` reports the dead
rank, the job is launched again), and by torchrun's elastic agent (``--max-restarts 1``, which stops
the survivor and starts both again), each from the kill to the first step the new attempt finished:
the failure's report, the restart and the load.  torchrun runs with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torch 2.13 a restart's workers otherwise find the old
workers' addresses in the store the agent shares with them and fail to connect (pytorch#135712); the
row ``torchrun, shared store`` tries torch's default and says what happened (the restarted workers fail to
connect, or hang: a job not ended in ``TORCHRUN_TIMEOUT_S`` is stopped, the agent and its workers).

**Per-step fault tolerance** (torchft, where it is installed: ``pip install torchft==0.2.0`` installs beside
torch 2.13 and runs on gloo): the same MLP in two replica groups of one rank each, torchft's
``DistributedDataParallel`` and ``Manager`` with a lighthouse in this process (a heartbeat timeout of
``FT_HEARTBEAT_MS``); replica 1 is killed as it begins step ``kill_at + 1`` and started again at once.
Nothing is saved to disk: the survivor goes on alone once the lighthouse has given up the dead
replica (row ``torchft, survivor``: from the kill to its next step, no step run again), and the new
replica takes the survivor's state over the network at the next quorum and joins at that step (row
``torchft, replacement``: from the kill to its first step); the two must end with equal parameters.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import TCPStore
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

from ..labtests.lab12 import mlp
from ..launcher import RankDied, launch
from .command import Measured, NotMeasured, add_world_size_argument
from .notebook import add_notebook_argument, functions_from_lab
from .stats import below_in_noise, slowest_samples, spread
from .tables import chart

NAME = "checkpoint"
HELP = "lab 12's save against dcp.save and async_save; a killed rank's recovery by dl.launch, torchrun and torchft"
LAB = os.path.join("12_running_jobs", "12_running_jobs.ipynb")
NAMES = ("save_checkpoint", "load_checkpoint", "train_with_checkpoints")
LAB_SAVE, DCP_SAVE, ASYNC_BLOCKED, ASYNC_WRITTEN = (
    "save_checkpoint (the lab's)",
    "dcp.save",
    "dcp.async_save, blocked",
    "dcp.async_save, written",
)
KIT_RESTART, TORCHRUN_RESTART, TORCHRUN_SHARED, FT_SURVIVOR, FT_REPLACEMENT = (
    "dl.launch again",
    "torchrun --max-restarts 1",
    "torchrun, shared store",
    "torchft, survivor",
    "torchft, replacement",
)
TORCHRUN_TIMEOUT_S = 60  # a torchrun job's limit: its restart takes 6 s here; with the shared store it can hang
STOP_WAIT_S = 10  # a hung torchrun agent's time to stop its workers after SIGTERM
FT_HEARTBEAT_MS = 2000  # the lighthouse's heartbeat timeout: how long a silent replica is waited for
FT_PACE_S = 0.05  # a torchft step's pause (the MLP's step takes ms): the survivor still trains when the new one is up
FT_TOGETHER = 3  # the torchft job ends at --steps or later, once both replicas took part in this many steps in a row
QUICK = ["--width", "256", "--repeats", "1", "--steps", "6", "--every", "2", "--kill-at", "3"]  # --quick


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What torch's saves write: the model's and the optimizer's state dicts (``get_state_dict``)."""
    return dict(zip(("model", "optim"), get_state_dict(model, optimizer)))


def _save_times(versions: dict, width: int, repeats: int, folder: str) -> dict:
    """In each rank: seconds the step is blocked by each save (and the asynchronous one's end), and the
    bytes of this rank's file of the last ``dcp.save``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, width)).sum().backward()
    optimizer.step()
    generator = torch.Generator().manual_seed(0)
    saver = dist.new_group(backend="gloo")  # the asynchronous save's own group
    rank, seconds, size = dist.get_rank(), {}, 0

    def timed(name, i, save, asynchronous=False):
        path = os.path.join(folder, f"{name.split()[0].rstrip(',')}-{i}")
        dist.barrier()
        start = time.perf_counter()
        pending = save(path)
        seconds.setdefault(name, []).append(time.perf_counter() - start)
        if asynchronous:
            pending.result()
            seconds.setdefault(ASYNC_WRITTEN, []).append(time.perf_counter() - start)
        return path

    dcp.save(_state(model, optimizer), checkpoint_id=os.path.join(folder, "warm"))
    for i in range(repeats):  # (after a first save, untimed: DCP's first call sets itself up)
        if "save_checkpoint" in versions:
            timed(LAB_SAVE, i, lambda p: versions["save_checkpoint"](p, model, optimizer, 1, generator))
        # (each save gathers its state dict inside its timing, as the lab's does: the same work in every row)
        last = timed(DCP_SAVE, i, lambda p: dcp.save(_state(model, optimizer), checkpoint_id=p))
        size = os.path.getsize(os.path.join(last, f"__{rank}_0.distcp"))
        timed(
            ASYNC_BLOCKED,
            i,
            lambda p: dcp.async_save(_state(model, optimizer), checkpoint_id=p, process_group=saver),
            asynchronous=True,
        )
    dist.barrier()
    return {"seconds": seconds, "bytes": size, "params": sum(p.numel() for p in model.parameters())}


def bench_saves(versions: dict, world_size: int = 2, width: int = 1024, repeats: int = 5) -> list[dict]:
    """A row per save: ``ms`` (median of the slowest rank) and rank 0's file ``bytes``; ``ratio``: dcp.save's
    time / this one's.  ``versions``: the notebook's ``save_checkpoint`` (may be missing)."""
    folder = tempfile.mkdtemp(prefix="disttrain-bench-checkpoint-")
    try:
        per_rank = launch(_save_times, world_size, versions, width, repeats, folder, timeout=600)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    first, rows = per_rank[0], []
    params = first["params"]
    for name in (LAB_SAVE, DCP_SAVE, ASYNC_BLOCKED, ASYNC_WRITTEN):
        row = {"part": "save", "version": name, "world_size": world_size, "size": {"width": width, "params": params}}
        if name not in first["seconds"]:
            rows.append({**row, "error": "the notebook defines no save_checkpoint"})
            continue
        ms = 1e3 * max(statistics.median(rank["seconds"][name]) for rank in per_rank)
        moves = spread(slowest_samples([rank["seconds"][name] for rank in per_rank]))
        row.update(ms=ms, spread=moves, repeats=repeats, bytes=first["bytes"], rule=12 * params / world_size)
        rows.append(row)
    base = next(r for r in rows if r["version"] == DCP_SAVE)
    for r in rows:
        if "ms" in r:
            r["baseline"], r["ratio"] = DCP_SAVE, base["ms"] / r["ms"]
    return rows


def _job(functions: dict, folder: str, total: int, every: int, kill_at: int | None, attempt: int) -> dict:
    """One attempt of the job (dl.launch's rank, or torchrun's worker): the lab's wide MLP on 2 FSDP ranks,
    the notebook's train_with_checkpoints; rank 1 notes the time and kills itself as it begins step
    ``kill_at + 1`` of a job started afresh; rank 0 notes when each step of this ``attempt`` ended."""
    train = functions["train_with_checkpoints"]  # (it finds the notebook's save and load where it was defined)
    t = mlp.training("fsdp", 0, mlp.WIDE)
    done = [0]

    def step(training):
        if kill_at is not None and done[0] == kill_at and dist.get_rank() == 1:
            with open(os.path.join(folder, "killed"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        mlp.train_step(training)
        done[0] += 1
        if dist.get_rank() == 0:
            with open(os.path.join(folder, f"steps{attempt}"), "a") as f:
                f.write(f"{time.time()!r}\n")

    resumed = train(os.path.join(folder, "checkpoints"), t, total, every, step)
    return {"resumed": resumed}


def _first_step(folder: str, attempt: int) -> float:
    """When the first step of ``attempt`` ended (rank 0's clock: the machine's, as the kill's)."""
    with open(os.path.join(folder, f"steps{attempt}")) as f:
        return min(float(line) for line in f if line.strip())


def _kit_restart(functions: dict, total: int, every: int, kill_at: int) -> dict:
    folder = tempfile.mkdtemp(prefix="disttrain-bench-restart-")
    try:
        try:
            launch(_job, 2, functions, folder, total, every, kill_at, 0, timeout=300)
            raise NotMeasured("the first attempt was not killed: does train_with_checkpoints call train_step?")
        except RankDied:
            reported = time.time()
        resumed = launch(_job, 2, functions, folder, total, every, None, 1, timeout=300)[0]["resumed"]
        with open(os.path.join(folder, "killed")) as f:
            killed = float(f.read())
        return {
            "recovered_s": _first_step(folder, 1) - killed,
            "reported_s": reported - killed,
            "resumed": resumed,
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _torchrun_restart(functions: dict, total: int, every: int, kill_at: int, own_store: bool) -> dict:
    """torchrun's elastic agent with one restart, on this module as its workers' script (``--torchrun-child``),
    the notebook's functions passed by value (cloudpickle)."""
    folder = tempfile.mkdtemp(prefix="disttrain-bench-torchrun-")
    try:
        with open(os.path.join(folder, "functions.pkl"), "wb") as f:
            cloudpickle.dump(functions, f)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        cmd += ["--max-restarts=1", f"--log-dir={os.path.join(folder, 'logs')}", "-m", __name__, "--torchrun-child"]
        cmd += [folder, str(total), str(every), str(kill_at)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if own_store:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        # the agent's output goes to a file, not a pipe: a worker left running would hold a pipe open and
        # reading it would never end (a hung shared-store restart did so: the bench never returned)
        with open(os.path.join(folder, "torchrun.out"), "w+") as log:
            agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
            try:
                agent.wait(timeout=TORCHRUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _stop_job(agent, folder)
                stopped = f"torchrun's job did not end in {TORCHRUN_TIMEOUT_S} s and was stopped"
                return {"error": stopped + " (its restarted workers hung)"}
            log.seek(0)
            said = log.read()
        if agent.returncode != 0:
            errors = [ln for ln in said.splitlines() if "RuntimeError:" in ln] or ["RuntimeError: (no error said)"]
            why = re.sub(r"\[/\S+\] ", "", errors[-1].split("RuntimeError:", 1)[1]).strip()
            return {"error": f"torchrun exited with {agent.returncode}; the restarted workers: {why[:160]}"}
        with open(os.path.join(folder, "killed")) as f:
            killed = float(f.read())
        with open(os.path.join(folder, "resumed")) as f:
            resumed = int(f.read())
        return {"recovered_s": _first_step(folder, 1) - killed, "resumed": resumed}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _stop_job(agent: subprocess.Popen, folder: str) -> None:
    """Stop a torchrun job that hung: SIGTERM to the agent (it stops its workers, each in a session of its
    own), then SIGKILL to it and to any worker of this job still running (found by its command line,
    which names the job's own ``folder``)."""
    agent.terminate()
    try:
        agent.wait(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()
    mark = f"--torchrun-child\0{folder}\0".encode()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if mark in f.read():
                    os.kill(int(entry), signal.SIGKILL)
        except OSError:  # (ended meanwhile, or not a process)
            pass


def _torchrun_child(folder: str, total: int, every: int, kill_at: int) -> None:
    """A torchrun worker: the job's attempt (the first, ``TORCHELASTIC_RESTART_COUNT`` 0, killed), the
    process group from torchrun's environment."""
    with open(os.path.join(folder, "functions.pkl"), "rb") as f:
        functions = cloudpickle.load(f)
    dist.init_process_group("gloo")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    got = _job(functions, folder, total, every, None if attempt else kill_at, attempt)
    if dist.get_rank() == 0:
        with open(os.path.join(folder, "resumed"), "w") as f:
            f.write(str(got["resumed"]))
    dist.destroy_process_group()


def _torchft_child(folder: str, replica: int, lighthouse: str, store_port: int, total: int, kill_at: int) -> None:
    """One replica group of one rank under torchft: the lab's wide MLP (the same initialisation in every
    replica), torchft's DDP and optimizer wrapper; each step's batch seeded by the step and the replica.
    Notes each committed step's end (``ft<replica>``: the step reached, the time); replica 1, when
    ``kill_at`` > 0, notes the time and kills itself as it begins step ``kill_at + 1``.  Ends at step
    ``total`` or later, once the two replicas took part in ``FT_TOGETHER`` steps in a row (the
    replacement has joined), and writes its parameters (``params<replica>``)."""
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    model = mlp.mlp_model(0, mlp.WIDE)
    adam = torch.optim.Adam(model.parameters(), lr=mlp.LR)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": adam.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        adam.load_state_dict(state["optim"])

    wait = timedelta(seconds=60)
    manager = Manager(
        pg=ProcessGroupGloo(),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica{replica}",
        store_addr="localhost",
        store_port=store_port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        timeout=wait,
        quorum_timeout=wait,
        connect_timeout=wait,
    )
    ddp, optimizer = DistributedDataParallel(manager, model), OptimizerWrapper(manager, adam)
    if replica == 0 or kill_at:  # the first two (not the replacement) start together: each waits for the other
        open(os.path.join(folder, f"ready{replica}"), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(folder, f"ready{1 - replica}")) and time.monotonic() < deadline:
            time.sleep(0.01)
    together = 0  # steps in a row both replicas took part in (the same count in both: the same quorums)
    while not (manager.current_step() >= total and together >= FT_TOGETHER):
        step = manager.current_step()
        if kill_at and replica == 1 and step == kill_at:
            with open(os.path.join(folder, "killed"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        generator = torch.Generator().manual_seed(mlp.DATA_SEED + 1000 * step + replica)
        mlp.train_step(mlp.Training(ddp, optimizer, generator, 0, 1))  # (one rank: the replica's whole batch)
        together = together + 1 if manager.num_participants() == 2 else 0
        with open(os.path.join(folder, f"ft{replica}"), "a") as f:
            f.write(f"{manager.current_step()} {time.time()!r}\n")
        time.sleep(FT_PACE_S)
    torch.save([p.detach() for p in model.parameters()], os.path.join(folder, f"params{replica}"))
    manager.shutdown(wait=False)


def _torchft_steps(folder: str, replica: int) -> list[tuple[int, float]]:
    with open(os.path.join(folder, f"ft{replica}")) as f:
        return [(int(step), float(at)) for step, at in (line.split() for line in f if line.strip())]


def _torchft_recovery(total: int, kill_at: int) -> list[dict]:
    """Rows ``torchft, survivor`` and ``torchft, replacement`` (see the module's text), or why not."""
    # torchft's logger reads RUST_LOG once, as torchft is imported: set for the import only, so that the
    # lighthouse in this process does not log every quorum to stderr
    before = os.environ.get("RUST_LOG")
    os.environ["RUST_LOG"] = "error"
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as e:
        why = f"torchft is not installed ({e}); pip install torchft==0.2.0"
        return [{"part": "recovery", "version": v, "error": why} for v in (FT_SURVIVOR, FT_REPLACEMENT)]
    finally:
        if before is None:
            del os.environ["RUST_LOG"]
        else:
            os.environ["RUST_LOG"] = before
    folder = tempfile.mkdtemp(prefix="disttrain-bench-torchft-")
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=FT_HEARTBEAT_MS
    )
    children: list[subprocess.Popen] = []
    stores: list = []  # each replica's store, kept open while it runs
    try:

        def start(replica: int, kill: int) -> subprocess.Popen:
            store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            stores.append(store)
            cmd = [sys.executable, "-m", __name__, "--torchft-child", folder, str(replica), lighthouse.address()]
            cmd += [str(store.port), str(total), str(kill)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "error"}
            log = open(os.path.join(folder, f"log{len(children)}"), "w")  # (a pipe unread would fill and block it)
            child = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            log.close()
            children.append(child)
            return child

        def said(child: subprocess.Popen) -> str:
            with open(os.path.join(folder, f"log{children.index(child)}")) as f:
                return f.read()[-300:]

        survivor, doomed = start(0, 0), start(1, kill_at)
        doomed.wait(timeout=300)
        if doomed.returncode != -signal.SIGKILL:
            raise NotMeasured(f"torchft's replica 1 ended with {doomed.returncode}: {said(doomed)}")
        replacement = start(1, 0)
        for child in (survivor, replacement):
            if child.wait(timeout=300) != 0:
                raise NotMeasured(f"a torchft replica ended with {child.returncode}: {said(child)}")
        with open(os.path.join(folder, "killed")) as f:
            killed = float(f.read())
        ends = [torch.load(os.path.join(folder, f"params{r}")) for r in (0, 1)]
        if not all(torch.equal(a, b) for a, b in zip(*ends)):
            raise NotMeasured("torchft's two replicas ended with different parameters")
        after = [(step, at) for step, at in _torchft_steps(folder, 0) if at > killed]
        joined = [(step, at) for step, at in _torchft_steps(folder, 1) if at > killed]  # the replacement's
        # nothing is run again: the survivor goes on from the kill; the replacement joins where it is
        survived = {"recovered_s": after[0][1] - killed, "resumed": kill_at, "lost_steps": 0}
        replaced = {"recovered_s": joined[0][1] - killed, "resumed": joined[0][0] - 1, "lost_steps": 0}
        return [
            {"part": "recovery", "version": FT_SURVIVOR, **survived},
            {"part": "recovery", "version": FT_REPLACEMENT, **replaced},
        ]
    except (NotMeasured, OSError, subprocess.TimeoutExpired, IndexError) as e:
        return [{"part": "recovery", "version": v, "error": str(e)[:200]} for v in (FT_SURVIVOR, FT_REPLACEMENT)]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        lighthouse.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


def bench_recovery(functions: dict, total: int = 16, every: int = 4, kill_at: int = 10) -> list[dict]:
    """A row per way of starting the job again: ``seconds`` from rank 1's death to the first step the new
    attempt finished, the step it resumed from, the steps lost (``kill_at`` − that step)."""
    if not set(NAMES) <= set(functions):
        missing = ", ".join(sorted(set(NAMES) - set(functions)))
        return [{"part": "recovery", "version": KIT_RESTART, "error": f"the notebook does not define {missing}"}]
    size = {"steps": total, "every": every, "killed after": kill_at}
    rows = []
    for version, measure in (
        (KIT_RESTART, lambda: _kit_restart(functions, total, every, kill_at)),
        (TORCHRUN_RESTART, lambda: _torchrun_restart(functions, total, every, kill_at, own_store=True)),
        (TORCHRUN_SHARED, lambda: _torchrun_restart(functions, total, every, kill_at, own_store=False)),
    ):
        got = measure()
        row = {"part": "recovery", "version": version, "world_size": 2, "size": dict(size), **got}
        if "resumed" in got:
            row["lost_steps"] = kill_at - got["resumed"]
        rows.append(row)
    rows += [{**got, "world_size": 2, "size": dict(size)} for got in _torchft_recovery(total, kill_at)]
    return rows


def format_checkpoint_table(rows: list[dict]) -> str:
    lines = []
    all_saves = [r for r in rows if r["part"] == "save"]
    for world_size in dict.fromkeys(r["world_size"] for r in all_saves):  # (a table per --world-size, in order)
        saves = [r for r in all_saves if r["world_size"] == world_size]
        first = saves[0]
        lines += [
            f"save on {world_size} ranks (FSDP2, a 2-layer MLP of width {first['size']['width']}, "
            f"{first['size']['params']:,} parameters, fp32 + Adam); ms the step is blocked, slowest rank's median; "
            "bytes: rank 0's file, against 12·Ψ/N; ratio: dcp.save's time / this one's",
            f"  {'version':<28} {'ms':>9} {'bytes':>13} {'12·Ψ/N':>13} {'ratio':>7}",
        ]
        for r in saves:
            if "error" in r:
                lines.append(f"  {r['version']:<28} not measured: {r['error']}")
            else:
                lines.append(
                    f"  {r['version']:<28} {r['ms']:>9.1f} {r['bytes']:>13,} {r['rule']:>13,.0f} {r['ratio']:>6.2f}x"
                )
        dcp_save = next((r for r in saves if r["version"] == DCP_SAVE and "ms" in r), None)
        if dcp_save is not None:  # (the asynchronous save's end is not a save blocking the step: not compared)
            blocking = [r for r in saves if r["version"] != ASYNC_WRITTEN]
            lines += ["  " + line for line in below_in_noise(blocking, lambda r, base=dcp_save: base)]
    recovery = [r for r in rows if r["part"] == "recovery"]
    if recovery:
        size = recovery[0].get("size", {})
        lines += [
            f"recovery on 2 ranks (the lab's wide MLP, FSDP2; {size.get('steps')} steps, a checkpoint every "
            f"{size.get('every')}, rank 1 killed after step {size.get('killed after')}): seconds from the kill to "
            "the first step of the new attempt (the failure's report, the restart, the load)",
            f"  {'version':<28} {'seconds':>9} {'resumed at':>11} {'steps lost':>11}",
        ]
        for r in recovery:
            if "error" in r:
                lines.append(f"  {r['version']:<28} not measured: {r['error']}")
            else:
                lines.append(f"  {r['version']:<28} {r['recovered_s']:>9.2f} {r['resumed']:>11} {r['lost_steps']:>11}")
        if any(r["version"] in (FT_SURVIVOR, FT_REPLACEMENT) and "error" not in r for r in recovery):
            lines.append(
                "  torchft: two replica groups of one rank, nothing saved and no step run again: the survivor waits "
                f"out the lighthouse's heartbeat timeout ({FT_HEARTBEAT_MS / 1000:g} s) and goes on alone; the "
                "replacement takes the survivor's state over the network and joins at the step shown "
                "(both end with equal parameters)"
            )
    return "\n".join(lines)


def add_arguments(parser) -> None:
    add_notebook_argument(parser, LAB)
    add_world_size_argument(parser, (2,), "ranks of the saves")
    parser.add_argument("--width", type=int, default=1024, help="the saved MLP's width (default %(default)s)")
    parser.add_argument("--steps", type=int, default=16, help="the recovered job's steps (default %(default)s)")
    parser.add_argument("--every", type=int, default=4, help="its checkpoint interval, steps (default %(default)s)")
    parser.add_argument("--kill-at", type=int, default=10, help="rank 1 dies after this step (default %(default)s)")


def measure(args) -> Measured:
    if not 0 < args.kill_at < args.steps:
        raise NotMeasured(f"--kill-at must lie between 0 and --steps: {args.kill_at} of {args.steps}")
    found = functions_from_lab(args, LAB, NAMES, "checkpointing functions")
    rows = []
    for world_size in args.world_size:
        rows += bench_saves(found, world_size, args.width, args.repeats)
    rows += bench_recovery(found, args.steps, args.every, args.kill_at)
    saves = [r for r in rows if r["part"] == "save" and "ms" in r]
    picture = chart(saves, "A checkpoint's save", "ms", "ms blocked", series="world_size", named="{} ranks")
    return Measured(rows, format_checkpoint_table(rows), [picture])


if __name__ == "__main__" and sys.argv[1:2] == ["--torchrun-child"]:
    _torchrun_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
if __name__ == "__main__" and sys.argv[1:2] == ["--torchft-child"]:
    _torchft_child(sys.argv[2], int(sys.argv[3]), sys.argv[4], *map(int, sys.argv[5:8]))
