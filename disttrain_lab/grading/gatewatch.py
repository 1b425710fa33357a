"""What the grader reads of the OS while its gate holds a graded run's ranks (the gate itself: ``gatekeeper.py``).

``for_ranks`` makes a run's ``Gatekeeper`` with its readers: what each rank has sent the others (``wire.snapshot`` in
the student's network namespace, by socket owner), whether a rank that says it is held is its main thread blocked
reading its gate connection (``pauses.receiving_on``), its private memory read while it waits there
(``pauses.memory_while_receiving``), and whether any thread of a rank is left to run (``/proc/<pid>/task``).  Where
the grader may not read another uid's ``/proc/<pid>`` (a root without CAP_SYS_PTRACE, in Gradescope's container),
``pauses.py`` runs as the student's uid (``read_as``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import torch

from disttrain_lab import pauses, wire
from disttrain_lab.grading.gatekeeper import Gatekeeper
from disttrain_lab.stored import stored_bytes

__all__ = ["for_ranks", "read_as", "receiving", "runnable", "stored"]


def for_ranks(
    netns_pid: int | None,
    answers: list[torch.Tensor],
    pids: list[int],
    user: int | None,
    timeout: float,
    memory: bool = False,
    stores: bool = False,
) -> Gatekeeper:
    """A gatekeeper for a run on the processes ``pids`` (rank r is ``pids[r]``, the host's ids) in the
    network namespace of ``netns_pid``, counting what they send each other as ``wire.snapshot`` reads it
    (as ``user``, where only that uid may see which process owns a socket).  ``memory``: at each hold, each
    held rank's private memory read while its main thread waits reading its gate connection (``Seen.memory``), and,
    with ``stores``, the bytes in files of every tmpfs the ranks may write (``stored.stored_bytes``: a sandbox's)."""
    owner: dict[int, int] = {}

    def baseline():
        return wire.snapshot(netns_pid, user=user)

    def sent(base) -> list[int]:
        now = wire.snapshot(netns_pid, user=user)
        if not owner:  # (the ranks' connections are open by the step's start: read whose they are once)
            owner.update(wire.owners(pids, user))
        return [sum(row) for row in wire.traffic(base, now, pids, owner=owner).matrix]

    ends: dict[str, tuple[int, int]] = {}  # a gate connection's rank end -> (its socket's inode, the rank's pid)

    def holding(connections: list[tuple[str, str]]) -> str:
        """'' where the process at the rank's end of each gate connection is one of ``pids`` and its main thread
        is blocked reading that connection's socket (``pauses.receiving_on``), else why not."""
        if any(rank_end not in ends for _, rank_end in connections):
            sockets, owned = wire.snapshot(netns_pid, user=user), wire.owners(pids, user)
            for gate_end, rank_end in connections:
                found = sockets.get((rank_end, gate_end))
                if found is not None and found.inode in owned:
                    ends[rank_end] = (found.inode, owned[found.inode])
        for _, rank_end in connections:
            if rank_end not in ends:
                return f"no rank of the run holds the gate connection from {rank_end}"
            inode, pid = ends[rank_end]
            if receiving(pid, user) != inode:
                return (
                    f"rank {pids.index(pid)} said it was held at the gate, but its main thread was not waiting for the "
                    "grader's answer (a thread of its own spoke for it)"
                )
        return ""

    def memory_of(connections: list[tuple[str, str]]) -> list[int | str | None]:
        """Each connection's rank's memory (``pauses.held_bytes``), read while its main thread waited reading that
        gate connection (``holding`` found its rank end just before); else None, or why it was refused (a process
        the ranks started, memory held where the OS's count misses it: ``pauses.Hidden``)."""
        try:
            started = pauses.strangers(pids)
        except (OSError, ValueError) as exc:  # (a rank gone, or unreadable: not read)
            return [f"the processes beside the ranks could not be read: {exc}"[:300]] * len(connections)
        if started:
            return [pauses.STRANGERS.format(started[:4])] * len(connections)
        read: list[int | str | None] = []
        before = stored(user, pids[0]) if stores else 0  # (the ranks share one mount namespace: it counts for each)
        if isinstance(before, str):
            return [before] * len(connections)
        for _, rank_end in connections:
            inode, pid = ends.get(rank_end, (None, None))
            try:
                got = read_as(user, pauses.memory_while_receiving, "--memory", pid) if pid is not None else None
            except pauses.Hidden as exc:
                got = {"hidden": str(exc)}  # (as ``pauses.py --memory`` says it, run as the student's uid)
            except (OSError, ValueError, subprocess.SubprocessError):  # (gone, or unreadable: not read)
                got = None
            if isinstance(got, dict):
                read.append(str(got.get("hidden"))[:400])
            else:
                read.append(got[1] if isinstance(got, (list, tuple)) and len(got) == 2 and got[0] == inode else None)
        after = stored(user, pids[0]) if stores else 0  # (again after the ranks: the larger counts)
        if isinstance(after, str):
            return [after] * len(connections)
        return [r + max(before, after) if type(r) is int else r for r in read]

    return Gatekeeper(
        netns_pid,
        answers,
        sent,
        baseline,
        timeout,
        busy=lambda: any(map(runnable, pids)),
        holding=holding,
        memory=memory_of if memory else None,
    )


def stored(user: int | None, pid: int) -> int | str:
    """``stored.stored_bytes(pid)``, read as ``user`` where this process may not read another uid's ``/proc/<pid>``;
    or why it could not be read (a reading of the ranks' memory is then refused)."""
    try:
        found = read_as(user, stored_bytes, "--stored", pid)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:  # (gone, unreadable, or uncountable)
        found = f"{type(exc).__name__}: {exc}"
    return found if type(found) is int else f"what the ranks' writable folders hold could not be read ({found})"[:300]


def receiving(pid: int, user: int | None) -> int | None:
    """``pauses.receiving_on(pid)``, read as ``user`` where this process may not read another uid's
    ``/proc/<pid>/syscall`` (a root without CAP_SYS_PTRACE, in a container)."""
    found = read_as(user, pauses.receiving_on, "--receiving", pid)
    return found if isinstance(found, int) else None


def read_as(user: int | None, function: Callable[[int], object], flag: str, pid: int):
    """``function(pid)`` (one of ``pauses``' readers), or, where this process may not read another uid's
    ``/proc/<pid>`` (a root without CAP_SYS_PTRACE, in a container), ``pauses.py <flag> pid`` run as ``user``: its
    JSON (None where it failed)."""
    try:
        return function(pid)
    except PermissionError:
        if user is None:
            raise
    done = subprocess.run(
        wire.as_user(user, [sys.executable, "-I", pauses.__file__, flag, str(pid)]), capture_output=True, timeout=10
    )
    try:
        return json.loads(done.stdout or b"{}").get(str(pid)) if done.returncode == 0 else None
    except ValueError:
        return None


def runnable(pid: int) -> bool:
    """Whether a thread of process ``pid`` is running or waiting for a core (state R in
    ``/proc/<pid>/task/<tid>/stat``); a process or thread gone, or unreadable, is not."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"R":
            return True
    return False
