"""Time on task (#41): the student's kernel records when each cell first ran and first passed
(disttrain_lab/worktime.py), and the class report turns the submissions' records into time per
exercise (disttrain_lab/grading/time_on_task.py)."""

from __future__ import annotations

import json
import os
import time

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from rich.console import Console

from disttrain_lab import worktime
from disttrain_lab.grading import time_on_task
from tests.notebooks import REPO

LAB = "01_point_to_point"
SOURCE = nbformat.read(REPO / "solutions" / LAB / f"{LAB}.ipynb", as_version=4)


def _record(tmp_path, student: str, cells: dict) -> None:
    folder = tmp_path / "submitted" / student / LAB
    folder.mkdir(parents=True)
    (folder / worktime.FILE).write_text(json.dumps({"version": 1, "cells": cells}))


def test_the_class_report_gives_each_exercise_its_students_times(tmp_path):
    exercises = time_on_task.exercise_cells(SOURCE)
    first, (ids, ends) = next(iter(exercises.items()))
    assert ends and set(ends) <= set(ids), (first, ids, ends)
    start = 1_800_000_000.0
    # four students on the first exercise: 10, 20, 30 and 40 minutes from its first cell to the self-check
    for k, minutes in enumerate((10, 20, 30, 40)):
        _record(
            tmp_path,
            f"s{k}",
            {ids[0]: {"first_run": start}, ends[0]: {"first_run": start + 60, "first_ok": start + 60 * minutes}},
        )
    # one whose record makes no sense (its self-check passed before anything ran), one with junk, one never passing
    _record(tmp_path, "late", {ids[0]: {"first_run": start + 9999}, ends[0]: {"first_ok": 2.0}})
    _record(tmp_path, "junk", {ids[0]: {"first_run": "yesterday"}, "x" * 99: {"first_run": 1.0}, ends[0]: [1, 2]})
    (tmp_path / "submitted" / "junk" / LAB / worktime.FILE).write_text("{not json")
    _record(tmp_path, "stuck", {ids[0]: {"first_run": start}, ends[0]: {"first_run": start + 5}})
    found = time_on_task.class_times(tmp_path, LAB, SOURCE)
    assert sorted(found[first]) == [600.0, 1200.0, 1800.0, 2400.0], found[first]
    assert all(not seconds for exercise, seconds in found.items() if exercise != first)
    console = Console(width=200, record=True)
    console.print(time_on_task.table(found, students=7))
    shown = console.export_text()
    assert "4 / 7" in shown and "25 min" in shown and "18 min – 32 min" in shown, shown


def test_an_exercise_graded_by_two_cells_is_one_exercise():
    lab = nbformat.read(REPO / "solutions" / "09_memory" / "09_memory.ipynb", as_version=4)
    found = time_on_task.exercise_cells(lab)
    graded = {
        c.id
        for c in lab.cells
        if c.metadata.get("nbgrader", {}).get("grade_id") in ("test_offload", "test_offload_overlap")
    }
    [both] = [name for name, (ids, _) in found.items() if graded <= set(ids)]
    assert "offload" in both.lower() or "Exercise 6" in both, both


def test_a_record_is_read_as_untrusted_data(tmp_path):
    path = tmp_path / worktime.FILE
    path.write_text(
        json.dumps({"cells": {"ok": {"first_run": 5, "first_ok": 7, "extra": 1}, "bad": {"first_run": -1}}})
    )
    assert worktime.read(path) == {"ok": {"first_run": 5.0, "first_ok": 7.0}}
    path.write_bytes(b"x" * (worktime.MAX_BYTES + 1))
    assert worktime.read(path) == {}


def test_nothing_is_recorded_under_autograding_or_outside_a_notebook(monkeypatch):
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    assert worktime.install() is False
    monkeypatch.delenv("NBGRADER_EXECUTION")
    assert worktime.install() is False  # (pytest: no notebook kernel)


def _run(client, code: str, cell_id: str | None) -> str:
    """One execute_request as JupyterLab sends it (the cell's id in its metadata); its status."""
    msg = client.session.msg("execute_request", {"code": code, "silent": False, "store_history": True})
    if cell_id is not None:
        msg["metadata"]["cellId"] = cell_id
    client.shell_channel.send(msg)
    while True:
        reply = client.get_shell_msg(timeout=120)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            return reply["content"]["status"]


@pytest.mark.slow  # a real kernel that imports torch: a few seconds
def test_a_notebook_kernel_records_each_cells_first_run_and_first_pass(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("NBGRADER_EXECUTION", "DISTTRAIN_NO_TIMES")}
    manager = KernelManager(kernel_name="python3")  # (ipykernel's own spec: this interpreter)
    manager.start_kernel(cwd=str(tmp_path), env=env)
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        assert _run(client, "import disttrain_lab as dl", "setup") == "ok"
        assert _run(client, "1 / 0", "exercise") == "error"
        time.sleep(0.05)
        assert _run(client, "x = 1", "exercise") == "ok"  # fixed: its first pass comes later than its first run
        assert _run(client, "y = 2", None) == "ok"  # a front end that sends no id: nothing recorded
        assert _run(client, "1 / 0", "setup") == "error"  # a later failure changes nothing
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    record = worktime.read(tmp_path / worktime.FILE)
    assert set(record) == {"setup", "exercise"}, record
    assert record["setup"]["first_run"] <= record["setup"]["first_ok"] <= record["exercise"]["first_run"]
    assert record["exercise"]["first_ok"] - record["exercise"]["first_run"] >= 0.05, record
