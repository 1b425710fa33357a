"""The grader kernel's side of a graded test: the test's code, its references and its
comparisons run here, in a kernel that never executes student code; the student's function
runs in the student's (sandboxed) kernel, and only data comes back.

``RobustExecute`` starts the grader kernel, runs the lab's locked set-up cells in it, then
``install(settings_path)``.  From then on ``dl.exercise.run(name, n, inputs)`` in a test
cell here:

1. writes the request (the function's name or a test's driver source, world size, inputs,
   timeout) with ``torch.save`` into a folder the student's kernel can read (its socket
   folder, bound into its sandbox), as a new file (``O_EXCL | O_NOFOLLOW``);
2. reads every TCP socket of the student's network namespace (``wire.snapshot``, from
   outside: ``nsenter`` + ``ss``);
3. asks the student's kernel, over its own Jupyter channels, to run
   ``disttrain_lab.exercise.serve(request, record)`` (silently: nothing reaches the notebook);
4. reads the sockets again: the bytes between the ranks' processes are the launch's traffic,
   counted by the OS (the test's references run in their own launches, here);
5. reads the record as data only (a regular file, not a link, at most
   ``exercise.MAX_RECORD_BYTES``, ``torch.load(weights_only=True)``), and replaces whatever
   traffic it claims with the count of step 4.

The ranks' process ids in the record are the student's claim; each must name a process of
the student's own sandbox (its pid namespace), so a forged id can only relabel the student's
own ranks.  Settings (the student kernel's connection file, a process in its namespaces,
the request folder as both sides see it) are rewritten by ``RobustExecute`` whenever the
student's kernel is (re)started.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import stat
import time
from pathlib import Path
from queue import Empty

import torch
from jupyter_client.blocking import BlockingKernelClient

from disttrain_lab import exercise, wire
from disttrain_lab.grading import sandbox

__all__ = ["install", "RemoteRunner", "write_settings", "host_pids"]

REPLY_MARGIN = 60.0  # seconds past the launch's own timeout before the student's kernel is given up


def install(settings_path: str) -> None:
    """Make ``dl.exercise.run`` in this (the grader's) kernel run in the student's kernel."""
    exercise.use_runner(RemoteRunner(Path(settings_path)))


def write_settings(path: Path, *, connection_file: str, kernel_pid: int | None, host_dir: str, kernel_dir: str) -> None:
    """Tell the grader kernel where the student's kernel is (RobustExecute, at each start)."""
    tmp = path.with_suffix(".partial")
    tmp.write_text(
        json.dumps(
            {
                "connection_file": connection_file,
                "kernel_pid": kernel_pid,
                "host_dir": host_dir,
                "kernel_dir": kernel_dir,
            }
        )
    )
    os.replace(tmp, path)


def host_pids(claimed: list, inside: int) -> list[int] | None:
    """The host's process ids of the processes the student's kernel calls ``claimed`` (ids in
    its own pid namespace), each checked to be in the namespace of process ``inside``; None
    when one is not."""
    if not isinstance(claimed, list) or not all(type(p) is int and p > 0 for p in claimed):
        return None
    try:
        namespace = os.readlink(f"/proc/{inside}/ns/pid")
    except OSError:
        return None
    if namespace == os.readlink("/proc/self/ns/pid"):  # no pid namespace: ids are the host's
        return claimed if all(os.path.exists(f"/proc/{p}") for p in claimed) else None
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") != namespace:
                continue
            for line in Path(f"/proc/{entry}/status").read_text().splitlines():
                if line.startswith("NSpid:"):
                    found[int(line.split()[-1])] = int(entry)
                    break
        except (OSError, ValueError):
            continue
    mapped = [found.get(p) for p in claimed]
    return None if None in mapped or len(set(mapped)) != len(mapped) else mapped


def _read_record(path: Path) -> dict:
    """The record file, if it is a regular file of acceptable size (never followed as a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        return {"error": {"type": "ExerciseError", "message": f"the student's kernel wrote no result ({exc.strerror})"}}
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > exercise.MAX_RECORD_BYTES:
            return {"error": {"type": "ExerciseError", "message": "the student's kernel's result is not a plain file"}}
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(exercise.MAX_RECORD_BYTES + 1)
    finally:
        os.close(fd)
    return exercise.loads(data)


class RemoteRunner:
    """``dl.exercise.run`` in the grader kernel (see the module docstring)."""

    def __init__(self, settings_path: Path):
        self.settings_path = settings_path
        self.client: BlockingKernelClient | None = None
        self.connection: str | None = None

    def _client(self, connection_file: str) -> BlockingKernelClient:
        if self.client is None or self.connection != connection_file:
            if self.client is not None:
                self.client.stop_channels()
            client = BlockingKernelClient()
            client.load_connection_file(connection_file)
            client.start_channels(shell=True, iopub=False, stdin=False, hb=True, control=False)
            self.client, self.connection = client, connection_file
        return self.client

    def __call__(self, target: str | dict, world_size: int, inputs: list, options: dict) -> dict:
        timeout = options["timeout"]
        name = target if isinstance(target, str) else target["name"]
        settings = json.loads(self.settings_path.read_text())
        client = self._client(settings["connection_file"])
        token = secrets.token_hex(8)
        host_dir, kernel_dir = Path(settings["host_dir"]), settings["kernel_dir"]
        request, record = host_dir / f"request-{token}.pt", host_dir / f"record-{token}.pt"
        buffer = io.BytesIO()
        torch.save({"target": target, "world_size": world_size, "inputs": inputs, "options": options}, buffer)
        # a new file (O_EXCL, no link followed) in a folder the student's kernel can write to
        fd = os.open(request, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(buffer.getvalue())
        kernel_pid = settings.get("kernel_pid")
        inside = sandbox.namespace_process(kernel_pid, "net") if kernel_pid else None
        try:
            before = wire.snapshot(inside)
        except (RuntimeError, OSError, ValueError) as exc:
            before, why = None, str(exc)
        code = (
            "__import__('disttrain_lab.exercise', fromlist=['serve']).serve("
            f"{kernel_dir + '/' + request.name!r}, {kernel_dir + '/' + record.name!r})"
        )
        try:
            reply = self._execute(client, code, timeout + REPLY_MARGIN, settings.get("kernel_pid"))
            if reply is None:
                return {
                    "error": {
                        "type": "ExerciseTimeout",
                        "message": f"{name} did not finish within {timeout + REPLY_MARGIN:g} s (the student's "
                        "kernel did not answer; it is restarted after this test)",
                    }
                }
            if reply == "dead":
                return {
                    "error": {
                        "type": "ExerciseError",
                        "message": f"the kernel died while running {name} (os._exit / crash / out of memory); "
                        "it is restarted after this test",
                    }
                }
            rec = _read_record(record)
        finally:
            for path in (request, record):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if "error" in rec:
            return rec
        rec.pop("matrix", None)
        in_pid_ns = sandbox.namespace_process(kernel_pid, "pid") if kernel_pid else None
        pids = host_pids(rec.get("pids"), in_pid_ns) if in_pid_ns is not None else None
        if pids is None or len(pids) != world_size:
            return {
                "error": {
                    "type": "ExerciseError",
                    "message": f"{name}: the ranks that ran it could not be found (their process ids were not "
                    "the student's kernel's own)",
                }
            }
        if before is None:
            rec["source"] = f"trace (the operating system could not be asked: {why})"
            return rec
        try:
            rec["matrix"] = wire.traffic(before, wire.snapshot(inside), pids).matrix
        except (RuntimeError, OSError, ValueError) as exc:
            rec["source"] = f"trace (the operating system could not be asked: {exc})"
        return rec

    def _execute(self, client: BlockingKernelClient, code: str, timeout: float, pid: int | None):
        msg_id = client.execute(code, silent=True, store_history=False, allow_stdin=False, stop_on_error=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = client.get_shell_msg(timeout=1.0)
            except Empty:
                if pid is not None and not os.path.exists(f"/proc/{pid}"):
                    return "dead"
                continue
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                return msg.get("content", {})
        return None
