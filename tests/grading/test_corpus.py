"""scripts/corpus.py (#41): a corpus of hand-written submissions, kept outside the project, graded by the
real grader (`disttrain-lab release` and `grade` into a course folder), each variant's verdict checked
against its expectation: an alternative-correct variant earns full marks, a subtly wrong one loses its
own exercise and nothing else.  On the fixture lab 00_basics, two variants; then the wrong one
labelled as correct, graded again in the same course folder (only the changed file's expectation, so
nothing is graded twice), fails the run and names the variant."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.helpers import run_python
from tests.notebooks import REPO

SCRIPT = REPO / "scripts" / "corpus.py"
SOURCE = REPO / "tests" / "fixtures" / "source"

RIGHT = """# expect: full
# why: the mean through the standard library, not a sum and a division
# %% ex_mean
import statistics

def mean(xs):
    return statistics.fmean(xs)
"""
WRONG = """# expect: below test_mean
# why: integer division: right on the visible case (mean([1, 2, 3]) == 2), wrong on [1, 2]
# %% ex_mean
def mean(xs):
    return sum(xs) // len(xs)
"""


def _corpus(tmp_path, wrong_expectation: str):
    corpus = tmp_path / "corpus" / "00_basics"
    corpus.mkdir(parents=True, exist_ok=True)
    (corpus / "mean_fmean.py").write_text(RIGHT)
    (corpus / "mean_floor.py").write_text(WRONG.replace("# expect: below test_mean", wrong_expectation))
    return corpus.parent


def _run(tmp_path, corpus):
    course = tmp_path / "course"
    return run_python(
        [str(SCRIPT), str(corpus), "--source", str(SOURCE), "--course-dir", str(course)], timeout=600, cwd=REPO
    )


@pytest.mark.slow
def test_the_corpus_grades_each_variant_as_expected_and_fails_a_wrong_expectation(tmp_path):
    done = _run(tmp_path, _corpus(tmp_path, "# expect: below test_mean"))
    assert done.returncode == 0, done.stdout
    assert "ok    00_basics/mean_fmean.py: expected full marks; graded full marks" in done.stdout, done.stdout
    assert "ok    00_basics/mean_floor.py: expected loses test_mean; graded test_mean 0/2" in done.stdout, done.stdout
    assert "2 of 2 variants graded as expected" in done.stdout

    again = _run(tmp_path, _corpus(tmp_path, "# expect: full"))  # the floor division called correct
    assert again.returncode == 1, again.stdout
    assert "WRONG 00_basics/mean_floor.py: expected full marks; graded test_mean 0/2" in again.stdout, again.stdout
    assert "1 of 2 variants graded as expected" in again.stdout


@pytest.mark.slow  # (the corpus command in a process of its own: 9 s here)
def test_an_unreadable_variant_is_refused_before_anything_is_graded(tmp_path):
    before = set(Path(tempfile.gettempdir()).glob("corpus-*"))
    corpus = tmp_path / "corpus" / "00_basics"
    corpus.mkdir(parents=True)
    (corpus / "no_expectation.py").write_text("# %% ex_mean\ndef mean(xs):\n    return 0\n")
    done = run_python([str(SCRIPT), str(corpus.parent), "--source", str(SOURCE)], timeout=120, cwd=REPO)
    assert done.returncode == 2 and "no_expectation.py: the first line must be '# expect: full'" in done.stdout
    (corpus / "no_expectation.py").write_text(
        "# expect: below test_nothing\n# %% ex_mean\ndef mean(xs):\n    return 0\n"
    )
    done = run_python([str(SCRIPT), str(corpus.parent), "--source", str(SOURCE)], timeout=120, cwd=REPO)
    assert done.returncode == 2 and "['test_nothing'] are not the lab's graded tests" in done.stdout, done.stdout
    assert "course folder" not in done.stdout  # nothing released, nothing graded
    assert set(Path(tempfile.gettempdir()).glob("corpus-*")) == before  # and no course folder left behind
