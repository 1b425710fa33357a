"""#42, no side channel: a graded run's ranks confine themselves (``confine.py``, Landlock) once the kit has
set them up, so that they can talk to each other only over the wire the grader observes.  Each way round
the wire is tried by the ranks of a run served as the grader's are (``serving``: ``prepare`` with
``confined``, the run inside ``pool.confined()``), and by the same ranks unconfined (the control: each way
works there, so a refusal is confinement's, not the probe's)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading

import pytest
import torch.distributed as dist

from disttrain_lab import confine, exercise, pool
from disttrain_lab.devices import plan

pytestmark = pytest.mark.skipif(confine.host_problem() is not None, reason=str(confine.host_problem()))


def _ways_round_the_wire(tag: str, made: str) -> dict:
    """In each rank: every way to pass data to another rank off the wire, tried; and what must still work.
    ``made``: a unix socket's path, listening in the test's process (an unconfined one, as the kernel is).
    (A test's driver: it runs with the notebook's names, so it imports what it uses.)"""
    import os
    import signal
    import socket

    import torch
    import torch.distributed as dist

    def _attempt(action) -> str:
        try:
            action()
        except OSError as exc:
            return f"refused: {type(exc).__name__}: {exc.strerror}"
        return "went through"

    rank = dist.get_rank()
    here = f"dl-confine-{tag}-{rank}"
    tried = {}
    for folder in ("/tmp", "/dev/shm"):
        path = os.path.join(folder, here)

        def write(path=path):
            with open(path, "wb") as f:
                f.write(b"x")
            os.unlink(path)

        tried[f"a file in {folder}"] = _attempt(write)
    tried["a fifo"] = _attempt(lambda: (os.mkfifo(f"/tmp/{here}.fifo"), os.unlink(f"/tmp/{here}.fifo")))

    def bind_path():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(f"/tmp/{here}.sock")
        os.unlink(f"/tmp/{here}.sock")

    tried["a unix socket's path"] = _attempt(bind_path)

    def connect_made():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(made)

    def udp():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"x", ("127.0.0.1", 9))

    tried["a unix socket the kernel made"] = _attempt(connect_made)
    tried["a UDP datagram"] = _attempt(udp)
    tried["a netlink user socket"] = _attempt(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 2).close())
    tried["a socket pair"] = _attempt(lambda: [s.close() for s in socket.socketpair()])
    # rank 0 listens on an abstract unix socket, rank 1 connects to it and signals rank 0
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    listener = []
    if rank == 0:

        def listen():
            listener.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            listener[0].bind(f"\0dl-confine-{tag}")
            listener[0].listen(1)

        tried["listening on an abstract socket"] = _attempt(listen)
    dist.barrier()
    if rank == 1:

        def connect():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(f"\0dl-confine-{tag}")

        tried["another rank's abstract socket"] = _attempt(connect)
        tried["a signal to another rank"] = _attempt(lambda: os.kill(pids[0], signal.SIGCONT))
        tried["a signal to the kernel"] = _attempt(lambda: os.kill(os.getppid(), signal.SIGCONT))
        # what another process shows of itself in /proc (a rank may rewrite its command line or its name)
        tried["another rank's /proc/<pid>/cmdline"] = _attempt(lambda: open(f"/proc/{pids[0]}/cmdline", "rb").read())
        tried["another rank's /proc/<pid>/comm"] = _attempt(lambda: open(f"/proc/{pids[0]}/comm", "rb").read())
        tried["the kernel's /proc/<pid>/environ"] = _attempt(lambda: open(f"/proc/{os.getppid()}/environ", "rb").read())
    dist.barrier()
    for opened in listener:
        opened.close()
    # what a rank still does: read files, write /dev/null, make a new group over TCP, a collective
    with open(torch.__file__, "rb") as f:
        tried["reading a file"] = "went through" if f.read(1) else "read nothing"
    tried["writing /dev/null"] = _attempt(lambda: open(os.devnull, "wb").write(b"x"))
    tried["reading its own /proc"] = _attempt(
        lambda: (open("/proc/self/status", "rb").read(), os.listdir("/proc/self/fd"))
    )
    tried["reading /proc/meminfo"] = _attempt(lambda: open("/proc/meminfo", "rb").read())
    group = dist.new_group([0, 1])
    x = torch.ones(3)
    dist.all_reduce(x, group=group)
    tried["all_reduce in a new group"] = "went through" if x.tolist() == [2.0, 2.0, 2.0] else f"got {x.tolist()}"
    return tried


OFF_THE_WIRE = (
    "a file in /tmp",
    "a file in /dev/shm",
    "a fifo",
    "a unix socket's path",
    "a unix socket the kernel made",
    "a UDP datagram",
    "a netlink user socket",
    "a socket pair",
    "listening on an abstract socket",
    "another rank's abstract socket",
    "a signal to another rank",
    "a signal to the kernel",
    "another rank's /proc/<pid>/cmdline",
    "another rank's /proc/<pid>/comm",
    "the kernel's /proc/<pid>/environ",
)
STILL_WORKS = (
    "reading a file",
    "writing /dev/null",
    "reading its own /proc",
    "reading /proc/meminfo",
    "all_reduce in a new group",
)


def test_a_graded_runs_ranks_talk_only_over_the_wire(tmp_path):
    made = str(tmp_path / "kernel.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(made)
    listener.listen(8)
    os.chmod(made, 0o777)
    pool.shutdown()
    pool.prepare(2, plan(2), confined=True)  # what the grader's prepare comm does (serving.prepare)
    graded_pids = pool.worker_pids()
    with pool.prepared_only(), pool.confined():  # what serving does with its request
        run = exercise.run(_ways_round_the_wire, 2, ("graded", made), timeout=60)
    tried = {**run.results[0], **run.results[1]}
    assert {way: tried[way].split(":")[0] for way in OFF_THE_WIRE} == dict.fromkeys(OFF_THE_WIRE, "refused"), tried
    assert "PermissionError" in tried["a file in /dev/shm"], tried
    assert {way: tried[way] for way in STILL_WORKS} == dict.fromkeys(STILL_WORKS, "went through"), tried
    assert pool.worker_pids() == graded_pids  # the prepared, confined ranks ran it
    # the control: the student's own run gets unconfined ranks (forked anew), where every way goes through
    run = exercise.run(_ways_round_the_wire, 2, ("own", made), timeout=60)
    assert not set(pool.worker_pids()) & set(graded_pids)
    tried = {**run.results[0], **run.results[1]}
    assert {way: tried[way] for way in OFF_THE_WIRE + STILL_WORKS} == dict.fromkeys(
        OFF_THE_WIRE + STILL_WORKS, "went through"
    ), tried
    pool.shutdown()
    listener.close()


def _writes(folder: str) -> dict:
    """In each rank: a file beneath ``folder`` (the run's writable one, in the kernel's working directory)
    written and read back, a sub-folder made, and a file beside it and in /tmp, each tried."""
    import os

    import torch.distributed as dist

    def _attempt(action) -> str:
        try:
            action()
        except OSError as exc:
            return f"refused: {type(exc).__name__}"
        return "went through"

    rank, inside = dist.get_rank(), os.path.abspath(folder)

    def write(path):
        with open(path, "wb") as f:
            f.write(b"x")
        with open(path, "rb") as f:
            assert f.read() == b"x"

    return {
        "beneath it": _attempt(lambda: write(os.path.join(inside, f"rank{rank}"))),
        "a sub-folder": _attempt(lambda: os.makedirs(os.path.join(inside, f"sub{rank}", "deeper"))),
        "beside it": _attempt(lambda: write(f"{inside}-beside{rank}")),
        "in /tmp": _attempt(lambda: write(f"/tmp/dl-writable-{os.getpid()}")),
    }


def test_a_run_given_a_writable_folder_writes_there_and_nowhere_else(tmp_path, monkeypatch):
    # lab 12's restart: checkpoints that outlive a killed rank; every other graded run's ranks write nothing
    from disttrain_lab import serving

    monkeypatch.chdir(tmp_path)
    pool.shutdown()
    serving.prepare({"world_size": 2, "device": None, "writable": "job"}, confined=True)  # the grader's prepare
    with pool.prepared_only(), pool.confined(), pool.writable(serving.writable_folder("job")):
        run = exercise.run(_writes, 2, ("job",), timeout=60, writable="job")
    for got in run.results:
        assert got == {
            "beneath it": "went through",
            "a sub-folder": "went through",
            "beside it": "refused: PermissionError",
            "in /tmp": "refused: PermissionError",
        }, got
    assert sorted(os.listdir(tmp_path / "job")) == ["rank0", "rank1", "sub0", "sub1"]
    # the next graded run without one gets ranks that write nothing (a pool of their own, forked anew)
    with pool.prepared_only(), pool.confined(), pytest.raises(exercise.ExerciseError, match="no warm ranks"):
        exercise.run(_writes, 2, ("job",), timeout=60)
    pool.prepare(2, plan(2), confined=True)
    with pool.prepared_only(), pool.confined():
        run = exercise.run(_writes, 2, ("job",), timeout=60)
    assert {v.split(":")[0] for got in run.results for v in got.values()} == {"refused"}, run.results
    pool.shutdown()
    # what crosses the protocol is one plain name: no path, no parent
    from disttrain_lab.protocol import ProtocolError, Request

    for bad in ("../up", "/tmp/x", "a/b", "..", ""):
        with pytest.raises(ProtocolError, match="writable must be None or a plain folder name"):
            Request(target="f", world_size=1, inputs=[()], timeout=1.0, writable=bad)


def _through_shared_memory(token: bytes, only: int | None) -> dict:
    """In each rank: rank 0 writes ``token`` at the end of every writable shared mapping it has (``rw-s`` in
    /proc/self/maps: what the kernel shared with it before the fork; ``only``: just the one at that address),
    rank 1 then looks for it in its own."""
    import ctypes

    import torch.distributed as dist

    def shared() -> list[tuple[int, int]]:
        spans = []
        with open("/proc/self/maps") as f:
            for line in f:
                where, perms = line.split()[:2]
                if perms.startswith("rw") and perms[3] == "s":
                    start, end = (int(x, 16) for x in where.split("-"))
                    spans.append((start, end))
        return spans

    mine = shared()
    if dist.get_rank() == 0:
        for start, end in mine:
            if only is None or start == only:
                ctypes.memmove(end - len(token), token, len(token))
    dist.barrier()
    found = [start for start, end in mine if ctypes.string_at(end - len(token), len(token)) == token]
    dist.barrier()
    return {"mappings": len(mine), "found": found}


def test_ranks_share_no_writable_memory_with_each_other():
    # The kernel's status mapping (what each rank is blocked in, for a hang's report) was one mapping for all
    # the ranks: a channel off the wire, confined or not.  Each rank now has its own, and a rank's child
    # unmaps the others' before any of its code runs.  And the kernel is the student's: a mapping it made
    # before the ranks were forked (here, the test's own) is every rank's too, so a confined rank unmaps
    # every shared mapping but its own slot (confine.unmap_shared).
    import ctypes
    import mmap
    import secrets

    kernel_made = mmap.mmap(-1, 4096)  # (MAP_SHARED, anonymous: inherited by every fork)
    view = ctypes.c_char.from_buffer(kernel_made)
    address = ctypes.addressof(view)
    del view
    pool.shutdown()
    for confined in (True, False):
        pool.prepare(2, plan(2), confined=confined)
        with pool.prepared_only(), pool.confined() if confined else contextlib.nullcontext():
            token = secrets.token_bytes(16)
            run = exercise.run(_through_shared_memory, 2, (token, None if confined else address), timeout=60)
        zero, one = run.results
        pool.shutdown()
        if confined:  # all rank 0 has is its own slot, where it finds its token (the probe works); rank 1 nothing
            assert zero["mappings"] == 1 and len(zero["found"]) == 1, run.results
            assert one["found"] == [], run.results
        else:  # the control: the kernel's mapping is shared, the status slots are not
            assert zero["found"] == [address] and one["found"] == [address], run.results
            assert kernel_made[-16:] == token
    kernel_made.close()


def test_a_confined_run_cannot_emulate_a_network():
    import disttrain_lab as dl

    pool.prepare(2, plan(2), confined=True)
    with pool.prepared_only(), pool.confined(), pytest.raises(dl.LaunchError, match="grade without network="):
        dl.launch(dist.get_rank, 2, network=dl.Network.preset("1 Gbit Ethernet"))
    pool.shutdown()


def _confine_beside_a_thread(write_to: str) -> None:
    """In a forked child: confine() with a second thread running; exit 0 if it refused and the write still works."""
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
    done = confine.confine()
    ok = done.failed is not None and "2 threads run here" in done.failed and not done.applied
    with open(write_to, "wb") as f:
        f.write(b"x")
    stop.set()
    os._exit(0 if ok and confine.confine() is done else 1)


def test_confining_too_late_applies_nothing_and_says_why(tmp_path):
    """Landlock binds the calling thread and those it starts later: with a thread already running, confine()
    applies nothing and says why (the worker then fails the run: ``failed``)."""
    pid = os.fork()
    if pid == 0:
        try:
            _confine_beside_a_thread(str(tmp_path / "written"))
        finally:
            os._exit(2)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert (tmp_path / "written").read_bytes() == b"x"


def test_the_host_says_what_confinement_gives():
    version, why = confine.abi()
    assert version >= confine.FULL_ABI and why is None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def test_the_grader_sees_from_outside_whether_the_ranks_were_confined(monkeypatch):
    # The ranks' parent is the student's kernel, which could rewrite the kit to skip confine(): the grader
    # (grading/remote.py) reads each rank's /proc/<pid>/status from outside, where a confined rank has
    # no_new_privs and one seccomp filter more than the process that forked it, and fails closed otherwise.
    pool.shutdown()
    pool.prepare(2, plan(2), confined=True)
    with pool.prepared_only(), pool.confined():
        exercise.run(_rank, 2, timeout=60)
    assert confine.unconfined(pool.worker_pids()) is None
    pool.shutdown()
    # a kernel that skips the call: the same graded run, its ranks unconfined
    monkeypatch.setattr(
        confine, "confine", lambda writable=None: confine.Confinement(7, ("no writes", "only TCP sockets"))
    )
    pool.prepare(2, plan(2), confined=True)
    with pool.prepared_only(), pool.confined():
        exercise.run(_rank, 2, timeout=60)
    said = confine.unconfined(pool.worker_pids())
    assert said is not None and said.startswith("rank 0 was not confined: no_new_privs 0"), said
    pool.shutdown()
    # the student's own runs are not confined, and the check says so too (the grader never asks it of them)
    exercise.run(_rank, 2, timeout=60)
    assert "was not confined" in str(confine.unconfined(pool.worker_pids()))
    pool.shutdown()
