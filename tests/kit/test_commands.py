"""Every command a user can type runs here, for real, in its own process: a smoke test each.

- ``disttrain-lab bench NAME`` for every benchmark of ``bench.benchmarks()`` that no other test
  runs from the command line, with tiny settings and one repeat; checked: it exits 0 and prints
  its table (header and rows, never its speed).  The others are checked by the lab's own test
  (:data:`COVERED_ELSEWHERE`): most on what ``bench all --quick`` printed for them (its ``QUICK``, the
  same parser and ``measure``: ``tests/benchreport.py``, made once per session), lab 2's from its own
  command line; a benchmark added with neither fails :func:`test_every_benchmark_has_a_smoke_test`.
- ``disttrain-lab bench all --quick --report DIR``: every benchmark with its tiny settings (its ``QUICK``, parsed
  by the parser ``bench NAME`` uses) in one run; checked: report.json (strict JSON) holds each one's options,
  rows, table and pictures, the launch, trace and compression tables say what their own command prints, and
  report.html shows each table and every picture as a PNG; a benchmark that cannot run is said so in its place,
  the others still run, exit 1.  ``bench launch`` and ``bench compression`` run there only (their own command
  line is the same parser and ``measure``; ``bench trace`` runs here too, through ``run``).
- ``disttrain-lab bench --help`` (and every ``bench NAME --help``), ``grade --help``, ``release --help``,
  ``release --check``; ``disttrain-lab --version`` and ``python -m disttrain_lab`` (the same command);
  a mistyped command or benchmark (``disttrain-lab relase``): argparse's error, exit 2, "did you mean".
- every option and argument of every command (``--help`` of each, through the parsers argparse
  builds) and of every script has help text; a shell script's settings (``${NAME:-...}``) are named
  in its ``--help``.
- run elsewhere: ``disttrain-lab doctor`` in tests/kit/test_packaging.py::test_console_script_runs (the
  console script, READY; its text: tests/kit/test_launcher.py::test_doctor_reports_backend_and_verdict);
  ``disttrain-lab grade LAB`` and ``grade merge`` in tests/grading/test_gradeclass.py, ``disttrain-lab
  export LAB`` there too (test_exports_match_the_gradebook, with a mistyped lab); the labs' release in
  tests/grading/test_grading.py and tests/grading/test_install.py.
- every script under ``scripts/`` with ``--help``: it prints its usage and does nothing else
  (a shell script's setup, JupyterLab or pytest never start); ``setup.sh`` refuses an argument.
"""

from __future__ import annotations

import argparse
import ast
import base64
import html.parser
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from disttrain_lab.bench import benchmarks
from disttrain_lab.bench.registry import MEASUREMENTS
from tests import benchreport
from tests.helpers import REPO

SCRIPTS = REPO / "scripts"

# `disttrain-lab bench NAME` checked by a lab's own test (its table against the solution's names): on what
# `bench all --quick` printed for it (tests/benchreport.py), or from its own command line (lab 2's, which
# tries other sizes): not run again here
COVERED_ELSEWHERE = {
    "memory": "tests/labs/test_lab09.py::test_bench_memory_runs_both_sides_in_one_run",
    "allreduce": "tests/labs/test_lab02.py::test_cli_bench_allreduce_uses_the_notebook",
    "ddp": "tests/labs/test_lab03.py::test_cli_bench_ddp_uses_the_notebook",
    "zero": "tests/labs/test_lab04.py::test_cli_bench_zero_uses_the_notebook",
    "pipeline": "tests/labs/test_lab05.py::test_cli_bench_pipeline_uses_the_notebook",
    "tp": "tests/labs/test_lab06.py::test_cli_bench_tp_uses_the_notebook",
    "sequence": "tests/labs/test_bench_sequence.py::test_cli_bench_sequence_with_tiny_options",
    "experts": "tests/labs/test_bench_experts.py::test_cli_bench_experts_with_tiny_options",
    "checkpoint": "tests/labs/test_bench_checkpoint.py::test_cli_bench_checkpoint_with_tiny_options",
    "schedules": "tests/labs/test_bench_schedules.py::test_cli_bench_schedules_with_tiny_options",
    "prefetch": "tests/labs/test_bench_prefetch.py::test_cli_bench_prefetch_with_tiny_options",
    "all": "tests/kit/test_commands.py::test_bench_all_writes_a_report",
    "launch": "tests/kit/test_commands.py::test_bench_all_writes_a_report",
    "compression": "tests/kit/test_commands.py::test_bench_all_writes_a_report",
}
# what the tables of the benchmarks run only by `bench all` print (the words of their own command's table)
IN_THE_REPORT = {
    "launch": [
        "method",
        "ranks",
        "median",
        "vs warm launch",
        "dl.launch warm",
        "  to the functions",
        "  back to the kernel",
        "in ranks: a new group",
        "the fresh gloo group each launch makes",
        "dl.launch cold",
        "mp.spawn",
        "torchrun --standalone",
    ],
    "compression": [
        "compression hooks in torch DDP: MLP 512 -> 1024 -> 1024 -> 512",
        "2 ranks",
        "median of 1",
        "steps/s",
        "bytes/step/rank",
        "vs dense",
        "torch allreduce_hook (dense)",
        "torch fp16_compress_hook",
        "torch powerSGD_hook, rank 2",
        "top-k 1% + error feedback",
        "INT8",
    ],
}

# the others, run here: NAME -> (tiny options, what its output must hold)
SMOKE = {
    "trace": (
        ["--trips", "100"],
        [
            "message",
            "mode",
            "us/round trip",
            "time / torch",
            "4 B torch",
            "4 B status only",
            "4 B traced",
            "1.0 MiB torch",
            "1.0 MiB traced",
        ],
    ),
    # its rows (every configuration, with the planner's prediction) are checked in test_bench_3d
    "3d": (
        ["--steps", "1", "--warmup", "0", "--no-progress"],
        [
            "Lab 8 train_3d, GPT of",
            "8 ranks",
            "median of 1 x 1 steps, slowest rank",
            "configuration",
            "s/step",
            "tokens/s",
            "predicted",
        ],
    ),
}


def disttrain_lab() -> list[str]:
    """The console script beside this interpreter (what a user types), else ``python -m``."""
    script = Path(sys.executable).parent / "disttrain-lab"
    return [str(script)] if script.exists() else [sys.executable, "-m", "disttrain_lab.cli"]


def run(command: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    # the repository's own course folders, whatever this shell points at
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DISTTRAIN_COURSE_DIR", "DISTTRAIN_SOURCE_DIR", "DISTTRAIN_RELEASE_DIR")
    }
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**clean, **(env or {})}
    )


def said(out: subprocess.CompletedProcess) -> str:
    return f"exit {out.returncode}\n--- stdout\n{out.stdout[-6000:]}\n--- stderr\n{out.stderr[-6000:]}"


# ----------------------------------------------------------------------------------------
# disttrain-lab bench NAME


def test_every_benchmark_has_a_smoke_test():
    names = set(benchmarks())
    assert not set(SMOKE) & set(COVERED_ELSEWHERE), "run here and elsewhere"
    assert set(SMOKE) | set(COVERED_ELSEWHERE) == names, (
        f"`disttrain-lab bench NAME` without a smoke test: {sorted(names - set(SMOKE) - set(COVERED_ELSEWHERE))} "
        f"(give it tiny options in SMOKE); gone: {sorted((set(SMOKE) | set(COVERED_ELSEWHERE)) - names)}"
    )
    # the tests named really run that benchmark's command line, or read what `bench all --quick` printed for it
    for name, where in COVERED_ELSEWHERE.items():
        path, test = where.split("::")
        fn = _function(REPO / path, test)
        if name in IN_THE_REPORT or name == "all":
            assert "quick_report" in _calls(fn), f"{where} does not read the session's bench all --quick"
        else:
            reads = any(
                isinstance(node, ast.Call) and _name(node.func) == "printed_by" and _constants(node.args)[:1] == [name]
                for node in ast.walk(fn)
            )
            assert reads or _runs(fn, name), f"{where} neither runs bench {name} nor reads its part of bench all"
    assert _runs(_function(REPO / "tests" / "benchreport.py", "quick_report"), "all")


def _function(path: Path, name: str) -> ast.FunctionDef:
    [fn] = [
        node for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef) and node.name == name
    ]
    return fn


def _name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _calls(fn: ast.FunctionDef) -> set[str]:
    return {_name(node.func) for node in ast.walk(fn) if isinstance(node, ast.Call)}


def _constants(nodes) -> list:
    return [e.value for e in nodes if isinstance(e, ast.Constant)]


def _runs(fn: ast.FunctionDef, name: str) -> bool:
    """A command line in ``fn``: a list literal holding "bench" then ``name``, however it is laid out."""
    commands = [_constants(node.elts) for node in ast.walk(fn) if isinstance(node, ast.List)]
    return any(words[i : i + 2] == ["bench", name] for words in commands for i in range(len(words) - 1))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(benchmarks()) - set(COVERED_ELSEWHERE) - {"3d"}))
def test_bench(name):
    if name not in SMOKE:
        pytest.fail(f"bench {name}: no smoke test; give it tiny options in SMOKE")
    options, expected = SMOKE[name]
    out = run(disttrain_lab() + ["bench", name, "--repeats", "1", *options], timeout=240)
    assert out.returncode == 0, said(out)
    missing = [words for words in expected if words not in out.stdout]
    assert not missing, f"not printed: {missing}\n{said(out)}"


@pytest.mark.slow
def test_bench_3d(tmp_path):
    """Lab 8's 3d benchmark on every configuration, one step each, the planner's prediction beside each."""
    from disttrain_lab.bench.three_d import CONFIGS

    options, expected = SMOKE["3d"]
    record = tmp_path / "step_times.json"
    out = run(disttrain_lab() + ["bench", "3d", "--repeats", "1", *options, "--write", str(record)], timeout=240)
    assert out.returncode == 0, said(out)
    missing = [words for words in expected if words not in out.stdout]
    assert not missing, f"not printed: {missing}\n{said(out)}"
    rows = [line for line in out.stdout.splitlines() if line.startswith("dp=")]
    assert sorted(row[:24].strip() for row in rows) == sorted(
        f"dp={dp} tp={tp} pp={pp} m={m}" for dp, tp, pp, m in CONFIGS
    ), said(out)
    assert all(row.endswith("%") and "n/a" not in row for row in rows), said(out)  # predictions and residuals
    assert "the planner's largest residual" in out.stdout, said(out)
    assert f"wrote {record}" in out.stdout
    written = json.loads(record.read_text())
    assert (written["steps"], written["repeats"], written["warmup"]) == (1, 1, 0)
    assert [(r["dp"], r["tp"], r["pp"], r["micro_batches"]) for r in written["runs"]] == CONFIGS
    assert all(r["median_step_s"] > 0 and len(r["step_s"]) == 1 for r in written["runs"])
    assert written["cluster"]["flops"] > 0 and "taking turns with them" in written["cluster"]["flops_note"]


class _Pictures(html.parser.HTMLParser):
    """The report page's headings' ids and its pictures' sources."""

    def __init__(self):
        super().__init__()
        self.ids, self.sources = [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "h2":
            self.ids.append(attrs.get("id"))
        if tag == "img":
            self.sources.append(attrs.get("src", ""))


@pytest.mark.slow
@pytest.mark.bench_report  # (made once per session, its benchmarks' own tests read their tables from it)
def test_bench_all_writes_a_report():
    """``bench all --quick --report DIR``: every benchmark, in the registry's order, with its tiny settings."""
    out = benchreport.quick_report()
    assert out.returncode == 0, out.said()
    tmp_path = out.folder
    assert f"wrote {tmp_path / 'report.json'} and {tmp_path / 'report.html'}" in out.stdout, out.said()
    report = json.loads((tmp_path / "report.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert report["quick"] is True and report["torch"] == torch.__version__, report
    entries = {b["name"]: b for b in report["benchmarks"]}
    assert list(entries) == [m.NAME for m in MEASUREMENTS], list(entries)
    pictures = 0
    for name, entry in entries.items():
        assert entry["status"] == "measured", (name, entry.get("why"), entry.get("traceback"))
        assert entry["options"] == [*benchmarks()[name].QUICK, "--repeats", "1"], entry["options"]
        assert entry["rows"] and entry["table"].strip() and entry["charts"], name
        for chart in entry["charts"]:  # every picture has points, each a (name or number, number)
            assert chart["series"] and all(chart["series"].values()), (name, chart)
            points = [p for series in chart["series"].values() for p in series]
            assert all(len(p) == 2 and isinstance(p[1], (int, float)) for p in points), (name, chart)
        pictures += len(entry["charts"])
    for name, words in IN_THE_REPORT.items():
        missing = [w for w in words if w not in entries[name]["table"]]
        assert not missing, f"bench {name}'s table lacks {missing}:\n{entries[name]['table']}"
    busbw = entries["allreduce"]["charts"][0]["series"]
    assert "dist.all_reduce" in busbw and all(x > 0 and y > 0 for x, y in busbw["dist.all_reduce"]), busbw
    assert all(r["predicted_s"] > 0 for r in entries["3d"]["rows"]), entries["3d"]["rows"]  # the planner's
    page = _Pictures()
    page.feed((tmp_path / "report.html").read_text())
    assert page.ids == list(entries), page.ids
    assert len(page.sources) == pictures, (len(page.sources), pictures)
    for source in page.sources:
        assert source.startswith("data:image/png;base64,"), source[:80]
        assert base64.b64decode(source.split(",", 1)[1]).startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.slow
def test_bench_all_on_several_numbers_of_ranks_shows_how_each_ratio_moves(tmp_path):
    """``bench all --world-size 2,4``: each benchmark that takes ``--world-size`` runs on both (lab 2's
    all-reduces, lab 6's TP MLP), with its table per number of ranks and the scaling table of each version's
    ratio to torch, drawn in the report.  (Not the launch bench here: its mp.spawn and torchrun starts on 4
    ranks beside a loaded suite lost a gloo connection once, torch's own; it took a list of sizes before.)"""
    out = run(
        disttrain_lab()
        + ["bench", "all", "--quick", "--only", "allreduce,tp,trace", "--world-size", "2,4"]
        + ["--report", str(tmp_path)],
        timeout=600,
    )
    assert out.returncode == 0, said(out)
    entries = {b["name"]: b for b in json.loads((tmp_path / "report.json").read_text())["benchmarks"]}
    assert entries["trace"]["options"] == [*benchmarks()["trace"].QUICK, "--repeats", "1"]  # (it takes none)
    for name in ("allreduce", "tp"):
        entry = entries[name]
        assert entry["status"] == "measured", (name, entry.get("why"), entry.get("traceback"))
        assert entry["options"][-2:] == ["--world-size", "2,4"], entry["options"]
        assert {r["world_size"] for r in entry["rows"]} == {2, 4}, (name, entry["rows"])
    for name, key in (("allreduce", "algorithm / bytes"), ("tp", "version")):
        table = entries[name]["table"]
        assert "scaling: each ratio (as in the tables above) on 2, 4 ranks, and how it moves from 2 to 4" in table
        header = next(line for line in table.splitlines() if line.startswith(key))
        assert header.split()[-5:] == ["2", "ranks", "4", "ranks", "change"], header
        [scaling] = [c for c in entries[name]["charts"] if c["title"].startswith("How each ratio moves")]
        torch_name = "dist.all_reduce, 64.0 KiB" if name == "allreduce" else "torch Colwise/RowwiseParallel"
        assert [x for x, _ in scaling["series"][torch_name]] == [2, 4], scaling
    assert "busbw in GB/s on 2 ranks" in entries["allreduce"]["table"]
    assert "busbw in GB/s on 4 ranks" in entries["allreduce"]["table"]
    assert "How each ratio moves" in (tmp_path / "report.html").read_text()


@pytest.mark.slow
def test_bench_all_reports_what_it_could_not_measure(tmp_path):
    """Where there is no notebook (run from an empty folder), a lab's benchmark is said not measured in its
    place, the others still run, and the command exits 1; an unknown name in ``--only`` is refused (exit 2)."""
    command = [*disttrain_lab(), "bench", "all", "--quick", "--only", "ddp,trace", "--report", str(tmp_path / "r")]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 1, said(out)
    entries = {b["name"]: b for b in json.loads((tmp_path / "r" / "report.json").read_text())["benchmarks"]}
    assert entries["trace"]["status"] == "measured", entries["trace"]
    assert entries["ddp"]["status"] == "not measured" and "no notebook to take" in entries["ddp"]["why"], entries
    assert "bench ddp: not measured: no notebook to take the data-parallel wrappers from" in out.stderr, said(out)
    assert "not measured: no notebook" in (tmp_path / "r" / "report.html").read_text()


def test_bench_all_refuses_an_unknown_benchmark(capsys):
    from disttrain_lab import cli

    assert cli.main(["bench", "all", "--only", "trace,nope"]) == 2
    assert "no benchmark named nope" in capsys.readouterr().err


def test_the_report_page_escapes_what_it_shows_and_its_json_is_strict():
    from disttrain_lab.bench import report

    content = {
        "kit": "0",
        "torch": "t",
        "python": "3",
        "machine": "m",
        "started": "s",
        "quick": False,
        "benchmarks": [
            {
                "name": "x",
                "about": "<b>",
                "options": [],
                "seconds": 1.0,
                "status": "failed",
                "why": "<script>1</script>",
            },
            {
                "name": "y",
                "about": "a",
                "options": [],
                "seconds": 1.0,
                "status": "measured",
                "table": "<img src=x>",
                "charts": [],
                "rows": [{"v": float("nan"), "w": (1, float("inf"))}],
            },
        ],
    }
    page = report.page(report.plain(content))
    assert "<script>" not in page and "<img src=x>" not in page and "&lt;script&gt;" in page
    assert report.plain(content)["benchmarks"][1]["rows"] == [{"v": None, "w": [1, None]}]


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_bench_help_lists_every_benchmark():
    out = run(disttrain_lab() + ["bench", "--help"], timeout=120)
    assert out.returncode == 0 and "usage: disttrain-lab bench" in out.stdout, said(out)
    missing = [name for name in benchmarks() if name not in out.stdout]
    assert not missing, said(out)


@pytest.mark.parametrize("argv", [["doctor", "--bogus"], ["bench", "trace", "--bogus", "5"]])
def test_an_unknown_option_is_an_error_not_the_default_run(argv, capsys):
    from disttrain_lab import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(argv)  # raises before anything runs: a benchmark would take seconds
    assert exited.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_each_benchmark_has_help(capsys):
    from disttrain_lab import cli

    for name in benchmarks():
        with pytest.raises(SystemExit) as stopped:
            cli.main(["bench", name, "--help"])
        text = capsys.readouterr().out
        assert stopped.value.code == 0 and f"usage: disttrain-lab bench {name}" in text and "--repeats" in text, text
        # each its own default (`bench all`'s, each benchmark's own, once reached every one: `bench launch` crashed)
        assert ("samples per median (default None)" in text) == (name == "all"), text


# ----------------------------------------------------------------------------------------
# disttrain-lab grade, release (doctor: see the module's docstring)


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, expected",
    [
        ("grade", ["usage: disttrain-lab grade", "lab", "--jobs", "--shard", "--force", "grade merge"]),
        ("release", ["usage: disttrain-lab release", "labs", "--check", "--install-source", "--time-cells"]),
    ],
)
def test_help(command, expected):
    # slow: both load nbgrader (~3 s)
    out = run(disttrain_lab() + [command, "--help"], timeout=120)
    assert out.returncode == 0, said(out)
    text = " ".join(out.stdout.split())  # argparse wraps its lines to the terminal's width
    missing = [words for words in expected if words not in text]
    assert not missing, f"not printed: {missing}\n{said(out)}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_release_check():
    """Releases a lab and builds the wheel in a scratch folder: labs/ and labs/wheels/ are what the
    sources make (after changing the kit's sources: `disttrain-lab release`).  One lab: every lab's
    fresh release is compared with labs/ by tests/grading/test_grading.py (its round trip's release)."""
    out = run(disttrain_lab() + ["release", "--check", "01_point_to_point"], timeout=560)
    assert out.returncode == 0 and "labs/ is up to date" in out.stdout, said(out)


# ----------------------------------------------------------------------------------------
# --version, python -m disttrain_lab, a typo, help for every option


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_version_and_python_dash_m_are_the_same_command():
    from disttrain_lab import __version__

    script = run(disttrain_lab() + ["--version"], timeout=120)
    module = run([sys.executable, "-m", "disttrain_lab", "--version"], timeout=120)
    assert script.returncode == module.returncode == 0, said(script) + said(module)
    assert script.stdout == module.stdout == f"disttrain-lab {__version__}\n"
    helped = run([sys.executable, "-m", "disttrain_lab", "--help"], timeout=120)
    assert helped.returncode == 0 and "usage: disttrain-lab" in helped.stdout, said(helped)
    assert all(command in helped.stdout for command in ("doctor", "bench", "release", "grade", "export"))


# a command's --help, then which of the benchmarks' modules the process imported
IMPORTED_BENCHMARKS = """
import sys
from disttrain_lab import cli
try:
    cli.main(sys.argv[1:])
except SystemExit:
    pass
print(sorted(m for m in sys.modules if m.startswith("disttrain_lab.bench")))
"""


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
@pytest.mark.parametrize("command", [["--help"], ["release", "--help"], ["doctor"], ["bench", "--help"]], ids=" ".join)
def test_only_bench_imports_the_benchmarks(command):
    """The benchmarks import torch's checkpointing and pipelining and matplotlib (3 s of CPU here):
    the other commands start without them."""
    out = run([sys.executable, "-c", IMPORTED_BENCHMARKS, *command], timeout=120)
    assert out.returncode == 0 and out.stdout.strip(), said(out)
    imported = out.stdout.splitlines()[-1]
    if command[0] == "bench":
        assert "'disttrain_lab.bench.report'" in imported, said(out)
    else:
        assert imported == "[]", said(out)


@pytest.mark.parametrize(
    "argv, meant",
    [(["relase"], "release"), (["grde", "LAB"], "grade"), (["exprot", "LAB"], "export"), (["bench", "trce"], "trace")],
)
def test_a_typo_is_argparses_error_with_the_closest_name(argv, meant, capsys):
    from disttrain_lab import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(argv)  # before anything runs
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"did you mean {meant!r}?" in err and "usage: disttrain-lab" in err, err


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_a_typo_in_a_terminal_is_no_traceback():
    out = run(disttrain_lab() + ["relase"], timeout=120)
    assert out.returncode == 2 and "did you mean 'release'?" in out.stderr and "Traceback" not in out.stderr, said(out)


def undocumented(parsers) -> list[str]:
    """Every argument of ``parsers`` and of their subcommands, at any depth, that has no help text."""
    missing, seen, todo = [], set(), list(parsers)
    while todo:
        parser = todo.pop()
        if id(parser) in seen:
            continue
        seen.add(id(parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {c.dest for c in action._choices_actions if c.help}  # (none made without help=)
                missing += [f"{parser.prog} {name}" for name in action.choices if name not in helped]
                todo += action.choices.values()
            elif not action.help:
                missing.append(f"{parser.prog} {'/'.join(action.option_strings) or action.dest}")
    return missing


@pytest.mark.parametrize(
    "command",
    [[], ["bench"], ["start"], ["release"], ["grade"], ["grade", "merge"], ["export"], ["gradescope"]],
    ids=" ".join,
)
def test_every_option_of_every_command_has_help(command, monkeypatch, capsys):
    """Each parser the command builds (``bench``'s holds every benchmark's), caught as it parses ``--help``."""
    from disttrain_lab import cli

    parsers, parse = [], argparse.ArgumentParser.parse_known_args

    def seen(self, *args, **kwargs):
        parsers.append(self)
        return parse(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", seen)
    with pytest.raises(SystemExit) as exited:
        cli.main([*command, "--help"])
    assert exited.value.code == 0 and "usage: " + " ".join(["disttrain-lab", *command]) in capsys.readouterr().out
    assert parsers and undocumented(parsers) == []


# run in one process: each script's parsers, caught as they parse --help (the script stops there)
CATCH_PARSERS = """
import argparse, json, runpy, sys
found, parse = {}, argparse.ArgumentParser.parse_known_args
def seen(self, *args, **kwargs):
    found.setdefault(sys.argv[0], []).extend([a.option_strings or [a.dest], a.help] for a in self._actions)
    return parse(self, *args, **kwargs)
argparse.ArgumentParser.parse_known_args = seen
out, scripts = sys.argv[1], sys.argv[2:]
for script in scripts:
    sys.argv = [script, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        pass
with open(out, "w") as f:
    json.dump(found, f)
"""


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_every_option_of_every_script_has_help(tmp_path):
    scripts = sorted(str(p) for p in SCRIPTS.glob("*.py"))
    out = run([sys.executable, "-c", CATCH_PARSERS, str(tmp_path / "found.json"), *scripts], timeout=240)
    assert out.returncode == 0, said(out)
    found = json.loads((tmp_path / "found.json").read_text())
    assert sorted(found) == scripts, "a script that parses no arguments: give it argparse and --help"
    assert {s: [names for names, text in actions if not text] for s, actions in found.items()} == {
        s: [] for s in scripts
    }
    for script in sorted(SCRIPTS.glob("*.sh")):  # their settings are environment variables, with defaults
        settings = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*):?-", script.read_text()))
        text = run(["bash", str(script), "--help"], timeout=60).stdout
        assert settings and not [name for name in settings if name not in text], f"{script.name}: {settings}"


def test_setup_refuses_an_argument(tmp_path):
    venv = tmp_path / "venv"  # as below: were it to go on, it would fail at once, in a scratch folder
    out = run(["bash", str(SCRIPTS / "setup.sh"), "--bogus"], timeout=60, env={"PYTHON": "false", "VENV": str(venv)})
    assert out.returncode == 2 and "unknown argument '--bogus'" in out.stderr and not venv.exists(), said(out)


# ----------------------------------------------------------------------------------------
# scripts/: each answers --help with its usage, and does nothing else


SLOW_HELP = {"hub_check.py", "scaling_runs.py"}  # their imports take 7-12 s: the full suite runs them


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_HELP else p
        for p in sorted(p for p in SCRIPTS.iterdir() if p.is_file() and not p.name.startswith("."))
    ],
    ids=lambda p: p.name,
)  # not __pycache__/, which importing a script leaves
def test_script_help(script, tmp_path):
    if script.suffix == ".py":
        command = [sys.executable, str(script), "--help"]
    elif script.suffix == ".sh":
        command = ["bash", str(script), "--help"]
    else:
        pytest.fail(f"{script.name}: neither a .py nor a .sh script; say here how to run it with --help")
    # were a shell script to go on past --help, its setup would fail at once (no python to make a venv
    # with) and in a scratch folder, instead of installing
    venv = tmp_path / "venv"
    out = run(command, timeout=60, env={"PYTHON": "false", "VENV": str(venv)})
    assert out.returncode == 0, said(out)
    usage = "usage:" in out.stdout.lower() or f"bash scripts/{script.name}" in out.stdout
    assert usage and script.name in out.stdout, said(out)
    assert not venv.exists() and not out.stderr.strip(), said(out)
