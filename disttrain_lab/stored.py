"""What a process could keep in files where it may write, read from outside it: the bytes a graded run's ranks could
hold across a reading of their memory with no process's count seeing them (#42).  ``pauses.py`` adds it to each rank's
reading in a sandbox (``osmemory.Watch(stores=True)``, ``grading/gatewatch.py``).  It imports nothing but the
standard library: ``pauses.py``, run as a file, loads it by its path."""

from __future__ import annotations

import os
import re

__all__ = ["PSEUDO", "WALKED_MOST", "Uncounted", "stored_bytes"]


class Uncounted(ValueError):
    """What the ranks may have written cannot be counted (too many files, a folder that cannot be read): a reading
    of their memory would undercount, so it is refused."""


# file systems that hold no file a process writes its data to (the kernel's views, devices, control files)
PSEUDO = frozenset(
    b"proc sysfs devtmpfs devpts mqueue cgroup cgroup2 securityfs debugfs tracefs bpf pstore configfs fusectl "
    b"hugetlbfs autofs binfmt_misc nsfs efivarfs rpc_pipefs selinuxfs".split()
)
WALKED_MOST = 100_000  # the most entries ``stored_bytes`` walks under a disk's folders bound in writable


def stored_bytes(pid: int) -> int:
    """The bytes held in files where process ``pid`` may write, read from its mount namespace's
    ``/proc/<pid>/mountinfo`` (every mount read-write there; through ``/proc/<pid>/root``):

    - a tmpfs: its blocks in use (``statvfs``), each file system once.  A tmpfs file's pages are memory that no
      process's count holds once the file is closed and unmapped: a rank could write what it keeps to one, close
      it, pause, and read it back (#42);
    - a disk's folder bound in (bubblewrap's sandbox binds the kernel's working folder and home in, from the
      grading's temp dir, ``grading/run_bwrap.py``): the blocks of every file below it (hard links once, symbolic
      links not followed, no other mount entered), at most ``WALKED_MOST`` entries (more: ``Uncounted``).

    In a graded run's sandbox those are the student's own (``grading/run_sandbox.py``: the private ``/tmp``,
    ``/dev/shm``, ``/var/tmp`` and ``/run``, with the submission's copy and the kernel's home in ``/tmp``), and
    they hold what the student's kernel and every rank wrote; which rank wrote what is not the OS's to say, so
    the grader counts all of it for each rank.  A disk's folder that this process reaches at the same place is the
    host's own (the ranks share this process's mount namespace: a test, the student's kernel) and is not walked;
    the grader asks for this count in a sandbox only."""
    with open(f"/proc/{pid}/mountinfo", "rb") as f:
        lines = f.read(1 << 20).splitlines()
    total, seen, walked = 0, set(), [0]
    for line in lines:
        mount, sep, fs = line.partition(b" - ")
        fields, described = mount.split(), fs.split()
        if not sep or len(fields) < 6 or len(described) < 3:
            raise ValueError(f"/proc/{pid}/mountinfo: {line[:120]!r} is not a mount's line")
        writable = b"rw" in fields[5].split(b",") and b"ro" not in described[2].split(b",")
        if not writable or described[0] in PSEUDO:
            continue
        point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4])  # (octal escapes)
        path = f"/proc/{pid}/root".encode() + point
        try:
            top = os.stat(path)  # (what the path reaches: the top of mounts stacked there)
            if described[0] == b"tmpfs":
                found = os.statvfs(path)
                if top.st_dev not in seen:
                    seen.add(top.st_dev)
                    total += (found.f_blocks - found.f_bfree) * found.f_frsize
            elif (top.st_dev, top.st_ino) not in seen and not _same(top, point):
                seen.add((top.st_dev, top.st_ino))
                total += _blocks_below(path, top.st_dev, seen, walked)
        except (FileNotFoundError, NotADirectoryError):  # (gone since, or a file's mount)
            continue
    return total


def _same(found: os.stat_result, point: bytes) -> bool:
    """Whether ``point`` reaches the same folder in this process's mount namespace as ``found`` is: the host's own
    file system (its root, where the ranks share this process's namespace), not a folder bound in for them."""
    try:
        mine = os.stat(point)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (found.st_dev, found.st_ino)


def _blocks_below(folder: bytes, device: int, seen: set, walked: list[int]) -> int:
    """The bytes of the blocks of every regular file below ``folder`` on ``device`` (each inode once: ``seen``),
    counting the entries walked in ``walked[0]``; ``Uncounted`` beyond ``WALKED_MOST`` of them, or where a folder
    cannot be read (a rank could hide its files behind it)."""
    total, folders = 0, [folder]
    while folders:
        try:
            entries = list(os.scandir(folders.pop()))
        except PermissionError as exc:
            raise Uncounted(f"a folder where the ranks may write could not be read: {exc}"[:300]) from None
        for entry in entries:
            walked[0] += 1
            if walked[0] > WALKED_MOST:
                raise Uncounted(
                    f"more than {WALKED_MOST:,} files and folders where the ranks may write: what they hold is "
                    "not counted in time"
                )
            found = entry.stat(follow_symlinks=False)
            if found.st_dev != device or (found.st_dev, found.st_ino) in seen:
                continue
            if entry.is_dir(follow_symlinks=False):
                folders.append(entry.path)
            elif entry.is_file(follow_symlinks=False):
                seen.add((found.st_dev, found.st_ino))
                total += found.st_blocks * 512
    return total
