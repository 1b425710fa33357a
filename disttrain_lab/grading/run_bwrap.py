"""The bubblewrap way of one sandbox per graded kernel: where the grader is not root but bubblewrap
runs (user namespaces), ``run_sandbox.py`` hands the kernel to ``run`` here (``sandbox.method() ==
"bwrap"``): wrapper (the grader) -> bwrap -> kernel, with the same private /tmp and /dev/shm
(size-capped tmpfs), hidden grader files, read-only root file system, new pid, IPC and network
namespaces, environment allowlist and syscall filter (``--seccomp``) as the root way, the caps
where an administrator delegated the cgroup base to the grader.

Like ``run_sandbox.py`` this file is loaded by its path (``run_sandbox._sibling``) and imports
nothing but the standard library; what both ways share (the private mounts' table, the host's unix
sockets, /etc/hosts for the namespace, the kernel's socket folder, the student's cgroup, the
siblings' loader) it is handed by ``run_sandbox.py`` as ``host``, so that the two ways hide the
same things.  ``sandbox.py`` (the grader's side) imports ``BWRAP_NAMESPACES`` to try them once.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

# bubblewrap's namespaces (sandbox.py tries them once: whether bwrap works on this host)
BWRAP_NAMESPACES = ["--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-net", "--die-with-parent"]
# the host's file system read-only, a fresh /dev and /proc: what every sandbox (and sandbox.py's try) starts from
BWRAP_ROOT = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]


def run(the_spec: dict, cmd: list[str], host) -> None:
    """wrapper (the grader) -> bwrap -> kernel, in new user, pid, IPC and mount namespaces.
    The submission folder, home and connection file are staged in the kernel's own folder
    (``scratch``, else the grading's temp dir; hidden from the kernel) and bound in; the stage,
    which the kernel writes into, is removed when the kernel ends (``trees.remove``).  ``host``:
    run_sandbox.py's pieces both ways share (module docstring).  Ends this process with the kernel's code."""
    size = str(the_spec["memory"] // 2)
    stage = Path(tempfile.mkdtemp(prefix="sandbox-", dir=the_spec.get("scratch")))
    ipc_dir, cgroup = None, None
    try:
        work, home, runtime = stage / "work", stage / "home", stage / "kernel"
        shutil.copytree(".", work, symlinks=True, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        home.mkdir()
        runtime.mkdir(mode=0o700)
        (stage / "hosts").write_text(host.hosts_file())
        if "-f" in cmd:
            conn_index = cmd.index("-f") + 1
            conn = json.loads(Path(cmd[conn_index]).read_bytes())
            ipc_dir = host.ipc_dir(conn)
            if ipc_dir:  # bound in below, where the kernel looks
                conn["ip"] = "/tmp/.kernel/ipc/" + os.path.basename(conn["ip"])
            (runtime / "kernel.json").write_text(json.dumps(conn))
            cmd[conn_index] = "/tmp/.kernel/kernel.json"
        keep = sorted({os.path.realpath(p) for p in the_spec["keep"] if os.path.isdir(p)})
        args = [
            shutil.which("bwrap") or "bwrap",
            *BWRAP_NAMESPACES,
            "--uid",
            str(the_spec["uid"]),
            "--gid",
            str(the_spec["uid"]),
            *BWRAP_ROOT,
            *(["--ro-bind", str(stage / "hosts"), "/etc/hosts"] if os.path.isfile("/etc/hosts") else []),
        ]
        # the same order as the root sandbox: the private tmpfs, then the hidden folders by
        # depth; after each, the kept folders below it are bound back read-only
        private = [t for t, _, _ in host.private_mounts if not os.path.islink(t) and os.path.isdir(t)]
        hidden = sorted(
            {os.path.realpath(p) for p in the_spec["hide"]} - {"/", "/proc", *private}, key=lambda p: p.count(os.sep)
        )
        done: list[str] = []
        bound: list[str] = []  # kept folders bound back so far
        for target in private + hidden:
            if any(target.startswith(d.rstrip(os.sep) + os.sep) for d in done) and not any(
                target == k or target.startswith(k.rstrip(os.sep) + os.sep) for k in bound
            ):
                continue  # below a folder hidden already (and not bound back)
            done.append(target)
            below = [k for k in keep if k.startswith(target.rstrip(os.sep) + os.sep)]
            bound += below
            if target in private:
                args += ["--size", size if target in ("/tmp", "/dev/shm") else str(16 * 2**20), "--tmpfs", target]
            elif os.path.isdir(target):
                args += ["--tmpfs", target]
            elif os.path.exists(target):
                args += ["--ro-bind", "/dev/null", target]
            for kept in below:
                args += ["--ro-bind", kept, kept]
            if target not in private and os.path.isdir(target):
                args += ["--remount-ro", target]
        if "/run" in private:
            args += ["--dir", "/run/lock"]
        # a read-only bind does not stop connect(): the host's unix sockets are covered
        for path in host.host_unix_sockets():
            try:
                if not host.below(path, done) and stat.S_ISSOCK(os.lstat(path).st_mode):
                    args += ["--ro-bind", "/dev/null", path]
            except OSError:  # gone, or unreadable to the grader (and so to the kernel)
                pass
        args += [
            "--bind",
            str(work),
            "/tmp/work",
            "--bind",
            str(home),
            "/tmp/home",
            "--bind",
            str(runtime),
            "/tmp/.kernel",
            *(["--bind", ipc_dir, "/tmp/.kernel/ipc"] if ipc_dir else []),
            "--chdir",
            "/tmp/work",
            "--",
            *cmd,
        ]
        env = host.sibling("kernel_env").kernel_env(os.environ, home="/tmp/home", runtime="/tmp/.kernel", keep=keep)
        limit = the_spec["data_limit"]
        cgroup = host.student_cgroup(the_spec)  # (a base an administrator delegated to the grader)

        def in_child() -> None:
            if limit:
                resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
            if cgroup is not None:  # bwrap and all below it: capped before anything runs
                cgroup.add(os.getpid())

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is for the kernel (its group gets it)
        # bwrap stays pid 1 of the sandbox: its options (the hidden host paths) go in a memfd
        # (--args), so that the kernel's /proc/1/cmdline names none of them; the command
        # after "--" stays (bwrap takes it only there; its paths are the sandbox's own)
        options, command = args[1 : args.index("--")], args[args.index("--") :]
        fds = [os.memfd_create("disttrain-sandbox-args", 0)]
        if the_spec.get("syscall_filter"):  # bwrap loads it last, just before the kernel runs
            fds.append(os.memfd_create("disttrain-sandbox-seccomp", 0))
            os.write(fds[1], host.sibling("syscall_filter").bpf())
            os.lseek(fds[1], 0, os.SEEK_SET)
            options += ["--seccomp", str(fds[1])]
        os.write(fds[0], b"".join(a.encode() + b"\0" for a in options))
        os.lseek(fds[0], 0, os.SEEK_SET)
        try:
            proc = subprocess.Popen(
                [args[0], "--args", str(fds[0]), *command], env=env, preexec_fn=in_child, pass_fds=fds
            )
        finally:
            for fd in fds:
                os.close(fd)
        signal.signal(signal.SIGTERM, lambda *_: proc.kill())
        code = proc.wait()
    finally:
        try:
            if cgroup is not None:
                cgroup.destroy()
        finally:  # (the socket folder is the grader's to remove, with the kernel's own folder)
            trees = host.sibling("trees")
            left = trees.said(stage, trees.remove(stage))
            if left:
                sys.stderr.write(left + "\n")
    os._exit(code & 0xFF if code >= 0 else 1)
