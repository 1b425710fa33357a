"""The grader's gate in a graded step's backward (disttrain_lab/gate.py, grading/gatekeeper.py): what the
grader reads off its capture, and what it refuses.  The gate at work, on real ranks, is
tests/labs/test_lab03.py::test_overlap_is_graded_from_the_grader_gate_not_the_ranks_trace."""

from __future__ import annotations

import pytest
import torch

from disttrain_lab import wire
from disttrain_lab.gate import Seen
from disttrain_lab.grading.gatekeeper import Gatekeeper


def _keeper(connections):
    keeper = Gatekeeper(None, [torch.zeros(1)] * len(connections), lambda base: [0], lambda: None, timeout=1.0)
    keeper.connections = connections
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
    assert seen == Seen(start=1.0, cut=3.0, settled=False)
    assert seen.window() == (1.0, 3.0)


def test_a_gate_the_capture_did_not_see_answer_is_unobserved():
    gate, a = "127.0.0.1:9", "127.0.0.1:100"
    seen = _keeper([(gate, a)]).seen([(10.0, gate, a, 1)], origin=9.0)
    assert seen.source == "unobserved"
    with pytest.raises(wire.Unobserved, match="held"):
        seen.window()


def test_a_rank_that_speaks_out_of_protocol_is_refused():
    with pytest.raises(ValueError, match="not one of its messages"):
        list(Gatekeeper._messages(bytearray(b"Xjunk")))
    buffer = bytearray(b"H\x01\x00\x00\x00SB\x10\x00")
    assert list(Gatekeeper._messages(buffer)) == [(b"H", 1), (b"S", 0)]
    assert buffer == bytearray(b"B\x10\x00")  # (a message not whole yet waits for its bytes)
