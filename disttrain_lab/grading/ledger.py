"""What a class's grading has done: ``<course>/grading-state/<lab>.json`` (the ledger) records
each student once nbgrader has written their grade, with a digest of what was graded (the
submission, the lab's source, its cell-time record), so that a rerun grades only students who
are new or whose digest changed, and a run killed mid-way resumes where it stopped."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import cell_times, intake

LEDGER_DIR = "grading-state"


def submission_digest(course: Path, student: str, lab: str, source: Path) -> str:
    """Changes when what grading takes from the submission (intake.fingerprint: the notebook,
    never through a link, and the timestamp), the lab's source notebook or its cell-time
    record changes."""
    h = hashlib.sha256()
    h.update(intake.fingerprint(course / "submitted" / student / lab / f"{lab}.ipynb"))
    for path in (source / lab / f"{lab}.ipynb", cell_times.times_dir() / f"{lab}.json"):
        h.update(path.read_bytes() if path.exists() else b"-")
    return h.hexdigest()


@dataclass
class Outcome:
    """One student's grading, as the ledger keeps it."""

    student: str
    digest: str
    status: str  # "graded", "stopped" (the student's time cap), "failed" (nbgrader failed)
    seconds: float
    problems: list[str] = field(default_factory=list)
    finished: float = 0.0  # time.time() when it was recorded
    regraded: bool = True  # False: taken from the ledger, not graded in this run


class Ledger:
    """``<course>/grading-state/<lab>.json``: written whole (atomically) after every student."""

    def __init__(self, course: Path, lab: str):
        self.path = course / LEDGER_DIR / f"{lab}.json"
        self._lock = threading.Lock()
        try:
            raw = json.loads(self.path.read_text())["students"]
        except (OSError, ValueError, KeyError):
            raw = {}
        self.entries = {name: Outcome(**{**entry, "regraded": False}) for name, entry in raw.items()}

    def put(self, outcome: Outcome) -> None:
        with self._lock:
            self.entries[outcome.student] = outcome
            self.path.parent.mkdir(parents=True, exist_ok=True)
            part = self.path.with_suffix(f".part{os.getpid()}")
            part.write_text(
                json.dumps(
                    {
                        "students": {
                            n: {k: v for k, v in asdict(o).items() if k != "regraded"}
                            for n, o in sorted(self.entries.items())
                        }
                    },
                    indent=1,
                )
            )
            os.replace(part, self.path)
