"""Every lab states its time in one form, and its totals are the sums of its rows (#41 item 2).

Near its top each solution notebook has a table `| | part | time |` (lab 8's has a `points` column
too), one row per exercise or prediction group, its first column `core` or `optional`, and under it

    **Core path: about X; with the optional parts, about Y.**

(only the core clause where nothing is optional).  A time is minutes (`45 min`), hours (`2 h`,
`1 h 30`) or a range of them (`45–60 min`, `3–4 h`, `50 min–1 h 15`); a range's low ends add up to
the total's low end and its high ends to the high end.  The instructor's term plan in
`grader/README.md` gives each lab the core time its notebook states.
"""

from __future__ import annotations

import re

import pytest

from tests.notebooks import REPO, load, solution_notebook

LABS = sorted(p.name for p in (REPO / "solutions").iterdir() if re.fullmatch(r"\d\d_\w+", p.name))
ONE = re.compile(r"(?:(\d+) h(?: (\d+))?|(\d+) min)")
CLAIM = re.compile(r"\*\*Core path: about (.+?)(?:; with the optional parts, about (.+?))?\.\*\*")
TERM_PLAN = REPO / "grader" / "README.md"


def minutes(text: str) -> int:
    """`45 min` -> 45, `2 h` -> 120, `1 h 30` -> 90."""
    m = ONE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"not a time: {text!r} (write `45 min`, `2 h` or `1 h 30`)")
    hours, mins, only = m.groups()
    return int(only) if only else 60 * int(hours) + int(mins or 0)


def span(text: str) -> tuple[int, int]:
    """A time or a range, in minutes (low, high): `45–60 min` -> (45, 60), `3–4 h` -> (180, 240)."""
    low, sep, high = text.strip().partition("–")
    if not sep:
        return minutes(low), minutes(low)
    if low.strip().isdigit():  # `45–60 min`, `3–4 h`: the low end takes the high end's unit
        unit = "h" if " h" in high else "min"
        low = f"{low.strip()} {unit}"
    return minutes(low), minutes(high)


def budget(lab: str) -> dict:
    """The lab's time table and its claimed totals: rows [(kind, part, (low, high))], core, total."""
    return budget_of(load(solution_notebook(lab)), lab)


def budget_of(nb, lab: str) -> dict:
    """``budget`` of the notebook ``nb`` (``lab``: its name, for the messages)."""
    for cell in nb.cells[:4]:
        if cell.cell_type != "markdown":
            continue
        lines = cell.source.splitlines()
        heads = [i for i, line in enumerate(lines) if re.fullmatch(r"\| \| part \|(?: points \|)? time \|", line)]
        if not heads:
            continue
        assert len(heads) == 1, f"{lab}: more than one time table"
        start = heads[0] + 2
        assert set(lines[start - 1].replace("|", "").split()) == {"---"}, f"{lab}: the table's second line"
        rows = []
        for line in lines[start:]:
            if not line.startswith("|"):
                break
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            assert cells[0] in ("core", "optional"), f"{lab}: a row's first column is core or optional: {line}"
            rows.append((cells[0], cells[1], span(cells[-1])))
        claims = CLAIM.findall(cell.source)
        assert len(claims) == 1, f"{lab}: no single '**Core path: about X; ...**' line under the table"
        core, total = claims[0]
        return {"rows": rows, "core": span(core), "total": span(total) if total else None}
    raise AssertionError(f"{lab}: no `| | part | time |` table in the notebook's first cells")


def summed(rows, kinds) -> tuple[int, int]:
    return sum(r[2][0] for r in rows if r[0] in kinds), sum(r[2][1] for r in rows if r[0] in kinds)


def test_times_parse():
    assert span("45 min") == (45, 45)
    assert span("45–60 min") == (45, 60)
    assert span("3–4 h") == (180, 240)
    assert span("1 h 30") == (90, 90)
    assert span("50 min–1 h 15") == (50, 75)
    assert span("3 h 30–4 h 45") == (210, 285)
    with pytest.raises(ValueError):
        span("about 3 hours")


@pytest.mark.parametrize("lab", LABS)
def test_the_core_path_and_the_total_are_the_sums_of_the_rows(lab):
    b = budget(lab)
    rows = b["rows"]
    assert any(kind == "core" for kind, _, _ in rows), f"{lab}: no core row"
    assert b["core"] == summed(rows, {"core"}), f"{lab}: the core path is the sum of the core rows"
    if any(kind == "optional" for kind, _, _ in rows):
        assert b["total"] == summed(rows, {"core", "optional"}), f"{lab}: the total is the sum of all rows"
    else:
        assert b["total"] is None, f"{lab}: a total with the optional parts, but no optional row"


@pytest.mark.parametrize("lab", LABS)
def test_every_exercise_has_a_row(lab):
    nb = load(solution_notebook(lab))
    numbers = {
        int(n)
        for c in nb.cells
        if c.cell_type == "markdown"
        for n in re.findall(r"^### Exercise (\d+)", c.source, re.M)
    }
    named = set()
    for _, part, _ in budget(lab)["rows"]:
        for first, last in re.findall(r"\b(?:Exercises?|Ex) (\d+)(?:–(\d+))?", part):
            named.update(range(int(first), int(last or first) + 1))
    assert numbers <= named, f"{lab}: exercises with no row in the time table: {sorted(numbers - named)}"


def test_a_changed_row_breaks_the_claim(monkeypatch):
    """The check can fail: one row longer and the stated core path no longer holds."""
    real = load

    def longer(path):
        nb = real(path)
        cell = next(c for c in nb.cells if "| | part |" in c.get("source", ""))
        cell.source = re.sub(r"\| core \|(.*)\| ([^|]+) \|\n", r"| core |\1| 9 h |\n", cell.source, count=1)
        return nb

    monkeypatch.setattr(f"{__name__}.load", longer)
    b = budget(LABS[0])
    assert b["core"] != summed(b["rows"], {"core"})


def test_the_term_plan_gives_each_lab_its_core_time():
    text = TERM_PLAN.read_text()
    plan = dict(re.findall(r"^\| `(\d\d_\w+)` \| ([^|]+?) \|", text, re.M))
    assert sorted(plan) == LABS, "the term plan in grader/README.md has one row per lab"
    for lab in LABS:
        assert span(plan[lab]) == budget(lab)["core"], f"{lab}: the term plan's core time is the notebook's"
