"""Where a release goes and where a released lab installs the kit from: with a course folder
the release (labs and wheel) goes there and the kit's checkout stays as it was; the install
source is refused while unset; a fresh kernel that has only torch and ipykernel (Colab, as a
new user meets it) installs the kit and runs a lab."""

from __future__ import annotations

import ast
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbgrader.api import Gradebook
from traitlets.config.loader import PyFileConfigLoader

from disttrain_lab import __version__, grading
from disttrain_lab.grading import readme_labs, releasing
from disttrain_lab.grading.install_source import (
    WHEELS,
    InstallSourceError,
    build_wheel,
    colab_url,
    stamped_requirement,
    wheel_contents,
    wheel_name,
)
from tests.freshenv import fresh_venv, installed
from tests.notebooks import REPO, load, nbgrader_meta, solution_notebook

WHEEL = wheel_name(__version__)


@pytest.mark.parametrize(
    "source, stamped",
    [
        ("wheel", f"../wheels/{WHEEL}"),
        (
            "wheel:https://raw.githubusercontent.com/uni/dl-course/main/labs/wheels/",
            f"disttrain-lab @ https://raw.githubusercontent.com/uni/dl-course/main/labs/wheels/{WHEEL}",
        ),
        ("git+https://github.com/uni/dl-course@v2", "disttrain-lab @ git+https://github.com/uni/dl-course@v2"),
        (
            "disttrain-lab @ git+https://github.com/uni/dl-course",
            "disttrain-lab @ git+https://github.com/uni/dl-course",
        ),
        (f"https://example.org/k/{WHEEL}", f"disttrain-lab @ https://example.org/k/{WHEEL}"),
    ],
)
def test_each_install_source_stamps_what_pip_installs(source, stamped):
    assert stamped_requirement(source) == stamped


@pytest.mark.parametrize(
    "source, fragment",
    [
        ("", "no install source for the labs' setup cell is set"),
        ("disttrain-lab", "no package of that name is published"),
        ("disttrain-lab @ git+https://github.com/YOUR-ORG/disttrain-lab", "placeholder"),
        ("wheel:raw.githubusercontent.com/x", "after 'wheel:' comes the URL"),
        ("numpy", "is not one the labs can install from"),
    ],
)
def test_unusable_install_sources_are_refused_saying_what_to_set(source, fragment):
    with pytest.raises(InstallSourceError) as err:
        stamped_requirement(source)
    assert fragment in str(err.value)
    if "placeholder" not in fragment and "wheel:" not in fragment:
        assert "c.StampInstallSource.pip_requirement" in str(err.value) and "'wheel'" in str(err.value)


@pytest.mark.parametrize(
    "source, url",
    [
        (
            "wheel:https://raw.githubusercontent.com/uni/dl-course/main/labs/wheels",
            "https://colab.research.google.com/github/uni/dl-course/blob/main/labs/01_point_to_point/01_point_to_point.ipynb",
        ),
        (
            "wheel:https://raw.githubusercontent.com/uni/dl-course/fall-26/course/release/wheels/",
            "https://colab.research.google.com/github/uni/dl-course/blob/fall-26/course/release/01_point_to_point/01_point_to_point.ipynb",
        ),
        (
            "wheel:https://raw.githubusercontent.com/uni/dl-course/main/wheels",
            "https://colab.research.google.com/github/uni/dl-course/blob/main/01_point_to_point/01_point_to_point.ipynb",
        ),
        ("wheel", None),  # the labs' address is not known: no badge
        ("wheel:https://example.org/labs/wheels", None),
        ("git+https://github.com/uni/dl-course@v2", None),
    ],
)
def test_colab_opens_a_lab_beside_the_wheels_folder_its_source_names(source, url):
    assert colab_url(source, "01_point_to_point") == url


def test_the_readmes_lab_table_has_a_colab_cell_per_lab_that_the_release_writes():
    text = (REPO / "README.md").read_text()
    assert readme_labs.labs_listed(text) == releasing.list_labs()  # a row for every lab, in order
    configured = grading.configured_install_source()
    assert readme_labs.with_badges(text, configured) == text, "README.md's Colab column: run `disttrain-lab release`"
    published = readme_labs.with_badges(text, "wheel:https://raw.githubusercontent.com/uni/dl-course/main/labs/wheels")
    assert readme_labs.labs_listed(published) == releasing.list_labs()
    for lab in releasing.list_labs():
        assert (
            f"| [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
            f"(https://colab.research.google.com/github/uni/dl-course/blob/main/labs/{lab}/{lab}.ipynb) |\n"
        ) in published, lab
    assert readme_labs.with_badges(published, "wheel") == readme_labs.with_badges(text, "wheel")  # and back
    assert published.replace("\n", "").count("|") == text.replace("\n", "").count("|")  # only the last cells


@pytest.mark.slow
def test_a_release_published_on_github_begins_each_lab_with_its_open_in_colab_badge(tmp_path, capsys):
    lab, dl101 = "01_point_to_point", tmp_path / "dl101"
    source = "wheel:https://raw.githubusercontent.com/uni/dl-course/main/release/wheels"
    url = "https://colab.research.google.com/github/uni/dl-course/blob/main/release/01_point_to_point/01_point_to_point.ipynb"
    title = nbformat.read(solution_notebook(lab), as_version=4).cells[1].source
    for _ in range(2):  # released again: one badge, not two
        assert grading.cli_release(["--course-dir", str(dl101), "--install-source", source, lab]) == 0
        assert f"  Open in Colab: {url}" in capsys.readouterr().out
        first = next(
            c
            for c in nbformat.read(dl101 / "release" / lab / f"{lab}.ipynb", as_version=4).cells
            if c.cell_type == "markdown"
        )
        assert (
            first.source
            == f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})\n\n{title}"
        )
    assert grading.cli_release(["--course-dir", str(dl101), "--install-source", "wheel", lab]) == 0
    assert "Open in Colab" not in capsys.readouterr().out  # a release for a Hub or a laptop: no badge
    first = next(
        c
        for c in nbformat.read(dl101 / "release" / lab / f"{lab}.ipynb", as_version=4).cells
        if c.cell_type == "markdown"
    )
    assert first.source == title


def test_release_never_writes_over_a_students_work_in_the_release_folder(tmp_path, capsys):
    """A student who opened the release folder's lab and ran it (JupyterLab autosaves the outputs), or left a
    file of their own there: the release refuses, names each file and what to do, and writes nothing."""
    lab, dl101 = "01_point_to_point", tmp_path / "dl101"
    shutil.copytree(REPO / "labs" / lab, dl101 / "release" / lab)
    notebook = dl101 / "release" / lab / f"{lab}.ipynb"
    worked = nbformat.read(notebook, as_version=4)
    first = next(c for c in worked.cells if nbgrader_meta(c).get("solution"))
    first.source += "\n# my answer"
    first.execution_count = 3
    first.outputs = [nbformat.v4.new_output("stream", name="stdout", text="it works\n")]
    nbformat.write(worked, notebook)
    (dl101 / "release" / lab / ".ipynb_checkpoints").mkdir()  # JupyterLab's own: nobody's work
    (dl101 / "release" / lab / ".ipynb_checkpoints" / f"{lab}-checkpoint.ipynb").write_text("{}")
    (dl101 / "release" / lab / "notes.md").write_text("mine")
    before = {p: p.read_bytes() for p in (dl101 / "release").rglob("*") if p.is_file()}

    assert grading.cli_release(["--course-dir", str(dl101), "--install-source", "wheel", lab]) == 2
    said = capsys.readouterr().err
    assert "the release would write over work in" in said and "disttrain-lab start NN" in said, said
    assert f"  {notebook}\n" in said and f"  {dl101 / 'release' / lab / 'notes.md'}\n" in said, said
    assert "checkpoint" not in said, said
    assert {p: p.read_bytes() for p in (dl101 / "release").rglob("*") if p.is_file()} == before
    assert not (dl101 / "release" / WHEELS).exists()  # refused before anything was written

    # a lab nobody ran (the release's own files) is not work
    shutil.copy2(REPO / "labs" / lab / f"{lab}.ipynb", notebook)
    (dl101 / "release" / lab / "notes.md").unlink()
    assert releasing.worked_on(dl101 / "release" / lab, REPO / "solutions" / lab) == []


def test_release_refuses_the_placeholder_before_writing_anything(tmp_path, capsys):
    with pytest.raises(InstallSourceError, match="no package of that name is published"):
        grading.release(
            ["01_point_to_point"],
            course=tmp_path / "course",
            release_to=tmp_path / "labs",
            install_source="disttrain-lab",
        )
    assert not (tmp_path / "labs").exists()
    code = grading.cli_release(["--install-source", "disttrain-lab", "01_point_to_point"])
    assert code == 2 and "c.StampInstallSource.pip_requirement" in capsys.readouterr().err


def test_the_committed_config_sets_a_source_that_installs():
    requirement = stamped_requirement(grading.configured_install_source())  # raises if it is the placeholder
    if requirement.startswith("../"):
        # "wheel": the wheel the release puts beside the labs, found from a lab's folder (labs/NN_name/)
        assert requirement == f"../{WHEELS}/{wheel_name()}", requirement
        assert (REPO / "labs" / WHEELS / wheel_name()).is_file(), f"labs/{WHEELS}/{wheel_name()} is not released"
    else:  # a URL pip installs the kit from, with the example's placeholder filled in
        assert requirement.startswith("disttrain-lab @ "), requirement
        assert "YOUR-ORG" not in requirement and "/ORG/" not in requirement, requirement


# ----------------------------------------------------------------------------------------
# A course folder is the instructor's, the kit's checkout is not

FOLDER_VARIABLES = ("DISTTRAIN_COURSE_DIR", "DISTTRAIN_RELEASE_DIR", "DISTTRAIN_SOURCE_DIR")


def test_a_release_goes_to_the_course_folder_and_only_without_one_to_labs(tmp_path, monkeypatch):
    for name in FOLDER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    tmp_path = tmp_path.resolve()
    labs = (REPO / "labs").resolve()
    assert releasing.release_folder() == labs  # the maintainer, regenerating what the repository ships
    assert releasing.release_folder(tmp_path / "dl101") == tmp_path / "dl101" / "release"  # --course-dir
    monkeypatch.setenv("DISTTRAIN_COURSE_DIR", str(tmp_path / "env"))
    assert releasing.release_folder() == tmp_path / "env" / "release"
    # `disttrain-lab grade` grades against the course's own release once one was written, else labs/
    assert releasing.graded_release() == labs
    (tmp_path / "env" / "release").mkdir(parents=True)
    assert releasing.graded_release() == tmp_path / "env" / "release"
    assert releasing.graded_release(tmp_path / "dl101") == labs
    monkeypatch.setenv("DISTTRAIN_RELEASE_DIR", str(tmp_path / "elsewhere"))  # wins over both
    assert releasing.release_folder(tmp_path / "dl101") == releasing.graded_release() == tmp_path / "elsewhere"


def _nbgrader_release_directory(env: dict[str, str], monkeypatch) -> Path:
    """The release directory that grader/nbgrader_config.py gives every nbgrader step under ``env``."""
    for name in FOLDER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in {"DISTTRAIN_SANDBOX": "off", "DISTTRAIN_SANDBOX_WARNED": "1", **env}.items():
        monkeypatch.setenv(name, value)  # (the wiring only: no host check, no warning)
    config = PyFileConfigLoader("nbgrader_config.py", path=str(REPO / "grader")).load_config()
    return Path(config.CourseDirectory.release_directory)


def test_plain_nbgrader_uses_the_course_folders_release_and_labs_only_without_one(tmp_path, monkeypatch):
    dl101 = (tmp_path / "dl101").resolve()
    assert _nbgrader_release_directory({}, monkeypatch) == REPO / "labs"
    assert _nbgrader_release_directory({"DISTTRAIN_COURSE_DIR": str(dl101)}, monkeypatch) == dl101 / "release"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def _checkout_copy(into: Path) -> Path:
    """The kit's checkout as it is now (its files that git tracks or would), committed in a fresh
    repository at ``into``: a clean checkout that no one else edits while the test runs."""
    for name in _git(REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0"):
        if name and (REPO / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, into / name)
    _git(into, "init", "-q")
    _git(into, "add", "-A")
    _git(into, "commit", "-q", "-m", "checkout")
    return into


def _written_since(folder: Path, start: float) -> list[str]:
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if not {".git", "__pycache__"} & set(p.relative_to(folder).parts) and p.is_file() and p.stat().st_mtime >= start
    )


def _install_part(setup_cell: str) -> str:
    """The setup cell's first statements, up to its `if` that pip-installs DISTTRAIN_LAB_PIP (the rest needs torch)."""
    body = ast.parse(setup_cell).body
    end = next(
        n for n in body if isinstance(n, ast.If) and "DISTTRAIN_LAB_PIP" in ast.get_source_segment(setup_cell, n)
    )
    return "\n".join(setup_cell.splitlines()[: end.end_lineno])


@pytest.mark.slow
def test_a_release_with_a_course_folder_writes_only_there_and_its_lab_installs_from_its_wheel(tmp_path):
    lab, dl101 = "01_point_to_point", (tmp_path / "dl101").resolve()
    checkout = _checkout_copy((tmp_path / "checkout").resolve())
    assert _git(checkout, "status", "--porcelain", "--untracked-files=all") == ""
    env = {k: v for k, v in os.environ.items() if k not in FOLDER_VARIABLES}
    start = time.time()
    out = subprocess.run(  # the command an instructor types, run by that checkout's kit
        [
            sys.executable,
            "-m",
            "disttrain_lab.cli",
            "release",
            lab,
            "--course-dir",
            str(dl101),
            "--install-source",
            "wheel",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=checkout,
        env={**env, "PYTHONPATH": str(checkout), "TMPDIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"released {lab} -> {dl101 / 'release' / lab}" in out.stdout, out.stdout

    # the checkout: clean, and not a file of it rewritten as it was (bytecode aside)
    assert _git(checkout, "status", "--porcelain", "--untracked-files=all") == ""
    assert _written_since(checkout, start) == []

    # the course folder: nbgrader's layout, the lab and the wheel beside it, the lab in the gradebook
    released = dl101 / "release"
    assert sorted(p.name for p in released.iterdir()) == [lab, WHEELS]
    assert [p.name for p in (released / WHEELS).iterdir()] == [wheel_name()]
    assert wheel_contents(released / WHEELS / wheel_name()) == wheel_contents(build_wheel(checkout))
    with Gradebook(f"sqlite:///{dl101 / 'gradebook.db'}") as gb:
        assert [n.name for n in gb.find_assignment(lab).notebooks] == [lab]

    # its setup cell, run from the lab's folder in a fresh kernel without the kit, installs that wheel
    setup = nbformat.read(released / lab / f"{lab}.ipynb", as_version=4).cells[0].source
    assert f'DISTTRAIN_LAB_PIP = "../{WHEELS}/{wheel_name()}"' in setup, setup
    python = fresh_venv(tmp_path / "venv", ["cloudpickle", "numpy", "matplotlib", "ipywidgets", "tqdm"])
    assert "disttrain-lab" not in installed(python)
    clean = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    ran = subprocess.run(
        [str(python), "-c", _install_part(setup)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=released / lab,
        env={**clean, "PIP_NO_INDEX": "1"},  # the wheel and what is installed: nothing from the network
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    version, location = installed(python)["disttrain-lab"]
    assert version == __version__ and Path(location).resolve().is_relative_to((tmp_path / "venv").resolve())


# ----------------------------------------------------------------------------------------
# A fresh kernel (only torch and ipykernel) runs a released lab's setup cell and first exercise


def _serve(folder: Path) -> http.server.ThreadingHTTPServer:
    """A web server for ``folder`` on a free port (as raw.githubusercontent.com serves labs/)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _solution_source(source: str) -> str:
    return "\n".join(l for l in source.splitlines() if l.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))


# what Colab's runtime has imported before the first cell runs, and must keep: its widgets are 7.x
COLAB_IPYWIDGETS = "7.7.1"
WIDGETS_CELL = """
# every widget of the kit, on this runtime's ipywidgets: tqdm's bar (the benchmarks') and lab 2's slider
import ipywidgets
from disttrain_lab.bench.command import progress

def _swap(numel):
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    mine, theirs = torch.full((numel,), float(rank)), torch.empty(numel)
    with dl.region("reduce-scatter", step=0, send=rank, recv=peer):
        receiving = dist.irecv(theirs, src=peer)
        dist.isend(mine, dst=peer).wait()
        receiving.wait()

print("ipywidgets", ipywidgets.__version__, "bar:", sum(progress(range(3), desc="three")))
dl.viz.ring_steps_slider(dl.launch(_swap, 2, 16, trace=True))
"""


@pytest.mark.slow
@pytest.mark.timeout(900)  # (54 s quiet; past the suite's 300 s once beside two CPU-bound processes: a venv, two pip
# installs and a lab's ranks, each process a fifth of a core; pip's and the cells' own limits are 900 s)
def test_a_lab_opened_alone_in_a_colab_like_runtime_installs_the_kit_and_runs_to_the_end(tmp_path, monkeypatch):
    """Colab as a student meets it: a kernel with torch, ipykernel and ipywidgets 7.7.1 and nothing of
    the kit; one released lab alone in a folder (no wheels/ beside it), its kit served over HTTP (as
    raw.githubusercontent.com serves a course's published labs/wheels).  The whole lab, solutions
    filled in, runs to its last cell; torch and ipywidgets are what they were; every widget renders."""
    lab = "01_point_to_point"
    served = tmp_path / "served"
    served.mkdir()
    server = _serve(served)
    try:
        source = f"wheel:http://127.0.0.1:{server.server_address[1]}/wheels"  # as a raw GitHub URL
        grading.release(
            [lab], course=tmp_path / "course", release_to=served, tmp_root=str(tmp_path), install_source=source
        )
        assert (served / "wheels" / WHEEL).exists()
        released = nbformat.read(served / lab / f"{lab}.ipynb", as_version=4)
        assert f'DISTTRAIN_LAB_PIP = "{stamped_requirement(source)}"' in released.cells[0].source
        alone = tmp_path / "colab"  # what Colab holds of a lab opened from GitHub: the notebook, nothing beside it
        alone.mkdir()

        # every exercise with the solution filled in
        solutions = {
            nbgrader_meta(c).get("grade_id"): c.source for c in load(solution_notebook(lab)).cells if nbgrader_meta(c)
        }
        exercises = [c for c in released.cells if nbgrader_meta(c).get("solution")]
        assert exercises
        for cell in exercises:
            cell.source = _solution_source(solutions[nbgrader_meta(cell)["grade_id"]])
        released.cells.append(nbformat.v4.new_code_cell(WIDGETS_CELL))

        python = fresh_venv(tmp_path / "venv", ["torch", "ipykernel"])
        pinned = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", f"ipywidgets=={COLAB_IPYWIDGETS}"],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert pinned.returncode == 0, pinned.stdout[-3000:] + pinned.stderr[-3000:]
        before = installed(python)
        assert "disttrain-lab" not in before and before["ipywidgets"][0] == COLAB_IPYWIDGETS
        assert "torch" in before and "ipykernel" in before
        kernels = tmp_path / "jupyter" / "kernels" / "colab"
        kernels.mkdir(parents=True)
        (kernels / "kernel.json").write_text(
            json.dumps(
                {
                    "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "display_name": "Colab-like (torch, ipykernel, ipywidgets 7.7.1)",
                    "language": "python",
                }
            )
        )
        monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
        monkeypatch.delenv("PYTHONPATH", raising=False)
        monkeypatch.delenv("VIRTUAL_ENV", raising=False)
        monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)  # a student's run: pictures and benchmarks in full
        client = NotebookClient(
            released,
            kernel_name="colab",
            timeout=900,
            startup_timeout=180,
            resources={"metadata": {"path": str(alone)}},
        )
        client.execute()
    finally:
        server.shutdown()
        server.server_close()
    errors = [o for c in released.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    code = [c for c in released.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "a cell did not run"
    passed = "".join(o.get("text", "") for c in code for o in c.outputs)
    # a self-check raises where its exercise is wrong: no error above means each passed; the first names its own
    assert nbgrader_meta(exercises[0])["grade_id"][3:] in passed, passed[:3000]
    widgets = [o for o in code[-1].outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(widgets) >= 2, code[-1].outputs  # the bar and the slider, as widget views
    assert f"ipywidgets {COLAB_IPYWIDGETS} bar: 3" in passed
    after = installed(python)
    assert after["disttrain-lab"][0] == __version__
    changed = {n: (before[n], after.get(n)) for n in before if after.get(n) != before[n]}
    assert not changed, f"installing the kit replaced installed packages: {changed}"
    added = set(after) - set(before)
    assert "matplotlib" in added and not added & {"jupyterlab", "nbgrader", "notebook", "jupyter-server"}, added


@pytest.mark.slow
def test_a_setup_cell_that_cannot_install_the_kit_says_why_and_what_to_do(tmp_path):
    """The setup cell of a lab opened where its install source cannot be reached: a RuntimeError that
    names the requirement and what to do, not pip's OSError alone and a ModuleNotFoundError per cell."""
    setup = nbformat.read(REPO / "labs" / "01_point_to_point" / "01_point_to_point.ipynb", as_version=4).cells[0]
    python = fresh_venv(tmp_path / "venv", [])
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    for requirement, advice in (
        (f"../{WHEELS}/{WHEEL}", "upload wheels/ next to it"),  # opened alone: no wheels/ beside it
        (f"disttrain-lab @ http://127.0.0.1:9/{WHEEL}", "Can this machine reach that address"),  # nothing listens
    ):
        cell = re.sub(r'^DISTTRAIN_LAB_PIP = "[^"]*"', f'DISTTRAIN_LAB_PIP = "{requirement}"', setup.source, flags=re.M)
        ran = subprocess.run(
            [str(python), "-c", _install_part(cell)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env={**clean, "PIP_NO_INDEX": "1", "PIP_RETRIES": "0", "PIP_TIMEOUT": "5"},
        )
        assert ran.returncode == 1, ran.stdout + ran.stderr
        said = ran.stderr.strip().splitlines()[-1]
        assert said.startswith(
            "RuntimeError: The lab kit (disttrain_lab) is not installed here, and `pip install "
            f"{requirement}` failed (pip's reason is above)."
        ), said
        assert advice in said and "DISTTRAIN_LAB_PIP above" in said, said
