"""Bytes the ranks sent each other, counted by the operating system, not by the ranks.

A rank's trace (``dl.launch(..., trace=True)``) is written inside the rank's own process, so
a rank can write anything there.  The kernel's TCP stack counts what really crossed each
connection: ``ss -ti`` shows, per socket, ``bytes_received`` (payload bytes read off that
connection, TCP/IP headers excluded).  Gloo gives every pair of ranks that talk its own
TCP connection, so the bytes rank A sent rank B are the bytes B's end of their connection
received.  A launch's process group stays up until the next launch, so its sockets can be
read right after the launch returns; a snapshot before and one after give what the launch
moved (``traffic``).  Gloo adds a small header to each message (about 150 bytes on torch
2.13), so a message of S payload bytes counts a little more than S.

    before = wire.snapshot()
    ... launch ...
    moved = wire.traffic(before, wire.snapshot(), pids=[pid of rank 0, pid of rank 1, ...])
    moved.sent(0), moved.received(1), moved.between(0, 1)

``snapshot(netns_pid=P)`` reads the sockets of the network namespace that process ``P`` is in
(``nsenter``, for the grader, which runs outside the student's sandbox); pids in the answer
are then the host's.  Needs ``ss`` (iproute2); ``available()`` says why not.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

__all__ = ["Socket", "Traffic", "snapshot", "traffic", "available"]

_RECEIVED = re.compile(r"\bbytes_received:(\d+)")
_PID = re.compile(r"\bpid=(\d+)")


@dataclass(frozen=True)
class Socket:
    """One established TCP connection end: its owner, its two addresses, what it received."""

    pid: int | None
    local: str
    peer: str
    received: int


@dataclass
class Traffic:
    """Payload bytes (gloo's message headers included) each rank sent each other rank.

    ``matrix[a][b]``: bytes rank ``a`` sent rank ``b``, as counted by the OS; ``source`` says
    where the numbers come from (``"os"``, or ``"trace"`` where the OS could not be asked)."""

    matrix: list[list[int]]
    source: str = "os"

    @property
    def world_size(self) -> int:
        return len(self.matrix)

    def sent(self, rank: int) -> int:
        return sum(self.matrix[rank])

    def received(self, rank: int) -> int:
        return sum(row[rank] for row in self.matrix)

    def between(self, src: int, dst: int) -> int:
        return self.matrix[src][dst]

    @property
    def total(self) -> int:
        return sum(map(sum, self.matrix))

    def describe(self) -> str:
        pairs = [f"{a}->{b}: {n:,} B" for a, row in enumerate(self.matrix) for b, n in enumerate(row) if n]
        return ", ".join(pairs) or "no bytes between ranks"


def available() -> str | None:
    """Why the OS's counts cannot be read here, or None when they can."""
    if shutil.which("ss") is None:
        return "`ss` (iproute2) is not installed"
    return None


def _same_netns(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
    except OSError:
        return False


def snapshot(
    netns_pid: int | None = None, timeout: float = 10.0, user: int | None = None
) -> dict[tuple[str, str], Socket]:
    """Every established TCP socket of a network namespace, by (local, peer) address.

    ``netns_pid``: a process in the namespace to read (None: this process's).  ``user``: read as
    that uid (``setpriv``, the effective ids only: the real ones stay the caller's, so that user's
    processes can neither read nor change the reader), where only it may see which of its processes
    owns a socket (a root without CAP_SYS_PTRACE, in a container).  Raises RuntimeError with the
    reason when it cannot be read."""
    why = available()
    if why:
        raise RuntimeError(why)
    cmd = ["ss", "-tinpH", "state", "established"]
    if netns_pid is not None and not _same_netns(netns_pid):
        cmd = ["nsenter", f"--net=/proc/{netns_pid}/ns/net", *cmd]
    if user is not None:
        cmd = ["setpriv", f"--euid={user}", f"--egid={user}", "--clear-groups", "--", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[:300]}")
    return parse(done.stdout)


def parse(text: str) -> dict[tuple[str, str], Socket]:
    """``ss -tinpH state established``'s output, by (local, peer) address."""
    found: dict[tuple[str, str], Socket] = {}
    head: list[str] | None = None
    info: list[str] = []

    def flush() -> None:
        if head is None or len(head) < 4:
            return
        local, peer = head[2], head[3]
        pid = _PID.search(" ".join(head[4:]))
        received = _RECEIVED.search(" ".join(info))
        found[(local, peer)] = Socket(
            pid=int(pid.group(1)) if pid else None,
            local=local,
            peer=peer,
            received=int(received.group(1)) if received else 0,
        )

    for line in text.splitlines():
        if not line.strip():
            continue
        if line[0].isspace():
            info.append(line)
            continue
        flush()
        head, info = line.split(), []
    flush()
    return found


def traffic(before: dict[tuple[str, str], Socket], after: dict[tuple[str, str], Socket], pids: list[int]) -> Traffic:
    """What moved between the processes ``pids`` (rank r is ``pids[r]``) from ``before`` to
    ``after``.  A connection that is new in ``after`` counts whole; one that was already there
    counts its growth.  Connections to anything that is not a rank (the launcher's store) are
    left out."""
    rank_of = {pid: r for r, pid in enumerate(pids)}
    matrix = [[0] * len(pids) for _ in pids]
    for key, sock in after.items():
        receiver = rank_of.get(sock.pid)
        other = after.get((sock.peer, sock.local))  # the other end of the same connection
        sender = rank_of.get(other.pid) if other is not None else None
        if receiver is None or sender is None or sender == receiver:
            continue
        old = before.get(key)
        grown = sock.received - (old.received if old is not None and old.pid == sock.pid else 0)
        matrix[sender][receiver] += max(0, grown)
    return Traffic(matrix=matrix)
