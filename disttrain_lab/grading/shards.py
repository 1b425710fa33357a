"""A class split across machines and joined again: ``--shard I/N`` grades the students whose
name hashes to shard I of N (``in_shard``), so N machines with the same ``submitted/`` split
a class with no student in two shards; ``merge`` writes one grades CSV (nbgrader's export
format) from their gradebooks, refusing a student graded on two of them."""

from __future__ import annotations

import csv
import hashlib
import io
from pathlib import Path

from nbgrader.api import Gradebook, MissingEntry


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes I/N (this machine's shard I of N, 1 <= I <= N), got {text!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"--shard I/N needs 1 <= I <= N, got {i}/{n}")
    return i, n


def in_shard(student: str, shard: tuple[int, int]) -> bool:
    """Student ``student`` belongs to shard I of N by a hash of the name: the same on every machine,
    whatever else is in its submitted/ folder."""
    i, n = shard
    return int(hashlib.sha256(student.encode()).hexdigest(), 16) % n == i - 1


EXPORT_KEYS = (
    "assignment",
    "duedate",
    "timestamp",
    "student_id",
    "last_name",
    "first_name",
    "email",
    "raw_score",
    "late_submission_penalty",
    "score",
    "max_score",
)


def _export_rows(gradebook: Path) -> dict[tuple[str, str], tuple[bool, dict]]:
    """(assignment, student) -> (graded there, the row nbgrader's CSV export writes for it)."""
    rows = {}
    with Gradebook(f"sqlite:///{Path(gradebook).resolve()}") as gb:
        for assignment in gb.assignments:
            for student in gb.students:
                row = {
                    "assignment": assignment.name,
                    "duedate": assignment.duedate,
                    "student_id": student.id,
                    "last_name": student.last_name,
                    "first_name": student.first_name,
                    "email": student.email,
                    "max_score": assignment.max_score,
                }
                try:
                    submission = gb.find_submission(assignment.name, student.id)
                    present = True
                    penalty = submission.late_submission_penalty
                    row.update(
                        timestamp=submission.timestamp,
                        raw_score=submission.score,
                        late_submission_penalty=penalty,
                        score=max(0.0, submission.score - penalty),
                    )
                except MissingEntry:
                    present = False
                    row.update(timestamp="", raw_score=0.0, late_submission_penalty=0.0, score=0.0)
                rows[(assignment.name, student.id)] = (
                    present,
                    {k: "" if row[k] is None else str(row[k]) for k in EXPORT_KEYS},
                )
    return rows


def merge(gradebooks: list[Path], out: Path) -> tuple[int, list[str]]:
    """One grades CSV (nbgrader's export format) from the shards' gradebooks: each (lab, student)
    from the gradebook that graded it.  Returns (rows written, problems: a student graded on two)."""
    merged: dict[tuple[str, str], tuple[bool, dict, Path]] = {}
    problems = []
    for gradebook in gradebooks:
        for key, (present, row) in _export_rows(gradebook).items():
            seen = merged.get(key)
            if seen and seen[0] and present:
                problems.append(f"{key[1]} is graded for {key[0]} in both {seen[2]} and {gradebook}")
            if not seen or (present and not seen[0]):
                merged[key] = (present, row, gradebook)
    # nbgrader's order: assignments as the gradebook lists them (by due date, name), students by id
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(EXPORT_KEYS)
    for key in sorted(merged, key=lambda k: (k[0], k[1])):
        writer.writerow([merged[key][1][k] for k in EXPORT_KEYS])
    Path(out).write_text(buffer.getvalue())
    return len(merged), problems
