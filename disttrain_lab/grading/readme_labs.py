"""The README's table of labs, with each lab's "Open in Colab" badge in its last column.

Where the labs will be on GitHub follows from the install source (``install_source.colab_url``:
``wheel:https://raw.githubusercontent.com/ORG/REPO/BRANCH/labs/wheels``), so the maintainer's
``disttrain-lab release`` (into the checkout's ``labs/``) writes the column: a badge per lab for a
course published so, a dash where the labs' address is not known.  ``release --check`` reports a
stale column like a stale lab.  Only the last cell of the rows that name a lab (`` `NN_name` ``)
is written; the rest of the README is the authors'.
"""

from __future__ import annotations

import re
from pathlib import Path

from .install_source import colab_badge, colab_url

_ROW = re.compile(r"^\| `(\d\d_[a-z0-9_]+)` \|(.*)\| ([^|]*) \|$", re.MULTILINE)
UNKNOWN = "—"  # no badge: the install source does not say where the labs will be


def with_badges(text: str, source: str) -> str:
    """``text`` (a README) with the Colab cell of each lab's row written for ``source``."""

    def row(found: re.Match) -> str:
        url = colab_url(source, found[1])
        return f"| `{found[1]}` |{found[2]}| {colab_badge(url) if url else UNKNOWN} |"

    return _ROW.sub(row, text)


def labs_listed(text: str) -> list[str]:
    """The labs ``text``'s table has a row for, in its order."""
    return [found[0] for found in _ROW.findall(text)]


def update(readme: Path, source: str) -> bool:
    """Write the Colab column of ``readme`` for ``source``; whether anything changed."""
    text = readme.read_text()
    new = with_badges(text, source)
    if new != text:
        readme.write_text(new)
    return new != text
