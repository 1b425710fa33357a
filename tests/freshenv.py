"""A fresh virtual environment holding only some installed distributions (say torch), the
way a student's Colab or Hub kernel has torch but not the kit.

Copying torch (700 MB) into every test's venv would take minutes, so the chosen
distributions, and what they require, are linked from this interpreter's site-packages
into one folder that the venv reads through a ``.pth`` file: pip and Python in the venv
see them as installed, and see nothing else of this machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import venv
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements_of(requires: list[str] | None, extras: tuple[str, ...] = ("",)) -> set[str]:
    """The canonical names a distribution needs here (markers evaluated, extras as given)."""
    names = set()
    for line in requires or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**default_environment(), "extra": e}) for e in extras):
            names.add(canonical(req.name))
    return names


def closure(names: list[str]) -> dict[str, metadata.Distribution]:
    """``names`` and everything they require, as installed for this interpreter."""
    found: dict[str, metadata.Distribution] = {}
    todo = [canonical(n) for n in names]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional need that is not installed here
        found[name] = dist
        todo += sorted(requirements_of(dist.requires))
    return found


def fresh_venv(path: Path, keep: list[str]) -> Path:
    """A venv at ``path`` that sees only ``keep`` (and their requirements); returns its python."""
    venv.EnvBuilder(with_pip=True, symlinks=True).create(path)
    python = path / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            cwd=path,
        ).stdout.strip()
    )
    shared = path / "kept"
    shared.mkdir()
    for dist in closure(keep).values():
        root = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            target = shared / top
            if (root / top).exists() and not target.exists():
                target.symlink_to(root / top)
    (site / "kept.pth").write_text(str(shared) + "\n")
    return python


def installed(python: Path) -> dict[str, tuple[str, str]]:
    """{name: (version, location)} of every distribution ``python`` can import."""
    code = (
        "import json, importlib.metadata as m; print(json.dumps({d.metadata['Name']: "
        "[d.version, str(d.locate_file(''))] for d in m.distributions()}))"
    )
    # run elsewhere than the checkout: its disttrain_lab.egg-info would count as installed
    out = subprocess.run(
        [str(python), "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=python.parent,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
    )
    return {canonical(k): tuple(v) for k, v in json.loads(out.stdout).items()}
