"""The grader's gate in a graded step's backward (disttrain_lab/gate.py, grading/gatekeeper.py): what the
grader reads off its capture, and what it refuses.  The gate at work, on real ranks, is
tests/labs/test_lab03.py::test_overlap_is_graded_from_the_grader_gate_not_the_ranks_trace."""

from __future__ import annotations

import pytest
import torch

from disttrain_lab import wire
from disttrain_lab.gate import GO, HOLD, Seen
from disttrain_lab.grading.gatekeeper import Gatekeeper


def _keeper(connections, sent=((GO, 1), (HOLD, 64))):
    """A gatekeeper that sent each connection ``sent`` (kind, bytes): the rounds of GO, and an answer."""
    keeper = Gatekeeper(None, [torch.zeros(16)] * len(connections), lambda base: [0], lambda: None, timeout=1.0)
    keeper.connections = connections
    keeper.messages = [[(kind, size, 0 if kind == HOLD else None) for kind, size in sent] for _ in connections]
    keeper.rounds = sum(1 for kind, _ in sent if kind == GO)
    return keeper


def test_the_window_opens_when_the_first_rank_is_told_to_begin():
    """A rank told to go first may send before the others are told (seen once on 3 ranks: a bucket's bytes
    crossed between the first and the last "go"), so the window starts at the first "go"; it ends at the
    first answer."""
    gate, a, b = "127.0.0.1:9", "127.0.0.1:100", "127.0.0.1:101"
    segments = [
        (10.0, gate, a, 1),  # "go" to rank a
        (10.2, "127.0.0.1:200", "127.0.0.1:201", 300),  # rank a's data, before b is told
        (10.5, gate, b, 1),  # "go" to rank b
        (12.0, gate, b, 64),  # b's answer first
        (12.1, gate, a, 64),
    ]
    seen = _keeper([(gate, a), (gate, b)]).seen(segments, origin=9.0)
    assert seen == Seen(start=1.0, cut=3.0, settled=False, marks=(1.0,), cuts=(3.0,))
    assert seen.window() == (1.0, 3.0)


def test_marks_are_read_by_the_position_of_each_message_the_grader_sent():
    """Each micro-step begins at a round of "go"s (marks), the held one too; the answer may cross in several
    segments and the next round's "go" may ride in the same segment as its end: each message is placed by the
    position of its first byte in the connection, not by counting segments."""
    gate, a, b = "127.0.0.1:9", "127.0.0.1:100", "127.0.0.1:101"
    sent = [(GO, 1), (GO, 1), (HOLD, 64), (GO, 1)]
    segments = [
        (10.0, gate, a, 1),
        (10.1, gate, b, 1),
        (11.0, gate, b, 1),  # the second round: b told first
        (11.1, gate, a, 1),
        (12.0, gate, a, 40),  # a's answer, in two segments
        (12.1, gate, b, 64),
        (12.2, gate, a, 25),  # the rest of a's answer, and the last round's "go"
        (13.0, gate, b, 1),
    ]
    seen = _keeper([(gate, a), (gate, b)], sent).seen(segments, origin=9.0)
    assert seen == Seen(start=2.0, cut=3.0, settled=False, marks=(1.0, 2.0, 3.2), cuts=(3.0,))
    assert seen.hold_window(0) == (2.0, 3.0)
    assert seen.windows() == [(1.0, 2.0), (2.0, 3.2)]
    assert seen.window() == (2.0, 3.0)


def test_a_gate_that_holds_nothing_marks_the_steps_alone():
    gate, a = "127.0.0.1:9", "127.0.0.1:100"
    keeper = Gatekeeper(None, [None], lambda base: [0], lambda: None, timeout=1.0)
    keeper.connections, keeper.messages, keeper.rounds = [(gate, a)], [[(GO, 1, None)] * 3], 3
    seen = keeper.seen([(10.0, gate, a, 1), (10.5, gate, a, 1), (11.0, gate, a, 1)], origin=9.0)
    assert seen.marks == (1.0, 1.5, 2.0) and seen.windows() == [(1.0, 1.5), (1.5, 2.0)]
    with pytest.raises(wire.Unobserved, match="held"):
        seen.window()  # (nothing was held: no window of a held backward to read)


def test_a_gate_the_capture_did_not_see_answer_is_unobserved():
    gate, a = "127.0.0.1:9", "127.0.0.1:100"
    seen = _keeper([(gate, a)]).seen([(10.0, gate, a, 1)], origin=9.0)
    assert seen.source == "unobserved"
    with pytest.raises(wire.Unobserved, match="held"):
        seen.window()
    with pytest.raises(wire.Unobserved, match="steps began"):
        seen.windows()


def test_a_rank_that_speaks_out_of_protocol_is_refused():
    with pytest.raises(ValueError, match="not one of its messages"):
        list(Gatekeeper._messages(bytearray(b"Xjunk")))
    buffer = bytearray(b"H\x01\x00\x00\x00SB\x10\x00")
    assert list(Gatekeeper._messages(buffer)) == [(b"H", 1), (b"S", 0)]
    assert buffer == bytearray(b"B\x10\x00")  # (a message not whole yet waits for its bytes)


def test_each_hold_has_its_own_answers_and_the_window_is_the_one_that_answers_with_tensors():
    """Lab 3 holds twice: its probe in the first step (zeros, at once) and the held window in the last (the
    test's tensors, once the bytes settled); ``window()`` is the second's, ``hold_window(0)`` the first's."""
    gate, a = "127.0.0.1:9", "127.0.0.1:100"
    keeper = Gatekeeper(None, [[None], [torch.zeros(16)]], lambda base: [0], lambda: None, timeout=1.0)
    keeper.connections, keeper.rounds = [(gate, a)], 2
    keeper.messages = [[(GO, 1, None), (HOLD, 4, 0), (GO, 1, None), (HOLD, 64, 1)]]
    segments = [(10.0, gate, a, 1), (10.5, gate, a, 4), (11.0, gate, a, 1), (12.0, gate, a, 64)]
    seen = keeper.seen(segments, origin=9.0)
    assert seen.cuts == (1.5, 3.0) and seen.marks == (1.0, 2.0)
    assert seen.hold_window(0) == (1.0, 1.5) and seen.window() == (2.0, 3.0)
    with pytest.raises(wire.Unobserved):
        seen.hold_window(2)


def _rank_at_the_gate(rank: int, ports, forged: bool) -> None:
    """A rank of a gated run: connects to the gate on the port it is sent, then says it is held and waits for
    the answer in its main thread, or (``forged``) from a thread of its own while the main thread waits for
    that thread (a futex, not the gate's socket)."""
    import threading

    from disttrain_lab.gate import Gate

    gate = Gate(ports.recv(), rank)
    if forged:
        speaker = threading.Thread(target=gate.wait, args=(torch.Size([4]),))
        speaker.start()
        speaker.join()
    else:
        gate.wait(torch.Size([4]))
    gate.close()


@pytest.mark.skipif(wire.available() is not None, reason=str(wire.available()))
@pytest.mark.parametrize(
    "forged", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["main_thread", "a_thread_speaks_for_it"]
)  # (forged: the grader looks again for HOLD_S, 5 s, before it calls the gate unobserved)
def test_a_rank_is_held_only_where_its_main_thread_waits_at_the_gate(forged):
    """#42: the gate's rank end is the student's process, so a rewritten gate.py could say "held" from a thread
    of its own while the rank's work went on.  The grader reads from /proc that each held rank's main thread is
    blocked reading its gate connection (``pauses.receiving_on``, the connection's rank end found with ``ss``
    and ``/proc/<pid>/fd``); where one is not, the gate is unobserved (and a test reading it fails), though the
    grader answers all the same (the run ends)."""
    import multiprocessing

    from disttrain_lab.grading import gatewatch

    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe() for _ in range(2)]
    ranks = [ctx.Process(target=_rank_at_the_gate, args=(r, pipes[r][1], forged and r == 1)) for r in range(2)]
    for p in ranks:
        p.start()
    keeper = gatewatch.for_ranks(None, [None, None], [p.pid for p in ranks], None, timeout=60)
    try:
        port = keeper.start()
        for mine, _ in pipes:
            mine.send(port)
        for p in ranks:
            p.join(30)
        assert [p.exitcode for p in ranks] == [0, 0]
    finally:
        keeper.stop()
        for p in ranks:
            p.kill()
    if forged:
        assert keeper.why and "rank 1 said it was held at the gate, but its main thread was not waiting" in keeper.why
        with pytest.raises(wire.Unobserved, match="a thread of its own spoke for it"):
            keeper.seen([], 0.0).ranks_held()
    else:
        assert keeper.why is None and keeper.held_ranks == [(0, 1)]


def test_a_host_links_copies_are_read_as_data_each_bounded():
    """A rank's host link (lab 9's OffloadAdam under grading) sends its copies on the gate's connection: each one
    kept whole as bytes, never parsed; a length past MAX_LINK_BYTES ends the gate's protocol (unobserved); a
    hold's drain reads the link's copies up to the rank's next message of another kind, which the loop keeps."""
    import struct

    from disttrain_lab.gate import DOWN, HOLD, MAX_LINK_BYTES, UP

    buffer = bytearray(DOWN + struct.pack("<I", 3) + b"abc" + UP + struct.pack("<I", 0) + HOLD + struct.pack("<I", 1))
    assert list(Gatekeeper._messages(buffer, links_only=True)) == [(DOWN, b"abc"), (UP, b"")]
    assert buffer == HOLD + struct.pack("<I", 1)
    assert list(Gatekeeper._messages(buffer)) == [(HOLD, 1)]
    partial = bytearray(DOWN + struct.pack("<I", 10) + b"abc")
    assert list(Gatekeeper._messages(partial)) == [] and len(partial) == 8  # (the rest comes later)
    with pytest.raises(ValueError, match="host link sent the gate"):
        list(Gatekeeper._messages(bytearray(UP + struct.pack("<I", MAX_LINK_BYTES + 1))))


@pytest.mark.parametrize("goes_on", [True, False], ids=["the_other_goes_on", "the_other_stops"])
def test_a_hold_answered_apart_keeps_one_rank_until_the_others_reach_the_next(monkeypatch, goes_on):
    """``gate.Behind``: at its hold the grader answers every rank but the one behind, and that one only once the
    others are held at the next hold (``Seen.ranks_ahead``), or, where one never gets there (it waits for the rank
    behind), ``HELD_WAIT`` seconds later; the ranks, threads of this process here, hold alike at each hold."""
    import threading

    from disttrain_lab.gate import Behind, Gate
    from disttrain_lab.grading import gatekeeper

    monkeypatch.setattr(gatekeeper, "HELD_WAIT", 0.5)
    keeper = Gatekeeper(None, [Behind([None, None], 0), [None, None]], lambda base: [0, 0], lambda: None, timeout=30)
    port = keeper.start()
    events, let_go = [], threading.Event()

    def rank(r: int) -> None:
        door = Gate(port, r)
        door.wait(torch.Size([2]))
        events.append((r, 0))
        if r == 0:
            let_go.set()
        elif not goes_on:
            let_go.wait(timeout=10)  # (as a rank that waits for the one held behind)
        door.wait(torch.Size([2]))
        events.append((r, 1))
        door.close()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    keeper.stop()
    assert keeper.why is None, keeper.why
    assert events[:2] == [(1, 0), (0, 0)] and sorted(events[2:]) == [(0, 1), (1, 1)], events
    assert keeper.ahead == [(0, (1,) if goes_on else ())], keeper.ahead
    assert keeper.held_ranks == [(0, 1), (0, 1)], keeper.held_ranks


def test_a_host_links_copies_sent_after_the_last_hold_are_kept_when_the_run_ends(monkeypatch):
    """A run can end between two of the gatekeeper's reads (a busy host): what a rank's host link sent after the last
    answer and the loop had not read by then is still read as the gatekeeper stops, kept as after the last hold (lab
    9's ``OffloadAdam``: the first layer's gradients go down the link after the last hold's answer).  Here the loop
    stops reading once the hold is answered, as a loop the host did not schedule in time."""
    import selectors
    import threading
    import time

    from disttrain_lab.gate import Gate
    from disttrain_lab.grading import gatekeeper

    deaf = threading.Event()

    class Deaf(selectors.DefaultSelector):
        def select(self, timeout=None):
            if deaf.is_set():
                time.sleep(timeout or 0)
                return []
            return super().select(timeout)

    monkeypatch.setattr(gatekeeper.selectors, "DefaultSelector", Deaf)
    send = Gatekeeper._send

    def answer_then_deaf(sock, data, kind, sent):
        send(sock, data, kind, sent)
        if kind[0] == HOLD:
            deaf.set()

    monkeypatch.setattr(Gatekeeper, "_send", staticmethod(answer_then_deaf))
    keeper = Gatekeeper(None, [[None]], lambda base: [0], lambda: None, timeout=30)
    port = keeper.start()

    def rank() -> None:
        door = Gate(port, 0)
        door.wait(torch.Size([1]))
        door.link("down", b"abc")
        door.link("down", b"defg")
        door.close()

    thread = threading.Thread(target=rank, daemon=True)
    thread.start()
    thread.join(timeout=20)
    time.sleep(0.3)  # (the loop selects, deaf, meanwhile)
    keeper.stop()
    assert keeper.link == [(0, "down", 1, b"abc"), (0, "down", 1, b"defg")], keeper.link
