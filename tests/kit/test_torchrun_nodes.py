"""The same code runs under ``torchrun`` on a cluster: two "nodes" on one machine.

Two ``torchrun`` agents are started at once, ``--nnodes 2 --node-rank 0`` and ``--node-rank 1``,
meeting over a c10d rendezvous on localhost, each with ``--nproc-per-node 2``: 4 ranks on 2
nodes, as on a cluster (only the network is loopback).  Their script calls the kit's own entry
point, ``dl.launch(fn, 4, trace=True)``, which under torchrun (RANK/WORLD_SIZE set) joins
torchrun's process group and runs ``fn`` on the current rank.  ``fn`` is one lab's solution:
lab 3's ``BucketedDDP`` (read from the instructor notebook, as ``disttrain-lab bench ddp`` reads
it, and sent to the script by value with cloudpickle, as ``dl.launch`` sends it to its ranks)
training a small MLP for 3 steps in 3 buckets on per-rank shards (3, 3, 2, 2 rows) of a seeded batch.

The test then runs the very same function with ``dl.launch(fn, 4, trace=True)`` the notebook's
way (forked ranks on this machine) and checks:

- torchrun's ranks saw world size 4, on two nodes (two agents, GROUP_RANK 0 and 1, LOCAL_RANK
  0 and 1 on each) and every rank got all 4 ranks' results back from ``launch``;
- on every rank the parameters after training equal the notebook run's (gloo reduces in the same
  ring order: here they are bit for bit the same; the test allows float rounding), all ranks hold
  the same parameters, and they match one process training on the whole batch;
- the trace is the same: on every rank both runs made the same calls (a broadcast per parameter,
  one all-reduce per bucket per step) with the same bytes, which are the gradients' bytes.

No leftover processes: each agent runs in its own session, and at the end every process of both
trees (agents and their workers, which torchrun starts in sessions of their own) is killed.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import cloudpickle
import pytest
import torch

import disttrain_lab as dl
from disttrain_lab import bench
from disttrain_lab.bench.timing import free_port
from tests.helpers import alive, child_pids
from tests.notebooks import solution_notebook

LAB = solution_notebook("03_data_parallel")
NAMES = ["BucketedDDP", "shard", "shard_loss"]
WORLD, NODES = 4, 2
SIZES, BATCH, STEPS = (8, 16, 16, 4), 10, 3  # 10 rows on 4 ranks: shards of 3, 3, 2, 2
BUCKET_MB = 1024 / 2**20  # 1 KiB buckets: 3 buckets of this MLP's 1888 gradient bytes
DEADLINE_S = 120  # per torchrun attempt; a good one takes 10-25 s on 2 cores
RDZV_CLASH = re.compile(r"RendezvousConnectionError|Address already in use|EADDRINUSE|address is already in use")


# ---- run on every rank, under torchrun and in the notebook's forked ranks alike ------------
# (the torchrun script gets these functions' source, so both runs execute the same code)


def train_bucketed(BucketedDDP, shard, shard_loss, sizes, batch, steps, bucket_mb):
    """Lab 3's bucketed DDP: ``steps`` SGD steps of an MLP on this rank's shard of each batch."""
    import os

    import torch
    import torch.distributed as dist

    from disttrain_lab.models import MLP, regression_data

    torch.manual_seed(0)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = regression_data(batch * steps, sizes[0], sizes[-1], seed=1)
    model = MLP(list(sizes), seed=0)
    ddp = BucketedDDP(model, bucket_mb=bucket_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = data.x[step * batch : (step + 1) * batch], data.y[step * batch : (step + 1) * batch]
        optimizer.zero_grad()
        shard_loss(ddp, shard(x, rank, world_size), shard(y, rank, world_size), batch).backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "NODE_LABEL")}
    return {
        "rank": rank,
        "world_size": world_size,
        "params": params,
        "buckets": len(ddp.buckets),
        "pid": os.getpid(),
        "env": env,
    }


def trace_facts(run) -> dict:
    """What the trace says each rank did: calls per op, and the bytes of its all-reduces and broadcasts in order."""
    return {
        r: {
            "calls": dict(run.calls(r)),
            "all_reduce_bytes": [e.bytes for e in run.select(op="all_reduce", rank=r)],
            "broadcast_bytes": [e.bytes for e in run.select(op="broadcast", rank=r)],
        }
        for r in range(run.world_size)
    }


SCRIPT = """\
import os

import cloudpickle
import torch

import disttrain_lab as dl

{functions}

with open({classes!r}, "rb") as f:
    lab = cloudpickle.load(f)       # lab 3's BucketedDDP, shard, shard_loss
run = dl.launch(dl.profiled(train_bucketed, {profile!r}), {world}, *(lab[n] for n in {names!r}), {sizes!r}, {batch},
                {steps}, {bucket_mb!r}, trace=True, timeout=90)
rank = int(os.environ["RANK"])
torch.save({{"result": run.results[rank], "results": run.results, "world_size": run.world_size,
            "trace": trace_facts(run)}}, os.path.join({out!r}, f"rank{{rank}}.pt"))
"""


# ---- starting two torchrun agents and cleaning up after them -------------------------------


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(child_pids(p))
    return tree


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL an agent's session and, as torchrun starts each worker in a session of its own,
    every worker's: every process group led by a process of this tree."""
    tree = process_tree(proc.pid) if proc.poll() is None else []
    for pid in tree:
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the agent's own group, whatever is left in it
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def two_nodes(script, logs) -> list[tuple[int, str]]:
    """Start both agents at once on a fresh rendezvous port; wait for both (or the deadline).
    Returns each agent's (exit code, output)."""
    port, rdzv_id = free_port(), f"disttrain-lab-{uuid.uuid4().hex[:8]}"
    procs = []
    try:
        for node in range(NODES):
            log = open(logs / f"node{node}.log", "w")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(NODES),
                "--node-rank",
                str(node),
                "--nproc-per-node",
                str(WORLD // NODES),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"localhost:{port}",
                "--rdzv-id",
                rdzv_id,
                "--max-restarts",
                "0",
                "--log-dir",  # torchrun's own logs here, not a torchelastic_* folder left in /tmp
                str(logs / f"elastic{node}"),
                # node 0 hosts the rendezvous store (as on a cluster, the endpoint's host does), so
                # a port someone else took fails at once instead of both agents joining a stranger
                "--rdzv-conf",
                f"is_host={int(node == 0)}",
                str(script),
            ]
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=logs,
                    start_new_session=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1", "NODE_LABEL": f"agent{node}"},
                )
            )
            log.close()
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:  # both done, or one failed: the other cannot finish alone
            codes = [proc.poll() for proc in procs]
            if all(code is not None for code in codes) or any(code for code in codes):
                break
            time.sleep(0.1)
    finally:
        for proc in procs:
            kill_tree(proc)
    return [(proc.returncode, (logs / f"node{node}.log").read_text()) for node, proc in enumerate(procs)]


# ---- the test --------------------------------------------------------------------------------


@pytest.mark.slow
def test_bucketed_ddp_on_two_torchrun_nodes_matches_the_notebook_launch(tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    logs.mkdir()
    functions = "\n\n".join(inspect.getsource(f) for f in (train_bucketed, trace_facts))
    script = tmp_path / "lab03_on_two_nodes.py"
    # the lab's classes, read from the notebook once and sent to torchrun's ranks by value, as
    # dl.launch sends them to forked ranks (each rank reading the notebook itself would import
    # nbformat and matplotlib 4 times over: ~7 s more on 2 cores)
    lab = bench.functions_from_notebook(LAB, NAMES)
    assert sorted(lab) == sorted(NAMES), sorted(lab)
    (tmp_path / "lab03.pkl").write_bytes(cloudpickle.dumps(lab))
    script.write_text(
        SCRIPT.format(
            functions=functions,
            classes=str(tmp_path / "lab03.pkl"),
            names=NAMES,
            world=WORLD,
            sizes=SIZES,
            batch=BATCH,
            steps=STEPS,
            bucket_mb=BUCKET_MB,
            out=str(out),
            profile=str(tmp_path / "profile"),
        )
    )

    agents = two_nodes(script, logs)
    if (
        any(code != 0 for code, _ in agents)
        and not any(out.iterdir())
        and any(RDZV_CLASH.search(text) for _, text in agents)
    ):
        agents = two_nodes(script, logs)  # someone took the port between free_port() and torchrun
    for node, (code, text) in enumerate(agents):
        assert code == 0, f"torchrun --node-rank {node} exited with {code}:\n{text[-4000:]}"
    ranks = {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)}
    for r, saved in ranks.items():
        assert not alive(saved["result"]["pid"]), f"rank {r}'s process is still running"

    # 4 ranks on 2 nodes: each agent's two ranks are local ranks 0 and 1 of one node
    results = [ranks[r]["result"] for r in range(WORLD)]
    assert [(res["rank"], res["world_size"], ranks[r]["world_size"]) for r, res in enumerate(results)] == [
        (r, WORLD, WORLD) for r in range(WORLD)
    ]
    nodes: dict[str, list[tuple[str, str]]] = {}
    for res in results:
        env = res["env"]
        assert env["LOCAL_WORLD_SIZE"] == str(WORLD // NODES) and env["RANK"] == str(res["rank"]), env
        nodes.setdefault(env["NODE_LABEL"], []).append((env["GROUP_RANK"], env["LOCAL_RANK"]))
    assert sorted(nodes) == ["agent0", "agent1"], nodes
    group_ranks = set()
    for label, seen in nodes.items():
        assert sorted(local for _, local in seen) == ["0", "1"], (label, seen)
        assert len({group for group, _ in seen}) == 1, (label, seen)  # one node rank per agent
        group_ranks.add(seen[0][0])
    assert group_ranks == {"0", "1"}, nodes
    # under torchrun launch returns every rank's result on every rank, as in the notebook
    for r in range(WORLD):
        for k in range(WORLD):
            torch.testing.assert_close(ranks[r]["results"][k]["params"], results[k]["params"], rtol=0, atol=0)

    # the notebook's way: the same function on 4 forked ranks
    try:
        run = dl.launch(
            train_bucketed, WORLD, *(lab[n] for n in NAMES), SIZES, BATCH, STEPS, BUCKET_MB, trace=True, timeout=90
        )
    finally:
        dl.shutdown()
    forked = run.results
    assert all(res["buckets"] == 3 for res in results + forked), [res["buckets"] for res in results + forked]

    # same parameters on every rank, and the same as the notebook launch's
    for r in range(WORLD):
        torch.testing.assert_close(results[r]["params"], results[0]["params"], rtol=0, atol=0)
        torch.testing.assert_close(forked[r]["params"], forked[0]["params"], rtol=0, atol=0)
        torch.testing.assert_close(results[r]["params"], forked[r]["params"], rtol=1e-6, atol=1e-7)
    # and right: one process training on the whole batch of each step
    from disttrain_lab.models import MLP, regression_data

    model, data = MLP(list(SIZES), seed=0), regression_data(BATCH * STEPS, SIZES[0], SIZES[-1], seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        rows = slice(step * BATCH, (step + 1) * BATCH)
        torch.nn.functional.mse_loss(model(data.x[rows]), data.y[rows]).backward()
        optimizer.step()
    single = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert not torch.equal(single, torch.cat([p.detach().reshape(-1) for p in MLP(list(SIZES), seed=0).parameters()]))
    torch.testing.assert_close(results[0]["params"], single, rtol=1e-5, atol=1e-6)

    # the trace: the same calls and bytes on every rank in both runs: one broadcast per parameter,
    # one all-reduce per bucket per step, of the gradients' bytes
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    notebook_facts = trace_facts(run)
    for r in range(WORLD):
        facts = ranks[r]["trace"]
        assert facts == notebook_facts, (r, facts, notebook_facts)
        mine = facts[r]
        assert mine["calls"] == {"broadcast": len(list(model.parameters())), "all_reduce": 3 * STEPS}, mine
        assert sum(mine["all_reduce_bytes"]) == STEPS * grad_bytes and sum(mine["broadcast_bytes"]) == grad_bytes, mine

    # profiled under torchrun as in a notebook (dl.profiled): the clock pings stayed out of the kit's trace
    # (checked above), and the four ranks' torch.profiler traces merge into one of four processes, each
    # holding the kit's calls the trace counted, its clock offset to rank 0 measured across the two agents
    merged = json.loads(dl.merge_traces(tmp_path / "profile").read_text())
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert names == {r: f"rank {r}" for r in range(WORLD)}, names
    for r in range(WORLD):
        calls = [e["name"] for e in merged["traceEvents"] if e.get("ph") == "X" and e["pid"] == r]
        assert calls.count("dl:all_reduce") == 3 * STEPS and calls.count("dl:broadcast") == len(
            list(model.parameters())
        ), r
    info = merged["disttrain_lab"]
    assert [d["rank"] for d in info["distributedInfo"]] == list(range(WORLD))
    for offset, error in zip(info["clock_offset_ns"], info["clock_error_ns"]):
        assert abs(offset) <= error + 200_000, info  # one machine, one clock: within the measurement's error
