"""Lab 14's overlap beyond DDP (``prefetch``): ``sharded_step`` on real ranks, checked against one process and, at
the grader's gate, on the wire.

Five tiny layers on 2 ranks, each run a few seconds, with the ranks' own timeout (60 s):

- an honest ``sharded_step`` (written here: FSDP2's schedule, storage freed after forward and gathered again for
  backward) passes with prefetch and without, under the grader's capture (``observed_from_outside``, root only), and
  on 3 ranks in the student's own kernel (values only);
- one that never prefetches gives the right values and fails the overlap on the wire, forward and backward;
- one that prefetches two layers ahead, one that gathers every layer at the start, one that keeps each layer
  whole after its forward (one gather a layer), and one that gathers late but sends each next shard early for show
  (three crossings), and one that prefetches only inside two layers, each fail on the wire with the values right;
- one that sums the gradients instead of averaging fails on the values;
- one that posts each next gather early but waits for it at once (nothing overlaps) passes the posting order and
  fails where the grader holds one rank a layer behind the other (slow: the grader's patience, twice).
"""

from __future__ import annotations

import ast
import ctypes
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from disttrain_lab import osmemory
from disttrain_lab.labtests.lab14 import prefetch
from tests.helpers import notebook_names, observed_from_outside

needs_capture = pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")


def _step(
    shards,
    layer,
    x,
    y,
    prefetch=True,
    ahead=1,
    upfront=False,
    keep=False,
    op="AVG",
    copy=False,
    only=None,
    early=False,
    hoard=False,
    relay=False,
):
    """``sharded_step`` as the exercise asks (``ahead`` layers of prefetch; ``upfront``: every forward gather posted
    at the start; ``keep``: whole parameters kept after forward, not gathered again; ``op``: the reduce-scatter's;
    ``copy``: each rank also sends the other its shard of the next layer before each layer, unused; ``only``: the
    layers whose forward, and whose backward, post a prefetch, the others none; ``early``: each prefetched gather
    waited for as soon as it is posted, before the layer runs; ``hoard``: a copy of each layer's whole parameters
    kept after its forward, the storage freed and gathered again as asked; ``relay``: zeros reduce-scattered, each
    layer's gradient averaged through the launcher's store instead; ``"share"``: the rank's own chunk of its gradient
    reduce-scattered, zeros elsewhere)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    n, count = dist.get_world_size(), len(shards)
    full = [torch.empty(n * s.numel()) for s in shards]
    for f in full:
        f.untyped_storage().resize_(0)
    posted = {}

    def gather(i):
        if i in posted or not 0 <= i < count or full[i].untyped_storage().nbytes():
            return
        full[i].untyped_storage().resize_(n * shards[i].numel() * 4)
        posted[i] = dist.all_gather_single(full[i].data, shards[i].detach(), async_op=True)

    def free(i):
        if not keep:
            full[i].untyped_storage().resize_(0)

    depth = ahead if prefetch else 0
    hoarded = []
    for i in range(count) if upfront else range(1):
        gather(i)
    inputs, outputs, h = [], [], x
    for i in range(count):
        gather(i)
        for k in range(i + 1, i + 1 + depth) if only is None or i in only else ():
            gather(k)
            if early and k in posted:
                posted[k].wait()
        posted.pop(i).wait()
        if copy and i + 1 < count:
            other = 1 - dist.get_rank()
            works = [dist.isend(shards[i + 1].detach(), other), dist.irecv(torch.empty_like(shards[i + 1]), other)]
            for work in works:
                work.wait()
        h = h.detach().requires_grad_(i > 0)
        inputs.append(h)
        h = layer(i, full[i].requires_grad_(), h)
        outputs.append(h)
        if hoard:
            hoarded.append(hoard(full[i].detach()) if callable(hoard) else full[i].detach().clone())
        free(i)
    loss = F.mse_loss(h, y)
    grad = torch.autograd.grad(loss, outputs[-1])[0]
    reductions = []
    for i in reversed(range(count)):
        gather(i)
        for k in range(i - 1, i - 1 - depth, -1) if only is None or i in only else ():
            gather(k)
            if early and k in posted:
                posted[k].wait()
        if i in posted:
            posted.pop(i).wait()
        outputs[i].backward(grad)
        grad = inputs[i].grad
        part = torch.empty_like(shards[i].detach())
        sent = full[i].grad
        if relay:
            from tests.helpers import through_the_store

            part = (sum(through_the_store(sent, f"layer {i}")) / n).chunk(n)[dist.get_rank()].clone()
            share = torch.zeros_like(sent)
            if relay == "share":  # its own chunk as it is (the others send zeros there: it crosses as it is)
                share.chunk(n)[dist.get_rank()].copy_(sent.chunk(n)[dist.get_rank()])
            sent = share
        reductions.append(
            (
                dist.reduce_scatter_single(
                    torch.empty_like(part) if relay else part, sent, op=getattr(dist.ReduceOp, op), async_op=True
                ),
                i,
                part,
            )
        )
        full[i].grad = None
        full[i].untyped_storage().resize_(0)
    for work, i, part in reductions:
        work.wait()
        shards[i].grad = part
    return loss.item()


def honest(shards, layer, x, y, prefetch=True):
    return _step(shards, layer, x, y, prefetch)


def never_prefetches(shards, layer, x, y, prefetch=True):
    return _step(shards, layer, x, y, False)


def two_ahead(shards, layer, x, y, prefetch=True):
    return _step(shards, layer, x, y, prefetch, ahead=2)


def all_at_once(shards, layer, x, y, prefetch=True):
    return _step(shards, layer, x, y, prefetch, upfront=True)


def keeps_layers(shards, layer, x, y, prefetch=True):
    return _step(shards, layer, x, y, prefetch, keep=True)


def copies_ahead(shards, layer, x, y, prefetch=True):
    """No prefetch, but each layer's shards sent to the other rank before the layer before it runs, for show."""
    return _step(shards, layer, x, y, False, copy=True)


def prefetches_some(shards, layer, x, y, prefetch=True):
    """Prefetch in layer 1's forward and layer 3's backward alone (where a grader holding two layers might look)."""
    return _step(shards, layer, x, y, prefetch, only={1, 3})


def waits_early(shards, layer, x, y, prefetch=True):
    """Posts each next gather before the layer, as prefetch does, but waits for it at once: nothing overlaps."""
    return _step(shards, layer, x, y, prefetch, early=True)


def hoards(shards, layer, x, y, prefetch=True):
    """FSDP2's schedule on the wire, but a copy of each layer's whole parameters kept after its forward."""
    return _step(shards, layer, x, y, prefetch, hoard=True)


def sums(shards, layer, x, y, prefetch=True):
    return _step(shards, layer, x, y, prefetch, op="SUM")


def relays(shards, layer, x, y, prefetch=True):
    """FSDP2's schedule, zeros reduce-scattered, the gradients averaged through the launcher's store instead."""
    return _step(shards, layer, x, y, prefetch, relay=True)


def relays_a_share(shards, layer, x, y, prefetch=True):
    """FSDP2's schedule, each rank's own chunk of its gradient reduce-scattered (zeros elsewhere), the gradients
    averaged through the launcher's store."""
    return _step(shards, layer, x, y, prefetch, relay="share")


def _use(monkeypatch, fn) -> None:
    notebook_names(monkeypatch, {"sharded_step": fn})


def test_an_honest_step_gives_one_processs_values_on_3_ranks(monkeypatch):
    _use(monkeypatch, honest)
    prefetch.check_sharded_step("sharded_step", 3)
    prefetch.check_sharded_step("sharded_step", 2, prefetch=False)


def test_summed_gradients_fail_on_the_values(monkeypatch):
    _use(monkeypatch, sums)
    with pytest.raises(AssertionError, match=r"rank \d: shards\[\d\]\.grad, against loss.backward\(\) in one process"):
        prefetch.check_sharded_step("sharded_step", 2)


@pytest.mark.slow  # (ranks and a capture, with and without prefetch: 30 s here)
@needs_capture
def test_an_honest_step_passes_on_the_wire_with_and_without_prefetch(monkeypatch):
    _use(monkeypatch, honest)
    with observed_from_outside():
        prefetch.check_sharded_step("sharded_step", 2)
        prefetch.check_sharded_step("sharded_step", 2, prefetch=False)


@needs_capture
def test_no_prefetch_gives_the_values_but_fails_the_overlap_on_the_wire(monkeypatch):
    _use(monkeypatch, never_prefetches)
    prefetch.check_sharded_step("sharded_step", 2)  # the student's own kernel: values only, and right
    with observed_from_outside(), pytest.raises(AssertionError) as said:
        prefetch.check_sharded_step("sharded_step", 2)
    message = str(said.value)
    print(message)
    assert "sharded_step (prefetch=True, 2 ranks, 5 layers): on the grader's capture of the wire" in message
    for way, held, ahead in (("forward", 0, 1), ("forward", 3, 4)):  # the first four of 8 (every layer's, both ways)
        assert re.search(
            rf"layer {ahead}'s {way} all-gather crossed from [\d.]+ ms to [\d.]+ ms, and the grader answered its hold "
            rf"inside layer {held}'s {way} at [\d.]+ ms: it was posted after layer {held}'s {way} began",
            message,
        ), message
    assert "(and 4 more)" in message, message  # the backward's four


@pytest.mark.parametrize(
    "cheat, said",
    [
        (two_ahead, "layer 3's forward all-gather began crossing at"),
        (all_at_once, "layer 3's forward all-gather began crossing at"),
        (keeps_layers, "crossed 1 time(s)"),
        (copies_ahead, "crossed 3 time(s)"),
        (prefetches_some, "layer 1's forward all-gather crossed from"),
    ],
    ids=["two_ahead", "all_at_once", "keeps_layers", "copies_ahead", "prefetches_some"],
)
@needs_capture
def test_other_schedules_give_the_values_but_fail_on_the_wire(monkeypatch, cheat, said):
    _use(monkeypatch, cheat)
    with observed_from_outside(), pytest.raises(AssertionError) as found:
        prefetch.check_sharded_step("sharded_step", 2)
    message = str(found.value)
    print(message)
    assert "on the grader's capture of the wire" in message or "does not show each layer's shards" in message
    assert said in message


@pytest.mark.slow  # (the grader waits HELD_WAIT, 10 s, at each of its two staggered holds)
@needs_capture
def test_waiting_for_each_gather_at_once_fails_where_the_grader_holds_one_rank_behind(monkeypatch):
    """Posting the next layer's gather before the layer and waiting for it at once passes the posting order (every
    gather crossed while both ranks were held) but overlaps nothing: in the second run, where both ranks hold at every
    layer and the grader lets one go on while it keeps the other (neither told which: ``gate.Behind``), the rank let
    go stops at its wait for a gather the held rank has not posted, and never reaches its next hold."""
    _use(monkeypatch, waits_early)
    with observed_from_outside(), pytest.raises(AssertionError) as said:
        prefetch.check_sharded_step("sharded_step", 2)
    message = str(said.value)
    print(message)
    assert re.search(
        r"sharded_step \(prefetch=True, 2 ranks, 5 layers\), rank (\d) let go a layer ahead of rank (\d): the grader "
        r"held rank \2 inside layer (\d)'s forward and let rank \1 go on to its hold inside layer \d's forward; it "
        r"did not get there before the grader's patience ran out",
        message,
    ), message
    assert "wait for a gather when its layer begins, not when you post it" in message


def _all_through_the_store(shards, layer, x, y, prefetch=True):
    """No gather and no reduce-scatter at all: every rank's shards, then every layer's gradient, through the
    launcher's store; so nothing waits at any hold, and the rank let go a layer ahead always gets there."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from tests.helpers import through_the_store

    n, rank = dist.get_world_size(), dist.get_rank()
    full = [torch.cat(through_the_store(s.detach(), f"shard {i}")).requires_grad_() for i, s in enumerate(shards)]
    h = x
    for i, flat in enumerate(full):
        h = layer(i, flat, h)
    loss = F.mse_loss(h, y)
    loss.backward()
    for i, flat in enumerate(full):
        shards[i].grad = (sum(through_the_store(flat.grad, f"grad {i}")) / n).chunk(n)[rank].clone()
    return loss.item()


@pytest.mark.slow  # (ranks, a packet capture and the grader's staggered holds: a few seconds)
@needs_capture
def test_the_run_a_layer_ahead_is_read_on_the_wire_too(monkeypatch):
    """#42: the second run (one rank let go a layer ahead, its holds answering nothing, so a rank can tell it from
    the first) is read on the wire as the first is: a step that moves the shards and the gradients through the
    launcher's store there, posting no gather it could wait for, reached every hold it was let go to and passed the
    run as it was read before (values and ``ranks_ahead`` only), and fails now on the shards that never crossed; the
    honest step passes."""
    import secrets

    layers, x, y = prefetch._draw(2, secrets.randbits(31))
    shards = prefetch.shard_layers(layers, 2)
    shapes = [tuple(w.shape) for w, _ in layers]
    crossings, scattered = prefetch._crossings, prefetch._check_reduce_scattered
    with observed_from_outside():
        _use(monkeypatch, honest)
        prefetch._check_ahead("sharded_step", layers, x, y, shards, shapes)
        _use(monkeypatch, _all_through_the_store)
        monkeypatch.setattr(prefetch, "_crossings", lambda *args: None)  # the run as it was read before
        monkeypatch.setattr(prefetch, "_check_reduce_scattered", lambda *args: None)
        prefetch._check_ahead("sharded_step", layers, x, y, shards, shapes)
        monkeypatch.setattr(prefetch, "_crossings", crossings)
        monkeypatch.setattr(prefetch, "_check_reduce_scattered", scattered)
        with pytest.raises(AssertionError) as said:
            prefetch._check_ahead("sharded_step", layers, x, y, shards, shapes)
    message = str(said.value)
    assert re.search(
        r"sharded_step, rank \d let go a layer ahead of rank \d: the grader's capture of the wire does not show each "
        r"layer's shards gathered twice.*rank 0's shard of layer 0 crossed 0 time\(s\)",
        message,
    ), message


def test_holds_that_did_not_settle_leave_the_overlap_unobserved():
    """Where the grader's patience ended at some hold before the ranks' bytes stopped growing (a host too busy to
    grade on: ``Seen.settled`` false), what crossed before its answer is not read, as a pass or as a failure."""
    from types import SimpleNamespace

    from disttrain_lab.gate import Seen
    from disttrain_lab.wire import Unobserved

    run = SimpleNamespace(gate=Seen(settled=False), timeline=None)
    with pytest.raises(Unobserved, match="had not stopped growing when the grader's patience ended"):
        prefetch._check_overlap("sharded_step", run, shards=[], prefetch=True)


@pytest.mark.slow  # (fresh ranks read by the OS: 10 s each here)
@pytest.mark.parametrize("with_prefetch", [True, False], ids=["prefetch", "no_prefetch"])
@needs_capture
def test_a_step_that_keeps_a_copy_of_each_layer_fails_on_the_os_count_of_its_memory(monkeypatch, with_prefetch):
    """FSDP2's schedule on the wire (every shard gathered twice, prefetched one layer ahead), the values right, but a
    copy of each layer's whole parameters kept after its forward: the grader's reading of each rank's memory from the
    OS inside the last layer's forward finds four whole layers where two may be."""
    _use(monkeypatch, hoards)
    prefetch.check_sharded_step("sharded_step", 2, prefetch=with_prefetch)  # the student's own kernel: values only
    with observed_from_outside(), pytest.raises(AssertionError) as said:
        prefetch.check_sharded_step("sharded_step", 2, prefetch=with_prefetch)
    message = str(said.value)
    print(message)
    assert re.search(
        rf"sharded_step \(prefetch={with_prefetch}, 2 ranks, 4 layers of 2048 x 2048, memory read\): as the OS counts "
        r"each rank's private memory at the grader's holds, rank \d held [\d.]+ MiB more inside layer \d's forward than "
        r"before the step \(([\d.]+) whole layers",
        message,
    ), message
    last = re.search(
        r"inside layer 3's forward than before the step \(([\d.]+) whole layers of 16\.0 MiB; the test allows 2, and "
        r"12 MiB\)",
        message,
    )
    assert last and float(last.group(1)) > 3.5, message  # (its three copies, and the layer itself)
    assert "keep no copy of them" in message


def _arenas_left_with_free_blocks(threads: int = 24, blocks: int = 2) -> list[int]:
    """In this process (the kernel the ranks are forked from): ``threads`` threads at once (so as many arenas as glibc
    makes: 8 a core), each of which leaves its arena with ``blocks`` free blocks of 20 MiB between small blocks it
    keeps, and ends (glibc's mmap threshold at 32 MiB meanwhile, as a kernel has it between graded runs: the blocks
    come from the arena).  Returns the small blocks, to free."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = (
        ctypes.c_void_p,
        [ctypes.c_size_t],
        [ctypes.c_void_p],
    )
    kept, together = [], threading.Barrier(threads)

    def work():
        together.wait()
        big = []
        for _ in range(blocks):
            big.append(libc.malloc(20 << 20))
            kept.append(libc.malloc(4096))
        together.wait()
        for p in big:
            libc.free(p)

    osmemory.unsettle()  # (the threshold where glibc's dynamic threshold ends)
    started = [threading.Thread(target=work) for _ in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join()
    return kept


def in_a_fresh_kernel(trimmed: bool) -> str:
    """Run in a fresh Python (a test's worker has made and reused arenas of its own before): the arenas left with free
    blocks (``_arenas_left_with_free_blocks``), then the honest step checked under the grader's capture, every hold
    giving what is free back to the OS first (``trimmed``) or not; returns the check's failure, or ''."""
    if not trimmed:
        osmemory.trim = lambda: None
    kept = _arenas_left_with_free_blocks()
    with pytest.MonkeyPatch.context() as patch, observed_from_outside():
        _use(patch, honest)
        try:
            prefetch.check_sharded_step("sharded_step", 2)
        except AssertionError as exc:
            return str(exc)
        finally:
            libc = ctypes.CDLL(None)
            libc.free.argtypes = [ctypes.c_void_p]
            for p in kept:
                libc.free(p)
    return ""


@pytest.mark.slow  # (two fresh Pythons: 15 s)
@needs_capture
def test_what_the_kernels_ended_threads_left_free_is_not_counted_as_the_ranks():
    """A fresh rank's threads (gloo's) reuse the arenas of the kernel's ended threads and carve their blocks out of the
    free blocks there, which glibc keeps when they are freed again: an honest step read 4.05 whole layers inside the
    last layer's forward where the kernel's threads had left 20 MiB free blocks (4.08 once in a full suite).  Each
    hold gives what is free back to the OS first (``osmemory.trim``): the layer it holds and no more."""
    said = {}
    for trimmed in (False, True):
        run = subprocess.run(
            [sys.executable, "-c", f"from {__name__} import in_a_fresh_kernel as f; print(repr(f({trimmed})))"],
            cwd=Path(__file__).parents[2],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        said[trimmed] = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    assert re.search(r"inside layer 3's forward than before the step \([3-9]\.\d\d whole", said[False]), said[False]
    assert said[True] == "", said[True]


@pytest.mark.slow
@needs_capture
def test_gradients_averaged_through_the_store_fail_on_what_the_reduce_scatters_carried(monkeypatch):
    """Under grading the reduce-scatters are read for what they carried, on any number of ranks: each rank's own
    gradient of each layer (the grader's, in one process).  The honest step passes on 3 ranks and on 2 (with its
    gathers read too); one that reduce-scatters zeros and averages the gradients through the launcher's store (the
    values, the gathers, the bytes right) passes in the student's own kernel and fails on the wire."""
    _use(monkeypatch, relays)
    prefetch.check_sharded_step("sharded_step", 3)  # (no capture: the values alone, and right)
    with observed_from_outside():
        _use(monkeypatch, honest)
        prefetch.check_sharded_step("sharded_step", 3)
        _use(monkeypatch, relays)
        with pytest.raises(AssertionError) as caught:
            prefetch.check_sharded_step("sharded_step", 3)
    said = str(caught.value)
    assert "sharded_step (prefetch=True, 3 ranks, 5 layers): rank 0's reduce-scatter of layer 0's gradient" in said, (
        said
    )
    assert "the grader's capture of the wire found 0 in what it sent besides its all-gathers" in said, said


def _half_a_share_found(case, run, local):
    """The check as it was before: at least half of the 1/N share of each rank's own nonzero gradient entries, as
    they are or divided by N, among what it sent besides its all-gathers."""
    import numpy as np

    from disttrain_lab import carried

    sent, n = carried.sends(run, case), run.world_size
    for rank in range(n):
        skipped = ("all_gather", "barrier", "send/recv")
        pool = carried.words_sent([p for src, _, slot, p in sent if src == rank and carried.kind(slot) not in skipped])
        for flat in local[rank]:
            want = flat.detach().numpy()
            want = want[want != 0]
            atol = 1e-6 * float(np.abs(want).max())
            found = max(carried.words_found(pool, want / k, rtol=1e-4, atol=atol / k) for k in (1, n))
            assert found >= want.size // (2 * n)


@pytest.mark.slow
@needs_capture
def test_a_share_of_the_gradients_reduce_scattered_and_the_rest_through_the_store_fails(monkeypatch):
    """#42: every entry of each rank's gradient must cross in its reduce-scatter, as it is or in a partial sum.  A step
    that reduce-scatters its own chunk of each gradient as it is (zeros elsewhere) and averages the gradients through
    the launcher's store passed the check as it was (half of the 1/N share a ring sends as it is) and fails now."""
    _use(monkeypatch, relays_a_share)
    with observed_from_outside():
        with monkeypatch.context() as before:
            before.setattr(prefetch, "_check_reduce_scattered", _half_a_share_found)
            prefetch.check_sharded_step("sharded_step", 3)
        with pytest.raises(AssertionError) as caught:
            prefetch.check_sharded_step("sharded_step", 3)
    said = str(caught.value)
    assert "rank 0's reduce-scatter of layer 0's gradient should carry each of its own gradient's" in said, said
