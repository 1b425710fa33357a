"""The sandbox, as the grader sees it: whether this host can put a graded kernel in one
(``problem``, ``method``: "root", the full sandbox, or "bwrap", bubblewrap without root), what
it lacks here (``missing``: the memory and process caps, the syscall filter; a grading under
``DISTTRAIN_SANDBOX=auto`` refuses to start without them), what it cannot do although it runs
(``caveat``), a summary for ``disttrain-lab doctor`` (``describe``), the spec and the command
line that start a kernel in it (``spec``, ``command``).

What the sandbox is -- an unprivileged user, private /tmp and /dev/shm, hidden grader
files, memory and process caps for the whole student, a syscall filter, killed as one unit --
and how it is made is ``run_sandbox.py``, the program ``command`` runs as a file (it imports
nothing of the package); its cgroups are ``cgroups.py`` (v1 or v2), its filter
``syscall_filter.py``; the environment a kernel sees (``kernel_env``) is named here too for
the grader's steps and tests.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys

from . import cgroups, reaper, run_sandbox, syscall_filter
from .cgroups import Cgroup
from .kernel_env import kernel_env
from .run_bwrap import BWRAP_NAMESPACES, BWRAP_ROOT

__all__ = [
    "BWRAP_CAVEAT",
    "Cgroup",
    "caps_problem",
    "caveat",
    "command",
    "describe",
    "kernel_env",
    "method",
    "missing",
    "namespace_process",
    "problem",
    "spec",
]


def problem() -> str | None:
    """Why this host cannot sandbox a kernel, or None when it can."""
    return _host()[1]


def method() -> str | None:
    """How kernels are sandboxed here: "root" (the full sandbox), "bwrap" (no root) or None."""
    return _host()[0]


BWRAP_CAVEAT = (
    "the grader is not root, so kernels run under bubblewrap: private /tmp and /dev/shm, "
    "hidden grader files, read-only file system, own pid, IPC and network namespaces, killed with the grading -- "
    "but the kernel's processes are the grader's own uid outside the sandbox, and files the grader can "
    "read outside the hidden paths stay readable"
)


NO_CPU_CAVEAT = (
    "no cgroup cpu controller: a student who keeps many processes "
    "busy slows the classmates graded beside them (no CPU share per student)"
)


@functools.cache
def caps_problem() -> str | None:
    """Why no cgroup can cap a student's memory and processes here (``cgroups.problem``, tried once)."""
    return cgroups.problem()


@functools.cache
def missing() -> tuple[str, ...]:
    """What the sandbox lacks on this host, each with what would give it: the memory and
    process caps for the whole student (a cgroup, ``cgroups.problem``), the syscall filter
    (``syscall_filter.problem``).  Empty: a full sandbox."""
    lacking = []
    caps = caps_problem()
    if caps:
        lacking.append(f"NO memory or process cap for the whole student: {caps}")
    seccomp = syscall_filter.problem()
    if seccomp:
        lacking.append(f"NO syscall filter: {seccomp}")
    return tuple(lacking)


def caveat() -> str | None:
    """What the sandbox cannot do on this host although it runs (None: nothing)."""
    said = [BWRAP_CAVEAT] if method() == "bwrap" else []
    said += list(missing())
    if not caps_problem() and "cpu" not in cgroups.host()["caps"]:
        said.append(NO_CPU_CAVEAT)
    return "; ".join(said) or None


def describe() -> str:
    """The grading host in a few lines (``disttrain-lab doctor``): the back-end, each cap and
    the syscall filter, and what refuses or degrades."""
    why = problem()
    if why:
        return f"grading sandbox: NONE: {why}\n  DISTTRAIN_SANDBOX=auto refuses to grade here; =off grades unsandboxed"
    offered = cgroups.host()
    caps = caps_problem()
    lines = [
        f"grading sandbox: {method()} ({'full' if method() == 'root' else 'bubblewrap, without root'}), "
        f"cgroup {offered['version'] or 'none'} below {cgroups.base()!r}",
        "  memory and process caps: "
        + ("yes (" + ", ".join(offered["caps"]) + f"; kill: {offered['kill']})" if not caps else f"NO: {caps}"),
        "  syscall filter: "
        + (
            f"yes (seccomp, {len(syscall_filter.DENIED)} calls denied)"
            if not syscall_filter.problem()
            else f"NO: {syscall_filter.problem()}"
        ),
    ]
    lines.append(
        "  DISTTRAIN_SANDBOX=auto grades here"
        if not missing()
        else "  DISTTRAIN_SANDBOX=auto REFUSES to grade here; =limited grades without what is missing"
    )
    return "\n".join(lines)


@functools.cache
def _host() -> tuple[str | None, str | None]:
    if not sys.platform.startswith("linux"):
        return None, f"sandboxing needs Linux (this is {sys.platform})"
    missing = [ns for ns in ("pid", "mnt", "ipc", "net") if not os.path.exists(f"/proc/self/ns/{ns}")]
    if missing:
        return None, f"the Linux kernel has no {'/'.join(missing)} namespaces"
    if os.geteuid() == 0:
        why_not_root = _namespaces_problem()
        if why_not_root is None:
            return "root", None
    else:
        why_not_root = "the grader does not run as root (no user switch, mounts or cgroups)"
    why = _bwrap_problem()
    return ("bwrap", None) if why is None else (None, f"{why_not_root}, and bubblewrap cannot stand in: {why}")


# what run_sandbox.py does first as root: a child of its own tries it (a container with
# Docker's default capabilities is root without CAP_SYS_ADMIN, and mounts nothing)
_UNSHARE = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.unshare(0x00020000 | 0x20000000 | 0x08000000 | 0x40000000) != 0:\n"
    "    sys.exit(os.strerror(ctypes.get_errno()))\n"
)


def _namespaces_problem() -> str | None:
    try:
        run = subprocess.run([sys.executable, "-I", "-c", _UNSHARE], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the grader is root but could not try to make namespaces ({exc})"
    if run.returncode != 0:
        return (
            f"the grader is root but cannot make mount, pid, IPC and network namespaces ({run.stderr.strip()[-200:]}; "
            "no CAP_SYS_ADMIN: a container with Docker's default capabilities?)"
        )
    return None


def _bwrap_problem() -> str | None:
    exe = shutil.which("bwrap")
    if exe is None:
        return "no `bwrap` on PATH (Debian/Ubuntu: apt-get install bubblewrap)"
    try:
        run = subprocess.run(
            [
                exe,
                *BWRAP_NAMESPACES,
                *BWRAP_ROOT,
                "--tmpfs",
                "/tmp",
                "true",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`{exe}` did not run ({exc})"
    if run.returncode != 0:
        return (
            f"`{exe}` failed: {run.stderr.strip()[-300:] or f'exit {run.returncode}'} "
            "(are unprivileged user namespaces switched off? sysctl kernel.unprivileged_userns_clone)"
        )
    return None


# ----------------------------------------------------------------------------------------
# what the operating system counted on the sandbox's network


def namespace_process(pid: int, kind: str) -> int:
    """The first process at or below ``pid`` in another ``kind`` namespace ("net", "pid")
    than the grader's: inside the sandbox (its init), or ``pid`` itself when the kernel shares
    the grader's (no sandbox)."""
    try:
        own = os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return pid
    for p in [pid] + reaper.descendants(pid):
        try:
            if os.readlink(f"/proc/{p}/ns/{kind}") != own:
                return p
        except OSError:
            continue
    return pid


# ----------------------------------------------------------------------------------------
# the spec the grader passes, and the command that starts a kernel in a sandbox


def spec(
    *,
    uid: int,
    memory: int,
    pids: int,
    data_limit: int,
    cgroup: str,
    hide: list[str],
    keep: list[str],
    scratch: str | None = None,
) -> dict:
    """What ``run_sandbox.py`` is asked for.  ``scratch``: a folder the grader made for this kernel
    (and removes after it) where a bubblewrap sandbox stages the kernel's working folder and home."""
    return {
        "uid": uid,
        "memory": memory,
        "pids": pids,
        "data_limit": data_limit,
        "cgroup": cgroup,
        "hide": hide,
        "keep": keep,
        "scratch": scratch,
        "method": method(),
        "caps": caps_problem() is None,  # (grading without them: DISTTRAIN_SANDBOX=limited)
        "syscall_filter": syscall_filter.problem() is None,
    }


def command(the_spec: dict, kernel_cmd: list[str]) -> list[str]:
    # run as a file, isolated (-I: no env, no script dir on sys.path): importing the
    # disttrain_lab package would import torch, seconds per kernel start
    return [sys.executable, "-I", os.path.abspath(run_sandbox.__file__), json.dumps(the_spec), "--", *kernel_cmd]
