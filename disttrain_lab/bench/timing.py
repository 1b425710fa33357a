"""What each rank measures of the versions it runs (call these on all ranks): each one's seconds, taking
turns (take_turns); the bytes it sends the other ranks, as the OS counted them on its connections or,
where the links are not the OS's, as its communication ops' tensor sizes (sent_bytes,
collective_bytes_counter); both for labs 10 and 11's steps (step_times, each step ending when the GPU
has finished it); and a free port for a process group's rendezvous (free_port)."""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist

from .. import wire
from ..devices import device as rank_device


def take_turns(runners: dict, repeats: int, warmup: int) -> dict:
    """In each rank: seconds of each ``runners[name]()`` call, the names taking turns (the order
    rotated every round, so none always goes first), a barrier before each; ``warmup`` rounds
    are left out.  Returns name -> list of ``repeats`` seconds.  Call it on all ranks."""
    names, seconds = list(runners), {}
    for i in range(warmup + repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            runners[name]()
            if i >= warmup:
                seconds.setdefault(name, []).append(time.perf_counter() - start)
    return seconds


_NOT_COMMUNICATION = ("wait", "wrap", "recv")  # c10d ops that move no data here (waits, wrappers, receives)


def collective_bytes_counter():
    """A dispatch mode adding up the bytes of every c10d collective called under it.

    torch's tensor parallelism calls the functional collectives (``_c10d_functional``), which
    the kit's trace does not see; this counts both kinds the same way, at the dispatcher (point-to-point
    sends too: ``c10d.send``).  ``with counter: ...``, then ``counter.bytes``, ``counter.calls``.
    """
    from torch.utils._python_dispatch import TorchDispatchMode  # torch's private module: only this counter needs it

    class CollectiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes, self.calls = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional") and not any(
                word in func.__name__ for word in _NOT_COMMUNICATION
            ):
                tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                self.bytes += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
                self.calls += 1
            return func(*args, **(kwargs or {}))

    return CollectiveBytes()


# what a bench's byte column counts: the bytes a rank sent the other ranks, as the OS counted them on its TCP
# connections (payload and gloo's headers: what crossed the wire; the grader's count, ``wire.traffic``), over
# gloo; the ops' tensor sizes (``collective_bytes_counter``) where the links are not the OS's (NCCL on GPUs)
SENT_ON_THE_WIRE = "counted by the OS on its connections: payload and gloo's headers"
OPS_SIZES = "the sizes of its communication ops' tensors: NCCL's links are not the OS's"


def sent_bytes(runners: dict) -> tuple[dict[str, int], str]:
    """In each rank: (name -> the bytes this rank sends the others in one call of ``runners[name]``, what was
    counted): over gloo, what the OS counted on the ranks' connections (``wire.snapshot`` before and after
    each call, a barrier after it, less what that barrier sends alone), ``SENT_ON_THE_WIRE``; else the
    sizes of the communication ops' tensors, ``OPS_SIZES``.  Call it on all ranks; each call runs once more."""
    if dist.get_backend() != "gloo" or wire.available() is not None:
        counted = {}
        for name, run in runners.items():
            counter = collective_bytes_counter()
            with counter:
                run()
            counted[name] = counter.bytes
        return counted, OPS_SIZES
    pids: list = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    me = dist.get_rank()

    def sent(run) -> int:
        dist.barrier()
        before = wire.snapshot()
        run()
        dist.barrier()  # (every rank done: what this one sent has arrived)
        return wire.traffic(before, wire.snapshot(), pids).sent(me)

    alone = min(sent(lambda: None) for _ in range(2))  # a barrier's own bytes
    return {name: max(0, sent(run) - alone) for name, run in runners.items()}, SENT_ON_THE_WIRE


def _finished(run):
    """``run``, returning only when the rank's GPU has finished its work (kernels are asynchronous)."""
    dev = rank_device()
    if dev.type != "cuda":
        return run

    def synchronized():
        run()
        torch.cuda.synchronize(dev)

    return synchronized


def step_times(runners: dict, repeats: int, warmup: int) -> dict:
    """In each rank: ``{"seconds": name -> seconds per step (see take_turns), "bytes": name -> the
    bytes the rank sends in one step, "counted": what they are}`` (``sent_bytes``) of ``runners``
    (name -> a step), each step ending when the rank's GPU has finished it.  Call it on all ranks."""
    runners = {name: _finished(run) for name, run in runners.items()}
    communicated, counted = sent_bytes(runners)
    seconds = take_turns(runners, repeats, warmup) if runners else {}
    return {"seconds": seconds, "bytes": communicated, "counted": counted}


def free_port() -> int:
    """A port the OS says is free now (port 0), for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
