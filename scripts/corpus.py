#!/usr/bin/env python
# Usage: PATH=.venv/bin:$PATH .venv/bin/python scripts/corpus.py CORPUS [--course-dir DIR] [--source DIR] [LAB ...]
"""Grade a corpus of hand-written submissions and check each one's verdict: an alternative-correct
variant earns full marks, a subtly wrong one loses the exercises it gets wrong and only those.

A corpus is kept outside the project (students must never see it): one folder per lab, one file per
variant, ``CORPUS/<lab>/<variant>.py``:

    # expect: full                      (or: # expect: below test_router test_expert_parallel)
    # why: top_k_route with argsort and a running count per expert
    # %% ex_router
    def top_k_route(logits, k, capacity_factor):
        ...

Each ``# %% <grade_id>`` line starts the source of one solution cell; the submission is the lab's
solution notebook with those cells replaced, so every other exercise is right.  ``full``: every
graded test keeps its points.  ``below T ...``: each test named loses points and every other keeps
all of its points (one mistake costs one exercise).  A variant's name (its file's stem: lower-case
letters, digits, ``_``) is its student's name.

The script releases the labs into a course folder (a new temporary one, or ``--course-dir``, where a
second run grades only the variants that changed), submits the variants, grades each lab with
``disttrain-lab grade``, reads each student's ``exports/<lab>/students/<student>.json`` and prints
one line per variant.  Exit status: 0 when every verdict is the expected one, 1 when one is not, 2
when the corpus cannot be read.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NAME = re.compile(r"[a-z0-9_]+")
EXPECT = re.compile(r"# expect: (full|below(?: \w+)+)\s*$")
CELL = re.compile(r"^# %% (\w+)\s*$", re.M)

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("corpus", type=Path, help="the corpus folder: <lab>/<variant>.py")
parser.add_argument("labs", nargs="*", help="labs to grade (default: every lab folder of the corpus)")
parser.add_argument("--course-dir", type=Path, help="the course folder to grade in (default: a new temporary one)")
parser.add_argument(
    "--source", type=Path, default=REPO / "solutions", help="the labs' source notebooks (default: solutions/)"
)
args = parser.parse_args()
# after the arguments: --help answers at once, without loading nbgrader
import json  # noqa: E402

import nbformat  # noqa: E402


def nbgrader_metadata(cell) -> dict:  # (as disttrain_lab.grading.cells has it: importing the kit imports torch)
    return cell.get("metadata", {}).get("nbgrader", {})


def grade_id(cell) -> str | None:
    return nbgrader_metadata(cell).get("grade_id")


class CorpusError(Exception):
    """A variant the script cannot read: the message says which file and why."""


def read_variant(path: Path, lab: nbformat.NotebookNode) -> tuple[str | set[str], dict[str, str]]:
    """(``"full"`` or the set of tests that must lose points, {solution grade_id: its new source})."""
    if not NAME.fullmatch(path.stem):
        raise CorpusError(f"{path}: a variant's name is its student's: lower-case letters, digits and _ only")
    text = path.read_text()
    first = text.splitlines()[0] if text else ""
    expect = EXPECT.match(first)
    if expect is None:
        raise CorpusError(f"{path}: the first line must be '# expect: full' or '# expect: below test_x ...'")
    parts = CELL.split(text)
    cells = {parts[i]: parts[i + 1].strip("\n") + "\n" for i in range(1, len(parts), 2)}
    solutions = {grade_id(c) for c in lab.cells if nbgrader_metadata(c).get("solution")}
    tests = {grade_id(c) for c in lab.cells if nbgrader_metadata(c).get("grade")}
    if not cells or set(cells) - solutions:
        raise CorpusError(f"{path}: '# %% <grade_id>' must name the lab's solution cells {sorted(solutions)}")
    verdict = expect.group(1)
    if verdict == "full":
        return "full", cells
    losing = set(verdict.split()[1:])
    if losing - tests:
        raise CorpusError(f"{path}: {sorted(losing - tests)} are not the lab's graded tests {sorted(tests)}")
    return losing, cells


def submission(lab: nbformat.NotebookNode, cells: dict[str, str]) -> nbformat.NotebookNode:
    out = nbformat.from_dict(json.loads(json.dumps(lab)))
    for cell in out.cells:
        if grade_id(cell) in cells:
            cell.source = cells[grade_id(cell)]
    return out


def judge(expected: str | set[str], tests: list[dict]) -> tuple[bool, str]:
    """Whether the graded tests match the expectation, and what they were ("test_x 0/2, ...")."""
    lost = {t["grade_id"] for t in tests if t["score"] < t["max_score"]}
    got = ", ".join(f"{t['grade_id']} {t['score']:g}/{t['max_score']:g}" for t in tests if t["grade_id"] in lost)
    want = set() if expected == "full" else expected
    return lost == want, got or "full marks"


def kit(*argv: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "disttrain_lab", *argv], capture_output=True, text=True, env=ENV, cwd=REPO
    )
    if done.returncode:
        sys.exit(
            f"disttrain-lab {' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return done


labs = args.labs or sorted(p.name for p in args.corpus.iterdir() if p.is_dir())
ENV = {**os.environ, "DISTTRAIN_SOURCE_DIR": str(args.source.resolve())}
try:
    variants = {}
    for name in labs:
        notebook = args.source / name / f"{name}.ipynb"
        if not notebook.exists():
            raise CorpusError(f"{args.corpus / name}: no lab {name} in {args.source}")
        lab = nbformat.read(notebook, 4)
        variants[name] = {p.stem: (p, *read_variant(p, lab)) for p in sorted((args.corpus / name).glob("*.py"))}
except CorpusError as e:
    print(e, file=sys.stderr)
    sys.exit(2)

# (made once the corpus is read, so that a corpus refused leaves no folder behind)
course = args.course_dir or Path(tempfile.mkdtemp(prefix="corpus-"))
print(f"course folder: {course}")
wrong = 0
for name in labs:
    lab = nbformat.read(args.source / name / f"{name}.ipynb", 4)
    if not (course / "release" / name).exists():
        kit("release", "--course-dir", str(course), name)
    for student, (_, _, cells) in variants[name].items():
        folder = course / "submitted" / student / name
        folder.mkdir(parents=True, exist_ok=True)
        nbformat.write(submission(lab, cells), folder / f"{name}.ipynb")
    kit("grade", name, "--course-dir", str(course), "--no-feedback", "--no-progress")
    for student, (path, expected, _) in variants[name].items():
        found = course / "exports" / name / "students" / f"{student}.json"
        tests = json.loads(found.read_text())["tests"] if found.exists() else []
        ok, got = judge(expected, tests) if tests else (False, "not graded")
        wrong += not ok
        want = "full marks" if expected == "full" else "loses " + ", ".join(sorted(expected))
        print(f"{'ok   ' if ok else 'WRONG'} {name}/{path.name}: expected {want}; graded {got}")
print(f"{sum(map(len, variants.values())) - wrong} of {sum(map(len, variants.values()))} variants graded as expected")
sys.exit(1 if wrong else 0)
