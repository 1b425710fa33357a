"""Memory hidden from the OS's count of a rank's private memory (#42): a rank that keeps a copy of each layer's whole
parameters (lab 14's ``sharded_step``, FSDP2's schedule on the wire, the values right) where ``Private_*`` of
``/proc/<pid>/smaps_rollup`` does not see it.  The grader's reading (``pauses.held_bytes``, ``pauses.strangers``)
counts it, or refuses to read:

- counted: a memfd written and not mapped, bytes parked in a TCP connection to itself, bytes parked in connections
  it never accepted;
- refused, so the test fails rather than take a low reading: more pipes than a rank's own (each can hold 1 MiB),
  a process it forked (its pages shared copy-on-write count as neither's private memory), a shared mapping that
  process touches too, and a process that forked again and ended, whose child the OS handed to init.

Each variant runs the run of lab 14's graded check that reads memory (``prefetch._check_freed``) as the grader runs it
(``observed_from_outside``: root, a packet capture); the honest step passes the whole check
(``test_lab14_prefetch.py``).
"""

from __future__ import annotations

import glob
import os
import re

import pytest

from disttrain_lab.labtests.lab14 import prefetch
from disttrain_lab.wire import Unobserved
from tests.helpers import not_a_subreaper, notebook_names, observed_from_outside
from tests.labs.test_lab14_prefetch import _step

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (CAP_NET_RAW)")


@pytest.fixture(autouse=True)
def _not_a_subreaper():
    """As the grader's kernel: an orphan of the ranks is no child of this process (``not_a_subreaper``)."""
    with not_a_subreaper():
        yield


@pytest.fixture(autouse=True)
def _smaller_layers(monkeypatch):
    """4 MiB layers (1024 x 1024), not the grade's 16 MiB, and 3 MiB of margin: each of these runs puts a quarter of
    the bytes on the loopback the tests' capture reads (beside other tests there, the grade's sizes once filled its
    queue), and a copy of each layer still reads 4 layers, above 2 and the margin (no noise makes a reading lower)."""
    monkeypatch.setattr(prefetch, "FREED_WIDTHS", (1024,) * 5)
    monkeypatch.setattr(prefetch, "FREED_MARGIN", 3 * 2**20)


STASH = f"/dev/shm/disttrain-test-stash-{os.getpid()}"  # (a tmpfs: the host's, as the sandbox's /dev/shm is)
LINGER_S = 60  # at most this long a process a rank forks outlives the rank (it ends with it: the test leaves nothing)


def _hiding(kind):
    """``sharded_step`` keeping a copy of each layer's whole parameters after its forward, hidden as ``kind`` says."""

    def step(shards, layer, x, y, prefetch=True):
        import fcntl
        import mmap
        import select
        import socket

        kept = []

        def linger(then=None):
            """Fork a process that stays until this rank has ended (its pipe's write end closes) or LINGER_S has
            passed (``then``: what it does first, given the read end)."""
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(w)
                    if then is not None:
                        then(r)
                    select.select([r], [], [], LINGER_S)
                finally:
                    os._exit(0)
            os.close(r)
            kept.append(w)  # (closed as the rank ends: the process ends then)
            return pid

        def stash(t):
            data = t.numpy().tobytes()
            if kind == "memfd":
                fd = os.memfd_create("stash")
                os.write(fd, data)
                kept.append(fd)
            elif kind == "tmpfs_file":  # written, closed: no descriptor, no mapping, pages of the tmpfs alone
                with open(f"{STASH}-{os.getpid()}-{len(os.listdir('/dev/shm'))}", "wb") as f:
                    f.write(data)
            elif kind == "pipes":
                for i in range(0, len(data), 1 << 20):
                    r, w = os.pipe()
                    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
                    os.write(w, data[i : i + (1 << 20)])
                    kept.append((r, w))
            elif kind in ("tcp_to_itself", "tcp_unaccepted"):
                server = socket.create_server(("127.0.0.1", 0))
                kept.append(server)
                sent = 0
                while sent < len(data):
                    a = socket.create_connection(server.getsockname())
                    if kind == "tcp_to_itself":
                        kept.append(server.accept()[0])
                    a.setblocking(False)
                    kept.append(a)
                    try:
                        while sent < len(data):
                            sent += a.send(data[sent : sent + (1 << 16)])
                    except BlockingIOError:
                        pass
            elif kind == "fork":  # the copy in private memory, then a process that shares it
                kept.append((t, linger()))
            elif kind == "shared_mapping":
                m = mmap.mmap(-1, len(data), flags=mmap.MAP_SHARED)
                m[:] = data
                kept.append((m, linger(lambda r: sum(m[i] for i in range(0, len(m), 4096)))))
            elif kind == "orphan":  # a child that forks and ends: its child goes to init, sharing the copy
                child = linger(lambda r: os.fork() and os._exit(0))  # (the child's child waits on the pipe)
                os.waitpid(child, 0)
                kept.append(t)
            return kept

        return _step(shards, layer, x, y, prefetch, hoard=lambda t: stash(t.clone()))

    return step


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["memfd", "tcp_to_itself", "tcp_unaccepted"])
def test_a_copy_kept_in_the_os_s_buffers_counts_as_the_rank_s_memory(monkeypatch, kind):
    notebook_names(monkeypatch, {"sharded_step": _hiding(kind)})
    with observed_from_outside(), pytest.raises(AssertionError) as said:
        prefetch._check_freed("sharded_step", prefetch=False)  # (the graded check's run that reads memory)
    message = str(said.value)
    last = re.search(r"inside layer 3's forward than before the step \(([\d.]+) whole layers", message)
    assert last and float(last.group(1)) > 3.5, message  # (its three copies, and the layer itself)


@pytest.mark.slow
def test_a_copy_kept_in_a_closed_tmpfs_file_counts_as_the_rank_s_memory(monkeypatch):
    """A rank that writes its copy to a file of a tmpfs and closes it holds no descriptor and no mapping of it: no
    process's count sees those pages.  In a graded run's sandbox every tmpfs the ranks may write is the student's
    own (``/tmp``, ``/dev/shm``, ...), and the grader counts what they hold for each rank (``stored.stored_bytes``,
    ``stores=True``, as ``grading/remote.py`` asks in a sandbox).  Here the host's ``/dev/shm`` stands for the
    sandbox's.  Without that count the copy passed the check."""
    notebook_names(monkeypatch, {"sharded_step": _hiding("tmpfs_file")})
    try:
        with observed_from_outside(stores=False):
            prefetch._check_freed("sharded_step", prefetch=False)  # (before: it passed)
        for path in glob.glob(f"{STASH}-*"):
            os.unlink(path)
        with observed_from_outside(stores=True), pytest.raises(AssertionError) as said:
            prefetch._check_freed("sharded_step", prefetch=False)
    finally:
        for path in glob.glob(f"{STASH}-*"):
            os.unlink(path)
    message = str(said.value)
    last = re.search(r"inside layer 3's forward than before the step \(([\d.]+) whole layers", message)
    assert last and float(last.group(1)) > 3.5, message  # (its three copies, and the layer itself)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, said",
    [
        ("pipes", r"held \d+ pipe\(s\)"),
        ("fork", r"had started process\(es\) \[\d+\] of its own|started after the ranks, in their cgroup, were still"),
        ("shared_mapping", r"had started process\(es\) \[\d+\] of its own|started after the ranks, in their cgroup"),
        ("orphan", r"started after the ranks, in their cgroup, were still there"),
    ],
)
def test_a_copy_kept_where_the_os_count_cannot_see_it_is_refused(monkeypatch, kind, said):
    notebook_names(monkeypatch, {"sharded_step": _hiding(kind)})
    with observed_from_outside(), pytest.raises(Unobserved) as refused:
        prefetch._check_freed("sharded_step", prefetch=False)  # (the graded check's run that reads memory)
    message = str(refused.value)
    assert re.search(said, message) and "fails rather than take the rank's own account" in message, message
