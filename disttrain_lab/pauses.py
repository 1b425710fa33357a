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

import json
import os
import platform
import signal
import sys
import time

__all__ = [
    "PAUSE_SYSCALL",
    "RECEIVE_SYSCALLS",
    "WAKE_SIGNAL",
    "pause_of",
    "paused",
    "memory_while_receiving",
    "private_bytes",
    "receiving_on",
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
PRIVATE_FIELDS = (b"Private_Clean:", b"Private_Dirty:", b"Swap:")


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
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f.read(1 << 14).splitlines():
            if line.startswith(b"voluntary_ctxt_switches:"):
                count = line.split(b":", 1)[1].strip()
                if count.isdigit():
                    return int(count)
    raise ValueError(f"/proc/{pid}/status has no voluntary_ctxt_switches")


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
    """(the inode of the socket process ``pid``'s main thread is blocked reading, its private memory): the memory
    read while that thread waited there, the same wait before and after the reading (the socket and its count of
    voluntary context switches unchanged); None where it was not waiting so throughout."""
    inode = receiving_on(pid)
    if inode is None:
        return None
    switches = _switches(pid)
    held = private_bytes(pid)
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


def watch(pids: list[int], said=sys.stdout, told=sys.stdin) -> None:
    """The protocol of the module's docstring, for every pause of ``pids``, until ``told`` ends or a process
    ends (``{"ended": pid}``) or cannot be read (``{"error": why}``)."""

    def say(**what) -> None:
        said.write(json.dumps(what) + "\n")
        said.flush()

    try:
        while True:
            pauses = [pause_of(p) for p in pids]
            if None in pauses:
                time.sleep(POLL_S)
                continue
            say(held=[private_bytes(p) for p in pids])
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
        print(json.dumps({p: memory_while_receiving(int(p)) for p in sys.argv[2:]}))
    else:  # `python -I pauses.py PID ...`: watch, as JSON lines (osmemory.Watch)
        watch([int(p) for p in sys.argv[1:]])
