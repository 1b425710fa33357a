"""What a grading process leaves out of its start-up: two costs that change nothing it does.

Every grading step is a fresh ``nbgrader`` process (``steps.run_nbgrader``: release, autograde,
feedback), and the grader's own commands import nbconvert.  Measured on the 2-core course
machine (``python -X importtime -c "import nbgrader.apps.nbgraderapp"``), two pieces of that
start-up cost more than the rest of it together:

- **rfc3987-syntax.**  jsonschema imports it when it is installed (jupyter-events asks for
  ``jsonschema[format-nongpl]``), to check the ``iri`` and ``iri-reference`` string formats;
  at import it builds an Earley parser of RFC 3987's grammar with lark: 3.2 s of the 6.2 s
  that importing nbgrader takes.  Nothing a grading process validates (nbformat's notebook
  schemas, nbgrader's) uses those formats; without the module jsonschema leaves them
  unchecked (``jsonschema._format`` imports it under ``suppress(ImportError)``).
  :func:`skip_slow_imports` marks it absent in this process only, before jsonschema loads.
- **alembic in a subprocess.**  A gradebook made new (every course's first release) asks
  ``alembic heads`` for the schema's version, in a process that imports nbgrader again:
  5.3 s.  :func:`alembic_head` reads the same revision from the same scripts in this process
  (0.2 s once nbgrader is imported); the nbgrader process a step starts uses it
  (:data:`NBGRADER_PRELUDE`).
- **torch.**  ``import disttrain_lab`` imports torch (3.5 s of CPU here) and the whole kit, which
  nbgrader's process never uses: its side of grading (``grading/``: the preprocessors, the files it
  hands the grader kernel, ``handoff.py``) is torch-free; the graded tests run in the grader kernel,
  the student's code in the student's kernel, each a process of its own that imports torch.
  :data:`NBGRADER_PRELUDE` first puts the package in ``sys.modules`` as a bare package (its folder,
  without running its ``__init__``), so the step imports ``disttrain_lab.grading`` alone
  (``tests/grading/test_startup.py`` holds it to that).

A student's kernel imports neither nbconvert nor this package.
"""

from __future__ import annotations

import sys

SLOW_OPTIONAL_IMPORTS = ("rfc3987_syntax",)


def skip_slow_imports() -> None:
    """Mark :data:`SLOW_OPTIONAL_IMPORTS` absent in this process (an ``import`` of one raises
    ``ImportError``, which their optional users catch); one already imported stays."""
    for name in SLOW_OPTIONAL_IMPORTS:
        sys.modules.setdefault(name, None)


def alembic_head() -> str:
    """The gradebook schema's newest revision: what ``nbgrader.api.get_alembic_version``
    returns, read in this process instead of from ``alembic heads`` in another."""
    from alembic.config import Config  # nbgrader's own dependencies, imported by its process only
    from alembic.script import ScriptDirectory
    from nbgrader.dbutil import _temp_alembic_ini

    with _temp_alembic_ini("sqlite:///gradebook.db") as ini:
        (head,) = ScriptDirectory.from_config(Config(ini)).get_heads()
    return head


# the kit's package as a bare package: its submodules import from its folder, its __init__ (torch and
# the whole kit) never runs; source text, run before anything imports the kit
BARE_KIT = (
    "import importlib.util, sys, types\n"
    "_spec = importlib.util.find_spec('disttrain_lab')\n"
    "_kit = types.ModuleType('disttrain_lab', 'the kit without its __init__ (grading/startup.py)')\n"
    "_kit.__path__, _kit.__file__, _kit.__spec__ = list(_spec.submodule_search_locations), _spec.origin, _spec\n"
    "sys.modules['disttrain_lab'] = _kit\n"
)

# run by the nbgrader process of a step before nbgrader itself (steps._NBGRADER_CHILD)
NBGRADER_PRELUDE = (
    BARE_KIT + "from disttrain_lab.grading import startup; import nbgrader.api\n"
    "nbgrader.api.get_alembic_version = startup.alembic_head\n"
)
