#!/usr/bin/env python
# Usage: PATH=.venv/bin:$PATH .venv/bin/python scripts/autograde_times.py [--sandbox off,on] [--rounds 3] [LAB ...]
"""Autograde time per submission per lab: the solution submitted by one student per round and
mode, each graded in its own nbgrader process (as `disttrain-lab grade` does); median over the
rounds.  With ``--sandbox off,on`` the modes take turns within each round (off, on, off, on, ...)
so that a change in the machine's load hits both alike; the ratio on/off is printed, with the
load average before and after."""

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("labs", nargs="*", help="labs to time (default: every lab in solutions/)")
parser.add_argument("--sandbox", default="auto", help="comma-separated modes to compare: auto, on, off")
parser.add_argument(
    "--rounds", type=int, default=3, help="gradings per lab and mode; the median is printed (default 3)"
)
args = parser.parse_args()
# after the arguments: --help answers at once, without loading nbgrader
import nbformat  # noqa: E402
from tqdm import tqdm  # noqa: E402

from disttrain_lab import grading  # noqa: E402

labs, modes = args.labs or grading.list_labs(REPO / "solutions"), args.sandbox.split(",")
root = Path(tempfile.mkdtemp(prefix="agtime-"))
course, release, tmp = root / "course", root / "release", root / "tmp"
tmp.mkdir(parents=True)
print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
for lab in tqdm(labs, desc="autograde times", unit="lab"):
    grading.release([lab], course=course, source=REPO / "solutions", release_to=release, tmp_root=str(tmp))
    sol = nbformat.read(REPO / "solutions" / lab / f"{lab}.ipynb", 4)
    secs = {mode: [] for mode in modes}
    for r in range(args.rounds):
        for mode in modes:
            student = f"s{r}_{mode}"
            d = course / "submitted" / student / lab
            d.mkdir(parents=True, exist_ok=True)
            nbformat.write(sol, d / f"{lab}.ipynb")
            [res] = grading.autograde(
                lab,
                [student],
                course=course,
                source=REPO / "solutions",
                release_from=release,
                limits=grading.Limits(sandbox=mode),
                tmp_root=str(tmp),
                log=lambda *a: None,
            ).values()
            secs[mode].append(res.seconds)
    table = grading.scores(lab, course)
    for mode in modes:
        tqdm.write(
            f"{lab:<22} sandbox={mode:<4} median {statistics.median(secs[mode]):6.1f} s  "
            f"runs {', '.join(f'{x:.1f}' for x in secs[mode])}  "
            f"scores {sorted({table[f's{r}_{mode}']['total'] for r in range(args.rounds)})}"
        )
    if len(modes) == 2:
        a, b = (statistics.median(secs[m]) for m in modes)
        tqdm.write(f"{lab:<22} {modes[1]}/{modes[0]} = {b / a:.2f}")
print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
shutil.rmtree(root, ignore_errors=True)
