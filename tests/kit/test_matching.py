"""Collectives that cannot match are named at once (disttrain_lab/matching.py): each rank's call,
its values and its line, within seconds, where gloo would wait until the timeout or abort."""

from __future__ import annotations

import inspect
import time

import pytest
import torch
import torch.distributed as dist

import disttrain_lab as dl
from disttrain_lab import matching, status

# within this, on a loaded machine: the ranks are compared once one has waited MISMATCH_AFTER (1 s)
SOON = 10.0


def line_of(fn, text: str) -> int:
    """The line of ``fn``'s source that holds ``text``, numbered as the ranks' reports number it."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


# --- what a student writes -------------------------------------------------------------


def sizes_differ():
    t = torch.ones(4 if dist.get_rank() == 0 else 3)
    dist.all_reduce(t)  # the call
    return t


def dtypes_differ():
    t = torch.ones(4, dtype=torch.float32 if dist.get_rank() == 0 else torch.float16)
    dist.all_reduce(t)  # the call
    return t


def ops_differ():
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)  # the call
    else:
        dist.broadcast(t, src=0)  # the other call


def roots_differ():
    t = torch.ones(4)
    dist.broadcast(t, src=dist.get_rank())  # the call


def only_rank_zero_calls():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(3))  # the call


def sizes_differ_in_a_subgroup():
    pair = dist.new_group([0, 1])
    if dist.get_rank() < 2:
        dist.all_reduce(torch.ones(4 if dist.get_rank() == 0 else 2), group=pair)  # the call
    dist.barrier()


CASES = {
    # fn: (what, the values each rank's line shows, world size)
    sizes_differ: ("sizes", ["rank 0: all_reduce(4 elements, float32)", "rank 1: all_reduce(3 elements, float32)"], 2),
    dtypes_differ: (
        "dtypes",
        ["rank 0: all_reduce(4 elements, float32)", "rank 1: all_reduce(4 elements, float16)"],
        2,
    ),
    ops_differ: (
        "ops",
        ["rank 0: all_reduce(4 elements, float32)", "rank 1: broadcast(src=0, 4 elements, float32)"],
        2,
    ),
    roots_differ: ("roots", ["rank 0: broadcast(src=0, 4 elements", "rank 1: broadcast(src=1, 4 elements"], 2),
    only_rank_zero_calls: ("missing", ["rank 0: all_reduce(3 elements, float32)", "rank 1: finished"], 2),
    sizes_differ_in_a_subgroup: ("sizes", ["rank 0: all_reduce(4 elements", "rank 1: all_reduce(2 elements"], 3),
}


@pytest.mark.parametrize("fn", list(CASES), ids=lambda fn: fn.__name__)
def test_a_mismatch_is_named_within_seconds_with_each_ranks_call_and_line(fn):
    what, shown, world = CASES[fn]
    start = time.perf_counter()
    with pytest.raises(dl.CollectiveMismatch) as err:
        dl.launch(fn, world, timeout=60)
    assert time.perf_counter() - start < SOON, "named at once, not at the 60-s timeout"
    text = str(err.value)
    assert err.value.mismatch.what == what, text
    for line in shown:
        assert line in text, text
    line = line_of(fn, "# the call")
    assert f"in {fn.__name__} (line {line})" in text, text  # the student's own line, on each rank
    if what == "missing":
        assert "which rank 1 returned without calling" in text, text
    else:
        assert f"entered collective #1 of their group with different {what}" in text, text
    assert isinstance(err.value, dl.LaunchTimeout)  # what it saved the student from
    assert dl.launch(lambda: dist.get_rank(), 2) == [0, 1]  # the pool recovers


def test_ranks_that_wait_long_in_matching_collectives_are_left_alone():
    def slow_rank_one():
        pair = dist.new_group([0, 1])
        total = 0.0
        for i in range(20):  # more collectives than a call log keeps
            t = torch.full((1000,), float(i))
            dist.all_reduce(t)
            dist.broadcast(t, src=i % 2)
            dist.all_reduce(t, group=pair)
            total += t.sum().item()
        if dist.get_rank() == 1:
            time.sleep(2.5)  # rank 0 waits in the next all_reduce for longer than MISMATCH_AFTER
        dist.all_reduce(t)
        return total

    out = dl.launch(slow_rank_one, 2, timeout=60)
    assert out[0] == out[1] == sum(4 * 1000.0 * i for i in range(20))


def test_a_recv_into_a_smaller_tensor_names_the_call_and_line_not_only_the_abort():
    def small_recv():
        if dist.get_rank() == 0:
            dist.send(torch.ones(4), dst=1)
        else:
            dist.recv(torch.zeros(2), src=0)  # the call

    start = time.perf_counter()
    with pytest.raises(dl.RankDied) as err:
        dl.launch(small_recv, 2, timeout=60)
    assert time.perf_counter() - start < SOON
    text = str(err.value)
    assert "gloo aborted it inside recv(src=0, 8 B)" in text, text
    assert f"in small_recv (line {line_of(small_recv, '# the call')})" in text, text
    assert "same size and dtype" in text, text


def test_a_crash_names_the_line_it_happened_on():
    def crash():
        import ctypes

        if dist.get_rank() == 1:
            ctypes.string_at(0)  # the call

    with pytest.raises(dl.RankDied) as err:
        dl.launch(crash, 2, timeout=60)
    assert "SIGSEGV" in str(err.value) and f"in crash (line {line_of(crash, '# the call')})" in str(err.value)


def test_a_call_log_is_data_whatever_a_rank_wrote_there():
    buf = bytearray(status.SLOT_BYTES * 2)
    # a rank's process can write anything into its slot: junk is read as data, or skipped
    buf[status.TEXT_BYTES :] = bytes(range(256)) * ((len(buf) - status.TEXT_BYTES) // 256) + bytes(
        (len(buf) - status.TEXT_BYTES) % 256
    )
    for rank in (0, 1):
        for call in matching.calls(buf, rank):
            assert isinstance(call.op, str) and isinstance(call.line, int)
    matching.find_mismatch([buf, buf], [0, 1], [0, 1], [0, 1])
    # two clean call logs of one collective that match: no mismatch
    buf = bytearray(status.SLOT_BYTES * 2)
    for rank in (0, 1):
        matching.note(buf, rank, 1, 1, None, "all_reduce", {"tensor": torch.ones(3)}, None)
    assert matching.find_mismatch([buf, buf], [0, 1], [0, 1]) is None
    matching.note(buf, 1, 2, 2, None, "all_reduce", {"tensor": torch.ones(5)}, None)
    matching.note(buf, 0, 2, 2, None, "all_reduce", {"tensor": torch.ones(3)}, None)
    found = matching.find_mismatch([buf, buf], [0, 1], [0])
    assert found is not None and found.what == "sizes" and [c.elements for c in found.calls] == [3, 5]
