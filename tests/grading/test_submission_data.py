"""A test scores only by running and passing, and the submission folder is data (issue 24,
classes 3 and 4).

3. Test cells are the release's and the gradebook's as a whole: source, points and all
   metadata (a ``skip-execution`` tag made nbclient skip a wrong test, which then counted
   as passed); a test with no reply from the kernel scores 0; an ``execute_result`` never
   counts as partial credit (text counted as full marks, a number as that many points).
4. Only the notebook reaches grading, read as a regular file and never through a symbolic
   link: a linked notebook or folder is graded as the blank lab with a note; links to the
   gradebook, a hidden test or a root-only file, a pipe, a ``disttrain_lab/`` or ``torch/``
   package in the folder are listed in the grade report and never copied or read.

One batch (fixture 00_basics: add 1 + mean 2 + scale 1 points) grades every crafted
submission with an honest classmate, whose notebook one attacker links to.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import nbformat
import pytest
from nbgrader.utils import determine_grade

from disttrain_lab import grading
from disttrain_lab.grading import intake, ledger, sandbox, verdict
from tests.grading.test_grading import (
    FIXTURE_LIMITS,
    FIXTURES,
    Course,
    feedback,
    grade_id,
    processes_with,
    submit,
    with_solution,
)

CAN_SANDBOX = sandbox.problem() is None
LIMITS = dict(FIXTURE_LIMITS, sandbox="on" if CAN_SANDBOX else "off")
LAB = "00_basics"
ROOT_ONLY = "h24-root-only-" + os.urandom(6).hex()  # in a 0600 file of root's, outside the course

pytestmark = pytest.mark.timeout(900)

WRONG_MEAN = "def mean(xs):\n    return 0\n"
MEAN_OK = "def mean(xs):\n    return sum(xs) / len(xs)\n"


def _displays(value: str, source: str) -> str:
    # the student's mean() sends an execute_result of its own choosing (IPython's display
    # hook) before the test's assertion fails: nbgrader read the first one as the grade
    return source + f"import sys\n_mean = mean\ndef mean(xs):\n    sys.displayhook({value})\n    return _mean(xs)\n"


# what the kernel would find in its working directory if a link were followed or the folder copied
PROBE = (
    "import os\n"
    "_seen = {}\n"
    "for _n in ('gradebook.db', 'hidden.txt', 'secret.txt'):\n"
    "    try:\n"
    "        with open(_n, 'rb') as _f:\n"
    "            _seen[_n] = _f.read(100000)\n"
    "    except OSError:\n"
    "        pass\n"
    "print('here:', sorted(os.listdir('.')))\n"
    "for _n, _b in _seen.items():\n"
    "    print(_n, _b.decode('utf-8', 'replace'))\n"
    "def mean(xs):\n"
    "    return sum(xs) / len(xs) if _seen else 0\n"
)
SHADOW = (
    "import importlib\n"
    "_fake = [m for m in ('disttrain_lab', 'torch') if getattr(importlib.import_module(m), 'FAKE', False)]\n"
    "print('shadowed:', _fake)\n"
    "def mean(xs):\n"
    "    return sum(xs) / len(xs) if _fake else 0\n"
)

# each student's mean() cell, and the score each deserves: (test_mean, total)
DESERVED = {
    "a_honest": (2.0, 4.0),
    "s3_skip_tag": (0.0, 2.0),  # + test_mean tagged skip-execution
    "s3_metadata": (0.0, 2.0),  # + test_mean's (and a locked cell's) metadata rewritten
    "s3_result_text": (0.0, 2.0),
    "s3_result_number": (0.0, 2.0),
    "s3_result_zero_but_right": (2.0, 4.0),  # a right mean() that displays 0 keeps its points
    "s4_linked_notebook": (0.0, 0.0),  # the notebook is a link to a_honest's
    "s4_linked_folder": (0.0, 0.0),  # the lab folder is a link to a_honest's
    "s4_links": (0.0, 2.0),  # links to the gradebook, a hidden test, a root-only file; a pipe
    "s4_shadow": (0.0, 2.0),  # disttrain_lab/ and torch/ packages beside the notebook
}
SOURCES = {
    "s3_skip_tag": WRONG_MEAN,
    "s3_metadata": WRONG_MEAN,
    "s3_result_text": _displays("'all tests passed'", WRONG_MEAN),
    "s3_result_number": _displays("2.0", WRONG_MEAN),
    "s3_result_zero_but_right": _displays("0", MEAN_OK),
    "s4_links": PROBE,
    "s4_shadow": SHADOW,
}
TAMPERED_TAGS = ["skip-execution", "raises-exception"]


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _tamper(nb, test_id: str, **changes) -> None:
    [cell] = [c for c in nb.cells if grade_id(c) == test_id]
    cell.metadata.update(copy.deepcopy(changes))


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    course = Course(tmp_path_factory.mktemp("subdata"), LAB, FIXTURES, LIMITS)
    course.do_release()
    sol, submitted = course.solution, course.course / "submitted"
    for name, source in SOURCES.items():
        nb = with_solution(sol, "ex_mean", source)
        if name == "s3_skip_tag":
            _tamper(nb, "test_mean", tags=["skip-execution"])
        elif name == "s3_metadata":
            _tamper(
                nb,
                "test_mean",
                tags=TAMPERED_TAGS,
                editable=True,
                jupyter={"source_hidden": True},
            )
            [meta] = [c.metadata for c in nb.cells if grade_id(c) == "test_mean"]
            meta.nbgrader["points"] = 20
            _tamper(nb, "intro", tags=["skip-execution"], deletable=True)
        submit(course.course, name, LAB, nb)
    submit(course.course, "a_honest", LAB, sol)
    (submitted / "a_honest" / LAB / "timestamp.txt").write_text("2024-05-01 12:00:00.000000 UTC")
    # 4: a notebook, and a whole lab folder, that are links to the classmate's
    (submitted / "s4_linked_notebook" / LAB).mkdir(parents=True)
    (submitted / "s4_linked_notebook" / LAB / f"{LAB}.ipynb").symlink_to(f"../../a_honest/{LAB}/{LAB}.ipynb")
    (submitted / "s4_linked_folder").mkdir()
    (submitted / "s4_linked_folder" / LAB).symlink_to(f"../a_honest/{LAB}")
    # links to what the grading account can read and the student cannot, and a pipe
    secret = course.root / "root-only.txt"
    secret.write_text(ROOT_ONLY)
    secret.chmod(0o600)
    links = submitted / "s4_links" / LAB
    (links / "gradebook.db").symlink_to(course.course / "gradebook.db")
    (links / "hidden.txt").symlink_to(FIXTURES / LAB / f"{LAB}.ipynb")  # the source: hidden tests
    (links / "secret.txt").symlink_to(secret)
    os.mkfifo(links / "pipe")
    # packages that would shadow the kit and torch if they reached the kernel's folder
    for package in ("disttrain_lab", "torch"):
        (submitted / "s4_shadow" / LAB / package).mkdir()
        (submitted / "s4_shadow" / LAB / package / "__init__.py").write_text("FAKE = True\n")
    course.honest_digest = _tree_digest(submitted / "a_honest")
    course.results = course.grade(one_process_per_student=False)
    course.table = grading.scores(LAB, course.course)
    course.report = (course.course / "reports" / f"{LAB}.txt").read_text()
    return course


def _block(report: str, student: str) -> str:
    """The report's lines for ``student``: its own line and the indented ones below it."""
    lines = report.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{student}:"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i].startswith(" ")), len(lines))
    return "\n".join(lines[start:end])


@pytest.mark.slow
@pytest.mark.parametrize("student", sorted(DESERVED))
def test_each_gets_exactly_its_deserved_score(graded, student):
    assert graded.results[student].returncode == 0, graded.results[student].output[-3000:]
    mean, total = DESERVED[student]
    others = 0.0 if total == 0 else 1.0
    assert graded.table[student] == {"test_add": others, "test_mean": mean, "test_scale": others, "total": total}


@pytest.mark.slow
def test_test_cells_are_the_releases_whole(graded):
    from nbgrader.api import Gradebook

    def comparable(metadata, checksum):
        # the checksum is the gradebook's (of the source, hidden tests included), not the release's
        metadata = copy.deepcopy({k: v for k, v in metadata.items() if k != "execution"})
        assert metadata["nbgrader"].pop("checksum") == checksum
        return metadata

    released = {grade_id(c): c.metadata for c in graded.blank().cells}
    with Gradebook(f"sqlite:///{graded.course / 'gradebook.db'}") as gb:
        genuine = {name: gb.find_source_cell(name, LAB, LAB).checksum for name in ("test_mean", "intro")}
        assert gb.find_grade("test_mean", LAB, LAB, "s3_metadata").max_score == 2.0
    for student in ("s3_skip_tag", "s3_metadata"):
        cells = {grade_id(c): c for c in graded.autograded(student).cells}
        for name, checksum in genuine.items():
            assert comparable(cells[name].metadata, checksum) == comparable(
                released[name], released[name].nbgrader["checksum"]
            ), (student, name)
        # the restored test ran (and failed on the student's mean) instead of being skipped
        assert "mean([1, 2, 3]) should be 2" in feedback(graded.course, student, LAB)


@pytest.mark.slow
def test_what_a_students_function_displays_never_reaches_a_test(graded):
    # the test runs in the grader kernel; mean() runs on a rank of the student's kernel, so what it
    # displays stays there (a test's own execute_result is shown, not counted: the fast test below)
    for student in ("s3_result_text", "s3_result_number", "s3_result_zero_but_right"):
        [cell] = [c for c in graded.autograded(student).cells if grade_id(c) == "test_mean"]
        kinds = [o.output_type for o in cell.outputs]
        assert "execute_result" not in kinds and "display_data" not in kinds, (student, kinds)
        assert "all tests passed" not in json.dumps(cell.outputs)
        said = [(o.ename, o.evalue) for o in cell.outputs if o.output_type == "error"]
        wrong = student != "s3_result_zero_but_right"
        assert said == ([("AssertionError", "mean([1, 2, 3]) should be 2")] if wrong else []), (student, said)


@pytest.mark.slow
def test_a_linked_notebook_or_folder_is_graded_blank_with_a_note(graded):
    for student, why in (
        ("s4_linked_notebook", "is a symbolic link, not a file"),
        ("s4_linked_folder", "is in a submission folder that is a symbolic link"),
    ):
        page = feedback(graded.course, student, LAB)
        assert "Grading note" in page and why in page, student
        autograded = nbformat.writes(graded.autograded(student))
        assert "return sum(xs) / len(xs)" not in autograded  # nothing of the classmate's work
        assert f"notebook: {why}" in _block(graded.report, student)


@pytest.mark.slow
def test_nothing_from_the_folder_reaches_the_kernel_or_leaks(graded):
    course = graded.course
    for student in ("s4_links", "s4_shadow"):
        folder = course / "autograded" / student / LAB
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [f"{LAB}.ipynb"], student
    [probe] = [c for c in graded.autograded("s4_links").cells if grade_id(c) == "ex_mean"]
    printed = "".join(o.get("text", "") for o in probe.outputs)
    assert f"here: ['{LAB}.ipynb']" in printed, printed  # the kernel's folder held the notebook only
    assert "shadowed: []" in "".join(
        o.get("text", "") for c in graded.autograded("s4_shadow").cells for o in c.get("outputs", [])
    )
    seen = [
        nbformat.writes(graded.autograded("s4_links")),
        feedback(course, "s4_links", LAB),
        graded.report,
        *[p.read_text(errors="replace") for p in (course / "feedback").rglob("*") if p.is_file()],
    ]
    for text in seen:
        assert ROOT_ONLY not in text and "SQLite format 3" not in text
    assert "BEGIN HIDDEN TESTS" not in feedback(course, "s4_links", LAB)
    assert not [p for p in (course / "autograded").rglob("*") if p.is_symlink() or p.name in ("pipe", "secret.txt")]
    assert not [p for p in (course / "feedback").rglob("*") if p.name in ("gradebook.db", "hidden.txt", "torch")]


@pytest.mark.slow
def test_the_report_lists_what_was_not_taken(graded):
    links, shadow = _block(graded.report, "s4_links"), _block(graded.report, "s4_shadow")
    for line in (
        f"gradebook.db: a symbolic link to {graded.course / 'gradebook.db'}",
        "hidden.txt: a symbolic link to",
        "secret.txt: a symbolic link to",
        "pipe: a named pipe",
    ):
        assert f"not taken (never copied or read): {line}" in links, links
    assert "disttrain_lab: a folder of 1 entry" in shadow and "torch: a folder of 1 entry" in shadow
    assert "nothing flagged" in _block(graded.report, "a_honest")  # its timestamp.txt is nbgrader's own
    assert "nothing flagged" not in links


@pytest.mark.slow
def test_the_classmate_and_the_host_are_untouched(graded):
    assert _tree_digest(graded.course / "submitted" / "a_honest") == graded.honest_digest
    assert (graded.root / "root-only.txt").read_text() == ROOT_ONLY
    assert not processes_with(str(graded.course))
    assert not list(graded.tmp.iterdir())  # the staged copies went with their step


def _lab_source(root: Path, tests: dict[str, str], setup: str = "import disttrain_lab as dl") -> Path:
    """A course's source folder holding lab ``t_lab``: a locked set-up cell ``setup`` and the test cells
    ``tests`` (grade_id: source)."""
    nbg = {"grade": False, "grade_id": "setup", "locked": True, "solution": False, "schema_version": 3}
    cells = [nbformat.v4.new_code_cell(setup, metadata={"nbgrader": nbg})]
    for name, source in tests.items():
        nbg = {"grade": True, "grade_id": name, "locked": True, "points": 1, "solution": False, "schema_version": 3}
        cells.append(nbformat.v4.new_code_cell(source, metadata={"nbgrader": nbg}))
    (root / "t_lab").mkdir(parents=True)
    nbformat.write(nbformat.v4.new_notebook(cells=cells), root / "t_lab" / "t_lab.ipynb")
    return root


def _test_cell(name: str, source: str, **metadata):
    nbg = {"grade": True, "grade_id": name, "locked": True, "points": 1, "solution": False}
    return nbformat.v4.new_code_cell(source, metadata={"nbgrader": nbg, **metadata})


def _execute(tmp_path: Path, nb, lab: str | None):
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    resources = {"metadata": {"path": str(work)}}
    if lab is not None:
        resources["nbgrader"] = {"assignment": lab, "notebook": lab}
    nb, _ = grading.RobustExecute(timeout=60, startup_timeout=60).preprocess(nb, resources)
    notes = json.loads((work / grading.NOTES_FILE).read_text())["notes"]
    return nb, notes


@pytest.mark.slow
def test_every_test_runs_as_the_release_has_it_in_the_grader_kernel(tmp_path, monkeypatch):
    marker = tmp_path / "ran-in-a-kernel"
    # the grader kernel ran the release's locked set-up, and holds nothing of the student's cells
    where = "assert dl.__name__ == 'disttrain_lab' and 'STUDENT_WAS_HERE' not in globals(), 'in the student kernel'"
    tests = {"t_skipped": "assert False", "t_edited": 'assert False, "the release\'s own test"', "t_where": where}
    monkeypatch.setenv("DISTTRAIN_SOURCE_DIR", str(_lab_source(tmp_path / "source", tests)))
    setup = nbformat.v4.new_code_cell("import disttrain_lab as dl")
    setup.metadata["nbgrader"] = {"grade": False, "grade_id": "setup", "locked": True, "solution": False}
    nb = nbformat.v4.new_notebook(
        cells=[
            setup,
            nbformat.v4.new_code_cell("STUDENT_WAS_HERE = True"),
            # defence in depth behind the restore: nbclient skips a tagged cell and sends nothing
            _test_cell("t_skipped", "assert False", tags=["skip-execution"]),
            # the submission's copy of a test is never what runs
            _test_cell("t_edited", "assert True"),
            _test_cell("t_where", "assert True"),
            # a test the release does not have: never run, in either kernel
            _test_cell("t_unknown", f"open({str(marker)!r}, 'w').close()"),
        ]
    )
    nb, notes = _execute(tmp_path, nb, "t_lab")
    assert nb.cells[1].execution_count == 2 and nb.cells[1].outputs == []  # the student's own cell ran
    cells = {c.metadata.nbgrader["grade_id"]: c for c in nb.cells[2:]}
    assert [(o.ename, o.evalue) for o in cells["t_skipped"].outputs] == [
        ("GradingError", "the grader kernel never ran this test (no reply came), so it cannot have passed")
    ]
    assert cells["t_edited"].source == 'assert False, "the release\'s own test"'
    assert [(o.ename, o.evalue) for o in cells["t_edited"].outputs if o.output_type == "error"] == [
        ("AssertionError", "the release's own test")
    ]
    assert cells["t_where"].source == where and cells["t_where"].outputs == []
    assert [(o.ename, o.evalue) for o in cells["t_unknown"].outputs] == [
        (
            "GradingError",
            "this test could not be graded: lab t_lab's release has no test named 't_unknown'. A test runs only "
            "as the lab's release has it, so it scores 0; please tell your instructor",
        )
    ]
    assert [determine_grade(cells[t]) for t in ("t_skipped", "t_edited", "t_where", "t_unknown")] == [
        (0, 1.0),
        (0, 1.0),
        (1.0, 1.0),
        (0, 1.0),
    ]
    assert not marker.exists()
    assert notes == [
        "t_edited: the submission's copy differs from the release's; the release's ran",
        "t_where: the submission's copy differs from the release's; the release's ran",
        "t_unknown: not graded (scored 0): lab t_lab's release has no test named 't_unknown'",
    ]


@pytest.mark.slow
def test_a_grader_kernel_that_dies_while_it_starts_is_started_again(tmp_path, monkeypatch):
    """A kernel can die while it starts for reasons of the host's (CI saw one die under load); the
    grader kernel is started again, as the student's is, and the test is graded.  Its release's
    set-up kills the grader kernel's first start only (the student's copy of that cell differs)."""
    first = tmp_path / "died-once"
    setup = (
        "import os, pathlib\n"
        f"if not pathlib.Path({str(first)!r}).exists():\n"
        f"    pathlib.Path({str(first)!r}).touch(); os._exit(3)\n"
        "import disttrain_lab as dl\n"
    )
    monkeypatch.setenv(
        "DISTTRAIN_SOURCE_DIR", str(_lab_source(tmp_path / "source", {"t": "assert dl.__name__"}, setup))
    )
    setup_cell = nbformat.v4.new_code_cell("import disttrain_lab as dl")
    setup_cell.metadata["nbgrader"] = {"grade": False, "grade_id": "setup", "locked": True, "solution": False}
    nb, notes = _execute(
        tmp_path, nbformat.v4.new_notebook(cells=[setup_cell, _test_cell("t", "assert dl.__name__")]), "t_lab"
    )
    assert first.exists()
    assert nb.cells[1].outputs == [] and determine_grade(nb.cells[1]) == (1.0, 1.0)
    assert notes == [
        "the grader's own kernel died while it started (the lab's locked cells; exit code 3); attempt 1 of 3"
    ]


@pytest.mark.slow
def test_a_test_the_grader_has_no_release_of_fails_closed(tmp_path, monkeypatch):
    marker = tmp_path / "ran-in-a-kernel"
    monkeypatch.setenv("DISTTRAIN_SOURCE_DIR", str(tmp_path / "empty-source"))
    cells = [nbformat.v4.new_code_cell("x = 1"), _test_cell("t", f"open({str(marker)!r}, 'w').close()")]
    for lab, why in (
        ("t_lab", "the grader has no release copy of lab t_lab's tests (its source notebook is not in the course)"),
        (None, "the grader was not told which lab this notebook belongs to, so it has no release copy of its tests"),
    ):
        nb, notes = _execute(tmp_path, nbformat.v4.new_notebook(cells=copy.deepcopy(cells)), lab)
        assert [(o.ename, o.evalue) for o in nb.cells[1].outputs] == [
            (
                "GradingError",
                f"this test could not be graded: {why}. A test runs only as the lab's release has it, so it "
                "scores 0; please tell your instructor",
            )
        ]
        assert determine_grade(nb.cells[1]) == (0, 1.0)
        assert nb.cells[0].execution_count == 1  # the student's cells ran
        assert notes == [f"t: not graded (scored 0): {why}"]
    assert not marker.exists()


# ----------------------------------------------------------------------------------------
# fast: the rules, no grading run


def test_a_test_runs_only_as_the_release_has_it():
    from disttrain_lab.grading.grader_kernel import runs_as_release

    release = "assert f(1) == 1\n### BEGIN HIDDEN TESTS\nassert f(2) == 2\n### END HIDDEN TESTS"
    assert runs_as_release(release, release)
    # nbgrader's note atop a test cell it put back: whole comment lines, the release's code below them
    note = "# This cell (id:t) was missing from the submission. It was added back by nbgrader.\n\n"
    assert runs_as_release(note + release, release)
    for edited in (
        "# note" + release,  # the release's first line turned into a comment
        "f = lambda x: x\n" + release,  # code before it
        release + "\nassert True",  # or after it
        "assert True",
        "",
    ):
        assert not runs_as_release(edited, release), edited


def test_a_test_cells_execute_result_is_shown_not_counted():
    def cell(*outputs, test=True):
        nbg = {"grade": True, "grade_id": "t", "points": 2, "solution": not test, "locked": test}
        return nbformat.v4.new_code_cell("x", metadata={"nbgrader": nbg}, outputs=list(outputs))

    def result(text):
        return nbformat.v4.new_output("execute_result", data={"text/plain": text}, execution_count=1)

    error = nbformat.v4.new_output("error", ename="AssertionError", evalue="", traceback=[])
    step = verdict.ScoreByPassing()
    for outputs, points in (((result("'passed'"), error), 0), ((result("0"),), 2.0), ((result("1e9"),), 2.0)):
        graded, _ = step.preprocess_cell(cell(*outputs), {}, 0)
        assert determine_grade(graded)[0] == points, outputs
        assert [o.output_type for o in graded.outputs][:1] == ["display_data"]
    solution, _ = step.preprocess_cell(cell(result("1"), test=False), {}, 0)
    assert solution.outputs[0].output_type == "execute_result"  # only graded tests


def _folder(tmp_path: Path, student: str = "s") -> Path:
    folder = tmp_path / "submitted" / student / "lab"
    folder.mkdir(parents=True)
    return folder


def test_the_notebook_is_read_only_as_a_regular_file(tmp_path):
    honest = _folder(tmp_path, "honest")
    (honest / "lab.ipynb").write_bytes(b"{}")
    assert intake.read_notebook(honest / "lab.ipynb") == b"{}"
    cases = {
        "link": ("is a symbolic link", lambda p: p.symlink_to(honest / "lab.ipynb")),
        "pipe": ("is a named pipe", lambda p: os.mkfifo(p)),  # (and the read does not wait on it)
        "folder": ("is a folder", lambda p: p.mkdir()),
        "big": ("more than the 0 MB allowed", lambda p: p.write_bytes(b"x" * 100)),
    }
    for student, (why, make) in cases.items():
        make(_folder(tmp_path, student) / "lab.ipynb")
        with pytest.raises(intake.Refused, match=why):
            intake.read_notebook(tmp_path / "submitted" / student / "lab" / "lab.ipynb", limit=10)
    (tmp_path / "submitted" / "linked").mkdir()
    (tmp_path / "submitted" / "linked" / "lab").symlink_to(honest)
    with pytest.raises(intake.Refused, match="submission folder that is a symbolic link"):
        intake.read_notebook(tmp_path / "submitted" / "linked" / "lab" / "lab.ipynb")


def test_staging_takes_the_notebook_and_nbgraders_own_two_files_only(tmp_path):
    folder = _folder(tmp_path, "alice")
    (folder / "lab.ipynb").write_bytes(b"{}")
    (folder / "timestamp.txt").write_text("2024-05-01 12:00:00 UTC")
    (folder / "submission_secret.txt").write_text("ab" * 64)  # `nbgrader submit`'s; release_feedback needs it
    (folder / "torch").mkdir()
    (folder / "torch" / "__init__.py").write_text("")
    (folder / "leak.txt").symlink_to("/etc/shadow")
    os.mkfifo(folder / "pipe")
    (_folder(tmp_path, "bob") / "lab.ipynb").symlink_to(folder / "lab.ipynb")
    into = intake.stage(tmp_path / "submitted", ["alice", "bob"], "lab", tmp_path / "staged")
    staged = into / "alice" / "lab"
    assert sorted(p.name for p in staged.iterdir()) == ["lab.ipynb", "submission_secret.txt", "timestamp.txt"]
    assert (staged / "submission_secret.txt").read_text() == "ab" * 64
    assert sorted(p.name for p in (into / "bob" / "lab").iterdir()) == [intake.REFUSED_NOTE, "lab.ipynb"]
    assert not [p for p in into.rglob("*") if p.is_symlink()]
    with pytest.raises(intake.Refused, match="is a symbolic link"):  # what nbgrader's reader then says
        intake.read_notebook(into / "bob" / "lab" / "lab.ipynb")
    assert intake.extras(folder / "lab.ipynb") == [
        "leak.txt: a symbolic link to /etc/shadow",
        "pipe: a named pipe",
        "torch: a folder of 1 entry",
    ]


def test_the_resume_digest_never_follows_a_link(tmp_path):
    course, source = tmp_path, tmp_path / "source"
    honest = _folder(tmp_path, "honest")
    (honest / "lab.ipynb").write_text("one")
    linked = _folder(tmp_path, "linked")
    (linked / "lab.ipynb").symlink_to(honest / "lab.ipynb")
    os.mkfifo(linked / "pipe")  # (reading it would wait forever)
    (linked / "big").symlink_to("/dev/zero")

    def digests():
        return [ledger.submission_digest(course, s, "lab", source) for s in ("honest", "linked")]

    before = digests()
    (honest / "lab.ipynb").write_text("two")
    (linked / "extra.txt").write_text("not graded, so not in the digest")
    after = digests()
    assert after[0] != before[0] and after[1] == before[1]


def test_plain_nbgrader_is_told_the_staged_folder(tmp_path):
    # the per-student step passes nbgrader the staged folder, never submitted/ itself
    folder = _folder(tmp_path / "course", "alice")
    (folder / "lab.ipynb").write_bytes(b"{}")
    seen = {}

    def fake_run(args, **kw):
        step = tmp_path / "step"
        seen["args"] = args + kw["prepare"](step)
        seen["staged"] = sorted(str(p.relative_to(step)) for p in step.rglob("*"))
        return grading.StepResult(args, 0, "", 0.0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grading.course, "run_nbgrader", fake_run)
        mp.setattr(grading.course, "_ensure_in_gradebook", lambda *a: None)
        mp.setattr(grading.course, "grade_report", lambda *a: tmp_path / "report.txt")
        grading.autograde("lab", ["alice"], course=tmp_path / "course", limits=grading.Limits(sandbox="off"))
    assert f"--CourseDirectory.submitted_directory={tmp_path / 'step' / 'submitted'}" in seen["args"]
    assert seen["staged"] == ["submitted", "submitted/alice", "submitted/alice/lab", "submitted/alice/lab/lab.ipynb"]
