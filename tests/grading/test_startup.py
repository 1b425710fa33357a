"""What a grading process leaves out of its start-up (disttrain_lab/grading/startup.py) changes
nothing it does: the gradebook's schema version is the one ``alembic heads`` names, and the
module left out is one that jsonschema only tries."""

from __future__ import annotations

import subprocess
import sys

import pytest
from nbgrader import api

from disttrain_lab.grading import startup
from tests.helpers import REPO


@pytest.mark.slow  # `alembic heads` in a process of its own: 5 s
def test_alembic_head_is_the_revision_alembic_heads_names():
    assert startup.alembic_head() == api.get_alembic_version()


@pytest.mark.slow  # two fresh interpreters importing nbconvert
def test_a_grading_process_validates_notebooks_without_rfc3987_syntax():
    check = (
        "import sys, disttrain_lab.grading, nbformat\n"
        "print(sys.modules.get('rfc3987_syntax', 'absent'))\n"
        "nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('1')])\n"
        "nbformat.validate(nb); print('valid')\n"
        "try:\n"
        "    nbformat.validate(nbformat.from_dict({'cells': 1}))\n"
        "except nbformat.ValidationError: print('invalid')\n"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "valid", "invalid"]
    # the nbgrader process of a step (steps._NBGRADER_CHILD's prelude) gets its gradebook's version in-process
    prelude = startup.NBGRADER_PRELUDE + "print(nbgrader.api.get_alembic_version())\n"
    out = subprocess.run([sys.executable, "-c", prelude], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == startup.alembic_head()


@pytest.mark.slow  # a fresh interpreter importing nbgrader's apps: 3 s
def test_an_nbgrader_step_imports_no_torch():
    # each step of a grading (generate_assignment, autograde, generate_feedback) is an nbgrader process that
    # loads grader/nbgrader_config.py and the classes it names; torch's import alone would be 3.5 s of CPU
    # there (the grader kernel and the student's kernel import it, not this process)
    check = startup.NBGRADER_PRELUDE + (
        "import importlib, runpy, traitlets.config\n"
        "from nbgrader.apps import AutogradeApp, GenerateAssignmentApp, GenerateFeedbackApp\n"
        "c = runpy.run_path('grader/nbgrader_config.py', {'get_config': traitlets.config.Config})['c']\n"
        "named = [c.GenerateFeedback.exporter_class, *c.Autograde.autograde_preprocessors,\n"
        "         *c.GenerateAssignment.preprocessors, *c.GenerateFeedback.preprocessors]\n"
        "for path in [str(n) for n in named if str(n).startswith('disttrain_lab')]:\n"
        "    module, _, name = path.rpartition('.'); getattr(importlib.import_module(module), name)\n"
        "print(len(named), sys.modules.get('torch', 'no torch'))\n"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    count, *torch = out.stdout.split()
    assert int(count) >= 3 and torch == ["no", "torch"], out.stdout
