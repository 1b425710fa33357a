"""The grader kernel's side of a graded test: the test's code, its references and its
comparisons run here, in a kernel that never executes student code; the student's function
runs in the student's (sandboxed) kernel, and only data comes back.

``RobustExecute`` starts the grader kernel, runs the lab's locked set-up cells in it, then
``install(settings_path)``.  From then on ``dl.exercise.run(name, n, inputs)`` in a test
cell here makes a ``protocol.Request`` and:

1. reads every TCP socket of the student's network namespace (``wire.snapshot``, from
   outside: ``nsenter`` + ``ss``, no process names parsed);
2. opens a comm on ``protocol.COMM_TARGET`` in the student's kernel, over its own Jupyter
   channels, with the request's bytes as its buffer (``serving.py`` answers it there: one comm
   message, whose buffer is the record's bytes); no source text is evaluated.  Before step 1
   a comm that asks the kernel to ``prepare`` forks the ranks the run will use, so that no rank
   is forked holding the request (every rank's inputs) in its copy of the kernel's memory; the
   request then runs only on those ranks (a kernel that would fork anew answers ``NotPrepared``:
   prepared again and resent once, then the test fails), each rank sent its own inputs alone;
3. reads the sockets again: the bytes between the ranks' processes are the launch's traffic,
   counted by the OS (the test's references run in their own launches, here); where the test
   asked for it (``timeline=True``), a packet capture in the student's network namespace ran
   from step 1 to here (``capture.py``): when each segment crossed, between which ranks;
4. reads the record as data only (``protocol.Record.from_bytes``: at most
   ``protocol.MAX_RECORD_BYTES``, ``torch.load(weights_only=True)``, every field checked), and
   gives the test its own ``protocol.Evidence``: the count of step 3, the sockets given to ranks by
   the inodes in their ``/proc/<pid>/fd``, and the capture.  Where step 1 or 3 fails, the traffic
   is *unobserved*: a test that reads it fails with the reason (``wire.Unobserved``); the ranks'
   own trace is never used.

The ranks' process ids in the record are the student's claim; each must name a process of
the student's own sandbox (its pid namespace), so a forged id can only relabel the student's
own ranks.  Settings (the student kernel's connection file, its process, in its namespaces) are rewritten
by ``RobustExecute`` whenever the student's kernel is (re)started.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from queue import Empty

from jupyter_client.blocking import BlockingKernelClient

from disttrain_lab import confine, exercise, osmemory, wire, wiretimeline
from disttrain_lab.gate import Seen
from disttrain_lab.grading import gatewatch, reaper, sandbox
from disttrain_lab.grading.capture import Capture
from disttrain_lab.grading.handoff import CELL_FILE, TIMED_OUT_FILE, read_json
from disttrain_lab.hangs import MIN_LAUNCH, REPORT_MARGIN
from disttrain_lab.protocol import COMM_TARGET, PREPARE, Evidence, Failure, Record, Request

__all__ = ["install", "RemoteRunner", "host_pids", "reader"]

NOT_ASKED = "not asked for: dl.exercise.run(..., timeline=True) captures it"
REPLY_MARGIN = 60.0  # seconds past the launch's own timeout before the student's kernel is given up
# seconds before the cell's limit that waiting for the student's kernel ends, left for the grader to
# say why (1 s was too little on a loaded host: the cell's own limit interrupted the report)
GIVE_UP_MARGIN = 2.0


def install(settings_path: str) -> None:
    """Make ``dl.exercise.run`` in this (the grader's) kernel run in the student's kernel."""
    exercise.use_runner(RemoteRunner(Path(settings_path)))


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
    found = _in_namespace(namespace)
    mapped = [found.get(p) for p in claimed]
    return None if None in mapped or len(set(mapped)) != len(mapped) else mapped


def _in_namespace(namespace: str) -> dict[int, int]:
    """Every process in the pid namespace ``namespace`` (``/proc/<pid>/ns/pid``'s link): its id there ->
    its host id."""
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
    return found


def student_processes(kernel_pid: int, inside: int | None) -> list[int]:
    """The host ids of every process of the student's: those in the pid namespace of process
    ``inside`` where it has its own, else the kernel and every process below it."""
    try:
        namespace = os.readlink(f"/proc/{inside}/ns/pid") if inside is not None else None
    except OSError:
        namespace = None
    if namespace is not None and namespace != os.readlink("/proc/self/ns/pid"):
        return sorted(_in_namespace(namespace).values())
    return [kernel_pid, *reaper.descendants(kernel_pid)]


def _not_again(function: str, what: dict) -> str:
    """Why ``function`` is not run again under grading, with what happened when it timed out."""
    return (
        f"{function} is not run again: it did not finish when the graded test {what.get('cell')} ran it, and "
        f"grading waits for a function that hangs only once. What happened then:\n{what.get('message')}"
    )


def _unanswered(name: str, answer: str | None, timeout: float, wait: float) -> tuple[Record, Evidence]:
    """The failure for a comm the student's kernel did not answer (``RemoteRunner._ask``'s None,
    "dead", or why)."""
    if answer is None:
        return _failed(
            "ExerciseTimeout",
            f"{name} did not finish within {timeout:g} s, and the student's kernel did not answer for "
            f"{wait:.0f} s (it is restarted after this test)",
        )
    if answer == "dead":
        return _failed(
            "ExerciseError",
            f"the kernel died while running {name} (os._exit / crash / out of memory); it is restarted after this test",
        )
    return _failed("ExerciseError", str(answer))


def _failed(kind: str, message: str, **details) -> tuple[Record, Evidence]:
    return Record.failed(kind, message, **details), Evidence.unobserved("the run failed")


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
            client.start_channels(shell=True, iopub=True, stdin=False, hb=True, control=False)
            self.client, self.connection = client, connection_file
            self._subscribed(client)
        return self.client

    @staticmethod
    def _subscribed(client: BlockingKernelClient, timeout: float = 30.0) -> None:
        """Wait until the iopub channel hears the kernel (a message it publishes for a request of
        ours), so that no answer is published before this end listens."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg_id = client.kernel_info()
            until = time.monotonic() + 1.0
            while time.monotonic() < until:
                try:
                    msg = client.get_iopub_msg(timeout=0.2)
                except Empty:
                    continue
                if msg.get("parent_header", {}).get("msg_id") == msg_id:
                    return

    def __call__(self, request: Request, gate: list | None = None) -> tuple[Record, Evidence]:
        """One run in the student's kernel, within what is left of the test cell's limit: the
        launch's timeout is capped so that a hang ends with the launcher's own report (which rank,
        blocked in what) before the cell is interrupted; a function of the student's that timed out
        in an earlier test is not run again (its message is given at once)."""
        name = request.name
        cell = read_json(self.settings_path.parent / CELL_FILE)
        timed_out = read_json(self.settings_path.parent / TIMED_OUT_FILE)
        if isinstance(request.target, str) and name in timed_out:
            return _failed("ExerciseTimeout", _not_again(name, timed_out[name]))
        deadline = cell.get("deadline")
        if isinstance(deadline, (int, float)):
            left = deadline - time.monotonic()
            if left - REPORT_MARGIN < MIN_LAUNCH:
                return _failed(
                    "ExerciseTimeout",
                    f"{name} was not run: this test had {left:.0f} s left of its time limit when graded "
                    "(earlier runs in it used the rest)",
                )
            if left - REPORT_MARGIN < request.timeout:
                request = request.replace(
                    timeout=round(left - REPORT_MARGIN, 1),
                    why=f"what was left of this test's time limit when graded; the test allows {request.timeout:g} s",
                )
        request = request.replace(
            timed_out={n: _not_again(n, what) for n, what in timed_out.items()},
            student_functions=[str(f) for f in cell.get("student_functions") or []],
        )
        record, evidence = self._run(request, deadline, gate)
        failure = record.failure
        if failure is not None and failure.kind == "ExerciseTimeout" and not failure.skipped:
            self._remember(name, request.target, failure, cell, timed_out)
        return record, evidence

    def _remember(self, name: str, target, failure: Failure, cell: dict, timed_out: dict) -> None:
        """Note the student's function that timed out (the innermost of the student's functions the
        stuck ranks were in; else the target itself when it is one of them)."""
        student = set(cell.get("student_functions") or [])
        running = list(failure.running)
        if isinstance(target, str):
            running.append(target)
        culprit = next((f for f in running if f in student), None)
        if culprit is None or culprit in timed_out:
            return
        timed_out[culprit] = {"cell": str(cell.get("grade_id", "an earlier test")), "message": failure.message}
        path = self.settings_path.parent / TIMED_OUT_FILE
        tmp = path.with_suffix(".partial")
        tmp.write_text(json.dumps(timed_out))
        os.replace(tmp, path)

    def _run(self, request: Request, deadline, gate: list | None = None) -> tuple[Record, Evidence]:
        """Prepare the ranks, then run on them; once more where the kernel had to fork anew."""
        settings = json.loads(self.settings_path.read_text())
        client = self._client(settings["connection_file"])
        kernel_pid = settings.get("kernel_pid")
        for _ in range(2):
            wait = request.timeout + REPLY_MARGIN
            if isinstance(deadline, (int, float)):
                wait = min(wait, deadline - time.monotonic() - GIVE_UP_MARGIN)
            fields = {
                "world_size": request.world_size,
                "device": request.device,
                "fresh": request.memory,
                "writable": request.writable,
            }
            answer = self._ask(client, None, wait, kernel_pid, data={PREPARE: fields})
            if not isinstance(answer, dict):
                return _unanswered(request.name, answer, request.timeout, wait)
            if answer.get("prepared") is not True:
                return _failed(
                    "ExerciseError",
                    f"{request.name} was not run: the student's kernel could not start its ranks "
                    f"({str(answer.get('why'))[:500]})",
                )
            prepared = answer.get("pids")
            record, evidence = self._run_prepared(request, deadline, client, kernel_pid, prepared, gate)
            if record.failure is None or record.failure.kind != "NotPrepared":
                return record, evidence
        return _failed(
            "ExerciseError",
            f"{request.name} was not run: the student's kernel twice started new ranks for it after the request "
            "had arrived (a rank must not hold the other ranks' inputs)",
        )

    def _run_prepared(
        self, request: Request, deadline, client, kernel_pid, prepared, gate: list | None = None
    ) -> tuple[Record, Evidence]:
        name, world_size = request.name, request.world_size
        inside = sandbox.namespace_process(kernel_pid, "net") if kernel_pid else None
        in_pid_ns = sandbox.namespace_process(kernel_pid, "pid") if kernel_pid else None
        user = reader(kernel_pid)
        # in a sandbox (its own pid and mount namespaces), what the student's tmpfs mounts hold counts in each
        # rank's memory: a rank could keep its state in a file there across a reading (stored.stored_bytes)
        stores = in_pid_ns is not None and in_pid_ns != kernel_pid
        keeper, not_gated = None, "not asked for"
        if gate is not None:  # the grader's gate in the ranks' backward (gate.py), for a test that holds one
            ranks = host_pids(prepared, in_pid_ns, user) if in_pid_ns is not None else None
            try:
                if ranks is None or len(ranks) != world_size:
                    raise RuntimeError("the ranks the student's kernel started for the run could not be found")
                keeper = gatewatch.for_ranks(
                    inside, gate, ranks, user, request.timeout, memory=request.memory, stores=stores
                )
                request = request.replace(gate=keeper.start())
            except (RuntimeError, OSError) as exc:
                keeper, not_gated = None, f"the grader's gate could not be opened: {exc}"[:300]
        try:
            before = wire.snapshot(inside, user=user)
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
            before, why = None, str(exc)
        watch, ranks_prepared = None, None
        if request.memory:  # each rank's memory from the OS, at the driver's pause (osmemory.py)
            ranks_prepared = host_pids(prepared, in_pid_ns, user) if in_pid_ns is not None else None
            if ranks_prepared is not None and len(ranks_prepared) == world_size and before is not None:
                watch = osmemory.Watch(
                    ranks_prepared,
                    lambda: (
                        wire.snapshot(inside, user=user),
                        wire.holders(student_processes(kernel_pid, in_pid_ns), user, skip_gone=True),
                    ),
                    user=user,  # (in a container, read as the student's uid: as the wire is)
                    stores=stores,
                ).start()
        capture, not_captured = None, NOT_ASKED
        if request.timeline:  # the data's times from the wire, for a test that asked for them
            try:
                capture = Capture(inside, payloads=request.content).start()
            except (RuntimeError, OSError) as exc:
                not_captured = str(exc)[:300]
        wait = request.timeout + REPLY_MARGIN
        if isinstance(deadline, (int, float)):  # an answer after the cell's limit is no use
            wait = min(wait, deadline - time.monotonic() - GIVE_UP_MARGIN)
        try:
            answer = self._ask(client, request.to_bytes(), wait, kernel_pid)
        finally:
            held = (
                watch.stop()
                if watch is not None
                else osmemory.Held.unobserved(
                    "the ranks the student's kernel started for the run could not be found"
                    if request.memory
                    else "not asked for"
                )
            )
            if keeper is not None:
                keeper.stop()
            segments = None
            if capture is not None:
                try:
                    segments = capture.stop()
                except RuntimeError as exc:
                    not_captured = str(exc)[:300]
        if not isinstance(answer, bytes):
            return _unanswered(name, answer, request.timeout, wait)
        record = Record.from_bytes(answer, world_size)
        if record.failure is not None:
            return record, Evidence.unobserved("the run failed")
        pids = host_pids(list(record.pids), in_pid_ns, user) if in_pid_ns is not None else None
        if pids is None or len(pids) != world_size:
            return _failed(
                "ExerciseError",
                f"{name}: the ranks that ran it could not be found (their process ids were not "
                "the student's kernel's own)",
            )
        try:
            if before is None:
                raise RuntimeError(why)
            if request.device in (None, "cpu"):  # (the CPU's ranks confine themselves: confine.py)
                not_confined = confine.unconfined(pids)
                if not_confined is not None:  # a way off the wire was left open: the wire is not all they said
                    why = f"{not_confined}; the notebook's kernel started or changed the ranks"
                    return record, Evidence.unobserved(why[:300], by_submission=True)
            after, owner = wire.snapshot(inside, user=user), wire.owners(pids, user)
            traffic = wire.traffic(before, after, pids, owner=owner)
            timeline = (
                wiretimeline.timeline(segments, after, pids, owner, capture.payloads if capture.keep_payloads else None)
                if segments is not None
                else wiretimeline.Timeline.unobserved(not_captured)
            )
            memory = osmemory.observed(held, before, watch.extras if watch else [], ranks_prepared, pids, owner)
            seen = (
                keeper.seen(segments, timeline.origin)
                if keeper is not None and segments is not None
                else Seen.unobserved(not_gated if keeper is None else timeline.why)
            )
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
            # fail closed: a test that reads the bytes fails (wire.Unobserved); never the ranks' own claim
            return record, Evidence.unobserved(str(exc)[:300])
        return record, Evidence(traffic=traffic, timeline=timeline, memory=memory, gate=seen)

    def _ask(self, client: BlockingKernelClient, request: bytes | None, timeout: float, pid: int | None, data=None):
        """Open a comm on ``COMM_TARGET`` in the student's kernel with ``request`` as its buffer (or
        none, and ``data``) and wait for its one answer: the record's bytes (the answer's data, a
        dict, where no request was sent); or None (no answer in ``timeout`` s), "dead" (the kernel's
        process ended), or why there is no record (the kernel closed the comm unanswered)."""
        while True:  # what the kernel published before (its cells' output): not ours
            try:
                client.get_iopub_msg(timeout=0)
            except Empty:
                break
        comm_id = uuid.uuid4().hex
        msg = client.session.msg("comm_open", {"comm_id": comm_id, "target_name": COMM_TARGET, "data": data or {}})
        msg["buffers"] = [request] if request is not None else []
        client.shell_channel.send(msg)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = client.get_iopub_msg(timeout=1.0)
            except Empty:
                if pid is not None and reaper.ended(pid):
                    return "dead"
                continue
            content = msg.get("content") or {}
            if not isinstance(content, dict) or content.get("comm_id") != comm_id:
                continue
            kind = msg.get("header", {}).get("msg_type")
            if kind == "comm_msg" and request is None:
                answer = content.get("data")
                return answer if isinstance(answer, dict) else "the student's kernel answered with no data"
            if kind == "comm_msg":
                buffers = msg.get("buffers") or []
                return bytes(buffers[0]) if len(buffers) == 1 else "the student's kernel answered without a record"
            if kind == "comm_close" and request is None:
                return (
                    "the student's kernel closed the grader's request to start its ranks unanswered (is "
                    "disttrain_lab imported there, and is its comm target the kit's own?)"
                )
            if kind == "comm_close":
                return (
                    "the student's kernel did not take the request: disttrain_lab is not imported there "
                    "(its setup cell, `import disttrain_lab as dl`, did not run?)"
                )
        return None
