"""Lab 14's exercise 2: ``run_order``, one rank's share of a pipeline order run on real ranks, graded against one
process (the values) and on the grader's capture of the wire (the order).

The student writes ``run_order(chunks, order, x, y, micro_batches) -> float | None``, called on every rank:

- ``chunks``: this rank's model chunks (``nn.Sequential`` stages), in chunk order; placement "loop" (Narayanan
  et al. 2021 §2.2.2): on p ranks, chunk c of rank r is stage c·p + r of the p·v stages;
- ``order``: this rank's actions in torch's spelling, run one after another ("2F1": stage 2's forward of
  micro-batch 1; "2B1" its full backward);
- ``x`` (batch, d_in) and ``y`` (batch, d_out): the whole batch, on every rank; micro-batch j is
  ``x.tensor_split(micro_batches)[j]`` (equal rows here);
- the loss of micro-batch j, on the last stage: ``F.mse_loss(out, y_j) / micro_batches``, written so (the wire
  check names each message by its exact bytes: another spelling of the same loss moves the gradients' last bits);
- F of stage s, j sends its output with ``dist.send``/``dist.isend`` to the rank holding s + 1 (received there with
  ``dist.recv``), B sends its input's gradient back to the rank holding s − 1;
- the parameters' gradients accumulate in their ``.grad`` over the micro-batches (as ``loss.backward()`` leaves
  them), and the rank holding the last stage returns the loss (the sum of the scaled micro-batch losses, a
  float), every other rank None.

That is the shape of torch's ``PipelineScheduleMulti.step`` (gradients left in ``.grad``, the loss on the last
stage) and of lab 5's step functions, for a schedule given as data (torch's ``_PipelineScheduleRuntime`` runs a
``pipeline_order`` so).

    >>> run_order([stage0, stage2], ["0F0", "0F1", "2F0", ...], x, y, micro_batches=4)  # rank 0 of 2
    None

The graded check (:func:`check_run_order`) draws a Linear/Tanh MLP of 2·p·v Linear layers (float32, two per
stage) and a batch with a fresh seed, runs the notebook's ``run_order`` on p ranks through a driver that builds
each rank's chunks from its own weights only and gives back, as data, every ``.grad`` and the loss; then (a)
compares those with ``loss.backward()`` on the whole model in one process, micro-batch by micro-batch with the
same scaling; (b) under grading, checks the order on the wire (``wireorder.check_order_on_wire``): every
activation and input gradient, as the grader computes them in one process stage by stage (float32, bit for bit
what a correct rank sends), crossed once, and no rank sent a message before what its order had waited for by
then had arrived.  The launch's own traffic does not show: a graded run's ranks make no barrier or other
collective around the notebook's function (``worker.py``; results come back through the pool, not the group),
so the only bytes between ranks besides the messages are gloo's handshake and notes, which ``wireorder`` reads
as such.
"""

from __future__ import annotations

import secrets

import torch
import torch.nn.functional as F
from torch import nn

from ... import checks
from .. import common
from .common import seen
from .model import stage_module
from .orders import SCHEDULES, check_order, rank_and_chunk, torch_order
from .wireorder import check_order_on_wire, reference_messages

__all__ = ["TOLERANCE", "TIMEOUT", "check_run_order"]

TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # float32, as lab 5: micro-batch gradients add up in another order
TIMEOUT = 60.0  # seconds for the run: a few tiny MLPs' micro-batches and their messages
ROWS = 2  # rows per micro-batch
D_IN, D_OUT = 5, 3  # the model's input and output widths; the hidden ones vary (6, 7, 8, ...): uneven messages

_HINT = (
    "does every rank post its receives in its own order's order, each send matching a receive on the rank holding "
    "the next (or previous) stage? Blocking sends both ways can wait on each other: dist.isend, waited at the end, "
    "cannot"
)


# What crosses: the driver (dl.exercise.run defines it where the notebook's code runs) -----------------------------


def _run_order_in_rank(layers, order, x, y, micro_batches):
    """A driver: this rank's chunks built from ``layers`` (per chunk, its Linear layers as (weight, bias, Tanh
    after it)), the notebook's run_order on them, and, as data, every parameter's .grad per chunk (None where
    unset) and what run_order returned (a tensor detached; anything else as it came, for the grader to refuse)."""
    import torch
    from torch import nn

    chunks = []
    for chunk in layers:
        modules = []
        for w, b, tanh in chunk:
            linear = nn.Linear(w.shape[1], w.shape[0], dtype=w.dtype)
            with torch.no_grad():
                linear.weight.copy_(w)
                linear.bias.copy_(b)
            modules += [linear, nn.Tanh()] if tanh else [linear]
        chunks.append(nn.Sequential(*modules))
    loss = run_order(chunks, list(order), x, y, micro_batches)  # noqa: F821  (the notebook's)
    grads = [[None if q.grad is None else q.grad.detach().clone() for q in chunk.parameters()] for chunk in chunks]
    return {"grads": grads, "loss": loss.detach().clone() if isinstance(loss, torch.Tensor) else loss}


# The grader's model and data ----------------------------------------------------------------------------------------


def _widths(p: int, v: int) -> list[int]:
    """D_IN, then 2·p·v − 1 hidden widths 6, 7, 8, 6, ..., then D_OUT: stage s's output is widths[2s + 2]."""
    return [D_IN] + [6 + i % 3 for i in range(2 * p * v - 1)] + [D_OUT]


def _draw(p: int, v: int, m: int, seed: int) -> tuple[list[list[tuple[torch.Tensor, torch.Tensor, bool]]], ...]:
    """Per stage, its two Linear layers as (weight, bias, Tanh after it: all but the model's last layer), and the
    batch x (ROWS·m, D_IN), y (ROWS·m, D_OUT); float32, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    widths = _widths(p, v)
    layers = [
        (torch.randn(d_out, d_in, generator=g) / d_in**0.5, torch.randn(d_out, generator=g) / 4, i < len(widths) - 2)
        for i, (d_in, d_out) in enumerate(zip(widths[:-1], widths[1:]))
    ]
    stages = [layers[2 * s : 2 * s + 2] for s in range(p * v)]
    x = torch.randn(ROWS * m, D_IN, generator=g)
    y = torch.randn(ROWS * m, D_OUT, generator=g)
    return stages, x, y


def _one_process(stages, x: torch.Tensor, y: torch.Tensor, m: int) -> tuple[list[list[torch.Tensor]], float]:
    """Each stage's parameters' gradients and the loss, from ``loss.backward()`` on the whole model, one micro-batch
    at a time, each loss scaled by 1/m (the gradients accumulate)."""
    modules = [stage_module(layers) for layers in stages]
    model = nn.Sequential(*modules)
    loss = 0.0
    for xs, ys in zip(x.tensor_split(m), y.tensor_split(m)):
        scaled = F.mse_loss(model(xs), ys) / m
        scaled.backward()
        loss += scaled.item()
    return [[q.grad for q in module.parameters()] for module in modules], loss


def _messages(stages, x: torch.Tensor, y: torch.Tensor, m: int) -> tuple[dict, dict]:
    """What a correct run sends, computed as the ranks compute it (float32, stage by stage, each stage's input a
    leaf of its own): ``acts[(s, j)]``, stage s's output of micro-batch j, and ``grads[(s, j)]``, the gradient of
    stage s's input, ``out.backward(grad)`` from the last stage's ``F.mse_loss(out, y_j) / m`` down."""
    modules = [stage_module(layers) for layers in stages]
    last = len(modules) - 1
    acts, grads = {}, {}
    for j, (xs, ys) in enumerate(zip(x.tensor_split(m), y.tensor_split(m))):
        inputs, outputs, h = [], [], xs
        for s, module in enumerate(modules):
            h = h.detach().requires_grad_(s > 0)
            inputs.append(h)
            h = module(h)
            outputs.append(h)
            if s < last:
                acts[s, j] = h.detach().clone()
        (F.mse_loss(outputs[last], ys) / m).backward()
        for s in range(last, 0, -1):
            grads[s, j] = inputs[s].grad.detach().clone()
            if s > 1:
                outputs[s - 1].backward(grads[s, j])
    return acts, grads


# Reading what came back (untrusted data) ---------------------------------------------------------------------------


def _check_values(case: str, results, stages, x, y, p: int, v: int, m: int) -> None:
    """(a): every chunk's parameters' .grad and the last stage's loss, against one process."""
    want_grads, want_loss = _one_process(stages, x, y, m)
    names = [name for name, _ in stage_module(stages[0]).named_parameters()]
    last_rank = rank_and_chunk(p * v - 1, p)[0]
    for rank, found in enumerate(results):
        if type(found) is not dict or set(found) != {"grads", "loss"} or type(found["grads"]) is not list:
            raise AssertionError(f"{case}: expected the driver's record from rank {rank}, got {seen(found)}")
        if len(found["grads"]) != v or any(type(g) is not list or len(g) != len(names) for g in found["grads"]):
            raise AssertionError(
                f"{case}: rank {rank}: expected {len(names)} gradients for each of its {v} chunks from the driver, "
                f"got {seen(found['grads'])}"
            )
        for c, got in enumerate(found["grads"]):
            s = c * p + rank
            for name, grad, want in zip(names, got, want_grads[s]):
                what = f"{case}: rank {rank}, chunk {c} (stage {s}): {name}.grad"
                if grad is None:
                    raise AssertionError(
                        f"{what} is None; every micro-batch's backward must reach every parameter of every chunk"
                    )
                checks.assert_close(
                    grad,
                    want,
                    what=(
                        f"{what}, against loss.backward() on the whole model in one process (each micro-batch's "
                        f"loss F.mse_loss(out, y_j) / {m}; gradients accumulate over the micro-batches)"
                    ),
                    **TOLERANCE,
                )
        loss = found["loss"]
        if rank != last_rank:
            if loss is not None:
                raise AssertionError(
                    f"{case}: rank {rank} returned {seen(loss)}; only the rank holding the last stage "
                    f"(rank {last_rank}) returns the loss, every other rank None"
                )
        elif type(loss) is not float or not abs(loss - want_loss) <= TOLERANCE["atol"] + TOLERANCE["rtol"] * abs(
            want_loss
        ):
            raise AssertionError(
                f"{case}: rank {rank} (the last stage's) returned loss {seen(loss)}; the sum of the micro-batches' "
                f"F.mse_loss(out, y_j) / {m} is {want_loss:.6f} (a float: loss.item())"
            )


# The graded check ----------------------------------------------------------------------------------------------------


def check_run_order(case: str, p: int, v: int, m: int, schedule: str) -> None:
    """Exercise 2, ``run_order(chunks, order, x, y, micro_batches)``, on p ranks of v chunks each (placement
    "loop"), m micro-batches of ROWS rows, running torch's ``schedule`` (``orders.torch_order``: "GPipe" only
    with v = 1; "Interleaved1F1B" ...), with weights and a batch the grader draws.  (a) Every chunk's .grad and
    the last stage's loss are one process's (``loss.backward()`` on the whole model, each micro-batch's loss
    scaled by 1/m), to ``TOLERANCE``; (b) under grading, the grader's capture of the wire shows each activation
    and input gradient crossing once, nothing else, and each rank running its order
    (``wireorder.check_order_on_wire``).  ``case`` starts every message (e.g. "run_order").  In the student's
    own kernel (no capture) only (a) is checked; where grading could not capture the wire, ``wire.Unobserved``
    is raised, never a pass."""
    if schedule not in SCHEDULES or SCHEDULES[schedule] != "loop":
        loops = [name for name, placement in SCHEDULES.items() if placement == "loop"]
        raise ValueError(f"schedule {schedule!r}: run_order runs placement 'loop'; valid schedules are {loops}")
    order = torch_order(schedule, p, v, m)
    check_order(order, p, v, m, "loop")
    if any(a.kind not in ("F", "B") for actions in order for a in actions):
        raise ValueError(f"schedule {schedule!r}: run_order runs F and B only; its order has I or W")
    stages, x, y = _draw(p, v, m, secrets.randbits(31))  # weights nobody sees before the run
    inputs = [
        ([stages[c * p + r] for c in range(v)], [str(a) for a in order[r]], x, y, m)  # rank r: its chunks only
        for r in range(p)
    ]
    label = f"{case} ({schedule} on {p} ranks, {v} chunks each, {m} micro-batches)"
    run = common.run_or_fail(_run_order_in_rank, p, inputs, label, _HINT, timeout=TIMEOUT, timeline=True, content=True)
    checks.assert_point_to_point(run, case)
    _check_values(label, run.results, stages, x, y, p, v, m)
    if run.timeline.source != "trace":  # grading: the order, on the wire the grader captured
        acts, grads = _messages(stages, x, y, m)
        reference = reference_messages(acts, grads, p, v, m, "loop")
        check_order_on_wire(label, run.timeline, order, p, v, m, "loop", reference)
