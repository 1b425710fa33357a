#!/usr/bin/env python
# Usage: PATH=.venv/bin:$PATH .venv/bin/python scripts/autograde_times.py [LAB ...]
"""Autograde time per submission per lab: the solution submitted by 3 students, each graded in
its own nbgrader process (as `disttrain-lab grade` does); median of 3."""
import statistics, sys, tempfile, shutil
from pathlib import Path
import nbformat
from tqdm import tqdm
from disttrain_lab import grading
REPO = Path(__file__).resolve().parent.parent
labs = sys.argv[1:] or grading.list_labs(REPO / "solutions")
root = Path(tempfile.mkdtemp(prefix="agtime-"))
course, release, tmp = root / "course", root / "release", root / "tmp"
tmp.mkdir(parents=True)
for lab in tqdm(labs, desc="autograde times", unit="lab"):
    grading.release([lab], course=course, source=REPO / "solutions", release_to=release, tmp_root=str(tmp))
    sol = nbformat.read(REPO / "solutions" / lab / f"{lab}.ipynb", 4)
    for s in ("s1", "s2", "s3"):
        d = course / "submitted" / s / lab; d.mkdir(parents=True, exist_ok=True)
        nbformat.write(sol, d / f"{lab}.ipynb")
    res = grading.autograde(lab, ["s1", "s2", "s3"], course=course, source=REPO / "solutions", release_from=release,
                            tmp_root=str(tmp), log=lambda *a: None)
    secs = [r.seconds for r in res.values()]
    table = grading.scores(lab, course)
    tqdm.write(f"{lab:<22} median {statistics.median(secs):6.1f} s  runs {', '.join(f'{x:.1f}' for x in secs)}  "
               f"score {table['s1']['total']:.0f}")
shutil.rmtree(root, ignore_errors=True)
