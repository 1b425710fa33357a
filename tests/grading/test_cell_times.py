"""Per-cell time limits from the solution's own cell times (disttrain_lab/grading/cell_times.py).

The rule (``FACTOR`` times the solution's seconds, at least ``FLOOR``, times the scale), and a
graded submission whose function spins: it waits the limit its solution's time gives, not the
plain cell limit.
"""

from __future__ import annotations

import json

import pytest

from disttrain_lab import grading
from disttrain_lab.grading import cell_times
from disttrain_lab.grading.course import measure_cell_times
from disttrain_lab.grading.execute import NOTES_FILE
from tests.grading.test_grading import FIXTURE_LIMITS, FIXTURES, Course, grade_id, submit, with_solution

pytestmark = pytest.mark.timeout(1500)


def test_cell_limits_are_factor_times_the_solution_with_a_floor(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTTRAIN_CELL_TIMES_DIR", str(tmp_path))
    assert cell_times.limits_for("lab") == {}  # never timed: the plain cell limit applies
    cell_times.record("lab", {"quick": 0.5, "slow": 30.0}, 0.1)
    assert cell_times.limits_for("lab") == {"quick": cell_times.FLOOR, "slow": cell_times.FACTOR * 30}
    assert cell_times.limits_for("lab", scale=2) == {"quick": 2 * cell_times.FLOOR, "slow": 2 * cell_times.FACTOR * 30}


def test_a_slower_or_busier_host_stretches_the_limits_by_its_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTTRAIN_CELL_TIMES_DIR", str(tmp_path))
    # never timed: against the kit's reference machine
    assert cell_times.host_factor("lab", cell_times.REFERENCE_PROBE)[0] == 1.0
    factor, said = cell_times.host_factor("lab", 3 * cell_times.REFERENCE_PROBE)
    assert factor == pytest.approx(3.0) and "no probe recorded" in said
    here = cell_times.probe()
    assert 0 < here < 10  # (about 0.1 s on a laptop)
    record = cell_times.record("lab", {"quick": 0.5, "slow": 30.0}, here)
    assert json.loads(record.read_text())["probe"] == round(here, 4)
    kept = round(here, 4)
    for now, factor in ((kept * 2, 2.0), (kept / 3, 1.0), (kept * 100, cell_times.HOST_MAX)):
        got, said = cell_times.host_factor("lab", now)
        assert got == pytest.approx(factor) and f"{kept:.3f} s where the times were recorded" in said
    # what the grader does with it: the limits of a host twice as slow are twice as long
    factor, _ = cell_times.host_factor("lab", kept * 2)
    assert cell_times.limits_for("lab", factor) == {"quick": 2 * cell_times.FLOOR, "slow": 2 * cell_times.FACTOR * 30}
    # a record from before the probe (no "probe" field): no stretch
    record.write_text(json.dumps({"lab": "lab", "cells": {"quick": 0.5}}))
    assert cell_times.host_factor("lab", cell_times.REFERENCE_PROBE * 2)[0] == pytest.approx(2.0)


@pytest.mark.slow
def test_a_spinning_submission_waits_the_limit_from_the_solution_times(tmp_path, monkeypatch):
    # the fixture lab: its solution timed once (as `disttrain-lab release --time-cells` does)
    monkeypatch.setenv("DISTTRAIN_CELL_TIMES_DIR", str(tmp_path / "times"))
    course = Course(
        tmp_path / "c",
        "00_basics",
        FIXTURES,
        dict(FIXTURE_LIMITS, cell_timeout=600, notebook_timeout=900, student_timeout=900),
    )
    seconds, probe = measure_cell_times("00_basics", source=FIXTURES, tmp_root=str(course.tmp))
    assert {"test_add", "test_mean", "test_scale"} <= seconds.keys() and probe > 0
    cell_times.record("00_basics", seconds, probe)
    assert cell_times.limits_for("00_basics")["ex_mean"] < 600
    course.do_release()
    # its solution cell never ends before it defines mean() (a test cannot hang: it runs in the grader
    # kernel, and a run of mean() that hangs ends at the run's own timeout); it waits rather than spins:
    # the limit is wall-clock time, and a spin would take a core from the rest of the suite (#35)
    spins = "import time\nwhile True:\n    time.sleep(0.05)\ndef mean(xs):\n    return sum(xs) / len(xs)\n"
    submit(course.course, "spinner", course.lab, with_solution(course.solution, "ex_mean", spins))
    result = course.grade(["spinner"])["spinner"]
    assert result.returncode == 0, result.output[-3000:]
    assert grading.scores(course.lab, course.course)["spinner"] == {
        "test_add": 1.0,
        "test_mean": 0.0,
        "test_scale": 1.0,
        "total": 2.0,
    }
    # the limit the grader gave: the record's, stretched by this host's probe at grading time
    notes = json.loads((course.course / "autograded" / "spinner" / course.lab / NOTES_FILE).read_text())
    assert 1 <= notes["cell_limit_factor"] <= cell_times.HOST_MAX, notes
    limit = cell_times.limits_for("00_basics", notes["cell_limit_factor"])["ex_mean"]
    [cell] = [c for c in course.autograded("spinner").cells if grade_id(c) == "ex_mean"]
    text = "".join(o.get("evalue", "") + "".join(o.get("traceback", [])) for o in cell.outputs)
    assert f"longer than the {limit} s allowed" in text, text  # not the 600 s cell limit
    assert limit - 1 <= notes["cell_seconds"]["ex_mean"] < limit + 60, (limit, notes["cell_seconds"])
    [test] = [c for c in course.autograded("spinner").cells if grade_id(c) == "test_mean"]
    assert [o.evalue for o in test.outputs if o.output_type == "error"] == [
        "there is no function named 'mean' in the notebook: run the cell that defines it"
    ]
    assert not list(course.tmp.iterdir())
