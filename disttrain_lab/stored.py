"""What a process could keep in files where it may write, read from outside it: the bytes a graded run's ranks could
hold across a reading of their memory with no process's count seeing them (#42).  ``pauses.py`` adds it to each rank's
reading in a sandbox (``osmemory.Watch(stores=True)``, ``grading/gatewatch.py``).  It imports nothing but the
standard library: ``pauses.py``, run as a file, loads it by its path."""

from __future__ import annotations

import ctypes
import os
import re

__all__ = ["PSEUDO", "WALK_ATTEMPTS", "WALKED_MOST", "Uncounted", "stored_bytes"]


class Uncounted(ValueError):
    """What the ranks may have written cannot be counted (too many files, a folder that cannot be read): a reading
    of their memory would undercount, so it is refused."""


# file systems that hold no file a process writes its data to (the kernel's views, devices, control files)
PSEUDO = frozenset(
    b"proc sysfs devtmpfs devpts mqueue cgroup cgroup2 securityfs debugfs tracefs bpf pstore configfs fusectl "
    b"autofs binfmt_misc nsfs efivarfs rpc_pipefs selinuxfs".split()
)
WALK_ATTEMPTS = 3  # walks of the folders, each started again where an entry vanished as it was walked
WALKED_MOST = 100_000  # the most entries ``stored_bytes`` walks under a disk's folders bound in writable


class _Vanished(Exception):
    """An entry went away, or could not be read, as it was walked."""


def stored_bytes(pid: int) -> int:
    """The bytes held in files where process ``pid`` may write, read from its mount namespace's
    ``/proc/<pid>/mountinfo`` (every mount read-write there; reached through ``/proc/<pid>/root`` with no symbolic
    link followed, ``openat2``):

    - a whole tmpfs: its blocks in use, and 1 KiB for each inode in use (``statvfs``), each file system once.  A
      tmpfs file's pages are memory that no process's count holds once the file is closed and unmapped: a rank
      could write what it keeps to one, close it, pause, and read it back (#42); tmpfs charges user extended
      attributes (Linux 6.6 and later) to its inodes' space, 1 inode per KiB, not to its blocks;
    - a folder bound in (bubblewrap's sandbox binds the kernel's working folder and home in, from the grading's
      temp dir, ``grading/run_bwrap.py``; the root sandbox, the kernel's socket folder), disk's or a part of a
      tmpfs: the blocks of every entry below it (each inode once, symbolic links not followed, no other mount
      entered), at most ``WALKED_MOST`` entries.  An entry that vanishes as it is walked, or a folder that cannot
      be read, makes the walk start again, twice at most, then ``Uncounted``, as more entries do.

    In a graded run's sandbox those are the student's own (``grading/run_sandbox.py``: the private ``/tmp``,
    ``/dev/shm``, ``/var/tmp`` and ``/run``, with the submission's copy and the kernel's home in ``/tmp``), and
    they hold what the student's kernel and every rank wrote; which rank wrote what is not the OS's to say, so
    the grader counts all of it for each rank.  A root file system writable and the same as this process's is the
    host's own (a test's ranks, the student's kernel: no sandbox, which leaves the root read-only) and is not
    walked; the grader asks for this count in a sandbox only."""
    for _ in range(WALK_ATTEMPTS):
        try:
            return _stored(pid)
        except _Vanished as exc:
            why = exc
    raise Uncounted(f"what the ranks may have written changed as it was counted, {WALK_ATTEMPTS} times: {why}"[:300])


def _stored(pid: int) -> int:
    with open(f"/proc/{pid}/mountinfo", "rb") as f:
        lines = f.read().splitlines()
    total, seen, walked = 0, set(), [0]
    root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for line in lines:
            mount, sep, fs = line.partition(b" - ")
            fields, described = mount.split(), fs.split()
            if not sep or len(fields) < 6 or len(described) < 3:
                raise ValueError(f"/proc/{pid}/mountinfo: {line[:120]!r} is not a mount's line")
            writable = b"rw" in fields[5].split(b",") and b"ro" not in described[2].split(b",")
            if not writable or described[0] in PSEUDO:
                continue
            point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4])  # (octal escapes)
            try:
                fd = _open_below(root, point)
            except (FileNotFoundError, NotADirectoryError):  # (gone since, or a file's mount)
                continue
            try:
                top = os.fstat(fd)  # (what the path reaches: the top of mounts stacked there)
                if described[0] == b"tmpfs" and fields[3] == b"/":
                    if top.st_dev not in seen:
                        seen.add(top.st_dev)
                        found = os.fstatvfs(fd)
                        total += (found.f_blocks - found.f_bfree) * found.f_frsize
                        total += (found.f_files - found.f_ffree) * 1024
                elif (top.st_dev, top.st_ino) not in seen and not (point == b"/" and _same(top, b"/")):
                    seen.add((top.st_dev, top.st_ino))
                    total += _blocks_below(os.dup(fd), top.st_dev, seen, walked)
            finally:
                os.close(fd)
    finally:
        os.close(root)
    return total


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYS_OPENAT2 = 437  # (the same number on every architecture)
_RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS, _RESOLVE_IN_ROOT = 0x02, 0x04, 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _open_below(root: int, point: bytes) -> int:
    """A descriptor of the folder ``point`` below the folder ``root``, opened for reading with no symbolic link
    followed on the way (``openat2``): a student may rename the folders above a mount and leave a link in its
    place, which a path through ``/proc/<pid>/root`` would follow in the reader's own root."""
    how = _OpenHow(
        os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS | _RESOLVE_IN_ROOT
    )
    name = point.lstrip(b"/") or b"."
    fd = _libc.syscall(_SYS_OPENAT2, root, ctypes.c_char_p(name), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), point.decode(errors="replace"))
    return fd


def _same(found: os.stat_result, point: bytes) -> bool:
    """Whether ``point`` reaches the same folder in this process's mount namespace as ``found`` is."""
    try:
        mine = os.stat(point)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (found.st_dev, found.st_ino)


def _blocks_below(folder: int, device: int, seen: set, walked: list[int]) -> int:
    """The bytes of the blocks of every entry below the folder open as ``folder`` (a descriptor this call closes)
    on ``device`` (each inode once: ``seen``), counting the entries walked in ``walked[0]``; ``Uncounted`` beyond
    ``WALKED_MOST`` of them; ``_Vanished`` where an entry went away or a folder could not be read (a rank could
    hide its files behind it).  Each folder is opened by name from its parent's descriptor, no link followed."""
    total, folders = 0, [folder]
    try:
        while folders:
            here = folders.pop()
            try:
                with os.scandir(here) as entries:
                    for entry in entries:
                        walked[0] += 1
                        if walked[0] > WALKED_MOST:
                            raise Uncounted(
                                f"more than {WALKED_MOST:,} files and folders where the ranks may write: what they "
                                "hold is not counted in time"
                            )
                        found = entry.stat(follow_symlinks=False)
                        if found.st_dev != device:  # (another mount: its own line of mountinfo)
                            continue
                        if (found.st_dev, found.st_ino) not in seen:
                            seen.add((found.st_dev, found.st_ino))
                            total += found.st_blocks * 512
                            if entry.is_dir(follow_symlinks=False):
                                flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                                folders.append(os.open(entry.name, flags, dir_fd=here))
            except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
                raise _Vanished(f"{type(exc).__name__}: {exc}") from None
            finally:
                os.close(here)
    finally:
        for left in folders:
            os.close(left)
    return total
