"""``disttrain-lab doctor | start | bench | release | grade | export | gradescope | new-lab``
(also ``python -m disttrain_lab``)."""

from __future__ import annotations

import argparse
import difflib
import sys

from . import __version__, confine, start
from .devices import doctor

# the instructor's commands: each parses its own arguments in the grading wing, imported only when it runs
INSTRUCTOR = {
    "release": "release labs from solutions/ into a course folder (--course-dir), else regenerate labs/",
    "grade": "autograde submissions, write feedback, export grades",
    "export": "write a graded lab's results: per-student JSON, per-exercise CSV, Canvas and Moodle CSVs",
    "gradescope": "pack a released lab as a Gradescope autograder (setup.sh, run_autograder)",
    "new-lab": "make a new lab's solution notebook, its graded checks and its README row",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="disttrain-lab", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="what this machine offers and what the launcher will use")
    # (parses its own arguments, as the instructor's commands do)
    sub.add_parser("start", help="your own copy of a lab in work/, kept when the lab is fixed", add_help=False)
    bench = sub.add_parser("bench", help="benchmarks, side by side with torch's own")
    for command, what in INSTRUCTOR.items():
        sub.add_parser(command, help=what, add_help=False)
    command = _first_word(argv)
    _known(parser, "command", command, list(sub.choices))
    if command == "bench":  # (the benchmarks' modules only then: every other command starts 3 s sooner)
        names = _add_benchmarks(bench)
        _known(bench, "benchmark", _first_word(argv[argv.index("bench") + 1 :]), names)
    args, rest = parser.parse_known_args(argv)  # the instructor's commands parse their own arguments
    if rest and args.command not in (*INSTRUCTOR, "start"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")  # a typo must not run the default
    if args.command == "doctor":
        print(doctor())
        print(_grading_host())
        return 0
    if args.command == "bench":
        from .bench.command import run_measured

        module = args.benchmark  # one that measures prints its table; `bench all` (report.py) runs them all
        return run_measured(module.measure, args) if hasattr(module, "measure") else module.run(args)
    if args.command == "start":
        return start.cli_start(rest)
    # the grading wing needs the instructor's tools (the [grader] extra: nbgrader, rich), which a
    # student's install lacks: imported only when an instructor's command runs
    if args.command == "release":
        from .grading import course

        return course.cli_release(rest)
    if args.command == "grade":
        from .grading import classgrade

        return classgrade.cli_grade(rest)
    if args.command == "export":
        from .grading import export

        return export.cli_export(rest)
    if args.command == "gradescope":
        from .grading import gradescope

        return gradescope.cli_gradescope(rest)
    if args.command == "new-lab":
        from .grading import newlab

        return newlab.cli_new_lab(rest)
    raise ValueError(f"unknown command {args.command!r}")


def _first_word(argv: list[str]) -> str | None:
    """The first argument that is not an option: the command (or a benchmark's name)."""
    return next((word for word in argv if not word.startswith("-")), None)


def _known(parser: argparse.ArgumentParser, what: str, word: str | None, choices: list[str]) -> None:
    """argparse's error (exit 2) for a word that is none of ``choices``, with the closest one."""
    if word is None or word in choices:
        return  # none given: argparse says what is missing
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    parser.error(
        f"unknown {what} {word!r} (choose from {', '.join(choices)})"
        + (f"; did you mean {close[0]!r}?" if close else "")
    )


def _grading_host() -> str:
    """The grading host's sandbox (its back-end, caps and syscall filter: what ``disttrain-lab
    grade`` would get here), where the instructor's tools are installed."""
    try:
        from .grading import sandbox
    except ImportError as exc:  # a student's install: no grading wing to describe
        return f"grading sandbox: not described here (the instructor's tools are not installed: {exc.name})"
    ranks_apart = confine.host_problem()
    return (
        sandbox.describe()
        + "\n  a graded run's ranks confined (Landlock: no files, signals or abstract sockets between them): "
        + (f"NO: {ranks_apart}" if ranks_apart else f"yes (ABI {confine.abi()[0]})")
    )


def _add_benchmarks(bench) -> list[str]:
    """``bench NAME``: one subcommand per module in ``bench.BENCHMARKS``, each with its own options.
    (Imported here, not at the top: the benchmarks import torch's checkpointing and pipelining and
    matplotlib, about 3 s of CPU that ``grade``, ``release`` and the rest have no use for.)"""
    from .bench import benchmarks
    from .bench.command import add_common_arguments

    names = bench.add_subparsers(dest="what", required=True, metavar="NAME")
    for name, module in benchmarks().items():
        parser = names.add_parser(
            name, help=module.HELP, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        add_common_arguments(parser)  # each its own (a parent's actions are shared: `all` changes its default)
        module.add_arguments(parser)
        parser.set_defaults(benchmark=module)
    return list(benchmarks())


if __name__ == "__main__":
    sys.exit(main())
