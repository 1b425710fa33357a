"""How pytest-xdist shares the suite among its workers (scripts/test.sh: ``--dist loadgroup
--no-loadscope-reorder``), in units that keep together what shares an execution.

A unit is one test file, except a lab's: a lab's round trip (tests/roundtrip.py: release it,
autograde the solution and the blank) is read by two files, tests/grading/test_grading.py
(its scores) and the lab's own tests/labs/test_labNN.py (what the solution's cells showed), so
the lab's tests in both files are one unit, ``lab:NN_name``.  One worker then makes the round
trip and reads it for both: no worker waits on another's round trip (the file lock), and
test_grading.py is no longer one unit that grows by a round trip per lab (26 min of ten labs'
round trips on one worker while the others ran everything else).  Every test carries its
unit as an ``xdist_group`` mark (``--dist loadgroup`` gives each group to one worker, its tests
in order, so a file's module-scoped fixtures are made once per unit).

The units are handed out longest first (longest processing time first; ``--no-loadscope-reorder``
keeps this order instead of xdist's most-tests-first), so the run does not end with one worker
still grading while the others wait.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

import pytest

from disttrain_lab import grading
from disttrain_lab.grading import cgroups, sandbox
from tests import roundtrip

# the unit of the tests that read the session's `bench all --quick` (unit_of), and their time limit: the
# command's (tests/benchreport.py's TIMEOUT, 900 s) and its clean-up, as any of them may make it
BENCH_REPORT_UNIT = "bench all --quick"
BENCH_REPORT_TIMEOUT = 960

# seconds of work per test file in a full run on 2 cores, 3 workers (what its tests take without
# making a round trip); files not listed come after these, in pytest's order.  The largest were
# measured again on 7 Dec (the wall time of each unit in the run's "CPU seconds by unit", a quiet
# fresh clone of 005b335: 57 min; the machine about 2.3 times slower than in November: #35's
# figures in docs/architecture.md; test_trusted.py's less the classmate dropped since); the others from the
# run's temporary folders (27 Nov, ten labs, load 5-7) where a file leaves them, else from
# --junitxml of earlier runs, less what batching their wrong answers in one kernel saved (labs 1, 3-6:
# 36, 40, 56, 26, 34 s -> 20, 9, 23, 6, 16 s at load 3-5).  test_browser.py: eight labs through JupyterLab
# (those not run as a student in their own files: 8 of the 12 labs' 420 s, a guess until measured).
SECONDS = {
    "test_browser.py": 704,  # (7 Dec: its wall time in a quiet fresh-clone run)
    # the fixtures' broken submissions and the CLI's (the labs are units of their own); measured alone at
    # load 5-7 once every fixture test ran in the grader kernel (issue 35: two kernels per student)
    "test_grading.py": 550,  # (7 Dec: its wall time in a quiet fresh-clone run)
    "test_broken_submissions.py": 170,  # (7 Dec: its slowest fixture, 166 s, in a quiet fresh-clone run)
    "test_gradeclass.py": 212,  # (7 Dec: its wall time in a quiet fresh-clone run)
    "test_security.py": 385,  # (7 Dec: its wall time in a quiet fresh-clone run)
    "test_gradescope.py": 205,  # measured alone, with other tests beside it: the packed round trip graded twice
    "test_trusted.py": 480,  # (7 Dec: its wall time in a quiet fresh-clone run)
    "test_lab05.py": 125,
    "test_lab09.py": 100,
    "test_lab03.py": 95,
    "test_lab04.py": 75,
    "test_lab10.py": 55,  # lab 10 split in two (30 Nov): its old 90 s shared by the two halves, to be measured
    "test_lab11.py": 50,
    "test_lab12.py": 40,  # (a guess: its notebook as a student runs it, and its wrong answers in one kernel)
    "test_lab13.py": 35,  # (a guess: its notebook as a student runs it, its wrong answers in one kernel, a capture)
    "test_lab14.py": 45,  # (a guess: its notebook as a student runs it, nine wrong answers in one kernel, captures)
    "test_caps.py": 229,  # (7 Dec: its wall time in a quiet fresh-clone run)
    "test_hygiene.py": 140,  # a grading of three students, 105 s, beside another test run
    "test_commands.py": 170,  # (7 Dec: its wall time in a quiet fresh-clone run, 372 s, less bench all's 204)
    BENCH_REPORT_UNIT: 230,  # bench all --quick (204 s in the quiet run of 7 Dec) and the tests that read it
    "test_lab06.py": 55,
    "test_lab01.py": 55,
    "test_lab02.py": 61,
    "test_fairness.py": 60,
    "test_launcher.py": 182,  # (7 Dec: its wall time in a quiet fresh-clone run)
    "test_submission_data.py": 140,  # (7 Dec: its wall time in a quiet fresh-clone run)
    "test_cell_times.py": 40,
    "test_corpus.py": 100,  # the fixture lab released and two variants graded, then graded again (beside a suite)  # the fixture timed once and a spinning student graded
    "test_lab07.py": 38,
    "test_lab08.py": 36,
    "test_install.py": 167,  # (7 Dec: its wall time in a quiet fresh-clone run)
    "test_feedback_page.py": 85,  # one grading, a browser with the network cut
    "test_sanitize.py": 25,  # a gradebook made by nbgrader, a browser on the formgrader's and feedback's pages
    "test_syscall_filter.py": 20,
    "test_torchrun_nodes.py": 25,
    "test_network.py": 22,
    "test_bench_sequence.py": 13,  # measured alone at load 1: 12 s, its CLI run 11 s
    "test_bench_experts.py": 13,  # measured alone at load 1: 12 s, its CLI run 11 s
    "test_bench_schedules.py": 15,
    "test_bench_prefetch.py": 12,  # (a guess until measured: two launches and a CLI run, a few seconds each)  # (measured beside a full suite: 35 s; three launches and a CLI run)
    "test_hidden_memory.py": 15,  # measured alone, quiet: 12 s (seven of lab 14's memory runs, on 4 MiB layers)
    "test_bench_checkpoint.py": 60,  # measured alone at load 1: 60 s (two torchrun restarts, torchft's replicas)
    "test_lab14_prefetch.py": 141,  # (7 Dec: its wall time in a quiet fresh-clone run)
}
# seconds of a lab's round trip (tests/roundtrip.py), from the same run
ROUND_TRIP_SECONDS = {
    "00_basics": 20,  # released only: its grading is test_grading.py's broken batch
    "00_launch": 160,  # (measured alone at load 5-7, its tests in the grader kernel: issue 35)
    "01_point_to_point": 170,  # (7 Dec: the unit\'s wall time less its own file\'s)
    "02_all_reduce": 164,  # (7 Dec: the unit\'s wall time less its own file\'s)
    "03_data_parallel": 245,  # (7 Dec: the unit\'s wall time less its own file\'s)
    "04_zero": 803,  # (7 Dec: the unit\'s wall time less its own file\'s)
    "05_pipeline": 117,  # (7 Dec: the unit\'s wall time less its own file\'s)
    "06_tensor_parallel": 151,  # (7 Dec: the unit\'s wall time less its own file\'s)
    "07_compression": 197,  # (7 Dec: the unit\'s wall time less its own file\'s)
    "08_capstone": 572,  # (7 Dec: the unit\'s wall time less its own file\'s)
    "09_memory": 371,  # (7 Dec: the unit\'s wall time less its own file\'s)
    "10_context_parallel": 226,  # (7 Dec: the unit\'s wall time less its own file\'s)
    "11_expert_parallel": 128,  # (7 Dec: the unit\'s wall time less its own file\'s)
    "12_running_jobs": 298,  # (7 Dec: the unit\'s wall time less its own file\'s)
    "13_fp8": 127,  # (7 Dec: the unit\'s wall time less its own file\'s)
    "14_schedules": 270,  # (7 Dec: the unit\'s wall time less its own file\'s)
}
ROUND_TRIP_GUESS = 150  # a lab not measured yet

LABS = {name[:2]: name for name in grading.list_labs(roundtrip.SOLUTIONS)}


def unit_of(item) -> str:
    """The unit ``item`` runs in: ``lab:NN_name`` for a lab's tests in test_grading.py (those of its
    ``released`` course) and in tests/labs/test_labNN.py; the tests that read the session's ``bench all
    --quick`` (tests/benchreport.py: the ``bench_report`` mark) in one; else its file's path."""
    if item.get_closest_marker("bench_report"):
        return BENCH_REPORT_UNIT
    released = getattr(item, "callspec", None) and item.callspec.params.get("released")
    if released:
        return f"lab:{released[0]}"
    own = re.fullmatch(r"test_lab(\d\d)\.py", item.path.name)
    if own and own.group(1) in LABS:
        return f"lab:{LABS[own.group(1)]}"
    return str(item.path.relative_to(item.config.rootpath))


def seconds_of(unit: str) -> float:
    if unit.startswith("lab:"):
        lab = unit[len("lab:") :]
        own = f"test_lab{lab[:2]}.py" if lab[:2] in LABS else ""
        return ROUND_TRIP_SECONDS.get(lab, ROUND_TRIP_GUESS) + SECONDS.get(own, 0)
    return SECONDS.get(os.path.basename(unit), 0)


def pytest_itemcollected(item):
    # before pytest-xdist reads the marks (its own pytest_collection_modifyitems, under loadgroup)
    item.add_marker(pytest.mark.xdist_group(unit_of(item)))


# a test that may make a lab's round trip (tests/roundtrip.py) gets the round trip's time limit,
# as tests/grading/test_grading.py has: it makes it when its lab's file runs without test_grading.py
ROUND_TRIP_TESTS = ("test_solution_notebook_executes_within_budget",)
ROUND_TRIP_TIMEOUT = 900


def pytest_collection_modifyitems(config, items):
    units = {item: unit_of(item) for item in items}
    # stable: a unit's tests keep their order (test_grading.py's, which make the round trip, first)
    items.sort(key=lambda item: (-seconds_of(units[item]), units[item]))
    for item in items:
        if item.originalname in ROUND_TRIP_TESTS and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(ROUND_TRIP_TIMEOUT))
        if item.get_closest_marker("bench_report") and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(BENCH_REPORT_TIMEOUT))


# Each pytest-xdist worker runs in a cgroup node of its own (where the host gives caps and
# this is root): ``self`` holds the worker and every process it starts itself (ranks a test
# launches, chromium, torchrun), ``grading`` is the sandbox's base (DISTTRAIN_CGROUP_BASE) for
# the students it grades.  The workers have equal CPU weights, as a grading step's two sides
# do (grading/cgroups.py).  Without it, every sandboxed student of the whole run shares the
# weight of the one ``disttrain-lab`` node, which the kernel sets against each process of the
# root group alone: under the suite's load (a dozen busy processes there) graded ranks got a
# tenth of the CPU and ran past cell limits that hold on a grading host.
# A worker's node weighs as four processes of the root group (v1 weighs a node against each
# process there): a CPU-bound process beside the suite (the brief's loaded machine) then takes
# about what it took when the workers' processes were each in the root group themselves,
# instead of as much as a whole worker with its gradings.
WORKER_SHARES = 4 * 1024
_WORKER_NODE: list = []  # (the worker's cpu node, the cpu cgroup it came from)
# Where a run's CPU goes (issue 35: the suite on two cores is bound by its CPU time, not its waits): each
# worker also enters a node of its own in the cpuacct hierarchy, which every process it starts stays in (the
# sandbox moves a student's kernel in the memory, pids and cpu hierarchies only), and counts the CPU seconds
# of each unit's tests, its gradings' processes included; the workers write them to CPU_FILE, and the run
# ends with the units that took most (pytest_terminal_summary).
CPU_FILE_ENV = "DISTTRAIN_TEST_CPU_FILE"
_CPU_NODE: list = []  # the worker's cpuacct node
_CPU_BY_UNIT: dict[str, list[float]] = {}  # unit: [CPU seconds, wall seconds]


def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker and os.geteuid() == 0 and (cgroups.MOUNT / "cpuacct" / "cpuacct.usage").exists():
        fd, path = tempfile.mkstemp(prefix="disttrain-tests-cpu-", suffix=".tsv")  # (the workers inherit it)
        os.close(fd)
        os.environ[CPU_FILE_ENV] = path
    offered = cgroups.host()
    if (
        not worker
        or os.geteuid() != 0
        or cgroups.BASE_ENV in os.environ
        or offered["version"] not in ("v1", "hybrid")  # (v2: one hierarchy, the worker's memory node would move too)
        or "cpu" not in offered["caps"]
        or sandbox.caps_problem() is not None
    ):
        return
    _remove_stale_runs()
    node = f"disttrain-tests/run-{os.getppid()}/{worker}"
    came_from = next(
        line.strip().split(":", 2)[2] for line in open("/proc/self/cgroup") if "cpu" in line.split(":")[1].split(",")
    )
    own = cgroups.MOUNT / "cpu" / node / "self"
    try:
        own.mkdir(parents=True, exist_ok=True)
        (own.parent / "cpu.shares").write_text(str(WORKER_SHARES))
        (own / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        print(f"tests: worker {worker} stays in its cpu cgroup ({exc})")
        return
    os.environ[cgroups.BASE_ENV] = f"{node}/grading"
    _WORKER_NODE.append((own, came_from))
    acct = cgroups.MOUNT / "cpuacct" / node
    if os.environ.get(CPU_FILE_ENV):
        try:
            acct.mkdir(parents=True, exist_ok=True)
            (acct / "cgroup.procs").write_text(str(os.getpid()))
            _CPU_NODE.append(acct)
        except OSError as exc:
            print(f"tests: worker {worker} counts no CPU time per unit ({exc})")


def _cpu_seconds() -> float:
    return int((_CPU_NODE[0] / "cpuacct.usage").read_text()) / 1e9


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_NODE:
        yield
        return
    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    spent = _CPU_BY_UNIT.setdefault(unit_of(item), [0.0, 0.0])
    spent[0] += _cpu_seconds() - cpu
    spent[1] += time.monotonic() - wall


def pytest_terminal_summary(terminalreporter):
    path = os.environ.get(CPU_FILE_ENV)
    if os.environ.get("PYTEST_XDIST_WORKER") or not path or not os.path.exists(path):
        return
    units: dict[str, list[float]] = {}
    for line in Path(path).read_text().splitlines():
        unit, cpu, wall = line.rsplit("\t", 2)
        units.setdefault(unit, [0.0, 0.0])
        units[unit][0] += float(cpu)
        units[unit][1] += float(wall)
    os.unlink(path)
    if not units:  # (one process, no workers: nothing counted)
        return
    total = sum(cpu for cpu, _ in units.values())
    terminalreporter.write_sep("=", f"CPU seconds by unit: {total:,.0f} in all (the workers' cpuacct nodes)")
    for unit, (cpu, wall) in sorted(units.items(), key=lambda u: -u[1][0])[:25]:
        terminalreporter.write_line(f"{cpu:8.0f} s CPU {wall:8.0f} s wall  {unit}")


def _remove_stale_runs() -> None:
    """The empty nodes of earlier runs whose pytest is gone (a run killed before its workers
    left their nodes), in every hierarchy."""
    for top in cgroups.MOUNT.glob("*/disttrain-tests/run-*"):
        if Path(f"/proc/{top.name[len('run-') :]}").exists():
            continue
        for node in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
            try:
                node.rmdir()
            except OSError:
                pass


def _move_all(node: Path, to: Path) -> None:
    """The worker and what it still runs (a warm pool's ranks, ended at its exit) out of ``node``, so that the
    node is empty and goes; each process moved by itself (the worker first: raises where it cannot be)."""
    (to / "cgroup.procs").write_text(str(os.getpid()))
    for pid in (node / "cgroup.procs").read_text().split():
        try:
            (to / "cgroup.procs").write_text(pid)
        except OSError:  # (ended since)
            pass


def pytest_unconfigure(config):
    if _CPU_NODE:
        lines = "".join(f"{unit}\t{cpu:.3f}\t{wall:.3f}\n" for unit, (cpu, wall) in _CPU_BY_UNIT.items())
        with open(os.environ[CPU_FILE_ENV], "a") as f:  # (one write each: the workers' lines stay whole)
            f.write(lines)
        try:
            _move_all(_CPU_NODE[0], cgroups.MOUNT / "cpuacct")
            for empty in (_CPU_NODE[0], _CPU_NODE[0].parent, _CPU_NODE[0].parent.parent):
                empty.rmdir()
        except OSError:
            pass
    for own, came_from in _WORKER_NODE:
        try:
            _move_all(own, cgroups.MOUNT / "cpu" / came_from.lstrip("/"))
        except OSError:
            continue
        grading = cgroups.Cgroup(os.environ[cgroups.BASE_ENV])  # (its nodes in every hierarchy)
        for d in [own, *grading.dirs]:  # then those above, the run's once the last worker left
            for empty in (d, d.parent, d.parent.parent, d.parent.parent.parent):
                try:
                    empty.rmdir()
                except OSError:
                    pass


@pytest.fixture(scope="session", autouse=True)
def _shared_round_trips(tmp_path_factory):
    """Where this session's workers share the labs' round trips (tests/roundtrip.py): the
    folder above each pytest-xdist worker's own temp root (one per session)."""
    base = tmp_path_factory.getbasetemp()
    roundtrip.SHARED = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
