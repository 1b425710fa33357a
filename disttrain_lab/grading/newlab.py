"""``disttrain-lab new-lab NN_name``: the files of a new lab, in the shape every lab has.

A lab is a solution notebook (``solutions/NN_name/NN_name.ipynb``, the nbgrader source) and its
graded checks (``disttrain_lab/labtests/labNN.py``); everything else finds the lab by itself
(the release, the grader's cell times, the per-lab tests of ``tests/labs/test_labs.py``, the
README's Colab column) except the README's table of labs, whose row this command adds.  So a new
lab's hand edits touch its own files only.

The notebook has the sections every lab has, in order, each a working example the author
rewrites: the locked setup cell; the lab's title and why; an exercise (``all_sum``: every rank
ends with the sum over the ranks, with one collective), its self-check and its graded test (a
call of the check module, more cases hidden); a picture from a real run; a prediction of the
exercise's time on an emulated link (α–β ring model), its self-check of the form, the measured
time, and its graded test (the model computed in the hidden block, never in the kit).  Released
as it is, the lab grades: the blank notebook earns 0, the solution every point.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NAME = re.compile(r"(\d\d)_[a-z][a-z0-9_]*")
README_ROW = re.compile(r"^\| `\d\d_[a-z0-9_]+` \|.*\|$", re.MULTILINE)

SETUP = """# Setup: install the lab kit where it is missing (Colab), then check the machine.
DISTTRAIN_LAB_PIP = "disttrain-lab"   # where the kit comes from (a pip requirement; the instructor sets it)

import importlib.util, os, subprocess, sys
if importlib.util.find_spec("disttrain_lab") is None and subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", DISTTRAIN_LAB_PIP]).returncode:
    raise RuntimeError(
        f"The lab kit (disttrain_lab) is not installed here, and `pip install {DISTTRAIN_LAB_PIP}` failed (pip's "
        "reason is above). " + ("This lab was opened without the course's wheels/ folder beside its own folder "
        "(from GitHub in Colab, or downloaded alone): upload wheels/ next to it, or open the lab from your course's "
        "own link. " if DISTTRAIN_LAB_PIP.startswith("../") else "Can this machine reach that address (is it "
        "online)? ") + "DISTTRAIN_LAB_PIP above, set by your instructor, says where the kit comes from; run this "
        "cell again once it can be installed.")

import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import disttrain_lab as dl
from disttrain_lab import checks
from disttrain_lab.labtests import lab{number} as lab_tests   # the graded tests' checks (lab_tests.check_all_sum??)

# Under autograding (nbgrader sets NBGRADER_EXECUTION) benchmarks and plots do less work;
# graded tests never do.
FAST = bool(os.environ.get("NBGRADER_EXECUTION"))
print(dl.doctor(short=True))"""

TITLE = """# Lab {number} — {title}

What this lab teaches and why a distributed-training engineer needs it; the cost model that
predicts it (α per message, β per byte); then a picture from a real run.  (This notebook was made
by `disttrain-lab new-lab`: every section below is a working example to rewrite.)

**Time**, for someone new to the topic (a row per exercise or prediction; the claim is their sum,
which `tests/labs/test_time_budgets.py` checks):

| | part | time |
| --- | --- | --- |
| core | section 1, Exercise 1 `all_sum` | 15–20 min |
| core | Prediction 1: an all-reduce on a 1 Gbit link, then its measurement | 10–15 min |

**Core path: about 25–35 min.**"""

EXERCISE_TEXT = """## 1. Summing over the ranks

Every rank holds a tensor `x`; after an **all-reduce** every rank holds the sum over the ranks.
A ring all-reduce sends `2(N-1)/N · S` bytes per rank for a tensor of `S` bytes.

### Exercise 1: `all_sum(x)`

**Write `all_sum(x)`.**  Every rank returns the sum over all ranks of `x` (the same tensor on
every rank), with one call of `torch.distributed`.  Every rank must send its part over the network."""

SOLUTION = '''def all_sum(x: torch.Tensor) -> torch.Tensor:
    """Return the sum over all ranks of ``x``, on every rank.

        >>> dl.launch(lambda: all_sum(torch.ones(2)), 2)
        [tensor([2., 2.]), tensor([2., 2.])]
    """
    @@ BEGIN SOLUTION
    dist.all_reduce(x)
    return x
    @@ END SOLUTION'''

SELF_CHECK = """# Self-check: on 3 ranks, rank r holds r + 1; every rank should end with 1 + 2 + 3 = 6.
_run = dl.launch(lambda: all_sum(torch.full((4,), dist.get_rank() + 1.0)), 3, trace=True, timeout=20)
for _rank, _out in enumerate(_run.results):
    checks.assert_close(_out, torch.full((4,), 6.0), what=f"rank {_rank}'s sum")
print(_run.summary())
checks.passed("all_sum: every rank holds the sum")"""

TEST = """checks.verify_untampered()
lab_tests.check_all_sum(3, (4,), torch.float32)
checks.passed("all_sum gives every rank the sum over the ranks")
@@ BEGIN HIDDEN_TESTS
lab_tests.check_all_sum(2, (3, 5), torch.float64)
lab_tests.check_all_sum(4, (7,), torch.int64)
@@ END HIDDEN_TESTS"""

PICTURE_TEXT = """What an all-reduce of 1 MiB looks like on 4 ranks, from a real run: each bar is one call on
one rank."""

PICTURE = """_run = dl.launch(lambda: all_sum(torch.ones(2**18)), 4, trace=True, timeout=60)
dl.viz.timeline(_run, title="all_sum of 1 MiB on 4 ranks")
plt.show()"""

PREDICTION_TEXT = """### Prediction 1: an all-reduce on a 1 Gbit link

On an emulated 1 Gbit Ethernet (**α = 50 µs**, **1/β = 125 MB/s**), a ring all-reduce of `S` bytes on
`N` ranks takes `2(N-1)` steps of a message of `S/N` bytes: `T = 2(N-1)(α + βS/N)`.

**Predict** that time in **milliseconds** for `N = 4` and `x = torch.zeros(2**18)` (S = 1 MiB), in
`PREDICTED_ALL_SUM_MS`.  It counts when it equals the model to **three significant figures**
(1 point); the check below checks only the form and shows the value the graded test will compare
(it does not know the answer), and the cell after it measures the time."""

PREDICTION = """@@ BEGIN SOLUTION
PREDICTED_ALL_SUM_MS = 2 * 3 * (50e-6 + 2**20 / 4 / 1.25e8) * 1e3      # 2(N-1) steps of α + βS/N, in ms
@@ END SOLUTION"""

PREDICTION_CHECK = """# Self-check of the form: a number the graded test can read (it does not know the answer).
dl.predictions.check("all-reduce of 1 MiB on 4 ranks, 1 Gbit Ethernet (ms)", globals().get("PREDICTED_ALL_SUM_MS"))"""

MEASURED = """# Measured: the fastest of a few all-reduces of your all_sum on the emulated link.
ETHERNET = dl.Network.preset("1 Gbit Ethernet")

def _fastest(repeats: int) -> float:
    x = torch.zeros(2**18)
    all_sum(x)                                          # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        all_sum(x)
        best = min(best, time.perf_counter() - start)
    return best

_measured_ms = dl.launch(_fastest, 4, 2 if FAST else 5, network=ETHERNET, timeout=120)[0] * 1e3
print(f"all_sum of 1 MiB on 4 ranks over the emulated {ETHERNET.name}: {_measured_ms:.1f} ms")
dl.viz.predicted_vs_measured([("all-reduce", globals().get("PREDICTED_ALL_SUM_MS"), _measured_ms)],
                             unit="ms", title="1 MiB all-reduced on 4 ranks, 1 Gbit Ethernet")
plt.show()"""

PREDICTION_TEST = """checks.verify_untampered()
# Graded (1 point): PREDICTED_ALL_SUM_MS against the cost model of the text, computed in this cell.
@@ BEGIN HIDDEN_TESTS
_N, _alpha, _beta, _S = 4, 50e-6, 1 / 1.25e8, 2**18 * 4
_model_ms = 2 * (_N - 1) * (_alpha + _beta * _S / _N) * 1e3
dl.predictions.assert_prediction("all-reduce of 1 MiB on 4 ranks, 1 Gbit Ethernet (ms)",
                                 dl.predictions.fetch("PREDICTED_ALL_SUM_MS"), _model_ms)
checks.passed("your all-reduce time matches the ring's α–β model")
@@ END HIDDEN_TESTS"""

CHECKS = '''"""Lab {number}'s graded tests ({title}): each check runs the student's function on ranks with
``dl.exercise.run`` and compares what every rank returned with a reference computed in one process
(torch itself), and reads the bytes between the ranks as the operating system counted them."""

from __future__ import annotations

import torch

from .. import checks, exercise

__all__ = ["check_all_sum"]


def check_all_sum(n: int, shape: tuple, dtype: torch.dtype) -> None:
    """``all_sum(x)``: every rank returns the sum over the ranks of ``x``, and every rank sends its
    part over the network (the operating system's count)."""
    case = f"all_sum on {{n}} ranks ({{dtype}}, shape {{shape}})"
    xs = [checks.sample_tensor(shape, dtype, seed=rank) for rank in range(n)]
    run = exercise.run("all_sum", n, [(x.clone(),) for x in xs], timeout=30)
    expected = torch.stack(xs).sum(dim=0)  # the reference, in one process
    for rank, out in enumerate(run.results):
        checks.assert_close(out, expected, what=f"{{case}}: rank {{rank}}'s sum")
    for rank in range(n):
        assert run.traffic.sent(rank) > 0, (
            f"{{case}}: every rank should send its part to the others, but the operating system counted no "
            f"byte sent by rank {{rank}} ({{run.traffic.describe()}})"
        )
'''


def _marked(source: str) -> str:
    """``source`` with nbgrader's solution and hidden-test markers written out (``@@`` becomes three
    hashes, ``HIDDEN_TESTS`` two words): the templates above spell them so, for no file of the kit
    may hold those markers."""
    marked = source.replace("@@ BEGIN ", "### BEGIN ").replace("@@ END ", "### END ")
    return marked.replace(" HIDDEN_TESTS", " HIDDEN TESTS")


def _meta(grade_id: str, *, solution=False, grade=False, locked=False, points=None) -> dict:
    nbg = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": 3, "solution": solution}
    nbg["task"] = False
    if points is not None:
        nbg["points"] = points
    return {"nbgrader": nbg}


def notebook(name: str, title: str) -> nbformat.NotebookNode:
    """The new lab's solution notebook (see the module docstring)."""
    number = NAME.fullmatch(name)[1]
    cells = [
        new_code_cell(SETUP.replace("{number}", number), metadata=_meta("setup", locked=True)),
        new_markdown_cell(TITLE.format(number=int(number), title=title)),
        new_markdown_cell(EXERCISE_TEXT),
        new_code_cell(_marked(SOLUTION), metadata=_meta("ex_all_sum", solution=True)),
        new_code_cell(SELF_CHECK),
        new_code_cell(_marked(TEST), metadata=_meta("test_all_sum", grade=True, locked=True, points=2)),
        new_markdown_cell(PICTURE_TEXT),
        new_code_cell(PICTURE),
        new_markdown_cell(PREDICTION_TEXT),
        new_code_cell(_marked(PREDICTION), metadata=_meta("ex_predict_all_sum", solution=True)),
        new_code_cell(PREDICTION_CHECK),
        new_code_cell(MEASURED),
        new_code_cell(
            _marked(PREDICTION_TEST), metadata=_meta("test_predict_all_sum", grade=True, locked=True, points=1)
        ),
    ]
    nb = new_notebook(
        cells=cells,
        metadata={
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
    )
    for i, cell in enumerate(nb.cells):  # stable ids: the release must be deterministic
        cell.id = f"{name}-{i}"
    return nb


def readme_with_row(text: str, name: str, title: str) -> str:
    """``text`` (the README) with the new lab's row after the last lab's (the Colab column is
    written by ``release``); unchanged where the row is there already."""
    if f"| `{name}` |" in text:
        return text
    rows = list(README_ROW.finditer(text))
    if not rows:
        raise ValueError("the README has no table of labs (rows like | `01_point_to_point` | ... |)")
    last = rows[-1]
    columns = last.group(0).count("|") - 1
    row = f"| `{name}` | {title} |" + " — |" * (columns - 2)
    return text[: last.end()] + "\n" + row + text[last.end() :]


def create(root: Path, name: str, title: str) -> list[Path]:
    """Write the new lab ``name`` into the project at ``root``; the files written."""
    found = NAME.fullmatch(name)
    if not found:
        raise ValueError(
            f"a lab's name is two digits, an underscore and lower-case words, e.g. 11_checkpoints; got {name!r}"
        )
    number = found[1]
    lab_dir = root / "solutions" / name
    checks_file = root / "disttrain_lab" / "labtests" / f"lab{number}.py"
    taken = [p for p in (root / "solutions").glob(f"{number}_*") if p.is_dir()]
    if taken or checks_file.exists():
        held = ", ".join(str(p) for p in [*taken, checks_file] if p.exists())
        raise ValueError(f"lab number {number} is taken: {held}")
    lab_dir.mkdir(parents=True)
    nbformat.write(notebook(name, title), lab_dir / f"{name}.ipynb")
    checks_file.parent.mkdir(parents=True, exist_ok=True)
    checks_file.write_text(CHECKS.format(number=int(number), title=title))
    written = [lab_dir / f"{name}.ipynb", checks_file]
    readme = root / "README.md"
    if readme.exists():
        readme.write_text(readme_with_row(readme.read_text(), name, title))
        written.append(readme)
    return written


def cli_new_lab(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="disttrain-lab new-lab",
        description="Make a new lab's solution notebook, its graded checks and its README row (see "
        "disttrain_lab/grading/newlab.py); then `disttrain-lab release` makes its student notebook.",
    )
    parser.add_argument("name", help="NN_name: two digits, an underscore, lower-case words (e.g. 11_checkpoints)")
    parser.add_argument("--title", help="the lab's title (default: from its name)")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the project's folder (default: here)")
    args = parser.parse_args(argv)
    title = args.title or args.name[3:].replace("_", " ").capitalize()
    try:
        written = create(args.root, args.name, title)
    except (ValueError, OSError) as exc:
        print(f"disttrain-lab new-lab: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    print("next: write the lab, then `disttrain-lab release` (student notebook) and run its tests")
    return 0
