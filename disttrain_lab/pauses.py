"""Whether a process is paused in ``time.sleep``, and the private memory it holds, read from ``/proc``;
and the watch that reads every rank once all pause (``osmemory.Watch`` runs it).  Also which socket a
process's main thread is blocked reading (``receiving_on``): the grader's gate reads it to know that a rank
that says it waits at the gate is waiting there itself (``grading/gatekeeper.py``), and the memory it holds
while it waits there (``memory_while_receiving``: lab 9 is read at the gate).

Run as a file, ``python -I pauses.py PID ...``, by ``osmemory.Watch``: as the student's uid where the
grader may not read another uid's ``/proc/<pid>/smaps_rollup`` (a root without CAP_SYS_PTRACE, in a
container; ``setpriv``, the effective ids only, so that the student's processes can neither signal nor
trace it), else as the grader.  So it imports nothing but the standard library.  It speaks one JSON
line at a time on stdout, and waits for one line on stdin after a reading:

- once every process is paused: ``{"held": [bytes, ...]}``; then it waits for the caller to read what
  else it needs at that moment (the wire) and to say so (a line on stdin);
- then ``{"kept": true}`` if every process is still in the same pause, and only then it ends the pause
  (the ``WAKE_SIGNAL`` that ``osmemory.pause`` waits for: a caller that stops the watch once the ranks
  have run on has read the line), else ``{"kept": false}``; and it waits for the next pause (a driver
  may pause the ranks more than once);
- ``{"ended": pid}`` once a process has ended (the run is over; a zombie not reaped yet too), ``{"error": why}``
  where one cannot be read; and it exits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import signal
import sys
import time

if __package__:
    from . import stored
else:  # run as a file (``python -I pauses.py``, which puts no folder on the path): the sibling, by its path
    _path = os.path.join(os.path.dirname(__file__), "stored.py")
    _spec = importlib.util.spec_from_file_location("disttrain_stored", _path)
    stored = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(stored)

__all__ = [
    "Hidden",
    "PAUSE_SYSCALL",
    "RECEIVE_SYSCALLS",
    "STRANGERS",
    "WAKE_SIGNAL",
    "pause_of",
    "paused",
    "memory_while_receiving",
    "held_bytes",
    "private_bytes",
    "receiving_on",
    "strangers",
    "watch",
]

# clock_nanosleep, what time.sleep calls on Linux (Python >= 3.11)
PAUSE_SYSCALL = {"x86_64": 230, "aarch64": 115, "arm64": 115}.get(platform.machine())
# read, recvfrom, recvmsg: the calls a thread waiting for a socket's data blocks in (Python's socket.recv on a
# socket without a Python-level timeout calls recvfrom; with one it would wait in poll first)
RECEIVE_SYSCALLS = {"x86_64": (0, 45, 47), "aarch64": (63, 207, 212), "arm64": (63, 207, 212)}.get(
    platform.machine(), ()
)
WAKE_SIGNAL = signal.SIGUSR2  # ends the driver's pause once the ranks are read (worker.py ignores it elsewhere)
POLL_S = 0.005
# (Private_Hugetlb: a private mapping of the host's huge pages, MAP_HUGETLB, is counted in neither Private_Clean nor
# Private_Dirty; a host that keeps no huge pages, /proc/sys/vm/nr_hugepages 0, gives none)
PRIVATE_FIELDS = (b"Private_Clean:", b"Private_Dirty:", b"Private_Hugetlb:", b"Swap:")


def private_bytes(pid: int) -> int:
    """Process ``pid``'s private memory from ``/proc/<pid>/smaps_rollup`` (read as bytes; every
    field it needs must be there, in kB)."""
    with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
        text = f.read(1 << 16)
    found = {}
    for line in text.splitlines():
        for name in PRIVATE_FIELDS:
            if line.startswith(name):
                parts = line[len(name) :].split()
                if len(parts) != 2 or parts[1] != b"kB" or not parts[0].isdigit():
                    raise ValueError(f"/proc/{pid}/smaps_rollup: {line[:80]!r} is not '<n> kB'")
                found[name] = int(parts[0]) * 1024
    missing = [n.decode() for n in PRIVATE_FIELDS if n not in found]
    if missing:
        raise ValueError(f"/proc/{pid}/smaps_rollup has no {', '.join(missing)}")
    return sum(found.values())


class Hidden(ValueError):
    """A process holds memory where the OS's count of its own does not see it, in a way the grader cannot count
    (``held_bytes``): a reading of it would undercount, so it is refused."""


def held_bytes(pid: int) -> int:
    """What process ``pid`` holds, as the grader counts it at a reading: its private memory (``private_bytes``),
    and what it keeps where that count does not see it (#42, "memory the OS's private count misses"):

    - its shared mappings, whole (``_shared_mapped``; at least their resident pages, ``RssShmem`` of
      ``/proc/<pid>/status``: a ``MAP_SHARED`` mapping that a process it forked also maps counts in neither's
      private memory; a memfd it mapped; pages dropped with ``MADV_DONTNEED`` and touched back later);
    - the files it holds open that hold data of their own (``_descriptor_bytes``: a memfd or a ``memfd_secret``
      written and not mapped, by its size, a file open for writing, a deleted file still open), and the bytes
      waiting in its TCP sockets' queues, sent or received and not read (a connection to itself, or one it never
      accepted, parks them in the OS's buffers);
    - refused (``Hidden``): a process it started (a fork shares its pages, copy-on-write, so neither counts
      them as private), more pipes or non-TCP sockets than a rank's own (``KIT_PIPES``, ``KIT_SOCKETS``); the
      OS keeps what those hold and no reading of them is exact.

    A rank's own pipes and socket are not counted: each holds 64 KiB unread (1 MiB at most, a pipe made larger),
    and what a rank writes into its channels to the kernel goes to the student's kernel, which is not read
    (see docs/architecture.md)."""
    children = _children(pid)
    if children:
        raise Hidden(
            f"process {pid} had started process(es) {children[:4]} of its own: a forked process shares its parent's "
            "memory (copy-on-write), which then counts as neither's private memory; a graded run's ranks may "
            "start none"
        )
    shared = max(_status_kb(pid, b"RssShmem:") * 1024, _shared_mapped(pid))
    return private_bytes(pid) + shared + _descriptor_bytes(pid)


def _shared_mapped(pid: int) -> int:
    """The bytes of process ``pid``'s shared mappings (``s`` in ``/proc/<pid>/maps``), whole, resident or not: a
    shared anonymous mapping (or a memfd's, closed) whose pages were dropped with ``MADV_DONTNEED`` is in no count
    of resident pages, and its data comes back at the next touch.  A rank's own: its status slot and glibc's
    read-only ``gconv-modules.cache`` (28 KiB)."""
    total = 0
    with open(f"/proc/{pid}/maps", "rb") as f:
        for line in f.read().splitlines():
            span, perms = line.split(b" ", 2)[:2]
            if perms[3:4] == b"s":
                start, _, end = span.partition(b"-")
                total += int(end, 16) - int(start, 16)
    return total


# why a reading is refused where ``strangers`` found processes (their pids, the first four)
STRANGERS = (
    "process(es) {} started after the ranks, in their cgroup, were still there at the reading: a process a rank forks "
    "shares its memory copy-on-write, which then counts as neither's private memory; a graded run's ranks may start "
    "none"
)


def strangers(pids: list[int]) -> list[int]:
    """The processes of the uid and cgroup of the processes ``pids`` (a graded run's ranks: the sandbox's, or a
    test's) that started after the first of them and are not one of them: what a rank forked and left (a child
    that forked again and ended leaves its own child to the sandbox's init), whose pages it shares copy-on-write.
    Left out, the grader's own helpers (descended from this process, and from no rank); and where the ranks are
    this process's own (the student's kernel, or a test's: nothing between them and it), the other programs of
    that user (descended from no rank, in another session than the ranks': a browser that the student's laptop, or
    a test, started meanwhile; a rank's orphan keeps the ranks' session, unless it made one of its own, which only a
    graded run's sandbox, where every process of the cgroup counts, would see).  Read from ``/proc/<pid>/stat``,
    ``status`` and ``cgroup``, which every uid may read.  (Two students graded at once have a uid and a cgroup
    each: ``grading/uids.py``, ``grading/cgroups.py``.)"""
    ranks, me = set(pids), os.getpid()
    group, uid = _cgroup(pids[0]), _uid(pids[0])
    first = min(_stat(p)[1] for p in pids)
    ours = _descends_from(pids[0], me)
    session = _stat(pids[0])[2]
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in ranks:
            continue
        pid = int(entry)
        try:
            if _stat(pid)[1] < first or _uid(pid) != uid or _cgroup(pid) != group:
                continue
            if not any(_descends_from(pid, rank) for rank in ranks) and (
                _descends_from(pid, me) or (ours and _stat(pid)[2] != session)
            ):
                continue
        except (OSError, ValueError):  # (ended meanwhile)
            continue
        found.append(pid)
    return found


def _stat(pid: int) -> tuple[int, int, int]:
    """(parent's pid, start time in clock ticks since boot, session id) of process ``pid``."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read(1 << 12).rpartition(b")")[2].split()  # (the name, in parentheses, is the process's own)
    return int(fields[1]), int(fields[19]), int(fields[3])


def _status(pid: int, field: bytes) -> list[bytes]:
    """The words after ``field`` (e.g. ``b"Uid:"``) on its line of ``/proc/<pid>/status`` (read as bytes: the
    line a process names itself on is its own, and comes first)."""
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f.read(1 << 14).splitlines()[1:]:
            if line.startswith(field):
                return line[len(field) :].split()
    raise ValueError(f"/proc/{pid}/status has no {field.decode()}")


def _uid(pid: int) -> bytes:
    """Process ``pid``'s real uid (the first of ``Uid:``'s four)."""
    return _status(pid, b"Uid:")[0]


def _cgroup(pid: int) -> bytes:
    with open(f"/proc/{pid}/cgroup", "rb") as f:
        return f.read(1 << 14)


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        pid = _stat(pid)[0]
    return False


# what a rank holds of its own: its channels to the kernel that forked it (ranks.start: its output and stack pipes,
# its control socket) and gloo's (its event loop's wake-up pipe, both ends in the rank)
KIT_PIPES, KIT_SOCKETS = 3, 1


def _children(pid: int) -> list[int]:
    """The processes ``pid``'s threads started that are still there (``/proc/<pid>/task/<tid>/children``)."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found += [int(p) for p in f.read().split() if p.isdigit()]
        except FileNotFoundError:  # (a thread that ended meanwhile; a kernel without CONFIG_PROC_CHILDREN: below)
            if os.path.exists(f"/proc/{pid}/task/{tid}") and not os.path.exists(f"/proc/{pid}/task/{tid}/children"):
                raise Hidden(
                    f"this kernel does not list a process's children (/proc/{pid}/task/{tid}/children)"
                ) from None
    return found


def _status_kb(pid: int, field: bytes) -> int:
    parts = _status(pid, field)
    if len(parts) != 2 or parts[1] != b"kB" or not parts[0].isdigit():
        raise ValueError(f"/proc/{pid}/status: {field.decode()} is not '<n> kB'")
    return int(parts[0])


def _descriptor_bytes(pid: int) -> int:
    """The bytes process ``pid``'s open descriptors hold: memfds and ``memfd_secret``s (their blocks, or their
    size where larger), files open for writing and deleted files still open (their allocated blocks), each file
    once, and the queues of its TCP sockets (and of the connections waiting unaccepted on
    one it listens on).  Raises ``Hidden`` for pipes and non-TCP sockets beyond the kit's channels."""
    total, files, sockets, pipes = 0, set(), set(), set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{name}"
        try:
            link = os.readlink(path)
        except FileNotFoundError:  # (closed meanwhile)
            continue
        if link.startswith("pipe:["):
            pipes.add(link)
        elif link.startswith("socket:[") and link[8:-1].isdigit():
            sockets.add(int(link[8:-1]))
        elif link.startswith("/"):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if not _is_regular(st.st_mode) or (st.st_dev, st.st_ino) in files:
                continue
            anonymous = link.startswith(("/memfd:", "/secretmem"))  # (secretmem's blocks read 0: its size counts)
            if anonymous or link.endswith(" (deleted)") or _open_for_writing(pid, name):
                files.add((st.st_dev, st.st_ino))
                total += max(st.st_blocks * 512, st.st_size if anonymous else 0)
    queued, tcp = _tcp_queues(pid, sockets)
    others = len(sockets - tcp)
    if len(pipes) > KIT_PIPES or others > KIT_SOCKETS:
        raise Hidden(
            f"process {pid} held {len(pipes)} pipe(s) and {others} socket(s) that are not TCP's, where a rank's own "
            f"are {KIT_PIPES} and {KIT_SOCKETS}: what a pipe or a local socket holds, the OS counts in no process's "
            "memory; a graded run's ranks may open none"
        )
    return total + queued


def _is_regular(mode: int) -> bool:
    return (mode & 0o170000) == 0o100000


def _open_for_writing(pid: int, fd: str) -> bool:
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as f:
            for line in f.read(4096).splitlines():
                if line.startswith(b"flags:"):
                    return int(line.split()[1], 8) & 0o3 != 0  # O_WRONLY or O_RDWR
    except (FileNotFoundError, ValueError, IndexError):
        pass
    return False


def _tcp_queues(pid: int, inodes: set[int]) -> tuple[int, set[int]]:
    """(the bytes queued in the TCP sockets among ``inodes``, those that are TCP sockets), from the tables of
    process ``pid``'s network namespace (``/proc/<pid>/net/tcp`` and ``tcp6``).  A connection that has arrived
    on a socket it listens on and was not accepted has no descriptor (inode 0): its queues count for the
    listener.  A listener's own queue counts connections, not bytes."""
    rows = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}", "rb") as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or b":" not in fields[4]:
                continue
            tx, rx = (int(q, 16) for q in fields[4].split(b":"))
            rows.append((fields[1], fields[3], tx, rx, int(fields[9])))
    listening = {local for local, state, _, _, inode in rows if state == b"0A" and inode in inodes}
    tcp = {inode for *_, inode in rows if inode in inodes}
    queued = sum(
        tx + rx
        for local, state, tx, rx, inode in rows
        if state != b"0A" and (inode in inodes or (inode == 0 and local in listening))
    )
    return queued, tcp


def pause_of(pid: int) -> int | None:
    """Which pause process ``pid`` is in: the count of times it has slept (its main thread's voluntary context
    switches, which one uninterrupted ``clock_nanosleep`` does not change), or None where it is not in one."""
    with open(f"/proc/{pid}/syscall", "rb") as f:
        first = f.read(64).split(b" ", 1)[0]
    if not (first.isdigit() and int(first) == PAUSE_SYSCALL):
        return None
    return _switches(pid)


def _switches(pid: int) -> int:
    """Process ``pid``'s main thread's count of voluntary context switches (one blocking wait does not change it)."""
    count = _status(pid, b"voluntary_ctxt_switches:")
    if len(count) != 1 or not count[0].isdigit():
        raise ValueError(f"/proc/{pid}/status: voluntary_ctxt_switches is not a count")
    return int(count[0])


def receiving_on(pid: int) -> int | None:
    """The inode of the socket process ``pid``'s main thread is blocked reading (``RECEIVE_SYSCALLS``, its first
    argument the socket's descriptor, ``/proc/<pid>/fd/<fd>`` a ``socket:[inode]``), or None where it is in no
    such call.  Raises OSError where the process cannot be read (gone, or another uid's without ptrace's right)."""
    with open(f"/proc/{pid}/syscall", "rb") as f:
        fields = f.read(256).split()
    if len(fields) < 2 or not fields[0].isdigit() or int(fields[0]) not in RECEIVE_SYSCALLS:
        return None  # (running, or blocked in another call)
    try:
        link = os.readlink(f"/proc/{pid}/fd/{int(fields[1], 16)}")
    except (FileNotFoundError, ValueError):  # (closed since: not waiting on it; a refusal is raised, as above)
        return None
    inode = link[len("socket:[") : -1] if link.startswith("socket:[") and link.endswith("]") else ""
    return int(inode) if inode.isdigit() else None


def memory_while_receiving(pid: int) -> tuple[int, int] | None:
    """(the inode of the socket process ``pid``'s main thread is blocked reading, its memory, ``held_bytes``): the
    memory read while that thread waited there, the same wait before and after the reading (the socket and its count of
    voluntary context switches unchanged); None where it was not waiting so throughout."""
    inode = receiving_on(pid)
    if inode is None:
        return None
    switches = _switches(pid)
    held = held_bytes(pid)
    return (inode, held) if receiving_on(pid) == inode and _switches(pid) == switches else None


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie its parent has not reaped yet (whose files in
    /proc, ``syscall`` among them, are root's: reading one as its uid is refused, which is no error of the watch)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read(1 << 12).rpartition(b")")[2].split()[:1]
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return state in ([b"Z"], [b"X"])


def paused(pid: int) -> bool:
    """Whether process ``pid`` is blocked in ``clock_nanosleep`` (``time.sleep``) now."""
    return pause_of(pid) is not None


def watch(pids: list[int], said=sys.stdout, told=sys.stdin, stores: bool = False) -> None:
    """The protocol of the module's docstring, for every pause of ``pids``, until ``told`` ends or a process
    ends (``{"ended": pid}``) or cannot be read (``{"error": why}``).  ``stores``: each process's reading also
    counts what the tmpfs mounts it may write hold (``stored.stored_bytes``: a graded run's sandbox)."""

    def say(**what) -> None:
        said.write(json.dumps(what) + "\n")
        said.flush()

    try:
        while True:
            pauses = [pause_of(p) for p in pids]
            if None in pauses:
                time.sleep(POLL_S)
                continue
            # (the ranks share one mount namespace; its files counted before and after the ranks, the larger kept:
            # a rank's thread that moves what it holds into a file as the others are read is counted either way)
            before = stored.stored_bytes(pids[0]) if stores else 0
            held = [held_bytes(p) for p in pids]
            after = stored.stored_bytes(pids[0]) if stores else 0
            say(held=[h + max(before, after) for h in held])
            if not told.readline():
                return
            kept = [pause_of(p) for p in pids] == pauses  # (still the same pause: the reading stands)
            say(kept=kept)  # (before the pause ends: a caller that stops the watch once the ranks ran on has it)
            if kept:
                for pid in pids:
                    try:
                        os.kill(pid, WAKE_SIGNAL)
                    except OSError:  # (ended since, or not ours to signal: its pause ends by itself)
                        pass
            while any(pause_of(p) == was for p, was in zip(pids, pauses)):
                time.sleep(POLL_S)  # (each has left this pause: none read twice in it)
    except (OSError, ValueError) as exc:
        gone = [p for p in pids if ended(p)]
        if gone:
            say(ended=gone[0])
        else:
            say(error=f"{type(exc).__name__}: {exc}"[:300])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--receiving"]:  # `python -I pauses.py --receiving PID ...`: receiving_on each, as JSON
        print(json.dumps({p: receiving_on(int(p)) for p in sys.argv[2:]}))
    elif sys.argv[1:2] == ["--memory"]:  # `python -I pauses.py --memory PID ...`: memory_while_receiving each

        def _read(pid: int):
            try:
                return memory_while_receiving(pid)
            except Hidden as exc:
                return {"hidden": str(exc)}

        print(json.dumps({p: _read(int(p)) for p in sys.argv[2:]}))
    elif sys.argv[1:2] == ["--stored"]:  # `python -I pauses.py --stored PID ...`: stored.stored_bytes each
        print(json.dumps({p: stored.stored_bytes(int(p)) for p in sys.argv[2:]}))
    else:  # `python -I pauses.py [--stores] PID ...`: watch, as JSON lines (osmemory.Watch)
        stores = sys.argv[1:2] == ["--stores"]
        watch([int(p) for p in sys.argv[1 + stores :]], stores=stores)
