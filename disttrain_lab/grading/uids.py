"""Which unprivileged uid a sandboxed kernel runs as: one no other grading on the host uses.

Each process that starts sandboxed kernels (one nbgrader step: one student, or a batch)
leases a uid for as long as it lives: an exclusive ``flock`` on
``/run/disttrain-lab/uids/<uid>`` (root's, 0700), taken from ``FIRST_UID`` up, skipping a
uid that names a user in the password database or that any running process holds.  The
kernel releases a lock when its holder dies, however it dies, so a killed grading leaves
no lease behind; a clean exit also removes the file.  Two gradings at once on one host --
two ``disttrain-lab grade`` runs, or the parallel jobs of one -- so never share a uid.

Where no lease can be had (no writable /run, every uid of the range taken) the kernel runs
as ``FIRST_UID`` + its job's slot, as before, and the grader says so loudly on stderr:
concurrent gradings may then share a uid.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import pwd
import sys
from pathlib import Path

FIRST_UID = 64123  # RobustExecute.sandbox_uid's default
SPAN = 2000  # uids tried from FIRST_UID (below 65534, "nobody")
LEASE_DIR = Path("/run/disttrain-lab/uids")

_held: dict[tuple[int, int], int] = {}  # (first uid, slot) -> the uid this process leased


def uids_in_use() -> set[int]:
    """Every uid (real, effective, saved, file system) of a running process."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    line = next(x for x in f if x.startswith("Uid:"))
                found |= {int(u) for u in line.split()[1:]}
            except (OSError, StopIteration, ValueError):
                pass
    return found


def _is_user(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def lease(first: int = FIRST_UID, span: int = SPAN, directory: Path = LEASE_DIR) -> int:
    """A uid in [first, first + span) that no other process has leased or runs as, held
    until this process exits.  Raises OSError (no lease directory) or RuntimeError (none free)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    busy = uids_in_use()
    for uid in range(first, first + span):
        if uid in busy or _is_user(uid):
            continue
        path = directory / str(uid)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino != os.stat(path).st_ino:  # its holder removed it meanwhile
                raise BlockingIOError
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())  # for a human: who holds it
        atexit.register(_release, fd, path)
        return uid
    raise RuntimeError(f"every uid from {first} to {first + span - 1} is leased or in use")


def _release(fd: int, path: Path) -> None:
    try:
        path.unlink()  # while still locked: nobody can take the file we remove
    except OSError:
        pass
    os.close(fd)


def sandbox_uid(first: int, slot: int) -> int:
    """The uid for this process's sandboxed kernels: a lease (the same one for every kernel
    it starts), else ``first + slot`` with a loud warning."""
    key = (first, slot)
    if key not in _held:
        try:
            _held[key] = lease(first)
        except (OSError, RuntimeError) as exc:
            _held[key] = first + slot
            print(
                f"\n*** disttrain-lab: no sandbox uid could be leased ({exc}); kernels run as uid "
                f"{first + slot} (first uid + job slot), which another grading on this host may "
                "use at the same time ***\n",
                file=sys.stderr,
            )
    return _held[key]
