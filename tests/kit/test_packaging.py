"""The project's own files install what it needs, and never an unpinned torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.version import Version

from disttrain_lab.grading.install_source import build_wheel
from tests.freshenv import canonical, fresh_venv, installed, requirements_of
from tests.helpers import REPO


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _environment_pip() -> list[str]:
    lines = (REPO / "environment.yml").read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip() == "- pip:")
    return [l.strip()[2:] for l in lines[start + 1 :] if l.strip().startswith("- ") and l.strip() != "- -e ."]


def test_environment_yml_lists_the_same_packages_as_pyproject():
    project = _pyproject()["project"]
    declared = {r for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        declared |= set(extra)
    assert sorted(_environment_pip()) == sorted(declared)


def test_torch_is_never_a_plain_dependency():
    project = _pyproject()["project"]
    assert not [r for r in project["dependencies"] if _name(r) == "torch"], (
        "a torch dependency would let pip replace Colab's or a Hub's torch"
    )
    assert project["optional-dependencies"]["torch"] == ["torch==2.13.0"]
    assert "torch==2.13.0" in _environment_pip()


def test_setup_script_installs_only_the_pinned_torch_and_only_when_missing():
    script = (REPO / "scripts" / "setup.sh").read_text()
    installs = [l for l in script.splitlines() if "pip install" in l and "torch" in l]
    assert installs and all('"torch==2.13.0"' in l for l in installs)
    assert "import torch" in script  # the guard that keeps an installed torch


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    assert "bash scripts/test.sh" in readme
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_package_holds_no_solutions():
    # students install disttrain_lab: nothing of solutions/ may be inside it
    markers = ("### BEGIN SOLUTION", "BEGIN HIDDEN TESTS")
    for path in (REPO / "disttrain_lab").rglob("*.py"):
        text = path.read_text()
        assert not any(m in text for m in markers if f'"{m}' not in text and f"'{m}" not in text), path


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_console_script_runs():
    out = subprocess.run(
        [str(Path(sys.executable).parent / "disttrain-lab"), "doctor"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "READY" in out.stdout


# --- a student's install is lean --------------------------------------------------------

STUDENT_DEPS = {"cloudpickle", "numpy", "matplotlib", "ipywidgets", "tqdm"}
# what may replace Colab's own Jupyter front end, or is only the instructor's
NEVER_FOR_STUDENTS = {
    "torch",
    "jupyterlab",
    "notebook",
    "jupyter-server",
    "nbgrader",
    "nbconvert",
    "nbclient",
    "jupyterhub",
    "jupyter-client",
    "ipykernel",
}


# the instructor's and the developer's tools: never in the student's kit (scripts/lab.sh); the grader's
# nbclient and psutil are not here, JupyterLab brings them (nbconvert, ipykernel)
INSTRUCTOR_ONLY = {"nbgrader", "rich", "nh3", "django-static-mathjax"}
DEVELOPER_ONLY = {"pytest", "pytest-xdist", "playwright", "jupyterhub", "ruff", "uv"}


def test_student_dependencies_are_only_what_a_kernel_needs():
    project = _pyproject()["project"]
    assert {_name(r) for r in project["dependencies"]} == STUDENT_DEPS
    extras = {name: {_name(r) for r in requirements} for name, requirements in project["optional-dependencies"].items()}
    assert extras["lab"] == {"jupyterlab"}  # the student's laptop: somewhere to open the labs
    assert {"jupyterlab", "nbgrader"} <= extras["grader"] and INSTRUCTOR_ONLY <= extras["grader"]
    assert DEVELOPER_ONLY <= extras["test"]
    script = (REPO / "scripts" / "setup.sh").read_text()
    assert '-e ".[$EXTRAS]"' in script
    for kit, wanted in (("student", "lab"), ("instructor", "lab,grader"), ("developer", "lab,grader,test")):
        assert f'{kit}) EXTRAS="{wanted}" ;;' in script, kit
    assert "DISTTRAIN_KIT=${DISTTRAIN_KIT:-student} bash scripts/setup.sh" in (REPO / "scripts" / "lab.sh").read_text()


def test_setup_refuses_a_kit_it_does_not_know(tmp_path):
    venv = tmp_path / "venv"
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "setup.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHON": "false", "VENV": str(venv), "DISTTRAIN_KIT": "teacher"},
    )
    assert out.returncode == 2 and "DISTTRAIN_KIT must be 'student', 'instructor'" in out.stderr, out.stderr
    assert not venv.exists()


def _kit_figures() -> dict[str, tuple[int, int]]:
    """The README's table of the three installs: kit -> (packages, MB), as measured and written there."""
    found = re.findall(
        r"^\| (student|instructor|developer)\b.*?\| ([0-9]+) packages \| ([0-9,]+) MB \|",
        (REPO / "README.md").read_text(),
        re.MULTILINE,
    )
    return {kit: (int(count), int(mb.replace(",", ""))) for kit, count, mb in found}


@pytest.mark.slow
def test_the_students_install_has_jupyterlab_and_nothing_of_the_instructors(tmp_path):
    """What scripts/lab.sh installs (the kit's `lab` extra) into a venv that has only torch, as a
    fresh laptop does after setup's torch: JupyterLab and the kit, no nbgrader, no test tools,
    about as many packages and megabytes as the README says (torch aside)."""
    wheel = build_wheel(REPO, tmp_path / "dist")
    python = fresh_venv(tmp_path / "venv", ["torch"])
    before = installed(python)
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"{wheel}[lab]"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = installed(python)
    added = set(after) - set(before)
    assert {"disttrain-lab", "jupyterlab", "ipywidgets", "matplotlib", "tqdm"} <= added, added
    assert not added & (INSTRUCTOR_ONLY | DEVELOPER_ONLY), added & (INSTRUCTOR_ONLY | DEVELOPER_ONLY)
    assert after["torch"] == before["torch"]
    # JupyterLab starts, with no nbgrader extension (no "Nbgrader" menu, no "Create Assignment")
    own = {  # this venv's jupyter alone: `jupyter labextension` finds its subcommand on PATH
        **{k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "VIRTUAL_ENV", "PYTHON"))},
        "PATH": f"{python.parent}:/usr/bin:/bin",
    }
    lab = subprocess.run(
        [str(python.parent / "jupyter"), "labextension", "list"], capture_output=True, text=True, timeout=120, env=own
    )
    assert lab.returncode == 0 and "jupyterlab_widgets" in lab.stdout + lab.stderr, lab.stdout + lab.stderr
    assert "nbgrader" not in (lab.stdout + lab.stderr).lower(), lab.stdout + lab.stderr
    # the student's own copies of the labs, with this kit's command
    start = subprocess.run(
        [
            str(tmp_path / "venv" / "bin" / "disttrain-lab"),
            "start",
            "01",
            "--labs",
            str(REPO / "labs"),
            "--into",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert start.returncode == 0 and (tmp_path / "work" / "01_point_to_point").is_dir(), start.stdout + start.stderr
    # the README's figures: packages the kit adds (torch's own aside) and their size on disk
    count, size = _kit_figures()["student"]
    megabytes = _disk_mb(tmp_path / "venv") - _disk_mb(tmp_path / "venv" / "kept")
    assert abs(len(added) - count) <= max(5, count // 5), (
        f"README says {count} packages, the install added {len(added)}"
    )
    assert abs(megabytes - size) <= max(20, size // 4), f"README says {size} MB, the install holds {megabytes} MB"


def _disk_mb(folder: Path) -> int:
    out = subprocess.run(["du", "-sm", str(folder)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


@pytest.mark.slow
def test_wheel_in_a_venv_with_only_torch_adds_student_deps_and_replaces_nothing(tmp_path):
    wheel = build_wheel(REPO, tmp_path / "dist")
    python = fresh_venv(tmp_path / "venv", ["torch"])
    before = installed(python)
    assert "torch" in before and "disttrain-lab" not in before and "numpy" not in before
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    items = {canonical(i["metadata"]["name"]): i["metadata"] for i in json.loads(report.read_text())["install"]}
    kit = items.pop("disttrain-lab")
    assert requirements_of(kit.get("requires_dist")) == STUDENT_DEPS, "the wheel's own requirements"
    # everything else pip would add is needed by the student dependencies, transitively
    reachable, todo = set(), list(STUDENT_DEPS)
    while todo:
        name = todo.pop()
        if name not in reachable:
            reachable.add(name)
            todo += requirements_of(items.get(name, {}).get("requires_dist"))
    assert set(items) <= reachable, f"added beyond the student dependencies: {set(items) - reachable}"
    assert not set(items) & set(before), f"would replace installed packages: {set(items) & set(before)}"
    assert not set(items) & NEVER_FOR_STUDENTS, set(items) & NEVER_FOR_STUDENTS


# in the fast tier (1 s): a change to the package without `disttrain-lab release` failed two CI runs' slow tier
def test_committed_wheel_is_built_from_these_sources(tmp_path):
    from disttrain_lab import grading
    from disttrain_lab.grading.install_source import build_wheel, needs_wheel, wheel_differences

    if not needs_wheel(grading.configured_install_source()):
        pytest.skip("the configured install source is not a wheel beside the labs")
    build_wheel(REPO, tmp_path)
    assert not wheel_differences(tmp_path, REPO / "labs" / "wheels"), (
        "labs/wheels/ is stale: run `disttrain-lab release`"
    )


def test_the_committed_wheel_holds_every_module_of_the_package():
    # students install the wheel: a module left out of it (a package folder setuptools was not told of)
    # fails only on a student's machine, never in an editable checkout
    import zipfile

    [wheel] = sorted((REPO / "labs" / "wheels").glob("disttrain_lab-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        shipped = {n for n in z.namelist() if n.endswith(".py")}
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "disttrain_lab").rglob("*.py")}
    assert modules - shipped == set(), "modules missing from the wheel: list their package in pyproject.toml"


@pytest.mark.slow
def test_every_lower_bound_is_what_the_lowest_resolution_installs():
    # `DISTTRAIN_RESOLUTION=lowest bash scripts/test.sh` runs the suite on these versions; a bound
    # that nothing can install (jupyterlab>=4.0 beside nbgrader 0.9.6) would claim support untested
    project = _pyproject()["project"]
    bounds = {}
    for requirement in [*project["dependencies"], *sum(project["optional-dependencies"].values(), [])]:
        floor = re.search(r"(>=|==)\s*([0-9][^,;\s]*)", requirement)
        assert floor, f"{requirement}: every dependency names its lowest version"
        bounds[_name(requirement)] = floor.group(2)
    uv = Path(sys.executable).parent / "uv"
    out = subprocess.run(
        [
            str(uv),
            "pip",
            "compile",
            "pyproject.toml",
            "--all-extras",
            "--resolution",
            "lowest-direct",
            "--python-version",
            f"{sys.version_info.major}.{sys.version_info.minor}",
            "--quiet",
            "--no-header",
            "--no-annotate",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    resolved = dict(line.split("==", 1) for line in out.stdout.split() if "==" in line and not line.startswith("-"))
    resolved = {_name(n): v for n, v in resolved.items()}
    wrong = {
        n: (b, resolved.get(n)) for n, b in bounds.items() if n not in resolved or Version(resolved[n]) != Version(b)
    }
    assert not wrong, f"declared lower bound vs what the lowest resolution installs: {wrong}"
