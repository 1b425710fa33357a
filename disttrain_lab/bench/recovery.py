"""What a failure costs: ``bench checkpoint``'s recovery rows (its text says what each one measures).

The lab's job on 2 FSDP ranks, rank 1 killed with ``SIGKILL`` as it begins step ``kill_at + 1``, started
again from its newest checkpoint: by the kit's launcher (``_kit_restart``), and by torchrun's elastic
agent with one restart, each attempt on a store of its own and then on torch's default shared one
(``_torchrun_restart``; a job that hangs is stopped, its agent and its workers, ``_stop_job``).  Below
them torchft's per-step fault tolerance, which saves nothing: two replica groups of one rank and a
lighthouse in this process (``_torchft_recovery``).  ``bench_recovery`` runs them all, a row each.

This module is also the script its workers run, given the job's folder and settings:
``python -m disttrain_lab.bench.recovery --torchrun-child FOLDER TOTAL EVERY KILL_AT`` is a torchrun
worker (the notebook's functions read from the folder, where cloudpickle wrote them by value), and
``--torchft-child FOLDER REPLICA LIGHTHOUSE STORE_PORT TOTAL KILL_AT`` a torchft replica.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from ..labtests.lab12 import mlp
from ..launcher import RankDied, launch
from .command import NotMeasured

NAMES = ("save_checkpoint", "load_checkpoint", "train_with_checkpoints")  # the lab's functions the job runs
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
            # the agent's summary of the last attempt: each worker's exit code (a signal named), as the error
            # said last may be the first attempt's, the kill's expected one
            lines = [ln.strip() for ln in said.splitlines()]
            ranks = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("rank ") and ":" in ln]
            codes = [" ".join(ln.split()[2:]) for ln in lines if ln.startswith("exitcode")]
            ends = ", ".join(f"rank {r}: {c}" for r, c in zip(ranks, codes)) or "(not said)"
            return {"error": f"torchrun exited with {agent.returncode}; the workers ended: {ends}; said: {why[:120]}"}
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
    _end_here()


def _end_here() -> None:
    """End a finished child (its files written and closed) before the interpreter's own teardown, in which torch's
    C++ threads could abort the process now and then ("terminate called without an active exception", SIGABRT,
    no Python frame; 4 of 10 torchrun restarts beside two CPU-bound processes), which torchrun counts as the
    attempt failing and the bench as the replica failing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
    _end_here()


def _torchft_steps(folder: str, replica: int) -> list[tuple[int, float]]:
    with open(os.path.join(folder, f"ft{replica}")) as f:
        # (only whole lines: the survivor may be writing the last one as it is read)
        return [(int(step), float(at)) for step, at in (line.split() for line in f if line.endswith("\n"))]


def _torchft_recovery(total: int, kill_at: int) -> list[dict]:
    """Rows ``torchft, survivor`` and ``torchft, replacement`` (see ``bench checkpoint``'s text), or why not."""
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
        # the replacement starts once the survivor has gone on alone, as a real one (a new node) comes minutes
        # later: started at once, it could register with the lighthouse before the heartbeat timeout, and the
        # survivor would never go on alone (seen once: both at step 3, 1.8 s after the kill)
        with open(os.path.join(folder, "killed")) as f:
            killed = float(f.read())
        deadline = time.monotonic() + 120
        while not [step for step, _ in _torchft_steps(folder, 0) if step > kill_at] and survivor.poll() is None:
            if time.monotonic() > deadline:
                raise NotMeasured("torchft's survivor took no step in 120 s after replica 1 was killed")
            time.sleep(0.02)
        replacement = start(1, 0)
        for child in (survivor, replacement):
            if child.wait(timeout=300) != 0:
                raise NotMeasured(f"a torchft replica ended with {child.returncode}: {said(child)}")
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


if __name__ == "__main__" and sys.argv[1:2] == ["--torchrun-child"]:
    _torchrun_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
if __name__ == "__main__" and sys.argv[1:2] == ["--torchft-child"]:
    _torchft_child(sys.argv[2], int(sys.argv[3]), sys.argv[4], *map(int, sys.argv[5:8]))
