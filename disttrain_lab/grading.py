"""Autograding that no submission can break: release, autograde, feedback, grades.

nbgrader does the bookkeeping (gradebook, checksums, hidden tests, feedback); this
module adds what a course on distributed training needs on top of it:

1. ``RobustExecute`` runs the notebook like nbgrader's ``Execute`` but survives the
   kernel dying (``os._exit``, a crash, out of memory) and cells that ignore the
   interrupt: it marks the cell with a message, restarts the kernel, replays the earlier
   cells to restore their definitions and carries on.  It also enforces a per-notebook
   wall-clock budget, a per-process memory limit in the kernel (and the ranks it starts),
   caps huge output while it arrives, and fails a graded test cell when code before it
   replaced ``torch.distributed`` or ``disttrain_lab`` functions.  Before each graded
   test cell it resets IPython's hooks and restores the names tests use
   (``kernel_guard.py``); where the host allows it, each kernel runs in a sandbox
   (``sandbox.py``: another user, private /tmp and /dev/shm, hidden grader files, cgroup
   caps, one pid namespace killed as a unit).
2. ``SubmissionExporter`` pre-checks each submission (empty file, malformed JSON, a
   notebook of another lab, metadata nbgrader chokes on) and grades such a file as the
   blank lab with a note at the top, so the feedback says why it scored 0.
3. ``RestoringOverwriteCells`` puts deleted test cells back wherever they were deleted.
4. ``FeedbackWithoutHiddenTests`` shows failing messages, not test code;
   ``scan_submission`` and ``grade_report`` flag what a human should look at.
5. ``release`` / ``autograde`` / ``generate_feedback`` / ``export_grades`` and the two
   command-line entry points ``cli_release`` and ``cli_grade``.  Each student is graded
   in its own ``nbgrader`` process under a wall-clock cap, in a private temp directory,
   and every process it started is gone afterwards.

The wiring lives in ``grader/nbgrader_config.py``, so plain ``nbgrader autograde`` run
from ``grader/`` behaves exactly like ``disttrain-lab grade``.
"""
from __future__ import annotations

import argparse
import ast
import atexit
import copy
import hmac
import json
import re
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty

import nbformat
from jupyter_core.utils import ensure_async, run_sync
from jupyter_client.manager import AsyncKernelManager
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbconvert.exporters import NotebookExporter
from nbgrader.preprocessors import ClearHiddenTests, Execute, NbGraderPreprocessor, OverwriteCells
from traitlets import Float, Integer, Unicode

from . import cell_times, sandbox
from .kernel_guard import GUARD_SOURCE, KEY_PLACEHOLDER, signature

# ----------------------------------------------------------------------------------------
# Where things live, and the limits (each overridable by an environment variable, so the
# config file, the CLI and the tests all agree).

REPO_ROOT = Path(__file__).resolve().parent.parent
GRADER_DIR = REPO_ROOT / "grader"


def course_dir() -> Path:
    """gradebook.db, submitted/, autograded/, feedback/: outside the repo."""
    return Path(os.environ.get("DISTTRAIN_COURSE_DIR", "~/.disttrain-lab/course")).expanduser().resolve()


def source_dir() -> Path:
    return Path(os.environ.get("DISTTRAIN_SOURCE_DIR", REPO_ROOT / "solutions")).resolve()


def release_dir() -> Path:
    return Path(os.environ.get("DISTTRAIN_RELEASE_DIR", REPO_ROOT / "labs")).resolve()


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


@dataclass
class Limits:
    cell_timeout: int = field(default_factory=lambda: _env_int("DISTTRAIN_CELL_TIMEOUT", 180))
    # seconds for one cell; a correct lab cell takes well under a minute on 2 cores
    notebook_timeout: int = field(default_factory=lambda: _env_int("DISTTRAIN_NOTEBOOK_TIMEOUT", 1500))
    # seconds for the whole notebook, kernel restarts and replays included
    kernel_memory: int = field(default_factory=lambda: _env_bytes("DISTTRAIN_KERNEL_MEMORY", 4 * 2**30))
    # bytes of data per process (RLIMIT_DATA) in the kernel and every rank it starts
    student_timeout: int = field(default_factory=lambda: _env_int("DISTTRAIN_STUDENT_TIMEOUT", 0))
    # hard cap on one student's nbgrader process; 0 = notebook_timeout + 5 minutes
    student_memory: int = field(default_factory=lambda: _env_bytes("DISTTRAIN_STUDENT_MEMORY", 8 * 2**30))
    # bytes for one student's kernel and every rank, /tmp and /dev/shm included (sandbox only)
    student_pids: int = field(default_factory=lambda: _env_int("DISTTRAIN_STUDENT_PIDS", 512))
    # processes + threads for one student's kernel and every rank (sandbox only)
    cell_time_scale: float = field(default_factory=lambda: float(os.environ.get("DISTTRAIN_CELL_TIME_SCALE", "") or 1))
    # multiplies the per-cell limits derived from the solution's own cell times (cell_times.py):
    # 2 on a grading machine twice as slow as the one that recorded them
    sandbox: str = field(default_factory=lambda: os.environ.get("DISTTRAIN_SANDBOX", "auto").strip() or "auto")
    # "auto": sandbox each kernel where the host can (root, cgroup v1, namespaces), and say
    # loudly where it cannot; "on": refuse to grade without it; "off": grade as the grader

    def __post_init__(self):
        for name in ("cell_timeout", "notebook_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if self.student_timeout <= 0:
            self.student_timeout = self.notebook_timeout + 300
        if self.cell_time_scale <= 0:
            raise ValueError(f"cell_time_scale must be positive (DISTTRAIN_CELL_TIME_SCALE), got {self.cell_time_scale}")
        if self.sandbox not in ("auto", "on", "off"):
            raise ValueError(f"sandbox must be 'auto', 'on' or 'off' (DISTTRAIN_SANDBOX), got {self.sandbox!r}")

    def sandboxed(self) -> tuple[bool, str | None]:
        """(whether kernels run in the sandbox, why not where the host cannot)."""
        if self.sandbox == "off":
            return False, "switched off (sandbox='off' / DISTTRAIN_SANDBOX=off)"
        why = sandbox.problem()
        if why and self.sandbox == "on":
            raise RuntimeError(f"sandbox='on' but this host cannot isolate a student: {why}")
        return why is None, why


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


# ----------------------------------------------------------------------------------------
# Executing a submission.

def _error_output(ename: str, message: str) -> nbformat.NotebookNode:
    # an error output is what makes nbgrader give a graded cell 0 points
    return nbformat.v4.new_output("error", ename=ename, evalue=message,
                                  traceback=[f"\x1b[0;31m{ename}\x1b[0m: {message}"])


NOTES_FILE = ".disttrain-grading.json"   # next to the autograded notebook; read by the grade report


def _grade_id(cell) -> str:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "?")


def _is_test_cell(cell) -> bool:
    nbg = cell.get("metadata", {}).get("nbgrader", {})
    return bool(nbg.get("grade")) and not nbg.get("solution")


def _is_instructor_cell(cell) -> bool:
    # locked cells that are neither graded nor a solution (a lab's setup cell): nbgrader
    # restores their source from the gradebook, so the names they bind are the lab's own
    nbg = cell.get("metadata", {}).get("nbgrader", {})
    return bool(nbg.get("locked")) and not nbg.get("grade") and not nbg.get("solution")


def _clamp_partial_credit(cell) -> None:
    """nbgrader reads a number a test cell returns as partial credit and fails the whole
    notebook when it exceeds the cell's points: keep it within [0, points]."""
    points = float(cell.metadata.nbgrader.get("points", 0))
    for output in cell.outputs:
        if output.output_type == "execute_result":
            try:
                value = float(output.get("data", {}).get("text/plain", ""))
            except (TypeError, ValueError):
                return
            if not 0 <= value <= points:
                output.data["text/plain"] = repr(min(max(value, 0.0), points))
            return


def _names_used(source: str) -> list[str]:
    return sorted(set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", source)))


def _names_bound(source: str) -> list[str]:
    """Top-level names a cell binds (imports, defs, classes, plain assignments)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    names = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names += [(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names += [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
    return names


# Run by the grader when the guard's answer was forged: drop the shell's own methods that
# a solution cell shadowed on the instance (user_expressions evaluates the guard's call).
_REPAIR_SHELL = (
    "_ip = get_ipython()\n"
    "for _n in ('user_expressions', 'run_cell', 'run_cell_async', 'run_ast_nodes', 'run_code', 'ev', 'ex',\n"
    "           'showtraceback', '_showtraceback', 'set_custom_exc', 'transform_cell'):\n"
    "    vars(_ip).pop(_n, None)\n"
    "del _ip, _n\n")


def _guard_call(function: str, names: list[str], *extra: str) -> str:
    args = ", ".join([repr(names), *map(repr, extra)])
    return f"__import__('sys').modules['_disttrain_grading_guard'].{function}({args})"


def _growth(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


class SandboxKernelManager(AsyncKernelManager):
    """Starts the kernel through disttrain_lab/sandbox.py (set ``sandbox_spec`` first)."""
    sandbox_spec: dict = {}

    def format_kernel_cmd(self, extra_arguments=None):
        return sandbox.command(self.sandbox_spec, super().format_kernel_cmd(extra_arguments))


def _git_paths(root: Path = REPO_ROOT) -> list[str]:
    """The repository's git data: its objects hold every solution and hidden test.  In a
    worktree ``.git`` is a file naming the real git directory (and its common one)."""
    git = root / ".git"
    if not git.is_file():
        return [str(git)]
    found = [str(git)]
    text = git.read_text(errors="replace").strip()
    if text.startswith("gitdir:"):
        gitdir = (root / text[len("gitdir:"):].strip()).resolve()
        found.append(str(gitdir))
        common = gitdir / "commondir"
        if common.is_file():
            found.append(str((gitdir / common.read_text().strip()).resolve()))
    return found


def _hidden_paths() -> list[str]:
    """What a sandboxed kernel must not see: the course (gradebook, every submission),
    the solutions and the repository's git data (which holds them too), the grading temp
    dir, the grader's home, and $DISTTRAIN_SANDBOX_HIDE."""
    extra = [p for p in os.environ.get("DISTTRAIN_SANDBOX_HIDE", "").split(os.pathsep) if p]
    return [str(course_dir()), str(source_dir()), *_git_paths(), tempfile.gettempdir(),
            os.path.expanduser("~"), *extra]


def _kept_paths() -> list[str]:
    """What it must read: the interpreter and the kit (bound back read-only where hidden)."""
    return sorted({sys.base_prefix, sys.prefix, str(REPO_ROOT)})


class RobustExecute(Execute):
    """nbgrader's Execute, made to survive any submission (see the module docstring)."""

    notebook_timeout = Integer(1500, help="wall-clock seconds for the whole notebook").tag(config=True)
    memory_limit = Integer(4 * 2**30, help="RLIMIT_DATA bytes per kernel/rank process; 0 = none").tag(config=True)
    max_output_bytes = Integer(2_000_000, help="output kept per cell; more fails the cell").tag(config=True)
    probe_timeout = Integer(10, help="seconds an interrupted kernel has to answer again").tag(config=True)
    sandbox = Unicode("off", help="'on': every kernel runs in disttrain_lab.sandbox; 'off': as the grader").tag(config=True)
    sandbox_uid = Integer(64123, help="unprivileged uid (and gid) the sandboxed kernel runs as").tag(config=True)
    student_memory = Integer(8 * 2**30, help="bytes for a sandboxed kernel and all it starts, /dev/shm and /tmp included").tag(config=True)
    student_pids = Integer(512, help="processes and threads for a sandboxed kernel and all it starts").tag(config=True)
    cell_time_scale = Float(1.0, help="multiplies the per-cell limits derived from the solution's cell times").tag(config=True)

    # -- the notebook loop ---------------------------------------------------------------

    def preprocess(self, nb, resources=None, km=None):
        self._deadline = time.monotonic() + self.notebook_timeout
        self._replayable: list[int] = []      # earlier cells that rebuild the kernel's state
        self._guard_ready = False
        self._instructor_cells: list[int] = []
        self._kernel_kwargs = {}
        self._notes: list[str] = []
        self._last_status = None
        self._output_bytes, self._output_capped = 0, False
        self._cell_seconds: dict[str, float] = {}     # this run's time per cell (recorded for the solution)
        lab = ((resources or {}).get("nbgrader") or {}).get("assignment")
        self._cell_limits = cell_times.limits_for(lab, self.cell_time_scale) if lab else {}
        try:
            return super().preprocess(nb, resources, km)
        finally:
            self._write_notes(resources)

    def preprocess_cell(self, cell, resources, index):
        self._check_assign_resources(resources)
        if cell.cell_type != "code" or not cell.source.strip():
            return cell, self.resources
        remaining = self._deadline - time.monotonic()
        if remaining < 1:
            cell.outputs = [_error_output("NotebookTimeout", (
                f"not run: the whole notebook may take at most {self.notebook_timeout} s "
                "when graded, and the cells above used it up"))]
            return cell, self.resources
        names = _names_used(cell.source) if _is_test_cell(cell) else []
        traffic = None
        if _is_test_cell(cell):
            replaced, notes, traced = self._guard("before_test", names)
            traffic = (traced, self._loopback_bytes())
            self._notes += [f"{_grade_id(cell)}: put back before the test: {n}" for n in notes]
            if replaced:
                self._notes.append(f"{_grade_id(cell)}: replaced before the test (scored 0): {', '.join(replaced)}")
                cell.outputs = [_error_output("TamperingError", (
                    "grading relies on the genuine " + ", ".join(replaced) + ", but code above "
                    "replaced it; this exercise gets 0 (the originals were put back for the rest)"))]
                return cell, self.resources
        key = cell_times.cell_key(cell)
        # the solution's own time for this cell, times a generous factor (cell_times.py), else the cell limit
        limit = int(max(1, min(self._cell_limits.get(key) or self.timeout or remaining, remaining)))
        cell_timeout = self.timeout
        self.timeout = limit
        self.error_on_timeout = {"ename": "CellTimeoutError", "evalue": "", "traceback": [
            f"\x1b[0;31mCellTimeoutError\x1b[0m: this cell ran longer than the {limit} s "
            "allowed when grading (an infinite loop, a deadlock, a long sleep?) and was stopped"]}
        self._output_bytes, self._output_capped = 0, False
        started = time.monotonic()
        self._last_status = None
        try:
            cell = self.execute_cell(cell, index, store_history=True)
        except DeadKernelError:
            cell.outputs.append(_error_output("DeadKernelError", (
                "the kernel died while running this cell (os._exit / crash / out of memory); "
                "it was restarted and the cells above were run again")))
            self._restart_and_replay()
            return cell, self.resources
        except CellTimeoutError:
            cell.outputs.append(_error_output("CellTimeoutError", (
                f"this cell ran longer than the {limit} s allowed when grading and did not stop "
                "when interrupted; the kernel was restarted and the cells above were run again")))
            self._restart_and_replay()
            return cell, self.resources
        finally:
            self.timeout = cell_timeout
            self._cell_seconds[key] = round(time.monotonic() - started, 3)
        timed_out = any(o.output_type == "error" and o.ename == "CellTimeoutError" for o in cell.outputs)
        if _is_test_cell(cell) and not timed_out:
            changed, _, traced = self._guard("after_test", names)
            claimed, counted = _growth(traffic[0], traced), _growth(traffic[1], self._loopback_bytes())
            if changed:        # the student's code, called by the test, changed what the test relies on
                self._notes.append(f"{_grade_id(cell)}: changed while the test ran: {', '.join(changed)}")
                cell.outputs.append(_error_output("TamperingError", (
                    "while this test ran, code it called changed " + ", ".join(changed) + "; the result "
                    "cannot be trusted, so this exercise gets 0 (the originals were put back)")))
            elif claimed is not None and counted is not None and claimed > counted:
                self._notes.append(f"{_grade_id(cell)}: the trace claims {claimed} B sent point to point, "
                                   f"the operating system counted {counted} B")
                cell.outputs.append(_error_output("TrafficError", (
                    f"the traces of this test's launches say the ranks sent {claimed:,} bytes point to "
                    f"point, but the operating system counted only {counted:,} bytes on the ranks' network "
                    "while the cell ran (it counts every byte sent between ranks, headers included, so it "
                    "can only be more): the trace was altered, or data moved some other way than "
                    "torch.distributed; this exercise gets 0")))
            elif self._last_status not in ("ok", None) and not any(o.output_type == "error" for o in cell.outputs):
                cell.outputs.append(_error_output("GradingError", (
                    f"the test did not pass (the kernel answered {self._last_status!r})")))
            _clamp_partial_credit(cell)
        elif _is_instructor_cell(cell):
            self._record_instructor_names(index)
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if any(o.ename == "CellTimeoutError" for o in errors):
            if not self._kernel_answers():
                cell.outputs.append(_error_output("CellTimeoutError", (
                    "the cell did not stop when interrupted; the kernel was restarted and "
                    "the cells above were run again")))
                self._restart_and_replay()
        elif not _is_test_cell(cell) and (not errors or time.monotonic() - started < 10):
            self._replayable.append(index)
        return cell, self.resources

    # -- kernel start: memory limit and the tampering guard -------------------------------

    def create_kernel_manager(self):
        km = super().create_kernel_manager()
        if self.sandbox == "on":
            km.__class__ = SandboxKernelManager
            km.sandbox_spec = sandbox.spec(
                uid=self.sandbox_uid + int(os.environ.get("DISTTRAIN_SANDBOX_SLOT", "0")),  # one uid per parallel job
                memory=self.student_memory, pids=self.student_pids,
                data_limit=self.memory_limit, cgroup=os.environ.get("DISTTRAIN_SANDBOX_CGROUP", "disttrain-lab/plain"),
                hide=_hidden_paths(), keep=_kept_paths())
            # the sandbox has its own network namespace: ZMQ over unix sockets in a folder
            # made for this kernel (the sandbox binds it in and removes it); a unix socket's
            # path holds at most 107 bytes, so a deep temp dir gives way to /tmp
            where = tempfile.gettempdir() if len(tempfile.gettempdir()) < 60 else "/tmp"
            km.transport, km.ip = "ipc", os.path.join(tempfile.mkdtemp(prefix="ipc-", dir=where), "k")
            atexit.register(shutil.rmtree, os.path.dirname(km.ip), True)   # (a killed wrapper cannot)
        elif self.sandbox != "off":
            raise ValueError(f"RobustExecute.sandbox must be 'on' or 'off', got {self.sandbox!r}")
        return km

    def start_new_kernel(self, **kwargs):
        # a restarted kernel starts where the first one did (the submission's folder)
        kwargs = self._kernel_kwargs = kwargs or getattr(self, "_kernel_kwargs", {})
        super().start_new_kernel(**kwargs)
        pid = getattr(getattr(self.km, "provisioner", None), "pid", None)
        if self.memory_limit and pid and self.sandbox != "on":   # (the sandbox sets it before the kernel starts)
            import resource
            # hard and soft: the kernel cannot raise it back; ranks it forks/spawns inherit it
            resource.prlimit(pid, resource.RLIMIT_DATA, (self.memory_limit, self.memory_limit))

    startup_retries = Integer(2, help="times a kernel that dies while starting is started again").tag(config=True)

    def start_new_kernel_client(self):
        for attempt in range(self.startup_retries + 1):
            try:
                kc = super().start_new_kernel_client()
                break
            except RuntimeError as exc:        # "Kernel died before replying to kernel_info"
                if attempt == self.startup_retries:
                    raise
                self.log.warning("the kernel died while starting (%s); starting it again", exc)
                if self.km is not None:
                    self._stop_kernel()
                self.km = self.create_kernel_manager()
                self.start_new_kernel()
        self._guard_key = secrets.token_bytes(32)      # signs the guard's answers (kernel_guard.py)
        self._guard_ready = self._run_quietly(GUARD_SOURCE.replace(KEY_PLACEHOLDER, self._guard_key.hex()),
                                              timeout=120) is not None
        return kc

    def _guard(self, function: str, names: list[str]) -> tuple[list[str], list[str], int | None]:
        """(problems, notes, traced bytes) from the guard in the kernel; see
        disttrain_lab/kernel_guard.py.  An answer that is not the guard's own (signed) is a
        problem; the grader then puts back IPython's own evaluation methods and asks once
        more, so that later tests are graded on their merits."""
        if not self._guard_ready:
            return [], [], None
        problems, notes, traced = self._ask_guard(function, names)
        if problems and problems[0].startswith("grading guard"):
            self._run_quietly(_REPAIR_SHELL, timeout=30)
            again, notes, traced = self._ask_guard(function, names)
            problems = problems + [p for p in again if not p.startswith("grading guard")] \
                if not (again and again[0].startswith("grading guard")) else again
        return problems, notes, traced

    def _ask_guard(self, function: str, names: list[str]) -> tuple[list[str], list[str], int | None]:
        nonce = secrets.token_hex(16)
        reply = self._run_quietly("", timeout=30, expression=_guard_call(function, names, nonce))
        if reply is None:          # busy past 30 s (or gone): a clean state cannot be shown
            return ["grading guard (it did not answer within 30 s)"], [], None
        result = reply.get("user_expressions", {}).get("r", {})
        if result.get("status") != "ok":
            return ["grading guard (it was removed)"], [], None
        try:
            problems, notes, traced, mac = ast.literal_eval(result["data"]["text/plain"])
            problems, notes = list(problems), list(notes)
        except (KeyError, ValueError, SyntaxError, TypeError):
            return ["grading guard (it was altered)"], [], None
        if not (isinstance(mac, str) and hmac.compare_digest(mac, signature(self._guard_key, nonce, (problems, notes, traced)))):
            return ["grading guard (its answer was not the guard's own: IPython's evaluation was replaced)"], [], None
        return [str(p) for p in problems], [str(n) for n in notes], traced if isinstance(traced, int) else None

    def _loopback_bytes(self) -> int | None:
        """What the OS counted on the kernel's loopback so far (sandbox.loopback_bytes)."""
        pid = getattr(getattr(self.km, "provisioner", None), "pid", None)
        return sandbox.loopback_bytes(pid) if pid else None

    def _record_instructor_names(self, index: int) -> None:
        if index not in self._instructor_cells:
            self._instructor_cells.append(index)
        names = _names_bound(self.nb.cells[index].source)
        if self._guard_ready and names:
            self._run_quietly("", timeout=30, expression=_guard_call("record", names))

    async def _check_raise_for_error(self, cell, cell_index, exec_reply):
        self._last_status = (exec_reply or {}).get("content", {}).get("status")
        return await super()._check_raise_for_error(cell, cell_index, exec_reply)

    def _write_notes(self, resources) -> None:
        """What the guard put back or caught, for the grade report (never shown to the student)."""
        path = (resources or {}).get("metadata", {}).get("path")
        if path and os.path.isdir(path):
            with open(os.path.join(path, NOTES_FILE), "w") as f:
                json.dump({"notes": self._notes, "sandbox": self.sandbox, "cell_seconds": self._cell_seconds}, f, indent=1)

    # -- restart and replay ----------------------------------------------------------------

    def _kernel_answers(self) -> bool:
        try:
            return self._run_quietly("pass", timeout=self.probe_timeout) is not None
        except DeadKernelError:
            return False

    def _restart_and_replay(self) -> None:
        self._stop_kernel()
        self.km = self.create_kernel_manager()
        self.start_new_kernel()
        self.start_new_kernel_client()
        for index in sorted(set(self._replayable) | set(self._instructor_cells)):
            remaining = self._deadline - time.monotonic()
            if remaining < 1:
                return
            try:
                reply = self._run_quietly(self.nb.cells[index].source, timeout=min(self.timeout, remaining))
            except DeadKernelError:
                reply = None
            if reply is None:          # it hangs or kills the kernel now: drop it and start over
                for kept in (self._replayable, self._instructor_cells):
                    if index in kept:
                        kept.remove(index)
                self._restart_and_replay()
                return
            if index in self._instructor_cells:
                self._record_instructor_names(index)

    def _stop_kernel(self) -> None:
        async def stop():
            if self.kc is not None:
                self.kc.stop_channels()
            try:
                await ensure_async(self.km.shutdown_kernel(now=True))
            except Exception as exc:       # already dead: nothing to stop
                self.log.debug("stopping the kernel: %s", exc)
            try:
                await ensure_async(self.km.cleanup_resources())
            except Exception as exc:
                self.log.debug("cleaning up the kernel: %s", exc)
        run_sync(stop)()
        self.kc, self.km = None, None

    def _run_quietly(self, code: str, timeout: float, expression: str | None = None) -> dict | None:
        """Execute code without recording outputs; the reply content, or None on timeout."""
        async def run():
            msg_id = self.kc.execute(code, silent=True, store_history=False, allow_stdin=False,
                                     stop_on_error=False,
                                     user_expressions={"r": expression} if expression else None)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    msg = await ensure_async(self.kc.shell_channel.get_msg(timeout=min(1.0, max(0.01, deadline - time.monotonic()))))
                except Empty:
                    if not await ensure_async(self.kc.is_alive()):
                        raise DeadKernelError("Kernel died") from None
                    continue
                if msg["parent_header"].get("msg_id") == msg_id:
                    return msg["content"]
            return None
        return run_sync(run)()

    # -- output cap ------------------------------------------------------------------------

    def output(self, outs, msg, display_id, cell_index):
        content = msg.get("content", {})
        self._output_bytes += len(content.get("text", "")) + sum(len(str(v)) for v in content.get("data", {}).values())
        if self._output_bytes > self.max_output_bytes:
            if not self._output_capped:
                self._output_capped = True
                outs.append(_error_output("OutputLimitExceeded", (
                    f"this cell printed more than {self.max_output_bytes // 1000} kB; the rest "
                    "of its output was dropped and the cell counts as failed")))
            return None
        return super().output(outs, msg, display_id, cell_index)


# ----------------------------------------------------------------------------------------
# Sanitizing a submission.

class RestoringOverwriteCells(OverwriteCells):
    """OverwriteCells whose deleted-test-cell restore never fails: nbgrader's own version
    only looks for the previous *graded* cell and raises KeyError when the cell before a
    deleted test is, e.g., a locked markdown cell."""

    def preprocess_cell(self, cell, resources, index):
        """Put the gradebook's nbgrader flags back first: one flipped ``grade``/``solution``/
        ``locked`` flag would otherwise make the checksum check fail the whole notebook."""
        from nbgrader.api import MissingEntry, TaskCell
        nbg = cell.get("metadata", {}).get("nbgrader", {})
        grade_id = nbg.get("grade_id")
        if grade_id is not None:
            def find(kind):
                try:
                    return getattr(self.gradebook, f"find_{kind}_cell")(grade_id, self.notebook_id, self.assignment_id)
                except MissingEntry:
                    return None
            source_cell = find("source")
            if source_cell is not None:
                graded, solution = find("graded"), find("solution")
                genuine = {"grade": graded is not None and not isinstance(graded, TaskCell),
                           "solution": solution is not None, "locked": bool(source_cell.locked),
                           "task": isinstance(graded, TaskCell)}
                for flag, value in genuine.items():
                    if bool(nbg.get(flag, False)) != value:
                        self.report_change(grade_id, flag, value, nbg.get(flag))
                        nbg[flag] = value
                if graded is not None:
                    nbg["points"] = float(graded.max_score)
        return super().preprocess_cell(cell, resources, index)

    def add_missing_grade_cells(self, nb, resources):
        source_nb = self.gradebook.find_notebook(self.notebook_id, self.assignment_id)
        source_cells = list(source_nb.source_cells)
        grade_cells = {c.name: c for c in source_nb.grade_cells}
        solution_ids = {c.name for c in source_nb.solution_cells}
        for pos, source_cell in enumerate(source_cells):
            present = {c.metadata["nbgrader"]["grade_id"]: i for i, c in enumerate(nb.cells)
                       if "grade_id" in c.get("metadata", {}).get("nbgrader", {})}
            if source_cell.name not in grade_cells or source_cell.name in present:
                continue
            self.log.warning("Missing grade cell %s: adding it back", source_cell.name)
            restored = self.missing_cell_transform(source_cell, grade_cells[source_cell.name].max_score,
                                                   is_solution=source_cell.name in solution_ids)
            before = [present[c.name] for c in source_cells[:pos] if c.name in present]
            nb.cells.insert(max(before) + 1 if before else 0, restored)
        return nb, resources


class SubmissionProblem(Exception):
    """Why a submitted file cannot be graded as it is (said to the student)."""


class SubmissionExporter(NotebookExporter):
    """Reads submissions for nbgrader autograde; a file that is not a gradable notebook of
    this lab is replaced by the blank lab with a note saying why (so it scores 0 with a
    reason in the feedback, instead of failing the grader run)."""

    max_submission_bytes = Integer(50_000_000).tag(config=True)

    def from_filename(self, filename, resources=None, **kw):
        if not getattr(self.parent, "_sanitizing", False):
            return super().from_filename(filename, resources, **kw)
        resources = resources or {}
        resources.setdefault("metadata", {})
        resources["metadata"].update(name=Path(filename).stem, path=os.path.dirname(filename))
        pristine = copy.deepcopy(resources)
        try:
            nb = self._read(filename)
            self._check_lab(nb, resources["nbgrader"])
            return self.from_notebook_node(nb, resources, **kw)
        except SubmissionProblem as problem:
            reason = str(problem)
        except Exception as exc:
            if type(exc).__module__.startswith("sqlalchemy"):
                raise              # the gradebook itself is broken: not the student's fault
            reason = f"could not be processed by the grader ({type(exc).__name__}: {exc})"
        self.log.warning("Submission %s %s: grading it as the blank lab", filename, reason)
        return self.from_notebook_node(self._blank(pristine["nbgrader"], reason), pristine, **kw)

    def _read(self, filename: str) -> nbformat.NotebookNode:
        size = os.path.getsize(filename)
        if size == 0:
            raise SubmissionProblem("is an empty file")
        if size > self.max_submission_bytes:
            raise SubmissionProblem(f"is {size // 10**6} MB, more than the {self.max_submission_bytes // 10**6} MB allowed")
        with open(filename, encoding="utf-8", errors="replace") as f:
            text = f.read()
        try:
            json.loads(text)
        except ValueError as exc:
            raise SubmissionProblem(f"is not valid notebook JSON ({exc})") from None
        try:
            nb = nbformat.reads(text, as_version=4)
            nbformat.validate(nb)
        except Exception as exc:
            raise SubmissionProblem(f"is not a valid Jupyter notebook ({type(exc).__name__}: {str(exc)[:200]})") from None
        return nb

    def _check_lab(self, nb, ids: dict) -> None:
        from nbgrader.api import Gradebook
        with Gradebook(ids["db_url"]) as gb:
            expected = {c.name for c in gb.find_notebook(ids["notebook"], ids["assignment"]).source_cells}
        present = {c.get("metadata", {}).get("nbgrader", {}).get("grade_id") for c in nb.cells} - {None}
        ours, foreign = present & expected, present - expected
        if expected and (not ours or len(foreign) > len(ours)):
            raise SubmissionProblem(f"is not the notebook of lab {ids['assignment']} (its exercise cells "
                                    "are not this lab's: another lab, or cells copied into a new notebook?)")

    def _blank(self, ids: dict, reason: str) -> nbformat.NotebookNode:
        coursedir = self.parent.coursedir
        released = Path(coursedir.format_path(coursedir.release_directory, ".", ids["assignment"])) / f"{ids['notebook']}.ipynb"
        nb = nbformat.read(released, as_version=4) if released.exists() else nbformat.v4.new_notebook()
        note = (f"**Grading note:** your submitted `{ids['notebook']}.ipynb` {reason}, so it was graded "
                "as the blank lab: every exercise scores 0. Fix the file and submit again, or ask your instructor.")
        nb.cells.insert(0, nbformat.v4.new_markdown_cell(note))
        for cell in nb.cells:
            cell.pop("id", None)
        nbformat.validator.normalize(nb)
        return nbformat.from_dict(nb)


class FeedbackWithoutHiddenTests(ClearHiddenTests):
    """Feedback step: the student sees each failing test's message, never the test code:
    hidden test regions are cut from graded cells, and their error tracebacks (which
    quote the failing line) are cut to their last line, ``Error: message``."""
    enforce_metadata = False

    def preprocess_cell(self, cell, resources, index):
        if not _is_test_cell(cell):
            return cell, resources
        cell, resources = super().preprocess_cell(cell, resources, index)
        for output in cell.get("outputs", []):
            if output.output_type == "error":   # a traceback's last line is "Error: message"
                output.traceback = output.traceback[-1:] or [f"\x1b[0;31m{output.ename}\x1b[0m: {output.evalue}"]
        return cell, resources


# Constructs a grader should look at; a match only flags the submission for a human.
HOSTILE_CONSTRUCTS = {
    "IPython hook APIs": r"get_ipython\s*\(|set_custom_exc|\.events\.register|ast_transformers|input_transformers|"
                         r"displayhook|excepthook|showtraceback|run_cell",
    "frame or object-graph introspection": r"\bimport\s+(gc|inspect)\b|\bfrom\s+(gc|inspect)\s+import|\bgc\.|"
                                           r"\binspect\.|sys\._getframe|f_back|f_globals|settrace|setprofile",
    "code-object surgery": r"__code__|__defaults__|__kwdefaults__|__globals__|sys\.modules",
    "ctypes / native code": r"\bctypes\b|\bcffi\b|\bmmap\b",
    "process or file-system probing": r"/proc\b|/dev/shm|sqlite3|gradebook|\.\./|\bos\.kill|\bkillpg\b|"
                                      r"\bsetsid\b|setpgid|\bos\.fork\b|daemon",
    "builtins": r"\bbuiltins\b|__builtins__|__import__",
    # a trace's events can be forged from inside a rank; the grader's byte count catches sends
    # that never happened, these show where the data may have moved instead
    "the tracer's internals, or a channel besides torch.distributed":
        r"\b_REC\b|_RUN_OBSERVERS|\btrace\._|\bsocket\b|shared_memory|\bmultiprocessing\b|\bos\.pipe\b|\bzmq\b",
}


def scan_submission(path: Path) -> list[str]:
    """Flags for a human: the student-editable cells of a submitted notebook that use a
    grader-hostile construct (one line per construct: the kind, the cell, the text).
    Flagging never changes a score."""
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as exc:
        return [f"could not be read for the scan ({type(exc).__name__})"]
    flags = []
    for index, cell in enumerate(nb.cells):
        nbg = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type != "code" or (nbg.get("locked") and not nbg.get("solution")):
            continue                      # locked cells are restored from the gradebook anyway
        for kind, pattern in HOSTILE_CONSTRUCTS.items():
            found = sorted({m.group(0) for m in re.finditer(pattern, cell.source)})
            if found:
                where = nbg.get("grade_id") or f"cell {index}"
                flags.append(f"{kind} in {where}: {', '.join(found)[:120]}")
    return flags


def grade_report(lab: str, students: list[str], results: dict, course: Path,
                 isolation: str | None) -> Path:
    """<course>/reports/<lab>.txt: how each student was graded and what a human should look
    at (grading failures, what the guard put back or caught, hostile constructs)."""
    lines = [f"Grade report for {lab}",
             "isolation: " + ("every kernel sandboxed (see grader/README.md, 'Threat model')" if isolation is None
                              else f"NONE: {isolation}; student code ran as the grader")
             + (f"\nisolation LIMITED: {sandbox.caveat()}" if isolation is None and sandbox.caveat() else ""), ""]
    for student in students:
        result = results.get(student)
        status = "ok" if result and result.returncode == 0 else \
            ("STOPPED (time cap)" if result and result.timed_out else "FAILED")
        notes_path = course / "autograded" / student / lab / NOTES_FILE
        try:
            notes = json.loads(notes_path.read_text()).get("notes", [])
        except (OSError, ValueError):
            notes = []
        flags = scan_submission(course / "submitted" / student / lab / f"{lab}.ipynb")
        lines.append(f"{student}: grading {status}" + ("" if notes or flags else ", nothing to look at"))
        lines += [f"  guard: {n}" for n in notes] + [f"  flag: {f}" for f in flags]
    path = course / "reports" / f"{lab}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


class StampInstallSource(NbGraderPreprocessor):
    """Release step: write where the kit installs from into each lab's setup cell (the line
    ``DISTTRAIN_LAB_PIP = "..."``), so a fresh kernel (Colab) can install it.

    Set it once in grader/nbgrader_config.py, e.g. ``c.StampInstallSource.pip_requirement =
    "wheel:https://raw.githubusercontent.com/ORG/REPO/main/labs/wheels"``; the choices and
    what each stamps are in :mod:`disttrain_lab.release`.  ``$DISTTRAIN_LAB_INSTALL_SOURCE``
    (set by ``disttrain-lab release --install-source``) wins over the file.
    """
    pip_requirement = Unicode("", help="where a lab's setup cell installs the kit from: 'wheel', "
                              "'wheel:<URL of labs/wheels>', 'git+<URL>' or a wheel's URL").tag(config=True)

    _LINE = re.compile(r'^DISTTRAIN_LAB_PIP = "[^"\n]*"', re.MULTILINE)

    def preprocess(self, nb, resources):
        from .release import ENV_VAR, stamped_requirement
        self._stamp = stamped_requirement(os.environ.get(ENV_VAR) or self.pip_requirement)
        return super().preprocess(nb, resources)

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "code" and self._LINE.search(cell.source):
            requirement = self._stamp.replace('"', '\\"')
            cell.source = self._LINE.sub(lambda _: f'DISTTRAIN_LAB_PIP = "{requirement}"', cell.source)
        return cell, resources


def configured_install_source() -> str:
    """The install source grader/nbgrader_config.py sets (``$DISTTRAIN_LAB_INSTALL_SOURCE`` wins)."""
    from traitlets.config.loader import PyFileConfigLoader
    from .release import ENV_VAR
    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR]
    config = PyFileConfigLoader("nbgrader_config.py", path=str(GRADER_DIR)).load_config()
    return str(config.StampInstallSource.get("pip_requirement", ""))


_NO_ISOLATION = ("\n*** disttrain-lab: grading WITHOUT isolation: {why}. Student code runs as the grader and "
                 "can read and change the gradebook, solutions and other students' files. Grade as root on "
                 "Linux with cgroup v1 memory+pids, or install bubblewrap (see grader/README.md, 'Threat model'). ***\n")


_LIMITED_ISOLATION = "\n*** disttrain-lab: grading with LIMITED isolation: {why} (see grader/README.md). ***\n"


def configure(c, limits: Limits | None = None) -> None:
    """Apply the whole grading setup to an nbgrader config object ``c``."""
    limits = limits or Limits()
    course_dir().mkdir(parents=True, exist_ok=True)
    c.CourseDirectory.root = str(course_dir())
    # parallel students write to one gradebook: wait for another job's write (sqlite's default is 5 s)
    c.CourseDirectory.db_url = f"sqlite:///{course_dir() / 'gradebook.db'}?timeout=300"
    c.CourseDirectory.source_directory = str(source_dir())
    c.CourseDirectory.release_directory = str(release_dir())
    c.CourseDirectory.ignore = release_ignore(source_dir())
    c.Execute.timeout = limits.cell_timeout
    c.Execute.startup_timeout = 120
    c.RobustExecute.notebook_timeout = limits.notebook_timeout
    c.RobustExecute.cell_time_scale = limits.cell_time_scale
    c.RobustExecute.memory_limit = limits.kernel_memory
    use_sandbox, why = limits.sandboxed()
    if not use_sandbox and limits.sandbox == "auto" and not os.environ.get("DISTTRAIN_SANDBOX_WARNED"):
        print(_NO_ISOLATION.format(why=why), file=sys.stderr)
    elif use_sandbox and sandbox.caveat() and not os.environ.get("DISTTRAIN_SANDBOX_WARNED"):
        print(_LIMITED_ISOLATION.format(why=sandbox.caveat()), file=sys.stderr)
    c.RobustExecute.sandbox = "on" if use_sandbox else "off"
    c.RobustExecute.student_memory = limits.student_memory
    c.RobustExecute.student_pids = limits.student_pids
    c.LimitOutput.max_lines = 300
    c.LimitOutput.max_traceback = 60
    c.OverwriteCells.add_missing_cells = True
    c.Autograde.exporter_class = "disttrain_lab.grading.SubmissionExporter"
    # stamp the install source before the setup cell is locked and checksummed
    from nbgrader.converters import GenerateAssignment
    steps = list(GenerateAssignment().preprocessors)
    c.GenerateAssignment.preprocessors = [StampInstallSource] + [p for p in steps if p is not StampInstallSource]
    from nbgrader.preprocessors import (AssignLatePenalties, CheckCellMetadata, ClearOutput, DeduplicateIds,
                                        IgnorePattern, LimitOutput, OverwriteKernelspec, SaveAutoGrades)
    from nbconvert.preprocessors import ClearMetadataPreprocessor
    c.Autograde.sanitize_preprocessors = [ClearOutput, DeduplicateIds, OverwriteKernelspec,
                                          RestoringOverwriteCells, CheckCellMetadata]
    from nbgrader.converters import GenerateFeedback
    c.GenerateFeedback.preprocessors = [FeedbackWithoutHiddenTests] + list(GenerateFeedback().preprocessors)
    c.Autograde.autograde_preprocessors = [RobustExecute, IgnorePattern, ClearMetadataPreprocessor, LimitOutput,
                                           SaveAutoGrades, AssignLatePenalties, CheckCellMetadata]


# ----------------------------------------------------------------------------------------
# Running nbgrader: one process per step, capped, in a private temp dir, nothing left behind.

def _children_of() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    return children


def _descendants(pid: int) -> list[int]:
    children, found, todo = _children_of(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _become_subreaper() -> None:
    # orphans of the grading run (a kernel whose nbgrader was killed, a rank that escaped)
    # are re-parented to us instead of init, so we can find and stop them
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER


def _environ_has(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read()
    except OSError:
        return False


_RUNNING: dict[int, subprocess.Popen] = {}    # nbgrader processes of this grader now, by pid (parallel jobs)
_STEPS = [0]                                    # steps under way (from before their start to after their reaping)
_STEPS_LOCK = threading.Lock()


def _reap_orphans(before: set[int], marker: bytes | None = None) -> None:
    """Kill what a step left behind: every new descendant when no other step runs beside it, else
    only those whose environment carries this step's ``marker`` (a parallel job's own)."""
    for _ in range(3):
        leftovers = [p for p in _descendants(os.getpid()) if p not in before]
        if _STEPS[0] > 1 and marker is not None:
            leftovers = [p for p in leftovers if p not in _RUNNING and _environ_has(p, marker)]
        if not leftovers:
            return
        _kill(leftovers)
        for pid in leftovers:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


_STEP_PREFIX = "disttrain-grade-"


def clean_stale_steps(tmp_root: str | None = None) -> None:
    """Remove what grading runs that were killed (SIGKILL, a restart) left: their temp
    directories and cgroups (whose sandboxed kernels die with them).  A step's names carry
    its grader's pid, so only steps of graders no longer running are touched."""
    root = Path(tmp_root or tempfile.gettempdir())
    stale = []
    for path in root.glob(f"{_STEP_PREFIX}*-*"):
        pid = path.name[len(_STEP_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            stale.append(path.name)
            shutil.rmtree(path, ignore_errors=True)
    if sandbox.problem() is None:
        for parent in (sandbox.CGROUP_ROOT / "memory" / "disttrain-lab",):
            for node in parent.glob(f"{_STEP_PREFIX}*-*") if parent.is_dir() else []:
                pid = node.name[len(_STEP_PREFIX):].split("-", 1)[0]
                if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                    sandbox.Cgroup(f"disttrain-lab/{node.name}").destroy()


def stop_running_steps() -> None:
    """Kill every nbgrader step this grader runs now, and all they started (an interrupted run)."""
    for pid in list(_RUNNING):
        _kill(_descendants(pid) + [pid])


# the nbgrader process dies with the thread that started it (PR_SET_PDEATHSIG), so a grader
# killed with SIGKILL leaves no step running on; then `python -m nbgrader ARGS`
_NBGRADER_CHILD = ("import ctypes, runpy, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0); "
                   "sys.argv[0] = 'nbgrader'; runpy.run_module('nbgrader', run_name='__main__', alter_sys=True)")


@dataclass
class StepResult:
    args: list[str]
    returncode: int
    output: str
    seconds: float
    timed_out: bool = False


PIPE_GRACE = 10.0    # seconds nbgrader's output may still flow after nbgrader itself has exited


def _wait_and_read(proc: subprocess.Popen, timeout: float, kill_leftovers) -> tuple[str, bool]:
    """``proc``'s output (stdout, a text pipe) and whether it ran past ``timeout`` (then it is killed).

    Waits for ``proc`` itself, not for the end of its pipe: a process it left behind (a kernel
    from a failed start-up retry) inherits the pipe and would hold it open until the step's
    timeout.  If the pipe is still open ``PIPE_GRACE`` s after ``proc`` exited, ``kill_leftovers()``
    stops what is left and the read ends."""
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(proc.stdout), daemon=True)    # line by line
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill(_descendants(proc.pid) + [proc.pid])
        proc.wait()
    reader.join(PIPE_GRACE)
    if reader.is_alive():
        kill_leftovers()
        reader.join(PIPE_GRACE)
    if reader.is_alive():           # held by a process we cannot see: keep what came, do not wait on
        return ("".join(chunks) + f"\n[disttrain-lab] nbgrader exited, but a process it started still held its "
                f"output {2 * PIPE_GRACE:.0f} s later; the output may be cut short\n"), timed_out
    proc.stdout.close()
    return "".join(chunks), timed_out


def run_nbgrader(args: list[str], *, timeout: float, env: dict | None = None,
                 tmp_root: str | None = None, slot: int = 0) -> StepResult:
    """Run ``nbgrader ARGS`` from grader/ (so its nbgrader_config.py applies).

    Steps may run in parallel threads: each has its own temp dir, cgroup and marker, and
    ``slot`` (0, 1, ... one per parallel job) gives its sandboxed kernels their own uid."""
    _become_subreaper()
    with _STEPS_LOCK:
        _STEPS[0] += 1
    try:
        return _run_step(args, timeout, env, tmp_root, slot)
    finally:
        with _STEPS_LOCK:
            _STEPS[0] -= 1


def _run_step(args: list[str], timeout: float, env: dict | None, tmp_root: str | None, slot: int) -> StepResult:
    before = set(_descendants(os.getpid()))
    bindir = os.path.dirname(sys.executable)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"{_STEP_PREFIX}{os.getpid()}-", dir=tmp_root) as tmp:
        full_env = dict(os.environ, **(env or {}))
        cgroup = f"disttrain-lab/{os.path.basename(tmp)}"     # every sandboxed kernel of this run below it
        full_env.update(PATH=bindir + os.pathsep + full_env.get("PATH", ""), TMPDIR=tmp,
                        JUPYTER_RUNTIME_DIR=os.path.join(tmp, "runtime"), MPLBACKEND="Agg",
                        PYTHONDONTWRITEBYTECODE="1", DISTTRAIN_SANDBOX_CGROUP=cgroup,
                        DISTTRAIN_SANDBOX_SLOT=str(slot), DISTTRAIN_GRADE_STEP=os.path.basename(tmp))
        proc = subprocess.Popen([sys.executable, "-c", _NBGRADER_CHILD, *args], cwd=GRADER_DIR, env=full_env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        _RUNNING[proc.pid] = proc
        marker = f"DISTTRAIN_GRADE_STEP={os.path.basename(tmp)}".encode()
        try:
            output, timed_out = _wait_and_read(proc, timeout, lambda: _reap_orphans(before, marker))
            if timed_out:
                output += f"\n[disttrain-lab] nbgrader {' '.join(args)} ran past {timeout:.0f} s and was stopped\n"
        finally:
            _RUNNING.pop(proc.pid, None)
            _reap_orphans(before, marker)
            if sandbox.method() == "root":
                sandbox.Cgroup(cgroup).destroy()
    return StepResult(args, proc.returncode, output, time.monotonic() - started, timed_out)


# ----------------------------------------------------------------------------------------
# The instructor's steps.

def _env(course: Path | None, source: Path | None, release: Path | None) -> dict:
    # no backend override: dl.launch follows one policy (gloo on the CPU unless a lab asks
    # for device="cuda"), so grading runs exactly what the notebook ran
    env = {}
    for name, value in (("DISTTRAIN_COURSE_DIR", course), ("DISTTRAIN_SOURCE_DIR", source),
                        ("DISTTRAIN_RELEASE_DIR", release)):
        if value is not None:
            env[name] = str(Path(value).resolve())
    return env


def list_labs(source: Path | None = None) -> list[str]:
    source = Path(source or source_dir())
    return sorted(p.name for p in source.iterdir() if p.is_dir() and (p / f"{p.name}.ipynb").exists()) \
        if source.is_dir() else []


def normalize_release(path: Path) -> None:
    """Strip what differs between two releases of the same source (so labs/ is stable)."""
    for nb_path in sorted(Path(path).rglob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        nb.metadata.pop("widgets", None)
        nb.metadata.get("language_info", {}).pop("version", None)
        for cell in nb.cells:
            cell.metadata.pop("execution", None)
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        nbformat.write(nb, nb_path)


def release(labs: list[str] | None = None, *, course: Path | None = None, source: Path | None = None,
            release_to: Path | None = None, tmp_root: str | None = None,
            install_source: str | None = None) -> list[StepResult]:
    """generate_assignment for each lab (all of solutions/ by default), into labs/.

    ``install_source`` (default: the configured one, see :mod:`disttrain_lab.release`) is
    stamped into every lab's setup cell; the unset placeholder is refused before anything
    is written.  For ``wheel`` sources the kit's wheel is built into ``labs/wheels/``.
    """
    from . import release as install
    chosen = install_source or configured_install_source()
    install.stamped_requirement(chosen)  # raises InstallSourceError, saying what to set
    env = _env(course, source, release_to)
    env[install.ENV_VAR] = chosen
    if install.needs_wheel(chosen):
        install.build_wheel(out=Path(release_to or release_dir()) / install.WHEELS)
    results = []
    for lab in labs or list_labs(source):
        result = run_nbgrader(["generate_assignment", lab, "--force"], timeout=600, env=env, tmp_root=tmp_root)
        if result.returncode != 0:
            raise RuntimeError(f"nbgrader generate_assignment {lab} failed:\n{result.output}")
        normalize_release(Path(release_to or release_dir()) / lab)
        results.append(result)
    return results


def students_of(lab: str, course: Path | None = None) -> list[str]:
    submitted = Path(course or course_dir()) / "submitted"
    return sorted(p.name for p in submitted.iterdir() if (p / lab).is_dir()) if submitted.is_dir() else []


def _ensure_in_gradebook(lab: str, course: Path, env: dict, tmp_root: str | None) -> None:
    from nbgrader.api import Gradebook, MissingEntry
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        try:
            gb.find_assignment(lab)
            return
        except MissingEntry:
            pass
    # a course directory that never released this lab: record it without touching labs/
    with tempfile.TemporaryDirectory(prefix="disttrain-release-", dir=tmp_root) as scratch:
        result = run_nbgrader(["generate_assignment", lab, "--force",
                               f"--CourseDirectory.release_directory={scratch}"],
                              timeout=600, env=env, tmp_root=tmp_root)
    if result.returncode != 0:
        raise RuntimeError(f"could not add {lab} to the gradebook:\n{result.output}")


def autograde(lab: str, students: list[str] | None = None, *, course: Path | None = None,
              source: Path | None = None, release_from: Path | None = None, limits: Limits | None = None,
              tmp_root: str | None = None, one_process_per_student: bool = True, jobs: int = 1,
              on_result=None, log=print) -> dict[str, StepResult]:
    """Autograde each student in its own nbgrader process, ``jobs`` at a time; one result per
    student.  ``on_result(student, result)`` is called as each finishes (from a worker thread).
    An interrupt (KeyboardInterrupt) stops every running student and is raised again."""
    course = Path(course or course_dir()).resolve()
    limits = limits or Limits()
    env = _env(course, source, release_from)
    env.update(DISTTRAIN_CELL_TIMEOUT=str(limits.cell_timeout), DISTTRAIN_NOTEBOOK_TIMEOUT=str(limits.notebook_timeout),
               DISTTRAIN_KERNEL_MEMORY=str(limits.kernel_memory), DISTTRAIN_STUDENT_MEMORY=str(limits.student_memory),
               DISTTRAIN_STUDENT_PIDS=str(limits.student_pids), DISTTRAIN_SANDBOX=limits.sandbox,
               DISTTRAIN_CELL_TIME_SCALE=str(limits.cell_time_scale), DISTTRAIN_SANDBOX_WARNED="1")
    isolated, why = limits.sandboxed()
    if not isolated:
        log(_NO_ISOLATION.format(why=why))
    elif sandbox.caveat():
        log(_LIMITED_ISOLATION.format(why=sandbox.caveat()))
    _ensure_in_gradebook(lab, course, env, tmp_root)
    students = students or students_of(lab, course)
    if not one_process_per_student:
        # plain `nbgrader autograde LAB`: every student in one process (faster; no per-student cap)
        result = run_nbgrader(["autograde", lab, "--force"], timeout=limits.student_timeout * len(students),
                              env=env, tmp_root=tmp_root)
        log(f"autograde {lab} ({len(students)} students): rc={result.returncode} in {result.seconds:.1f} s")
        results = {student: result for student in students}
        grade_report(lab, students, results, course, why if not isolated else None)
        return results
    import concurrent.futures
    import queue
    results, slots, stopping = {}, queue.Queue(), threading.Event()
    for slot in range(jobs):
        slots.put(slot)

    def grade_one(student: str) -> None:
        slot = slots.get()      # a free slot: its sandbox uid and nobody else's while this student runs
        try:
            if stopping.is_set():
                return
            result = run_nbgrader(["autograde", lab, "--student", student, "--force"],
                                  timeout=limits.student_timeout, env=env, tmp_root=tmp_root, slot=slot)
        finally:
            slots.put(slot)
        if stopping.is_set():   # killed by the interrupt: not a grade
            return
        if result.timed_out:      # as nbgrader does for a failed submission: no half-written results
            shutil.rmtree(course / "autograded" / student / lab, ignore_errors=True)
        results[student] = result
        status = "ok" if result.returncode == 0 else ("STOPPED (time cap)" if result.timed_out else "FAILED")
        if on_result is not None:
            on_result(student, result)
        else:
            log(f"autograde {lab} {student}: {status} in {result.seconds:.1f} s")
            if result.returncode != 0:
                log(result.output[-3000:])

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="grade")
    futures = []
    try:
        futures = [pool.submit(grade_one, student) for student in students]
        for future in concurrent.futures.as_completed(futures):
            future.result()
    except BaseException:
        stopping.set()
        for future in futures:
            future.cancel()
        stop_running_steps()
        raise
    finally:
        pool.shutdown(wait=True)
    graded = [s for s in students if s in results]
    report = grade_report(lab, graded, results, course, why if not isolated else None)
    log(f"grade report: {report}")
    return results


def generate_feedback(lab: str, students: list[str] | None = None, *, course: Path | None = None,
                      source: Path | None = None, tmp_root: str | None = None) -> StepResult:
    args = ["generate_feedback", lab, "--force"]
    if students and len(students) == 1:
        args += ["--student", students[0]]
    return run_nbgrader(args, timeout=600, env=_env(course, source, None), tmp_root=tmp_root)


def export_grades(csv_path: Path | None = None, *, course: Path | None = None,
                  tmp_root: str | None = None) -> Path:
    course = Path(course or course_dir()).resolve()
    csv_path = Path(csv_path or course / "grades.csv").resolve()
    result = run_nbgrader(["export", f"--to={csv_path}"], timeout=600, env=_env(course, None, None), tmp_root=tmp_root)
    if result.returncode != 0:
        raise RuntimeError(f"nbgrader export failed:\n{result.output}")
    return csv_path


def scores(lab: str, course: Path | None = None) -> dict[str, dict[str, float]]:
    """{student: {grade_id: score, ..., "total": score}} from the gradebook."""
    from nbgrader.api import Gradebook
    course = Path(course or course_dir()).resolve()
    table = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        assignment = gb.find_assignment(lab)
        for submission in assignment.submissions:
            row = {}
            for notebook in submission.notebooks:
                for grade in notebook.grades:
                    if grade.max_score:
                        row[grade.name] = float(grade.score)
            row["total"] = float(submission.score)
            table[submission.student.id] = row
    return table


# ----------------------------------------------------------------------------------------
# Command line: `disttrain-lab release` and `disttrain-lab grade`.

def cli_release(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disttrain-lab release",
                                     description="Regenerate labs/ from solutions/ with nbgrader generate_assignment.")
    parser.add_argument("labs", nargs="*", help="lab names (default: every lab in solutions/)")
    parser.add_argument("--course-dir", type=Path, help="course directory holding gradebook.db "
                        "(default: $DISTTRAIN_COURSE_DIR or ~/.disttrain-lab/course)")
    parser.add_argument("--check", action="store_true",
                        help="release into a scratch directory and fail if labs/ differs from it")
    parser.add_argument("--install-source", help="where the labs' setup cell installs the kit from "
                        "(default: c.StampInstallSource.pip_requirement in grader/nbgrader_config.py): 'wheel', "
                        "'wheel:<URL of labs/wheels>', 'git+<URL>' or a wheel's URL")
    parser.add_argument("--time-cells", action="store_true",
                        help="also grade each lab's solution once and record its cell times in grader/cell_times/ "
                        "(the grader derives each cell's time limit from them; see disttrain_lab/cell_times.py)")
    args = parser.parse_args(argv)
    from .release import WHEELS, InstallSourceError, wheel_differences
    try:
        if not args.check:
            labs = args.labs or list_labs()
            for lab in _track(labs, "releasing"):
                for result in release([lab], course=args.course_dir, install_source=args.install_source):
                    print(f"released {lab} -> {release_dir() / lab} ({result.seconds:.1f} s)")
            for lab in _track(labs if args.time_cells else [], "timing the solutions' cells"):
                print(f"cell times of {lab}: {cell_times.record(lab, cell_times.measure(lab))}")
            return 0
        stale = []
        with tempfile.TemporaryDirectory(prefix="disttrain-check-") as scratch:
            fresh = Path(scratch) / "labs"
            labs = args.labs or list_labs()
            release(labs, course=Path(scratch) / "course", release_to=fresh, install_source=args.install_source)
            for lab in labs:
                stale += release_differences(fresh / lab, release_dir() / lab)
            stale += wheel_differences(fresh / WHEELS, release_dir() / WHEELS)
    except InstallSourceError as exc:
        print(f"disttrain-lab release: {exc}", file=sys.stderr)
        return 2
    for line in stale:
        print(line)
    print("labs/ is up to date" if not stale else "labs/ is out of date: run `disttrain-lab release`")
    return 1 if stale else 0


def _track(items: list, description: str):
    """``items`` with a progress bar on stderr (rich); what the loop prints stays on stdout."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    with Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True, redirect_stdout=False) as progress:
        yield from progress.track(items)


def _comparable(nb_path: Path) -> list:
    nb = nbformat.read(nb_path, as_version=4)
    return [(c.cell_type, c.source, json.dumps(c.metadata, sort_keys=True)) for c in nb.cells]


def release_differences(fresh: Path, committed: Path) -> list[str]:
    """What differs between a fresh release and the committed one (sources and metadata)."""
    fresh_files = {p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file()} if fresh.is_dir() else set()
    committed_files = {p.relative_to(committed) for p in committed.rglob("*") if p.is_file()} if committed.is_dir() else set()
    lines = [f"missing from {committed}: {p}" for p in sorted(fresh_files - committed_files)]
    lines += [f"not in a fresh release: {committed / p}" for p in sorted(committed_files - fresh_files)]
    for rel in sorted(fresh_files & committed_files):
        a, b = fresh / rel, committed / rel
        same = _comparable(a) == _comparable(b) if rel.suffix == ".ipynb" else a.read_bytes() == b.read_bytes()
        if not same:
            lines.append(f"differs from a fresh release: {committed / rel}")
    return lines


def cli_grade(argv: list[str] | None = None) -> int:
    """``disttrain-lab grade``: see :mod:`disttrain_lab.gradeclass` (parallel, resumable, shards)."""
    from .gradeclass import cli_grade as grade_class_cli
    return grade_class_cli(argv)
