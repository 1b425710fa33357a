#!/usr/bin/env python
# Usage: PATH=.venv/bin:$PATH .venv/bin/python scripts/class_times.py [--students 24] [--jobs 1 2] [LAB]
"""Wall time of `disttrain-lab grade LAB --jobs N` on one class, for each N, and every score checked.

The class (in a scratch course): a quarter honest (the solution), a quarter blank (the released
lab), a quarter partly done (the last exercise left blank) and a quarter broken (the kernel killed
in the last exercise, the last exercise spinning forever, a file that is not JSON).  Each N grades
the whole class again (--force); the load average is printed before and after each run, since a
shared machine's load changes the figures."""

import argparse
import copy
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def grade_id(cell):
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def with_solution(nb, exercise, source):
    nb = copy.deepcopy(nb)
    [cell] = [c for c in nb.cells if grade_id(c) == exercise]
    cell.source = source
    return nb


def spinning(source: str) -> str:
    """Code that makes every function ``source`` defines spin forever when called (as a student's
    infinite loop does: each graded cell calling it waits for its limit)."""
    import ast

    names = [node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)]
    return "\n\ndef _spin(*args, **kwargs):\n    while True:\n        pass\n" + "".join(f"{n} = _spin\n" for n in names)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "lab", nargs="?", default="01_point_to_point", help="the lab the class submits (default %(default)s)"
    )
    parser.add_argument(
        "--students", type=int, default=24, help="the class's size, a quarter of each kind (default %(default)s)"
    )
    parser.add_argument(
        "--jobs", type=int, nargs="+", default=[1, 2], help="each N to grade the class with, `--jobs N` (default: 1 2)"
    )
    args = parser.parse_args()
    # after the arguments: --help answers at once, without loading nbgrader
    import nbformat

    from disttrain_lab import grading

    lab = args.lab
    root = Path(tempfile.mkdtemp(prefix="class-times-"))
    course, release, tmp = root / "course", root / "release", root / "tmp"
    tmp.mkdir(parents=True)
    grading.release([lab], course=course, source=REPO / "solutions", release_to=release, tmp_root=str(tmp))
    sol = nbformat.read(REPO / "solutions" / lab / f"{lab}.ipynb", 4)
    blank = nbformat.read(release / lab / f"{lab}.ipynb", 4)
    points = {
        grade_id(c): float(c.metadata.nbgrader["points"])
        for c in sol.cells
        if c.get("metadata", {}).get("nbgrader", {}).get("grade")
    }
    solutions = [grade_id(c) for c in sol.cells if c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    last = solutions[-1]
    [blank_last] = [c.source for c in blank.cells if grade_id(c) == last]
    [sol_last] = [c.source for c in sol.cells if grade_id(c) == last]
    # the points of the last exercise: its graded cells, up to the next solution cell
    lost, inside = set(), False
    for cell in sol.cells:
        nbg = cell.get("metadata", {}).get("nbgrader", {})
        if nbg.get("solution"):
            inside = nbg.get("grade_id") == last
        elif inside and nbg.get("grade"):
            lost.add(nbg["grade_id"])
    total, partial = sum(points.values()), sum(v for k, v in points.items() if k not in lost)
    kinds = [
        ("honest", sol, total),
        ("blank", blank, 0.0),
        ("partial", with_solution(sol, last, blank_last), partial),
        ("killed", with_solution(sol, last, "__import__('os')._exit(1)\n" + sol_last), partial),
        ("spinning", with_solution(sol, last, sol_last + spinning(sol_last)), partial),
        ("notjson", b"{ this is not a notebook", 0.0),
    ]
    expected = {}
    for i in range(args.students):
        name, content, score = kinds[[0, 1, 2, 3 + (i // 4) % 3][i % 4]]
        student = f"s{i:02d}-{name}"
        folder = course / "submitted" / student / lab
        folder.mkdir(parents=True)
        if isinstance(content, bytes):
            (folder / f"{lab}.ipynb").write_bytes(content)
        else:
            nbformat.write(content, folder / f"{lab}.ipynb")
        expected[student] = score
    env = dict(
        os.environ,
        DISTTRAIN_COURSE_DIR=str(course),
        DISTTRAIN_SOURCE_DIR=str(REPO / "solutions"),
        DISTTRAIN_RELEASE_DIR=str(release),
        TMPDIR=str(tmp),
    )
    print(f"{lab}: {args.students} students ({', '.join(k for k, _, _ in kinds)}), {os.cpu_count()} cores", flush=True)
    wall = {}
    for jobs in args.jobs:
        load = os.getloadavg()
        start = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "disttrain_lab.cli",
                "grade",
                lab,
                "--jobs",
                str(jobs),
                "--force",
                "--no-feedback",
                "--no-progress",
            ],
            env=env,
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        wall[jobs] = time.monotonic() - start
        table = grading.scores(lab, course)
        wrong = {
            s: (table.get(s, {}).get("total"), e) for s, e in expected.items() if table.get(s, {}).get("total") != e
        }
        print(
            f"--jobs {jobs}: {wall[jobs]:6.0f} s wall, rc={proc.returncode}, load average before "
            f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, after {os.getloadavg()[0]:.1f}; scores "
            + ("all as expected" if not wrong else f"WRONG (got, expected): {wrong}"),
            flush=True,
        )
        if proc.returncode or wrong:
            print(proc.stdout[-4000:], proc.stderr[-4000:])
    base = wall[args.jobs[0]]
    print("wall time ratio: " + ", ".join(f"--jobs {j}: {wall[j] / base:.2f}" for j in args.jobs))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
