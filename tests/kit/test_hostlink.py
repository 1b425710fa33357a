"""disttrain_lab.hostlink: an emulated host link takes the α–β time, one copy at a time per direction,
both directions at once, and logs what crossed."""

from __future__ import annotations

import time

import pytest
import torch

import disttrain_lab as dl
from disttrain_lab.hostlink import HostLink


def test_pcie_preset():
    pcie = dl.Network.preset("PCIe 4.0 x16")
    assert pcie.bandwidth == 2.5e10 and pcie.latency == 10e-6 and "PCIe" in str(pcie)


def test_a_copy_takes_the_model_time_and_is_logged():
    link = HostLink(dl.Network(latency=0.01, bandwidth=4e4))  # 4000 B: 0.01 + 0.1 s
    source = torch.arange(1000, dtype=torch.float32)
    start = time.perf_counter()
    future = link.copy(source, "down")
    # at once: well inside the 0.11 s the copy models (a copy that waited for it would take all of it;
    # 0.05 s, the bound before, was missed by 0.3 ms once on a loaded host)
    assert time.perf_counter() - start < 0.1, "copy must return at once"
    source.zero_()  # the copy was taken when copy() was called
    out = future.result()
    assert time.perf_counter() - start >= 0.11
    assert torch.equal(out, torch.arange(1000, dtype=torch.float32))
    [t] = link.log
    # the log holds the model's time (start + 0.01 + 4000 / 4e4), exact but for float rounding
    assert (t.direction, t.nbytes) == ("down", 4000) and t.end - t.start == pytest.approx(0.11)
    half = link.copy(source, "up", dtype=torch.float16).result()
    assert half.dtype == torch.float16 and link.bytes("up") == 2000 and link.bytes() == 6000
    link.reset()
    assert link.log == [] and link.bytes() == 0
    link.close()


def test_one_lane_per_direction_full_duplex():
    # copies of 0.25 s each, so that the second down is asked for while the first is carried even on a busy
    # host (at 0.05 s, a loaded run once asked for it 36 ms after the first had ended)
    latency = 0.25
    with HostLink(dl.Network(latency=latency, bandwidth=1e12)) as link:
        start = time.perf_counter()
        futures = [link.copy(torch.ones(1), d) for d in ("down", "down", "up")]
        for f in futures:
            f.result()
        took = time.perf_counter() - start
    # two downs one after the other (2 L); the up beside them, not after them (3 L).  Read from the link's
    # log, not from the wall clock's total: on a loaded host the threads' wake-ups add to it (0.15 s was
    # once too little beside a CI run)
    assert took >= 2 * latency, took
    downs = sorted((t for t in link.log if t.direction == "down"), key=lambda t: t.start)
    [up] = [t for t in link.log if t.direction == "up"]
    assert downs[1].start >= downs[0].end and downs[1].requested < downs[0].end
    assert up.start < downs[1].end, (up, downs)  # (carried beside the downs: one lane would start it after)


def test_bad_direction_says_which_are_valid():
    with HostLink() as link, pytest.raises(ValueError, match="down"):
        link.copy(torch.ones(1), "sideways")
