"""``disttrain-lab start``: a student's own copy of a lab, which a fixed lab never overwrites."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest

from disttrain_lab import cli
from tests.helpers import REPO

LAB = "01_point_to_point"


def start(*args: str, cwd, monkeypatch=None) -> subprocess.CompletedProcess:
    """``disttrain-lab start ARGS`` in ``cwd``: in this process (``cli.main``, what the console
    script calls) where ``monkeypatch`` is given, else as a command."""
    if monkeypatch is None:
        return subprocess.run(
            [sys.executable, "-m", "disttrain_lab", "start", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=120,
        )
    monkeypatch.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(["start", *args])
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
            if isinstance(exit.code, str):
                print(exit.code, file=sys.stderr)
    return subprocess.CompletedProcess(["disttrain-lab", "start", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture
def clone(tmp_path):
    """A kit's folder: two released labs and the wheels, as a clone has them."""
    for lab in (LAB, "02_all_reduce"):
        shutil.copytree(REPO / "labs" / lab, tmp_path / "labs" / lab)
    (tmp_path / "labs" / "wheels").mkdir()
    (tmp_path / "labs" / "wheels" / "disttrain_lab-0.1.0-py3-none-any.whl").write_bytes(b"a wheel")
    return tmp_path


def notebook(path):
    return json.loads(path.read_text())


def write(path, nb) -> None:
    path.write_text(json.dumps(nb, indent=1))


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_a_lab_is_copied_into_work_with_the_wheels_its_first_cell_installs_from(clone):
    out = start("1", cwd=clone)
    assert out.returncode == 0, out.stderr
    mine = clone / "work" / LAB / f"{LAB}.ipynb"
    assert f"started: {mine}" in out.stdout
    assert mine.read_bytes() == (clone / "labs" / LAB / f"{LAB}.ipynb").read_bytes()
    assert (clone / "work" / "wheels" / "disttrain_lab-0.1.0-py3-none-any.whl").read_bytes() == b"a wheel"
    assert not (clone / "work" / "02_all_reduce").exists()  # one lab asked for, one copied
    assert start("point_to_point", cwd=clone).stdout.startswith(f"your copy: {mine}")  # by title too


def test_a_fixed_lab_never_overwrites_the_students_work(clone, monkeypatch):
    assert start("--all", cwd=clone, monkeypatch=monkeypatch).returncode == 0
    released = clone / "labs" / LAB / f"{LAB}.ipynb"
    mine = clone / "work" / LAB / f"{LAB}.ipynb"
    theirs = clone / "work" / "02_all_reduce" / "02_all_reduce.ipynb"
    # the student works in lab 1 (and has not opened lab 2) ...
    nb = notebook(mine)
    code = next(
        c for c in nb["cells"] if c["cell_type"] == "code" and "raise NotImplementedError()" in "".join(c["source"])
    )
    code["source"] = "def ping_pong():\n    return 'my answer'\n"
    write(mine, nb)
    work = mine.read_bytes()
    # ... then both labs are fixed, and lab 1 gets a data file
    for path in (released, clone / "labs" / "02_all_reduce" / "02_all_reduce.ipynb"):
        fixed = notebook(path)
        fixed["cells"][1]["source"] = "# a corrected introduction\n"
        write(path, fixed)
    (clone / "labs" / LAB / "data.csv").write_text("x\n1\n")
    out = start("--all", cwd=clone, monkeypatch=monkeypatch)
    assert out.returncode == 0, out.stderr
    assert mine.read_bytes() == work, "the student's notebook was written over"
    beside = mine.with_name(f"{LAB}.new.ipynb")
    assert beside.read_bytes() == released.read_bytes()
    said = " ".join(out.stdout.split())
    assert f"kept your {mine}" in said and f"as {LAB}.new.ipynb" in said, said
    assert "changed: # a corrected introduction" in said, said  # which cells differ from the student's
    assert notebook(theirs)["cells"][1]["source"] == "# a corrected introduction\n"  # untouched: updated
    assert f"updated {theirs}" in said and f"added {clone / 'work' / LAB / 'data.csv'}" in said, said
    # said once: nothing new the next time
    again = start("--all", cwd=clone, monkeypatch=monkeypatch)
    assert "kept your" not in again.stdout and "updated" not in again.stdout and mine.read_bytes() == work


def test_a_copy_made_before_start_existed_is_kept_too(clone, monkeypatch):
    mine = clone / "work" / LAB / f"{LAB}.ipynb"
    mine.parent.mkdir(parents=True)
    mine.write_text('{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}')
    out = start(LAB, cwd=clone, monkeypatch=monkeypatch)
    assert out.returncode == 0 and mine.read_text().startswith('{"cells": []'), out.stdout
    assert mine.with_name(f"{LAB}.new.ipynb").exists()


def test_what_start_refuses(clone, tmp_path, monkeypatch):
    out = start("99", cwd=clone, monkeypatch=monkeypatch)
    assert out.returncode != 0 and "no lab '99'" in out.stderr and "01_point_to_point, 02_all_reduce" in out.stderr
    assert "name one lab" in start(cwd=clone, monkeypatch=monkeypatch).stderr
    assert "no folder" in start("01", "--labs", str(tmp_path / "nowhere"), cwd=clone, monkeypatch=monkeypatch).stderr


@pytest.mark.slow
def test_lab_sh_starts_every_lab_in_the_students_work_folder(tmp_path):
    # scripts/lab.sh (the README's first command): setup, `start --all`, then JupyterLab on the copies
    out = subprocess.run(
        ["bash", "scripts/lab.sh", "--version"],
        cwd=REPO,
        env={**os.environ, "WORK_ROOT": str(tmp_path / "work")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    labs = sorted(p.name for p in (REPO / "labs").iterdir() if p.name != "wheels")
    assert sorted(p.name for p in (tmp_path / "work").iterdir() if p.name != "wheels") == labs
    assert f"started: {tmp_path / 'work' / LAB / (LAB + '.ipynb')}" in out.stdout
