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
   outside: ``nsenter`` + ``ss``, no process names parsed);
3. asks the student's kernel, over its own Jupyter channels, to run
   ``disttrain_lab.exercise.serve(request, record)`` (silently: nothing reaches the notebook);
4. reads the sockets again: the bytes between the ranks' processes are the launch's traffic,
   counted by the OS (the test's references run in their own launches, here); where the test
   asked for it (``timeline=True``), a packet capture in the student's network namespace ran
   from step 2 to here (``capture.py``): when each segment crossed, between which ranks;
5. reads the record as data only (a regular file, not a link, at most
   ``exercise.MAX_RECORD_BYTES``, ``torch.load(weights_only=True)``), and replaces whatever
   traffic it claims with the count of step 4, the sockets given to ranks by the inodes in
   their ``/proc/<pid>/fd``.  Where step 2 or 4 fails, the traffic is *unobserved*: a test that
   reads it fails with the reason (``wire.Unobserved``); the ranks' own trace is never used.

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
import subprocess
import time
from pathlib import Path
from queue import Empty

import torch
from jupyter_client.blocking import BlockingKernelClient

from disttrain_lab import exercise, wire
from disttrain_lab.grading import reaper, sandbox
from disttrain_lab.grading.capture import Capture
from disttrain_lab.hangs import MIN_LAUNCH, REPORT_MARGIN

__all__ = ["install", "RemoteRunner", "write_settings", "write_cell", "host_pids", "reader"]

NOT_ASKED = "not asked for: dl.exercise.run(..., timeline=True) captures it"
REPLY_MARGIN = 60.0  # seconds past the launch's own timeout before the student's kernel is given up
CELL_FILE = "cell.json"  # the test cell being graded: its grade_id, deadline, the student's function names
TIMED_OUT_FILE = "timed-out.json"  # the student's functions that timed out, and where (kept across kernels)


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


def write_cell(folder: Path, grade_id: str, deadline: float, student_functions: list[str]) -> None:
    """Tell the grader kernel which test cell it is running and when its limit ends
    (``time.monotonic()``, one clock for every process of the host), and the names of the
    functions the student's solution cells define (RobustExecute, before each graded cell)."""
    tmp = folder / (CELL_FILE + ".partial")
    tmp.write_text(json.dumps({"grade_id": grade_id, "deadline": deadline, "student_functions": student_functions}))
    os.replace(tmp, folder / CELL_FILE)


def _read_json(path: Path) -> dict:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _error(kind: str, message: str) -> dict:
    return {"error": {"type": kind, "message": message}}


def _real_uid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(next(line for line in f if line.startswith("Uid:")).split()[1])
    except (OSError, StopIteration, ValueError):
        return None


def reader(kernel_pid: int | None) -> int | None:
    """The uid the student's sockets are read as: where the student's kernel shares the grader's
    network namespace as another user (``DISTTRAIN_SANDBOX=container``), that user, for in a
    container the grader has no CAP_SYS_PTRACE to see which of another user's processes owns a
    socket; else None (the grader itself).  Its reads failing then fails the test (no trace's claim)."""
    if kernel_pid is None or sandbox.namespace_process(kernel_pid, "net") != kernel_pid:
        return None
    for pid in [kernel_pid, *reaper.children(kernel_pid)]:  # (the kernel, below run_container's wrapper)
        uid = _real_uid(pid)
        if uid is not None and uid != os.geteuid():
            return uid
    return None


def host_pids(claimed: list, inside: int, user: int | None = None) -> list[int] | None:
    """The host's process ids of the processes the student's kernel calls ``claimed`` (ids in
    its own pid namespace), each checked to be in the namespace of process ``inside`` (and, with
    no pid namespace, to run as ``user`` where given); None when one is not."""
    if not isinstance(claimed, list) or not all(type(p) is int and p > 0 for p in claimed):
        return None
    if len(set(claimed)) != len(claimed):  # one process named as two ranks
        return None
    try:
        namespace = os.readlink(f"/proc/{inside}/ns/pid")
    except OSError:
        return None
    if namespace == os.readlink("/proc/self/ns/pid"):  # no pid namespace: ids are the host's
        ok = all(os.path.exists(f"/proc/{p}") and (user is None or _real_uid(p) == user) for p in claimed)
        return claimed if ok else None
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


def _not_again(function: str, what: dict) -> str:
    """Why ``function`` is not run again under grading, with what happened when it timed out."""
    return (
        f"{function} is not run again: it did not finish when the graded test {what.get('cell')} ran it, and "
        f"grading waits for a function that hangs only once. What happened then:\n{what.get('message')}"
    )


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
        """One run in the student's kernel, within what is left of the test cell's limit: the
        launch's timeout is capped so that a hang ends with the launcher's own report (which rank,
        blocked in what) before the cell is interrupted; a function of the student's that timed out
        in an earlier test is not run again (its message is given at once)."""
        name = target if isinstance(target, str) else target["name"]
        cell = _read_json(self.settings_path.parent / CELL_FILE)
        timed_out = _read_json(self.settings_path.parent / TIMED_OUT_FILE)
        if isinstance(target, str) and target in timed_out:
            return _error("ExerciseTimeout", _not_again(target, timed_out[target]))
        timeout, options = options["timeout"], dict(options)
        deadline = cell.get("deadline")
        if isinstance(deadline, (int, float)):
            left = deadline - time.monotonic()
            if left - REPORT_MARGIN < MIN_LAUNCH:
                return _error(
                    "ExerciseTimeout",
                    f"{name} was not run: this test had {left:.0f} s left of its time limit when graded "
                    "(earlier runs in it used the rest)",
                )
            if left - REPORT_MARGIN < timeout:
                options["timeout"] = round(left - REPORT_MARGIN, 1)
                options["why"] = f"what was left of this test's time limit when graded; the test allows {timeout:g} s"
        options["timed_out"] = {n: _not_again(n, what) for n, what in timed_out.items()}
        options["student_functions"] = [str(f) for f in cell.get("student_functions") or []]
        rec = self._run(target, name, world_size, inputs, options, deadline)
        error = rec.get("error")
        if (
            isinstance(error, dict)
            and error.get("type") == "ExerciseTimeout"
            and "was stopped at once" not in str(error.get("message"))
        ):
            self._remember(name, target, error, cell, timed_out)
        return rec

    def _remember(self, name: str, target, error: dict, cell: dict, timed_out: dict) -> None:
        """Note the student's function that timed out (the innermost of the student's functions the
        stuck ranks were in; else the target itself when it is one of them)."""
        student = set(cell.get("student_functions") or [])
        running = [f for f in error.get("running") or [] if isinstance(f, str)]
        if isinstance(target, str):
            running.append(target)
        culprit = next((f for f in running if f in student), None)
        if culprit is None or culprit in timed_out:
            return
        timed_out[culprit] = {"cell": str(cell.get("grade_id", "an earlier test")), "message": str(error["message"])}
        path = self.settings_path.parent / TIMED_OUT_FILE
        tmp = path.with_suffix(".partial")
        tmp.write_text(json.dumps(timed_out))
        os.replace(tmp, path)

    def _run(self, target, name: str, world_size: int, inputs: list, options: dict, deadline) -> dict:
        timeout = options["timeout"]
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
        user = reader(kernel_pid)
        try:
            before = wire.snapshot(inside, user=user)
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
            before, why = None, str(exc)
        capture, not_captured = None, NOT_ASKED
        if options.get("timeline"):  # the data's times from the wire, for a test that asked for them
            try:
                capture = Capture(inside).start()
            except (RuntimeError, OSError) as exc:
                not_captured = str(exc)[:300]
        code = (
            "__import__('disttrain_lab.exercise', fromlist=['serve']).serve("
            f"{kernel_dir + '/' + request.name!r}, {kernel_dir + '/' + record.name!r})"
        )
        wait = timeout + REPLY_MARGIN
        if isinstance(deadline, (int, float)):  # an answer after the cell's limit is no use
            wait = min(wait, deadline - time.monotonic() - 1.0)
        try:
            reply = self._execute(client, code, wait, settings.get("kernel_pid"))
            if reply is None:
                return _error(
                    "ExerciseTimeout",
                    f"{name} did not finish within {timeout:g} s, and the student's kernel did not answer for "
                    f"{wait:.0f} s (it is restarted after this test)",
                )
            if reply == "dead":
                return _error(
                    "ExerciseError",
                    f"the kernel died while running {name} (os._exit / crash / out of memory); "
                    "it is restarted after this test",
                )
            rec = _read_record(record)
        finally:
            segments = None
            if capture is not None:
                try:
                    segments = capture.stop()
                except RuntimeError as exc:
                    not_captured = str(exc)[:300]
            for path in (request, record):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if "error" in rec:
            return rec
        for claimed in ("matrix", "unobserved", "timeline", "timeline_unobserved"):  # (only the grader's own)
            rec.pop(claimed, None)
        in_pid_ns = sandbox.namespace_process(kernel_pid, "pid") if kernel_pid else None
        pids = host_pids(rec.get("pids"), in_pid_ns, user) if in_pid_ns is not None else None
        if pids is None or len(pids) != world_size:
            return _error(
                "ExerciseError",
                f"{name}: the ranks that ran it could not be found (their process ids were not "
                "the student's kernel's own)",
            )
        try:
            if before is None:
                raise RuntimeError(why)
            after, owner = wire.snapshot(inside, user=user), wire.owners(pids, user)
            rec["matrix"] = wire.traffic(before, after, pids, owner=owner).matrix
            if segments is not None:
                rec["timeline"] = wire.timeline(segments, after, pids, owner).segments
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
            # fail closed: a test that reads the bytes fails (wire.Unobserved); never the ranks' own claim
            rec["unobserved"] = not_captured = str(exc)[:300]
        if "timeline" not in rec:
            rec["timeline_unobserved"] = not_captured
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
