"""The nbgrader round trip, on every lab in solutions/ and on the fixture assignments.

For each lab: release it (and check the committed labs/ matches a fresh release), then
autograde the solution submitted as a student (full marks) and the released blank notebook
(0, no crash); on the launch fixture and the first lab also a partly done one, the blank
with its first exercise done (exactly that exercise's points), and one whose kernel dies in
its last exercise; made once per session by tests/roundtrip.py.  On the fixtures, every
broken submission the grader must survive is crafted by editing ONE exercise of a copy of
the solution notebook; that exercise loses its points, the others keep theirs, the feedback says
why, and nothing is left running or on disk (here the runs that hang, kill their kernel or exhaust
memory; the other broken submissions are test_broken_submissions.py's).  Every test runs in the
grader kernel, the student's functions on ranks of the student's kernel (``dl.exercise.run``).
"""

from __future__ import annotations

import html
import os
import signal
import subprocess
import sys
import time

import nbformat
import pytest

import disttrain_lab
from disttrain_lab import grading
from disttrain_lab.grading import classgrade, reaper, steps
from tests.helpers import REPO
from tests.notebooks import load
from tests.roundtrip import (  # noqa: F401  (other grading tests import these from here)
    FIRST_REAL_LAB,
    FIXTURE_LIMITS,
    FIXTURES,
    Course,
    all_points,
    feedback,
    grade_id,
    points_after,
    processes_with,
    round_trip,
    submit,
    with_solution,
)

HAS_LAUNCH = hasattr(disttrain_lab, "launch")

pytestmark = pytest.mark.timeout(900)

# fixtures first (fast), then every real lab
LABS = (
    [("00_basics", FIXTURES)]
    + ([("00_launch", FIXTURES)] if HAS_LAUNCH else [])
    + [(lab, REPO / "solutions") for lab in grading.list_labs(REPO / "solutions")]
)

# ----------------------------------------------------------------------------------------
# round trip on every lab


@pytest.fixture(scope="module", params=LABS, ids=[lab for lab, _ in LABS])
def released(request, tmp_path_factory):
    lab, source = request.param
    if source == FIXTURES:
        course = Course(tmp_path_factory.mktemp(lab), lab, source, FIXTURE_LIMITS)
        course.do_release()
        return course
    # a real lab's course is its round trip's (made once per session: tests/roundtrip.py)
    return round_trip(lab).course


@pytest.mark.slow
def test_release_has_no_solutions_and_is_deterministic(released):
    lab_dir = released.release / released.lab
    files = sorted(p.relative_to(lab_dir) for p in lab_dir.rglob("*") if p.is_file())
    assert all(p.suffix == ".ipynb" or p.parts[0] == "data" for p in files), files
    text = "".join(p.read_text() for p in lab_dir.rglob("*.ipynb"))
    assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    if released.source != FIXTURES and released.lab != FIRST_REAL_LAB:
        return  # a release is made the same way for every lab: byte-for-byte on the fixtures and one lab
    first = {p: p.read_bytes() for p in lab_dir.rglob("*") if p.is_file()}
    released.do_release()
    assert {p: p.read_bytes() for p in lab_dir.rglob("*") if p.is_file()} == first


@pytest.mark.slow
def test_committed_labs_match_a_fresh_release(released):
    if released.source == FIXTURES:
        pytest.skip("fixtures are not committed to labs/")
    diffs = grading.release_differences(released.release / released.lab, REPO / "labs" / released.lab)
    assert not diffs, "labs/ is stale; run `disttrain-lab release`:\n" + "\n".join(diffs)


@pytest.mark.slow
def test_round_trip_full_blank_partial(released):
    if released.lab == "00_basics":
        pytest.skip("00_basics's round trip runs in the broken batch below (honest_full, honest_blank, partial)")
    trip = round_trip(released.lab, released.source, FIXTURE_LIMITS if released.source == FIXTURES else None)
    total, kept, lost = trip.total, trip.kept, trip.lost
    assert kept and lost, f"the first or last exercise of {released.lab} has no graded test cell after it"
    results = trip.results
    assert all(r.returncode == 0 for r in results.values()), {s: r.output[-2000:] for s, r in results.items()}
    table = trip.table
    assert table["full"]["total"] == sum(total.values()), table["full"]
    assert table["blank"]["total"] == 0
    if "partial" in trip.students:  # the first exercise done only: its points, and none of the others
        assert {k: table["partial"][k] for k in total} == {k: (v if k in kept else 0.0) for k, v in total.items()}
    # the solution runs top to bottom without an error anywhere (demos and plots too) ...
    full = trip.course.autograded("full")
    failing = {
        i: o.ename
        for i, c in enumerate(full.cells)
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "error"
    }
    assert not failing, f"cells of the solution raised under autograding: {failing}"
    # ... and the blank lab fails every graded cell on the student's stub, not on something else
    # (a graded prediction left blank reads "not filled in yet" when it is a number, and fails
    # on the stub's NotImplementedError when it is a function whose body is the stub)
    for cell in trip.course.autograded("blank").cells:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade"):
            names = [o.ename + ": " + o.evalue for o in cell.outputs if o.output_type == "error"]
            stubs = ["NotImplementedError"] + (["not filled in yet"] if "dl.predictions.fetch(" in cell.source else [])
            assert names and any(stub in names[0] for stub in stubs), (grade_id(cell), names)
    if "crashed" in trip.students:  # the kernel died in the last exercise: only its points are lost
        assert {k: table["crashed"][k] for k in total} == {k: (0.0 if k in lost else v) for k, v in total.items()}
        assert "kernel died" in feedback(trip.course.course, "crashed", released.lab)
    # nothing of the course was left running or on disk when its grading ended
    assert not trip.left_processes and not trip.left_files, (trip.left_processes, trip.left_files)


# ----------------------------------------------------------------------------------------
# broken submissions (fixture 00_basics: add 1 + mean 2 + scale 1 points; mean is broken).
# Every test runs in the grader kernel and calls the student's function on a rank of the
# student's kernel (dl.exercise.run): what the function does there, the run reports.

MEAN_OK = "def mean(xs):\n    return sum(xs) / len(xs)\n"
BROKEN_MEAN = {
    # name: (solution-cell source for ex_mean, text the feedback must show)
    # (the run's timeout is capped to what is left of the test's 20 s: the launcher's report of it)
    "infinite_loop": ("def mean(xs):\n    while True:\n        pass\n", "mean did not finish within"),
    "long_sleep": ("def mean(xs):\n    time.sleep(10**6)\n", "mean did not finish within"),
    # the solution cell itself hangs, ignoring the interrupt: the kernel is restarted, mean never defined
    # (ipykernel resets the SIGINT handler before each cell, so the cell ignores it itself; it waits rather
    # than spins, as a hang costs the grader its wall time: infinite_loop is the spinning one)
    "ignores_interrupt": (
        "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    time.sleep(0.05)\n" + MEAN_OK,
        "did not stop when interrupted",
    ),
    # the student's kernel dies while the test waits for the run: the grader sees the kernel's process end
    # (a zombie counts) and says so at once, not at the cell's limit.  (A graded run's rank may not signal
    # its kernel: confine.py.  So a thread of the kernel's own kills it once a graded run has started.)
    "kills_kernel_in_test": (
        "import signal, threading\n"
        "from disttrain_lab import pool as _pool\n"
        "def _graded_run():\n"
        "    p = _pool._POOL\n"
        "    return (id(p), p.calls) if p is not None and p.confined and p.calls else None\n"
        "def _die_in_a_graded_run(before=_graded_run()):\n"
        "    while _graded_run() in (None, before):  # (until the next graded run starts)\n"
        "        time.sleep(0.01)\n"
        "    time.sleep(0.5)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "threading.Thread(target=_die_in_a_graded_run, daemon=True).start()\n"
        "def mean(xs):\n    time.sleep(30)\n",
        "the kernel died while running mean",
    ),
    "aborts_kernel_in_cell": ("os.abort()\n" + MEAN_OK, "kernel died"),
    # 1 GiB held (touched: real memory), then 8 GiB asked for at once: over the rank's data cap (the
    # kernel's, inherited), refused with a MemoryError at once
    "exhausts_memory": (
        "def mean(xs):\n    hog = [bytearray(2**30), bytearray(2**33)]\n    return len(hog)\n",
        "MemoryError",
    ),
}


@pytest.fixture(scope="module")
def broken_batch(tmp_path_factory):
    """Every broken run of mean (a hang, a dead kernel, memory) beside two honest students and a
    partial one, autograded in one batch (the other broken submissions: test_broken_submissions.py)."""
    course = Course(tmp_path_factory.mktemp("broken"), "00_basics", FIXTURES, FIXTURE_LIMITS)
    course.do_release()
    sol, lab = course.solution, course.lab
    for name, (source, _) in BROKEN_MEAN.items():
        submit(course.course, name, lab, with_solution(sol, "ex_mean", source))
    submit(course.course, "honest_full", lab, sol)
    submit(course.course, "honest_blank", lab, course.blank())
    [blank_scale] = [c.source for c in course.blank().cells if grade_id(c) == "ex_scale"]
    submit(course.course, "partial", lab, with_solution(sol, "ex_scale", blank_scale))
    # one plain `nbgrader autograde 00_basics` for the whole batch: also proves the plain path
    course.results = course.grade(one_process_per_student=False)
    course.table = grading.scores(lab, course.course)
    return course


CASES = list(BROKEN_MEAN)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_broken_exercise_loses_only_its_points(broken_batch, case):
    assert broken_batch.results[case].returncode == 0, broken_batch.results[case].output[-3000:]
    assert broken_batch.table[case] == {"test_add": 1.0, "test_mean": 0.0, "test_scale": 1.0, "total": 2.0}
    assert BROKEN_MEAN[case][1] in html.unescape(feedback(broken_batch.course, case, "00_basics"))


@pytest.mark.slow
def test_other_students_intact_and_nothing_left_behind(broken_batch):
    assert broken_batch.table["honest_full"]["total"] == 4
    assert broken_batch.table["honest_blank"]["total"] == 0
    assert broken_batch.table["partial"] == {"test_add": 1.0, "test_mean": 2.0, "test_scale": 0.0, "total": 3.0}
    assert set(broken_batch.table) == set(broken_batch.results)
    assert not processes_with(str(broken_batch.course))
    assert not list(broken_batch.tmp.iterdir())
    csv = grading.export_grades(course=broken_batch.course, tmp_root=str(broken_batch.tmp))
    rows = csv.read_text().splitlines()
    assert len(rows) == 1 + len(broken_batch.results)


# ----------------------------------------------------------------------------------------
# broken ranks (fixture 00_launch: allsum 2 + ring_next 1 + shift 1 points; allsum is broken)

ALLSUM_OK = (
    "def allsum():\n    t = torch.tensor([dist.get_rank() + 1.0])\n    dist.all_reduce(t)\n    return t.item()\n"
)
BROKEN_ALLSUM = {
    "one_rank_raises": "def allsum():\n    if dist.get_rank() == 1:\n        raise ValueError('boom')\n"
    "    return 3.0 if dist.get_world_size() == 2 else 6.0\n",
    "rank_exits": "def allsum():\n    if dist.get_rank() == 1:\n        os._exit(1)\n    return 3.0\n",
    "rank_aborts": "import os\ndef allsum():\n    if dist.get_rank() == 0:\n        os.abort()\n    return 3.0\n",
    "deadlock": "def allsum():\n    t = torch.zeros(1)\n    dist.recv(t, (dist.get_rank() + 1) % dist.get_world_size())\n"
    "    return t.item()\n",
}
# a fake all_reduce in the student's kernel: the kit refuses every launch there from then on
PATCHES_ALL_REDUCE = "def _fake(t, *a, **k):\n    t.fill_(3.0)\ndist.all_reduce = _fake\n" + ALLSUM_OK


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LAUNCH, reason="dl.launch (disttrain_lab/launcher.py) has not landed yet")
def test_broken_ranks_lose_only_that_exercise(tmp_path):
    course = Course(tmp_path, "00_launch", FIXTURES, dict(FIXTURE_LIMITS, cell_timeout=60))
    course.do_release()
    for name, source in {**BROKEN_ALLSUM, "patches_all_reduce": PATCHES_ALL_REDUCE}.items():
        submit(course.course, name, course.lab, with_solution(course.solution, "ex_allsum", source))
    submit(course.course, "honest_full", course.lab, course.solution)
    results = course.grade(one_process_per_student=False)
    table = grading.scores(course.lab, course.course)
    assert table["honest_full"]["total"] == 4
    for name in BROKEN_ALLSUM:
        assert results[name].returncode == 0, results[name].output[-3000:]
        assert table[name] == {"test_allsum": 0.0, "test_ring_next": 1.0, "test_shift": 1.0, "total": 2.0}, name
    assert results["patches_all_reduce"].returncode == 0, results["patches_all_reduce"].output[-3000:]
    assert table["patches_all_reduce"] == {"test_allsum": 0.0, "test_ring_next": 0.0, "test_shift": 0.0, "total": 0.0}
    for cell in course.autograded("patches_all_reduce").cells:
        if grade_id(cell) in ("test_allsum", "test_ring_next", "test_shift"):
            said = [o.get("evalue", "") for o in cell.outputs if o.output_type == "error"]
            assert said and "torch.distributed.all_reduce was replaced" in said[0], (grade_id(cell), said)
    assert not processes_with(str(course.course))
    assert not list(course.tmp.iterdir())


# ----------------------------------------------------------------------------------------
# the command line, and the per-student wall-clock cap


@pytest.mark.slow
def test_cli_grade_caps_a_hung_student_and_grades_the_rest(tmp_path, monkeypatch, capsys):
    course = Course(tmp_path, "00_basics", FIXTURES, None)
    course.do_release()
    # its solution cell never ends (the cell limit is 600 s below): only the per-student cap stops it.  It waits
    # rather than spins: the cap is wall-clock time, and a spin would only take a core from the rest of the suite
    # for the cap's 120 s (#35); a spinning cell is graded in test_broken_exercise_loses_only_its_points
    hung = "import time\nwhile True:\n    time.sleep(0.05)\n"
    submit(course.course, "hung", course.lab, with_solution(course.solution, "ex_mean", hung))
    submit(course.course, "honest", course.lab, course.solution)
    for name, value in {
        "DISTTRAIN_COURSE_DIR": course.course,
        "DISTTRAIN_SOURCE_DIR": FIXTURES,
        "DISTTRAIN_RELEASE_DIR": course.release,
        "TMPDIR": course.tmp,
        # the cap applies to the honest student too (two kernels: the student's and the grader's; 50 s
        # under a load of 5 on 2 cores): 120 s leaves room on a loaded machine
        "DISTTRAIN_CELL_TIMEOUT": 600,
        "DISTTRAIN_STUDENT_TIMEOUT": 120,
    }.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr("tempfile.tempdir", None)  # let tempfile see the new TMPDIR
    assert classgrade.cli_grade([course.lab]) == 0
    out = capsys.readouterr().out
    assert "STOPPED (time cap)" in out and "grading failed" in out
    table = grading.scores(course.lab, course.course)
    assert table["honest"]["total"] == 4
    assert (course.course / "grades.csv").exists()
    assert (course.course / "feedback" / "honest" / course.lab / f"{course.lab}.html").exists()
    assert not processes_with(str(course.course))
    assert not list(course.tmp.iterdir())


def _step_with_a_leftover(body: str):
    """A process like nbgrader whose child (a kernel from a failed start-up retry) inherits its stdout."""
    child = f"import subprocess, sys, time; subprocess.Popen(['sleep', '600']); print('graded', flush=True); {body}"
    return subprocess.Popen(
        [sys.executable, "-c", child],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_a_process_left_holding_nbgraders_output_does_not_hold_the_grader(monkeypatch):
    monkeypatch.setattr(steps, "PIPE_GRACE", 1.0)
    steps._become_subreaper()  # as run_nbgrader does: the leftover becomes ours
    before = set(reaper.descendants(os.getpid()))
    started = time.monotonic()
    output, timed_out = steps._wait_and_read(
        _step_with_a_leftover("sys.exit(3)"), 120, lambda: steps._reap_orphans(before)
    )
    assert time.monotonic() - started < 60  # not the step's timeout, nor the leftover's 600 s
    assert "graded" in output and not timed_out
    assert set(reaper.descendants(os.getpid())) <= before, "the leftover was not stopped"
    # a step that runs past its timeout is stopped, and what it printed is kept
    proc = _step_with_a_leftover("time.sleep(600)")
    output, timed_out = steps._wait_and_read(proc, 3, lambda: steps._reap_orphans(before))
    assert timed_out and "graded" in output and proc.returncode == -signal.SIGKILL
    steps._reap_orphans(before)  # as run_nbgrader does after every step
    assert set(reaper.descendants(os.getpid())) <= before


# ----------------------------------------------------------------------------------------
# the course's install source is stamped into every released lab


def test_install_source_is_stamped_into_the_setup_cell():
    cell = nbformat.v4.new_code_cell('DISTTRAIN_LAB_PIP = "disttrain-lab"   # set by the instructor\nimport os')
    stamp = grading.StampInstallSource(pip_requirement="disttrain-lab @ git+https://example.org/x.git")
    nb, _ = stamp(nbformat.v4.new_notebook(cells=[cell]), {})  # as nbgrader calls it
    assert nb.cells[0].source.splitlines()[0] == (
        'DISTTRAIN_LAB_PIP = "disttrain-lab @ git+https://example.org/x.git"   # set by the instructor'
    )


@pytest.mark.slow
def test_released_labs_carry_the_configured_install_source():
    from disttrain_lab.grading.install_source import stamped_requirement

    configured = stamped_requirement(grading.configured_install_source())
    for lab in sorted((REPO / "labs").glob("*/*.ipynb")):
        setup = load(lab).cells[0].source
        assert f'DISTTRAIN_LAB_PIP = "{configured}"' in setup, lab
