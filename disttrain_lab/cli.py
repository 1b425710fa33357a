"""``disttrain-lab doctor | bench | release | grade``."""

from __future__ import annotations

import argparse
import sys

from .bench import benchmarks
from .devices import doctor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disttrain-lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="what this machine offers and what the launcher will use")
    bench = sub.add_parser("bench", help="benchmarks, side by side with torch's own")
    _add_benchmarks(bench)
    sub.add_parser("release", help="regenerate labs/ from solutions/ (nbgrader generate_assignment)", add_help=False)
    sub.add_parser("grade", help="autograde submissions, write feedback, export grades", add_help=False)
    args, rest = parser.parse_known_args(argv)  # release and grade parse their own arguments
    if rest and args.command not in ("release", "grade"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")  # a typo must not run the default
    if args.command == "doctor":
        print(doctor())
        print(_grading_host())
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


def _grading_host() -> str:
    """The grading host's sandbox (its back-end, caps and syscall filter: what ``disttrain-lab
    grade`` would get here), where the instructor's tools are installed."""
    try:
        from .grading import sandbox
    except ImportError as exc:  # a student's install: no grading wing to describe
        return f"grading sandbox: not described here (the instructor's tools are not installed: {exc.name})"
    return sandbox.describe()


def _add_benchmarks(bench) -> None:
    """``bench NAME``: one subcommand per module in ``bench.BENCHMARKS``, each with its own options."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--repeats", type=int, default=5, help="samples per median (default %(default)s)")
    names = bench.add_subparsers(dest="what", required=True, metavar="NAME")
    for name, module in benchmarks().items():
        parser = names.add_parser(
            name,
            help=module.HELP,
            description=module.__doc__,
            parents=[common],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(parser)
        parser.set_defaults(benchmark=module)


if __name__ == "__main__":
    sys.exit(main())
