"""The student's kernel as ``execute.RobustExecute`` runs it: started in the sandbox where it is
on (``SandboxKernelManager``, what it hides and keeps), under a memory limit where it is not,
started again when it dies while starting, run quietly (code whose outputs nobody keeps), asked
whether it still answers, and stopped, leaving nothing: each sandboxed kernel's own folder (its
sockets, what its sandbox staged) and cgroup are removed once it is stopped (``clean_kernels``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from queue import Empty

from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import ensure_async, run_sync
from nbclient.exceptions import DeadKernelError

from . import cgroups, run_container, sandbox, steps, trees, uids
from .config import REPO_ROOT, course_dir, source_dir

WRAPPER_GRACE = 5.0  # seconds a sandbox's wrapper has to end its kernel and clean up when asked
# the grader's references, which a graded kernel must not import: lab 13 asks for an FP8 linear layer in torch
# alone and grades it against torchao's Float8Linear (in the grader's kernel, which has it)
REFERENCE_PACKAGES = ("torchao",)


class SandboxKernelManager(AsyncKernelManager):
    """Starts the kernel in the sandbox (``sandbox.command``; set ``sandbox_spec`` first)."""

    sandbox_spec: dict = {}

    def format_kernel_cmd(self, extra_arguments=None):
        return sandbox.command(self.sandbox_spec, super().format_kernel_cmd(extra_arguments))


class ContainerKernelManager(AsyncKernelManager):
    """Starts the kernel as another uid, without namespaces (``run_container.command``; set
    ``container_spec`` first): ``DISTTRAIN_SANDBOX=container``."""

    container_spec: dict = {}

    def format_kernel_cmd(self, extra_arguments=None):
        return run_container.command(self.container_spec, super().format_kernel_cmd(extra_arguments))


def git_paths(root: Path = REPO_ROOT) -> list[str]:
    """The repository's git data: its objects hold every solution and hidden test.  In a
    worktree ``.git`` is a file naming the real git directory (and its common one)."""
    git = root / ".git"
    if not git.is_file():
        return [str(git)]
    found = [str(git)]
    text = git.read_text(errors="replace").strip()
    if text.startswith("gitdir:"):
        gitdir = (root / text[len("gitdir:") :].strip()).resolve()
        found.append(str(gitdir))
        common = gitdir / "commondir"
        if common.is_file():
            found.append(str((gitdir / common.read_text().strip()).resolve()))
    return found


def hidden_paths(references: bool = True) -> list[str]:
    """What a sandboxed kernel must not see: the course (gradebook, every submission),
    the solutions and the repository's git data (which holds them too), the grading temp
    dir and its folder for sockets, the grader's home, and $DISTTRAIN_SANDBOX_HIDE; with
    ``references``, the grader's reference packages too (``reference_paths``)."""
    extra = [p for p in os.environ.get("DISTTRAIN_SANDBOX_HIDE", "").split(os.pathsep) if p]
    extra += [p for p in [os.environ.get(steps.SOCKETS_ENV)] if p]
    extra += reference_paths() if references else []
    return [str(course_dir()), str(source_dir()), *git_paths(), tempfile.gettempdir(), os.path.expanduser("~"), *extra]


def reference_paths() -> list[str]:
    """The folders of the packages a graded kernel must not import (``REFERENCE_PACKAGES``), where installed:
    found without importing them (a top-level ``find_spec`` runs none of the package's code)."""
    found = []
    for name in REFERENCE_PACKAGES:
        spec = importlib.util.find_spec(name)
        found += [os.path.realpath(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
    return found


def socket_root() -> str:
    """Where a sandboxed kernel's own folder goes: the grading step's folder for sockets
    (``steps.SOCKETS_ENV``), else the temp dir, else /tmp: a unix socket's path holds at most
    107 bytes (``steps.SOCKET_DIR_MAX``)."""
    for where in (os.environ.get(steps.SOCKETS_ENV), tempfile.gettempdir()):
        if where and len(where) < steps.SOCKET_DIR_MAX:
            return where
    return "/tmp"


def kept_paths() -> list[str]:
    """What it must read: the interpreter and the kit (bound back read-only where hidden)."""
    return sorted({sys.base_prefix, sys.prefix, str(REPO_ROOT)})


class StudentKernel:
    """The kernel methods of ``RobustExecute`` (a mixin before nbgrader's ``Execute``, whose
    traits ``sandbox``, ``sandbox_uid``, ``student_memory``, ``student_pids``,
    ``memory_limit``, ``startup_retries`` and ``probe_timeout`` it reads).  Once a kernel
    and its client are up it calls ``self._kernel_started()``."""

    def create_kernel_manager(self):
        km = super().create_kernel_manager()
        if self.sandbox == "on":
            km.__class__ = SandboxKernelManager
            # the sandbox has its own network namespace: ZMQ over unix sockets, in the kernel's own
            # folder (bound in; a bubblewrap sandbox stages there too), removed once it is stopped
            folder = tempfile.mkdtemp(prefix="kernel-", dir=socket_root())
            self._kernels_made().append(("folder", folder))
            os.mkdir(os.path.join(folder, "ipc"), 0o700)
            km.transport, km.ip = "ipc", os.path.join(folder, "ipc", "k")
            km.sandbox_spec = sandbox.spec(
                # a uid no other grading on the host uses (uids.py), else one per parallel job
                uid=uids.sandbox_uid(self.sandbox_uid, int(os.environ.get("DISTTRAIN_SANDBOX_SLOT", "0")))
                if sandbox.method() == "root"
                else self.sandbox_uid + int(os.environ.get("DISTTRAIN_SANDBOX_SLOT", "0")),
                memory=self.student_memory,
                pids=self.student_pids,
                data_limit=self.memory_limit,
                cgroup=os.environ.get("DISTTRAIN_SANDBOX_CGROUP", f"{cgroups.base()}/plain"),
                hide=hidden_paths(),
                keep=kept_paths(),
                scratch=folder,
            )
        elif self.sandbox == "container":  # no namespaces to make: another uid, rlimits, the filter
            km.__class__ = ContainerKernelManager
            km.container_spec = run_container.spec(
                data_limit=self.memory_limit,
                pids=self.student_pids,
                hide=hidden_paths(references=False),
                keep=kept_paths(),
                references=reference_paths(),
            )
            # the kernel's own folder (its sockets, the copy of its working folder, its home): in /tmp,
            # where its uid can reach it (the grading temp dir is root's); run_container.py removes it
            # (and clean_kernels, where its wrapper was killed first)
            folder = tempfile.mkdtemp(prefix="kernel-", dir="/tmp")
            self._kernels_made().append(("folder", folder))
            km.transport, km.ip = "ipc", os.path.join(folder, "k")
        elif self.sandbox != "off":
            raise ValueError(f"RobustExecute.sandbox must be 'on', 'container' or 'off', got {self.sandbox!r}")
        return km

    def start_new_kernel(self, **kwargs):
        # a restarted kernel starts where the first one did (the submission's folder)
        kwargs = self._kernel_kwargs = kwargs or getattr(self, "_kernel_kwargs", {})
        super().start_new_kernel(**kwargs)
        pid = getattr(getattr(self.km, "provisioner", None), "pid", None)
        if self.sandbox == "on" and pid and self.km.sandbox_spec.get("caps"):  # (run_sandbox's name for it)
            self._kernels_made().append(("cgroup", f"{self.km.sandbox_spec['cgroup']}/kernel-{pid}"))
        if self.memory_limit and pid and self.sandbox != "on":  # (the sandbox sets it before the kernel starts)
            import resource

            # hard and soft: the kernel cannot raise it back; ranks it forks/spawns inherit it
            resource.prlimit(pid, resource.RLIMIT_DATA, (self.memory_limit, self.memory_limit))

    def start_new_kernel_client(self):
        for attempt in range(self.startup_retries + 1):
            try:
                kc = super().start_new_kernel_client()
                break
            except RuntimeError as exc:  # "Kernel died before replying to kernel_info"
                if attempt == self.startup_retries:
                    raise
                self.log.warning("the kernel died while starting (%s); starting it again", exc)
                if self.km is not None:
                    self._stop_kernel()
                self.km = self.create_kernel_manager()
                self.start_new_kernel()
        self._kernel_started()
        return kc

    def _kernel_answers(self, code: str = "pass", timeout: float | None = None) -> bool:
        try:
            return self._run_quietly(code, timeout=timeout or self.probe_timeout) is not None
        except DeadKernelError:
            return False

    def _stop_kernel(self) -> None:
        self._end_wrapper()

        async def stop():
            if self.kc is not None:
                self.kc.stop_channels()
            try:
                await ensure_async(self.km.shutdown_kernel(now=True))
            except Exception as exc:  # already dead: nothing to stop
                self.log.debug("stopping the kernel: %s", exc)
            try:
                await ensure_async(self.km.cleanup_resources())
            except Exception as exc:
                self.log.debug("cleaning up the kernel: %s", exc)

        run_sync(stop)()
        self.kc, self.km = None, None
        self.clean_kernels()

    def _cleanup_kernel(self) -> None:
        # nbclient's own (at the end of the notebook) ends a kernel gracefully: an interrupt, a
        # shutdown request, then half its shutdown_wait_time (2.5 s) before SIGTERM, which every
        # sandboxed kernel waited out (its wrapper outlives the kernel).  A graded kernel has
        # nothing left to save: _stop_kernel ends it, and all it started, at once.
        if self.km is not None:
            self._stop_kernel()

    def _end_wrapper(self) -> None:
        """Ask a sandbox's wrapper to end (SIGTERM: it kills the kernel, removes its cgroup or, in
        container mode, every process of the student's uid, and its staged folder) before the
        kernel manager's SIGKILL to its process group would cut that short."""
        process = getattr(getattr(self.km, "provisioner", None), "process", None)
        if self.sandbox not in ("on", "container") or process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(WRAPPER_GRACE)
        except subprocess.TimeoutExpired:  # (killed with its group next)
            self.log.warning("the sandbox of the student's kernel did not end within %s s", WRAPPER_GRACE)

    def _kernels_made(self) -> list[tuple[str, str]]:
        """("folder" | "cgroup", path) of what was made for each kernel started, until removed."""
        if not hasattr(self, "_made_for_kernels"):
            self._made_for_kernels = []
        return self._made_for_kernels

    def clean_kernels(self) -> None:
        """Remove what was made for the kernels, all stopped by now: each cgroup node its sandbox's
        wrapper did not remove (killed before it could: its processes are killed first), then each
        kernel's folder, which the student's code could write into (``trees.remove``: as the
        student, never following a link, at any depth; what is left is logged, never raised)."""
        made = self._kernels_made()
        for kind, path in sorted(made):  # ("cgroup" < "folder")
            if kind == "cgroup":
                try:
                    sandbox.Cgroup(path).destroy()
                except OSError as exc:
                    self.log.warning("could not remove the kernel's cgroup %s: %s", path, exc)
            else:
                left = trees.said(path, trees.remove(path))
                if left:
                    self.log.warning(left)
        made.clear()

    def _run_quietly(self, code: str, timeout: float) -> dict | None:
        """Execute code without recording outputs; the reply content, or None on timeout."""

        async def run():
            msg_id = self.kc.execute(
                code,
                silent=True,
                store_history=False,
                allow_stdin=False,
                stop_on_error=False,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    msg = await ensure_async(
                        self.kc.shell_channel.get_msg(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
                    )
                except Empty:
                    if not await ensure_async(self.kc.is_alive()):
                        raise DeadKernelError("Kernel died") from None
                    continue
                if msg["parent_header"].get("msg_id") == msg_id:
                    return msg["content"]
            return None

        return run_sync(run)()
