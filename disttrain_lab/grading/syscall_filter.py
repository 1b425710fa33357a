"""A seccomp filter for a graded kernel and its ranks: the system calls that reach past the
sandbox are refused with an error the student's code can read, everything else is allowed.

The sandbox (``run_sandbox.py``) hides the grader's files with mounts and namespaces; a
student's code that makes namespaces of its own (a user namespace makes it root inside),
moves mounts, loads BPF, or reads another process's memory works around them, and each of
those calls is also where kernel exploits start.  A grading kernel never needs them:
Python, Jupyter's ipykernel and ZMQ, torch with gloo over TCP loopback, fork, threads,
shared memory and pipes all run under this filter (``tests/grading/test_syscall_filter.py``
runs each of them under it).

Both of the sandbox's back-ends take it::

    root      the kernel's process calls ``install()`` after dropping to the student's uid,
              before exec: the filter holds for the kernel and everything it starts
    bwrap     ``bwrap --seccomp FD``: FD holds ``bpf()``, the compiled classic-BPF program,
              which bubblewrap loads just before it execs the kernel

Built with libseccomp (``libseccomp.so.2``, the maintained C library; Debian/Ubuntu:
``apt-get install libseccomp2``) through ctypes.  Like ``run_sandbox.py`` this file imports
nothing of the package: it also runs loaded by its file path under ``python -I``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
from typing import NamedTuple

LIBRARY = "libseccomp.so.2"
INSTALL_HINT = "Debian/Ubuntu: apt-get install libseccomp2; Fedora/RHEL: dnf install libseccomp"

# what clone()'s flags may not hold: any new namespace.  (CLONE_NEWTIME, 0x80, exists for
# unshare and clone3 only: in clone()'s flags that bit belongs to the exit signal.)
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
CLONE_NEW_ANY = (
    CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
)  # 0x7e020000


class Denied(NamedTuple):
    """System calls refused for one reason."""

    why: str  # one line: what the calls reach that the sandbox must keep
    names: tuple[str, ...]
    error: int = errno.EPERM  # the errno the refused call returns
    flags: int = 0  # refused only with one of these bits in clone's flags argument (0: always)


# The deny list.  Every call here fails with EPERM (clone3: ENOSYS) instead of killing the
# process, so a student's code gets an OSError it can read and report.
GROUPS: tuple[Denied, ...] = (
    Denied(
        "namespaces and mounts: a new user namespace is root inside it; mounts undo what the sandbox hides",
        (
            "unshare",
            "setns",
            "mount",
            "umount2",
            "pivot_root",
            "chroot",
            "open_tree",
            "move_mount",
            "fsopen",
            "fsmount",
            "fspick",
            "mount_setattr",
            "open_tree_attr",
        ),
    ),
    Denied("clone with a new namespace (a plain fork or thread passes)", ("clone",), flags=CLONE_NEW_ANY),
    # clone3's flags sit in a struct in memory, which a seccomp filter cannot read: ENOSYS
    # says "no clone3 here" and glibc falls back to clone, filtered above (Docker and systemd do the same)
    Denied("clone3: its flags are out of the filter's sight", ("clone3",), error=errno.ENOSYS),
    Denied("BPF programs run in the kernel: its largest attack surface", ("bpf",)),
    # (libuv, below torch's TCPStore, tries io_uring_setup and falls back to epoll when refused)
    Denied(
        "io_uring: a second way into the kernel that no seccomp filter sees",
        ("io_uring_setup", "io_uring_enter", "io_uring_register"),
    ),
    Denied("kernel keyrings: not namespaced, shared with the host", ("keyctl", "add_key", "request_key")),
    Denied("perf events: side channels on other processes, a long history of kernel bugs", ("perf_event_open",)),
    Denied(
        "another process's memory and files",
        ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp"),
    ),
    Denied("userfaultfd: stalls the kernel at a chosen page fault, the usual exploit's lever", ("userfaultfd",)),
    # (issue 42: the ranks of a graded run talk only over the wire the grader observes.  Nothing of
    # Python, ipykernel, ZMQ or torch uses these; multiprocessing's semaphores are files in /dev/shm)
    Denied(
        "System V shared memory, semaphores and message queues, POSIX message queues: a way between the ranks "
        "off the observed wire",
        (
            *("shmget", "shmat", "shmctl", "semget", "semop", "semtimedop", "semctl"),
            *("msgget", "msgsnd", "msgrcv", "msgctl"),
            *("mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr"),
        ),
    ),
    Denied(
        "extended attributes written, and secret memory: data a file's blocks, Landlock and the grader's count of "
        "a rank's memory do not see, a way between the ranks off the observed wire",
        ("setxattr", "lsetxattr", "fsetxattr", "setxattrat", "memfd_secret"),
    ),
    Denied(
        "file handles: open a file by its handle, past the mounts that hide it",
        ("open_by_handle_at", "name_to_handle_at"),
    ),
    Denied("fanotify: watches the whole file system", ("fanotify_init",)),
    Denied("kernel modules", ("init_module", "finit_module", "delete_module")),
    Denied("the host's machine: kexec, reboot, swap", ("kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff")),
    Denied("the host's accounting, quotas and kernel log", ("acct", "quotactl", "syslog")),
    Denied("the host's clocks", ("settimeofday", "clock_settime", "clock_adjtime", "adjtimex")),
    Denied("I/O ports (x86 only)", ("iopl", "ioperm")),
    Denied("old calls of profilers and terminals: dcookies, hanging up a tty", ("lookup_dcookie", "vhangup")),
)
# personality stays allowed: nothing of Python, ipykernel or torch calls it (none of their
# system calls under strace), but what it changes (address randomisation, uname's version)
# is the caller's own, not the sandbox's
DENIED: tuple[str, ...] = tuple(name for group in GROUPS for name in group.names)


# ----------------------------------------------------------------------------------------
# libseccomp, through ctypes (the names and values of its seccomp.h)

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_MASKED_EQ = 7  # (the argument & datum_a) == datum_b
SCMP_FLTATR_CTL_TSYNC = 4  # load the filter into every thread of the process
NR_SCMP_ERROR = -1  # seccomp_syscall_resolve_name: a name libseccomp does not know
PR_GET_SECCOMP, PR_SET_NO_NEW_PRIVS, PR_GET_NO_NEW_PRIVS = 21, 38, 39

# Calls on the list that are newer than libseccomp 2.5.4 (Debian 12's), with their numbers.  Since Linux 5.1
# (pidfd_send_signal, 424) a new call takes the same number on every architecture but alpha and mips
# ("common" in arch/x86/entry/syscalls/syscall_64.tbl and scripts/syscall.tbl), so the filter can name them by
# number where libseccomp does not know them; a kernel older than the call answers ENOSYS to it anyway, and the
# filter's EPERM comes first.
NEWER_CALLS = {"setxattrat": 463, "open_tree_attr": 467}  # Linux 6.13, 6.15
SAME_NUMBERS = ("x86_64", "aarch64", "riscv64", "ppc64le", "ppc64", "s390x", "loongarch64")


def scmp_act_errno(code: int) -> int:
    """SCMP_ACT_ERRNO(x): the call returns -1 with errno ``code``."""
    return 0x00050000 | (code & 0xFFFF)


class ArgCmp(ctypes.Structure):
    """struct scmp_arg_cmp: one comparison on one of the call's arguments (0-5)."""

    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),  # enum scmp_compare
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


_lib: ctypes.CDLL | None = None


def _library() -> ctypes.CDLL:
    """libseccomp with the signatures of the functions used here.  (seccomp_rule_add_array
    rather than the variadic seccomp_rule_add: ctypes cannot pass a struct through "...")"""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(LIBRARY)
        c = ctypes
        for name, restype, argtypes in (
            ("seccomp_init", c.c_void_p, [c.c_uint32]),
            ("seccomp_release", None, [c.c_void_p]),
            ("seccomp_attr_set", c.c_int, [c.c_void_p, c.c_int, c.c_uint32]),
            ("seccomp_syscall_resolve_name", c.c_int, [c.c_char_p]),
            ("seccomp_rule_add_array", c.c_int, [c.c_void_p, c.c_uint32, c.c_int, c.c_uint, c.POINTER(ArgCmp)]),
            ("seccomp_load", c.c_int, [c.c_void_p]),
            ("seccomp_export_bpf", c.c_int, [c.c_void_p, c.c_int]),
            ("seccomp_version", c.POINTER(c.c_uint * 3), []),
        ):
            function = getattr(lib, name)  # AttributeError: a libseccomp older than 2.3
            function.restype, function.argtypes = restype, argtypes
        _lib = lib
    return _lib


def _ok(ret: int, what: str) -> None:
    if ret < 0:  # libseccomp answers -errno
        raise OSError(-ret, f"{what}: {os.strerror(-ret)}")


def version() -> str:
    """libseccomp's version, e.g. ``"2.5.4"``."""
    return ".".join(str(n) for n in _library().seccomp_version().contents)


def numbers(names: tuple[str, ...] = DENIED) -> dict[str, int]:
    """Each call's number on this machine's architecture (by default the deny list's).
    Calls the architecture lacks (iopl and ioperm off x86) are left out; a call newer than
    libseccomp takes its number from ``NEWER_CALLS``; any other name libseccomp does not know
    is an error, since the kernel may well have that call: a filter built without it would
    let it through."""
    lib = _library()
    found, unknown = {}, []
    for name in names:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr >= 0:
            found[name] = nr
        elif nr == NR_SCMP_ERROR and name in NEWER_CALLS and os.uname().machine in SAME_NUMBERS:
            found[name] = NEWER_CALLS[name]
        elif nr == NR_SCMP_ERROR:
            unknown.append(name)
        # else a pseudo number (__PNR_*, below -1): not a call of this architecture
    if unknown:
        raise RuntimeError(
            f"libseccomp {version()} does not know the system calls {', '.join(unknown)}: a filter built with it "
            f"would let them through; install a newer libseccomp ({INSTALL_HINT})"
        )
    return found


def _clone_flags_arg() -> int:
    # clone(flags, stack, ...) everywhere but on s390, where the first two arguments swap
    # (libseccomp does not rewrite them)
    return 1 if os.uname().machine.startswith("s390") else 0


@contextlib.contextmanager
def _filter():
    """A libseccomp filter context holding the deny list: (the library, the context)."""
    lib = _library()
    nrs = numbers()
    # The filter is for this machine's architecture alone, and a call made through another
    # ABI (i386's int 0x80 on x86_64, x32's numbers, which the program checks for) meets
    # libseccomp's default bad-arch action, kept on purpose: it kills (SIGSYS).  Another
    # syscall table is no way around the deny list.
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError(errno.ENOMEM, "seccomp_init failed")
    try:
        for group in GROUPS:
            action = scmp_act_errno(group.error)
            for name in group.names:
                if name not in nrs:
                    continue
                if not group.flags:
                    _ok(lib.seccomp_rule_add_array(ctx, action, nrs[name], 0, None), f"seccomp_rule_add {name}")
                    continue
                # one rule per bit: the rules of one call are OR'ed (the comparisons within a rule AND'ed)
                for bit in (1 << i for i in range(64) if group.flags >> i & 1):
                    cmp = ArgCmp(_clone_flags_arg(), SCMP_CMP_MASKED_EQ, bit, bit)
                    _ok(lib.seccomp_rule_add_array(ctx, action, nrs[name], 1, ctypes.byref(cmp)), f"rule {name}")
        yield lib, ctx
    finally:
        lib.seccomp_release(ctx)


# ----------------------------------------------------------------------------------------
# what the sandbox calls


def problem() -> str | None:
    """Why no filter can be built on this host (not Linux, no libseccomp, a kernel without
    seccomp), or None."""
    if not sys.platform.startswith("linux"):
        return f"a seccomp filter needs Linux; this host runs {sys.platform}"
    try:
        _library()
    except OSError:
        return f"libseccomp is not installed ({LIBRARY} not found; {INSTALL_HINT})"
    except AttributeError as exc:
        return f"this libseccomp is too old ({exc}; {INSTALL_HINT})"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(ctypes.c_int(PR_GET_SECCOMP), *[ctypes.c_ulong(0)] * 4) < 0:
        return f"this kernel has no seccomp ({os.strerror(ctypes.get_errno())}: built without CONFIG_SECCOMP)"
    try:
        bpf()
    except (OSError, RuntimeError) as exc:
        return f"no seccomp filter can be built here: {exc}"
    return None


def install() -> None:
    """Load the filter into this process: every thread of it, and every process it starts
    or execs from now on.  For a sandbox's kernel, after it dropped to the student's uid
    and before it execs the kernel."""
    libc = ctypes.CDLL(None, use_errno=True)
    zero = ctypes.c_ulong(0)
    # the kernel takes a filter from a process without CAP_SYS_ADMIN only once it has
    # no_new_privs (else a setuid program it execs would run under a filter of its choosing)
    if libc.prctl(ctypes.c_int(PR_GET_NO_NEW_PRIVS), zero, zero, zero, zero) != 1:
        if libc.prctl(ctypes.c_int(PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1), zero, zero, zero) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
    with _filter() as (lib, ctx):
        _ok(lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_TSYNC, 1), "seccomp_attr_set(SCMP_FLTATR_CTL_TSYNC)")
        _ok(lib.seccomp_load(ctx), "seccomp_load")


def bpf() -> bytes:
    """The filter as a classic-BPF program (``struct sock_filter`` entries, 8 bytes each):
    what ``bwrap --seccomp FD`` reads from FD to its end and loads just before it execs the
    command.  The same deny list as ``install()``, compiled for this machine's architecture."""
    # exported into a memfd: a pipe would block once the program outgrew the pipe's buffer
    fd = os.memfd_create("disttrain-seccomp-bpf")
    try:
        with _filter() as (lib, ctx):
            _ok(lib.seccomp_export_bpf(ctx, fd), "seccomp_export_bpf")
        return os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)
