"""Bytes a rank actually holds: parameters, gradients, optimizer state — measured, not predicted.

ZeRO's promise is about memory, so Lab 4 grades memory the way it grades communication:
from what the rank really holds.  :func:`held` walks the model's parameters and their
``.grad``, and every tensor reachable from the objects you pass (an optimizer, a ZeRO
wrapper, their attributes, lists and dicts, any ``torch.optim.Optimizer`` inside and its
``state``), and adds up the bytes of their *storages*, each storage once: a view into a
flat buffer costs the whole buffer, two views of one buffer cost it once, a storage
resized to 0 costs nothing.

    held = dl.memory.held(model, optimizer)       # after backward, before step
    held.parameters, held.gradients, held.optimizer_state, held.other, held.total

A storage is counted in the first of these that holds it: a model parameter's data
(``parameters``), a gradient (``.grad`` of a parameter or of any tensor an optimizer
updates: ``gradients``), a tensor in an optimizer's ``state`` (``optimizer_state``),
anything else reachable from the objects passed (``other``: flat buffers, saved copies).
Distributed tensors (``DTensor``, as torch FSDP uses) count their local shard.

:class:`SavedActivations` counts what autograd keeps for the backward pass (activations), by
layer, as it is saved (``torch.autograd.graph.saved_tensors_hooks``): the same on CPU as on a GPU.

:class:`ParameterWatch` records, at each layer's forward and backward, the parameter bytes
each layer holds at that moment: ZeRO-3 must hold a layer's full parameters only while
that layer runs.

This module measures; what ZeRO *should* hold (the 16Ψ arithmetic) is the lab's exercise.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .events import format_bytes

__all__ = [
    "Held",
    "held",
    "tensor_bytes",
    "storage_key",
    "ParameterWatch",
    "Snapshot",
    "layers_with_parameters",
    "SavedActivations",
]

_MAX_DEPTH = 8  # how deep held() follows attributes, lists and dicts from an object passed


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory this rank holds: a DTensor's local shard, else ``t`` itself."""
    return t.to_local() if hasattr(t, "_local_tensor") else t


def storage_key(t: torch.Tensor) -> tuple[int, int, str]:
    """(address, bytes, device) of the storage under ``t``: equal for tensors that share memory."""
    t = _local(t)
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes(), str(t.device)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors`` (views of one buffer count it once).

    >>> flat = torch.zeros(10)
    >>> tensor_bytes([flat[:5], flat[5:]]), tensor_bytes([torch.zeros(3)])
    (40, 12)
    """
    return sum(key[1] for key in {storage_key(t) for t in tensors if t is not None})


@dataclass
class Held:
    """Bytes one rank holds, by role (see the module docstring for which role wins)."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.other

    def as_dict(self) -> dict[str, int]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer_state,
            "other": self.other,
            "total": self.total,
        }

    def __str__(self) -> str:
        return ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in self.as_dict().items())


class _Walk:
    """Every tensor reachable from some objects, and which ones an optimizer keeps as state."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.tensors: list[torch.Tensor] = []
        self.state: list[torch.Tensor] = []

    def visit(self, obj: Any, depth: int = 0, in_state: bool = False) -> None:
        if depth > _MAX_DEPTH or id(obj) in self.seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            return
        self.seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            (self.state if in_state else self.tensors).append(obj)
            return
        if isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                self.visit(group.get("params", []), depth + 1)
            for value in obj.state.values():
                self.visit(value, depth + 1, in_state=True)
            self.visit_attributes(obj, depth)  # a wrapper optimizer (ZeroRedundancyOptimizer) holds another
            return
        if isinstance(obj, nn.Module):
            self.tensors.extend(obj.parameters())
            self.tensors.extend(obj.buffers())
            return
        if isinstance(obj, dict):
            for key, value in obj.items():
                self.visit(key, depth + 1, in_state)
                self.visit(value, depth + 1, in_state)
            return
        if isinstance(obj, (list, tuple, set, frozenset)):
            for value in obj:
                self.visit(value, depth + 1, in_state)
            return
        if isinstance(obj, (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
            return  # code, not data (and never walk a module's globals)
        self.visit_attributes(obj, depth)

    def visit_attributes(self, obj: Any, depth: int) -> None:
        try:
            attributes = vars(obj)
        except TypeError:
            return
        for name, value in attributes.items():
            if name not in ("param_groups", "state", "defaults"):  # an Optimizer's own fields were seen above
                self.visit(value, depth + 1)


def held(model: nn.Module, *holders: Any) -> Held:
    """Bytes this rank holds for ``model`` and the objects in ``holders`` (optimizers, wrappers).

    Call it inside a launched rank, e.g. after ``loss.backward()`` (gradients present) and
    again after ``optimizer.step()``.

        >>> model = dl.models.MLP([4, 8, 2]); opt = torch.optim.Adam(model.parameters())
        >>> torch.nn.functional.mse_loss(model(torch.ones(3, 4)), torch.zeros(3, 2)).backward(); opt.step()
        >>> dl.memory.held(model, opt)        # 58 parameters of fp32: 232 B each for data, grads; 464 B of Adam moments
        Held(parameters=232, gradients=232, optimizer_state=480, other=0)
    """
    walk = _Walk()
    params = list(model.parameters())
    walk.seen.update(id(p) for p in params)
    for holder in holders:
        if holder is not model:
            walk.visit(holder)
    reachable = [*params, *walk.tensors]
    roles = (
        ("parameters", params),
        ("gradients", [t.grad for t in reachable if t.grad is not None]),
        ("optimizer_state", walk.state),
        ("other", walk.tensors),
    )
    counted: set[tuple] = set()
    result = Held()
    for role, tensors in roles:
        keys = {storage_key(t) for t in tensors} - counted
        counted |= keys
        setattr(result, role, sum(key[1] for key in keys))
    return result


# --------------------------------------------------------------------------------------
# Parameter bytes per layer while forward and backward run (the ZeRO-3 property)
# --------------------------------------------------------------------------------------
def layers_with_parameters(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that own parameters directly (``recurse=False``), by qualified name: ZeRO-3's units."""
    return {name: m for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}


@dataclass
class Snapshot:
    """Parameter bytes each layer held at one moment."""

    moment: str  # "forward" (just before the layer's forward runs), "after forward",
    # "backward" (just before the layer's backward runs)
    layer: str  # the layer that is about to run / just ran
    bytes_by_layer: dict[str, int] = field(default_factory=dict)

    def full_layers(self, full_bytes: dict[str, int]) -> list[str]:
        """Layers that hold at least their full parameter size (``full_bytes[name]``) right now."""
        return [name for name, b in self.bytes_by_layer.items() if b >= full_bytes[name]]


class ParameterWatch:
    """Record the parameter bytes every layer holds at each layer's forward and backward.

    Install it *after* the strategy that wraps the model (its hooks then run after the
    strategy's: "forward" is seen once the layer's parameters are gathered, "after forward"
    once they are freed again)::

        watch = dl.memory.ParameterWatch(model)
        loss_fn(model(x), y).backward()
        watch.remove()
        for snap in watch.snapshots: print(snap.moment, snap.layer, snap.bytes_by_layer)

    "backward" is recorded from a hook on the layer's output gradient, i.e. just before the
    layer's own backward runs.
    """

    def __init__(self, model: nn.Module) -> None:
        self.layers = layers_with_parameters(model)
        self.snapshots: list[Snapshot] = []
        self._handles = []
        for name, layer in self.layers.items():
            self._handles.append(
                layer.register_forward_pre_hook(lambda m, args, name=name: self._record("forward", name))
            )
            self._handles.append(
                layer.register_forward_hook(lambda m, args, output, name=name: self._after_forward(name, output))
            )

    def bytes_by_layer(self) -> dict[str, int]:
        return {name: tensor_bytes(layer.parameters(recurse=False)) for name, layer in self.layers.items()}

    def _record(self, moment: str, name: str) -> None:
        self.snapshots.append(Snapshot(moment, name, self.bytes_by_layer()))

    def _after_forward(self, name: str, output) -> None:
        self._record("after forward", name)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self._record("backward", name))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> ParameterWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class SavedActivations:
    """Bytes autograd saves for backward while the block runs: the activations, measured.

    Every tensor an operation saves for its backward passes through
    ``torch.autograd.graph.saved_tensors_hooks``; each storage is counted once, in the
    innermost module of ``model`` running when it was first saved, and the model's own
    parameters (saved by every linear layer, but held anyway) are left out::

        with dl.memory.SavedActivations(model) as saved:
            loss = model(x).sum()
        saved.total, saved.by_layer      # bytes; {"blocks.0.attn": ..., ...}

    Count one forward per block: the graph keeps what it saved alive, so storages are not
    reused while it lives.  ``saved.tensors`` lists ``(layer, shape, dtype, bytes)`` per storage.

    Run backward inside the block too, and ``saved.peak`` is the most bytes of saved tensors
    the graph held at once over forward *and* backward: a storage is held from its first save
    until backward has used every save of it (autograd frees a node's saved tensors once the
    node has run), which is what recomputation changes (a checkpointed segment's activations
    are saved again in backward, and held only while its backward runs)::

        with dl.memory.SavedActivations(model) as saved:
            loss = model(x).sum()
            loss.backward()
        saved.peak, saved.alive          # the most held at once; what is still held (0 here)

    ``torch.utils.checkpoint(..., use_reentrant=False)`` saves through hooks of its own, which
    hide what it saves from these; its reentrant variant (and a ``torch.autograd.Function``) does not.
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self.model = model
        self.by_layer: dict[str, int] = {}
        self.tensors: list[tuple[str, tuple, torch.dtype, int]] = []
        self._seen: set = set()
        self.alive = 0  # bytes of saved storages the graph holds now
        self.peak = 0  # the most it held at once
        self._held: dict[tuple, list[int]] = {}  # storage -> [bytes, saves of it backward has not used yet]
        self._stack = [""]
        self._handles = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._parameters = {storage_key(p) for p in model.parameters()} if model is not None else set()

    @property
    def total(self) -> int:
        return sum(self.by_layer.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key in self._parameters:
            return t
        if key not in self._seen:
            self._seen.add(key)
            layer = self._stack[-1]
            self.by_layer[layer] = self.by_layer.get(layer, 0) + key[1]
            self.tensors.append((layer, tuple(t.shape), t.dtype, key[1]))
        if key in self._held:
            self._held[key][1] += 1
        else:
            self._held[key] = [key[1], 1]
            self.alive += key[1]
            self.peak = max(self.peak, self.alive)
        return t

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        # backward uses a saved tensor once per save; after the last use autograd lets it go
        key = storage_key(t)
        held = self._held.get(key)
        if held is not None:
            held[1] -= 1
            if held[1] == 0:
                self.alive -= held[0]
                del self._held[key]
        return t

    def _enter(self, name: str) -> None:  # hooks return None: a value would replace the input/output
        self._stack.append(name)

    def _leave(self) -> None:
        self._stack.pop()

    def __enter__(self) -> SavedActivations:
        if self.model is not None:
            for name, module in self.model.named_modules():
                self._handles.append(module.register_forward_pre_hook(lambda m, a, name=name: self._enter(name)))
                self._handles.append(module.register_forward_hook(lambda m, a, out: self._leave()))
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
