"""Tracing: every torch.distributed call is recorded, summarised and drawn."""

from __future__ import annotations

import math

import matplotlib
import pytest
import torch
import torch.distributed as dist

import disttrain_lab as dl

matplotlib.use("Agg")


def every_op():
    """One call of each communication op gloo supports, on 2 ranks."""
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.ones(4)  # 16 bytes
    if r == 0:
        dist.send(t, 1, tag=3)
        dist.recv(t, 1)
    else:
        dist.recv(t, 0, tag=3)
        dist.send(t, 0)
    reqs = [dist.isend(t, 1 - r), dist.irecv(torch.empty(4), 1 - r)]
    for q in reqs:
        q.wait()
    dist.broadcast(t, src=1)
    dist.all_reduce(t)
    dist.reduce(t, dst=0)
    dist.all_gather([torch.empty(4) for _ in range(n)], t)
    dist.all_gather_into_tensor(torch.empty(4 * n), t)
    dist.reduce_scatter(torch.empty(4), [torch.ones(4) for _ in range(n)])
    dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * n))
    dist.scatter(torch.empty(4), [torch.ones(4) for _ in range(n)] if r == 0 else None, src=0)
    dist.gather(t, [torch.empty(4) for _ in range(n)] if r == 0 else None, dst=0)
    dist.all_to_all_single(torch.empty(4), torch.ones(4))
    dist.barrier()
    with dl.region("compute", step=7):
        t.mul_(2)
    return r


@pytest.fixture(scope="module")
def run_every_op():
    return dl.launch(every_op, 2, trace=True)


def test_run_carries_results_and_world(run_every_op):
    run = run_every_op
    assert isinstance(run, dl.Run) and run.results == [0, 1] and run.world_size == 2
    assert run.backend == "gloo" and run.wall_time > 0


@pytest.mark.parametrize(
    "op",
    [
        "send",
        "recv",
        "isend",
        "irecv",
        "broadcast",
        "all_reduce",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "gather",
        "all_to_all_single",
        "barrier",
    ],
)
def test_every_op_is_recorded_once_per_rank(run_every_op, op):
    for rank in (0, 1):
        assert run_every_op.calls(rank)[op] == 1, (op, rank)


def test_p2p_records_peer_tag_and_bytes(run_every_op):
    run = run_every_op
    first_send = run.select(op="send", rank=0)[0]
    assert (first_send.peer, first_send.tag, first_send.bytes) == (1, 3, 16)
    first_recv = run.select(op="recv", rank=1)[0]
    assert (first_recv.peer, first_recv.tag, first_recv.bytes) == (0, 3, 16)
    assert run.bytes_sent(0) == 16 * 2 and run.bytes_received(1) == 16 * 2  # send + isend


def test_waits_are_recorded_with_the_op_they_wait_on(run_every_op):
    waits = run_every_op.select(kind="wait", rank=0)
    assert sorted(w.name for w in waits) == ["irecv", "isend"]
    assert all(w.end >= w.start for w in waits)


def test_collectives_record_root_and_bytes(run_every_op):
    run = run_every_op
    (b,) = run.select(op="broadcast", rank=0)
    assert b.peer == 1 and b.bytes == 16 and b.kind == "collective"
    (ag,) = run.select(op="all_gather", rank=0)
    assert ag.bytes == 32  # the whole gathered output
    (rs,) = run.select(op="reduce_scatter_tensor", rank=1)
    assert rs.bytes == 32 and rs.meta["reduce_op"] == "SUM"
    assert {e.op for e in run.collectives()} >= {"broadcast", "all_reduce", "barrier"}


def test_regions_carry_name_and_meta(run_every_op):
    (reg,) = run_every_op.select(kind="region", rank=1)
    assert reg.name == "compute" and reg.meta == {"step": 7} and reg.duration >= 0


def test_times_share_one_clock_and_are_ordered(run_every_op):
    run = run_every_op
    assert all(0 <= e.start <= e.end <= run.wall_time + 1e-3 for e in run.events)
    # a blocking recv cannot end before the matching send started
    for send, recv in run.messages():
        if recv.op == "recv":
            assert recv.end >= send.start - 1e-4


def test_summary_is_a_table(run_every_op):
    summary = run_every_op.summary()
    assert summary[0]["sent"] == 32 and summary[0]["calls"]["all_reduce"] == 1
    text = repr(summary)
    assert "rank" in text.splitlines()[0] and "all_reduce×1" in text


def test_timeline_draws_one_row_per_rank(run_every_op):
    ax = dl.viz.timeline(run_every_op)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert len(ax.collections) >= len(run_every_op.events)


def test_untraced_launch_returns_plain_list():
    assert dl.launch(lambda: 1, 2, trace=False) == [1, 1]


def test_object_collectives_show_their_inner_tensor_calls():
    def objects():
        out = [None, None]
        dist.all_gather_object(out, {"rank": dist.get_rank()})
        return out

    run = dl.launch(objects, 2, trace=True)
    assert run.results[0] == [{"rank": 0}, {"rank": 1}]
    assert run.calls(0)["all_gather"] >= 1 and all(e.bytes > 0 for e in run.collectives(0))


def test_from_import_is_traced_too():
    def direct():
        from torch.distributed import all_reduce

        all_reduce(torch.ones(2))

    run = dl.launch(direct, 2, trace=True)
    assert run.calls()["all_reduce"] == 2


# --- rounds: the one-port model --------------------------------------------------------


def linear_broadcast(src):
    t = torch.full((3,), float(dist.get_rank() == src))
    if dist.get_rank() == src:
        for peer in range(dist.get_world_size()):
            if peer != src:
                dist.send(t, peer)
    else:
        dist.recv(t, src)
    return t


def tree_broadcast(src):
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((3,), float(r == src))
    me = (r - src) % n
    mask = 1
    while mask < n:  # receive from the parent
        if me & mask:
            dist.recv(t, (me - mask + src) % n)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:  # forward to the children
        if me + mask < n:
            dist.send(t, (me + mask + src) % n)
        mask >>= 1
    return t


def ring_pass_k(k):
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((2,), float(r))
    buf = torch.empty(2)
    for _ in range(k):
        reqs = [dist.isend(t, (r + 1) % n), dist.irecv(buf, (r - 1) % n)]
        for q in reqs:
            q.wait()
        t = buf.clone()
    return t


@pytest.mark.parametrize("n", [2, 3, 4])
def test_rounds_linear_broadcast_is_n_minus_1(n):
    run = dl.launch(linear_broadcast, n, 0, trace=True)
    assert all(torch.equal(t, torch.ones(3)) for t in run.results)
    assert run.rounds() == n - 1


@pytest.mark.parametrize("n, src", [(2, 1), (3, 2), (4, 1), (5, 3)])
def test_rounds_binomial_tree_is_ceil_log2(n, src):
    run = dl.launch(tree_broadcast, n, src, trace=True)
    assert all(torch.equal(t, torch.ones(3)) for t in run.results)
    assert run.rounds() == math.ceil(math.log2(n))
    assert len(run.select(op="send", rank=src)) == math.ceil(math.log2(n))


@pytest.mark.parametrize("n", [2, 4])
def test_rounds_of_k_ring_steps_with_isend_irecv(n):
    run = dl.launch(ring_pass_k, n, 2 * (n - 1), trace=True)
    assert run.rounds() == 2 * (n - 1)
    assert len(run.messages()) == n * 2 * (n - 1)


def _pingpong(trips):
    t = torch.ones(1)
    for _ in range(trips):
        if dist.get_rank() == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
    return float(t)


def test_tracing_records_each_call_once_and_changes_nothing_else():
    """What tracing costs is measured by the benchmark (`disttrain-lab bench trace`: the
    time of a traced round trip against a plain one), not by a timed test, which a busy
    shared machine would fail; here: one event per call, nothing else recorded, same results."""
    run = dl.launch(_pingpong, 2, 300, trace=True)
    assert run.results == dl.launch(_pingpong, 2, 300) == [1.0, 1.0]
    for rank, peer in ((0, 1), (1, 0)):
        events = run.by_rank(rank)
        assert [e.op for e in events] == (["send", "recv"] if rank == 0 else ["recv", "send"]) * 300
        assert all(e.peer == peer and e.bytes == 4 and e.kind == "p2p" for e in events)
    assert len(run.messages()) == 600


def chain_forwarding_before_wait():
    """A chain broadcast that forwards an irecv buffer before waiting on it (a race that
    gloo's I/O thread often wins): still N - 1 rounds, not 1."""
    import time

    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((4,), float(r == 0))
    if r > 0:
        req = dist.irecv(t, r - 1)
        time.sleep(0.05)
    if r < n - 1:
        dist.send(t, r + 1)
    if r > 0:
        req.wait()
    return t


@pytest.mark.parametrize("n", [3, 4])
def test_rounds_see_a_forwarded_buffer_before_its_wait(n):
    run = dl.launch(chain_forwarding_before_wait, n, trace=True)
    assert run.rounds() == n - 1


def test_waits_pair_with_their_own_request():
    def out_of_order():
        r = dist.get_rank()
        if r == 0:
            dist.send(torch.ones(2), 1, tag=0)
            dist.send(torch.ones(2), 1, tag=0)
            return None
        a, b = torch.empty(2), torch.empty(2)
        first, second = dist.irecv(a, 0, tag=0), dist.irecv(b, 0, tag=0)
        second.wait()
        first.wait()

    run = dl.launch(out_of_order, 2, trace=True)
    posts = run.select(op="irecv", rank=1)
    waits = {e.meta["request"]: e for e in run.select(kind="wait", rank=1)}
    assert {p.meta["request"] for p in posts} == set(waits)


def test_numpy_integer_peers_are_valid_ranks():
    import numpy as np

    def swap():
        r = dist.get_rank()
        t = torch.full((1,), float(r))
        peer = np.int64(1 - r)
        if r == 0:
            dist.send(t, peer)
            dist.recv(t, peer)
        else:
            buf = torch.empty(1)
            dist.recv(buf, peer)
            dist.send(t, peer)
            t = buf
        return float(t)

    assert dl.launch(swap, 2) == [1.0, 0.0]


def test_wrappers_expose_no_untraced_function():
    def probe():
        return [hasattr(dist.all_reduce, name) for name in ("__wrapped__", "__disttrain_traced__")]

    assert dl.launch(probe, 2) == [[False, False], [False, False]]


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_a_rank_stuck_in_new_group_is_reported_as_such():
    def only_rank_zero_makes_a_group():
        if dist.get_rank() == 0:
            dist.new_group([0, 1])

    with pytest.raises(dl.LaunchTimeout) as err:
        dl.launch(only_rank_zero_makes_a_group, 2, timeout=3)
    assert "rank 0: new_group" in str(err.value) and "every rank of the world must call" in str(err.value)
