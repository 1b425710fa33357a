"""What runs on lab 7's ranks: the helpers the drivers import there (public: the hidden tests'
own drivers use them too; none uses the notebook's names), and the drivers themselves, whose source is
sent to the student's kernel and defined there among the notebook's names."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ... import models
from .common import _HOOK_SIZES


# --------------------------------------------------------------------------------------
# What the drivers import in the ranks (public: code that runs elsewhere uses it, the hidden
# tests' own drivers too; none of it uses the notebook's names)
# --------------------------------------------------------------------------------------
def compress_steps(ef, grads) -> list:
    """``ef`` (an ErrorFeedback) compressing each gradient in turn: what it sent at each step, and its
    residual after it."""
    steps = []
    for grad in grads:
        values, indices = ef.compress(grad)
        residual = ef.residual
        steps.append((values, indices, residual.clone() if isinstance(residual, torch.Tensor) else residual))
    return steps


def hook_namespaces(topk_hook) -> list[dict]:
    """Where the notebook's topk_hook, and the ErrorFeedback.compress and sparse_all_reduce it calls,
    look their names up (in this rank), each once."""
    spaces = {id(topk_hook.__globals__): topk_hook.__globals__}
    for name in ("ErrorFeedback", "sparse_all_reduce"):
        for fn in (topk_hook.__globals__.get(name), getattr(topk_hook.__globals__.get(name), "compress", None)):
            if hasattr(fn, "__globals__"):
                spaces[id(fn.__globals__)] = fn.__globals__
    return list(spaces.values())


def train_watched(hook, state, x, y, density, steps, sizes=_HOOK_SIZES, lr=0.1) -> dict:
    """torch DDP on this rank's (x, y) with ``hook`` (and ``state``), each of its calls watched: (the
    future's type, its value's shape and dtype, the bucket's, and at density 1 the bucket's gradient and
    the future's value); the losses and the trained parameters."""
    model = DistributedDataParallel(models.MLP(list(sizes), seed=0))
    seen = []

    def watched(state, bucket):
        gradient = bucket.buffer().clone()
        fut = hook(state, bucket)
        future = isinstance(fut, torch._C.Future)  # torch.futures.Future, or torch._C.Future (work.get_future())
        value = fut.wait() if future else None
        shape = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
        keep = density >= 1 and isinstance(value, torch.Tensor)
        seen.append(
            (
                "Future" if future else type(fut).__name__,
                shape,
                (tuple(gradient.shape), gradient.dtype),
                gradient if keep else None,
                value.clone() if keep else None,
            )
        )
        return fut

    model.register_comm_hook(state, watched)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach() for p in model.parameters()], "seen": seen}


# --------------------------------------------------------------------------------------
# Drivers: run in the student's kernel, among the notebook's names (their source is sent)
# --------------------------------------------------------------------------------------
def _topk_round_trip(flat, density):
    """Driver (runs in your kernel): topk_compress of flat, and topk_decompress of what it gave."""
    values, indices = topk_compress(flat, density)  # noqa: F821  (the notebook's)
    return values, indices, topk_decompress(values, indices, flat.numel())  # noqa: F821  (the notebook's)


def _feedback_steps(density, grads):
    """Driver (runs in your kernel): one ErrorFeedback(density) compressing each gradient in turn;
    what it sent at each step, and its residual after it."""
    from disttrain_lab.labtests.lab07.ranks import compress_steps

    return compress_steps(ErrorFeedback(density), grads)  # noqa: F821  (the notebook's)


def _quantize_case(flat, chunk_size):
    """Driver (runs in your kernel): quantize_int8 of flat rounding to nearest, and dequantize_int8 of it;
    then 400 stochastic roundings from one seeded generator, each dequantized."""
    q, scales = quantize_int8(flat, chunk_size)  # noqa: F821  (the notebook's)
    gen = torch.Generator().manual_seed(1)
    runs = torch.stack(
        [dequantize_int8(*quantize_int8(flat, chunk_size, True, gen), chunk_size) for _ in range(400)]  # noqa: F821
    )
    return q, scales, dequantize_int8(q, scales, chunk_size), runs  # noqa: F821  (the notebook's)


def _train_topk(x, y, density, error_feedback, steps, sizes=(16, 64, 64, 4), lr=0.1):
    """Driver (runs in your kernel, on every rank): torch DDP on this rank's (x, y) with your topk_hook,
    each of its calls watched: (the future's type, its value's shape and dtype, the bucket's, and at
    density 1 the bucket's gradient and the future's value)."""
    from disttrain_lab.labtests.lab07.ranks import train_watched

    state = TopKState(density, error_feedback=error_feedback)  # noqa: F821  (the notebook's)
    return train_watched(topk_hook, state, x, y, density, steps, sizes, lr)  # noqa: F821  (the notebook's)


def _train_replayed(averages, sizes=_HOOK_SIZES, lr=0.1):
    """The grader's replay, launched here: the same DDP training, each step's bucket gradient the average
    ``averages[step]`` that the ranks' hooks' all-gathers carried (read from the wire, in DDP's bucket layout, as
    the hook saw it); this rank's losses."""
    model = DistributedDataParallel(models.MLP(list(sizes), seed=0))
    step = [0]

    def from_the_wire(_, bucket):
        future = torch.futures.Future()
        future.set_result(averages[step[0]].to(bucket.buffer().dtype).reshape(bucket.buffer().shape))
        return future

    model.register_comm_hook(None, from_the_wire)
    data = models.regression_data(256, sizes[0], sizes[-1], seed=1)
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = data.x[rank::n], data.y[rank::n]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step[0] in range(len(averages)):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _train_dense(steps, sizes=_HOOK_SIZES, lr=0.1):
    """The reference, launched here: the same training with DDP's own all-reduce (default_hooks.allreduce_hook)."""
    model = DistributedDataParallel(models.MLP(list(sizes), seed=0))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    data = models.regression_data(256, sizes[0], sizes[-1], seed=1)
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = data.x[rank::n], data.y[rank::n]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach() for p in model.parameters()]}
