"""Where ranks compute: one device policy, in the notebook, under the grader and under torchrun.

    >>> dl.plan(4).backend, dl.plan(4).start_method          # device="cpu", the default
    ('gloo', 'fork')
    >>> dl.launch(lambda: str(dl.device()), 2, device="cuda")   # on 2 GPUs
    ['cuda:0', 'cuda:1']

- ``device="cpu"`` (the default) runs gloo on the CPU and never touches a GPU (no CUDA
  context, no ``set_device``), however many GPUs the node has.
- ``device="cuda"`` uses a ``cpu:gloo,cuda:nccl`` group (CPU tensors still travel over
  gloo), and rank k uses the k-th GPU visible to the server (``CUDA_VISIBLE_DEVICES``).

:func:`plan` decides, :func:`device` tells a rank which device is its own, and
:func:`doctor` says what this machine offers and what ``dl.launch`` will do here.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

__all__ = ["Plan", "plan", "device", "backend_name", "doctor", "resolve_device", "DEVICES", "MAX_WORLD_SIZE"]

DEVICES = ("cpu", "cuda")
BACKENDS = ("gloo", "nccl")
START_METHODS = ("fork", "spawn")
MAX_WORLD_SIZE = 32  # gloo ranks on one machine; NCCL: one per GPU
# backend= is the old spelling of device=: gloo meant the CPU, nccl meant one GPU per rank
_DEVICE_OF_BACKEND = {"gloo": "cpu", "nccl": "cuda"}


@dataclass
class Plan:
    """How the ranks of a launch run (see :func:`plan`)."""

    device: str  # "cpu" or "cuda": what dl.device() gives a rank
    backend: str  # "gloo" on "cpu"; "nccl" on "cuda", and then CPU tensors still travel over gloo
    start_method: str  # "fork" (fast, CPU only) or "spawn" (fresh interpreters: CUDA-safe, or no fork())
    reason: str  # one line for doctor(): why this plan

    def __post_init__(self) -> None:
        for name, value, valid in (
            ("device", self.device, DEVICES),
            ("backend", self.backend, BACKENDS),
            ("start_method", self.start_method, START_METHODS),
        ):
            if value not in valid:
                raise ValueError(f"Plan {name} must be one of {valid}, got {value!r}")
        if _DEVICE_OF_BACKEND[self.backend] != self.device:
            raise ValueError(
                f"Plan device={self.device!r} needs backend="
                f"{'nccl' if self.device == 'cuda' else 'gloo'!r}, got backend={self.backend!r}"
            )
        if self.device == "cuda" and self.start_method != "spawn":
            # a forked child cannot use CUDA once the parent touched it
            raise ValueError(f"Plan device='cuda' needs start_method='spawn', got {self.start_method!r}")
        if not isinstance(self.reason, str):
            raise ValueError(f"Plan reason must be a string, got {self.reason!r}")

    @property
    def group_backend(self) -> str:
        # with NCCL, CPU tensors (every p2p lab uses them) go over gloo: one group serves both
        return "cpu:gloo,cuda:nccl" if self.backend == "nccl" else "gloo"


def _gpu_count() -> int:
    """GPUs visible to this process (CUDA_VISIBLE_DEVICES respected)."""
    try:
        import torch

        # device_count asks NVML and leaves CUDA uninitialised, so forked ranks can still
        # use the GPU; torch.cuda.is_available() would initialise it in this process
        return torch.cuda.device_count()
    except Exception:
        return 0


def _check_device(device) -> str:
    """ "cpu" or "cuda" from a string or a torch.device; anything else is refused."""
    if isinstance(device, str):
        kind, index = device, None
    else:  # torch.device("cuda") works too
        kind, index = getattr(device, "type", device), getattr(device, "index", None)
    if kind not in DEVICES or index is not None:
        raise ValueError(
            f'device must be one of {DEVICES}, got {device!r}: "cpu" runs every rank on the '
            f'CPU with gloo; "cuda" gives rank k the k-th visible GPU (NCCL). A rank asks '
            f"dl.device() which GPU is its own, so no index is given here"
        )
    return kind


def plan(world_size: int | None = None, device: str = "cpu", *, local_world_size: int | None = None) -> Plan:
    """Which backend and start method ``launch(..., device=device)`` uses for ``world_size`` ranks.

    The policy (the same in a notebook, under the grader and under torchrun):

    - ``device="cpu"`` (the default): gloo on the CPU, ranks forked from this process.
      No rank touches a GPU (no CUDA context, no ``set_device``), however many there are.
    - ``device="cuda"``: NCCL for CUDA tensors in a ``cpu:gloo,cuda:nccl`` group (so CPU
      tensors still work), ranks are fresh interpreters (a forked child cannot use CUDA),
      and rank k uses the k-th GPU visible to this process (``CUDA_VISIBLE_DEVICES``
      respected).  More ranks than visible GPUs, or no GPU, is a ``ValueError``.

    ``local_world_size``: the ranks on this machine when it differs from ``world_size``
    (torchrun on several nodes).  The environment does not change the policy (the old
    ``DISTTRAIN_LAB_BACKEND`` variable is no longer read).
    """
    device = _check_device(device)
    local = world_size if local_world_size is None else local_world_size
    spawn_only = sys.platform not in ("linux", "darwin")  # no fork() there
    if device == "cpu":
        if spawn_only:
            how = "spawn", "ranks are fresh interpreters"
        elif _cuda_used_here():
            how = "spawn", "ranks are fresh interpreters (this process has used CUDA: a forked rank's backward fails)"
        else:
            how = "fork", "ranks are forked from this process (fast)"
        return Plan("cpu", "gloo", how[0], f"device='cpu': gloo on the CPU; {how[1]}")
    gpus = _gpu_count()
    if gpus == 0:
        import torch

        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build (torch.version.cuda is None)"
        raise ValueError(
            f"device='cuda' needs a GPU, but this process sees none (torch.cuda.device_count() == 0; "
            f"torch {torch.__version__} is {build}; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!s}). Use device='cpu' "
            f"(gloo on the CPU runs every lab), or run on a machine with GPUs"
        )
    if local is not None and local > gpus:
        raise ValueError(
            f"device='cuda' gives each rank its own GPU: {local} ranks need {local} GPUs, but "
            f"{gpus} GPU(s) are visible to this server (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). Use world_size <= {gpus}, "
            f"or device='cpu' for up to {MAX_WORLD_SIZE} ranks"
        )
    import torch.distributed as dist

    if not dist.is_nccl_available():
        raise ValueError(
            "device='cuda' needs NCCL, and this torch was built without it "
            "(torch.distributed.is_nccl_available() is False); use device='cpu'"
        )
    return Plan(
        "cuda",
        "nccl",
        "spawn",
        f"device='cuda': NCCL, rank k on the k-th of {gpus} visible GPU(s); ranks are fresh interpreters (CUDA-safe)",
    )


def _cuda_used_here() -> bool:
    """Whether this process has initialised CUDA (a notebook that computed on DEVICE = "cuda" in the kernel).
    A child forked from it then fails at its first backward, on the CPU too: autograd's threads for the GPU
    do not survive a fork (torch: "Unable to handle autograd's threading in combination with fork-based
    multiprocessing"), and CUDA cannot be used in it at all.  Seen on an H200 running lab 9."""
    torch = sys.modules.get("torch")  # (not imported: nothing can have used CUDA)
    return torch is not None and torch.cuda.is_initialized()


def backend_name() -> str:
    """In a rank: its launch's backend as :class:`Plan` names it, ``"gloo"`` or ``"nccl"``.
    ``dist.get_backend()`` names the whole group, ``"cpu:gloo,cuda:nccl"`` for a ``device="cuda"`` launch
    (its CPU tensors travel over gloo), and ``dl.launch``'s ``run.backend`` is ``"nccl"`` there."""
    import torch.distributed as dist

    name = str(dist.get_backend())
    return "nccl" if any(part.split(":")[-1] == "nccl" for part in name.split(",")) else name


def resolve_device(device, backend) -> str:
    """``launch``'s device= (None: "cpu"), or the deprecated backend= ("gloo" -> "cpu", "nccl" -> "cuda").

    Called by ``launch`` itself: its deprecation warning points at the caller of ``launch``."""
    if backend is None:
        return _check_device("cpu" if device is None else device)
    if backend not in _DEVICE_OF_BACKEND:
        raise ValueError(
            f"backend must be one of {tuple(_DEVICE_OF_BACKEND)} or None, got {backend!r}; "
            f"backend= is deprecated: say device='cpu' (gloo) or device='cuda' (NCCL)"
        )
    implied = _DEVICE_OF_BACKEND[backend]
    if device is not None and _check_device(device) != implied:
        # gloo runs on the CPU; NCCL moves only CUDA tensors, so it needs device='cuda'
        raise ValueError(
            f"device={device!r} and backend={backend!r} disagree: backend={backend!r} needs "
            f"device={implied!r} ({'NCCL moves only CUDA tensors' if backend == 'nccl' else 'gloo runs on the CPU'}). "
            f"backend= is deprecated: give only device= (device='cpu' for gloo, device='cuda' for NCCL)"
        )
    import warnings

    warnings.warn(
        f"dl.launch(backend={backend!r}) is deprecated; use device={implied!r}", DeprecationWarning, stacklevel=3
    )
    return implied


def device():
    """The torch.device this rank computes on: ``cuda:k`` for rank k of a ``device="cuda"``
    launch (the k-th visible GPU; under torchrun, ``cuda:LOCAL_RANK``), else the CPU.

        >>> dl.launch(lambda: dl.device(), 2)                 # [device('cpu'), device('cpu')]
        >>> x = torch.ones(4, device=dl.device())             # inside a rank: on its own GPU
    """
    import torch

    asked = os.environ.get("DISTTRAIN_LAB_RANK_DEVICE")
    if asked is None:  # not in a launch's rank: a torchrun script that set up NCCL itself?
        import torch.distributed as dist

        asked = "cuda" if dist.is_initialized() and "nccl" in str(dist.get_backend()) else "cpu"
    if asked == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


# --------------------------------------------------------------------------------------
# doctor: what this machine offers (``disttrain-lab doctor``, and a lab's setup cell)
# --------------------------------------------------------------------------------------
def _own_process() -> bool:
    # the command line (`disttrain-lab doctor`, or `python -m disttrain_lab.cli`, whose
    # argv[0] is cli.py's path) is a process of its own; a notebook's kernel is not
    main = sys.modules.get("__main__")
    return (
        os.path.basename(sys.argv[0]) in ("disttrain-lab", "cli.py")
        or getattr(getattr(main, "__spec__", None), "name", None) == "disttrain_lab.cli"
    )


def doctor(short: bool = False) -> str:
    """What this machine offers and what ``dl.launch`` will do here.

    ``short=True`` gives the one line a lab's setup cell prints.
    """
    import torch
    import torch.distributed as dist

    cores = os.cpu_count() or 1
    cuda_initialized = torch.cuda.is_initialized()
    gpus = torch.cuda.device_count()  # NVML: leaves CUDA uninitialised, so forked ranks may use it
    chosen = plan(world_size=2)  # device="cpu", the default: what every launch uses unless asked
    try:
        on_gpu = (
            plan(world_size=gpus, device="cuda").reason.removeprefix("device='cuda': ") if gpus else "no GPU visible"
        )
    except ValueError as exc:
        on_gpu = str(exc).split(". ")[0]
    if short:
        return (
            f"disttrain-lab: torch {torch.__version__}, {cores} CPU cores, {gpus} GPU(s); "
            f"ranks use {chosen.backend} ({chosen.start_method})"
            + (f"; device='cuda': NCCL on up to {gpus} ranks" if gpus else "")
        )
    backends = [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok]
    lines = [
        f"python        {platform.python_version()} ({sys.executable})",
        f"torch         {torch.__version__}",
        f"CPU cores     {cores}",
        # device names need CUDA initialised: only in the CLI (its own process), not in a notebook
        f"GPUs          {gpus}"
        + (
            "".join(f"\n              cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(gpus))
            if not short and _own_process()
            else ""
        ),
        f"backends      {', '.join(backends) or 'none'}",
        f"launcher      {chosen.backend}, {chosen.start_method}: {chosen.reason}",
        f"              device='cuda': {on_gpu}",
        f"CUDA used in this process already: {'yes' if cuda_initialized else 'no'}",
    ]
    if not dist.is_gloo_available():
        verdict = "NOT READY: this torch has no gloo backend, which every lab needs on CPU."
    else:
        verdict = f"READY: labs run up to 4 ranks with {chosen.backend} on the CPU" + (
            f", and up to {gpus} rank(s) with device='cuda' (one GPU per rank)."
            if gpus and dist.is_nccl_available()
            else "."
        )
    lines.append(verdict)
    return "\n".join(lines)
