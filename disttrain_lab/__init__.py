"""disttrain-lab: write distributed training yourself, run it on real ranks from a notebook.

import disttrain_lab as dl
dl.launch(fn, 4)                    # run fn on 4 ranks, get their return values
run = dl.launch(fn, 4, trace=True)  # ... and every torch.distributed call they made
dl.launch(fn, 4, network=dl.Network.preset("1 Gbit Ethernet"))   # over an emulated link
dl.viz.timeline(run)                # per-rank timeline of a real run
dl.exercise.run("ping_pong", 2, inputs)   # a notebook's function, results and bytes as data (tests)
dl.predictions.check("bubble", PREDICTED_BUBBLE)  # a graded prediction's form (never its answer)
"""

from ._version import __version__

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise ImportError(
        "disttrain_lab needs PyTorch, which is not installed here. Install the pinned CPU build "
        "with `pip install torch==2.13.0` (or `bash scripts/setup.sh`); on Colab and most Hubs "
        "torch is already there."
    ) from exc

from . import checks, exercise, hints, integrity, memory, models, network, predictions, trace, viz, wire, worktime  # noqa: E402
from .devices import device, doctor, plan  # noqa: E402
from .launcher import CollectiveMismatch, LaunchError, LaunchTimeout, RankDied, RankError, TamperingError, launch  # noqa: E402
from .network import Network  # noqa: E402
from .pool import shutdown  # noqa: E402
from .profiling import merge_traces, profiled  # noqa: E402
from .trace import Event, Run, region  # noqa: E402

__all__ = [
    "launch",
    "Network",
    "network",
    "doctor",
    "device",
    "shutdown",
    "plan",
    "region",
    "profiled",
    "merge_traces",
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

integrity.watch_defaults()
hints.install()  # in a notebook: a stub's bare NotImplementedError, dist.* outside a launch, explained
worktime.install()  # in a notebook: when each cell first ran and first passed, for the class's time on task
