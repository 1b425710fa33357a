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
    _add_benchmarks(bench)
    sub.add_parser("release", help="regenerate labs/ from solutions/ (nbgrader generate_assignment)",
                   add_help=False)
    sub.add_parser("grade", help="autograde submissions, write feedback, export grades", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "doctor":
        print(doctor())
        return 0
    if args.command == "bench":
        return args.benchmark.run(args)
    # the grading wing needs the instructor's tools (the [grader] extra: nbgrader, rich), which a
    # student's install lacks: imported only when an instructor's command runs
    if args.command == "release":
        from .grading import course
        return course.cli_release(rest)
    if args.command == "grade":
        from .grading import classgrade
        return classgrade.cli_grade(rest)
    raise ValueError(f"unknown command {args.command!r}")


def _add_benchmarks(bench) -> None:
    """``bench NAME``: one subcommand per module in ``bench.BENCHMARKS``, each with its own options."""
    from .bench import benchmarks
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--repeats", type=int, default=5, help="samples per median (default 5)")
    names = bench.add_subparsers(dest="what", required=True, metavar="NAME")
    for name, module in benchmarks().items():
        parser = names.add_parser(name, help=module.HELP, description=module.__doc__, parents=[common],
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(parser)
        parser.set_defaults(benchmark=module)


if __name__ == "__main__":
    sys.exit(main())
