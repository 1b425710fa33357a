"""Bytes the ranks sent each other, counted by the operating system, not by the ranks.

A rank's trace (``dl.launch(..., trace=True)``) is written inside the rank's own process, so
a rank can write anything there.  The kernel's TCP stack counts what really crossed each
connection: ``ss -ti`` shows, per socket, ``bytes_received`` (payload bytes read off that
connection, TCP/IP headers excluded).  Gloo gives every pair of ranks that talk its own
TCP connection, so the bytes rank A sent rank B are the bytes B's end of their connection
received.  Which process owns a socket is read from the kernel as well: ``ss -e`` gives each
socket's inode, and ``/proc/<pid>/fd`` of each rank links to its sockets' inodes
(``socket:[N]``).  No text a student's process chooses is parsed: ``ss -p`` would print each
owner's process name, which a process sets itself (``prctl(PR_SET_NAME)``: a name holding
``pid=1`` or a newline moves or hides its bytes), so it is not used; ``ss``'s output is read as
bytes, and a line it cannot parse fails the read rather than being skipped.  A launch's
process group stays up until the next launch, so its sockets can be read right after the
launch returns; a snapshot before and one after give what the launch
moved (``traffic``).  Gloo's protocol adds its own bytes to each message (96 from the sender,
48 from the receiver: ``protocol_bytes``), so a message of S payload bytes counts S + 96 one way
and 48 the other, exactly.

    before = wire.snapshot()
    ... launch ...
    moved = wire.traffic(before, wire.snapshot(), pids=[pid of rank 0, pid of rank 1, ...])
    moved.sent(0), moved.received(1), moved.between(0, 1)

``snapshot(netns_pid=P)`` reads the sockets of the network namespace that process ``P`` is in
(``nsenter``, for the grader, which runs outside the student's sandbox); ``pids`` are then the
host's.  Needs ``ss`` (iproute2); ``available()`` says why not.  A rank whose sockets cannot be
read (another user's process, one made non-dumpable) fails the count: ``RuntimeError``.

When each byte crossed, and what it carried, is the grader's packet capture of the same connections
(``wiretimeline.Timeline``, built from a ``snapshot``'s sockets and their ``owners``); what either
could not observe raises ``Unobserved`` on every read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from . import fd_links, gloo_ops
from .fd_links import socket_links

__all__ = [
    "Socket",
    "Traffic",
    "protocol_bytes",
    "Unobserved",
    "OffTheWire",
    "snapshot",
    "as_user",
    "owners",
    "traffic",
    "available",
]

_RECEIVED = re.compile(r"(?:^|\s)bytes_received:(\d+)(?:\s|$)")
# a socket's line of `ss -tineH state established`: Recv-Q, Send-Q, local, peer, a timer while one
# runs, the owner's uid where it is not root, then ino:N (before sk: and the grader-made cgroup path)
_HEAD = re.compile(r"\d+\s+\d+\s+(\S+)\s+(\S+)\s+(?:timer:\([\w.,]*\)\s+)?(?:uid:\d+\s+)?ino:(\d+)\s")
_SOCKET_LINK = re.compile(r"socket:\[(\d+)\]")


@dataclass(frozen=True)
class Socket:
    """One established TCP connection end: its socket's inode, its two addresses, what it received."""

    inode: int
    local: str
    peer: str
    received: int


# What a rank may exchange with processes that are not ranks (the launcher's store, which makes the
# process groups): measured on this kit, about 1 KB per rank for a launch's own group and 1 KB more for each
# group it joins (200 B for one it is not in); more is data passed round the wire
OUTSIDE_BASE = 256 << 10  # bytes per rank and run
OUTSIDE_PER_CONNECTION = 16 << 10  # and per connection to another rank the rank opened in the run (a new group's)


class OffTheWire(AssertionError):
    """A rank exchanged more with a process that is not a rank (the launcher's store, the student's kernel)
    than making its process groups takes: the ranks talked round the connections the grader counts."""


class Unobserved(RuntimeError):
    """The bytes between the ranks were not counted by the OS where a grade needs them: the test
    fails rather than take the ranks' own account (``Traffic.unobserved``)."""


# what an Unobserved message tells its reader to do: the instructor where the host could not observe,
# the student where the submission made the run unobservable (its ranks were not left as the kit starts them)
_HOST_COUNTS = (
    "For the instructor: grade on a host where `ss` (iproute2) runs and the grader may read the ranks' "
    "/proc/<pid>/fd (grader/README.md)"
)
SUBMISSION_CHANGED_THE_RANKS = (
    "This was the submission's doing, not the grading host's: leave the ranks as the kit starts them (no "
    "code of the notebook's own may start, replace or change them), and the grader observes them"
)


@dataclass
class Traffic:
    """Payload bytes (gloo's message headers included) each rank sent each other rank.

    ``matrix[a][b]``: bytes rank ``a`` sent rank ``b``, as counted by the OS; ``source`` says
    where the numbers come from: ``"os"``; ``"trace"`` (the ranks' own account, for pictures and
    self-checks where the student's own machine cannot ask the OS); or ``"unobserved"`` (under
    grading, where the grader could not count them: every count raises ``Unobserved``, saying
    why, and ``matrix`` is None)."""

    matrix: list[list[int]] | None
    source: str = "os"
    why: str = ""
    outside: list[int] | None = None  # bytes each rank exchanged (both ways) with processes that are not ranks
    allowed: list[int] | None = None  # how many of them its process groups explain (OUTSIDE_BASE, ..._PER_CONNECTION)
    by_submission: bool = False  # unobserved because of what the submission did, not the host

    @classmethod
    def unobserved(cls, why: str, by_submission: bool = False) -> Traffic:
        return cls(matrix=None, source="unobserved", why=why, by_submission=by_submission)

    def _counts(self) -> list[list[int]]:
        if self.outside is not None and self.allowed is not None:
            over = [(r, n, self.allowed[r]) for r, n in enumerate(self.outside) if n > self.allowed[r]]
            if over:
                said = "; ".join(f"rank {r}: {n:,} bytes, at most {most:,} allowed" for r, n, most in over)
                raise OffTheWire(
                    f"the ranks exchanged data with a process that is not a rank (the launcher's store, or the "
                    f"notebook's kernel) during the run: {said} (making a process group takes about 1 KB). The ranks "
                    "must talk to each other with torch.distributed's calls over their own connections, which the "
                    "grader counts; what goes through the store or another process is not counted, so a run that "
                    "sends data there earns nothing from the bytes it moved"
                )
        if self.matrix is None:
            to_do = SUBMISSION_CHANGED_THE_RANKS if self.by_submission else _HOST_COUNTS
            raise Unobserved(
                f"the grader could not count the bytes between the ranks ({self.why}), so a test that grades "
                f"them fails rather than take the ranks' own account. {to_do}"
            )
        return self.matrix

    @property
    def world_size(self) -> int:
        return len(self._counts())

    def sent(self, rank: int) -> int:
        return sum(self._counts()[rank])

    def received(self, rank: int) -> int:
        return sum(row[rank] for row in self._counts())

    def between(self, src: int, dst: int) -> int:
        return self._counts()[src][dst]

    @property
    def total(self) -> int:
        return sum(map(sum, self._counts()))

    def describe(self) -> str:
        pairs = [f"{a}->{b}: {n:,} B" for a, row in enumerate(self._counts()) for b, n in enumerate(row) if n]
        return ", ".join(pairs) or "no bytes between ranks"


GLOO_PREAMBLE = gloo_ops.PREAMBLE  # bytes before every message of gloo's TCP pairs (gloo_ops)
HANDSHAKE_BYTES = gloo_ops.HANDSHAKE  # gloo's handshake as a launch's process group is made: 8 bytes one way


def protocol_bytes(messages: dict[tuple[int, int], Sequence[int]], world_size: int) -> list[list[int]]:
    """What the OS counts on each connection when these point-to-point messages cross:
    ``messages[(a, b)]`` lists the payload bytes of each message rank ``a`` sends rank ``b``.

    Gloo's TCP pairs (``gloo/transport/tcp/pair.cc``, measured on torch 2.13) put, for each message,
    a note from the sender when the send is posted (its 48-byte preamble alone), a note back from
    the receiver when the receive is posted (48), and then the message (preamble and payload), so a
    message of P bytes costs P + 96 from ``a`` to ``b`` and 48 from ``b`` to ``a``.  The launch's
    connection handshake adds ``HANDSHAKE_BYTES`` on each connection, one way, as a launch begins."""
    matrix = [[0] * world_size for _ in range(world_size)]
    for (a, b), sizes in messages.items():
        matrix[a][b] += sum(sizes) + 2 * GLOO_PREAMBLE * len(sizes)
        matrix[b][a] += GLOO_PREAMBLE * len(sizes)
    return matrix


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


def as_user(user: int, cmd: list[str]) -> list[str]:
    """``cmd`` run as uid ``user`` (``setpriv``, the effective ids only: the real ones stay the caller's, so
    that user's processes can neither signal, trace nor change it), where only that uid may read its
    processes' ``/proc`` (a root without CAP_SYS_PTRACE, in a container)."""
    return ["setpriv", f"--euid={user}", f"--egid={user}", "--clear-groups", "--", *cmd]


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
    cmd = ["ss", "-tineH", "state", "established"]
    if netns_pid is not None and not _same_netns(netns_pid):
        cmd = ["nsenter", f"--net=/proc/{netns_pid}/ns/net", *cmd]
    if user is not None:
        cmd = as_user(user, cmd)
    for attempt in range(3):  # (a connection closing while ss reads may print half of it: read again)
        done = subprocess.run(cmd, capture_output=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.decode('ascii', 'replace').strip()[:300]}")
        try:
            return parse(done.stdout)
        except RuntimeError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def parse(output: bytes | str) -> dict[tuple[str, str], Socket]:
    """``ss -tineH state established``'s output (bytes, as the kernel's tool wrote them), by
    (local, peer) address.  Raises RuntimeError on a line it cannot read: a count that skipped
    one would be a count someone could hide bytes from."""
    text = output.decode("ascii", "replace") if isinstance(output, bytes) else output
    found: dict[tuple[str, str], Socket] = {}
    lines = [line for line in text.split("\n") if line.strip()]
    i = 0
    while i < len(lines):
        head = _HEAD.match(lines[i] + " ")
        if head is None or i + 1 >= len(lines) or not lines[i + 1][0].isspace():
            after = lines[i + 1][:200] if i + 1 < len(lines) else "(the end)"
            raise RuntimeError(
                f"ss printed a line that is not a socket and its details: {lines[i][:200]!r}, then {after!r}"
            )
        received = _RECEIVED.search(lines[i + 1])
        local, peer, inode = head[1], head[2], int(head[3])
        if (local, peer) in found:
            raise RuntimeError(f"ss printed the connection {local} -> {peer} twice")
        found[(local, peer)] = Socket(inode=inode, local=local, peer=peer, received=int(received[1]) if received else 0)
        i += 2
    return found


def holders(
    pids: list[int], user: int | None = None, timeout: float = 10.0, skip_gone: bool = False
) -> dict[int, list[int]]:
    """Socket inode -> the pids among ``pids`` that hold it open (``/proc/<pid>/fd``), in ``pids``' order,
    read as ``user`` where given (as ``snapshot``).  Raises RuntimeError when one cannot be read
    (``skip_gone``: a process that has ended holds nothing)."""
    try:
        if user is None:
            listed = socket_links(pids, skip_gone=skip_gone)
        else:
            args = [fd_links.__file__, *(["--skip-gone"] if skip_gone else []), *map(str, pids)]
            done = subprocess.run(as_user(user, [sys.executable, "-I", *args]), capture_output=True, timeout=timeout)
            if done.returncode != 0:
                why = done.stderr.decode("ascii", "replace").strip().splitlines()[-1:] or ["no reason given"]
                raise OSError(why[0][:300])
            listed = json.loads(done.stdout)
    except OSError as exc:
        raise RuntimeError(f"the ranks' sockets could not be read from /proc/<pid>/fd: {exc}") from None
    found: dict[int, list[int]] = {}
    for pid in pids:
        for link in listed.get(str(pid), []):
            socket = _SOCKET_LINK.fullmatch(link)
            if socket and pid not in found.setdefault(int(socket[1]), []):
                found[int(socket[1])].append(pid)
    return found


def owners(pids: list[int], user: int | None = None, timeout: float = 10.0) -> dict[int, int]:
    """Socket inode -> pid, for every socket each of ``pids`` holds open (the last of them in ``pids``'
    order where two hold one: ``holders``).  Raises RuntimeError when one cannot be read."""
    return {inode: held[-1] for inode, held in holders(pids, user, timeout).items()}


def shared_connections(
    sockets: dict[tuple[str, str], Socket], held: dict[int, list[int]], ranks: list[int]
) -> list[str]:
    """The connections between two of ``ranks`` (pids) that another process holds open too, said
    ("rank 0's connection to rank 1, also open in pid 123"): ``held`` is ``holders`` of every process
    that could (the ranks among them); ``sockets`` a ``snapshot``."""
    rank_of = {pid: r for r, pid in enumerate(ranks)}
    said = []
    for sock in sockets.values():
        mine = [p for p in held.get(sock.inode, []) if p in rank_of]
        other = sockets.get((sock.peer, sock.local))
        theirs = [p for p in held.get(other.inode, []) if p in rank_of] if other is not None else []
        if len(mine) != 1 or len(theirs) != 1 or mine == theirs:
            continue
        extra = [p for p in held[sock.inode] if p != mine[0]]
        if extra:
            said.append(f"rank {rank_of[mine[0]]}'s connection to rank {rank_of[theirs[0]]}, also open in pid {extra}")
    return said


def traffic(
    before: dict[tuple[str, str], Socket],
    after: dict[tuple[str, str], Socket],
    pids: list[int],
    owner: dict[int, int] | None = None,
    user: int | None = None,
) -> Traffic:
    """What moved between the processes ``pids`` (rank r is ``pids[r]``) from ``before`` to
    ``after``.  A connection that is new in ``after`` counts whole; one that was already there
    counts its growth.  Connections to anything that is not a rank (the launcher's store) are
    counted apart, both ways, per rank (``Traffic.outside``).  ``owner``: socket inode -> pid
    (default: ``owners(pids, user)``, read now)."""
    owner = owners(pids, user) if owner is None else owner
    rank_of = {pid: r for r, pid in enumerate(pids)}
    matrix = [[0] * len(pids) for _ in pids]
    outside, opened = [0] * len(pids), [0] * len(pids)
    for key, sock in after.items():
        receiver = rank_of.get(owner.get(sock.inode))
        other = after.get((sock.peer, sock.local))  # the other end of the same connection
        sender = rank_of.get(owner.get(other.inode)) if other is not None else None
        old = before.get(key)
        grown = max(0, sock.received - (old.received if old is not None and old.inode == sock.inode else 0))
        if receiver is not None and sender is None:  # a rank's end of a connection to a process not a rank
            outside[receiver] += grown
        elif sender is not None and receiver is None:  # that process's end: what the rank sent it
            outside[sender] += grown
        elif receiver is not None and sender != receiver:
            matrix[sender][receiver] += grown
            if old is None or old.inode != sock.inode:  # a connection the run opened (a new group's pair)
                opened[receiver] += 1
    allowed = [OUTSIDE_BASE + OUTSIDE_PER_CONNECTION * n for n in opened]
    return Traffic(matrix=matrix, outside=outside, allowed=allowed)
