"""disttrain-lab: write distributed training yourself, run it on real ranks from a notebook.

import disttrain_lab as dl
dl.launch(fn, 4)                    # run fn on 4 ranks, get their return values
run = dl.launch(fn, 4, trace=True)  # ... and every torch.distributed call they made
dl.launch(fn, 4, network=dl.Network.preset("1 Gbit Ethernet"))   # over an emulated link
dl.viz.timeline(run)                # per-rank timeline of a real run
dl.exercise.run("ping_pong", 2, inputs)   # a notebook's function, results and bytes as data (tests)
dl.predictions.check("bubble", PREDICTED_BUBBLE)  # a graded prediction's form (never its answer)
"""

__version__ = "0.1.0"

import importlib
import sys

# the student's kit: each name below and the module that defines it (loaded with torch, see _load_kit)
_SUBMODULES = (
    "checks",
    "exercise",
    "hints",
    "integrity",
    "memory",
    "models",
    "network",
    "predictions",
    "trace",
    "viz",
    "wire",
    "worktime",
)
_NAMES = {
    "device": "devices",
    "doctor": "devices",
    "plan": "devices",
    "CollectiveMismatch": "launcher",
    "LaunchError": "launcher",
    "LaunchTimeout": "launcher",
    "RankDied": "launcher",
    "RankError": "launcher",
    "TamperingError": "launcher",
    "launch": "launcher",
    "Network": "network",
    "shutdown": "pool",
    "Event": "trace",
    "Run": "trace",
    "region": "trace",
}

__all__ = [
    "launch",
    "Network",
    "network",
    "doctor",
    "device",
    "shutdown",
    "plan",
    "region",
    "Run",
    "Event",
    "LaunchError",
    "RankError",
    "RankDied",
    "LaunchTimeout",
    "CollectiveMismatch",
    "TamperingError",
    "viz",
    "trace",
    "checks",
    "exercise",
    "models",
    "memory",
    "predictions",
]


def _load_kit() -> None:
    """Import the kit (and torch), bind its names here, and install what a notebook relies on:
    the watch on torch's functions (``integrity``), the explained errors (``hints``) and the
    time on task (``worktime``).  Runs once: at ``import disttrain_lab`` in a notebook's kernel
    and where torch is already imported (the ranks), else at the first name used.  A process
    that only grades (nbgrader's steps: ``disttrain_lab.grading``) never imports torch (3.5 s
    of CPU per step on the 2-core course machine)."""
    if "launch" in globals():
        return
    try:
        import torch  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(
            "disttrain_lab needs PyTorch, which is not installed here. Install the pinned CPU build "
            "with `pip install torch==2.13.0` (or `bash scripts/setup.sh`); on Colab and most Hubs "
            "torch is already there."
        ) from exc
    for module in _SUBMODULES:
        importlib.import_module(f"{__name__}.{module}")  # (each bound here as the submodule it is)
    for name, module in _NAMES.items():
        globals()[name] = getattr(sys.modules[f"{__name__}.{module}"], name)
    integrity = sys.modules[f"{__name__}.integrity"]
    integrity.watch_defaults()
    sys.modules[
        f"{__name__}.hints"
    ].install()  # in a notebook: a stub's bare NotImplementedError, dist.* outside a launch, explained
    sys.modules[
        f"{__name__}.worktime"
    ].install()  # in a notebook: when each cell first ran and first passed, for the class's time on task


def __getattr__(name: str):
    if name in _NAMES:
        _load_kit()
        return globals()[name]
    if name in _SUBMODULES:  # (``from . import wire`` in a module of the kit lands here too: that module only)
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAMES, *_SUBMODULES})


# in a notebook's kernel (the grader's requests arrive on the kit's comm target, and a cell's errors are
# explained, from the first cell on) and wherever torch is already imported: now
if sys.modules.get("torch") is not None or "ipykernel" in sys.modules:
    _load_kit()
