"""Detect a submission that replaced the functions grading relies on.

A graded test compares a student's function with torch's own ``dist.broadcast`` and
checks the trace; both are meaningless if the notebook replaced ``dist.all_reduce`` or a
``disttrain_lab.checks`` function.  At import we remember the genuine objects; later,
``find_tampering()`` lists every one that was swapped or whose code no longer lives in
torch's (or this package's) own files.  The launcher refuses to run, and checks refuse
to pass, when anything is listed.
"""

from __future__ import annotations

import os
import types

from .trace import TRACED_OPS, Event, Run, genuine_of

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_SNAPSHOT: dict[tuple[str, str], object] = {}  # (module, name) -> genuine object


class TamperingError(RuntimeError):
    """A function that grading relies on was replaced, so the result cannot be trusted."""


def _where(obj) -> str:
    code = getattr(obj, "__code__", None)
    if code is None:
        return type(obj).__name__
    name = code.co_filename
    if "ipykernel" in name or name.startswith("<"):
        return f"code defined in the notebook ({name})"
    return name


def _genuine_home(module_name: str) -> str:
    if module_name.startswith("disttrain_lab"):
        return _PACKAGE_DIR
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__))


def _unwrap(obj):
    # the tracer wraps torch.distributed's functions in launched ranks; that is allowed
    return genuine_of(obj)


def watch(module: types.ModuleType, names: list[str] | None = None) -> None:
    """Remember the current objects of ``module`` (all public callables by default)."""
    if names is None:
        names = [
            n for n, v in vars(module).items() if callable(v) and not n.startswith("_") and not isinstance(v, type)
        ]
    for name in names:
        if hasattr(module, name):
            genuine = _unwrap(getattr(module, name))
            _SNAPSHOT[(module.__name__, name)] = genuine
            _CODE[(module.__name__, name)] = _code_of(genuine)


_CODE: dict[tuple[str, str], tuple] = {}  # (module, name) -> (__code__, __defaults__, __kwdefaults__)


def _code_of(obj) -> tuple:
    # swapping __code__ (even for another genuine torch function's) or the defaults
    # changes what a function does while it stays the same object
    f = getattr(obj, "__func__", obj)
    return (
        getattr(f, "__code__", None),
        getattr(f, "__defaults__", None),
        dict(getattr(f, "__kwdefaults__", None) or {}),
    )


def watch_class(cls: type, label: str) -> None:
    """Remember every attribute in ``cls.__dict__`` (methods and operators such as
    ``Tensor.__eq__``): a check comparing tensors trusts them."""
    _CLASSES[label] = (cls, dict(vars(cls)))


_CLASSES: dict[str, tuple[type, dict]] = {}


def _class_changes() -> list[str]:
    problems = []
    for label, (cls, genuine) in _CLASSES.items():
        current = vars(cls)
        for name in genuine.keys() | current.keys():
            before, now = genuine.get(name, _MISSING), current.get(name, _MISSING)
            # methods, operators and properties matter; caches such as __slotnames__ do not
            if before is not now and (_behaves(before) or _behaves(now)):
                problems.append(f"{label}.{name} was replaced or added")
    return problems


_MISSING = object()


def _behaves(value) -> bool:
    return value is not _MISSING and (callable(value) or hasattr(value, "__get__"))


def find_tampering() -> list[str]:
    """One line per replaced function; empty when everything is genuine."""
    import sys

    problems = []
    for (module_name, name), genuine in _SNAPSHOT.items():
        module = sys.modules.get(module_name)
        current = _unwrap(getattr(module, name, None)) if module else None
        if current is not genuine:
            problems.append(f"{module_name}.{name} was replaced by {_where(current)}")
            continue
        code = getattr(current, "__code__", None)
        if code is not None and not os.path.abspath(code.co_filename).startswith(_genuine_home(module_name)):
            problems.append(f"the code of {module_name}.{name} was replaced by {_where(current)}")
        elif _code_of(current) != _CODE.get((module_name, name), _code_of(current)):
            problems.append(
                f"the code or default arguments of {module_name}.{name} were changed "
                "(__code__ / __defaults__ / __kwdefaults__)"
            )
    return problems + _class_changes()


def verify() -> None:
    """Raise TamperingError if any watched function was replaced."""
    problems = find_tampering()
    if problems:
        raise TamperingError(
            "grading relies on torch's and disttrain_lab's own functions, but "
            + "; ".join(problems)
            + ". Remove the code that assigns to them (and restart the kernel)."
        )


def watch_defaults() -> None:
    """The objects every lab relies on: torch.distributed's API and torch's comparisons."""
    import torch
    import torch.distributed as dist
    import torch.testing

    names = list(TRACED_OPS) + [
        "init_process_group",
        "get_rank",
        "get_world_size",
        "new_group",
        "batch_isend_irecv",
        "all_gather_object",
        "broadcast_object_list",
    ]
    watch(dist, names)
    watch(torch, ["equal", "allclose", "isclose", "ne", "eq", "logical_not", "any", "all", "where"])
    watch(torch.testing, ["assert_close"])
    watch_class(torch.Tensor, "torch.Tensor")
    watch_class(torch._C.TensorBase, "torch._C.TensorBase")
    watch_class(Run, "disttrain_lab.Run")
    watch_class(Event, "disttrain_lab.Event")
