"""What runs on lab 6's ranks: the helpers the drivers import there (public: the hidden tests'
own drivers use them too), and the drivers themselves, whose source is sent to the student's kernel
and defined there among the notebook's names."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ... import checks, models


# --------------------------------------------------------------------------------------
# What the drivers import in the ranks (public: code that runs elsewhere uses it, the hidden
# tests' own drivers too; none of it uses the notebook's names)
# --------------------------------------------------------------------------------------
def chunk(size: int, parts: int, index: int) -> slice:
    """The index-th of ``parts`` equal contiguous chunks of range(size)."""
    step = size // parts
    return slice(index * step, (index + 1) * step)


def tp_group(tp_size: int):
    """Groups of ``tp_size`` consecutive ranks (torch's own dist.new_subgroups); None: all ranks, one group."""
    if tp_size == dist.get_world_size():
        return None
    group, _ = dist.new_subgroups(tp_size)
    return group


def parameter_bytes(tensors) -> int:
    """Bytes of the tensors themselves (what an all-reduce of their gradients moves)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors``: a slice that is a view of the full weight
    costs the whole full weight."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def parameters_of(module: nn.Module) -> dict:
    """``module``'s parameters: name -> (value, gradient or None), copies."""
    return {
        name: (p.detach().clone(), None if p.grad is None else p.grad.clone()) for name, p in module.named_parameters()
    }


def batches_2d(sizes, batch, steps):
    """train_2d's data: ``steps`` batches of ``batch`` rows (the same in the ranks and in the reference)."""
    data = models.regression_data(batch * steps, sizes[0], sizes[-1], seed=7)
    return list(zip(data.x.split(batch), data.y.split(batch)))


class WholeColumnLinear(nn.Module):
    """The grader's stand-in for ``ColumnParallelLinear`` (exercise 3 is graded on it where exercise 1 has
    not passed): the same output, this rank's rows of ``full``, but it keeps the **whole** weight and
    slices it at every forward, so it saves nothing; handed in as exercise 1 it fails there (its weight is
    not the (out/t, in) slice)."""

    def __init__(self, full: nn.Linear, group=None):
        super().__init__()
        self.rows = chunk(full.out_features, dist.get_world_size(group), dist.get_rank(group))
        self.weight = nn.Parameter(full.weight.detach().clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight[self.rows], None if self.bias is None else self.bias[self.rows])


class WholeRowLinear(nn.Module):
    """The grader's stand-in for ``RowParallelLinear`` (as ``WholeColumnLinear``): this rank's partial
    sum, from the whole weight sliced at every forward; the bias on group rank 0."""

    def __init__(self, full: nn.Linear, group=None):
        super().__init__()
        position = dist.get_rank(group)
        self.columns = chunk(full.in_features, dist.get_world_size(group), position)
        self.weight = nn.Parameter(full.weight.detach().clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None and position == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight[:, self.columns], self.bias)


def _gathered_sum(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts).sum(dim=0)


class GatheredCopy(torch.autograd.Function):
    """The grader's stand-in for ``CopyToTensorParallel`` (f): the identity forward; backward, the sum of
    the group's gradients, made with an all-gather (not the all-reduce exercise 2 asks for: handed in as
    exercise 2 it fails there)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _gathered_sum(grad, ctx.group), None


class GatheredReduce(torch.autograd.Function):
    """The grader's stand-in for ``ReduceFromTensorParallel`` (g): the sum over the group, made with an
    all-gather; the identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _gathered_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


STAND_INS = {
    "ColumnParallelLinear": WholeColumnLinear,
    "RowParallelLinear": WholeRowLinear,
    "CopyToTensorParallel": GatheredCopy,
    "ReduceFromTensorParallel": GatheredReduce,
}


def mlp_run(mlp_class, sizes, batch, tp_size) -> dict:
    """In a rank: ``mlp_class`` (the notebook's TensorParallelMLP) built from the dense MLP, one forward and
    one backward, with a next_phase() between the phases; the output, the input's gradient, the parameters
    and their storage's bytes."""
    group = tp_group(tp_size)
    dense = models.MLP(sizes, seed=3)
    x = checks.sample_tensor((batch, sizes[0]), seed=4).requires_grad_()
    mlp = mlp_class(dense, group)
    next_phase()  # forward
    y = mlp(x)
    next_phase()  # backward
    y.backward(checks.sample_tensor((batch, sizes[-1]), seed=5))
    return {"y": y.detach(), "x grad": x.grad, "params": parameters_of(mlp), "bytes": storage_bytes(mlp.parameters())}


def next_phase():
    """A driver calls this between two phases of your code (building, forward, backward): a barrier
    of all ranks, where ``_phases`` splits each rank's trace."""
    dist.barrier()


def trained_2d_with(train_2d, mlp_class, sizes, batch, steps, tp_size):
    """In a rank: the student's ``train_2d`` on the dense MLP and the batches, with ``mlp_class`` in the
    place of the TensorParallelMLP it builds; the trained slices, their bytes and their storage's."""
    names = train_2d.__globals__  # what train_2d calls TensorParallelMLP, in this rank
    students = names.get("TensorParallelMLP")
    names["TensorParallelMLP"] = mlp_class
    try:
        model = train_2d(models.MLP(sizes, seed=11), batches_2d(sizes, batch, steps), tp_size, lr=0.1)
    finally:
        names["TensorParallelMLP"] = students
    return parameters_of(model), parameter_bytes(model.parameters()), storage_bytes(model.parameters())


# --------------------------------------------------------------------------------------
# Drivers: run in the student's kernel, among the notebook's names (their source is sent)
# --------------------------------------------------------------------------------------
def _linear_in_rank(d_in, d_out, batch, bias, tp_size):
    """The test's driver: both layers built from one full layer; the row layer gets this rank's slice of the input."""
    from disttrain_lab.labtests.lab06.ranks import chunk, parameters_of, storage_bytes, tp_group

    group = tp_group(tp_size)
    position, size = dist.get_rank(group), dist.get_world_size(group)
    full = models.MLP([d_in, d_out], seed=1, bias=bias)[0]
    x, dy = checks.sample_tensor((batch, d_in), seed=2), checks.sample_tensor((batch, d_out), seed=3)
    column, row = ColumnParallelLinear(full, group), RowParallelLinear(full, group)  # noqa: F821  (the notebook's)
    y_column, y_row = column(x), row(x[:, chunk(d_in, size, position)])
    y_column.backward(dy[:, chunk(d_out, size, position)])
    y_row.backward(dy)
    return {
        "y_column": y_column.detach(),
        "y_row": y_row.detach(),
        "column": parameters_of(column),
        "row": parameters_of(row),
        "column_bytes": storage_bytes(column.parameters()),
        "row_bytes": storage_bytes(row.parameters()),
    }


def _slices_held_in_rank(d, hidden, batch, seed):
    """The memory case's driver: ``ColumnParallelLinear`` of a d -> hidden layer and ``RowParallelLinear`` of a
    hidden -> d layer (``torch.manual_seed(seed)``, then torch's own initialisation), built on all ranks; the full
    layers dropped (``gc.collect()``) before the ranks pause (``osmemory.pause``, where the grader reads each rank's
    private memory from the OS); then this rank's partial sum of the two layers' output for one input (row's
    input: column's output, this rank's hidden features)."""
    import gc

    from disttrain_lab import osmemory
    from disttrain_lab.labtests.lab06.common import PAUSE_S

    torch.manual_seed(seed)
    first, second = nn.Linear(d, hidden), nn.Linear(hidden, d)
    column, row = ColumnParallelLinear(first), RowParallelLinear(second)  # noqa: F821  (the notebook's)
    del first, second
    gc.collect()
    osmemory.pause(PAUSE_S)
    with torch.no_grad():
        return row(column(checks.sample_tensor((batch, d), seed=seed + 1)))


def _build_layer(kind, d_in, d_out):
    """The test's driver: one of your layers, built from a full layer."""
    layer = {"column": ColumnParallelLinear, "row": RowParallelLinear}[kind]  # noqa: F821  (the notebook's)
    layer(nn.Linear(d_in, d_out))


def _f_g_in_rank(batch, d, tp_size):
    """The test's driver: f then g, forward and backward, with a next_phase() between the phases."""
    from disttrain_lab.labtests.lab06.ranks import next_phase, tp_group

    group, rank = tp_group(tp_size), dist.get_rank()
    same = checks.sample_tensor((batch, d), seed=1).requires_grad_()  # f's input: one X on every rank
    mine = checks.sample_tensor((batch, d), seed=10 + rank).requires_grad_()  # g's input: each rank's partial sum
    before = mine.detach().clone()
    next_phase()  # f forward
    out_f = CopyToTensorParallel.apply(same, group)  # noqa: F821  (the notebook's)
    next_phase()  # f backward
    out_f.backward(checks.sample_tensor((batch, d), seed=20 + rank))
    next_phase()  # g forward
    out_g = ReduceFromTensorParallel.apply(mine, group)  # noqa: F821  (the notebook's)
    next_phase()  # g backward
    out_g.backward(checks.sample_tensor((batch, d), seed=30 + rank))
    return {
        "f": out_f.detach(),
        "f grad": same.grad,
        "g": out_g.detach(),
        "g grad": mine.grad,
        "g input changed": not torch.equal(mine.detach(), before),
    }


def _mlp_in_rank(sizes, batch, tp_size):
    """The test's driver: your TensorParallelMLP built from the dense MLP, one forward and one backward,
    with a next_phase() between the phases (``mlp_run``)."""
    from disttrain_lab.labtests.lab06.ranks import mlp_run

    return mlp_run(TensorParallelMLP, sizes, batch, tp_size)  # noqa: F821  (the notebook's)


def _mlp_standing_in(sizes, batch, tp_size, replace):
    """The test's driver where exercise 1 or 2 has not passed: your TensorParallelMLP with the grader's
    stand-ins (``STAND_INS``) in the place of the notebook's classes named in ``replace``, where your code
    looks them up (in this rank); the notebook's put back after."""
    from disttrain_lab.labtests.common import standing_in
    from disttrain_lab.labtests.lab06.ranks import STAND_INS, mlp_run

    names = TensorParallelMLP.__init__.__globals__  # noqa: F821  (the notebook's)
    with standing_in({name: STAND_INS[name] for name in replace}, [names]):
        return mlp_run(TensorParallelMLP, sizes, batch, tp_size)  # noqa: F821


def _build_mlp(sizes):
    """The test's driver: your TensorParallelMLP built from a dense MLP."""
    TensorParallelMLP(models.MLP(sizes))  # noqa: F821  (the notebook's)


def _train_2d_in_rank(sizes, batch, steps, tp_size):
    """The test's driver: your train_2d on the dense MLP and the batches; the trained slices come back."""
    from disttrain_lab.labtests.lab06.ranks import batches_2d, parameter_bytes, parameters_of, storage_bytes

    model = train_2d(models.MLP(sizes, seed=11), batches_2d(sizes, batch, steps), tp_size, lr=0.1)  # noqa: F821
    return parameters_of(model), parameter_bytes(model.parameters()), storage_bytes(model.parameters())


def _call_parallel_groups(tp_size):
    """The test's driver: your parallel_groups (what it returns stays in the ranks)."""
    parallel_groups(tp_size)  # noqa: F821  (the notebook's)
