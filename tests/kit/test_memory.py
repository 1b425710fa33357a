"""disttrain_lab.memory: bytes a rank holds, measured from its tensors' storages.

- held() counts parameters, gradients, optimizer state and other reachable tensors, each
  storage once (views share, resized-to-0 storages cost nothing), in a single process and
  for torch's own sharded optimizers (ZeroRedundancyOptimizer, FSDP's DTensors) on 2 ranks.
- ParameterWatch sees a layer's parameters gathered in its forward and backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import disttrain_lab as dl
from disttrain_lab import memory


def _trained(optimizer_class=torch.optim.Adam, sizes=(4, 8, 2)):
    model = dl.models.MLP(list(sizes), seed=0)
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    nn.functional.mse_loss(model(torch.ones(3, sizes[0])), torch.zeros(3, sizes[-1])).backward()
    optimizer.step()
    return model, optimizer


def test_tensor_bytes_counts_each_storage_once():
    flat = torch.zeros(10)
    assert memory.tensor_bytes([flat[:5], flat[5:], flat]) == 40
    assert memory.tensor_bytes([torch.zeros(3), torch.zeros(3, dtype=torch.float64), None]) == 12 + 24
    empty = torch.zeros(6)
    empty.untyped_storage().resize_(0)
    assert memory.tensor_bytes([empty]) == 0


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_held_adam_and_sgd():
    model, adam = _trained()
    psi = sum(p.numel() for p in model.parameters())  # 58
    held = memory.held(model, adam)
    # Adam: m and v per parameter, plus a 4-byte step counter per parameter tensor
    assert held.as_dict() == {
        "parameters": 4 * psi,
        "gradients": 4 * psi,
        "optimizer_state": 8 * psi + 4 * 4,
        "other": 0,
        "total": 16 * psi + 16,
    }
    model, sgd = _trained(torch.optim.SGD)
    assert memory.held(model, sgd).optimizer_state == 0
    assert memory.held(model).gradients == 4 * psi and memory.held(model).optimizer_state == 0
    model.zero_grad(set_to_none=True)
    assert memory.held(model, sgd).gradients == 0


def test_held_follows_a_wrapper_and_classifies_what_it_keeps():
    model = dl.models.MLP([4, 8, 2], seed=0)
    psi = sum(p.numel() for p in model.parameters())

    class Wrapper:  # shards as views into the parameters, their own grads, a spare buffer
        def __init__(self):
            self.views = [p.detach().view(-1)[:2] for p in model.parameters()]
            for v in self.views:
                v.grad = torch.zeros(2)
            self.inner = {"adam": torch.optim.Adam(self.views, lr=0.1)}
            self.buffers = [torch.zeros(5)]
            self.callback = lambda: None
            self.module = torch  # a module attribute is never walked

    wrapper = Wrapper()
    wrapper.inner["adam"].step()
    held = memory.held(model, wrapper)
    assert held.parameters == 4 * psi  # the views share the parameters' storage
    assert held.gradients == 4 * 2 * 4  # the views' grads; the model has none
    assert held.optimizer_state == 4 * (2 * 2 * 4 + 4)
    assert held.other == 20
    assert "other 20 B" in str(held)


def _torch_sharded(kind: str):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = dl.models.MLP([6, 10, 4], seed=0)
    psi = sum(p.numel() for p in model.parameters())
    if kind == "zero":
        forward = nn.parallel.DistributedDataParallel(model)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
    else:
        for layer in memory.layers_with_parameters(model).values():
            fully_shard(layer)
        fully_shard(model)
        forward, optimizer = model, torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.mse_loss(forward(torch.ones(4, 6)), torch.zeros(4, 4)).backward()
        optimizer.step()
    return psi, memory.held(model, optimizer).as_dict()


def test_held_sees_torch_sharding_on_two_ranks():
    # ZeroRedundancyOptimizer partitions whole parameters; FSDP shards each on dim 0 (DTensor local shards)
    for kind in ("zero", "fsdp"):
        results = dl.launch(_torch_sharded, 2, kind, timeout=60)
        psi = results[0][0]
        state = sum(r[1]["optimizer_state"] for r in results)
        assert 8 * psi <= state <= 8 * psi + 2 * 64, (kind, results)
        for _, held in results:
            if kind == "zero":
                assert held["parameters"] == 4 * psi and held["gradients"] == 4 * psi, held
            else:
                assert held["parameters"] < 4 * psi and held["gradients"] < 4 * psi, held


def test_parameter_watch_sees_each_layer_run():
    model = dl.models.MLP([3, 5, 2], seed=0)
    watch = memory.ParameterWatch(model)
    assert list(watch.layers) == ["0", "2"]
    nn.functional.mse_loss(model(torch.ones(2, 3)), torch.zeros(2, 2)).backward()
    watch.remove()
    assert [(s.moment, s.layer) for s in watch.snapshots] == [
        ("forward", "0"),
        ("after forward", "0"),
        ("forward", "2"),
        ("after forward", "2"),
        ("backward", "2"),
        ("backward", "0"),
    ]
    full = {"0": 4 * (15 + 5), "2": 4 * (10 + 2)}
    assert all(s.bytes_by_layer == full and s.full_layers(full) == ["0", "2"] for s in watch.snapshots)
    model(torch.ones(1, 3))
    assert len(watch.snapshots) == 6, "remove() unhooks"


def _watch_in_rank():
    """A layer gathered only while it runs (as ZeRO-3 does): the watch sees it full exactly then."""
    layer = nn.Linear(4, 4)
    shape = layer.weight.shape
    layer.weight.data = layer.weight.data.reshape(-1)[:8].clone()  # "a shard"

    def gather(module, args):
        full = torch.empty(2 * 8)
        dist.all_gather_into_tensor(full, module.weight.data)
        module.weight.data = full.view(shape)

    def free(module, args, output):
        module.weight.data = module.weight.data.reshape(-1)[:8].clone()

    layer.register_forward_pre_hook(gather)
    layer.register_forward_hook(free)
    watch = memory.ParameterWatch(layer)
    layer(torch.ones(1, 4))
    return [(s.moment, s.bytes_by_layer[""]) for s in watch.snapshots]


def test_parameter_watch_measures_a_gathered_layer():
    for snapshots in dl.launch(_watch_in_rank, 2, timeout=30):
        assert snapshots == [("forward", 64 + 16), ("after forward", 32 + 16)], snapshots


def test_saved_activations_counts_what_backward_keeps_by_layer():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    with memory.SavedActivations(model) as saved:
        loss = model(x).sum()
    # linear 0 keeps its input (5x8), GELU its input (5x16), linear 2 its input (5x16);
    # the weights the linears also save are parameters, held anyway, and left out
    assert saved.by_layer == {"0": 5 * 8 * 4, "1": 5 * 16 * 4, "2": 5 * 16 * 4}
    assert saved.total == 800
    loss.backward()  # the hooks are gone and the graph still works
    assert model[0].weight.grad is not None


def test_saved_activations_peak_follows_recomputation_n_over_k_plus_k():
    """A chain of n equal layers (Linear, Tanh: one b×w tensor saved each), checkpointed every k layers with
    torch's reentrant checkpoint: backward holds the n/k segment inputs and, while it recomputes one segment,
    that segment's k outputs: (n/k + k) tensors at its peak (Chen et al. 2016), and nothing once it is over."""
    import torch.utils.checkpoint

    n, w, b = 16, 8, 4
    model = nn.Sequential(*[nn.Sequential(nn.Linear(w, w), nn.Tanh()) for _ in range(n)])
    x = torch.randn(b, w, requires_grad=True)
    one = b * w * 4
    with memory.SavedActivations(model) as saved:
        model(x).sum().backward()
    assert saved.peak == saved.total == (n + 1) * one and saved.alive == 0  # the input and n outputs, all at once
    for k in (1, 2, 4, 8, 16):
        with memory.SavedActivations(model) as saved:
            h = x
            for i in range(0, n, k):
                h = torch.utils.checkpoint.checkpoint(model[i : i + k], h, use_reentrant=True)
            forward_peak = saved.peak
            h.sum().backward()
        assert forward_peak == n // k * one, (k, forward_peak)  # the segments' inputs only
        assert saved.peak == (n // k + k) * one and saved.alive == 0, (k, saved.peak / one)
