"""Where a course lives and the limits a grading run applies (``configure`` in ``__init__.py``
applies them to nbgrader; ``grader/nbgrader_config.py`` calls it)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from . import run_container, sandbox

# ----------------------------------------------------------------------------------------
# Where things live, and the limits (each overridable by an environment variable, so the
# config file, the CLI and the tests all agree).

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout: grader/, solutions/, labs/, the kit
GRADER_DIR = REPO_ROOT / "grader"


# the environment variables that name a course's three folders (grading.course passes them to nbgrader)
COURSE_DIR_ENV = "DISTTRAIN_COURSE_DIR"
SOURCE_DIR_ENV = "DISTTRAIN_SOURCE_DIR"
RELEASE_DIR_ENV = "DISTTRAIN_RELEASE_DIR"


def course_dir() -> Path:
    """gradebook.db, submitted/, autograded/, feedback/: outside the repo."""
    return Path(os.environ.get(COURSE_DIR_ENV, "~/.disttrain-lab/course")).expanduser().resolve()


def source_dir() -> Path:
    return Path(os.environ.get(SOURCE_DIR_ENV, REPO_ROOT / "solutions")).resolve()


def release_dir() -> Path:
    return Path(os.environ.get(RELEASE_DIR_ENV, REPO_ROOT / "labs")).resolve()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(float(value)) if value.strip() else default


def _env_bytes(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip().upper()
    if not value:
        return default
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    if value[-1] in units:
        return int(float(value[:-1]) * units[value[-1]])
    return int(value)


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, "") or default)


def _env_str(name: str, default: str) -> str:
    return os.environ.get(name, default).strip() or default


def _limit(variable: str, read, default):
    """A field of Limits whose default is read from the environment variable ``variable`` (named here only)."""
    return field(default_factory=lambda: read(variable, default), metadata={"variable": variable})


@dataclass
class Limits:
    cell_timeout: int = _limit("DISTTRAIN_CELL_TIMEOUT", _env_int, 180)
    # seconds for one cell; a correct lab cell takes well under a minute on 2 cores
    notebook_timeout: int = _limit("DISTTRAIN_NOTEBOOK_TIMEOUT", _env_int, 1500)
    # seconds for the whole notebook, kernel restarts and replays included
    kernel_memory: int = _limit("DISTTRAIN_KERNEL_MEMORY", _env_bytes, 4 * 2**30)
    # bytes of data per process (RLIMIT_DATA) in the kernel and every rank it starts
    student_timeout: int = _limit("DISTTRAIN_STUDENT_TIMEOUT", _env_int, 0)
    # hard cap on one student's nbgrader process; 0 = notebook_timeout + 5 minutes
    student_memory: int = _limit("DISTTRAIN_STUDENT_MEMORY", _env_bytes, 8 * 2**30)
    # bytes for one student's kernel and every rank, /tmp and /dev/shm included (sandbox only)
    student_pids: int = _limit("DISTTRAIN_STUDENT_PIDS", _env_int, 512)
    # processes + threads for one student's kernel and every rank (sandbox only)
    cell_time_scale: float = _limit("DISTTRAIN_CELL_TIME_SCALE", _env_float, 1)
    # multiplies the per-cell limits derived from the solution's own cell times (cell_times.py):
    # 2 on a grading machine twice as slow as the one that recorded them
    sandbox: str = _limit("DISTTRAIN_SANDBOX", _env_str, "auto")
    # "auto" (or "on"): sandbox each kernel with memory and process caps and the syscall
    # filter, and refuse to grade where the host cannot (sandbox.missing() says what lacks);
    # "limited": grade in whatever sandbox the host allows, without what it lacks, said loudly;
    # "container": no sandbox but another uid, rlimits and the syscall filter (run_container.py), for a
    # container without CAP_SYS_ADMIN, one student per container (Gradescope), said loudly;
    # "off": no sandbox, student code runs as the grader (trusted code only)

    def __post_init__(self):
        for name in ("cell_timeout", "notebook_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if self.student_timeout <= 0:
            self.student_timeout = self.notebook_timeout + 300
        if self.cell_time_scale <= 0:
            raise ValueError(
                f"cell_time_scale must be positive ({self.variable('cell_time_scale')}), got {self.cell_time_scale}"
            )
        if self.sandbox not in SANDBOX_MODES:
            raise ValueError(
                f"sandbox must be one of {', '.join(map(repr, SANDBOX_MODES))} ({self.variable('sandbox')}), "
                f"got {self.sandbox!r}"
            )

    @classmethod
    def variable(cls, name: str) -> str:
        """The environment variable that sets the limit ``name``."""
        return {f.name: f.metadata["variable"] for f in fields(cls)}[name]

    def environment(self) -> dict[str, str]:
        """These limits as environment variables: ``Limits()`` in a process given them is these limits
        (how the grader hands them to each nbgrader process)."""
        return {f.metadata["variable"]: str(getattr(self, f.name)) for f in fields(self)}

    def sandboxed(self) -> tuple[bool, str | None]:
        """(whether kernels run in the sandbox, why not when switched off).  Refuses (raises
        ``SandboxRefused``) where the host cannot sandbox, or gives no caps or no syscall filter,
        unless a setting opts out: hostile code is never graded unsandboxed by default."""
        if self.sandbox == "off":
            return False, f"switched off (sandbox='off' / {self.variable('sandbox')}=off)"
        if self.sandbox == "container":  # opt-in only: weaker than the sandbox (grader/README.md, Gradescope)
            why = run_container.problem()
            if why:
                raise SandboxRefused(f"{self.variable('sandbox')}=container cannot grade here: {why}")
            return False, f"{CONTAINER}: {run_container.SUMMARY}"
        why = sandbox.problem()
        if why:
            raise SandboxRefused(
                f"this host cannot isolate a student: {why}. Fix that (grader/README.md, 'Host requirements'), "
                f"or set {self.variable('sandbox')}=off to grade trusted code unsandboxed"
            )
        lacking = sandbox.missing()
        if lacking and self.sandbox != "limited":
            raise SandboxRefused(
                f"the sandbox on this host lacks: {'; '.join(lacking)}. Fix that (grader/README.md, "
                f"'Host requirements'), or set {self.variable('sandbox')}=limited to grade without it"
            )
        return True, None


SANDBOX_MODES = ("auto", "on", "limited", "off", "container")


class SandboxRefused(RuntimeError):
    """Grading would run hostile code without the isolation it needs, and no setting allows it."""


# when a failed prediction's feedback shows the cost model's value (grading/feedback_page.py,
# and the Gradescope package's results: grading/gradescope.py)
SHOW_EXPECTED_ENV = "DISTTRAIN_SHOW_EXPECTED"
SHOW_EXPECTED = ("after-deadline", "always", "never")


def show_expected() -> str:
    """``after-deadline`` (the default: once the assignment's due date has passed; never while it
    has none), ``always`` or ``never``, from ``$DISTTRAIN_SHOW_EXPECTED``."""
    value = os.environ.get(SHOW_EXPECTED_ENV, "after-deadline").strip().lower()
    if value not in SHOW_EXPECTED:
        raise ValueError(f"{SHOW_EXPECTED_ENV}={value!r}: use one of {', '.join(SHOW_EXPECTED)}")
    return value


def release_ignore(solutions: Path) -> list[str]:
    """CourseDirectory.ignore for generate_assignment: everything in a lab folder except
    its notebooks and its ``data/`` folder, so no solution module or answer file is
    ever copied into labs/."""
    ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback", ".*"]
    if solutions.is_dir():
        for lab in sorted(solutions.iterdir()):
            if lab.is_dir():
                for entry in sorted(lab.iterdir()):
                    if entry.suffix != ".ipynb" and entry.name != "data" and entry.name not in ignore:
                        ignore.append(entry.name)
    return ignore


NO_ISOLATION = (
    "\n*** disttrain-lab: grading WITHOUT isolation: {why}. Student code runs as the grader and "
    "can read and change the gradebook, solutions and other students' files. Grade as root on "
    "Linux with cgroups, or install bubblewrap (see grader/README.md, 'Host requirements'). ***\n"
)


LIMITED_ISOLATION = "\n*** disttrain-lab: grading with LIMITED isolation: {why} (see grader/README.md). ***\n"


# how Limits.sandboxed() names a grading in container mode: not the sandbox, but not the grader's uid either
CONTAINER = "container mode (DISTTRAIN_SANDBOX=container)"

CONTAINER_ISOLATION = "\n*** disttrain-lab: grading in {why} (see grader/README.md, 'Grading on Gradescope'). ***\n"


def isolation_notice(why: str) -> str:
    """The loud notice of a grading outside the sandbox, ``why`` as ``Limits.sandboxed()`` said it."""
    return (CONTAINER_ISOLATION if why.startswith(CONTAINER) else NO_ISOLATION).format(why=why)


def isolation_report(why: str) -> str:
    """The grade report's isolation line for a grading outside the sandbox."""
    return why if why.startswith(CONTAINER) else f"NONE: {why}; student code ran as the grader"
