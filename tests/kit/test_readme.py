"""The README's examples print what the README says they print (its error reports are the kit's
own words, not a paraphrase that drifts): each ```python block followed by a ```text block is run
as a notebook cell would run it, and its output is compared line by line."""

from __future__ import annotations

import re

import pytest

from tests.helpers import REPO, run_python

# a notebook cell: code of __main__ (functions travel to the ranks by value), then the error as
# IPython's last line shows it, "TypeName: message"
RUNNER = """
import sys
source = open(sys.argv[1]).read()
try:
    exec(compile(source, "cell.py", "exec"), {"__name__": "__main__"})
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
"""


def examples() -> list[tuple[str, str]]:
    text = (REPO / "README.md").read_text()
    block = r"((?:(?!```).)*?)```"  # up to the fence that ends it
    return re.findall(r"```python\n" + block + r"\n```text\n" + block, text, flags=re.S)


def normal(line: str) -> str:
    """A line with its measured seconds left out ("for 4.9 s": how long a rank waited)."""
    return re.sub(r"for \d+(\.\d+)? s\b", "for … s", line.rstrip())


def test_the_readme_has_examples_with_their_output():
    assert len(examples()) >= 2


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
@pytest.mark.parametrize("code, shown", examples(), ids=lambda v: v.splitlines()[0][:40] if "\n" in v else v)
def test_each_readme_example_prints_what_the_readme_shows(tmp_path, code, shown):
    cell = tmp_path / "cell.py"
    cell.write_text(code)
    runner = tmp_path / "run.py"
    runner.write_text(RUNNER)
    out = run_python([str(runner), str(cell)], timeout=120, cwd=tmp_path).stdout
    got = [normal(line) for line in out.splitlines()]
    for want in map(normal, shown.strip().splitlines()):
        if want.endswith("..."):  # the README cuts a long line short
            assert any(line.startswith(want[:-3].rstrip()) for line in got), (want, out)
        else:
            assert want in got, (want, out)
