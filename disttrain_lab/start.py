"""``disttrain-lab start LAB``: the student's own copy of a lab, outside the kit's tracked files.

A student who works in ``labs/`` edits files that ``git pull`` and ``disttrain-lab release``
also write: a fixed lab then conflicts with, or silently replaces, their work.  ``start``
copies a released lab (``labs/NN_name/``) into the student's work folder (``work/NN_name/``
beside ``labs/``, ignored by git), and notes what it copied (``.disttrain-start.json``).  Run
again later, it never writes over a file the student changed:

- a file the release fixed and the student never touched is updated in place;
- a file the release fixed *and* the student changed is left alone, and the fixed one is put
  beside it (``NN_name.new.ipynb``), with the cells that changed named, so that the student
  copies their answers across (or keeps working in theirs);
- files the release added are copied; the kit's wheels (``labs/wheels``, what a lab's first
  cell installs from, ``../wheels``) are mirrored, since they are not the student's.

    disttrain-lab start 01                 # work/01_point_to_point/01_point_to_point.ipynb
    disttrain-lab start --all              # every lab (scripts/lab.sh does this, then opens work/)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

MANIFEST = ".disttrain-start.json"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def labs_in(labs: Path) -> list[str]:
    """The released labs in ``labs`` (a folder NN_name holding NN_name.ipynb)."""
    return sorted(p.name for p in labs.iterdir() if p.is_dir() and (p / f"{p.name}.ipynb").is_file())


def find_lab(labs: Path, which: str) -> str:
    """The lab ``which`` names: its number ("01", "1"), its folder's name, or the part after the number."""
    names = labs_in(labs)
    for name in names:
        number, _, title = name.partition("_")
        if which in (name, title) or (which.isdigit() and int(which) == int(number)):
            return name
    raise SystemExit(f"disttrain-lab start: no lab {which!r} in {labs}; the labs there are: {', '.join(names)}")


def _changed_cells(old: Path, new: Path) -> list[str]:
    """The cells of notebook ``new`` that differ from ``old`` (by cell id), as their first line."""
    try:
        before = {c.get("id"): c.get("source") for c in json.loads(old.read_text())["cells"]}
        cells = json.loads(new.read_text())["cells"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    out = []
    for cell in cells:
        if before.get(cell.get("id")) != cell.get("source"):
            source = cell.get("source")
            text = "".join(source) if isinstance(source, list) else str(source)
            first = next((line.strip() for line in text.splitlines() if line.strip()), "(empty)")
            out.append(("new: " if cell.get("id") not in before else "changed: ") + first[:90])
    return out


def start(labs: Path, work: Path, name: str) -> list[str]:
    """Copy lab ``name`` from ``labs`` into ``work``, or bring a copy up to date without writing
    over the student's changes; what was done, one line each."""
    source, target = labs / name, work / name
    manifest_path = target / MANIFEST
    try:
        copied = json.loads(manifest_path.read_text())["files"] if manifest_path.is_file() else {}
    except (OSError, ValueError, KeyError, TypeError):
        copied = {}
    said, record = [], dict(copied)
    fresh = not target.exists()
    for path in sorted(p for p in source.rglob("*") if p.is_file() and ".ipynb_checkpoints" not in p.parts):
        rel = path.relative_to(source).as_posix()
        mine, released = target / rel, _digest(path)
        if not mine.exists():
            mine.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, mine)
            record[rel] = released
            if not fresh:
                said.append(f"added {mine} (new in the release)")
        elif released == copied.get(rel) or _digest(mine) == released:
            record[rel] = released  # nothing new in the release, or the student has it already
        elif copied.get(rel) is not None and _digest(mine) == copied[rel]:
            shutil.copy2(path, mine)  # fixed in the release, untouched by the student
            record[rel] = released
            said.append(f"updated {mine} (fixed in the release; you had not changed it)")
        else:
            beside = mine.with_name(f"{mine.stem}.new{mine.suffix}")
            shutil.copy2(path, beside)
            record[rel] = released  # offered once: said again only when the release changes again
            changes = _changed_cells(mine, path) if mine.suffix == ".ipynb" else []
            said.append(
                f"kept your {mine}: the release changed it too, so the new version is beside it as {beside.name}"
                + (
                    " (cells that differ from yours: "
                    + "; ".join(changes[:8])
                    + ("; ..." if len(changes) > 8 else "")
                    + ")"
                    if changes
                    else ""
                )
                + f".  Copy your answers into {beside.name}, or keep working in yours."
            )
    target.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps({"lab": name, "files": record}, indent=1, sort_keys=True))
    notebook = target / f"{name}.ipynb"
    said.insert(0, f"{'started' if fresh else 'your copy'}: {notebook}")
    return said


def _mirror_wheels(labs: Path, work: Path) -> None:
    """The kit's wheels, where a lab's first cell looks for them (``../wheels``): not the student's files."""
    wheels = labs / "wheels"
    if wheels.is_dir():
        shutil.copytree(wheels, work / "wheels", dirs_exist_ok=True)


def cli_start(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="disttrain-lab start", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("lab", nargs="?", help='the lab: its number ("01"), its folder name, or its title')
    parser.add_argument("--all", action="store_true", help="every lab in --labs")
    parser.add_argument("--labs", type=Path, default=Path("labs"), help="the released labs (default: %(default)s)")
    parser.add_argument("--into", type=Path, default=None, help="the work folder (default: work/ beside --labs)")
    args = parser.parse_args(argv)
    if not args.labs.is_dir():
        parser.error(f"no folder {args.labs} here: run this in the kit's folder, or pass --labs")
    if bool(args.all) == bool(args.lab):
        parser.error("name one lab (e.g. `disttrain-lab start 01`), or pass --all")
    work = args.into or args.labs.resolve().parent / "work"
    names = labs_in(args.labs) if args.all else [find_lab(args.labs, args.lab)]
    for name in names:
        for line in start(args.labs, work, name):
            print(line)
    _mirror_wheels(args.labs, work)
    return 0
