"""Where a released lab installs the kit from: refused while unset, and a fresh kernel that
has only torch and ipykernel (Colab, as a new user meets it) installs it and runs a lab."""

from __future__ import annotations

import functools
import http.server
import json
import threading
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from disttrain_lab import __version__, grading
from disttrain_lab.grading.install_source import WHEELS, InstallSourceError, stamped_requirement, wheel_name
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


@pytest.mark.slow
def test_fresh_kernel_installs_the_kit_from_a_released_lab_and_passes_a_self_check(tmp_path, monkeypatch):
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

        # the first exercise with the solution filled in, up to its self-check
        solution = load(solution_notebook(lab))
        first = next(i for i, c in enumerate(released.cells) if nbgrader_meta(c).get("solution"))
        grade_id = nbgrader_meta(released.cells[first])["grade_id"]
        released.cells[first].source = _solution_source(
            next(c.source for c in solution.cells if nbgrader_meta(c).get("grade_id") == grade_id)
        )
        check = next(
            i for i, c in enumerate(released.cells) if i > first and c.cell_type == "code" and not nbgrader_meta(c)
        )
        released.cells = released.cells[: check + 1]

        python = fresh_venv(tmp_path / "venv", ["torch", "ipykernel"])
        before = installed(python)
        assert "disttrain-lab" not in before and "torch" in before and "ipykernel" in before
        kernels = tmp_path / "jupyter" / "kernels" / "fresh"
        kernels.mkdir(parents=True)
        (kernels / "kernel.json").write_text(
            json.dumps(
                {
                    "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "display_name": "fresh (torch + ipykernel)",
                    "language": "python",
                }
            )
        )
        monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
        monkeypatch.delenv("PYTHONPATH", raising=False)
        monkeypatch.delenv("VIRTUAL_ENV", raising=False)
        client = NotebookClient(
            released,
            kernel_name="fresh",
            timeout=900,
            startup_timeout=180,
            resources={"metadata": {"path": str(served / lab)}},
        )
        client.execute()
    finally:
        server.shutdown()
        server.server_close()
    errors = [o for c in released.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    check_out = "".join(o.get("text", "") for o in released.cells[-1].outputs)
    assert grade_id[3:] in check_out, check_out  # the self-check's verdict names the exercise
    after = installed(python)
    assert after["disttrain-lab"][0] == __version__
    changed = {n: (before[n], after.get(n)) for n in before if after.get(n) != before[n]}
    assert not changed, f"installing the kit replaced installed packages: {changed}"
    added = set(after) - set(before)
    assert "matplotlib" in added and not added & {"jupyterlab", "nbgrader", "notebook", "jupyter-server"}, added
