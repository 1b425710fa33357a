"""The sandbox, as the grader sees it: whether this host can put a graded kernel in one
(``problem``, ``method``: "root", the full sandbox, or "bwrap", bubblewrap without root;
``caveat``: what it cannot do here), the spec and the command line that start a kernel in
it (``spec``, ``command``), and what the operating system counted on its network
(``loopback_bytes``).

What the sandbox is -- an unprivileged user, private /tmp and /dev/shm, hidden grader
files, memory and process caps for the whole student, killed as one unit -- and how it is
made is ``run_sandbox.py``, the program ``command`` runs as a file (it imports nothing of
the package); its cgroups (``Cgroup``), and the environment a kernel sees
(``kernel_env``), are named here too for the grader's steps and tests.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from . import run_sandbox
from .run_sandbox import BWRAP_NAMESPACES, CGROUP_ROOT, Cgroup, has_cpu_controller, kernel_env

__all__ = [
    "BWRAP_CAVEAT",
    "CGROUP_ROOT",
    "NO_CPU_CAVEAT",
    "Cgroup",
    "caveat",
    "command",
    "has_cpu_controller",
    "kernel_env",
    "loopback_bytes",
    "method",
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
    "but NO memory or process cap for the whole student (cgroups need root), and files the "
    "grader can read outside the hidden paths stay readable"
)


NO_CPU_CAVEAT = (
    "no cgroup v1 cpu controller at /sys/fs/cgroup/cpu: a student who keeps many processes "
    "busy slows the classmates graded beside them (no CPU share per student)"
)


def caveat() -> str | None:
    """What the sandbox cannot do on this host although it runs (None: nothing)."""
    if method() == "bwrap":
        return BWRAP_CAVEAT
    return NO_CPU_CAVEAT if method() == "root" and not has_cpu_controller() else None


@functools.cache
def _host() -> tuple[str | None, str | None]:
    if not sys.platform.startswith("linux"):
        return None, f"sandboxing needs Linux (this is {sys.platform})"
    missing = [ns for ns in ("pid", "mnt", "ipc", "net") if not os.path.exists(f"/proc/self/ns/{ns}")]
    if missing:
        return None, f"the Linux kernel has no {'/'.join(missing)} namespaces"
    if os.geteuid() != 0:
        why = _bwrap_problem()
        return (
            ("bwrap", None)
            if why is None
            else (
                None,
                f"the grader does not run as root (no user switch, mounts or cgroups), and bubblewrap "
                f"cannot stand in: {why}",
            )
        )
    for controller in ("memory", "pids"):
        if not (CGROUP_ROOT / controller / "cgroup.procs").exists():
            return None, f"no cgroup v1 {controller} controller at {CGROUP_ROOT / controller}"
    return "root", None


def _bwrap_problem() -> str | None:
    exe = shutil.which("bwrap")
    if exe is None:
        return "no `bwrap` on PATH (Debian/Ubuntu: apt-get install bubblewrap)"
    try:
        run = subprocess.run(
            [
                exe,
                *BWRAP_NAMESPACES,
                "--ro-bind",
                "/",
                "/",
                "--dev",
                "/dev",
                "--proc",
                "/proc",
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


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                children = [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
                found += children
                todo += children
        except (OSError, ValueError):
            pass
    return found


def namespace_process(pid: int, kind: str) -> int:
    """The first process at or below ``pid`` in another ``kind`` namespace ("net", "pid")
    than the grader's: inside the sandbox (its init), or ``pid`` itself when the kernel shares
    the grader's (no sandbox)."""
    try:
        own = os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return pid
    for p in [pid] + _descendants(pid):
        try:
            if os.readlink(f"/proc/{p}/ns/{kind}") != own:
                return p
        except OSError:
            continue
    return pid


def loopback_bytes(pid: int) -> int | None:
    """Bytes sent so far over loopback in the network namespace of the kernel started as
    ``pid``: the sandbox's own namespace (the first process below ``pid`` in a namespace other
    than the grader's), or the host's when the kernel is not sandboxed (more traffic than the
    student's, never less: traffic between local addresses always crosses ``lo``).  Headers
    and acknowledgements included, so at least every payload byte the ranks sent each other.
    None where it cannot be read."""
    where = namespace_process(pid, "net")
    try:
        for line in Path(f"/proc/{where}/net/dev").read_text().splitlines():
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[8])  # receive: 8 fields, then transmit bytes
    except (OSError, ValueError, IndexError):
        pass
    return None


# ----------------------------------------------------------------------------------------
# the spec the grader passes, and the command that starts a kernel in a sandbox


def spec(*, uid: int, memory: int, pids: int, data_limit: int, cgroup: str, hide: list[str], keep: list[str]) -> dict:
    return {
        "uid": uid,
        "memory": memory,
        "pids": pids,
        "data_limit": data_limit,
        "cgroup": cgroup,
        "hide": hide,
        "keep": keep,
        "method": method(),
    }


def command(the_spec: dict, kernel_cmd: list[str]) -> list[str]:
    # run as a file, isolated (-I: no env, no script dir on sys.path): importing the
    # disttrain_lab package would import torch, seconds per kernel start
    return [sys.executable, "-I", os.path.abspath(run_sandbox.__file__), json.dumps(the_spec), "--", *kernel_cmd]
