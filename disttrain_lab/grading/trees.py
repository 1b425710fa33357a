"""Removing a folder that a student's code may have written into: ``remove(path)``.

Grading leaves folders on the host that a student's kernel could write into: the kernel's socket
folder (bound into the sandbox), bubblewrap's staged working folder, container mode's kernel
folder, and the grading step's temp dir that holds them.  What a student leaves there is built to
break a clean-up: 10,000 nested folders (``shutil.rmtree`` recurses, and dies of ``RecursionError``
even with ``ignore_errors``), a folder nobody may read (``chmod 000``), a link to a grader's file or
folder, a named pipe, names with newlines.  A clean-up that raises took the classmates graded
after it in the same run, and every later run on the host, down with it.

So ``remove`` never raises: it returns what it could not remove, in words (``[]``: all gone),
for the caller to log.  The walk runs in a child process (``python -I -S`` this file, the folder
passed as an open descriptor), killed at a time limit and with its parent; it holds two
descriptors at most, whatever the depth, and goes back up by ``..`` only to the folder it came
from (checked by device and inode: a tree moved meanwhile is left, never followed outside); it
never follows a link (it removes the link), never enters another mount, and makes a folder of
its own it cannot enter enterable first.  A folder owned by another user (a student's) is
emptied by a child that becomes that user, with no groups: only what the student could delete
can go; the folder itself then goes as the grader.  Like ``run_sandbox.py``, which loads it by
its path, it imports only the standard library.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import stat
import subprocess
import sys

TIMEOUT = 120.0  # seconds one removal may take (a student can make a tree that takes hours)
SHOWN = 20  # problems listed; the rest are counted

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
PR_SET_PDEATHSIG = 1


def remove(path, *, timeout: float = TIMEOUT) -> list[str]:
    """Remove ``path`` (a folder and everything below it, or a single entry), never raising:
    what could not be removed, each in words ([] when nothing is left)."""
    path = os.fspath(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        return [f"{_shown(path)}: {exc.strerror}"]
    if not stat.S_ISDIR(info.st_mode):  # a link is removed, never followed
        return _unlink(path, None)
    try:
        problems = _empty_in_child(path, info, timeout)
    except Exception as exc:  # noqa: BLE001 - never raise into the grader
        problems = [f"{_shown(path)}: {exc}"]
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        problems.append(f"{_shown(path)}: {exc.strerror}")
    return problems


def said(path, problems: list[str]) -> str:
    """One line for a log: what was left of ``path`` and why ('' when nothing)."""
    if not problems:
        return ""
    more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
    return f"[disttrain-lab] could not remove all of {_shown(os.fspath(path))}: " + "; ".join(problems[:SHOWN]) + more


def _empty_in_child(path: str, info: os.stat_result, timeout: float) -> list[str]:
    fd = os.open(path, _DIR) if _enterable(info) else None
    if fd is None:  # a folder of ours we may not enter (chmod 000): made enterable, never followed
        _make_enterable(os.path.basename(path), _parent_fd(path))
        fd = os.open(path, _DIR)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), str(fd)],
            pass_fds=[fd],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its owner's children too are killed at the time limit
        )
    finally:
        os.close(fd)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)  # (the group lives while its leader is not reaped)
        proc.communicate()
        return [f"{_shown(path)}: not removed within {timeout:g} s"]
    try:
        return [str(p) for p in json.loads(out)]
    except ValueError:
        return [f"{_shown(path)}: the removal failed: {out.decode(errors='replace')[-500:].strip()}"]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _parent_fd(path: str) -> int:
    return os.open(os.path.dirname(os.path.abspath(path)), _DIR)


def _shown(name: str) -> str:
    return name if name.isprintable() else ascii(name)


def _enterable(info: os.stat_result) -> bool:
    """Whether this process may list a folder and remove what is in it, by its mode."""
    if os.geteuid() == 0:
        return True
    if info.st_uid == os.geteuid():
        return info.st_mode & 0o700 == 0o700
    return True  # not ours: nothing to change; tried as it is


def _make_enterable(name: str, parent: int) -> None:
    """chmod 0700 the folder ``name`` in ``parent`` (closed after), never through a link: opened
    O_PATH without following, changed through its /proc/self/fd entry (a folder, checked)."""
    try:
        handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            os.chmod(f"/proc/self/fd/{handle}", 0o700)
        finally:
            os.close(handle)
    finally:
        os.close(parent)


def _unlink(name: str, parent: int | None, remove=os.unlink, shown: str | None = None) -> list[str]:
    """Remove the entry ``name`` of the folder ``parent`` (None: a path) with ``remove`` (``os.rmdir``
    for an empty folder): what went wrong, in words, with ``shown`` as its name."""
    try:
        remove(name, dir_fd=parent)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return [f"{shown or _shown(name)}: {exc.strerror}"]
    return []


# ----------------------------------------------------------------------------------------
# the child: empty the folder open as a descriptor


def _empty(top: int) -> list[str]:
    """Remove everything in the folder open as ``top`` (not the folder itself): as its owner
    where this process is root and the folder is another user's, else as this process."""
    info = os.fstat(top)
    if os.geteuid() == 0 and info.st_uid != 0:
        return _as_owner(top, info)
    return _walk(top)


def _die_with_parent() -> None:
    """SIGKILL when the parent ends (a wrapper killed mid-removal leaves no walk running on)."""
    parent = os.getppid()
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it ended before that
        os._exit(1)


def _as_owner(fd: int, info: os.stat_result) -> list[str]:
    """``_walk(fd)`` in a child that became the folder's owner (no groups, its own group, never root's)."""
    gid = info.st_gid if info.st_gid != 0 else info.st_uid
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(info.st_uid, info.st_uid, info.st_uid)
            _die_with_parent()  # (after the change of uid, which clears it)
            problems = _walk(fd)
        except BaseException as exc:  # noqa: BLE001 - a forked child never returns into the caller
            problems = [f"removing as uid {info.st_uid}: {exc!r}"]
        os.write(write, json.dumps(problems).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(child, 0)
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        return [f"the removal as uid {info.st_uid} ended without a word"]


def _walk(top: int) -> list[str]:
    """Depth first, without recursion: one descriptor for the folder being emptied, and a trail of
    (device, inode) of the folders above it to check each step back up against."""
    problems: list[str] = []
    me = os.geteuid()
    base = os.fstat(top)
    if base.st_uid == me and me != 0 and base.st_mode & 0o700 != 0o700:
        os.fchmod(top, 0o700)
    fd = os.dup(top)
    trail: list[tuple[int, int]] = []  # the folders above the current one
    names: list[str] = []  # the current folder's name in each of them
    todo = [os.listdir(fd)]  # per level: the entries still to remove
    try:
        while True:
            if not todo[-1]:
                if not trail:
                    return problems
                try:
                    up = os.open("..", _DIR, dir_fd=fd)
                except FileNotFoundError:  # removed under us (by another removal of the same tree)
                    return problems
                os.close(fd)
                fd = up
                if _identity(os.fstat(fd)) != trail.pop():  # moved while we were below: stop here
                    problems.append(f"{_where(names)}: moved during the removal; left")
                    return problems
                todo.pop()
                name = names.pop()
                problems += _unlink(name, fd, os.rmdir, _where([*names, name]))
                continue
            name = todo[-1].pop()
            try:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as exc:
                problems.append(f"{_where([*names, name])}: {exc.strerror}")
                continue
            if not stat.S_ISDIR(info.st_mode):  # a file, a link (never followed), a pipe, a socket
                problems += [f"{_where(names)}/{p}" if names else p for p in _unlink(name, fd)]
                continue
            if info.st_dev != base.st_dev:  # another file system mounted here: busy, never entered
                problems.append(f"{_where([*names, name])}: a mount point; left")
                continue
            try:
                os.rmdir(name, dir_fd=fd)
                continue
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    problems.append(f"{_where([*names, name])}: {exc.strerror}")
                    continue
            if me == 0 and info.st_uid != 0:  # a student's folder: emptied as the student
                problems += _owners_part(name, fd, info, names)
                continue
            if info.st_uid == me and me != 0 and info.st_mode & 0o700 != 0o700:
                try:
                    _make_enterable(name, os.dup(fd))
                except OSError as exc:
                    problems.append(f"{_where([*names, name])}: {exc.strerror}")
                    continue
            try:
                inner = os.open(name, _DIR, dir_fd=fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                problems.append(f"{_where([*names, name])}: {exc.strerror}")
                continue
            if _identity(os.fstat(inner)) != _identity(info):  # swapped since the stat: not ours to walk
                os.close(inner)
                problems.append(f"{_where([*names, name])}: replaced during the removal; left")
                continue
            trail.append(_identity(os.fstat(fd)))
            names.append(name)
            os.close(fd)
            fd = inner
            try:
                todo.append(os.listdir(fd))
            except OSError as exc:
                problems.append(f"{_where(names)}: {exc.strerror}")
                todo.append([])
    finally:
        os.close(fd)


def _owners_part(name: str, parent: int, info: os.stat_result, names: list[str]) -> list[str]:
    """Empty the folder ``name`` (of another user) as its owner, then remove it as this process."""
    try:
        inner = os.open(name, _DIR, dir_fd=parent)
    except OSError as exc:
        return [f"{_where([*names, name])}: {exc.strerror}"]
    try:
        if _identity(os.fstat(inner)) != _identity(info):
            return [f"{_where([*names, name])}: replaced during the removal; left"]
        problems = [f"{_where([*names, name])}/{p}" for p in _as_owner(inner, info)]
    finally:
        os.close(inner)
    return problems + _unlink(name, parent, os.rmdir, _where([*names, name]))


def _identity(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def _where(names: list[str]) -> str:
    """A path below the folder being removed, for a message (the last levels of a deep one)."""
    shown = [_shown(n) for n in names]
    return "/".join(shown) if len(shown) <= 6 else f".../({len(shown) - 3} folders)/" + "/".join(shown[-3:])


if __name__ == "__main__":  # the child: python -I -S trees.py FD; what is left as JSON on stdout
    try:
        _die_with_parent()
        left = _empty(int(sys.argv[1]))
    except BaseException as exc:  # noqa: BLE001 - said to the parent, never a traceback
        left = [f"the removal stopped: {exc!r}"]
    if len(left) > 10 * SHOWN:  # (what a log shows of them)
        left = [*left[: 10 * SHOWN], f"{len(left) - 10 * SHOWN} more entries"]
    sys.stdout.write(json.dumps(left))
