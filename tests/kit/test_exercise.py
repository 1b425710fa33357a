"""dl.exercise.run: a notebook's function run on ranks, read back as data only, with the bytes
between ranks counted by the operating system (disttrain_lab/wire.py), not by the ranks."""

from __future__ import annotations

import ctypes
import gc
import os
import re
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist

import __main__
from disttrain_lab import carried, checks, exercise, hangs, pool, protocol, serving, wire, wiretimeline
from disttrain_lab.devices import plan
from tests.helpers import observed_from_outside

pytestmark = pytest.mark.skipif(wire.available() is not None, reason=str(wire.available()))


def _ping_pong(x, repeats):
    rank = dist.get_rank()
    for _ in range(repeats):
        if rank == 0:
            dist.send(x, dst=1)
            dist.recv(x, src=1)
        elif rank == 1:
            dist.recv(x, src=0)
            dist.send(x, dst=0)
    return x


def _forged(x, repeats):
    """Rank 1 'receives' without anything being sent: the data is made up locally, and the
    trace is padded with the sends and receives the test wants to see."""
    from disttrain_lab import trace

    if dist.get_rank() == 1:
        x = torch.arange(float(x.numel()))
    return x, trace  # (the trace module: not data)


def _made_up(x, repeats):
    return torch.arange(float(x.numel())) if dist.get_rank() == 1 else x


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/disttrain-exercise-evil",))


class _NotData:
    pass


def _evil(x, repeats):
    return _NotData()


def _stuck(x, repeats):
    if dist.get_rank() == 1:
        dist.recv(x, src=0)  # rank 0 never sends
    return x


def _others_inputs(x):
    """No communication: every value this rank can find in its process, other than its own input,
    that is another rank's input (each rank's input is filled with 1000 + its rank)."""
    mine = float(x[0])
    seen = set()
    for obj in gc.get_objects():  # what the caller's frames and everything else hold
        items = obj if isinstance(obj, (list, tuple)) else ()
        for item in items[:64]:
            for t in item if isinstance(item, tuple) else (item,):
                if isinstance(t, torch.Tensor) and t.numel() == x.numel() and float(t[0]) >= 1000:
                    seen.add(float(t[0]))
    return sorted(seen - {mine})


@pytest.fixture(autouse=True)
def notebook_functions(monkeypatch):
    """The functions above, as if a notebook's cells had defined them."""
    for fn in (_ping_pong, _forged, _made_up, _evil, _stuck, _others_inputs):
        monkeypatch.setattr(__main__, fn.__name__.lstrip("_"), fn, raising=False)
    for name, module in (("torch", torch), ("dist", dist)):  # what a lab's set-up cell imports
        monkeypatch.setattr(__main__, name, module, raising=False)
    yield


def _drive_ping_pong(numel, repeats):
    """A test's driver: builds the input in the rank, calls the notebook's function by name."""
    x = torch.arange(float(numel)) if dist.get_rank() == 0 else torch.zeros(numel)
    return ping_pong(x, repeats).sum().item()  # noqa: F821  (the notebook's, when it runs)


def _inputs(numel: int, repeats: int):
    return [(torch.arange(float(numel)), repeats), (torch.zeros(numel), repeats)]


def test_a_rank_holds_no_other_ranks_inputs():
    """#42: each rank is sent its own inputs alone (``launcher.PerRank``), on ranks forked before the
    inputs existed (under grading the grader's ``prepare`` comm forks them before its request is
    sent: ``serving.prepare``), so a rank that searches its own process finds no other rank's
    input, and a collective cannot be computed with none of its data on the wire."""
    pool.prepare(2, plan(2))  # what the grader's prepare comm does
    with pool.prepared_only():  # what serving does with the request after it
        run = exercise.run("others_inputs", 2, [(torch.full((7,), 1000.0 + r),) for r in range(2)], timeout=30)
    assert run.results == [[], []], f"each rank found the other's input in its own process: {run.results}"
    pool.shutdown()
    with pool.prepared_only(), pytest.raises(exercise.ExerciseError, match="no warm ranks for a run of 2"):
        exercise.run("others_inputs", 2, [(torch.zeros(7),) for r in range(2)], timeout=30)


def test_results_come_back_as_data_and_the_os_counts_each_pair():
    run = exercise.run("ping_pong", 2, _inputs(4096, 3), timeout=30)
    checks.assert_close(run.results[1], torch.arange(4096.0), what="rank 1")
    assert run.traffic.source == "os"
    payload = 3 * 4096 * 4
    checks.assert_traffic(run, {(0, 1): payload, (1, 0): payload}, "ping_pong")
    assert run.trace.bytes_sent(0) == payload  # the ranks' own account agrees
    assert [e.op for e in run.trace.by_rank(0) if e.kind == "p2p"] == ["send", "recv"] * 3
    checks.assert_close(run.inputs_after[1][0], torch.arange(4096.0), what="rank 1's x after the call")


def _numpy_values(scale):
    import numpy as np

    return [np.float64(scale), np.int64(3), np.arange(3.0) * scale, {"x": (np.float32(0.5), np.array(2.0))}]


def _through_the_store(x):
    """Rank 0 hands its tensor to rank 1 through the launcher's store (the process groups' rendezvous)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    if dist.get_rank() == 0:
        store.set("passed", x.numpy().tobytes())
        return x
    return torch.frombuffer(bytearray(store.get("passed")), dtype=x.dtype)


def _many_groups(x):
    import torch.distributed as dist

    for _ in range(20):  # (20 groups: about 20 KB of the store's traffic per rank)
        dist.all_reduce(x, group=dist.new_group(list(range(dist.get_world_size()))))
    return x


def test_what_passes_through_the_store_is_counted_against_the_ranks():
    """#42: the ranks' connections to the launcher's store (it makes their process groups, and lives in the
    kernel) are counted apart; beyond what making the groups takes (about 1 KB each), the bytes a test reads
    raise ``wire.OffTheWire``: 1 MiB passed through it is seen, an honest run with 20 new groups is not."""
    x = [(torch.arange(262144.0),), (torch.zeros(262144),)]
    run = exercise.run(_through_the_store, 2, x, timeout=30)
    checks.assert_close(run.results[1], torch.arange(262144.0), what="rank 1")  # it got there ...
    outside = run.traffic.outside
    assert run.traffic.source == "os" and min(outside) > 1 << 20, outside  # ... as the OS counted
    with pytest.raises(
        wire.OffTheWire, match=r"rank 0: 1,04\d,\d{3} bytes, at most 278,528 allowed"
    ):  # (the launch's own group: one pair)
        run.traffic.sent(0)
    run = exercise.run(_many_groups, 2, [(torch.ones(4),)] * 2, timeout=60)
    assert max(run.traffic.outside) < wire.OUTSIDE_BASE and run.traffic.sent(0) > 0, run.traffic.outside
    assert (
        run.traffic.allowed == [wire.OUTSIDE_BASE + 21 * wire.OUTSIDE_PER_CONNECTION] * 2
    )  # 20 pairs, and the launch's


def test_numpys_numbers_and_arrays_come_back_as_data():
    """#41: a list of numpy float64 values (a prediction, a measured list) is data, not refused:
    numbers come back as Python's, arrays as tensors (numpy's own types are not in a record)."""
    run = exercise.run(_numpy_values, 2, (2.0,), timeout=30)
    value, count, array, nested = run.results[1]
    assert (type(value), value, type(count), count) == (float, 2.0, int, 3)
    checks.assert_close(array, torch.tensor([0.0, 2.0, 4.0], dtype=torch.float64), what="the array")
    assert type(nested["x"][0]) is float and type(nested["x"][1]) is float
    assert serving.as_data([("kept", None)]) == [("kept", None)]
    assert type(serving.as_data([torch.Size([2, 3])])[0]) is torch.Size


def test_a_driver_runs_next_to_the_notebooks_code_from_its_source():
    run = exercise.run(_drive_ping_pong, 2, (1024, 2), timeout=30)
    assert run.results == [float(sum(range(1024)))] * 2
    checks.assert_traffic(run, {(0, 1): 2 * 4096, (1, 0): 2 * 4096}, "driver")
    assert run.backend == "gloo"
    again = exercise.run(_drive_ping_pong, 2, (8, 1), timeout=30)  # a driver runs any number of times
    assert again.results == [float(sum(range(8)))] * 2
    assert not hasattr(__main__, "_drive_ping_pong")  # ... without being defined among the notebook's names
    with pytest.raises(ValueError, match="defined at the top level"):
        exercise.run(lambda: 1, 2)


def _drive_with_regions(numel, repeats):
    """A test's driver that marks its own stretches of work (as lab 10's ring marks each block)."""
    from disttrain_lab import trace

    with trace.region("block", not_data=object()):  # meta that is not data stays in the rank
        x = torch.arange(float(numel)) if dist.get_rank() == 0 else torch.zeros(numel)
        return ping_pong(x, repeats).sum().item()  # noqa: F821  (the notebook's, when it runs)


def test_the_students_own_regions_come_back_named_without_their_meta():
    run = exercise.run(_drive_with_regions, 2, (8, 1), timeout=30)
    regions = [e for e in run.trace.events if e.kind == "region"]
    assert sorted((e.rank, e.name, e.meta) for e in regions) == [(0, "block", {}), (1, "block", {})]  # not "student"
    first_send = next(e for e in run.trace.by_rank(0) if e.op == "send")
    assert regions[0].start <= first_send.start <= regions[0].end  # on the same clock as the calls


def test_a_result_made_up_without_sending_fails_on_the_counted_bytes():
    run = exercise.run("made_up", 2, _inputs(4096, 1), timeout=30)
    checks.assert_close(run.results[1], torch.arange(4096.0), what="rank 1")  # the values are right ...
    with pytest.raises(AssertionError, match="operating system counted"):  # ... but nothing moved
        checks.assert_traffic(run, {(0, 1): 4096 * 4, (1, 0): 4096 * 4}, "made_up")


def test_what_is_not_data_is_an_error_and_never_unpickled(tmp_path):
    marker = "/tmp/disttrain-exercise-evil"
    if os.path.exists(marker):
        os.unlink(marker)
    with pytest.raises(exercise.ExerciseError, match="rank 0 returned _NotData"):
        exercise.run("evil", 2, _inputs(4, 1), timeout=30)
    with pytest.raises(exercise.ExerciseError, match="returned tuple"):
        exercise.run("forged", 2, _inputs(4, 1), timeout=30)
    assert not os.path.exists(marker)
    # a record written by anyone else is read as data only, too
    import io
    import pickle

    buffer = io.BytesIO()
    torch.save({"version": 1, "results": [_Evil(), 1]}, buffer, pickle_module=pickle)
    record = protocol.Record.from_bytes(buffer.getvalue(), 2)
    assert record.failure is not None and "could not be read as plain data" in record.failure.message
    assert not os.path.exists(marker)


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_errors_and_timeouts_say_what_happened():
    with pytest.raises(exercise.ExerciseTimeout, match="did not finish within 3 s"):
        exercise.run("stuck", 2, _inputs(4, 1), timeout=3)
    with pytest.raises(exercise.ExerciseError, match="no function named 'nowhere'"):
        exercise.run("nowhere", 2)
    with pytest.raises(ValueError, match="one tuple of arguments per rank"):
        exercise.run("ping_pong", 3, _inputs(4, 1))


def _record_bytes(**fields) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save({"version": 1, **fields}, buffer)
    return buffer.getvalue()


GOOD = {"results": [1, 2], "inputs_after": [[], []], "events": [], "pids": [11, 12], "backend": "gloo", "failure": None}
EVENT = dict(
    rank=0, op="send", kind="p2p", start=0.0, end=1e-4, peer=1, group=None, bytes=40, tag=None, name="", meta={}
)


@pytest.mark.parametrize(
    "changes, said",
    [
        ({"results": [1]}, "one result per rank"),
        ({"inputs_after": [[]]}, "arguments after the call"),
        ({"events": [("not", "an", "event")]}, "an event must hold exactly the fields"),
        ({"events": [("rank", 0, "send", "p2p", 0.0, 1e-4, 1, None, 40, None, "", {})]}, "exactly the fields"),
        ({"events": [{**EVENT, "rank": 5}]}, "wrong types"),  # a rank that does not exist
        ({"events": [{**EVENT, "bytes": -40}]}, "wrong types"),
        ({"events": [{**EVENT, "start": float("nan")}]}, "wrong types"),
        ({"pids": [0, -1]}, "process ids"),
        ({"matrix": [[0, 10**9], [10**9, 0]]}, "fields a Record does not have: matrix"),  # the grader's own count
        ({"timeline": [(0.0, 0, 1, 88)]}, "fields a Record does not have: timeline"),
        ({"version": 0}, "protocol version 0"),
        ({"failure": {"kind": "Passed", "message": "all good"}}, "failure's kind must be one of"),
    ],
)
def test_records_that_do_not_hold_a_run_are_refused(changes, said):
    record = protocol.Record.from_bytes(_record_bytes(**{**GOOD, **changes}), 2)
    assert record.failure is not None and record.failure.kind == "ExerciseError", record
    assert "no valid record" in record.failure.message and said in record.failure.message, record.failure.message
    with pytest.raises(exercise.ExerciseError, match="no valid record"):
        exercise.from_record("f", 2, record, protocol.Evidence.unobserved("no run"))


def test_a_valid_record_reads_back_as_named_fields():
    record = protocol.Record.from_bytes(_record_bytes(**{**GOOD, "events": [EVENT]}), 2)
    assert record.failure is None and record.results == [1, 2] and record.pids == (11, 12)
    assert record.events[0].op == "send" and record.events[0].peer == 1 and record.events[0].bytes == 40
    assert protocol.Record.from_bytes(record.to_bytes(), 2) == record  # the same bytes both ways
    assert protocol.Record.from_bytes(b"x" * (protocol.MAX_RECORD_BYTES + 1), 2).failure.message.endswith(
        f"more than {protocol.MAX_RECORD_BYTES:,}"
    )


def test_a_request_crosses_as_data_and_is_checked_at_both_ends():
    request = protocol.Request(
        target=protocol.Driver("_drive", "def _drive():\n    return 1\n"),
        world_size=2,
        inputs=[(torch.ones(3), 1), (torch.zeros(3), 1)],
        timeout=5.0,
        network={"latency": 1e-3, "bandwidth": 1e9},
        timed_out={"f": "f hung in test_f"},
        student_functions=["f"],
    )
    again = protocol.Request.from_bytes(request.to_bytes())
    assert again.target == request.target and again.name == "_drive" and again.timed_out == request.timed_out
    assert again.student_functions == ("f",) and torch.equal(again.inputs[0][0], torch.ones(3))
    for bad, said in (
        ({"world_size": 0}, "world_size must be an int >= 1"),
        ({"inputs": [(1,)]}, "one tuple per rank"),
        ({"timeout": float("inf")}, "timeout must be a positive number"),
        ({"target": "os.system"}, "target must be a function's name"),
    ):
        with pytest.raises(protocol.ProtocolError, match=said):
            request.replace(**bad)


SS_OUTPUT = b"""\
0      0               127.0.0.1:44671          127.0.0.1:34618 ino:2001 sk:1 cgroup:/grader <->
\t bbr wscale:10,10 bytes_sent:819632 bytes_retrans:32768 bytes_acked:786604 bytes_received:786872 segs_out:36
0      0               127.0.0.1:34618          127.0.0.1:44671 ino:1001 sk:2 cgroup:/grader <->
\t bbr wscale:10,10 bytes_sent:786872 bytes_acked:786873 bytes_received:786864 segs_out:37
0      0      [::ffff:127.0.0.1]:29533 [::ffff:127.0.0.1]:49646 ino:501 sk:3 cgroup:/grader <->
\t bbr bytes_sent:576 bytes_acked:576 bytes_received:586
0      0      [::ffff:127.0.0.1]:49646 [::ffff:127.0.0.1]:29533 ino:2002 sk:4 cgroup:/grader <->
\t bbr bytes_sent:626 bytes_received:576
"""


def test_ss_output_is_read_per_connection_and_only_between_ranks():
    sockets = wire.parse(SS_OUTPUT)
    assert sockets[("127.0.0.1:34618", "127.0.0.1:44671")].received == 786864
    owner = {1001: 10, 2001: 20, 2002: 20, 501: 5}  # socket inode -> pid, as /proc/<pid>/fd says
    moved = wire.traffic({}, sockets, pids=[10, 20], owner=owner)
    assert moved.matrix == [[0, 786872], [786864, 0]]  # the store (pid 5) is not a rank
    before = {k: wire.Socket(s.inode, s.local, s.peer, s.received - 100) for k, s in sockets.items()}
    assert wire.traffic(before, sockets, pids=[10, 20], owner=owner).matrix == [[0, 100], [100, 0]]


def test_a_line_ss_printed_that_is_not_a_socket_fails_the_count():
    for broken in (SS_OUTPUT + b"pid=7 bytes_received:99999\n", SS_OUTPUT.replace(b"ino:1001 ", b"")):
        with pytest.raises(RuntimeError, match="not a socket"):
            wire.parse(broken)


HOSTILE_NAMES = ["pid=1 fd=3", "a\nbytes_recv:9", 'x",pid=7,fd=3']


def _named_peer(name: str, port: int, payload: int) -> int:
    """A child process named ``name`` (prctl PR_SET_NAME: what `ss -p` would print) that connects
    to ``port`` and sends ``payload`` bytes, then waits to be killed; its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name.encode()), 0, 0, 0)
            conn = socket.create_connection(("127.0.0.1", port))
            conn.sendall(b"x" * payload)
            time.sleep(60)
        finally:
            os._exit(0)
    return pid


def test_a_process_name_can_neither_move_nor_hide_its_bytes():
    # a rank names itself so that `ss -p`'s owner field lies or breaks the line: the count comes from
    # the sockets' inodes in each rank's /proc/<pid>/fd, so every byte lands on the rank that sent it
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(len(HOSTILE_NAMES))
    before = wire.snapshot()
    children = [_named_peer(name, server.getsockname()[1], 1000 * (i + 1)) for i, name in enumerate(HOSTILE_NAMES)]
    try:
        accepted = []
        for _ in children:  # every byte read off each connection before the count
            conn, _ = server.accept()
            accepted.append(conn)  # (kept open: a closed connection is no longer counted)
            conn.settimeout(0.5)
            try:
                while conn.recv(65536):
                    pass
            except TimeoutError:  # (the sender stays connected: nothing more came)
                pass
        moved = wire.traffic(before, wire.snapshot(), [os.getpid(), *children])
        assert [moved.between(1 + i, 0) for i in range(len(children))] == [1000, 2000, 3000], moved.describe()
        assert moved.sent(0) == 0
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        server.close()


def test_a_rank_whose_sockets_cannot_be_read_fails_the_count():
    with pytest.raises(RuntimeError, match=r"/proc/<pid>/fd"):
        wire.owners([2**22 + 12345])  # no such process (pid_max is at most 2**22)


def test_an_unobserved_count_fails_every_test_that_reads_it_and_says_why():
    record = protocol.Record.from_bytes(_record_bytes(**GOOD), 2)
    run = exercise.from_record("f", 2, record, protocol.Evidence.unobserved("ss: not found"))
    assert run.traffic.source == "unobserved" and run.results == [1, 2]  # the results still grade
    for read in (lambda t: t.sent(0), lambda t: t.between(0, 1), lambda t: t.describe(), lambda t: t.total):
        with pytest.raises(wire.Unobserved, match=r"could not count the bytes between the ranks \(ss: not found\)"):
            read(run.traffic)
    with pytest.raises(wire.Unobserved):
        checks.assert_traffic(run, {(0, 1): 5, (1, 0): 5}, "f")


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_a_timeout_names_the_functions_the_ranks_were_in_and_a_timed_out_function_stops_at_once(monkeypatch):
    # under grading (disttrain_lab/grading/remote.py): the record of a timeout names the notebook's functions
    # the stuck ranks were in, and a function that timed out in an earlier test is not waited for again: on
    # the ranks it raises at once, with what happened then, wherever it is called from (here: a driver)
    request = protocol.Request(target="stuck", world_size=2, inputs=_inputs(4, 1), timeout=3.0)
    stuck = serving.run(request).failure
    assert stuck.kind == "ExerciseTimeout" and "_stuck" in stuck.running, stuck
    assert "rank 1: recv(src=0" in stuck.message and "in _stuck (line" in stuck.message, stuck.message
    original = __main__.ping_pong
    not_again = request.replace(
        target=exercise._driver(_drive_ping_pong),
        inputs=[(8, 1)] * 2,
        timeout=30.0,
        timed_out={"ping_pong": "ping_pong timed out in test_x"},
    )
    error = serving.run(not_again).failure
    assert error.kind == "ExerciseTimeout" and error.skipped, error
    assert "was stopped at once: ping_pong timed out in test_x" in error.message, error
    assert __main__.ping_pong is original  # put back for the notebook
    assert exercise.run(_drive_ping_pong, 2, (8, 1), timeout=30).results == [28.0, 28.0]
    # the grader's run of a test in the student's kernel under autograding: a student's function that ran past
    # the timeout is replaced in the kernel too, so that cells calling it there (not on ranks) stop at once
    monkeypatch.setattr(hangs, "_GRADING", True)
    monkeypatch.setattr(hangs, "_HUNG", {})
    monkeypatch.setattr(__main__, "spinner", None, raising=False)  # (removed after the test)
    exec("def spinner(x, repeats):\n    while True:\n        pass\n", vars(__main__))  # as a cell defines it
    graded = request.replace(target="spinner", student_functions=["spinner", "ping_pong"])
    error = serving.run(graded).failure
    # (the loop's two lines, `while True:` and `pass`: the stack is sampled on either)
    assert "running Python code" in error.message and re.search(r"in spinner \(line [23]\)", error.message), error
    with pytest.raises(hangs.SkippedAfterHang, match="spinner is not run again: when a graded test ran it"):
        __main__.spinner(None, 1)  # in the kernel itself, at once


def _batched(x, repeats):
    """Not a ping-pong: rank 0 sends every message before rank 1 answers any: the same bytes
    between the same ranks, the same result (a trace is the ranks' to rewrite as round trips)."""
    rank = dist.get_rank()
    copies = [x.clone() for _ in range(repeats)]
    for c in copies:
        dist.send(c, dst=1) if rank == 0 else dist.recv(c, src=0)
    for c in copies:
        dist.recv(c, src=1) if rank == 0 else dist.send(c, dst=0)
    return copies[-1]


@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_the_wire_shows_round_trips_that_a_batched_exchange_does_not_have():
    # what crossed, when, between which ranks: the grader's packet capture (grading/capture.py) read with the
    # sockets' owners, as remote.py does; a batched exchange (whose trace a rank could rewrite) is told apart
    from disttrain_lab import pool
    from disttrain_lab.grading.capture import Capture

    __main__.batched = _batched
    found = {}
    for name in ("ping_pong", "batched"):
        exercise.run(name, 2, _inputs(64, 1), timeout=30)  # the ranks' connections made before the capture
        before = wire.snapshot()
        with Capture() as capture:
            run = exercise.run(name, 2, _inputs(4096, 3), timeout=30)
        pids = pool.worker_pids()[:2]
        after, owner = wire.snapshot(), wire.owners(pids)
        found[name] = wiretimeline.timeline(capture.segments, after, pids, owner)
        checks.assert_close(run.results[1], torch.arange(4096.0), what=f"{name}: rank 1")
        counted = wire.traffic(before, after, pids, owner=owner)
        for src, dst in ((0, 1), (1, 0)):  # the capture sees what the OS counted, gloo's headers and all
            assert found[name].bytes(src, dst) == counted.between(src, dst) >= 3 * 16384, (found[name], counted)
    assert found["ping_pong"].directions() == [(0, 1), (1, 0)] * 3, found["ping_pong"].segments
    assert found["batched"].directions() == [(0, 1), (1, 0)], found["batched"].segments
    del __main__.batched


def _zeros_on_the_wire(x, repeats):
    """A ping-pong's messages, in its order and of its size, that carry zeros, not x."""
    rank, junk = dist.get_rank(), torch.zeros_like(x)
    for _ in range(repeats):
        if rank == 0:
            dist.send(junk, dst=1)
            dist.recv(junk, src=1)
        else:
            dist.recv(junk, src=0)
            dist.send(junk, dst=0)
    return x


@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_the_wire_must_carry_the_data_itself():
    """#42: the capture keeps what each connection carried; a run whose messages have the right sizes
    and order but not the data (which reached the other rank some other way) fails assert_carried."""
    __main__.zeros_on_the_wire = _zeros_on_the_wire
    x = torch.arange(4096.0)
    try:
        with observed_from_outside():
            honest = exercise.run("ping_pong", 2, _inputs(4096, 3), timeout=30, content=True)
            junk = exercise.run("zeros_on_the_wire", 2, _inputs(4096, 3), timeout=30, content=True)
        own = exercise.run("zeros_on_the_wire", 2, _inputs(64, 1), timeout=30, content=True)
    finally:
        del __main__.zeros_on_the_wire
    assert honest.timeline.source == junk.timeline.source == "wire"
    carried.assert_carried(honest, {(0, 1): [x] * 3, (1, 0): [x] * 3}, "ping_pong")
    checks.assert_traffic(junk, {(0, 1): 3 * x.numel() * 4, (1, 0): 3 * x.numel() * 4}, "zeros")  # sizes right
    assert junk.timeline.directions() == [(0, 1), (1, 0)] * 3  # order right
    with pytest.raises(AssertionError, match=r"from rank 0 to rank 1 should carry 3 message\(s\).*found 0 of them"):
        carried.assert_carried(junk, {(0, 1): [x] * 3}, "zeros")
    assert junk.timeline.carries(0, 1, [torch.zeros(4096).numpy().tobytes()] * 3) == 3  # what it did carry
    # in the student's own kernel there is no capture: nothing to check, and nothing fails
    assert own.timeline.source == "trace"
    carried.assert_carried(own, {(0, 1): [torch.arange(64.0)]}, "zeros, in the student's kernel")


def test_the_students_own_run_shows_the_traces_sends_as_its_timeline():
    # no grader in the student's kernel: a self-check reads the order of the ranks' traced sends (a picture, not a grade)
    run = exercise.run("ping_pong", 2, _inputs(10, 3), timeout=30, timeline=True)
    assert run.timeline.source == "trace" and run.timeline.directions() == [(0, 1), (1, 0)] * 3
    # rank 0's three sends (a note when posted, then the data) and its three receives' notes, as gloo sends them
    assert run.timeline.bytes(0, 1) == 3 * (wire.GLOO_PREAMBLE + (wire.GLOO_PREAMBLE + 40) + wire.GLOO_PREAMBLE)
