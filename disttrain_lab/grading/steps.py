"""Running nbgrader: one process per step, capped, in a private temp dir, nothing left behind.

A step's folders (its temp dir, and where that path is too long for a unix socket's, a short
folder for its kernels' sockets) carry the grader's pid in their names and are removed when the
step ends, however it ended (``trees.remove``: whatever a student's kernel left in them never
stops the removal nor the run); a killed grader's, by the next run (``clean_stale_steps``)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import cgroups, reaper, sandbox, startup, trees
from .config import GRADER_DIR


def _become_subreaper() -> None:
    # orphans of the grading run (a kernel whose nbgrader was killed, a rank that escaped)
    # are re-parented to us instead of init, so we can find and stop them
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


processes_with = reaper.processes_with  # (what the tests and scripts/hub_check.py import from here)


_RUNNING: dict[int, subprocess.Popen] = {}  # nbgrader processes of this grader now, by pid (parallel jobs)
_STEPS = [0]  # steps under way (from before their start to after their reaping)
_STEPS_LOCK = threading.Lock()


def _reap_orphans(before: set[int], marker: bytes | None = None) -> None:
    """Kill what a step left behind: every new descendant when no other step runs beside it, else
    only those whose environment carries this step's ``marker`` (a parallel job's own)."""
    for _ in range(3):
        leftovers = [p for p in reaper.descendants(os.getpid()) if p not in before]
        if _STEPS[0] > 1 and marker is not None:
            leftovers = [p for p in leftovers if p not in _RUNNING and reaper.environ_has(p, marker)]
        if not leftovers:
            return
        reaper.kill(leftovers)
        for pid in leftovers:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


_STEP_PREFIX = "disttrain-grade-"

# a sandboxed kernel's sockets live in a folder of its own (kernels.py) below the step's folder
# for them, named in the nbgrader process's environment: a unix socket's path holds at most 107
# bytes, so that folder's path stays shorter than SOCKET_DIR_MAX
SOCKETS_ENV = "DISTTRAIN_SOCKET_DIR"
SOCKET_DIR_MAX = 60


def _short_root() -> str:
    """Where a step whose temp dir is too deep puts its sockets' folder: the grader's temp dir,
    else /tmp (each with room below it for the folder's name)."""
    where = tempfile.gettempdir()
    return where if len(where) + len(_STEP_PREFIX) + 16 < SOCKET_DIR_MAX else "/tmp"


def clean_stale_steps(tmp_root: str | None = None, log=print) -> None:
    """Remove what grading runs that were killed (SIGKILL, a restart) left: their cgroups (whose
    sandboxed kernels die with them), then their temp directories and sockets' folders.  A
    step's names carry its grader's pid, so only steps of graders no longer running are
    touched; what cannot be removed is said (``log``), never raised."""

    def stale(names):
        for path in names:
            pid = path.name[len(_STEP_PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                yield path

    if sandbox.problem() is None and sandbox.caps_problem() is None:
        for parent in sandbox.Cgroup(cgroups.base()).dirs[:1]:
            for node in stale(parent.glob(f"{_STEP_PREFIX}*-*") if parent.is_dir() else []):
                sandbox.Cgroup(f"{cgroups.base()}/{node.name}").destroy()
    for root in sorted({Path(tmp_root or tempfile.gettempdir()), Path(_short_root())}):
        for path in stale(root.glob(f"{_STEP_PREFIX}*-*")):
            left = trees.said(path, trees.remove(path))
            if left:
                log(left)


def stop_running_steps() -> None:
    """Kill every nbgrader step this grader runs now, and all they started (an interrupted run)."""
    for pid in list(_RUNNING):
        reaper.kill_tree(pid)


# the nbgrader process dies with the thread that started it (PR_SET_PDEATHSIG), so a grader
# killed with SIGKILL leaves no step running on; it joins the step's grader node (the cgroup
# files named in _JOIN, before it starts anything); then `python -m nbgrader ARGS`
_JOIN = "DISTTRAIN_STEP_JOIN"
_CHILD_SETUP = (
    "import ctypes, os, runpy, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
    f"for procs in filter(None, os.environ.pop({_JOIN!r}, '').split(os.pathsep)):\n"
    "    with open(procs, 'w') as f: f.write(str(os.getpid()))\n"
)
_NBGRADER_CHILD = (
    _CHILD_SETUP
    + startup.NBGRADER_PRELUDE
    + "sys.argv[0] = 'nbgrader'; runpy.run_module('nbgrader', run_name='__main__', alter_sys=True)"
)


def _grader_node(cgroup: str) -> tuple[dict, str]:
    """The step's own side (nbgrader, the grader kernel) in a node beside the student's
    kernels, of their CPU weight (cgroups.py), where this host gives caps: (what the nbgrader
    process's environment gets, a line for the step's output where it could not be made)."""
    if sandbox.problem() is not None or sandbox.caps_problem() is not None:
        return {}, ""
    try:
        node = sandbox.Cgroup(f"{cgroup}/grader").create(memory=None, pids=None)
    except OSError as exc:
        return {}, f"[disttrain-lab] the grader's side of this step runs without a CPU share of its own: {exc}\n"
    return {_JOIN: os.pathsep.join(str(d / "cgroup.procs") for d in node.dirs)}, ""


@dataclass
class StepResult:
    args: list[str]
    returncode: int
    output: str
    seconds: float
    timed_out: bool = False


PIPE_GRACE = 10.0  # seconds nbgrader's output may still flow after nbgrader itself has exited


def _wait_and_read(proc: subprocess.Popen, timeout: float, kill_leftovers) -> tuple[str, bool]:
    """``proc``'s output (stdout, a text pipe) and whether it ran past ``timeout`` (then it is killed).

    Waits for ``proc`` itself, not for the end of its pipe: a process it left behind (a kernel
    from a failed start-up retry) inherits the pipe and would hold it open until the step's
    timeout.  If the pipe is still open ``PIPE_GRACE`` s after ``proc`` exited, ``kill_leftovers()``
    stops what is left and the read ends."""
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(proc.stdout), daemon=True)  # line by line
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        reaper.kill_tree(proc.pid)
        proc.wait()
    reader.join(PIPE_GRACE)
    if reader.is_alive():
        kill_leftovers()
        reader.join(PIPE_GRACE)
    if reader.is_alive():  # held by a process we cannot see: keep what came, do not wait on
        return (
            "".join(chunks) + f"\n[disttrain-lab] nbgrader exited, but a process it started still held its "
            f"output {2 * PIPE_GRACE:.0f} s later; the output may be cut short\n"
        ), timed_out
    proc.stdout.close()
    return "".join(chunks), timed_out


def run_nbgrader(
    args: list[str],
    *,
    timeout: float,
    env: dict | None = None,
    tmp_root: str | None = None,
    slot: int = 0,
    prepare: Callable[[Path], list[str]] | None = None,
) -> StepResult:
    """Run ``nbgrader ARGS`` from grader/ (so its nbgrader_config.py applies).

    Steps may run in parallel threads: each has its own temp dir, cgroup and marker, and
    ``slot`` (0, 1, ... one per parallel job) picks their uid where none can be leased (uids.py).
    ``prepare(step_dir)``, if given, runs before nbgrader starts and returns more arguments
    for it; what it writes in ``step_dir`` (a folder of the step's temp dir, hidden from
    the sandbox) is removed with the step, a killed grader's by the next run."""
    _become_subreaper()
    with _STEPS_LOCK:
        _STEPS[0] += 1
    try:
        return _run_step(args, timeout, env, tmp_root, slot, prepare)
    finally:
        with _STEPS_LOCK:
            _STEPS[0] -= 1


def _run_step(
    args: list[str], timeout: float, env: dict | None, tmp_root: str | None, slot: int, prepare
) -> StepResult:
    before = set(reaper.descendants(os.getpid()))
    started = time.monotonic()
    tmp = tempfile.mkdtemp(prefix=f"{_STEP_PREFIX}{os.getpid()}-", dir=tmp_root)
    folders = [tmp]
    try:
        if len(tmp) >= SOCKET_DIR_MAX:
            folders.append(tempfile.mkdtemp(prefix=f"{_STEP_PREFIX}{os.getpid()}-", dir=_short_root()))
        result = _run_in(tmp, folders[-1], before, args, timeout, env, slot, prepare)
    finally:
        # (after the step's processes were reaped and its cgroup removed: no student code runs)
        left = [line for folder in folders if (line := trees.said(folder, trees.remove(folder)))]
    if left:
        result.output += "\n" + "\n".join(left) + "\n"
    result.seconds = time.monotonic() - started
    return result


def _run_in(
    tmp: str, sockets: str, before: set[int], args: list[str], timeout: float, env: dict | None, slot: int, prepare
) -> StepResult:
    """The step itself, in its temp dir ``tmp``, its kernels' sockets below ``sockets``."""
    bindir = os.path.dirname(sys.executable)
    if prepare is not None:
        args = [*args, *prepare(Path(tmp) / "prepared")]
    full_env = dict(os.environ, **(env or {}))
    cgroup = f"{cgroups.base()}/{os.path.basename(tmp)}"  # every sandboxed kernel of this run below it
    join, unjoined = _grader_node(cgroup)
    full_env.update(
        join,
        PATH=bindir + os.pathsep + full_env.get("PATH", ""),
        TMPDIR=tmp,
        JUPYTER_RUNTIME_DIR=os.path.join(tmp, "runtime"),
        # the student's kernel draws inline, as in JupyterLab: the feedback shows the figures
        # a student's cells drew (the grader kernel's tests draw nothing: grader_kernel.py)
        MPLBACKEND="module://matplotlib_inline.backend_inline",
        PYTHONDONTWRITEBYTECODE="1",
        DISTTRAIN_SANDBOX_CGROUP=cgroup,
        DISTTRAIN_SANDBOX_SLOT=str(slot),
        DISTTRAIN_GRADE_STEP=os.path.basename(tmp),
    )
    full_env[SOCKETS_ENV] = sockets
    proc = subprocess.Popen(
        [sys.executable, "-c", _NBGRADER_CHILD, *args],
        cwd=GRADER_DIR,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    _RUNNING[proc.pid] = proc
    marker = f"DISTTRAIN_GRADE_STEP={os.path.basename(tmp)}".encode()
    try:
        output, timed_out = _wait_and_read(proc, timeout, lambda: _reap_orphans(before, marker))
        output = unjoined + output
        if timed_out:
            output += f"\n[disttrain-lab] nbgrader {' '.join(args)} ran past {timeout:.0f} s and was stopped\n"
    finally:
        _RUNNING.pop(proc.pid, None)
        _reap_orphans(before, marker)
        if sandbox.problem() is None and sandbox.caps_problem() is None:
            sandbox.Cgroup(cgroup).destroy()
    return StepResult(args, proc.returncode, output, 0.0, timed_out)
