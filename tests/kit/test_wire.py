"""What the wire shows of gloo's point-to-point messages: the bytes the operating system counts
are exactly ``wire.protocol_bytes`` of the messages sent (so the count fixes their number and
size), a timeline's byte positions say when a direction passed a point, and the student's own
kernel draws its timeline and count from the trace as gloo would put them on the wire."""

from __future__ import annotations

import os
import struct

import pytest
import torch
import torch.distributed as dist

import __main__
import disttrain_lab as dl
from disttrain_lab import checks, exercise, pool, wire, wiretimeline

NOTE = wire.GLOO_PREAMBLE

pytestmark = pytest.mark.skipif(wire.available() is not None, reason=str(wire.available()))


def _ring(flat, posted_early):
    """A ring reduce-scatter: isend then recv each step, or every receive posted up front."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(flat.tensor_split(n))
    steps = [((rank - s - 1) % n, (rank - s - 2) % n) for s in range(n - 1)]
    buffers = [torch.empty_like(chunks[into]) for _, into in steps]
    early = [dist.irecv(b, (rank - 1) % n) for b in buffers] if posted_early else []
    for s, (out, into) in enumerate(steps):
        sending = dist.isend(chunks[out].contiguous(), (rank + 1) % n)
        early[s].wait() if posted_early else dist.recv(buffers[s], (rank - 1) % n)
        chunks[into] += buffers[s]
        sending.wait()
    return chunks[rank].clone()


def _messages(run) -> dict[tuple[int, int], list[int]]:
    found: dict[tuple[int, int], list[int]] = {}
    for send, recv in run.messages():
        found.setdefault((send.rank, recv.rank), []).append(send.bytes)
    return found


@pytest.mark.parametrize("posted_early", [False, True])
@pytest.mark.parametrize("n, numel", [(2, 7), (4, 1001), (3, 40_000)])
def test_the_os_counts_exactly_gloos_protocol(n, numel, posted_early):
    # each message: its payload + 96 bytes one way, 48 the other; gloo's handshake as the launch opens each connection: 8 bytes one way
    dl.launch(_ring, n, torch.ones(numel), posted_early)  # the ranks' connections made before counting
    before = wire.snapshot()
    run = dl.launch(_ring, n, torch.ones(numel), posted_early, trace=True)
    counted = wire.traffic(before, wire.snapshot(), pool.worker_pids()[:n])
    model = wire.protocol_bytes(_messages(run), n)
    for a in range(n):
        for b in range(n):
            assert 0 <= counted.matrix[a][b] - model[a][b] <= wire.HANDSHAKE_BYTES, (a, b, counted.matrix, model)


def test_the_count_fixes_how_many_messages_and_how_big():
    # a run's bytes against the ring's messages, and against one message more and a whole tensor sent
    __main__.ring = _ring
    try:
        run = exercise.run("ring", 4, [(torch.ones(40), False)] * 4, timeout=30)
    finally:
        del __main__.ring
    ring = {(r, (r + 1) % 4): (3, 3 * 40) for r in range(4)}  # 3 chunks of 10 float32
    checks.assert_messages(run, ring, "ring")
    for wrong, words in (
        ({**ring, (0, 1): (4, 3 * 40)}, "4 message(s) from rank 0 to rank 1"),
        ({**ring, (0, 1): (3, 3 * 160)}, "with 480 bytes of payload"),
        ({**ring, (0, 2): (1, 40)}, "from rank 0 to rank 2"),
    ):
        with pytest.raises(AssertionError, match=r"(?s)" + words.replace("(", r"\(").replace(")", r"\)")):
            checks.assert_messages(run, wrong, "ring")


def test_an_unobserved_count_tells_whom_to_ask():
    # the host could not observe: the instructor is told what the host needs; the submission changed the
    # ranks (grading/remote.py's outside check of their confinement): the student is told, not the instructor
    for unobserved in (
        lambda: wire.Traffic.unobserved("no ss").total,
        wiretimeline.Timeline.unobserved("no capture").directions,
    ):
        with pytest.raises(wire.Unobserved, match="For the instructor"):
            unobserved()
    for unobserved in (
        lambda: wire.Traffic.unobserved("rank 0 was not confined", by_submission=True).total,
        wiretimeline.Timeline.unobserved("rank 0 was not confined", by_submission=True).directions,
    ):
        with pytest.raises(wire.Unobserved) as said:
            unobserved()
        assert "rank 0 was not confined" in str(said.value) and wire.SUBMISSION_CHANGED_THE_RANKS in str(said.value)
        assert "For the instructor" not in str(said.value)


def test_positions_on_a_direction():
    timeline = wiretimeline.Timeline(
        segments=[(0.0, 0, 1, NOTE), (0.1, 1, 0, NOTE), (0.2, 0, 1, 1000), (0.3, 0, 1, 500)]
    )
    assert timeline.passed(0, 1, 0) == 0.0 and timeline.passed(0, 1, NOTE) == 0.2
    assert timeline.passed(0, 1, NOTE + 1499) == 0.3 and timeline.passed(0, 1, NOTE + 1500) is None
    assert [timeline.crossed(0, 1, t) for t in (0.0, 0.25, 9)] == [NOTE, NOTE + 1000, NOTE + 1500]
    assert timeline.crossed(1, 0, 0.05) == 0
    with pytest.raises(wire.Unobserved):
        wiretimeline.Timeline.unobserved("no capture").passed(0, 1, 0)


def test_the_students_own_kernel_shows_the_trace_as_gloo_sends_it():
    # no grader there: the count and the timeline come from the traced messages, with gloo's notes and preambles
    __main__.ring = _ring
    try:
        run = exercise.run("ring", 2, [(torch.ones(40), False)] * 2, timeout=30, timeline=True)
    finally:
        del __main__.ring
    assert run.timeline.source == "trace"
    # rank 0's one message (a note, then the data) and the note of its own receive from rank 1
    assert run.timeline.bytes(0, 1) == NOTE + (NOTE + 80) + NOTE


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_the_capture_sees_what_the_os_counted():
    from disttrain_lab.grading.capture import Capture

    dl.launch(_ring, 4, torch.ones(8), True)
    before = wire.snapshot()
    with Capture() as capture:
        dl.launch(_ring, 4, torch.ones(4004), True)
    pids = pool.worker_pids()[:4]
    after, owner = wire.snapshot(), wire.owners(pids)
    timeline, counted = (
        wiretimeline.timeline(capture.segments, after, pids, owner),
        wire.traffic(before, after, pids, owner),
    )
    for a in range(4):
        for b in range(4):
            if a != b:
                assert timeline.bytes(a, b) == counted.between(a, b), (a, b)


def test_the_capture_starts_only_once_the_kernel_stamps_packets_as_they_pass():
    """The kernel's switch for stamping packets is turned on by a work item, which a loaded host once ran late: two
    segments were then stamped when the capture read them, 0.3 s and 0.2 s after they left.  The capture says ready
    only once a datagram on the loopback, read 5 ms after it was sent, carries a stamp from before then; stamps that
    come late every time (here: the clocks put a second apart) refuse the capture after its wait."""
    import time

    from disttrain_lab.grading import capture

    apart = capture._clocks_apart()
    start = time.monotonic()
    capture._wait_for_live_stamps(apart)
    assert time.monotonic() - start < 2, time.monotonic() - start
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not stamp packets as they passed within 0.1 s"):
        capture._wait_for_live_stamps(apart - 1.0, within=0.1)
    assert time.monotonic() - start < 2, time.monotonic() - start


@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")
def test_the_capture_times_a_segment_when_it_left_not_when_it_was_read():
    """A capture the scheduler keeps waiting (a loaded host: here, stopped outright) reads the segments late;
    their times are still the kernel's, when each one left (lab 5's bubble is timed from them: a late
    reading of gloo's handshake once made a step look 48 ms shorter than it was).  Asked to stop as soon as it runs
    again, it still reads what was queued (its wait had timed out while it was stopped: it read nothing, once)."""
    import signal
    import socket
    import time

    from disttrain_lab.grading.capture import Capture

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        with Capture() as capture:
            capture._process.send_signal(signal.SIGSTOP)
            try:
                sent = []  # (just before and just after each send: a loaded host may pause this test between them)
                for data, pause in ((b"a" * 100, 0.3), (b"b" * 100, 0.2)):
                    sent.append(time.monotonic())
                    client.sendall(data)
                    sent.append(time.monotonic())
                    time.sleep(pause)  # (after the second, both in the queue, unread, for 0.2 s more)
            finally:
                capture._process.send_signal(signal.SIGCONT)
        mine = f"127.0.0.1:{client.getsockname()[1]}"
        times = [t for t, src, _, n in capture.segments if src == mine and n == 100]
        assert len(times) == 2, capture.segments
        # each time within its send call (50 ms for the clocks' conversion), 0.2 s or more before the capture ran again
        assert sent[0] - 0.05 <= times[0] <= sent[1] + 0.05 and sent[2] - 0.05 <= times[1] <= sent[3] + 0.05, (
            times,
            sent,
        )
    finally:
        client.close()
        peer.close()
        server.close()


def _framed(payload: bytes) -> bytes:
    """``payload`` as gloo sends it: a note, then the preamble and the data (``gloo_ops``)."""
    return (
        struct.pack("<6Q", 48, 2, 0, 0, len(payload), 0)
        + struct.pack("<6Q", 48 + len(payload), 1, 0, 0, len(payload), 0)
        + payload
    )


def test_bytes_sent_again_are_kept_once():
    """A loaded host makes TCP send a segment again, whole or from the middle of one already seen
    (measured: 1 in 20 runs of a 4 MiB ring shift beside two CPU-bound processes); the capture keeps
    each byte once, so a message's bytes stay whole in what the connection carried."""
    from disttrain_lab.grading.capture import Carried

    carried, top = Carried(), 2**32 - 100  # a connection whose numbers wrap within it
    a, b = "10.0.0.1:1", "10.0.0.2:2"
    assert carried.new(a, b, top, 100) == 0
    assert carried.new(a, b, 0, 100) == 0  # past the wrap: new bytes
    assert carried.new(a, b, top + 50, 50) is None  # sent again, whole
    assert carried.new(a, b, 50, 100) == 50  # sent again from the middle of one seen: its last 50 are new
    assert carried.new(b, a, 7, 10) == 0  # the other direction is its own
    data = bytes(range(256)) * 4  # one message of gloo's, its preamble first
    stream = _framed(data)
    parts = [(1000, stream[:300]), (1300, stream[300:600]), (1150, stream[150:450]), (1600, stream[600:])]
    assert wiretimeline._joined(parts) == stream  # placed by sequence number, not appended
    timeline = wiretimeline.Timeline(segments=[(0.0, 0, 1, len(stream))], data={(0, 1): [wiretimeline._joined(parts)]})
    stream = data
    assert timeline.carries(0, 1, [stream[:200], stream[200:]]) == 2
    assert timeline.carries(0, 1, [stream[200:], stream[:200]]) == 1  # in order: the second is before the first
    assert timeline.carries(1, 0, [stream[:8]]) == 0
    with pytest.raises(wire.Unobserved):
        wiretimeline.Timeline(segments=[(0.0, 0, 1, 8)]).carries(0, 1, [b"x"])  # payloads not asked for
    # a segment whose data the capture could not keep (past its limits): that pair is unobserved, not empty
    after = {
        ("1.0.0.1:1", "1.0.0.2:2"): wire.Socket(11, "1.0.0.1:1", "1.0.0.2:2", 0),
        ("1.0.0.2:2", "1.0.0.1:1"): wire.Socket(12, "1.0.0.2:2", "1.0.0.1:1", 0),
    }
    segments = [(0.0, "1.0.0.1:1", "1.0.0.2:2", 3), (0.1, "1.0.0.2:2", "1.0.0.1:1", 3)]
    cut = wiretimeline.timeline(segments, after, [100, 200], {11: 100, 12: 200}, [(0, _framed(b"abc")), (0, None)])
    assert cut.carries(0, 1, [b"abc"]) == 1
    with pytest.raises(wire.Unobserved, match="could not keep all the data from rank 1 to rank 0"):
        cut.carries(1, 0, [b"abc"])


def test_the_socket_reader_runs_as_a_file_on_the_standard_library_alone():
    """``wire.owners(user=...)`` runs ``fd_links.py`` as a file, as another uid (``python -I``): it must import
    nothing of the package (a relative import there broke reading another uid's sockets in a container)."""
    import json
    import socket
    import subprocess
    import sys

    from disttrain_lab import fd_links

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    try:
        done = subprocess.run(
            [sys.executable, "-I", fd_links.__file__, str(os.getpid())], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
        links = json.loads(done.stdout)[str(os.getpid())]
        assert f"socket:[{os.fstat(server.fileno()).st_ino}]" in links
        assert os.fstat(server.fileno()).st_ino in wire.owners([os.getpid()], user=os.geteuid())
    finally:
        server.close()


def test_a_connection_open_in_a_third_process_is_found():
    """``holders`` and ``shared_connections``: a connection between two ranks that a third process holds
    open too (a child forked after the connection was made inherits it) is said, with that process's id;
    the same connection held by its two ends alone is not.  (The grader then reads no memory for the
    ranks: a process named as a rank while a real rank does the work would share its connections.)"""
    import socket
    import subprocess
    import sys
    import time

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    # "rank 1" connects to "rank 0" (this process), then forks a child that holds the connection too
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, socket, sys, time\n"
            f"s = socket.create_connection(('127.0.0.1', {server.getsockname()[1]}))\n"
            "pid = os.fork()\n"
            "if pid == 0:\n    time.sleep(30)\n    os._exit(0)\n"
            "print(pid, flush=True)\ntime.sleep(30)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    grandchild = None
    try:
        conn, _ = server.accept()
        grandchild = int(child.stdout.readline())
        time.sleep(0.2)
        ranks = [os.getpid(), child.pid]
        sockets = wire.snapshot()
        alone = wire.holders(ranks)
        assert wire.shared_connections(sockets, alone, ranks) == []
        held = wire.holders([*ranks, grandchild, 2**22 + 12345], skip_gone=True)  # (one that has ended)
        said = wire.shared_connections(sockets, held, ranks)
        assert said == [f"rank 1's connection to rank 0, also open in pid [{grandchild}]"], said
    finally:
        child.kill()
        if grandchild is not None:
            os.kill(grandchild, 9)
        server.close()
