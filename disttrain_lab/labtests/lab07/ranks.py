"""What runs on lab 7's ranks: the helpers the drivers import there (public: the hidden tests'
own drivers use them too; none uses the notebook's names), and the drivers themselves, whose source is
sent to the student's kernel and defined there among the notebook's names."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
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


def _first_qs(state, bucket, rank: int, min_compression_rate: float, seed: int = 0) -> None:
    """Exercise 6's first Qs in torch's ``powerSGD_hook``'s state: each compressed gradient's (m × r') drawn by the
    exercise's rule (``torch.randn(m, r', generator=...)``, one generator seeded ``seed``, the bucket's compressed
    gradients in order), laid out as torch keeps them (its gradients grouped by shape), with its P memory, so that
    torch's hook warm-starts from them instead of drawing its own."""
    generator, drawn = torch.Generator().manual_seed(seed), []
    for grad in bucket.gradients():
        n, m = grad.view(grad.shape[0], -1).shape
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            drawn.append(((n, m), torch.randn(m, r, generator=generator)))
    shapes = list(dict.fromkeys(shape for shape, _ in drawn))
    ordered = [q for shape in shapes for at, q in drawn if at == shape]
    state.q_memory_dict[bucket.index()] = torch.cat([q.reshape(-1) for q in ordered])
    state.p_memory_dict[bucket.index()] = torch.empty(sum(n * q.shape[1] for (n, _), q in drawn))


def _torch_powersgd_sent(rank: int, steps: int, sizes=(9, 17, 11, 5), lr: float = 0.1) -> list[torch.Tensor]:
    """The grader's reference for exercise 6, launched here: the training of the notebook's ``_watch_powersgd``
    (the same MLP, data, SGD and one bucket) with torch's own ``powerSGD_hook`` at matrix rank ``rank``, warm-started
    from the exercise's first Qs (``_first_qs``); what this rank put into each all-reduce, in order, as the call was
    made (a copy): the plain steps' buckets (torch's divided by the world size first), then at each compressed step
    the uncompressed gradients, the Ps and the Qs."""
    model = DistributedDataParallel(models.MLP(list(sizes), seed=0), bucket_cap_mb=100)
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=2,
        min_compression_rate=2,
        use_error_feedback=True,
        warm_start=True,
    )

    def hook(state, bucket):
        if state.iter >= state.start_powerSGD_iter and bucket.index() not in state.p_memory_dict:
            _first_qs(state, bucket, rank, state.min_compression_rate)
        return powerSGD_hook.powerSGD_hook(state, bucket)

    model.register_comm_hook(state, hook)
    data = models.regression_data(64, sizes[0], sizes[-1], seed=1)
    x, y = data.x[dist.get_rank() :: dist.get_world_size()], data.y[dist.get_rank() :: dist.get_world_size()]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    sent, all_reduce = [], dist.all_reduce

    def recorded(tensor, *args, **kwargs):
        sent.append(tensor.detach().clone())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recorded  # (torch's hooks call torch.distributed.all_reduce by name; only this rank's)
    try:
        for _ in range(steps):
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
    finally:
        dist.all_reduce = all_reduce
    return sent
