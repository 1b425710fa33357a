"""Lab 14's exercise 2 (``running``): ``run_order`` on real ranks, checked against one process and on the wire.

On p = 2 ranks, v = 2 chunks each, m = 4 micro-batches of torch's Interleaved1F1B (tiny widths), each run a few
seconds, with the ranks' own timeout (60 s, as lab 5's) so that none can hang:

- an honest ``run_order`` (written here, running its order literally: dist.isend forward and back, dist.recv
  in the order's order) passes, with the grader's capture of the wire (``observed_from_outside``, root only);
- one that ignores its order and runs GPipe (every forward, then every backward) gives the right gradients and
  loss but fails the order on the wire: rank 0's 0F3 follows 2B0 in interleaved 1F1B, and in GPipe its activation
  crosses before any gradient can have come back;
- one that sends an extra tensor fails on the wire (a payload that is no activation or gradient);
- one that does not scale each micro-batch's loss by 1/m fails on the values (no capture needed).
"""

from __future__ import annotations

import os
import re

import pytest

from disttrain_lab.labtests.lab14 import running
from tests.helpers import notebook_names, observed_from_outside

P, V, M = 2, 2, 4
SCHEDULE = "Interleaved1F1B"
needs_capture = pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")


def _run(chunks, order, x, y, micro_batches, scale=True, junk=False):
    """``run_order`` as the exercise asks, the order run literally: F receives its input from the previous stage's
    rank (unless stage 0), sends its output on; B receives its output's gradient (unless the last stage, whose loss
    is F.mse_loss / m), sends its input's gradient back.  Sends are isend, waited at the end: blocking sends both
    ways could wait on each other."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank, p = dist.get_rank(), dist.get_world_size()
    last = len(chunks) * p - 1
    xs, ys = x.tensor_split(micro_batches), y.tensor_split(micro_batches)
    inputs, outputs, sends, loss = {}, {}, [], 0.0
    for action in order:
        stage, kind, j = re.fullmatch(r"(\d+)([FB])(\d+)", action).groups()
        stage, j = int(stage), int(j)
        chunk = chunks[stage // p]
        if kind == "F":
            h = xs[j]
            if stage > 0:
                h = torch.empty(len(xs[j]), chunk[0].in_features)
                dist.recv(h, src=(stage - 1) % p)
                h.requires_grad_()
            out = chunk(h)
            inputs[stage, j], outputs[stage, j] = h, out
            if stage < last:
                sent = out.detach()
                sends.append((dist.isend(sent, dst=(stage + 1) % p), sent))
        else:
            out, h = outputs.pop((stage, j)), inputs.pop((stage, j))
            if stage == last:
                scaled = F.mse_loss(out, ys[j]) / (micro_batches if scale else 1)
                scaled.backward()
                loss += scaled.item()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, src=(stage + 1) % p)
                out.backward(grad)
            if stage > 0:
                sends.append((dist.isend(h.grad, dst=(stage - 1) % p), h.grad))
    for work, _ in sends:
        work.wait()
    if junk:  # one tensor more, rank 0 to rank 1
        extra = torch.full((7,), 0.5)
        dist.send(extra, dst=1) if rank == 0 else dist.recv(extra, src=0) if rank == 1 else None
    return loss if last % p == rank else None


def honest(chunks, order, x, y, micro_batches):
    return _run(chunks, order, x, y, micro_batches)


def gpipe(chunks, order, x, y, micro_batches):
    """Ignores ``order``: every forward (chunk by chunk), then every backward (last chunk first)."""
    import torch.distributed as dist

    rank, p, v = dist.get_rank(), dist.get_world_size(), len(chunks)
    forwards = [f"{c * p + rank}F{j}" for c in range(v) for j in range(micro_batches)]
    backwards = [f"{c * p + rank}B{j}" for c in reversed(range(v)) for j in range(micro_batches)]
    return _run(chunks, forwards + backwards, x, y, micro_batches)


def with_junk(chunks, order, x, y, micro_batches):
    return _run(chunks, order, x, y, micro_batches, junk=True)


def unscaled(chunks, order, x, y, micro_batches):
    return _run(chunks, order, x, y, micro_batches, scale=False)


def _use(monkeypatch, fn) -> None:
    """``fn`` as the notebook's run_order (the driver finds it in ``__main__``, where the student's code runs)."""
    notebook_names(monkeypatch, {"run_order": fn})


@needs_capture
def test_an_honest_run_passes_on_the_wire(monkeypatch):
    _use(monkeypatch, honest)
    with observed_from_outside():
        running.check_run_order("run_order", P, V, M, SCHEDULE)


@needs_capture
def test_gpipe_gives_the_values_but_fails_the_order_on_the_wire(monkeypatch):
    _use(monkeypatch, gpipe)
    running.check_run_order("run_order", P, V, M, SCHEDULE)  # the student's own kernel: values only, and right
    with observed_from_outside(), pytest.raises(AssertionError) as said:
        running.check_run_order("run_order", P, V, M, SCHEDULE)
    message = str(said.value)
    print(message)
    # (which early messages the message lists first depends on timing; that one is early is causal: GPipe's 0F3
    # crosses before rank 1 can have run any backward, where interleaved 1F1B's rank 0 runs 0F3 after 2B0)
    assert (
        "run_order (Interleaved1F1B on 2 ranks, 2 chunks each, 4 micro-batches): the ranks did not run the order"
        in (message)
    )
    assert re.search(
        r"rank \d sent stage \d's activation of micro-batch \d \(its action \d+, \dF\d\) at [\d.]+ ms, before stage \d's "
        r"(activation|input gradient) of micro-batch \d had arrived \([\d.]+ ms\)",
        message,
    )


@needs_capture
def test_an_extra_message_fails_on_the_wire(monkeypatch):
    _use(monkeypatch, with_junk)
    with observed_from_outside(), pytest.raises(AssertionError) as said:
        running.check_run_order("run_order", P, V, M, SCHEDULE)
    message = str(said.value)
    print(message)
    assert "1 payload(s) equal to no activation or input gradient of a correct run: rank 0 -> rank 1, 28 bytes" in (
        message
    )


def test_an_unscaled_loss_fails_on_the_values(monkeypatch):
    _use(monkeypatch, unscaled)
    with pytest.raises(AssertionError) as said:
        running.check_run_order("run_order", P, V, M, SCHEDULE)
    message = str(said.value)
    print(message)
    assert "against loss.backward() on the whole model in one process" in message
    assert "values differ from the expected ones" in message
