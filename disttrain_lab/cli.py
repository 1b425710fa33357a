"""``disttrain-lab doctor | bench | release | grade``."""
from __future__ import annotations

import argparse
import os
import platform
import sys


def _own_process() -> bool:
    return os.path.basename(sys.argv[0]) in ("disttrain-lab", "cli.py") or __name__ == "__main__"


def doctor(short: bool = False) -> str:
    """What this machine offers and what ``dl.launch`` will do here.

    ``short=True`` gives the one line a lab's setup cell prints.
    """
    import torch
    import torch.distributed as dist
    from .launcher import plan
    cores = os.cpu_count() or 1
    cuda_initialized = torch.cuda.is_initialized()
    gpus = torch.cuda.device_count()  # NVML: leaves CUDA uninitialised, so forked ranks may use it
    chosen = plan(world_size=2)   # device="cpu", the default: what every launch uses unless asked
    try:
        on_gpu = plan(world_size=gpus, device="cuda").reason.removeprefix("device='cuda': ") if gpus \
            else "no GPU visible"
    except ValueError as exc:
        on_gpu = str(exc).split(". ")[0]
    if short:
        return (f"disttrain-lab: torch {torch.__version__}, {cores} CPU cores, {gpus} GPU(s); "
                f"ranks use {chosen.backend} ({chosen.start_method})"
                + (f"; device='cuda': NCCL on up to {gpus} ranks" if gpus else ""))
    backends = [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok]
    lines = [
        f"python        {platform.python_version()} ({sys.executable})",
        f"torch         {torch.__version__}",
        f"CPU cores     {cores}",
        # device names need CUDA initialised: only in the CLI (its own process), not in a notebook
        f"GPUs          {gpus}" + ("".join(f"\n              cuda:{i} {torch.cuda.get_device_name(i)}"
                                           for i in range(gpus)) if not short and _own_process() else ""),
        f"backends      {', '.join(backends) or 'none'}",
        f"launcher      {chosen.backend}, {chosen.start_method}: {chosen.reason}",
        f"              device='cuda': {on_gpu}",
        f"CUDA used in this process already: {'yes' if cuda_initialized else 'no'}",
    ]
    if not dist.is_gloo_available():
        verdict = "NOT READY: this torch has no gloo backend, which every lab needs on CPU."
    else:
        verdict = (f"READY: labs run up to 4 ranks with {chosen.backend} on the CPU"
                   + (f", and up to {gpus} rank(s) with device='cuda' (one GPU per rank)." if gpus and
                      dist.is_nccl_available() else "."))
    lines.append(verdict)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disttrain-lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="what this machine offers and what the launcher will use")
    bench = sub.add_parser("bench", help="benchmarks, side by side with torch's own")
    bench.add_argument("what", choices=["launch", "trace", "allreduce", "ddp", "zero", "tp", "pipeline", "compression",
                                          "3d"],
                       help="what to measure")
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--notebook", help="allreduce, ddp, zero: the lab notebook whose functions to measure "
                       "(default: solutions/02_all_reduce/02_all_reduce.ipynb, solutions/03_data_parallel/"
                       "03_data_parallel.ipynb, solutions/04_zero/04_zero.ipynb or solutions/05_pipeline/"
                       "05_pipeline.ipynb, else the same under labs/)")
    bench.add_argument("--world-size", type=int, default=None, help="allreduce: number of ranks (default 4); "
                       "ddp, zero: (default 2); pipeline: stages (default 4)")
    bench.add_argument("--bucket-mb", type=float, default=25.0, help="ddp: bucket size of BucketedDDP and torch DDP")
    bench.add_argument("--max-bytes", type=int, default=64 << 20, help="allreduce: largest message")
    from .bench_3d import add_arguments as bench_3d_arguments
    bench_3d_arguments(bench)        # 3d: --steps, --write, --no-progress
    sub.add_parser("release", help="regenerate labs/ from solutions/ (nbgrader generate_assignment)",
                   add_help=False)
    sub.add_parser("grade", help="autograde submissions, write feedback, export grades", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "doctor":
        print(doctor())
        return 0
    if args.command == "bench":
        from . import bench as bench_module
        if args.what == "launch":
            rows = bench_module.bench_launch(repeats=args.repeats)
            print(bench_module.format_launch_table(rows))
            return 0
        if args.what == "trace":
            print(bench_module.format_trace_table(bench_module.bench_trace(repeats=args.repeats)))
            return 0
        if args.what == "allreduce":
            return _bench_allreduce(args)
        if args.what == "ddp":
            return _bench_ddp(args)
        if args.what == "zero":
            return _bench_zero(args)
        if args.what == "pipeline":
            return _bench_pipeline(args)
        if args.what == "tp":
            return _bench_tp(args)
        if args.what == "compression":
            from .bench_compression import main as bench_compression_main
            return bench_compression_main(args, _functions_from_lab)
        if args.what == "3d":
            from .bench_3d import run as bench_3d_run
            return bench_3d_run(args)
        raise ValueError(f"unknown benchmark {args.what!r}")
    if args.command in ("release", "grade"):
        from . import grading
        return getattr(grading, f"cli_{args.command}")(rest)
    raise ValueError(f"unknown command {args.command!r}")


ALL_REDUCE_LAB = os.path.join("02_all_reduce", "02_all_reduce.ipynb")
ALL_REDUCE_FUNCTIONS = ("naive_all_reduce", "parallel_all_reduce", "ring_all_reduce", "halving_doubling_all_reduce")


def _functions_from_lab(args, lab: str, names, what: str) -> dict | None:
    """``names`` as the lab notebook (``--notebook``, else solutions/``lab``, else labs/``lab``) defines them."""
    from . import bench as bench_module
    path = args.notebook or next((p for p in (os.path.join("solutions", lab), os.path.join("labs", lab))
                                  if os.path.exists(p)), None)
    if path is None or not os.path.exists(path):
        print(f"no notebook to take the {what} from: pass --notebook PATH (looked for "
              f"{path or 'solutions/' + lab + ' and labs/' + lab})", file=sys.stderr)
        return None
    functions = bench_module.functions_from_notebook(path, names)
    missing = [name for name in names if name not in functions]
    print(f"{what} from {path}" + (f" (not defined there: {', '.join(missing)})" if missing else ""))
    return functions


def _bench_allreduce(args) -> int:
    from . import bench as bench_module
    functions = _functions_from_lab(args, ALL_REDUCE_LAB, ALL_REDUCE_FUNCTIONS, "all-reduce functions")
    if functions is None:
        return 2
    sizes = [s for s in bench_module.ALLREDUCE_SIZES if s <= args.max_bytes]
    rows = bench_module.bench_allreduce(functions, world_size=args.world_size or 4, sizes=sizes, repeats=args.repeats)
    print(bench_module.format_allreduce_table(rows))
    return 0


DDP_LAB = os.path.join("03_data_parallel", "03_data_parallel.ipynb")
DDP_CLASSES = {"naive": "NaiveDDP", "overlapped": "OverlappedDDP", "bucketed": "BucketedDDP"}


def _bench_ddp(args) -> int:
    import functools
    from . import bench as bench_module
    classes = _functions_from_lab(args, DDP_LAB, list(DDP_CLASSES.values()), "data-parallel wrappers")
    if classes is None:
        return 2
    versions = {name: classes[cls] for name, cls in DDP_CLASSES.items() if cls in classes}
    if "bucketed" in versions:
        versions[f"bucketed ({args.bucket_mb:g} MiB)"] = functools.partial(versions.pop("bucketed"), bucket_mb=args.bucket_mb)
    rows = bench_module.bench_ddp(versions, world_size=args.world_size or 2, repeats=args.repeats,
                                  bucket_mb=args.bucket_mb)
    print(bench_module.format_ddp_table(rows))
    return 0


ZERO_LAB = os.path.join("04_zero", "04_zero.ipynb")
ZERO_CLASSES = {"Zero1Optimizer": 1, "Zero2Optimizer": 2, "Zero3Module": 3}


def _bench_zero(args) -> int:
    """``bench zero``: the lab's ZeRO classes against ZeroRedundancyOptimizer and FSDP (2 ranks by default)."""
    from . import bench as bench_module
    found = _functions_from_lab(args, ZERO_LAB, [*ZERO_CLASSES, "zero_memory_per_rank"], "ZeRO classes")
    if found is None:
        return 2
    versions = {name: (stage, found[name]) for name, stage in ZERO_CLASSES.items() if name in found}
    rows = bench_module.bench_zero(versions, world_size=args.world_size or 2, repeats=args.repeats,
                                   predict=found.get("zero_memory_per_rank"))
    print(bench_module.format_zero_table(rows))
    return 0


TP_LAB = os.path.join("06_tensor_parallel", "06_tensor_parallel.ipynb")


def _bench_tp(args) -> int:
    """``bench tp``: the lab's TensorParallelMLP against torch's ColwiseParallel/RowwiseParallel at N = 1, 2, 4
    (``--world-size N``: only N)."""
    from . import bench as bench_module
    found = _functions_from_lab(args, TP_LAB, ["TensorParallelMLP"], "tensor-parallel MLP")
    if found is None:
        return 2
    world_sizes = (args.world_size,) if args.world_size else (1, 2, 4)
    rows = bench_module.bench_tp(found, world_sizes=world_sizes, repeats=args.repeats)
    print(bench_module.format_tp_table(rows))
    return 0


PIPELINE_LAB = os.path.join("05_pipeline", "05_pipeline.ipynb")
PIPELINE_FUNCTIONS = ("split_stages", "Stage", "naive_step", "gpipe_step", "one_f_one_b_step")


def _bench_pipeline(args) -> int:
    """``bench pipeline``: naive, GPipe at m = 1, 2, 4, 8 and 1F1B against torch's ScheduleGPipe (4 stages)."""
    import functools
    from . import bench as bench_module
    found = _functions_from_lab(args, PIPELINE_LAB, PIPELINE_FUNCTIONS, "pipeline functions")
    if found is None:
        return 2
    if not {"split_stages", "Stage"} <= found.keys():
        print("the notebook must define split_stages and Stage", file=sys.stderr)
        return 2
    versions = {"naive": (found["naive_step"], 1)} if "naive_step" in found else {}
    for m in (1, 2, 4, 8):
        if "gpipe_step" in found:
            versions[f"GPipe m={m}"] = (functools.partial(found["gpipe_step"], micro_batches=m), m)
    if "one_f_one_b_step" in found:
        versions["1F1B m=8"] = (functools.partial(found["one_f_one_b_step"], micro_batches=8), 8)
    rows = bench_module.bench_pipeline(versions, found["split_stages"], found["Stage"],
                                       world_size=args.world_size or 4, repeats=args.repeats)
    print(bench_module.format_pipeline_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
