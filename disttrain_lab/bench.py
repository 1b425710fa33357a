"""Measurements, always side by side in one run and reported as medians.

``disttrain-lab bench launch`` times what a student waits for when a cell runs ranks:
this launcher cold (a fresh pool) and warm, ``torch.multiprocessing.spawn`` and
``torchrun --standalone``, each running the same trivial function (join a gloo process
group, return ``rank * 10``).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta


def _trivial():
    import torch.distributed as dist
    return dist.get_rank() * 10


def _spawn_target(rank: int, world_size: int, port: int) -> None:
    # what torch.multiprocessing.spawn users write: join a group, work, leave
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    _trivial()
    dist.destroy_process_group()


def time_spawn(world_size: int) -> float:
    import torch.distributed as dist
    import torch.multiprocessing as mp
    start = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    mp.spawn(_spawn_target, args=(world_size, store.port), nprocs=world_size, join=True)
    return time.perf_counter() - start


def time_torchrun(world_size: int) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={world_size}", "-m", "disttrain_lab.bench", "--torchrun-child"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - start


def time_launch(world_size: int, warm: bool) -> float:
    from .launcher import launch, shutdown
    if not warm:
        shutdown()
    start = time.perf_counter()
    out = launch(_trivial, world_size)
    elapsed = time.perf_counter() - start
    assert out == [10 * r for r in range(world_size)], out
    return elapsed


def bench_launch(world_sizes=(2, 4), repeats: int = 5, slow_repeats: int = 3) -> list[dict]:
    """Median seconds per call of each way to start ranks; one row per (method, world size)."""
    from .launcher import launch, shutdown
    rows = []
    for n in world_sizes:
        launch(_trivial, n)  # warm the pool once
        warm = [time_launch(n, warm=True) for _ in range(max(repeats, 20))]
        cold = [time_launch(n, warm=False) for _ in range(repeats)]
        shutdown()
        spawn = [time_spawn(n) for _ in range(slow_repeats)]
        torchrun = [time_torchrun(n) for _ in range(slow_repeats)]
        for name, xs in (("dl.launch warm", warm), ("dl.launch cold", cold),
                         ("mp.spawn", spawn), ("torchrun --standalone", torchrun)):
            rows.append({"method": name, "world_size": n, "median_s": statistics.median(xs),
                         "mean_s": statistics.fmean(xs), "repeats": len(xs)})
    return rows


def format_launch_table(rows: list[dict]) -> str:
    lines = [f"{'method':<22} {'ranks':>5} {'median':>10} {'mean':>10} {'n':>3}  vs warm launch"]
    for row in rows:
        warm = next(r["median_s"] for r in rows if r["method"] == "dl.launch warm" and r["world_size"] == row["world_size"])
        lines.append(f"{row['method']:<22} {row['world_size']:>5} {row['median_s'] * 1e3:>8.1f}ms "
                     f"{row['mean_s'] * 1e3:>8.1f}ms {row['repeats']:>3}  {row['median_s'] / warm:>8.1f}x")
    return "\n".join(lines)


def _pingpong_modes(trips: int, nbytes: int) -> dict:
    """Seconds per round trip on rank 0 for: torch's own functions, the launcher's
    status-only wrappers (always on in a launched rank), and full tracing."""
    import torch
    import torch.distributed as dist
    from . import trace
    rank = dist.get_rank()
    t = torch.zeros(max(1, nbytes // 4))
    genuine = (trace._ORIGINALS["send"], trace._ORIGINALS["recv"])
    wrapped = (dist.send, dist.recv)
    out = {}
    for mode, (send, recv), record in (("torch", genuine, False), ("status only", wrapped, False),
                                       ("traced", wrapped, True), ("torch again", genuine, False)):
        trace._REC.recording = record
        dist.barrier()
        start = time.perf_counter()
        for _ in range(trips):
            if rank == 0:
                send(t, 1)
                recv(t, 1)
            else:
                recv(t, 0)
                send(t, 0)
        out[mode] = (time.perf_counter() - start) / trips
        trace._REC.events.clear()
    trace._REC.recording = False
    return out


def bench_trace(trips: int = 2000, sizes=(4, 1 << 20), repeats: int = 5) -> list[dict]:
    """Tracing overhead per ping-pong round trip, medians of ``repeats`` runs."""
    from .launcher import launch
    rows = []
    for nbytes in sizes:
        runs = [launch(_pingpong_modes, 2, trips if nbytes < 1024 else trips // 20, nbytes)[0]
                for _ in range(repeats)]
        base = statistics.median([min(r["torch"], r["torch again"]) for r in runs])
        for mode in ("torch", "status only", "traced"):
            med = statistics.median([min(r["torch"], r["torch again"]) if mode == "torch" else r[mode] for r in runs])
            rows.append({"bytes": nbytes, "mode": mode, "us_per_trip": med * 1e6, "ratio": med / base})
    return rows


def format_trace_table(rows: list[dict]) -> str:
    lines = [f"{'message':>9} {'mode':<12} {'us/round trip':>14} {'vs torch':>9}"]
    for row in rows:
        from .trace import format_bytes
        lines.append(f"{format_bytes(row['bytes']):>9} {row['mode']:<12} {row['us_per_trip']:>14.1f} {row['ratio']:>8.2f}x")
    return "\n".join(lines)


if __name__ == "__main__" and "--torchrun-child" in sys.argv:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    _trivial()
    dist.destroy_process_group()
