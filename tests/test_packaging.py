"""The project's own files install what it needs, and never an unpinned torch."""
from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _environment_pip() -> list[str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip() == "- pip:")
    return [l.strip()[2:] for l in lines[start + 1:] if l.strip().startswith("- ") and l.strip() != "- -e ."]


def test_environment_yml_lists_the_same_packages_as_pyproject():
    project = _pyproject()["project"]
    declared = {r for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        declared |= set(extra)
    assert sorted(_environment_pip()) == sorted(declared)


def test_torch_is_never_a_plain_dependency():
    project = _pyproject()["project"]
    assert not [r for r in project["dependencies"] if _name(r) == "torch"], \
        "a torch dependency would let pip replace Colab's or a Hub's torch"
    assert project["optional-dependencies"]["torch"] == ["torch==2.13.0"]
    assert "torch==2.13.0" in _environment_pip()


def test_setup_script_installs_only_the_pinned_torch_and_only_when_missing():
    script = (ROOT / "scripts" / "setup.sh").read_text()
    installs = [l for l in script.splitlines() if "pip install" in l and "torch" in l]
    assert installs and all('"torch==2.13.0"' in l for l in installs)
    assert "import torch" in script  # the guard that keeps an installed torch


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_package_holds_no_solutions():
    # students install disttrain_lab: nothing of solutions/ may be inside it
    markers = ("### BEGIN SOLUTION", "BEGIN HIDDEN TESTS")
    for path in (ROOT / "disttrain_lab").rglob("*.py"):
        text = path.read_text()
        assert not any(m in text for m in markers if f'"{m}' not in text and f"'{m}" not in text), path


def test_console_script_runs():
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "disttrain-lab"), "doctor"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "READY" in out.stdout
