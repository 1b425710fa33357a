"""A rank process as the pool (``warmpool.py``) holds it: started, its output shown in the cell, its
stack read when it is stuck, its crash report and exit code read when it died, and what its state
in ``/proc`` says (waiting for a CPU: :func:`runnable`; ending, not yet reaped: :func:`dying`).

The rank's own side is ``worker.py``; the pool decides when to do each of these.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection

from . import trace
from .reports import stack_frames
from .worker import STACK_SIGNAL, worker_main

__all__ = ["Rank", "start", "stacks", "runnable", "dying", "MAX_OUTPUT_LINES"]

MAX_OUTPUT_LINES = 2000  # per rank and launch; more is counted, not shown


class Rank:
    """One worker process: its control connection, the read ends of its output and stack pipes."""

    def __init__(self, rank: int, pid: int, conn: Connection, out_fd: int, stack_fd: int, popen=None):
        self.rank, self.pid, self.conn, self.out_fd, self.popen = rank, pid, conn, out_fd, popen
        self.stack_fd = stack_fd  # where the rank writes its Python stack when asked (STACK_SIGNAL)
        self.partial = b""
        self.shown = 0
        self.hidden = 0

    # ---- output ---------------------------------------------------------------------------
    def relay(self) -> bool:
        """Show the complete lines the rank has written so far; False when nothing was read."""
        try:
            chunk = os.read(self.out_fd, 1 << 16)
        except (BlockingIOError, OSError):
            return False
        if not chunk:
            return False
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        self._show(lines)
        return True

    def drain(self) -> None:
        """Show everything left in the rank's pipe, a last line without a newline too."""
        for _ in range(64):
            if not self.relay():
                break
        if self.partial:
            self._show([self.partial])
            self.partial = b""

    def flush_hidden(self) -> None:
        """Say how many lines were not shown (past MAX_OUTPUT_LINES), once per launch."""
        if self.hidden:
            sys.stdout.write(
                f"[rank {self.rank}] ... {self.hidden} more lines not shown (at most {MAX_OUTPUT_LINES} per rank)\n"
            )
            self.hidden = 0

    def _show(self, lines: list[bytes]) -> None:
        out = []
        for line in lines:
            if self.shown < MAX_OUTPUT_LINES:
                out.append(f"[rank {self.rank}] {line.decode(errors='replace')}\n")
                self.shown += 1
            else:
                self.hidden += 1
        if out:
            sys.stdout.write("".join(out))
            sys.stdout.flush()

    # ---- its end --------------------------------------------------------------------------
    def crash_report(self) -> str:
        """What the rank's faulthandler wrote on its stack pipe when a fatal signal killed it."""
        text = b""
        for _ in range(64):
            try:
                chunk = os.read(self.stack_fd, 1 << 16)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            text += chunk
        return text.decode(errors="replace")

    def reap(self) -> int | None:
        """Exit code of the process (negative: killed by that signal); waits briefly."""
        for _ in range(50):
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.popen.returncode if self.popen else None
            if pid:
                if self.popen is not None:
                    self.popen.returncode = os.waitstatus_to_exitcode(status)
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        return None


def start(rank: int, fork: bool, slots: list, status_fds: list[int], size: int, owner_pid: int) -> Rank:
    """Start rank ``rank``'s worker: forked from this process (``fork``: the CPU's way), else a
    fresh interpreter (GPUs), with its own status mapping (``slots[rank]``, or ``status_fds[rank]``
    for a fresh interpreter; each ``SLOT_BYTES * size``) and the owner's pid it dies with.  The
    other ranks' mappings are not the rank's: a forked child unmaps them before anything else runs."""
    parent_sock, child_sock = socket.socketpair()
    out_r, out_w = os.pipe()
    stack_r, stack_w = os.pipe()
    if fork:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # child: never return into the caller's stack
            code = 1
            try:
                parent_sock.close()
                os.close(out_r)
                os.close(stack_r)
                _blank_inherited(keep=(child_sock.fileno(), out_w, stack_w))
                for other, slot in enumerate(slots):
                    if other != rank:
                        slot.close()  # (munmap: a rank sees no other rank's status)
                worker_main(child_sock.detach(), out_w, slots[rank], forked=True, parent=owner_pid, stack_fd=stack_w)
                code = 0
            finally:
                os._exit(code)
        popen = None
    else:
        fds = (child_sock.fileno(), out_w, status_fds[rank], stack_w)
        popen = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from disttrain_lab.worker import spawned_main; spawned_main()",
                *map(str, fds[:3]),
                str(owner_pid),
                str(trace.SLOT_BYTES * size),
                str(stack_w),
            ],
            pass_fds=fds,
            stdin=subprocess.DEVNULL,
            stdout=out_w,
            stderr=out_w,
            close_fds=True,
        )
        pid = popen.pid
    child_sock.close()
    os.close(out_w)
    os.close(stack_w)
    os.set_blocking(out_r, False)
    os.set_blocking(stack_r, False)
    return Rank(rank, pid, Connection(parent_sock.detach()), out_r, stack_r, popen)


def _blank_inherited(keep) -> None:
    """In a rank just forked: every descriptor it inherited but ``keep`` (its own channels to the kernel) now
    refers to /dev/null.  The kernel's descriptors include the ends of the ranks forked before this one (the
    kernel's end of their control sockets, their output pipes): left open, a rank could write into another
    rank's control channel or read its output, a way between ranks that no wire shows.  Pointed at /dev/null
    rather than closed, so that a number an object of the kernel's copy still holds is never reused for
    something else (its finaliser would close that)."""
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
            if fd in keep or fd == null:
                continue
            try:
                fcntl.fcntl(fd, fcntl.F_GETFD)
            except OSError:  # closed since the listing (the listing's own descriptor)
                continue
            os.dup2(null, fd, inheritable=fd <= 2)  # (stdin stays a program's stdin)
    finally:
        os.close(null)


def stacks(ranks: list[Rank]) -> dict[int, list[tuple[str, int]]]:
    """Each stuck rank's Python stack, outermost call first, as (function, line): the
    functions of the notebook (and of a test's driver) it is in, the kit's and torch's left out.
    A rank writes it when signalled (faulthandler, so also while blocked inside C++)."""
    for r in ranks:
        try:
            os.kill(r.pid, STACK_SIGNAL)
        except ProcessLookupError:
            pass
    texts = {r.rank: b"" for r in ranks}
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        grew = False
        for r in ranks:
            try:
                chunk = os.read(r.stack_fd, 1 << 16)
            except (BlockingIOError, OSError):
                continue
            texts[r.rank] += chunk
            grew = grew or bool(chunk)
        if not grew and all(texts.values()):
            break  # every rank wrote its stack, and nothing more came
        time.sleep(0.05)
    return {rank: stack_frames(text.decode(errors="replace")) for rank, text in texts.items()}


def kill(ranks: list[Rank]) -> None:
    """SIGKILL every rank (one blocked in C++ ignores anything gentler), wait for each, close its pipes."""
    for r in ranks:
        try:
            os.kill(r.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for r in ranks:
        try:
            os.waitpid(r.pid, 0)
        except ChildProcessError:
            pass
        if r.popen is not None:
            r.popen.returncode = r.popen.returncode if r.popen.returncode is not None else -9
        for closer in (r.conn.close, lambda r=r: os.close(r.out_fd), lambda r=r: os.close(r.stack_fd)):
            try:
                closer()
            except OSError:
                pass


def runnable(pid: int) -> bool:
    """True for a process whose main thread is running or waiting for a CPU (state R), not asleep in a call."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"R"
    except (OSError, IndexError):
        return False


def dying(pid: int) -> bool:
    """True for a process that a SIGKILL is pending for, or that is exiting: its main thread
    is a zombie while its other threads (gloo's) still end, when waitpid cannot reap it yet."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
    except OSError:
        return False  # no /proc (macOS): waitpid alone
    state = fields.get(b"State", b"").strip()[:1]
    pending = 0
    for key in (b"SigPnd", b"ShdPnd"):
        try:
            pending |= int(fields.get(key, b"0").strip() or b"0", 16)
        except ValueError:
            pass
    return state in (b"Z", b"X") or bool(pending & (1 << (signal.SIGKILL - 1)))
