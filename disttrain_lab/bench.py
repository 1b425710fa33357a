"""Measurements, always side by side in one run and reported as medians.

``disttrain-lab bench launch`` times what a student waits for when a cell runs ranks:
this launcher cold (a fresh pool) and warm, ``torch.multiprocessing.spawn`` and
``torchrun --standalone``, each running the same trivial function (join a gloo process
group, return ``rank * 10``).

``disttrain-lab bench allreduce`` measures all-reduce implementations the way nccl-tests
does (algbw and busbw against message size), side by side with ``dist.all_reduce``.  The
implementations come from a lab notebook (this package holds no solutions): see
:func:`functions_from_notebook` and :func:`bench_allreduce`.
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



# --------------------------------------------------------------------------------------
# All-reduce: algbw and busbw against message size (the nccl-tests definitions)
# --------------------------------------------------------------------------------------
TORCH_ALL_REDUCE = "dist.all_reduce"
ALLREDUCE_SIZES = tuple(4 << (2 * k) << 10 for k in range(8))   # 4 KiB, 16 KiB, ..., 64 MiB


def busbw_factor(world_size: int) -> float:
    """busbw / algbw for all-reduce: 2(N-1)/N, the share of S that crosses each rank's link
    in an optimal algorithm, so busbw can be compared with the link's bandwidth at any N."""
    return 2 * (world_size - 1) / world_size


def _torch_all_reduce(x):
    import torch.distributed as dist
    dist.all_reduce(x)
    return x


def _probe_allreduce(fn, numel: int):
    """One call of ``fn`` on a small uneven tensor, compared with dist.all_reduce on the same ranks."""
    import torch
    import torch.distributed as dist
    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=torch.float64)
    expected = x.clone()
    dist.all_reduce(expected)
    fn(x)                                          # in place, like dist.all_reduce
    return float((x - expected).abs().max())


def _time_allreduce(algorithms: dict, sizes, repeats: int, warmup: int, dtype_name: str) -> dict:
    """In each rank: seconds per call of every algorithm at every size, interleaved."""
    import torch
    import torch.distributed as dist
    dtype = getattr(torch, dtype_name)
    names = list(algorithms)
    seconds: dict = {}
    for nbytes in sizes:
        numel = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
        source = torch.ones(numel, dtype=dtype)
        x = torch.empty(numel, dtype=dtype)        # preallocated: time the algorithm, not malloc
        for i in range(warmup + repeats):
            shift = i % len(names)                 # rotate the order so no algorithm always goes first
            for name in names[shift:] + names[:shift]:
                x.copy_(source)                    # an in-place all-reduce overwrote it
                dist.barrier()
                start = time.perf_counter()
                algorithms[name](x)
                elapsed = time.perf_counter() - start
                if i >= warmup:
                    seconds.setdefault((name, nbytes), []).append(elapsed)
    return seconds


def bench_allreduce(algorithms: dict, world_size: int = 4, sizes=ALLREDUCE_SIZES, repeats: int = 5,
                    warmup: int = 1, dtype: str = "float32", timeout: float = 600.0) -> list[dict]:
    """busbw of each all-reduce in ``algorithms`` (name -> fn(x), in place, SUM) and of
    ``dist.all_reduce``, side by side in one launch on ``world_size`` ranks.

    For every size, the algorithms take turns (order rotated each repeat); each call's time
    is the slowest rank's, and a row reports the median over ``repeats``:
    algbw = S / t and busbw = algbw * 2(N-1)/N (nccl-tests' definitions).  Each algorithm is
    first checked once against dist.all_reduce; one that raises or is wrong gets a row with
    ``error`` instead of being timed.

        >>> rows = bench_allreduce({"ring": ring_all_reduce}, world_size=4, sizes=[1 << 20])
        >>> print(format_allreduce_table(rows))
    """
    from .launcher import LaunchError, launch
    if world_size < 2:
        raise ValueError(f"an all-reduce benchmark needs world_size >= 2, got {world_size}")
    rows, working = [], {}
    for name, fn in algorithms.items():
        try:
            errors = launch(_probe_allreduce, world_size, fn, 1000 + world_size - 1, timeout=60)
            problem = None if max(errors) < 1e-9 else f"wrong result (max abs error {max(errors):.3g})"
        except LaunchError as exc:
            problem = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if problem:
            rows.append({"algorithm": name, "world_size": world_size, "error": problem})
        else:
            working[name] = fn
    working[TORCH_ALL_REDUCE] = _torch_all_reduce
    per_rank = launch(_time_allreduce, world_size, working, list(sizes), repeats, warmup, dtype,
                      timeout=timeout)
    for name, nbytes in sorted(per_rank[0], key=lambda key: (key[1], list(working).index(key[0]))):
        slowest = [max(rank[(name, nbytes)][i] for rank in per_rank) for i in range(repeats)]
        median = statistics.median(slowest)
        rows.append({"algorithm": name, "world_size": world_size, "bytes": nbytes, "median_s": median,
                     "algbw": nbytes / median, "busbw": nbytes / median * busbw_factor(world_size),
                     "repeats": repeats})
    return rows


def format_allreduce_table(rows: list[dict]) -> str:
    """busbw (GB/s) per message size, one column per algorithm, each / dist.all_reduce's."""
    from .trace import format_bytes
    timed = [r for r in rows if "error" not in r]
    names = list(dict.fromkeys(r["algorithm"] for r in timed))
    if not timed:
        return "\n".join(f"{r['algorithm']}: not measured: {r['error']}" for r in rows)
    by = {(r["algorithm"], r["bytes"]): r for r in timed}
    world_size = timed[0]["world_size"]
    width = max(12, *(len(n) for n in names)) + 2
    lines = [f"busbw in GB/s on {world_size} ranks, median of {timed[0]['repeats']} "
             f"(in brackets: / {TORCH_ALL_REDUCE})",
             f"{'size':>9}" + "".join(f"{n:>{width + 8}}" for n in names)]
    for nbytes in sorted({r["bytes"] for r in timed}):
        torch_row = by.get((TORCH_ALL_REDUCE, nbytes))
        cells = []
        for n in names:
            row = by.get((n, nbytes))
            ratio = f"({row['busbw'] / torch_row['busbw']:.2f}x)" if row and torch_row else ""
            cells.append(f"{row['busbw'] / 1e9:>{width}.3f} {ratio:>7}" if row else f"{'-':>{width + 8}}")
        lines.append(f"{format_bytes(nbytes):>9}" + "".join(cells))
    lines += [f"{r['algorithm']}: not measured: {r['error']}" for r in rows if "error" in r]
    return "\n".join(lines)


def functions_from_notebook(path, names) -> dict:
    """The functions ``names`` as a lab notebook defines them: runs its setup cell and every
    code cell made only of imports, ``def``s, ``class``es and constant assignments (solution
    cells, given helpers), never test cells (graded or read-only), benchmarks or plots.  Names the notebook does
    not define are left out of the result."""
    import ast
    import contextlib
    import io
    import nbformat
    nb = nbformat.read(str(path), as_version=4)
    namespace = {"__name__": "__lab_notebook__"}   # not importable: cloudpickle sends the functions by value

    def definitions_only(source: str) -> bool:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return False
        allowed = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)
        return bool(tree.body) and all(
            isinstance(node, allowed) or (isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
                                          and isinstance(node.value, (ast.Constant, ast.Dict, ast.Tuple, ast.List)))
            for node in tree.body)

    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        setup = meta.get("grade_id") == "setup"
        if cell.cell_type != "code" or meta.get("grade") or (meta.get("locked") and not setup):
            continue                                   # graded tests and read-only test helpers
        if setup or definitions_only(cell.source):
            with contextlib.redirect_stdout(io.StringIO()):   # the setup cell's doctor line
                exec(compile(cell.source, f"{path}:{meta.get('grade_id', 'cell')}", "exec"), namespace)
    return {name: namespace[name] for name in names if callable(namespace.get(name))}

# --------------------------------------------------------------------------------------
# Data parallelism: training steps per second, side by side with torch's DDP
# --------------------------------------------------------------------------------------
TORCH_DDP = "torch DDP"
DDP_MODEL = (1024, 2048, 2048, 1024)       # an MLP of 8.4 M parameters: 32 MiB of gradients per step


def _ddp_step_times(versions: dict, sizes, batch: int, steps: int, repeats: int, warmup: int,
                    bucket_mb: float) -> dict:
    """In each rank: seconds per ``steps`` training steps of every version, interleaved.

    Each version trains its own copy of the same model on the same data; ``versions`` maps
    a name to ``wrap(model)``, which returns an object whose ``finish()`` runs after
    ``loss.backward()`` and before ``optimizer.step()``.  torch DDP (``bucket_cap_mb=bucket_mb``)
    runs beside them as the reference.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from .models import MLP, regression_data
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = regression_data(batch * world_size, sizes[0], sizes[-1], seed=1)
    x, y = data.x.tensor_split(world_size)[rank], data.y.tensor_split(world_size)[rank]
    runners = {}
    for name, wrap in {**versions, TORCH_DDP: None}.items():
        model = MLP(list(sizes), seed=0)
        if wrap is None:
            forward, finish = DistributedDataParallel(model, bucket_cap_mb=bucket_mb), (lambda: None)
        else:
            forward, finish = model, wrap(model).finish
        runners[name] = (forward, finish, torch.optim.SGD(model.parameters(), lr=1e-3))
    names, seconds = list(runners), {}
    for i in range(warmup + repeats):
        shift = i % len(names)                     # rotate the order so no version always goes first
        for name in names[shift:] + names[:shift]:
            forward, finish, optimizer = runners[name]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(forward(x), y).backward()
                finish()
                optimizer.step()
            if i >= warmup:
                seconds.setdefault(name, []).append(time.perf_counter() - start)
    return seconds


def bench_ddp(versions: dict, world_size: int = 2, sizes=DDP_MODEL, batch: int = 32, steps: int = 3,
              repeats: int = 7, warmup: int = 2, bucket_mb: float = 25.0, timeout: float = 600.0) -> list[dict]:
    """Training steps per second of each data-parallel version in ``versions`` (name ->
    ``wrap(model)``, see :func:`_ddp_step_times`) and of torch's DistributedDataParallel,
    side by side in one launch: same model (``MLP(sizes)``), same data (``batch`` samples per
    rank), one CPU thread per rank.  The versions take turns (order rotated each repeat);
    a sample is ``steps`` steps on the slowest rank; a row reports the median of ``repeats``
    samples after ``warmup`` ones, and ``ratio`` = steps/s ÷ torch DDP's.

        >>> rows = bench_ddp({"bucketed": BucketedDDP}, world_size=2)
        >>> print(format_ddp_table(rows))
    """
    from .launcher import launch
    if world_size < 2:
        raise ValueError(f"a data-parallel benchmark needs world_size >= 2, got {world_size}")
    per_rank = launch(_ddp_step_times, world_size, versions, tuple(sizes), batch, steps, repeats, warmup,
                      bucket_mb, timeout=timeout)
    rows = []
    for name in [*versions, TORCH_DDP]:
        slowest = [max(rank[name][i] for rank in per_rank) for i in range(repeats)]
        rows.append({"version": name, "world_size": world_size, "steps_per_s": steps / statistics.median(slowest),
                     "repeats": repeats, "parameters": sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))})
    reference = next(r["steps_per_s"] for r in rows if r["version"] == TORCH_DDP)
    for row in rows:
        row["ratio"] = row["steps_per_s"] / reference
    return rows


def format_ddp_table(rows: list[dict]) -> str:
    """Steps/s per version and the ratio to torch DDP's."""
    first = rows[0]
    width = max(16, *(len(r["version"]) for r in rows)) + 2
    lines = [f"training steps/s on {first['world_size']} ranks, MLP of {first['parameters'] / 1e6:.1f} M "
             f"parameters, median of {first['repeats']}",
             f"{'version':<{width}} {'steps/s':>8} {'vs ' + TORCH_DDP:>14}"]
    lines += [f"{r['version']:<{width}} {r['steps_per_s']:>8.2f} {r['ratio']:>13.2f}x" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__" and "--torchrun-child" in sys.argv:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    _trivial()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# ZeRO: steps per second and bytes held per rank, side by side with torch's
# ZeroRedundancyOptimizer and FSDP (fully_shard)
# --------------------------------------------------------------------------------------
TORCH_ZERO_REDUNDANCY = "torch DDP + ZeroRedundancyOptimizer"
TORCH_FSDP = "torch FSDP (fully_shard)"
ZERO_MODEL = (1024, 2048, 2048, 1024)      # the DDP bench's MLP: 8.4 M parameters, 134 MB of fp32 Adam training state


def _torch_zero_redundancy(model, lr: float):
    """ZeRO-1 as torch ships it: DDP all-reduces gradients, ZeroRedundancyOptimizer keeps Adam
    state for this rank's parameters only and broadcasts the updated parameters."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    wrapped = DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=lr)
    return wrapped, optimizer


def _torch_fsdp(model, lr: float):
    """ZeRO-3 as torch ships it: FSDP2's fully_shard on every parameterised layer, then the root."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from .memory import layers_with_parameters
    for layer in layers_with_parameters(model).values():
        if layer is not model:
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def _zero_step_times(versions: dict, sizes, batch: int, steps: int, repeats: int, warmup: int, lr: float) -> dict:
    """In each rank: seconds per ``steps`` Adam steps of every version, interleaved, and the
    bytes each holds after the last backward (``memory.held``; gradients present)."""
    import torch
    import torch.distributed as dist
    from . import memory
    from .models import MLP, regression_data
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = regression_data(batch * world_size, sizes[0], sizes[-1], seed=1)
    x, y = data.x.tensor_split(world_size)[rank], data.y.tensor_split(world_size)[rank]
    runners = {}
    for name, make in versions.items():
        model = MLP(list(sizes), seed=0)
        if name in (TORCH_ZERO_REDUNDANCY, TORCH_FSDP):
            forward, optimizer = make(model, lr)
        else:
            forward, optimizer = model, make(model, lr)
        runners[name] = (model, forward, optimizer)
    names, seconds, held = list(runners), {}, {}
    for i in range(warmup + repeats):
        shift = i % len(names)                     # rotate the order so no version always goes first
        for name in names[shift:] + names[:shift]:
            model, forward, optimizer = runners[name]
            dist.barrier()
            start = time.perf_counter()
            for step in range(steps):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(forward(x), y).backward()
                if step == steps - 1 and i == warmup + repeats - 1:
                    pause = time.perf_counter()    # measuring is not training: leave it out of the time
                    held[name] = memory.held(model, optimizer).as_dict()
                    start += time.perf_counter() - pause
                optimizer.step()
            if i >= warmup:
                seconds.setdefault(name, []).append(time.perf_counter() - start)
    return {"seconds": seconds, "held": held}


def bench_zero(versions: dict, world_size: int = 2, sizes=ZERO_MODEL, batch: int = 16, steps: int = 2,
               repeats: int = 5, warmup: int = 1, lr: float = 1e-3, predict=None, timeout: float = 600.0) -> list[dict]:
    """Adam training steps per second and bytes held per rank of each ZeRO version, side by
    side with torch's ZeroRedundancyOptimizer (under DDP) and FSDP (``fully_shard``), in one launch.

    ``versions`` maps a name to ``(stage, make)``, where ``make(model, lr)`` wraps a fresh
    ``MLP(sizes)`` and returns an object with ``zero_grad()`` and ``step()`` (the lab's
    ``Zero1Adam``...).  Same model, same data (``batch`` samples per rank), versions taking
    turns; a sample is ``steps`` steps on the slowest rank, a row the median of ``repeats``.
    ``ratio`` compares steps/s with torch's version of the same stage (stages 1-2:
    ZeroRedundancyOptimizer, stage 3: FSDP).  ``held`` is the largest rank's
    ``memory.held(...)`` after the last backward.  ``predict``, if given, is the lab's
    calculator ``predict(num_parameters, stage, world_size, param_bytes=4, grad_bytes=4,
    optimizer_bytes=8) -> {"total": ...}`` (fp32 Adam): rows then carry ``predicted``.

        >>> rows = bench_zero({"ZeRO-1": (1, Zero1Adam), "ZeRO-3": (3, Zero3Adam)}, predict=zero_memory_per_rank)
        >>> print(format_zero_table(rows))
    """
    from .launcher import launch
    if world_size < 2:
        raise ValueError(f"a ZeRO benchmark needs world_size >= 2, got {world_size}")
    stages = {name: stage for name, (stage, _) in versions.items()}
    stages.update({TORCH_ZERO_REDUNDANCY: 1, TORCH_FSDP: 3})
    makers = {name: make for name, (_, make) in versions.items()}
    makers.update({TORCH_ZERO_REDUNDANCY: _torch_zero_redundancy, TORCH_FSDP: _torch_fsdp})
    per_rank = launch(_zero_step_times, world_size, makers, tuple(sizes), batch, steps, repeats, warmup, lr,
                      timeout=timeout)
    parameters = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
    rows = []
    for name in makers:
        slowest = [max(rank["seconds"][name][i] for rank in per_rank) for i in range(repeats)]
        worst = max((rank["held"][name] for rank in per_rank), key=lambda h: h["total"])
        row = {"version": name, "stage": stages[name], "world_size": world_size, "parameters": parameters,
               "steps_per_s": steps / statistics.median(slowest), "repeats": repeats, "held": worst}
        if predict is not None:
            row["predicted"] = int(predict(parameters, stages[name], world_size, param_bytes=4, grad_bytes=4,
                                           optimizer_bytes=8)["total"])
        rows.append(row)
    by_name = {r["version"]: r for r in rows}
    for row in rows:
        reference = by_name[TORCH_FSDP if row["stage"] == 3 else TORCH_ZERO_REDUNDANCY]
        row["reference"] = reference["version"]
        row["ratio"] = row["steps_per_s"] / reference["steps_per_s"]
    return rows


def format_zero_table(rows: list[dict]) -> str:
    """Steps/s (and / torch's same stage), bytes held per rank (and / the formula, if predicted)."""
    from .trace import format_bytes
    first = rows[0]
    width = max(20, *(len(r["version"]) for r in rows)) + 2
    predicted = all("predicted" in r for r in rows)
    lines = [f"Adam steps/s and bytes held per rank (the largest rank, after backward) on {first['world_size']} "
             f"ranks, MLP of {first['parameters'] / 1e6:.1f} M parameters (fp32), median of {first['repeats']}",
             f"{'version':<{width}} {'stage':>5} {'steps/s':>8} {'vs torch':>9}   {'held':>9} "
             f"{'params':>9} {'grads':>9} {'optim':>9} {'other':>9}" + (f" {'formula':>9} {'held/formula':>12}"
                                                                       if predicted else "")]
    for r in rows:
        h = r["held"]
        line = (f"{r['version']:<{width}} {r['stage']:>5} {r['steps_per_s']:>8.2f} {r['ratio']:>8.2f}x   "
                f"{format_bytes(h['total']):>9} {format_bytes(h['parameters']):>9} {format_bytes(h['gradients']):>9} "
                f"{format_bytes(h['optimizer_state']):>9} {format_bytes(h['other']):>9}")
        if predicted:
            line += f" {format_bytes(r['predicted']):>9} {h['total'] / r['predicted']:>11.3f}x"
        lines.append(line)
    lines.append(f"(vs torch: stages 1-2 against {TORCH_ZERO_REDUNDANCY}, stage 3 against {TORCH_FSDP})")
    return "\n".join(lines)
