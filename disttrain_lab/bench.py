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


def slowest_median(per_rank: list[list[float]]) -> float:
    """Median over repeats of the slowest rank's seconds: a step of several ranks ends
    when its last rank does.  ``per_rank[r][i]`` is rank r's time in repeat i."""
    return statistics.median(max(times) for times in zip(*per_rank))


def _trivial():
    import torch.distributed as dist
    return dist.get_rank() * 10


def _spawn_target(rank: int, world_size: int, port: int) -> None:
    # what torch.multiprocessing.spawn users write: join a group, work, leave
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    _trivial()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_spawn(world_size: int) -> float:
    import torch.multiprocessing as mp
    start = time.perf_counter()
    mp.spawn(_spawn_target, args=(world_size, _free_port()), nprocs=world_size, join=True)
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
        median = slowest_median([rank[(name, nbytes)] for rank in per_rank])
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
                exec(compile(cell.source, f"{path}:{meta.get('grade_id', 'cell')}", "exec",
                                 dont_inherit=True), namespace)  # not this module's __future__ imports
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
    a name to ``wrap(model)``, which returns a DDP-like module (``ddp(x)`` runs the model) whose
    ``finish_gradient_synchronization()`` runs after ``loss.backward()`` and before
    ``optimizer.step()``.  torch DDP (``bucket_cap_mb=bucket_mb``) runs beside them as the reference.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from .launcher import device
    from .models import MLP, regression_data
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = regression_data(batch * world_size, sizes[0], sizes[-1], seed=1)
    x, y = data.x.tensor_split(world_size)[rank].to(device()), data.y.tensor_split(world_size)[rank].to(device())
    runners = {}
    for name, wrap in {**versions, TORCH_DDP: None}.items():
        model = MLP(list(sizes), seed=0).to(device())
        if wrap is None:
            forward, finish = DistributedDataParallel(model, bucket_cap_mb=bucket_mb), (lambda: None)
        else:
            ddp = wrap(model)
            forward, finish = ddp, ddp.finish_gradient_synchronization
        runners[name] = (forward, finish, torch.optim.SGD(model.parameters(), lr=1e-3))

    def train(forward, finish, optimizer):
        def run():
            for _ in range(steps):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(forward(x), y).backward()
                finish()
                optimizer.step()
        return run

    return take_turns({name: train(*parts) for name, parts in runners.items()}, repeats, warmup)


def bench_ddp(versions: dict, world_size: int = 2, sizes=DDP_MODEL, batch: int = 32, steps: int = 3,
              repeats: int = 7, warmup: int = 2, bucket_mb: float = 25.0, timeout: float = 600.0,
              device: str = "cpu") -> list[dict]:
    """Training steps per second of each data-parallel version in ``versions`` (name ->
    ``wrap(model)``, see :func:`_ddp_step_times`) and of torch's DistributedDataParallel,
    side by side in one launch: same model (``MLP(sizes)``), same data (``batch`` samples per
    rank), one CPU thread per rank (``device="cuda"``: one GPU per rank).  The versions take turns (order rotated each repeat);
    a sample is ``steps`` steps on the slowest rank; a row reports the median of ``repeats``
    samples after ``warmup`` ones, and ``ratio`` = steps/s ÷ torch DDP's.

        >>> rows = bench_ddp({"bucketed": BucketedDDP}, world_size=2)
        >>> print(format_ddp_table(rows))
    """
    from .launcher import launch
    if world_size < 2:
        raise ValueError(f"a data-parallel benchmark needs world_size >= 2, got {world_size}")
    per_rank = launch(_ddp_step_times, world_size, versions, tuple(sizes), batch, steps, repeats, warmup,
                      bucket_mb, timeout=timeout, device=device)
    rows = []
    for name in [*versions, TORCH_DDP]:
        rows.append({"version": name, "world_size": world_size,
                     "steps_per_s": steps / slowest_median([rank[name] for rank in per_rank]),
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


def _lab_zero(stage: int, cls, model, lr: float):
    """A lab's ZeRO class as its users build it: stages 1-2 wrap an optimizer like ZeroRedundancyOptimizer,
    ``cls(model.parameters(), torch.optim.Adam, lr=lr)``; stage 3 wraps the model like ``fully_shard``,
    with Adam on the wrapper's parameters (the shards).  Returns (forward, optimizer)."""
    import torch
    if stage == 3:
        wrapped = cls(model)
        return wrapped, torch.optim.Adam(wrapped.parameters(), lr=lr)
    return model, cls(model.parameters(), torch.optim.Adam, lr=lr)


def _zero_step_times(versions: dict, sizes, batch: int, steps: int, repeats: int, warmup: int, lr: float) -> dict:
    """In each rank: seconds per ``steps`` Adam steps of every version, interleaved, and the
    bytes each holds after the last backward (``memory.held``; gradients present)."""
    import torch
    import torch.distributed as dist
    from . import memory
    from .launcher import device
    from .models import MLP, regression_data
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = regression_data(batch * world_size, sizes[0], sizes[-1], seed=1)
    x, y = data.x.tensor_split(world_size)[rank].to(device()), data.y.tensor_split(world_size)[rank].to(device())
    runners = {}
    for name, make in versions.items():
        model = MLP(list(sizes), seed=0).to(device())
        forward, optimizer = make(model, lr)
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
               repeats: int = 5, warmup: int = 1, lr: float = 1e-3, predict=None, timeout: float = 600.0,
               device: str = "cpu") -> list[dict]:
    """Adam training steps per second and bytes held per rank of each ZeRO version, side by
    side with torch's ZeroRedundancyOptimizer (under DDP) and FSDP (``fully_shard``), in one launch.

    ``versions`` maps a name to ``(stage, cls)``: the lab's ``Zero1Optimizer`` / ``Zero2Optimizer``
    (built as ``cls(model.parameters(), torch.optim.Adam, lr=lr)``, like ZeroRedundancyOptimizer) or
    ``Zero3Module`` (built as ``cls(model)``, like ``fully_shard``, with Adam on its shards).  Same model, same data (``batch`` samples per rank), versions taking
    turns; a sample is ``steps`` steps on the slowest rank, a row the median of ``repeats``.
    ``ratio`` compares steps/s with torch's version of the same stage (stages 1-2:
    ZeroRedundancyOptimizer, stage 3: FSDP).  ``held`` is the largest rank's
    ``memory.held(...)`` after the last backward.  ``predict``, if given, is the lab's
    calculator ``predict(num_parameters, stage, world_size, param_bytes=4, grad_bytes=4,
    optimizer_bytes=8) -> {"total": ...}`` (fp32 Adam): rows then carry ``predicted``.

        >>> rows = bench_zero({"ZeRO-1": (1, Zero1Optimizer), "ZeRO-3": (3, Zero3Module)}, predict=zero_memory_per_rank)
        >>> print(format_zero_table(rows))
    """
    from .launcher import launch
    if world_size < 2:
        raise ValueError(f"a ZeRO benchmark needs world_size >= 2, got {world_size}")
    stages = {name: stage for name, (stage, _) in versions.items()}
    stages.update({TORCH_ZERO_REDUNDANCY: 1, TORCH_FSDP: 3})
    import functools
    makers = {name: functools.partial(_lab_zero, stage, cls) for name, (stage, cls) in versions.items()}
    makers.update({TORCH_ZERO_REDUNDANCY: _torch_zero_redundancy, TORCH_FSDP: _torch_fsdp})
    per_rank = launch(_zero_step_times, world_size, makers, tuple(sizes), batch, steps, repeats, warmup, lr,
                      timeout=timeout, device=device)
    parameters = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
    rows = []
    for name in makers:
        worst = max((rank["held"][name] for rank in per_rank), key=lambda h: h["total"])
        row = {"version": name, "stage": stages[name], "world_size": world_size, "parameters": parameters,
               "steps_per_s": steps / slowest_median([rank["seconds"][name] for rank in per_rank]),
               "repeats": repeats, "held": worst}
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


# --------------------------------------------------------------------------------------
# Pipeline parallelism: training steps per second of naive, GPipe and 1F1B against
# torch.distributed.pipelining's ScheduleGPipe, on a simulated accelerator
# --------------------------------------------------------------------------------------
TORCH_PIPELINE = "torch ScheduleGPipe"
PIPELINE_MODEL = (64,) * 9        # 8 Linear layers of 64 × 64: two per stage on 4 ranks
PIPELINE_COST = 0.5e-3            # simulated accelerator: seconds per sample for one stage's forward (backward: 2×)


def _simulated_module(module, cost: float):
    """``module`` on the lab's simulated accelerator: its forward sleeps ``cost`` s per sample,
    its backward twice that, so a stage's time is fixed and needs no CPU core (2 cores, 4 ranks)."""
    import torch

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.rows = len(x)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            time.sleep(2 * cost * ctx.rows)
            return grad

    class Simulated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, x):
            time.sleep(cost * len(x))
            return Sleep.apply(self.inner(x))

    return Simulated()


def _torch_gpipe_runner(module, micro_batches: int, cost: float, x, y):
    """One ScheduleGPipe training step of this rank's stage (``module``), as a callable."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    rank, p = dist.get_rank(), dist.get_world_size()
    stage = PipelineStage(_simulated_module(module, cost), rank, p, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=micro_batches, loss_fn=torch.nn.functional.mse_loss)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == p - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        optimizer.step()
    return step


def _pipeline_step_times(versions: dict, split_stages, make_stage, sizes, batch: int, repeats: int, warmup: int,
                         cost: float, torch_micro_batches) -> tuple[dict, dict]:
    """In each rank: seconds per training step of every version, taking turns (order rotated).

    ``versions`` maps a name to ``(step, m)``: ``step(stage, x, y)`` runs one pipeline step on
    ``make_stage(module, rank, p, cost)``, this rank's part of ``split_stages(MLP(sizes), p)``.
    ScheduleGPipe at each of ``torch_micro_batches`` runs beside them on the same split.
    Returns (seconds per name, errors per name).
    """
    import torch
    import torch.distributed as dist
    from .models import MLP, regression_data
    rank, p = dist.get_rank(), dist.get_world_size()
    x, y = regression_data(batch, sizes[0], sizes[-1], seed=1)
    runners, errors = {}, {}
    for name, (step_fn, _) in versions.items():
        stage = make_stage(split_stages(MLP(list(sizes), seed=0), p)[rank], rank, p, cost)
        optimizer = torch.optim.SGD(stage.module.parameters(), lr=1e-3)

        def run(stage=stage, optimizer=optimizer, step_fn=step_fn):
            optimizer.zero_grad()
            step_fn(stage, x, y)
            optimizer.step()
        runners[name] = run
    for m in torch_micro_batches:
        name = f"{TORCH_PIPELINE} m={m}"
        try:
            runners[name] = _torch_gpipe_runner(split_stages(MLP(list(sizes), seed=0), p)[rank], m, cost, x, y)
        except Exception as exc:          # e.g. a torch without pipelining: say so in the table
            errors[name] = f"{type(exc).__name__}: {exc}"
    return take_turns(runners, repeats, warmup), errors


def take_turns(runners: dict, repeats: int, warmup: int) -> dict:
    """In each rank: seconds of each ``runners[name]()`` call, the names taking turns (the order
    rotated every round, so none always goes first), a barrier before each; ``warmup`` rounds
    are left out.  Returns name -> list of ``repeats`` seconds.  Call it on all ranks."""
    import torch.distributed as dist
    names, seconds = list(runners), {}
    for i in range(warmup + repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            runners[name]()
            if i >= warmup:
                seconds.setdefault(name, []).append(time.perf_counter() - start)
    return seconds


def bench_pipeline(versions: dict, split_stages, make_stage, world_size: int = 4, sizes=PIPELINE_MODEL,
                   batch: int = 64, cost: float = PIPELINE_COST, repeats: int = 5, warmup: int = 1,
                   torch_micro_batches=(1, 2, 4, 8), timeout: float = 600.0) -> list[dict]:
    """Training steps per second of each pipeline version and of torch's ScheduleGPipe, side by
    side in one launch on ``world_size`` stages of ``MLP(sizes)``, ``batch`` samples per step.

    ``versions`` maps a name to ``(step, m)`` (see :func:`_pipeline_step_times`); ``split_stages``
    and ``make_stage`` come from the lab notebook.  Every stage runs on the simulated accelerator:
    ``cost`` s per sample forward, twice that backward, so the schedule, not the 2 CPU cores,
    decides the time.  A row: the median over ``repeats`` of the slowest rank, ``speedup`` over
    the first version (naive), and ``ideal`` = p·m/(m + p − 1), the speedup without communication.

        >>> rows = bench_pipeline({"naive": (naive_step, 1), "GPipe m=4": (gpipe_m4, 4)}, split_stages, Stage)
        >>> print(format_pipeline_table(rows))
    """
    from .launcher import launch
    if world_size < 2:
        raise ValueError(f"a pipeline needs world_size >= 2 stages, got {world_size}")
    per_rank = launch(_pipeline_step_times, world_size, versions, split_stages, make_stage, tuple(sizes), batch,
                      repeats, warmup, cost, tuple(torch_micro_batches), timeout=timeout)
    errors = {name: why for _, errs in per_rank for name, why in errs.items()}
    micro = {**{name: m for name, (_, m) in versions.items()},
             **{f"{TORCH_PIPELINE} m={m}": m for m in torch_micro_batches}}
    rows = []
    for name, m in micro.items():
        row = {"version": name, "micro_batches": m, "world_size": world_size, "batch": batch, "repeats": repeats,
               "cost": cost, "ideal": world_size * m / (m + world_size - 1)}
        if name in errors:
            row["error"] = errors[name]
        else:
            row["steps_per_s"] = 1 / slowest_median([seconds[name] for seconds, _ in per_rank])
        rows.append(row)
    base = next((r["steps_per_s"] for r in rows if "steps_per_s" in r), 1.0)
    for row in rows:
        if "steps_per_s" in row:
            row["speedup"] = row["steps_per_s"] / base
    return rows


def format_pipeline_table(rows: list[dict]) -> str:
    """Steps/s, samples/s, speedup over the first row (naive) and the ideal p·m/(m + p − 1)."""
    first = rows[0]
    width = max(16, *(len(r["version"]) for r in rows)) + 2
    lines = [f"training steps/s, {first['world_size']} stages, batch {first['batch']}, simulated accelerator "
             f"{first['cost'] * 1e3:g} ms/sample forward (2x backward), median of {first['repeats']}",
             f"{'version':<{width}} {'m':>3} {'steps/s':>8} {'samples/s':>10} {'speedup':>8} {'ideal':>6}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['version']:<{width}} {r['micro_batches']:>3} not measured: {r['error']}")
        else:
            lines.append(f"{r['version']:<{width}} {r['micro_batches']:>3} {r['steps_per_s']:>8.2f} "
                         f"{r['steps_per_s'] * r['batch']:>10.0f} {r['speedup']:>7.2f}x {r['ideal']:>5.2f}x")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Tensor parallelism: step time and bytes per step of a Megatron-style MLP, side by side
# with torch.distributed.tensor.parallel (ColwiseParallel / RowwiseParallel on a DeviceMesh)
# --------------------------------------------------------------------------------------
TORCH_TP = "torch Colwise/RowwiseParallel"
TP_MODEL = (1024, 4096, 1024)        # a transformer block's MLP, d -> 4d -> d: 8.4 M parameters
_NOT_COMMUNICATION = ("wait", "wrap")  # c10d ops that move no data (waiting, autograd wrappers)


def _collective_bytes_counter():
    """A dispatch mode adding up the bytes of every c10d collective called under it.

    torch's tensor parallelism calls the functional collectives (``_c10d_functional``), which
    the kit's trace does not see; this counts both kinds the same way, at the dispatcher.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes, self.calls = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional") and not any(
                    word in func.__name__ for word in _NOT_COMMUNICATION):
                tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                self.bytes += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
                self.calls += 1
            return func(*args, **(kwargs or {}))

    return CollectiveBytes()


def _torch_tensor_parallel(dense, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    import torch.distributed as dist
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return parallelize_module(dense, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _tp_step_times(versions: dict, sizes, batch: int, steps: int, repeats: int, warmup: int) -> dict:
    """In each rank: per version, seconds per ``steps`` training steps (interleaved, order
    rotated), collective bytes and calls of one step, or why it could not run.

    ``versions`` maps a name to ``make(dense_mlp)`` returning the tensor-parallel module over all
    ranks; torch's ``parallelize_module`` with ColwiseParallel/RowwiseParallel runs beside them.
    The input requires a gradient, as inside a network, so backward all-reduces it too.
    """
    import torch
    import torch.distributed as dist
    from .launcher import device as rank_device
    from .models import MLP, regression_data
    device = rank_device()
    data = regression_data(batch, sizes[0], sizes[-1], seed=1)
    x, y = data.x.to(device), data.y.to(device)
    runners, unavailable = {}, {}
    for name, make in {**versions, TORCH_TP: None}.items():
        dense = MLP(list(sizes), seed=0).to(device)
        if make is not None:
            model = make(dense)           # an error in the lab's class surfaces as it is
        else:
            try:
                model = _torch_tensor_parallel(dense, device)
            except Exception as exc:      # torch's version may not run on this backend: say why, measure ours
                unavailable[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
                continue
        runners[name] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))

    def step(model, optimizer):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x.clone().requires_grad_()), y).backward()
        optimizer.step()

    communicated = {}
    for name, (model, optimizer) in runners.items():
        counter = _collective_bytes_counter()
        with counter:
            step(model, optimizer)
        communicated[name] = (counter.bytes, counter.calls)
    names, seconds = list(runners), {}
    for i in range(warmup + repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step(*runners[name])
            if i >= warmup:
                seconds.setdefault(name, []).append(time.perf_counter() - start)
    return {"seconds": seconds, "communicated": communicated, "unavailable": unavailable}


def bench_tp(versions: dict, world_sizes=(1, 2, 4), sizes=TP_MODEL, batch: int = 64, steps: int = 2,
             repeats: int = 5, warmup: int = 1, timeout: float = 600.0) -> list[dict]:
    """Training step time and bytes communicated per step of each tensor-parallel MLP in
    ``versions`` (name -> ``make(dense)``, see :func:`_tp_step_times`) and of torch's
    ``parallelize_module(ColwiseParallel, RowwiseParallel)``, side by side in one launch per
    world size: same ``MLP(sizes)``, same batch.  A sample is ``steps`` steps on the slowest
    rank; rows report the median of ``repeats`` samples after ``warmup``, rank 0's collective
    bytes per step, and ``ratio`` = torch's step time ÷ this one's (above 1: faster than torch).

        >>> print(format_tp_table(bench_tp({"TensorParallelMLP": TensorParallelMLP})))
    """
    from .launcher import launch
    for n in world_sizes:
        if sizes[1] % n:
            raise ValueError(f"the hidden width {sizes[1]} must be divisible by every world size; {n} is not a divisor")
    rows = []
    for n in world_sizes:
        per_rank = launch(_tp_step_times, n, versions, tuple(sizes), batch, steps, repeats, warmup, timeout=timeout)
        first = per_rank[0]
        for name in [*versions, TORCH_TP]:
            row = {"version": name, "world_size": n, "batch": batch, "sizes": tuple(sizes), "repeats": repeats}
            if name in first["unavailable"]:
                row["error"] = first["unavailable"][name]
            else:
                row["ms_per_step"] = 1e3 * slowest_median([rank["seconds"][name] for rank in per_rank]) / steps
                row["bytes_per_step"], row["calls_per_step"] = first["communicated"][name]
            rows.append(row)
        reference = next((r for r in rows[-len(versions) - 1:] if r["version"] == TORCH_TP and "error" not in r), None)
        for row in rows[-len(versions) - 1:]:
            if reference is not None and "error" not in row:
                row["ratio"] = reference["ms_per_step"] / row["ms_per_step"]
    return rows


def format_tp_table(rows: list[dict]) -> str:
    """One line per (world size, version): ms per step, collective bytes and calls per step, vs torch."""
    from .trace import format_bytes
    first = rows[0]
    sizes = first["sizes"]
    parameters = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
    width = max(20, *(len(r["version"]) for r in rows)) + 2
    lines = [f"training step of an MLP {' -> '.join(map(str, sizes))} ({parameters / 1e6:.1f} M parameters), "
             f"batch {first['batch']}, median of {first['repeats']}; bytes and calls: rank 0's collectives per step",
             f"{'N':>2} {'version':<{width}} {'ms/step':>8} {'bytes/step':>11} {'calls':>5} {'vs torch':>9}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['world_size']:>2} {r['version']:<{width}} not measured: {r['error']}")
        else:
            ratio = f"{r['ratio']:>8.2f}x" if "ratio" in r else f"{'-':>9}"
            lines.append(f"{r['world_size']:>2} {r['version']:<{width}} {r['ms_per_step']:>8.1f} "
                         f"{format_bytes(r['bytes_per_step']):>11} {r['calls_per_step']:>5} {ratio}")
    return "\n".join(lines)


if __name__ == "__main__" and "--torchrun-child" in sys.argv:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    _trivial()
    dist.destroy_process_group()
