"""``disttrain-lab bench all --quick --report DIR``, run once per test session and read by every test that
checks a benchmark's table.

``bench all --quick`` runs each benchmark with its tiny settings (its module's ``QUICK``) through the same
parser and ``measure`` as ``bench NAME``, and prints the same table: the benchmarks' own tests read their part
of its output instead of running ``bench NAME`` with the same options once more (#35: ten benchmarks, among
them torchrun's restarts and torchft's replicas, ran twice).  The first test to ask makes it (a file lock, as
``roundtrip.round_trip`` does); every test that reads it carries the ``bench_report`` mark, which puts it in
one unit with the report's own test (tests/conftest.py), so that no worker waits on another's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from disttrain_lab.bench import benchmarks, report
from disttrain_lab.bench.command import add_common_arguments
from tests import roundtrip
from tests.helpers import REPO

TIMEOUT = 900  # the command's limit: ~110 s quiet, 300 s under CI's load


@dataclass
class QuickReport:
    folder: Path  # report.json and report.html
    returncode: int
    stdout: str
    stderr: str

    def said(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout[-6000:]}\n--- stderr\n{self.stderr[-6000:]}"

    def printed_by(self, name: str, options: list[str]) -> str:
        """What ``bench NAME OPTIONS`` prints, as ``bench all`` printed it for ``name``: its part of the output,
        from its heading to the next benchmark's.  ``options`` (the test's, with ``--repeats 1``) must be the
        ones ``bench all --quick`` ran it with."""
        assert self.returncode == 0, self.said()
        module = benchmarks()[name]
        quick, parsed = report.options_of(module, quick=True, repeats=None)  # (as bench all ran it)
        parser = argparse.ArgumentParser()
        add_common_arguments(parser)
        module.add_arguments(parser)
        assert vars(parser.parse_args(options)) == vars(parsed), f"bench all --quick runs bench {name} {quick}"
        heading = f"bench {name} {' '.join(quick)}\n"
        assert heading in self.stdout, self.said()
        part = self.stdout.split(heading, 1)[1]
        following = [f"\nbench {other} " for other in benchmarks() if other != name]
        ends = [i + 1 for i in (part.find(h) for h in following) if i >= 0]
        return part[: min(ends)] if ends else part


def quick_report() -> QuickReport:
    """This session's ``bench all --quick --report DIR`` (made by the first caller, read by the others)."""
    root = roundtrip.shared_root() / "bench_all_quick"
    with FileLock(str(root) + ".lock"):
        done = root / "run.json"
        if not done.exists():
            root.mkdir(parents=True, exist_ok=True)
            script = Path(sys.executable).parent / "disttrain-lab"  # the command an instructor types
            command = [str(script)] if script.exists() else [sys.executable, "-m", "disttrain_lab.cli"]
            out = subprocess.run(
                [*command, "bench", "all", "--quick", "--report", str(root)],
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
                cwd=REPO,
            )
            done.write_text(json.dumps({"returncode": out.returncode, "stdout": out.stdout, "stderr": out.stderr}))
        run = json.loads(done.read_text())
    return QuickReport(folder=root, **run)
