"""Confining a rank of a graded run with Linux's Landlock, so that the ranks can talk to each other only
over the wire the grader observes (#42): once the kit has set the rank up, and before the student's code
runs, the rank may write no file anywhere (only ``/dev/null``), may read nothing of another process's
``/proc/<pid>`` (its command line, name, environment, which a rank may rewrite), may not signal a process
outside itself, and may not connect to an abstract unix socket made outside itself.  Other reads, imports
and TCP stay allowed (lazy imports; gloo's new connections for ``dist.new_group``).

    >>> confine.confine()          # in the rank, once, while it has one thread
    Confinement(abi=7, applied=('no writes', "no reads of other processes' /proc", 'no signals out',
    'no abstract unix sockets out'), missing=(), failed=None)

What it does not close: descriptors and shared memory the rank had before (the kit blanks the inherited
descriptors, ``ranks._blank_inherited``, and gives each rank a status mapping of its own), TCP to any
process (the kernel's store among them), a pathname unix socket some unconfined process made, and the
calls the sandbox's syscall filter refuses instead (System V IPC, POSIX message queues, ptrace).  Landlock
binds the calling thread and the threads it starts later (before ABI 8, not the threads already running),
so the rank must call it while it has one thread.  Where the kernel has no Landlock, or an older ABI, the
answer says what could not be applied; the grading host's description says so too
(``grading/sandbox.py``).  A rank's own kernel is the student's, so a student who rewrites the kit there
can skip the call: confinement stops the plain ways round the wire, and the grade still rests on what the
grader observes.

Through ctypes and the three system calls (their numbers are the same on every architecture): the PyPI
bindings looked at (``landlock``, ``py-landlock``) lack ABI 6's scopes.
"""

from __future__ import annotations

import ctypes
import os
import stat
import sys
from dataclasses import dataclass

__all__ = ["Confinement", "abi", "confine", "host_problem", "FULL_ABI"]

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

# LANDLOCK_ACCESS_FS_*: every right that writes, and reading (EXECUTE stays unhandled: allowed); reading is
# allowed again everywhere but other processes' /proc/<pid> (``_readable``)
_WRITE_FILE, _READ_FILE, _READ_DIR, _TRUNCATE = 1 << 1, 1 << 2, 1 << 3, 1 << 14
_WRITES_ABI1 = (
    _WRITE_FILE
    | 1 << 4  # REMOVE_DIR
    | 1 << 5  # REMOVE_FILE
    | 1 << 6  # MAKE_CHAR
    | 1 << 7  # MAKE_DIR
    | 1 << 8  # MAKE_REG
    | 1 << 9  # MAKE_SOCK (bind() of a pathname unix socket)
    | 1 << 10  # MAKE_FIFO
    | 1 << 11  # MAKE_BLOCK
    | 1 << 12  # MAKE_SYM
)
_REFER = 1 << 13  # ABI 2
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
FULL_ABI = 6  # the first ABI that closes everything this module closes

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


@dataclass(frozen=True)
class Confinement:
    """What :func:`confine` did: Landlock's ``abi`` (0: none), what holds now, what this host's kernel
    cannot give (``missing``, each with why), and ``failed``: why confining this process failed although
    the host offers it (None: it did not fail)."""

    abi: int
    applied: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    failed: str | None = None


def abi() -> tuple[int, str | None]:
    """(Landlock's ABI version, None) on this kernel, or (0, why there is none)."""
    if not sys.platform.startswith("linux"):
        return 0, f"Landlock is Linux's; this is {sys.platform}"
    got = _libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    if got >= 0:
        return int(got), None
    code = ctypes.get_errno()
    why = {
        38: "the kernel has no Landlock (older than 5.13, or a seccomp filter refuses its calls)",
        95: "Landlock is built into the kernel but not enabled (add landlock to the lsm= boot parameter)",
        1: "a seccomp filter refuses landlock_create_ruleset",
    }.get(code, f"landlock_create_ruleset: {os.strerror(code)}")
    return 0, why


def _call(*args) -> int:
    got = _libc.syscall(*args)
    if got < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return got


_DONE: dict[int, Confinement] = {}  # pid -> what confine() did there (Landlock cannot be undone)


def confine() -> Confinement:
    """Confine this process and the threads it starts from now on: no writes but to /dev/null; with ABI 6,
    no signals and no abstract unix sockets outside it.  Call it while the process has one thread (a
    thread already running would stay outside: with more than one, nothing is applied and ``failed`` says
    so).  A second call in the same process answers as the first did.  Never raises."""
    pid = os.getpid()
    if pid not in _DONE:
        _DONE[pid] = _confine()
    return _DONE[pid]


def _confine() -> Confinement:
    version, why = abi()
    if not version:
        return Confinement(0, (), (f"Landlock: {why}",))
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:
        return Confinement(version, failed=f"{threads} threads run here: those already running would stay unconfined")
    handled = (
        _WRITES_ABI1 | _READ_FILE | _READ_DIR | (_REFER if version >= 2 else 0) | (_TRUNCATE if version >= 3 else 0)
    )
    scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if version >= FULL_ABI else 0
    old_abi = f"signals and abstract unix sockets: Landlock ABI {version} < {FULL_ABI} (Linux 6.12)"
    missing = () if scoped else (old_abi,)
    attr = _RulesetAttr(handled, 0, scoped)
    try:
        size = ctypes.c_size_t(ctypes.sizeof(attr))
        ruleset = _call(_SYS_CREATE_RULESET, ctypes.byref(attr), size, ctypes.c_uint32(0))
    except OSError as exc:
        return Confinement(version, (), missing, f"landlock_create_ruleset: {exc.strerror}")
    try:
        _allow(ruleset, os.devnull, _WRITE_FILE | (_TRUNCATE if version >= 3 else 0))  # (file rights only)
        for path in _readable():
            _allow(ruleset, path, _READ_FILE | _READ_DIR)
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return Confinement(version, (), missing, f"no_new_privs: {os.strerror(ctypes.get_errno())}")
        _call(_SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0))
    except OSError as exc:
        return Confinement(version, (), missing, f"Landlock: {exc.strerror}")
    finally:
        os.close(ruleset)
    applied = (
        "no writes",
        "no reads of other processes' /proc",
        *(("no signals out", "no abstract unix sockets out") if scoped else ()),
    )
    return Confinement(version, applied, missing)


def _readable() -> list[str]:
    """Where a confined rank may read: every entry of ``/`` but ``/proc``, and of ``/proc`` every entry but
    other processes' (``/proc/<pid>``: what another rank writes into its own command line, name or
    environment would be read there; ``/proc/self`` leads to this process's own)."""
    own = str(os.getpid())
    top = [os.path.join("/", e) for e in os.listdir("/") if e != "proc"]
    proc = [os.path.join("/proc", e) for e in os.listdir("/proc") if e == own or not e.isdigit()]
    return top + [p for p in proc if p not in ("/proc/self", "/proc/thread-self")]


def _allow(ruleset: int, path: str, rights: int) -> None:
    """Add the rule: ``rights`` beneath ``path`` (a file takes the file rights only; a path gone meanwhile,
    or one this process may not open, is left out: nothing beneath it is allowed)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= ~_READ_DIR
        rule = _PathBeneath(rights, fd)
        _call(_SYS_ADD_RULE, ruleset, ctypes.c_int(_RULE_PATH_BENEATH), ctypes.byref(rule), ctypes.c_uint32(0))
    finally:
        os.close(fd)


def host_problem() -> str | None:
    """What confining a rank cannot close on this host (None: everything :func:`confine` closes)."""
    version, why = abi()
    if not version:
        return f"ranks of a graded run are not confined (Landlock: {why}): they can pass data through files"
    if version < FULL_ABI:
        return (
            f"Landlock ABI {version} < {FULL_ABI} (Linux 6.12): the ranks of a graded run can signal each other and "
            "use abstract unix sockets"
        )
    return None
