"""A hang under grading is reported by the launcher, and costs its time once (issue 25).

Lab 1 is graded in the grader kernel, each graded cell within its limit (max(30 s, 5 × the
solution's time), grader/cell_times/).  One submission, the solution but for three exercises:

- ``ping_pong`` deadlocks (both ranks receive first) in the graded case only: its graded cell
  must end with the launcher's own report (which rank, blocked in what, the diagnosis), not
  with the cell's limit (``KeyboardInterrupt`` from the launcher's internals, "CellTimeoutError");
- ``broadcast_linear`` never returns (an endless loop that sleeps: a hang costs the grader its wall
  time, and spinning ranks would only take the cores from the rest of the suite, #35; a spinning
  function is graded in test_grading's ``infinite_loop``): the self-check above its graded cell hangs
  first; the graded cell, and the one of ``broadcast_tree``, which calls ``broadcast_linear``, must
  fail at once, saying what happened then (which rank was in which function), instead of each
  waiting its own limit for the same spin.

The other exercises keep their points.
"""

from __future__ import annotations

import json

import pytest

from disttrain_lab import grading, wire
from disttrain_lab.grading.execute import NOTES_FILE
from tests.grading.test_grading import Course, feedback, grade_id, submit, with_solution
from tests.helpers import REPO
from tests.roundtrip import LOADED_HOST_SCALE

LAB = "01_point_to_point"
pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(wire.available() is not None, reason=str(wire.available())),
]

DEADLOCKS = """
def ping_pong(x, repeats=1):
    rank = dist.get_rank()
    for _ in range(repeats):
        if rank in (0, 1) and x.numel() == 10:   # (the graded case; the self-checks pass)
            dist.recv(x, src=1 - rank)          # both ranks receive first: nobody sends
            dist.send(x, dst=1 - rank)
        elif rank == 0:
            dist.send(x, dst=1)
            dist.recv(x, src=1)
        elif rank == 1:
            dist.recv(x, src=0)
            dist.send(x, dst=0)
    return x
"""

SPINS = """
def broadcast_linear(x, src):
    while True:
        time.sleep(0.05)
"""

CALLS_THE_SPINNER = """
def broadcast_tree(x, src):
    return broadcast_linear(x, src)
"""


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    # the cell limits a loaded host's instructor sets (cell_time_scale), as every real lab's round trip here has:
    # at scale 1 the launch gets what is left of test_ping_pong's 30 s limit but REPORT_MARGIN (4 s) to stop its
    # ranks and say why, which a full suite beside two CPU-bound processes and more ran past once (the cell's
    # CellTimeoutError, with no report); scaled, the run's own 30 s timeout ends it, as on such a host
    limits = {"cell_time_scale": LOADED_HOST_SCALE * grading.Limits().cell_time_scale}
    course = Course(tmp_path_factory.mktemp("fairness"), LAB, REPO / "solutions", limits)
    course.do_release()
    nb = with_solution(course.solution, "ex_ping_pong", DEADLOCKS)
    nb = with_solution(nb, "ex_broadcast_linear", SPINS)
    nb = with_solution(nb, "ex_broadcast_tree", CALLS_THE_SPINNER)
    submit(course.course, "hangs", LAB, nb)
    course.results = course.grade(["hangs"])
    course.table = grading.scores(LAB, course.course)
    course.page = feedback(course.course, "hangs", LAB)
    course.cells = {grade_id(c): c for c in course.autograded("hangs").cells if grade_id(c)}
    notes = course.course / "autograded" / "hangs" / LAB / NOTES_FILE
    course.seconds = json.loads(notes.read_text())["cell_seconds"]
    return course


def _errors(cell) -> str:
    return "\n".join(f"{o.ename}: {o.evalue}" for o in cell.outputs if o.output_type == "error")


@pytest.mark.slow
def test_a_deadlock_is_reported_by_the_launcher_within_the_cells_limit(graded):
    told = _errors(graded.cells["test_ping_pong"])
    assert "rank 0: recv(src=1" in told and "rank 1: recv(src=0" in told and "in ping_pong (line" in told, told
    assert "Every rank is waiting to receive" in told, told
    # the launch ends first: its own timeout, or (when the cell's limit is the shorter, as on a quiet
    # host where the limit is not scaled up for load) what was left of the cell's limit
    assert "ping_pong did not finish within" in told, told
    assert "CellTimeoutError" not in told and "KeyboardInterrupt" not in told, told
    assert "KeyboardInterrupt" not in graded.page and "CellTimeoutError" not in graded.page


@pytest.mark.slow
def test_a_function_that_hung_costs_its_time_once(graded):
    for cell in ("test_broadcast_linear", "test_broadcast_tree"):
        told = _errors(graded.cells[cell])
        assert "broadcast_linear is not run again" in told, told
        assert "running Python code" in told and "broadcast_linear (line" in told, told  # what happened then
        assert graded.seconds[cell] < 10, graded.seconds


@pytest.mark.slow
def test_only_the_broken_exercises_lose_points(graded):
    assert graded.results["hangs"].returncode == 0, graded.results["hangs"].output[-3000:]
    lost = {cell for cell, points in graded.table["hangs"].items() if cell != "total" and points == 0}
    assert lost == {"test_ping_pong", "test_broadcast_linear", "test_broadcast_tree"}, graded.table["hangs"]
