"""Kernels forked from a process that has already imported torch: a kernel's start, 5 s of CPU on the
2-core course machine (torch's import alone 3 s), becomes a fork.

Only for kernels the grader trusts: the grader kernel (``grader_kernel.py``, one per student a grading
step grades) and the test suite's own kernels.  A student's kernel never starts this way: it starts in
its sandbox (``kernels.py``), as its own program.

``ForkingKernelManager`` launches a kernel whose command is this interpreter's ``-m ipykernel_launcher``
(the ``python3`` kernel) by asking a *zygote* for it: a process of this interpreter, started once per
process that asks (``Zygote.shared``), that imported torch, numpy, IPython and ipykernel and nothing
else (no kit: its import installs a notebook's hooks, which a kernel makes at its own import), and
started no thread of its own.  The zygote forks; the child takes the kernel's environment, folder and
arguments, becomes a session leader as ``Popen(start_new_session=True)`` makes it, and runs
``ipykernel_launcher`` as ``python -m`` would (``sys.path[0]`` its folder).  The manager holds a
``ForkedKernel``, which answers as ``Popen`` does (``poll``, ``wait``, ``send_signal``, ``kill``): the
zygote reaps the child and sends its exit status on the connection the fork was asked on.  What the
zygote imported, it imported with the environment of the process that started it; a kernel's own
variables (``MPLBACKEND``, ``NBGRADER_EXECUTION``) are read after it starts, and torch reads none of
them at import.  The kernels share the zygote's string-hash seed (as under a fixed ``PYTHONHASHSEED``);
random generators are reseeded in each (Python's by itself, numpy's here; torch's starts from a fixed
seed in any process).  Any other command, or a zygote that cannot start, launches as jupyter_client does.

Run as a file (``python kernel_forks.py SOCKET``), it is the zygote: it imports nothing of this
package, so nothing of it is in the kernels it forks.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from jupyter_client.manager import AsyncKernelManager  # (ipykernel imports jupyter_client in every kernel too)

__all__ = ["ForkedKernel", "ForkingKernelManager", "Zygote"]

PRELOADED = ("torch", "numpy", "zmq", "tornado", "IPython", "ipykernel.kernelapp")
START_TIMEOUT = 120.0  # seconds for the zygote's imports on a loaded host
_PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------------------------------------
# the zygote (this file run as a program)


def _serve(path: str) -> None:
    """Import ``PRELOADED``, listen on the unix socket ``path``, and fork a kernel per request (one JSON
    line: argv, env, cwd), answering its pid, then its exit status when it ends; end with the parent."""
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    waiting: dict[int, socket.socket] = {}  # pid -> the connection its fork was asked on
    while os.getppid() == parent:
        readable, _, _ = select.select([server], [], [], 0.1)
        if readable:
            conn, _ = server.accept()
            try:
                request = json.loads(_read_line(conn))
                pid = os.fork()
                if pid == 0:
                    server.close()
                    conn.close()
                    _become_kernel(request)  # never returns
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                waiting[pid] = conn
            except (OSError, ValueError, KeyError, TypeError) as exc:
                with _quietly():
                    conn.sendall(json.dumps({"error": repr(exc)}).encode() + b"\n")
                conn.close()
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                with _quietly():
                    conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                conn.close()
    for pid in waiting:  # (the parent is gone: so are the kernels it asked for)
        with _quietly():
            os.kill(pid, signal.SIGKILL)


class _quietly:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is not None and issubclass(kind, OSError)


def _read_line(conn: socket.socket, limit: int = 1 << 22) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk or len(data) > limit:
            raise OSError("the request ended early")
        data += chunk
    return data


def _become_kernel(request: dict) -> None:
    """In the forked child: the kernel's environment, folder and session, then ``python -m
    ipykernel_launcher ARGS``; the child's exit status is the kernel's."""
    code = 1
    try:
        import ctypes
        import runpy

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # (the zygote gone: so is it)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["argv"][0], *request["argv"][3:]]
        sys.path[0] = os.getcwd()  # (python -m: the folder it starts in)
        sys.modules["numpy"].random.seed()  # (Python's random reseeds itself in a child; numpy's does not)
        runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001  (whatever ended the kernel: its status, never the zygote's loop)
        import traceback

        traceback.print_exc()
    finally:
        with _quietly():
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


# ---------------------------------------------------------------------------------------------
# the client: the zygote's process, and a forked kernel as Popen


class ForkedKernel:
    """A kernel the zygote forked, as ``subprocess.Popen`` answers for one it started: ``pid``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill`` (its exit status
    comes from the zygote, which is its parent)."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int, conn: socket.socket):
        self.pid, self.returncode, self._conn, self._buffer = pid, None, conn, b""

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._buffer.endswith(b"\n"):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return
            chunk = self._conn.recv(4096)
            if not chunk:  # the zygote itself is gone, and with it its children
                self._buffer = json.dumps({"exit": -signal.SIGKILL}).encode() + b"\n"
                break
            self._buffer += chunk
        self.returncode = int(json.loads(self._buffer)["exit"])
        self._conn.close()

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"kernel {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The zygote process of this process (``shared()``): started on first use, stopped at exit."""

    _shared: Zygote | None = None
    _lock = threading.Lock()

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="kernel-forks-")
        self.path = os.path.join(self.folder, "z")
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), self.path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
        )
        ready = select.select([self.process.stdout], [], [], START_TIMEOUT)[0]
        if not ready or self.process.stdout.readline().strip() != b"ready":
            self.stop()
            raise OSError(f"the kernels' zygote did not start within {START_TIMEOUT:g} s")
        atexit.register(self.stop)

    @classmethod
    def shared(cls) -> Zygote | None:
        """This process's zygote, started on first use; None where it cannot start (then kernels
        launch as jupyter_client launches them)."""
        with cls._lock:
            if cls._shared is None or cls._shared.process.poll() is not None:
                try:
                    cls._shared = Zygote()
                except OSError:
                    cls._shared = None
            return cls._shared

    def fork(self, argv: list[str], env: dict[str, str], cwd: str) -> ForkedKernel:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(START_TIMEOUT)
        conn.connect(self.path)
        conn.sendall(json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode() + b"\n")
        answer = json.loads(_read_line(conn))
        if "pid" not in answer:
            conn.close()
            raise OSError(f"the kernels' zygote could not fork: {answer.get('error')}")
        conn.settimeout(None)
        return ForkedKernel(int(answer["pid"]), conn)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.process.stdout:
            self.process.stdout.close()
        with _quietly():
            os.unlink(self.path)
        with _quietly():
            os.rmdir(self.folder)


def _forkable(cmd: list[str]) -> bool:
    return len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1:3] == ["-m", "ipykernel_launcher"]


class ForkingKernelManager(AsyncKernelManager):
    """``AsyncKernelManager`` whose ``python3`` kernels are forked by this process's zygote (see the
    module's docstring); any other kernel starts as jupyter_client starts it."""

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw) -> None:
        forkable = (
            len(kernel_cmd) >= 3 and kernel_cmd[0] == sys.executable and kernel_cmd[1:3] == ["-m", "ipykernel_launcher"]
        )
        zygote = Zygote.shared() if forkable else None
        if zygote is None:
            return await super()._async_launch_kernel(kernel_cmd, **kw)
        env = kw.get("env") or dict(os.environ)
        cwd = str(kw.get("cwd") or os.getcwd())
        provisioner = self.provisioner
        provisioner.process = zygote.fork(kernel_cmd, {str(k): str(v) for k, v in env.items()}, cwd)
        provisioner.pid = provisioner.pgid = provisioner.process.pid
        provisioner.cwd = cwd
        self._reconcile_connection_info(provisioner.connection_info)


if __name__ == "__main__":
    _serve(sys.argv[1])
