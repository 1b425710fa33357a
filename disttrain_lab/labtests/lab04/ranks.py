"""What runs in a rank in lab 4's exercises 2-4: the graded models, building the notebook's ZeRO class
the way a user does and training with it (``train``), and the drivers that ``dl.exercise.run`` sends to the
student's kernel (defined there among the notebook's names, they call the notebook's classes by name and
import what they use from here), with the grader's ``shard_size`` and ``padded_flat`` that stand in for
exercise 2's."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ... import devices, gate, memory, models, osmemory
from .common import OPTIMIZERS, PAUSE_S, batches


def _model(kind: str, sizes: Sequence[int]) -> nn.Module:
    """The graded models: an MLP, one with a frozen first layer, a fine-tuned one (its first layer trains only its
    bias, the next linear layer is frozen: at least 3 layers), a tied autoencoder (sizes = [d, hidden, d])."""
    if kind == "mlp":
        return models.MLP(sizes, seed=0)
    if kind == "frozen":
        return models.PartlyFrozenMLP(sizes, seed=0)
    if kind == "finetuned":
        model = models.MLP(sizes, seed=0)
        for p in [model[0].weight, *model[2].parameters()]:
            p.requires_grad_(False)
        return model
    if kind == "tied":
        return models.TiedAutoencoder(d=sizes[0], hidden=sizes[1], seed=0)
    raise ValueError(f"kind must be 'mlp', 'frozen', 'finetuned' or 'tied', got {kind!r}")


def _shared(model: nn.Module) -> list:
    """The parameters used by more than one layer: the tied autoencoder's weight (its encoder's, used again by
    the decoder step in the model's own forward)."""
    return [model.encoder.weight] if isinstance(model, models.TiedAutoencoder) else []


def _build(cls, stage: int, model: nn.Module, opt: str):
    """What a user writes: ZeRO-1/2 wrap an optimizer like ZeroRedundancyOptimizer; ZeRO-3 wraps the model
    like fully_shard, and the optimizer is built on its parameters (the shards).  Returns (forward, optimizer)."""
    optimizer_class, defaults, _ = OPTIMIZERS[opt]
    if stage == 3:
        wrapped = cls(model, shared=_shared(model))
        if not isinstance(wrapped, nn.Module) or getattr(wrapped, "module", None) is not model:
            raise TypeError(
                f"{cls.__name__}(model, shared=...) should be an nn.Module whose .module is the model it wraps"
            )
        return wrapped, optimizer_class(wrapped.parameters(), **defaults)
    optimizer = cls(model.parameters(), optimizer_class, **defaults)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{cls.__name__}(params, optimizer_class, **defaults) should be a torch.optim.Optimizer, "
            f"like ZeroRedundancyOptimizer (class {cls.__name__}(torch.optim.Optimizer))"
        )
    return model, optimizer


def train(cls, stage: int, kind: str, sizes: Sequence[int], steps: int, batch: int, opt: str) -> dict:
    """In a rank (the drivers call it: public, as what a driver imports): build the notebook's class ``cls``
    and train the model with optimizer ``opt`` for ``steps`` steps, each rank on its slice of the batch.  Returns
    data only: what the rank holds after the last backward, (stage 3) each layer's parameter bytes at every
    layer's forward and backward, and the model's parameters as the rank holds them after the last step (for
    stage 3, its shards: the test puts them together).  ``kind="paused"``: an MLP of ``sizes`` trained with a
    pause before the last step, where the grader reads the rank's memory from the OS (``held.py``); the seed of
    the elements it compares told at the grader's gate once the training is over (in the student's own kernel,
    no gate: given, ``"paused <seed>"``)."""
    if kind.startswith("paused"):  # ("paused <seed>": the grader's seed for the elements it compares)
        return _train_paused(cls, stage, sizes, steps, batch, opt, int(kind.split()[1]) if " " in kind else 0)
    rank, n = dist.get_rank(), dist.get_world_size()
    model = _model(kind, sizes).to(devices.device())
    full_bytes = {
        layer_name: 4 * sum(p.numel() for p in layer.parameters(recurse=False))
        for layer_name, layer in memory.layers_with_parameters(model).items()
    }
    forward, optimizer = _build(cls, stage, model, opt)
    watch = memory.ParameterWatch(model)  # after cls(...): its hooks run after the student's
    for step, (x, y) in enumerate(batches(sizes, batch, steps)):
        optimizer.zero_grad()
        watch.snapshots.clear()
        x, y = x.tensor_split(n)[rank].to(devices.device()), y.tensor_split(n)[rank].to(devices.device())
        F.mse_loss(forward(x), y).backward()
        if step == steps - 1:
            held = memory.held(model, optimizer, forward).as_dict()
        optimizer.step()
    watch.remove()
    return {
        "params": [p.detach().cpu() for p in model.parameters()],
        "held": held,
        "full_bytes": full_bytes,
        "snapshots": [(s.moment, s.layer, s.bytes_by_layer) for s in watch.snapshots],
    }


def _train_paused(cls, stage: int, sizes: Sequence[int], steps: int, batch: int, opt: str, seed: int = 0) -> dict:
    """``train`` for the memory case: nothing of the kit's in the rank but the model and the pauses
    (``osmemory.pause``, a ``time.sleep`` the grader ends once it has read the ranks): before the last step,
    between two steps, where what a rank keeps from one step to the next is all it holds; and, for stage 3,
    just before each layer's forward in the last step (a forward pre-hook registered after the student's:
    their layer gathered, the others not), then just before each layer's backward (a hook on the layer's
    output, put there by a forward hook registered after the student's: autograd runs it when the gradient
    reaches that output, after the student's own hooks on it).  Returns each parameter's sum and sum of
    squares (float64), and its values at the elements ``sampled`` from the grader's seed (under grading told at its
    gate after the last step, so that no rank can keep those elements alone exact; else ``seed``), as this rank
    holds it after the last step (stage 3: its shard, and of the sampled elements those in it)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = models.MLP(list(sizes), seed=0).to(devices.device())
    numels = [p.numel() for p in model.parameters()]
    forward, optimizer = _build(cls, stage, model, opt)
    layers = list(memory.layers_with_parameters(model).values()) if stage == 3 else []
    hooks: list = []
    for step, (x, y) in enumerate(batches(sizes, batch, steps)):
        if step == steps - 1:
            osmemory.pause(PAUSE_S)
            hooks = [layer.register_forward_pre_hook(_pause_before_layer) for layer in layers]
            hooks += [layer.register_forward_hook(_pause_before_backward) for layer in layers]
        optimizer.zero_grad()
        x, y = x.tensor_split(n)[rank].to(devices.device()), y.tensor_split(n)[rank].to(devices.device())
        out = forward(x)
        for hook in hooks:
            hook.remove()
        F.mse_loss(out, y).backward()
        optimizer.step()
    door = gate.connect(rank)  # (under grading: the grader tells the seed only now, the training over)
    if door is not None:
        door.start()  # (a mark; then a few bytes, the least the grader waits for before it answers a hold)
        dist.all_reduce(torch.zeros(4))
        seed = int(door.wait(torch.Size([1]))[0])
        door.close()
    samples = []
    for i, (p, numel) in enumerate(zip(model.parameters(), numels)):
        flat, at = p.detach().reshape(-1).cpu(), sampled(numel, seed + i)
        if stage == 3:  # this rank's shard: elements [rank·c, (rank + 1)·c) of the padded parameter
            lo = rank * flat.numel()
            at = at[(at >= lo) & (at < lo + flat.numel())] - lo
        samples.append(flat[at].double().tolist())
    return {
        "sums": [
            (float(p.detach().double().sum()), float(p.detach().double().square().sum())) for p in model.parameters()
        ],
        "samples": samples,
    }


SAMPLED = 2048  # elements of each parameter whose values the memory case returns (held.py)


def sampled(numel: int, seed: int, k: int = SAMPLED) -> torch.Tensor:
    """The elements (indices into the flattened parameter, sorted) whose values the memory case compares with one
    process's: all of a parameter of at most ``k``, else ``k`` drawn at random from ``seed`` (public: the
    grader draws the same)."""
    if numel <= k:
        return torch.arange(numel)
    return torch.randint(numel, (k,), generator=torch.Generator().manual_seed(seed)).sort().values


def _pause_before_layer(module: nn.Module, args) -> None:
    """A forward pre-hook (the memory case, stage 3): the ranks pause where the grader reads them."""
    osmemory.pause(PAUSE_S)


def _pause_before_backward(module: nn.Module, args, output) -> None:
    """A forward hook (the memory case, stage 3): the ranks pause again when the gradient reaches this
    layer's output, just before its backward (on a CPU autograd runs the hook in the thread that called
    ``backward()``, the main one, where the grader's signal ends the pause)."""
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(_pause_in_backward)


def _pause_in_backward(grad: torch.Tensor) -> None:
    osmemory.pause(PAUSE_S)


def _train_in_rank(name, stage, kind, sizes, steps, batch, opt):
    """The tests' driver (dl.exercise.run defines it where the notebook's code runs, and runs it in every rank):
    the notebook's class ``name``, built and trained there (``train``); returns data only."""
    from disttrain_lab.labtests.lab04.ranks import train

    if name == "Zero1Optimizer":
        cls = Zero1Optimizer  # noqa: F821  (the notebook's)
    elif name == "Zero2Optimizer":
        cls = Zero2Optimizer  # noqa: F821
    elif name == "Zero3Module":
        cls = Zero3Module  # noqa: F821
    else:
        raise ValueError(f"the tests train Zero1Optimizer, Zero2Optimizer or Zero3Module, not {name!r}")
    return train(cls, stage, kind, sizes, steps, batch, opt)


def reference_shard_size(numel: int, world_size: int) -> int:
    """The grader's ``shard_size`` (public: a driver imports it in the ranks): ceil(numel / world_size)."""
    return -(-numel // world_size)


def reference_padded_flat(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """The grader's ``padded_flat``: ``t`` flattened and zero-padded to world_size · shard_size elements."""
    flat = t.detach().reshape(-1)
    return F.pad(flat, (0, world_size * reference_shard_size(flat.numel(), world_size) - flat.numel()))


def _train_zero3_standing_in(name, stage, kind, sizes, steps, batch, opt):
    """The tests' driver for Zero3Module while exercise 2 (whose shard_size and padded_flat it uses) has not
    passed its graded test: the notebook's Zero3Module with the grader's two helpers in the place of the
    notebook's (where its methods look them up, in this rank), trained by ``train``; the notebook's put back."""
    from disttrain_lab.labtests.common import standing_in
    from disttrain_lab.labtests.lab04.ranks import reference_padded_flat, reference_shard_size, train

    helpers = {"shard_size": reference_shard_size, "padded_flat": reference_padded_flat}
    spaces = {id(f.__globals__): f.__globals__ for f in vars(Zero3Module).values() if hasattr(f, "__globals__")}  # noqa: F821
    with standing_in(helpers, list(spaces.values())):
        return train(Zero3Module, stage, kind, sizes, steps, batch, opt)  # noqa: F821  (the notebook's)
