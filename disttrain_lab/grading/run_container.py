"""A graded kernel where the kit's sandbox cannot be made: ``DISTTRAIN_SANDBOX=container``.

In a container with Docker's default capabilities (no ``CAP_SYS_ADMIN``: Gradescope's) the
grader is root but makes no namespace, no mount and no cgroup, so ``run_sandbox.py`` cannot run.
What root still can there -- switch users (``CAP_SETUID``, ``CAP_SETGID``), own and kill their
files and processes -- gives the student's kernel a weaker but stated isolation, opt-in only::

    wrapper (root)    the kernel's own folder (made by the grader below /tmp, 0700): a copy of its
    │                 working folder, its home, its connection file; waits; then kills every
    │                 process of the student's uid and removes the folder
    └── kernel (a fresh uid from UID_FIRST up, picked at random per kernel, no groups, no new
        privileges; RLIMIT_DATA per process, RLIMIT_NPROC for the uid, no core dumps, first in
        line for the OOM killer; the syscall filter; the allowlisted environment of the sandbox)

It refuses to start the kernel when any hidden path (the course, the solutions, the grading temp
dir, the grader's home, ``$DISTTRAIN_SANDBOX_HIDE``) is readable or enterable as that uid: here
file permissions, not mounts, keep them from the student.  What holds and what does not is
grader/README.md, "Grading on Gradescope".  Like ``run_sandbox.py`` this file runs as a file
(``python -I run_container.py SPEC -- KERNEL-COMMAND``) and imports nothing of the package; it
loads ``syscall_filter.py``, ``kernel_env.py`` and ``trees.py`` (removing the kernel's folder) by
their paths.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import secrets
import shutil
import signal
import stat
import sys
from pathlib import Path

# every kernel a uid of its own, drawn from 2**30 uids no account uses: two containers on one
# host (Docker shares the host's uids) almost never draw the same, so RLIMIT_NPROC, which counts
# a uid's processes host-wide, is this student's alone
UID_FIRST, UID_SPAN = 2**30, 2**30
PR_SET_PDEATHSIG = 1
# what the wrapper needs of root: chown (CHOWN), read the grader's files (DAC_OVERRIDE), kill
# the student's processes (KILL), become the student (SETGID, SETUID): all in Docker's defaults
NEEDED_CAPS = {0: "CAP_CHOWN", 1: "CAP_DAC_OVERRIDE", 5: "CAP_KILL", 6: "CAP_SETGID", 7: "CAP_SETUID"}
# ss lists the student's sockets for the grader, run by setpriv as the student's effective uid
# (wire.snapshot): in a container the grader has no CAP_SYS_PTRACE to see another uid's sockets
TOOLS = {"ss": "iproute2", "setpriv": "util-linux"}

# what a grading in container mode says of itself (config.Limits.sandboxed, the grade report, results.json)
SUMMARY = (
    "no namespaces or cgroups (no CAP_SYS_ADMIN), so not the kit's sandbox; the student's kernel and ranks run "
    "as a fresh unprivileged uid (no groups, no new privileges) under the syscall filter, with RLIMIT_DATA per "
    "process and RLIMIT_NPROC for the uid, the grader's files readable by root only (checked as that uid before "
    "the kernel starts), every process of the uid killed when the kernel ends; NOT isolated: the container's "
    "process list, network, /tmp and /dev/shm, and no memory cap for the student as a whole"
)


def _sibling(name: str):
    """A module beside this file that imports only the standard library, loaded by its path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"disttrain_container_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def problem() -> str | None:
    """Why this process cannot run kernels in container mode, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"container mode needs Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "the grader does not run as root, so it cannot run the student's kernel as another user"
    status = Path("/proc/self/status").read_text()
    effective = int(status.split("CapEff:")[1].split()[0], 16)
    lacking = [name for bit, name in NEEDED_CAPS.items() if not effective >> bit & 1]
    if lacking:
        return f"the grader lacks the capabilities {', '.join(lacking)}"
    absent = [f"`{tool}` ({package})" for tool, package in TOOLS.items() if shutil.which(tool) is None]
    if absent:
        return f"no {' or '.join(absent)} on PATH: the grader counts the ranks' bytes with them"
    why = _sibling("syscall_filter").problem()
    return f"no syscall filter: {why}" if why else None


def spec(*, data_limit: int, pids: int, hide: list[str], keep: list[str], references: list[str] | None = None) -> dict:
    """``hide``: what the student's uid must not read (else the kernel is not started); ``references``: the
    grader's reference packages it should not import (``kernels.REFERENCE_PACKAGES``): where it can, the kernel
    starts all the same, saying so in the grader's log (``setup.sh`` makes them root's only on Gradescope)."""
    return {"data_limit": data_limit, "pids": pids, "hide": hide, "keep": keep, "references": list(references or [])}


def command(the_spec: dict, kernel_cmd: list[str]) -> list[str]:
    return [sys.executable, "-I", os.path.abspath(__file__), json.dumps(the_spec), "--", *kernel_cmd]


def student_uids() -> set[int]:
    """The uids of this range that own a running process (what ``sweep`` stops)."""
    found = set()
    for entry in os.listdir("/proc"):
        try:  # (the status file, not the owner of /proc/PID: a process that is not dumpable shows as root's)
            with open(f"/proc/{entry}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration, ValueError):
            continue
        if UID_FIRST <= uid < UID_FIRST + UID_SPAN:
            found.add(uid)
    return found


def sweep(uid: int) -> None:
    """Kill every process of ``uid``: a child that becomes ``uid`` signals -1, which reaches every
    process that uid may signal, its own ones (a ``setsid`` or a double fork escapes no one)."""
    child = os.fork()
    if child == 0:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            for _ in range(1000):  # until none is left (a fork may land between two rounds)
                os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            os._exit(0)
        except BaseException:  # noqa: BLE001 - a forked child never returns into the caller
            os._exit(1)
        os._exit(1)
    os.waitpid(child, 0)


def _reachable(path: str) -> bool:
    """Whether the calling uid can read ``path`` or enter it (a folder)."""
    try:
        mode = os.stat(path).st_mode  # EACCES: a folder above it is closed
    except OSError:
        return False
    return os.access(path, os.R_OK) or (stat.S_ISDIR(mode) and os.access(path, os.X_OK))


def _stage(cmd: list[str], uid: int) -> tuple[Path, Path, Path]:
    """The kernel's own folder (where its sockets go, made by the grader for it alone): a copy of
    the working folder, a home, the connection file; all the student's.  (folder, work, home)."""
    index = cmd.index("-f") + 1
    conn = json.loads(Path(cmd[index]).read_bytes())
    if conn.get("transport") != "ipc":
        raise ValueError(f"container mode runs a kernel over unix sockets ('ipc'), not {conn.get('transport')!r}")
    folder = Path(os.path.realpath(conn["ip"])).parent
    work, home, runtime = folder / "work", folder / "home", folder / "kernel"
    shutil.copytree(".", work, symlinks=True, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    home.mkdir()
    runtime.mkdir(mode=0o700)
    (runtime / "kernel.json").write_text(json.dumps(conn))
    cmd[index] = str(runtime / "kernel.json")
    for root, dirs, files in os.walk(folder):
        for entry in [root] + [os.path.join(root, n) for n in dirs + files]:
            os.lchown(entry, uid, uid)
    return folder, work, home


def main(argv: list[str]) -> None:
    the_spec, cmd = json.loads(argv[0]), argv[2:]
    uid = UID_FIRST + secrets.randbelow(UID_SPAN)
    syscall_filter = _sibling("syscall_filter")  # (built while this file is where it was)
    folder, work, home = _stage(cmd, uid)
    keep = [os.path.realpath(k) for k in the_spec["keep"]]
    env = _sibling("kernel_env").kernel_env(os.environ, home=str(home), runtime=str(folder / "kernel"), keep=keep)
    env["JPY_PARENT_PID"] = str(os.getpid())  # ipykernel ends when this wrapper does
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is for the kernel (its group gets it)
    kernel = os.fork()
    if kernel == 0:
        try:
            try:
                Path("/proc/self/oom_score_adj").write_text("1000")  # the student's processes go first
            except OSError:  # (no such file here: the container's memory limit still bounds the student)
                pass
            if the_spec["data_limit"]:
                resource.setrlimit(resource.RLIMIT_DATA, (the_spec["data_limit"],) * 2)
            resource.setrlimit(resource.RLIMIT_NPROC, (the_spec["pids"],) * 2)  # this uid's processes and threads
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # (a change of uid clears it)
            exposed = [p for p in the_spec["hide"] if _reachable(p)]
            if exposed:
                raise PermissionError(
                    f"the student's uid could read {', '.join(exposed)}: container mode hides the grader's files "
                    "by their permissions alone (make them root's only, chmod go-rwx; grader/README.md)"
                )
            readable = [p for p in the_spec.get("references", []) if _reachable(p)]
            if readable:
                sys.stderr.write(
                    f"[disttrain-lab] container mode: the student's uid can read {', '.join(readable)}, which the "
                    "grader withholds from graded kernels (lab 13 grades an FP8 layer written in torch alone against "
                    "torchao): only the ranks' own report says a submission did not import it. Make them root's "
                    "only (chmod -R go-rwx; Gradescope's setup.sh does)\n"
                )
            os.chdir(work)
            syscall_filter.install()  # last: sets no_new_privs, holds for everything the kernel starts
            os.execvpe(cmd[0], cmd, env)
        except BaseException as exc:  # noqa: BLE001 - report any set-up failure, never return
            sys.stderr.write(f"[disttrain-lab] container mode: the kernel was not started: {exc}\n")
            os._exit(70)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(kernel, signal.SIGKILL))
    try:
        _, status = os.waitpid(kernel, 0)
    finally:
        sweep(uid)
        # the student wrote into it: removed as the student, whatever it holds (trees.py); never raises
        trees = _sibling("trees")
        left = trees.said(folder, trees.remove(folder))
        if left:
            sys.stderr.write(left + "\n")
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
