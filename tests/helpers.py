"""Small helpers shared by the tests."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat

# the repository's root, for every test file whichever folder of tests/ it is in
REPO = Path(__file__).resolve().parent.parent


def load(path: Path) -> nbformat.NotebookNode:
    """A fresh copy of the notebook at ``path`` (e.g. ``load(solution_notebook(lab))``), as nbformat 4."""
    return nbformat.read(path, as_version=4)


def source_of(module) -> str:
    """The source of ``module``: of every module of it where it is a package (a lab's checks
    grown into one: ``disttrain_lab/labtests/lab08/``)."""
    path = Path(module.__file__)
    if path.name != "__init__.py":
        return path.read_text()
    return "\n".join(p.read_text() for p in sorted(path.parent.glob("*.py")))


def child_pids(parent: int | None = None) -> list[int]:
    """Live (non-zombie) processes whose parent is ``parent`` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, ppid = fields[0], int(fields[1])
        if ppid == parent and state != "Z":
            pids.append(int(entry))
    return pids


# what torch, multiprocessing and this kit name their shared-memory files; a shared CI
# machine has other users of /dev/shm, whose files are none of this test's business
_SHM_PREFIXES = ("torch_", "sem.", "psm_", "mp-", "disttrain")


def tmp_listing(tmp: str = "/tmp") -> set[str]:
    """What is in ``tmp`` (give a launch a private TMPDIR: other processes on a shared machine
    write to /tmp) and this kit's kind of files in /dev/shm: what a launch must not leave behind."""
    found = set()
    for d, keep in ((tmp, lambda n: not n.startswith("pytest-")), ("/dev/shm", lambda n: n.startswith(_SHM_PREFIXES))):
        try:
            found |= {os.path.join(d, n) for n in os.listdir(d) if keep(n)}
        except OSError:
            pass
    return found


def run_python(args: list[str], timeout: float, env: dict | None = None, cwd=None):
    """Run this interpreter with ``args``; output merged into ``.stdout``."""
    return subprocess.run(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def run_torchrun(script, nproc: int = 2, timeout: float = 120):
    """``torchrun --standalone`` of ``script`` on ``nproc`` processes (one thread each); torchrun's own
    logs go beside the script (``--log-dir``), not to a torchelastic_* folder left in /tmp."""
    args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return run_python(
        [*args, f"--log-dir={script.parent / 'elastic'}", str(script)], timeout=timeout, env={"OMP_NUM_THREADS": "1"}
    )


@contextlib.contextmanager
def not_a_subreaper():
    """Within it this process reaps no orphans, as the grader's kernel: a pytest worker that made a round trip does
    (``grading/steps.py`` makes the process that runs nbgrader a subreaper), and an orphan of the ranks it forked
    would then be its child, which ``pauses.strangers`` leaves out as the grader's own."""
    libc = ctypes.CDLL(None, use_errno=True)
    was = ctypes.c_int(0)
    libc.prctl(37, ctypes.byref(was), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
    libc.prctl(36, 0, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    try:
        yield
    finally:
        libc.prctl(36, was.value, 0, 0, 0)


def alive(pid: int) -> bool:
    """True if the process runs (a zombie has exited: it only awaits reaping by its parent,
    which may be this test process when grading made it a child subreaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def survivors(pids, within: float = 10.0) -> list[int]:
    """Those of ``pids`` still running after waiting up to ``within`` seconds for all to exit.
    A signalled process dies when it next runs, which on a loaded host can be a while after
    the signal: check deaths with this, not after a fixed sleep."""
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


def gpu_count() -> int:
    """GPUs torch sees here (NVML: no CUDA context is opened in the test process)."""
    import torch

    return torch.cuda.device_count()


def needs_gpus(n: int = 1):
    """Mark a test ``gpu`` and skip it, saying why, where fewer than ``n`` GPUs are visible.

    @needs_gpus(2)
    def test_ddp_on_two_gpus(): ...
    """
    import pytest

    def mark(test):
        have = gpu_count()
        test = pytest.mark.gpu(test)
        return pytest.mark.skipif(
            have < n, reason=f"needs {n} GPU(s) for device='cuda'; torch.cuda.device_count() is {have} here"
        )(test)

    return mark


# The capture here reads the host's own loopback, which the suite's other workers flood at times (lab 4's
# all-gathers: about 1 GB/s); a capture that lost packets to their traffic, or could not keep the data of a
# connection between ranks (its cap on what it keeps, filled by their traffic), is made again, twice at most
CAPTURE_ATTEMPTS = 3


def notebook_names(monkeypatch, space: dict) -> None:
    """The names of a notebook's namespace (``bench.functions_from_notebook``'s functions' globals) in
    ``__main__``, where a test's drivers find them in the student's kernel, for this test only."""
    import __main__

    for name, value in space.items():
        if not name.startswith("__"):
            monkeypatch.setattr(__main__, name, value, raising=False)


@contextlib.contextmanager
def observed_from_outside(stores: bool = False):
    """``dl.exercise.run`` in this process with the evidence the grader takes (as grading/remote.py
    does, without a student's kernel between): the bytes each rank sent from ``ss``, and when the
    data crossed from a packet capture (root only: ``CAP_NET_RAW``).  ``stores``: memory read at the gate also
    counts what the ranks' tmpfs mounts hold, as the grader does in a sandbox (here the host's: ``/dev/shm``)."""
    from disttrain_lab import exercise, serving, wire, wiretimeline
    from disttrain_lab.gate import Seen
    from disttrain_lab.grading import gatewatch
    from disttrain_lab.grading.capture import Capture
    from disttrain_lab.protocol import Evidence, Record

    def runner(request, gate=None):
        for attempt in range(CAPTURE_ATTEMPTS):
            last = attempt == CAPTURE_ATTEMPTS - 1
            keeper = None
            if gate is not None:  # the grader's gate in the ranks' backward, on ranks started before it opens
                answer = serving.prepare(
                    {"world_size": request.world_size, "device": request.device, "fresh": request.memory}
                )
                keeper = gatewatch.for_ranks(
                    None, gate, answer["pids"], None, request.timeout, memory=request.memory, stores=stores
                )
                request = request.replace(gate=keeper.start())
            before = wire.snapshot()
            try:
                with Capture(payloads=request.content) as capture:
                    try:
                        record = Record.from_bytes(serving.run(request).to_bytes(), request.world_size)
                    finally:
                        if keeper is not None:
                            keeper.stop()
            except RuntimeError as exc:  # (the grader's capture sees the student's namespace alone)
                if "packet capture lost" not in str(exc) or last:
                    raise
                continue
            if record.failure is not None:
                return record, Evidence.unobserved("the run failed")
            pids = list(record.pids)
            after, owner = wire.snapshot(), wire.owners(pids)
            timeline = wiretimeline.timeline(
                capture.segments, after, pids, owner, capture.payloads if capture.keep_payloads else None
            )
            seen = keeper.seen(capture.segments, timeline.origin) if keeper is not None else Seen.none()
            if last or timeline.data is None or None not in timeline.data.values():
                traffic = wire.traffic(before, after, pids, owner=owner)
                return record, Evidence(traffic=traffic, timeline=timeline, gate=seen)
            # (else a ranks' connection lost its data to the cap on what a capture keeps, which others filled)

    exercise.use_runner(runner)
    try:
        yield
    finally:
        exercise.use_runner(None)


# --------------------------------------------------------------------------------------
# A side channel for the tests' attacks: what ranks could pass each other off the wire


def shm_path(test: str, key) -> str:
    """A /dev/shm name for one run of an attack in ``test`` (the ranks' parent's pid in it, so that two runs
    apart never meet; ``shm_clear(test)`` removes them after)."""
    return f"/dev/shm/{test}-{os.getppid()}-{key}"


def shm_put(path: str, value) -> None:
    """Pass ``value`` (tensors) to the other ranks: written whole, then renamed into place."""
    import torch

    torch.save(value, f"{path}.part")
    os.replace(f"{path}.part", path)


def shm_get(path: str, timeout: float = 10.0):
    """What another rank passed (``shm_put``), once it is there."""
    import torch

    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.001)
    return torch.load(path)


def shm_clear(test: str) -> None:
    """Remove what ``test``'s attacks left in /dev/shm (one test runs in one process at a time)."""
    for left in Path("/dev/shm").glob(f"{test}-*"):
        left.unlink(missing_ok=True)


def relayed_f_and_g() -> tuple[type, type]:
    """Lab 6's f and g (``torch.autograd.Function``s of ``(x, group)``) as a submission could forge them: the sum
    over the group taken from the launcher's store (``through_the_store``), an all-reduce of zeros of the same
    size on the wire.  Returns (f, g)."""
    import torch
    import torch.distributed as dist

    def summed(x, group):
        dist.all_reduce(torch.zeros_like(x), group=group)
        return sum(through_the_store(x.detach().clone(), "relay", among=dist.get_process_group_ranks(group)))

    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            return summed(x, group)

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return summed(grad.contiguous(), ctx.group), None

    return F, G


def through_the_store(value, tag: str, among=None) -> list:
    """Every rank's ``value`` (tensors, or lists of them), passed through the launcher's store rather than the wire:
    a few KiB go unseen by the checks that count only calls and bytes, as a submission could pass them.  Call it on
    every rank (of ``among``, ranks of the world: each one's value at the same call, in that order), the same calls
    in the same order; each rank counts its calls in the store (``tag``'s), so that a store kept from run to run
    never hands back an earlier run's value."""
    import io

    import torch
    import torch.distributed as dist

    store, rank, n = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    call = store.add(f"{tag}/calls/{rank}", 1)
    buffer = io.BytesIO()
    torch.save(value, buffer)
    store.set(f"{tag}/{call}/{rank}", buffer.getvalue())
    return [torch.load(io.BytesIO(store.get(f"{tag}/{call}/{r}"))) for r in (range(n) if among is None else among)]
