"""Where a lab's setup cell installs the kit from, and the wheel a release ships beside the labs.

A student on Colab opens a lab with nothing of the kit installed; the lab's first cell runs
``pip install "<DISTTRAIN_LAB_PIP>"``.  The instructor says once where that comes from, in
``grader/nbgrader_config.py`` (``c.StampInstallSource.pip_requirement``), or per release
with ``disttrain-lab release --install-source SOURCE``.  ``SOURCE`` is one of:

    wheel                         release builds the kit's wheel into wheels/ beside the labs
                                  (<course>/release/wheels/, or the maintainer's labs/wheels/); a lab
                                  installs it from ../wheels/<file> (a Hub or laptop with the release
                                  folder, or Colab with the folder uploaded)
    wheel:https://BASE            the same wheel, installed from BASE/<file>: for Colab opening labs
                                  from GitHub, BASE = https://raw.githubusercontent.com/ORG/REPO/BRANCH/labs/wheels
    git+https://HOST/ORG/REPO@TAG pip builds the kit from a git repository
    https://.../<file>.whl        a wheel you host yourself

A bare ``disttrain-lab`` is refused: no package of that name is published, so the first
cell of every lab would fail for a new user.  ``configured_install_source()`` says which source
is set; ``submission.StampInstallSource`` writes what it stamps into each released lab.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from traitlets.config.loader import PyFileConfigLoader

from .._version import __version__
from .config import GRADER_DIR, REPO_ROOT

WHEELS = "wheels"  # beside the labs: <course>/release/wheels/, or the maintainer's labs/wheels/
ENV_VAR = "DISTTRAIN_LAB_INSTALL_SOURCE"  # overrides the configured source

CHOICES = (
    "wheel",
    "wheel:https://raw.githubusercontent.com/ORG/REPO/BRANCH/labs/wheels",
    "git+https://github.com/ORG/REPO@TAG",
    "https://HOST/PATH/disttrain_lab-VERSION-py3-none-any.whl",
)


class InstallSourceError(ValueError):
    """The configured install source would not install the kit on a fresh kernel."""


def configured_install_source() -> str:
    """The install source grader/nbgrader_config.py sets (``$DISTTRAIN_LAB_INSTALL_SOURCE`` wins)."""
    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR]
    config = PyFileConfigLoader("nbgrader_config.py", path=str(GRADER_DIR)).load_config()
    return str(config.StampInstallSource.get("pip_requirement", ""))


def wheel_name(version: str = __version__) -> str:
    return f"disttrain_lab-{version}-py3-none-any.whl"


def stamped_requirement(source: str) -> str:
    """What a lab's setup cell passes to ``pip install`` for the instructor's ``source``.

    >>> stamped_requirement("wheel")
    '../wheels/disttrain_lab-0.1.0-py3-none-any.whl'
    >>> stamped_requirement("git+https://github.com/org/kit@v1")
    'disttrain-lab @ git+https://github.com/org/kit@v1'
    """
    source = (source or "").strip()
    if source == "wheel":
        return f"../{WHEELS}/{wheel_name()}"
    if source.startswith("wheel:"):
        base = source[len("wheel:") :].rstrip("/")
        if not re.match(r"^(https?|file)://\S+$", base):
            raise InstallSourceError(
                f"install source {source!r}: after 'wheel:' comes the URL the labs/wheels "
                f"folder is served from, e.g. {CHOICES[1]!r}"
            )
        return f"disttrain-lab @ {base}/{wheel_name()}"
    url = source.split(" @ ", 1)[1].strip() if re.match(r"^disttrain[-_]lab\s+@\s+", source) else source
    if "YOUR-ORG" in url or "/ORG/" in url:
        raise InstallSourceError(
            f"install source {source!r} still holds the example's placeholder; put in your repository's address"
        )
    if re.match(r"^git\+(https|ssh|file)://\S+$", url) or re.match(r"^(https?|file)://\S+\.(whl|tar\.gz|zip)$", url):
        return f"disttrain-lab @ {url}"
    how = (
        f"set c.StampInstallSource.pip_requirement in grader/nbgrader_config.py (or {ENV_VAR}, or "
        f"`disttrain-lab release --install-source ...`) to one of: " + ", ".join(repr(c) for c in CHOICES)
    )
    if not source or re.match(r"^disttrain[-_]lab\b", source):
        raise InstallSourceError(
            f"no install source for the labs' setup cell is set (got {source!r}): a student "
            f"on Colab would run `pip install disttrain-lab`, and no package of that name "
            f"is published, so every lab's first cell would fail. {how}"
        )
    raise InstallSourceError(f"install source {source!r} is not one the labs can install from. {how}")


_RAW_GITHUB = re.compile(r"^wheel:https://raw\.githubusercontent\.com/([^/\s]+)/([^/\s]+)/([^/\s]+)/(\S*?)/?wheels/?$")
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
BADGE_START = "[![Open In Colab]("  # how a stamped badge's line starts (so a release can find and replace it)


def colab_url(source: str, lab: str) -> str | None:
    """Where Colab opens ``lab`` of a course whose labs are published on GitHub, read from the install
    source that says so (``wheel:https://raw.githubusercontent.com/ORG/REPO/BRANCH/PATH/wheels``: the labs
    sit beside that wheels/ folder); None for any other source, whose labs' address is not known.

    >>> colab_url("wheel:https://raw.githubusercontent.com/uni/dl/main/labs/wheels", "01_point_to_point")
    'https://colab.research.google.com/github/uni/dl/blob/main/labs/01_point_to_point/01_point_to_point.ipynb'
    """
    found = _RAW_GITHUB.match((source or "").strip())
    if not found:
        return None
    org, repo, branch, path = found.groups()
    folder = f"{path.strip('/')}/" if path.strip("/") else ""
    return f"https://colab.research.google.com/github/{org}/{repo}/blob/{branch}/{folder}{lab}/{lab}.ipynb"


def colab_badge(url: str) -> str:
    """The "Open in Colab" badge (markdown) that links to ``url``."""
    return f"{BADGE_START}{COLAB_BADGE})]({url})"


def needs_wheel(source: str) -> bool:
    return source.strip() == "wheel" or source.strip().startswith("wheel:")


# ----------------------------------------------------------------------------------------
# The wheel


def _source_digest(root: Path) -> str:
    """A hash of what goes into the wheel: every file of the package (its code and its data: the feedback page's
    templates too; not Python's caches), pyproject.toml and the README."""
    h = hashlib.sha256()
    package = [p for p in (root / "disttrain_lab").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for path in sorted([root / "pyproject.toml", root / "README.md", *package]):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def build_wheel(root: Path = REPO_ROOT, out: Path | None = None) -> Path:
    """Build the kit's wheel (``pip wheel``) into ``out``; returns its path.

    Reproducible: the same sources give the same bytes (SOURCE_DATE_EPOCH), so a release
    that changed nothing leaves labs/wheels/ as it was.  Built once per source state and
    kept in ~/.cache/disttrain-lab/wheels.
    """
    root = Path(root)
    if not (root / "pyproject.toml").exists() or not (root / "disttrain_lab").is_dir():
        raise InstallSourceError(
            f"building the kit's wheel needs its source checkout; {root} has no "
            f"pyproject.toml and disttrain_lab/ (run the release from the repository)"
        )
    cache = (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "disttrain-lab"
        / "wheels"
        / _source_digest(root)
    )
    cached = cache / wheel_name()
    if not cached.exists():
        with tempfile.TemporaryDirectory(prefix="disttrain-wheel-") as tmp:
            # build from a copy: an in-tree build would leave build/ and *.egg-info in the checkout
            src = Path(tmp) / "src"
            shutil.copytree(
                root,
                src,
                ignore=shutil.ignore_patterns(
                    ".git", ".venv", "labs", "solutions", "tests", "build", "*.egg-info", "__pycache__", ".*"
                ),
            )
            env = dict(os.environ, SOURCE_DATE_EPOCH="315532800", PYTHONDONTWRITEBYTECODE="1")
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(Path(tmp) / "out"), str(src)],
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
            )
            built = list((Path(tmp) / "out").glob("disttrain_lab-*.whl"))
            if proc.returncode != 0 or len(built) != 1:
                raise RuntimeError(f"pip wheel failed for {root}:\n{proc.stdout}{proc.stderr}")
            cache.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built[0], cache / (built[0].name + ".part"))
            os.replace(cache / (built[0].name + ".part"), cache / built[0].name)
    if out is None:
        return cached
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("disttrain_lab-*.whl"):
        old.unlink()
    shutil.copy2(cached, out / cached.name)
    return out / cached.name


def wheel_contents(path: Path) -> dict[str, bytes]:
    """What a student installs from the wheel: the package's files and its metadata.  The
    build tool's own records (``WHEEL``'s generator, ``RECORD``'s hashes of those, the
    metadata format version) change with every setuptools release, not with the kit."""
    with zipfile.ZipFile(path) as z:
        found = {}
        for name in z.namelist():
            if name.endswith(".dist-info/RECORD") or name.endswith(".dist-info/WHEEL"):
                continue
            data = z.read(name)
            if name.endswith(".dist-info/METADATA"):
                data = b"\n".join(line for line in data.split(b"\n") if not line.startswith(b"Metadata-Version:"))
            found[name] = data
        return found


def wheel_differences(fresh: Path, committed: Path) -> list[str]:
    """Lines saying how the committed labs/wheels/ differs from a fresh build's (file contents)."""
    fresh_wheels = {p.name: p for p in Path(fresh).glob("*.whl")}
    committed_wheels = {p.name: p for p in Path(committed).glob("*.whl")} if Path(committed).is_dir() else {}
    lines = [f"missing from {committed}: {n}" for n in sorted(fresh_wheels.keys() - committed_wheels.keys())]
    lines += [
        f"not in a fresh release: {committed_wheels[n]}" for n in sorted(committed_wheels.keys() - fresh_wheels.keys())
    ]
    for name in sorted(fresh_wheels.keys() & committed_wheels.keys()):
        if wheel_contents(fresh_wheels[name]) != wheel_contents(committed_wheels[name]):
            lines.append(f"differs from a fresh build (the kit's sources changed): {committed_wheels[name]}")
    return lines
