"""The one reaper: finding and stopping the processes a grading started, through psutil.

Every process tree the grader stops goes through here (a step's nbgrader process and what it
left, the kernels of a killed grading, a sandbox's init and what runs below it).  Where the
processes sit in a cgroup of their own (a sandboxed student), ``cgroups.Cgroup.kill`` stops
them in one step instead (v2's ``cgroup.kill``: no fork slips past it); a tree walked here can
gain a child between the walk and the kill, so callers that must leave nothing loop
(``kill_new``) until a walk finds nothing new.
"""

from __future__ import annotations

import os
import signal

import psutil


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first, then theirs); [] when it is gone."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def children(pid: int) -> list[int]:
    """The processes ``pid`` started itself."""
    try:
        return [p.pid for p in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def ended(pid: int) -> bool:
    """Whether ``pid`` no longer runs: gone, or a zombie its parent has not reaped yet (a
    sandboxed kernel's wrapper, whose parent is the nbgrader process, stays one until that
    process polls it)."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return True


def kill(pids) -> None:
    """SIGKILL each of ``pids`` that still runs.  Reaping is the caller's: a child that a
    ``subprocess.Popen`` holds must be reaped by its ``wait()``, or that reads exit status 0
    (``steps._reap_orphans`` waits for the orphans it kills)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


def kill_tree(pid: int) -> None:
    """``pid`` and every process below it."""
    kill([*descendants(pid), pid])


def environ_has(pid: int, marker: bytes) -> bool:
    """Whether ``pid``'s environment holds ``marker`` (read as bytes: a student's process may
    carry any text there)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read()
    except OSError:
        return False


def processes_with(marker: str) -> list[int]:
    """Processes (but this one) whose environment mentions ``marker`` (a course dir, a run's
    own tag): what must be none after grading."""
    me = os.getpid()
    return [p for p in psutil.pids() if p != me and environ_has(p, marker.encode())]
