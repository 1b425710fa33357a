"""Confining a rank of a graded run with Linux's Landlock, so that the ranks can talk to each other only
over the wire the grader observes (#42): once the kit has set the rank up, and before the student's code
runs, the rank may write no file anywhere (only ``/dev/null``), may read nothing of another process's
``/proc/<pid>`` (its command line, name, environment, which a rank may rewrite), may not signal a process
outside itself, may not connect to an abstract unix socket made outside itself, and may open no socket
but TCP's (a seccomp filter: no UDP, no unix socket, no netlink but its routing family).  Other reads,
imports and TCP stay allowed (lazy imports; gloo's new connections for ``dist.new_group``).

    >>> confine.confine()          # in the rank, once, while it has one thread
    Confinement(abi=7, applied=('no writes', "no reads of other processes' /proc", 'no signals out',
    'no abstract unix sockets out', 'only TCP sockets'), missing=(), failed=None)

What it does not close (the kit does, before the call): descriptors and shared memory the rank had before
(``ranks._blank_inherited`` blanks the inherited descriptors; :func:`unmap_shared` every shared mapping
but the rank's own status slot), nor TCP to any process (the kernel's store among them; counted by the
grader), and the calls the sandbox's syscall filter refuses instead (System V IPC, POSIX message queues,
ptrace). Landlock binds the calling thread and the threads it starts later (before ABI 8, not the threads
already running), so the rank must call it while it has one thread. Where the kernel has no Landlock, or
an older ABI, the answer says what could not be applied; the grading host's description says so too
(``grading/sandbox.py``). A rank's own kernel is the student's, so a student who rewrites the kit there
can skip the call: confinement stops the plain ways round the wire, and the grade still rests on what the
grader observes.

What torch writes the first time a rank uses it (``torch._dynamo``'s cache folder) the kernel writes before
it forks the ranks, confined or not (:func:`write_before_confining`).

Through ctypes and the three system calls (their numbers are the same on every architecture): the PyPI
bindings looked at (``landlock``, ``py-landlock``) lack ABI 6's scopes.  The socket filter is a classic BPF
program of 20 instructions written here: the kit's libseccomp binding (``grading/syscall_filter.py``) is
the grading wing's, which the student kit never imports, and libseccomp may be missing on a laptop.
"""

from __future__ import annotations

import ctypes
import linecache
import os
import stat
import sys
from dataclasses import dataclass

__all__ = [
    "Confinement",
    "abi",
    "confine",
    "host_problem",
    "seccomp_filters",
    "unconfined",
    "unmap_shared",
    "write_before_confining",
    "FULL_ABI",
]

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


def confine(writable: str | None = None) -> Confinement:
    """Confine this process and the threads it starts from now on: no writes but to /dev/null (and beneath
    the folder ``writable``, when given: a run whose files must outlive its ranks); with ABI 6, no signals
    and no abstract unix sockets outside it.  Call it while the process has one thread (a
    thread already running would stay outside: with more than one, nothing is applied and ``failed`` says
    so).  A second call in the same process answers as the first did.  Never raises."""
    pid = os.getpid()
    if pid not in _DONE:
        _DONE[pid] = _confine(writable)
    return _DONE[pid]


def _confine(writable: str | None = None) -> Confinement:
    version, why = abi()
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:
        return Confinement(version, failed=f"{threads} threads run here: those already running would stay unconfined")
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # (both Landlock and an unprivileged seccomp need it)
        return Confinement(version, failed=f"no_new_privs: {os.strerror(ctypes.get_errno())}")
    applied: tuple[str, ...] = ()
    missing: tuple[str, ...] = (f"Landlock: {why}",)
    if version:
        landlock = _landlock(version, writable)
        if isinstance(landlock, str):
            return Confinement(version, failed=landlock)
        applied, missing = landlock
    calls = _SOCKET_CALLS.get(os.uname().machine)
    if calls is None:
        return Confinement(version, applied, (*missing, _NO_SOCKET_FILTER))
    failed = _only_tcp_sockets(calls)
    if failed is not None:
        return Confinement(version, applied, missing, f"only TCP sockets: seccomp: {failed}")
    return Confinement(version, (*applied, "only TCP sockets"), missing)


def _landlock(version: int, writable: str | None = None) -> tuple[tuple[str, ...], tuple[str, ...]] | str:
    """Restrict this process with Landlock: (what holds now, what this ABI cannot give), or why it failed."""
    handled = (
        _WRITES_ABI1 | _READ_FILE | _READ_DIR | (_REFER if version >= 2 else 0) | (_TRUNCATE if version >= 3 else 0)
    )
    scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if version >= FULL_ABI else 0
    old_abi = f"signals and abstract unix sockets: Landlock ABI {version} < {FULL_ABI} (Linux 6.12)"
    attr = _RulesetAttr(handled, 0, scoped)
    try:
        size = ctypes.c_size_t(ctypes.sizeof(attr))
        ruleset = _call(_SYS_CREATE_RULESET, ctypes.byref(attr), size, ctypes.c_uint32(0))
    except OSError as exc:
        return f"landlock_create_ruleset: {exc.strerror}"
    try:
        _allow(ruleset, os.devnull, _WRITE_FILE | (_TRUNCATE if version >= 3 else 0))  # (file rights only)
        for path in _readable():
            _allow(ruleset, path, _READ_FILE | _READ_DIR)
        if writable is not None:
            _allow(ruleset, writable, handled)  # (every right, beneath it only)
        _call(_SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0))
    except OSError as exc:
        return f"Landlock: {exc.strerror}"
    finally:
        os.close(ruleset)
    applied = (
        "no writes" if writable is None else f"no writes but beneath {writable}",
        "no reads of other processes' /proc",
        *(("no signals out", "no abstract unix sockets out") if scoped else ()),
    )
    return applied, (() if scoped else (old_abi,))


def write_before_confining() -> None:
    """What torch writes the first time a rank uses it, done in the kernel before confined ranks are forked
    (they may write nothing): an optimizer's first step imports ``torch._dynamo``, which makes its cache
    folder (``/tmp/torchinductor_<user>``) as it is imported.  Imported here once, as the kernel's first pool
    is forked, every later pool's ranks have it (2 s a rank otherwise, at each pool; a graded request's
    pool is forked anew after the student's own launches), and no graded test pays for it; the sources it
    leaves in ``linecache`` (1 MB) are dropped, so that the notebook's kernel holds what it held."""
    kept = set(linecache.cache)
    import torch._dynamo  # noqa: F401

    for name in set(linecache.cache) - kept:
        linecache.cache.pop(name, None)


def unmap_shared(keep) -> None:
    """Unmap every shared mapping of this process but ``keep`` (a writable buffer: the rank's own status
    slot): what a rank inherits from the kernel that forked it (a mapping the notebook made, a semaphore of
    ``multiprocessing``) is shared with every other rank forked from it, a way round the wire.  Call it in a
    rank of a graded run before :func:`confine`, while nothing else runs."""
    view = ctypes.c_char.from_buffer(keep)
    own = ctypes.addressof(view)
    del view  # (the export ends: the slot can still be closed)
    with open("/proc/self/maps", "rb") as f:
        lines = f.read().splitlines()
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) < 5 or len(fields[1]) != 4 or fields[1][3:4] != b"s":
            continue
        start, end = (int(x, 16) for x in fields[0].split(b"-"))
        if start <= own < end:
            continue
        _libc.munmap(ctypes.c_void_p(start), ctypes.c_size_t(end - start))


def seccomp_filters(pid: int) -> tuple[bool, int, int] | None:
    """(no_new_privs, how many seccomp filters, the parent's pid) of process ``pid``, read by anyone from its
    ``/proc/<pid>/status`` (the kernel's lines, read as bytes: the one a process names itself in is
    escaped, and skipped); None where this kernel does not say (before Linux 5.9) or the process is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return None
    fields = dict(line.split(b":", 1) for line in lines[1:] if b":" in line)  # (line 0: Name, the process's own)
    try:
        return fields[b"NoNewPrivs"].strip() == b"1", int(fields[b"Seccomp_filters"]), int(fields[b"PPid"])
    except (KeyError, ValueError):
        return None


def unconfined(ranks: list[int]) -> str | None:
    """Why the ranks ``ranks`` (host pids) of a graded run look unconfined from outside, or None: each must
    have no_new_privs and more seccomp filters than the process that forked it (the socket filter: a kernel
    that rewrote the kit to skip ``confine`` shows it).  None too where this host would not confine
    (``_SOCKET_CALLS``) or its kernel does not say (``seccomp_filters``)."""
    if os.uname().machine not in _SOCKET_CALLS:
        return None
    for rank, pid in enumerate(ranks):
        mine = seccomp_filters(pid)
        if mine is None:
            return None if os.path.exists(f"/proc/{pid}") else f"rank {rank} (pid {pid}) was gone"
        theirs = seccomp_filters(mine[2])
        if theirs is None:
            return f"rank {rank}'s parent (pid {mine[2]}) could not be read"
        if not mine[0] or mine[1] <= theirs[1]:
            return (
                f"rank {rank} was not confined: no_new_privs {int(mine[0])}, {mine[1]} seccomp filter(s) against "
                f"the {theirs[1]} of the process that forked it (a confined rank adds one: confine.py)"
            )
    return None


# seccomp, classic BPF (linux/filter.h, linux/seccomp.h): what a confined rank may still open a socket for
_LD_W_ABS, _JEQ, _JGE, _AND, _RET = 0x20, 0x15, 0x35, 0x54, 0x06
_ALLOW, _EPERM = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW; SECCOMP_RET_ERRNO with EPERM
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
# machine: (AUDIT_ARCH_*, socket's number, socketpair's number)
_SOCKET_CALLS = {"x86_64": (0xC000003E, 41, 53), "aarch64": (0xC00000B7, 198, 199)}
_NO_SOCKET_FILTER = f"only TCP sockets: the kit has no socket filter for {os.uname().machine} (x86_64, aarch64)"
_AF_INET, _AF_INET6, _AF_NETLINK, _SOCK_STREAM, _IPPROTO_TCP, _NETLINK_ROUTE = 2, 10, 16, 1, 6, 0


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def _socket_program(arch: int, socket_nr: int, socketpair_nr: int) -> list[tuple[int, int, int, int]]:
    """The filter: ``socket()`` only for TCP over IPv4 or IPv6 (what gloo and the store use) and for netlink's
    routing family (the C library's address lookups); no ``socketpair()``; a call through another ABI than
    this machine's (i386's on x86_64, x32's numbers) refused.  As (code, jt, jf, k), jumps resolved."""
    deny, allow = "deny", "allow"
    program = [  # (code, k, where to go if true, if false): a label, or None for the next instruction
        (_LD_W_ABS, 4, None, None),  # seccomp_data.arch
        (_JEQ, arch, None, deny),
        (_LD_W_ABS, 0, None, None),  # seccomp_data.nr
        (_JGE, 0x40000000, deny, None),  # x32's numbers
        (_JEQ, socketpair_nr, deny, None),
        (_JEQ, socket_nr, None, allow),
        (_LD_W_ABS, 16, None, None),  # args[0]: the family
        (_JEQ, _AF_NETLINK, "netlink", None),
        (_JEQ, _AF_INET, "inet", None),
        (_JEQ, _AF_INET6, "inet", deny),  # (AF_UNIX, AF_PACKET, ... refused)
        ("inet", _LD_W_ABS, 24, None, None),  # args[1]: the type, with SOCK_NONBLOCK and SOCK_CLOEXEC
        (_AND, 0xF, None, None),
        (_JEQ, _SOCK_STREAM, None, deny),  # (UDP and raw sockets refused)
        (_LD_W_ABS, 32, None, None),  # args[2]: the protocol (0: TCP for a stream; not SCTP)
        (_JEQ, 0, allow, None),
        (_JEQ, _IPPROTO_TCP, allow, deny),
        ("netlink", _LD_W_ABS, 32, None, None),
        (_JEQ, _NETLINK_ROUTE, allow, deny),  # (NETLINK_USERSOCK and the rest refused)
        ("allow", _RET, _ALLOW, None, None),
        ("deny", _RET, _EPERM, None, None),
    ]
    rows = [r if isinstance(r[0], int) else r[1:] for r in program]
    where = {r[0]: i for i, r in enumerate(program) if isinstance(r[0], str)}

    def jump(i: int, to) -> int:
        return 0 if to is None else where[to] - i - 1

    return [(code, jump(i, t), jump(i, f), k) for i, (code, k, t, f) in enumerate(rows)]


def _only_tcp_sockets(calls: tuple[int, int, int]) -> str | None:
    """Load the socket filter (``_socket_program``) into this process (no_new_privs already set): a rank can then
    reach another only by TCP, which the grader counts; UDP, unix sockets (a path some unconfined process
    made among them) and netlink's user sockets would go round it.  None, or why it could not be loaded."""
    rows = _socket_program(*calls)
    code = (_SockFilter * len(rows))(*(_SockFilter(c, t, f, k) for c, t, f, k in rows))
    prog = _SockFprog(len(rows), code)
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        return os.strerror(ctypes.get_errno())
    return None


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
    if os.uname().machine not in _SOCKET_CALLS:
        return f"{_NO_SOCKET_FILTER}: the ranks of a graded run can talk over UDP and unix sockets"
    if version < FULL_ABI:
        return (
            f"Landlock ABI {version} < {FULL_ABI} (Linux 6.12): the ranks of a graded run can signal each other and "
            "use abstract unix sockets"
        )
    return None
