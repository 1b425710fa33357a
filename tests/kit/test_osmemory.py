"""osmemory: each rank's private memory read from the OS at a pause, never from the rank.

- ``private_bytes`` reads ``/proc/<pid>/smaps_rollup`` as bytes; a process that allocates and writes
  100 MiB reads about 100 MiB more; a malformed field is refused, not guessed.
- ``Watch`` reads once every watched process is in ``time.sleep`` (``clock_nanosleep``), not before;
  a process that never pauses leaves the reading unobserved, and reading it then raises ``Unobserved``;
  having read, it ends the driver's ``pause`` (and no other sleep).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import time

import pytest

from disttrain_lab import osmemory, pauses
from disttrain_lab.stored import stored_bytes
from disttrain_lab.wire import Unobserved
from tests.helpers import not_a_subreaper

CHILD = """
import signal, sys, time
signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # (as a rank does, worker.py: the watch's signal ends no other sleep)
ballast = bytearray({size})
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
print("ready", flush=True)
{after}
"""


def _child(size: int, after: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(size=size, after=after)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _held_beyond_an_idle_child(after: str, said: str) -> int:
    """``pauses.held_bytes`` of a child that ran ``after`` (which prints ``said`` once done) less an idle child's.

    The two interpreters' own heaps differ by a few pages either way (a fresh CI clone read one page short of
    32 MiB), so the tests below allow 1 MiB under what ``after`` holds: what they tell apart (the data counted or
    not) is tens of MiB apart."""
    small, proc = _child(0, "time.sleep(30)"), _child(0, after)
    try:
        assert proc.stdout.readline().strip() == said
        return pauses.held_bytes(proc.pid) - pauses.held_bytes(small.pid)
    finally:
        small.kill(), proc.kill()


def _child_with_its_own_shm(after: str) -> subprocess.Popen:
    """``_child`` in a mount namespace of its own with a private tmpfs on ``/dev/shm`` (as root), as a sandbox's
    rank has: no other test's files in what its writable folders hold."""
    private = 'mount -t tmpfs -o size=64m none /dev/shm && exec "$0" -c "$1"'
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", private, sys.executable]
        + [CHILD.format(size=0, after=after)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_private_bytes_counts_what_a_process_wrote():
    small, large = _child(0, "time.sleep(30)"), _child(100 * 2**20, "time.sleep(30)")
    try:
        grew = pauses.private_bytes(large.pid) - pauses.private_bytes(small.pid)
        assert 95 * 2**20 < grew < 110 * 2**20, grew
    finally:
        small.kill(), large.kill()


def _fake_rollup(tmp_path, monkeypatch, fields: bytes) -> None:
    """``/proc/<pid>/smaps_rollup`` reads as its first line and ``fields``."""
    fake = tmp_path / "smaps_rollup"
    fake.write_bytes(b"00400000-7fff r--p 00000000 00:00 0 [rollup]\n" + fields)
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda path, *a, **k: real_open(fake if "smaps_rollup" in str(path) else path, *a, **k)
    )


def test_a_malformed_field_is_refused(tmp_path, monkeypatch):
    _fake_rollup(
        tmp_path, monkeypatch, b"Private_Clean: lots kB\nPrivate_Dirty: 1 kB\nPrivate_Hugetlb: 0 kB\nSwap: 0 kB\n"
    )
    with pytest.raises(ValueError, match="is not '<n> kB'"):
        pauses.private_bytes(1)


def test_private_huge_pages_count_and_a_missing_field_is_refused(tmp_path, monkeypatch):
    """A private mapping of huge pages (``MAP_HUGETLB``; this host keeps none to map) is in ``Private_Hugetlb`` alone;
    a kernel whose rollup lacks a field is refused, not read as holding nothing there."""
    rollup = (
        b"Rss: 4104 kB\nShared_Hugetlb: 2048 kB\nPrivate_Clean: 4 kB\nPrivate_Dirty: 4 kB\nPrivate_Hugetlb: 4096 kB\n"
    )
    _fake_rollup(tmp_path, monkeypatch, rollup + b"Swap: 0 kB\n")
    assert pauses.private_bytes(1) == (4 + 4 + 4096) * 1024  # (Shared_Hugetlb: a shared mapping, _shared_mapped's)
    _fake_rollup(tmp_path, monkeypatch, rollup.replace(b"Private_Hugetlb: 4096 kB\n", b"") + b"Swap: 0 kB\n")
    with pytest.raises(ValueError, match="has no Private_Hugetlb"):
        pauses.private_bytes(1)


def test_the_watch_reads_at_the_pause_and_only_then():
    proc = _child(50 * 2**20, "x = 0\nfor _ in range(30_000_000): x += 1\ntime.sleep(5)")
    try:
        assert not pauses.paused(proc.pid)  # (counting: not in time.sleep)
        started = time.monotonic()
        watch = osmemory.Watch([proc.pid], at_pause=lambda: "read at the pause").start()
        while not pauses.paused(proc.pid):
            assert proc.poll() is None and time.monotonic() < started + 60, "the child never paused"
            time.sleep(0.01)
        time.sleep(0.5)
        held = watch.stop()
        assert watch.extras == ["read at the pause"] and held.of(0) > 50 * 2**20, (held, time.monotonic() - started)
    finally:
        proc.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace with a tmpfs of its own needs root")
def test_a_closed_tmpfs_file_counts_for_every_rank_where_the_stores_are_read():
    """What a process wrote to a tmpfs file and closed is in no process's count (no descriptor, no mapping): with
    ``stores`` (a graded run's sandbox, ``grading/remote.py``) the watch adds what every writable tmpfs of the
    ranks' mount namespace holds to each reading (``stored.stored_bytes``).  The child has a mount namespace of its
    own with a private tmpfs on ``/dev/shm``, as a sandbox's rank does (no other test's files in this count)."""
    path = "/dev/shm/stash"
    after = f"open({path!r}, 'wb').write(b'1' * (40 << 20))\nprint('written', flush=True)\ntime.sleep(30)"
    proc = _child_with_its_own_shm(after)
    try:
        assert proc.stdout.readline().strip() == "written"
        stored = stored_bytes(proc.pid)
        assert 40 << 20 <= stored < 41 << 20, stored
        readings = {}
        for stores in (False, True):
            watch = osmemory.Watch([proc.pid], stores=stores).start()
            time.sleep(1.0)
            readings[stores] = watch.stop().of(0)
        assert 39 << 20 < readings[True] - readings[False] < 42 << 20, readings
        assert stored_bytes(os.getpid()) < stored  # (not this process's /dev/shm: the child's own)
    finally:
        proc.kill()
        proc.wait()


def test_a_shared_mapping_whose_pages_were_dropped_counts_whole():
    """``MADV_DONTNEED`` on a shared anonymous mapping drops its pages from every count of resident memory
    (``Private_*``, ``RssShmem``), and touching them brings the data back: the reading counts a shared mapping
    whole (``pauses._shared_mapped``)."""
    after = (
        "import mmap\n"
        "m = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_SHARED)\n"
        "m.write(b'7' * (64 << 20))\n"
        "m.madvise(mmap.MADV_DONTNEED)\n"
        "assert m[12345] == ord('7')\n"  # (the data is still there)
        "print('dropped', flush=True)\n"
        "time.sleep(30)\n"
    )
    grew = _held_beyond_an_idle_child(after, "dropped")
    assert 63 << 20 <= grew < 72 << 20, grew  # (not counted whole: under 1 MiB)


def test_a_deleted_file_held_open_for_reading_counts(tmp_path):
    """A file written, reopened for reading only, and deleted keeps its blocks while it is open, in no folder a
    walk can see and in no descriptor open for writing: the reading counts a deleted file held open in any mode
    (``pauses._descriptor_bytes``)."""
    path = tmp_path / "stash"
    after = (
        f"open({str(path)!r}, 'wb').write(b'5' * (32 << 20))\n"
        f"kept = open({str(path)!r}, 'rb')\n"
        f"os.unlink({str(path)!r})\n"
        "print('deleted', flush=True)\n"
        "time.sleep(30)\n"
    )
    grew = _held_beyond_an_idle_child("import os\n" + after, "deleted")
    assert 31 << 20 <= grew < 40 << 20, grew  # (private memory alone: 6 MiB)


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace with a tmpfs of its own needs root")
def test_extended_attributes_on_a_tmpfs_count_as_stored():
    """tmpfs keeps a file's user extended attributes (Linux 6.6 and later) in no block: ``statvfs``'s blocks do not
    change, its free inodes do, one per KiB.  The count adds 1 KiB per inode in use (and the sandbox's syscall
    filter refuses ``setxattr``: ``grading/syscall_filter.py``)."""
    after = (
        "import errno, os\n"
        "open('/dev/shm/f', 'wb').close()\n"
        "try:\n"
        "    for i in range(64):\n"
        "        os.setxattr('/dev/shm/f', f'user.k{i}', b'x' * 60000)\n"
        "    print('set', flush=True)\n"
        "except OSError as e:\n"
        "    print('unsupported' if e.errno == errno.EOPNOTSUPP else repr(e), flush=True)\n"
        "time.sleep(30)\n"
    )
    proc = _child_with_its_own_shm(after)
    try:
        said = proc.stdout.readline().strip()
        if said == "unsupported":
            pytest.skip("this kernel's tmpfs keeps no user extended attributes (before Linux 6.6)")
        assert said == "set", said
        assert stored_bytes(proc.pid) >= 64 * 60000, stored_bytes(proc.pid)  # (3.7 MiB, in no block)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_files_in_a_disk_folder_bound_in_writable_count_and_the_hosts_own_folders_do_not(tmp_path):
    """Bubblewrap's sandbox (``grading/run_bwrap.py``) binds the kernel's working folder in from the host's disk: a
    rank there could write its state to a file and close it.  ``stored.stored_bytes`` walks every disk folder
    mounted writable in the process's namespace (a real bwrap here, the root read-only, a folder bound in) and
    counts its files' blocks, a hard link once; the host's own root, which a process outside any sandbox shares
    with the reader, is not walked."""
    bound = tmp_path / "work"
    bound.mkdir()
    script = (
        "import os, sys, time\n"
        "work = sys.argv[1]\n"
        "open(f'{work}/stash', 'wb').write(b'1' * (24 << 20))\n"
        "os.link(f'{work}/stash', f'{work}/again')\n"
        "for i in range(100):\n"
        "    os.symlink('x' * 4000, f'{work}/link{i}')\n"  # (a block each, outside every regular file)
        "print(os.getpid(), flush=True)\n"
        "time.sleep(30)\n"
    )
    # (the folder bound at its own path: the root read-only, with this interpreter wherever it lives, a CI clone's
    # under /tmp too; private tmpfs on /dev/shm: no other test's files in this count)
    cmd = ["bwrap", "--ro-bind", "/", "/", "--tmpfs", "/dev/shm", "--proc", "/proc", "--bind", str(bound), str(bound)]
    proc = subprocess.Popen([*cmd, sys.executable, "-c", script, str(bound)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.isdigit(), line
        pid = int(line)  # (bwrap's child: no pid namespace of its own here)
        stored = stored_bytes(pid)
        assert (24 << 20) + 100 * 4096 <= stored < 25 << 20, stored  # (the file once, though linked twice; the links)
        stored_bytes(os.getpid())  # (no Uncounted: the host's root, far over 100,000 entries, is not walked)
    finally:
        proc.kill()
        proc.wait()


def test_no_pause_no_reading():
    proc = _child(0, "x = 0\nwhile True: x += 1")
    try:
        watch = osmemory.Watch([proc.pid]).start()
        time.sleep(0.5)
        held = watch.stop()
        assert held.bytes is None and "never all paused" in held.why
        with pytest.raises(Unobserved, match="not observed from the OS"):
            held.of(0)
    finally:
        proc.kill()


@pytest.mark.slow  # (the child imports torch: 4-5 s)
def test_the_watch_ends_the_pause_it_has_read_and_no_other_sleep():
    # osmemory.pause sleeps until the watch, having read the process, wakes it (WAKE_SIGNAL); another sleep,
    # where the signal is ignored as in a rank (CHILD), is not ended by it, and the signal does not end the process either
    code = (
        "import os\nfrom disttrain_lab import osmemory\n"
        "took = osmemory.pause(30)\n"
        "print(f'paused {took:.2f}', flush=True)\n"
        "import threading\n"
        "threading.Timer(0.2, os.kill, (os.getpid(), osmemory.WAKE_SIGNAL)).start()  # (during the next sleep)\n"
        "started = time.monotonic(); time.sleep(0.6)\n"
        "print(f'slept {time.monotonic() - started:.2f}', flush=True)\n"
    )
    proc = _child(10 * 2**20, code)
    try:
        watch = osmemory.Watch([proc.pid]).start()
        out, _ = proc.communicate(timeout=25)
        held = watch.stop()
        assert proc.returncode == 0 and held.of(0) > 10 * 2**20, (proc.returncode, out, held)
        paused, slept = (float(line.split()[1]) for line in out.split("\n")[:2])
        assert paused < 10 and slept >= 0.6, out
    finally:
        proc.kill()


def test_where_nobody_can_watch_nothing_pauses_and_nothing_is_read(monkeypatch):
    # (a laptop without Linux's /proc: the driver's pauses would only cost time, the reading fails closed)
    monkeypatch.setattr(osmemory, "WATCHABLE", False)
    started = time.monotonic()
    assert osmemory.pause(30) == 0.0 and time.monotonic() - started < 1
    held = osmemory.Watch([1]).start().stop()
    assert held.bytes is None and "no pause can be seen nor memory read" in held.why


def test_a_zombie_has_ended_and_a_living_process_has_not():
    """A rank woken from its last pause may exit before the watch is stopped; until its parent reaps it, it is a
    zombie whose /proc files are root's, so the watch, run as the student's uid, is refused its ``syscall``: that
    is the run's end (``{"ended": pid}``), not an error that voids the readings made (seen once in a container,
    beside two CPU-bound processes)."""
    child = os.fork()
    if child == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while not pauses.ended(child) and time.monotonic() < deadline:  # (a zombie once it has exited)
            time.sleep(0.01)
        assert pauses.ended(child)
        assert os.path.exists(f"/proc/{child}")  # (not reaped: still there)
        assert not pauses.ended(os.getpid())
    finally:
        os.waitpid(child, 0)
    assert pauses.ended(child)  # (reaped: gone)


def _pids_running(marker: str) -> list[int]:
    """The processes whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if entry.isdigit() and marker.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not osmemory.WATCHABLE, reason="no /proc to read processes from")
def test_strangers_are_what_the_ranks_left_not_another_program_of_their_user():
    """Beside two "ranks" this process started: an orphan a rank left (its child started a process of its own and
    ended: the grandchild is left to init, in the ranks' session) and a rank's own child count; a process that another
    program left in a session of its own (a browser the student's laptop or a test starts: descended from no rank and
    not from this process) does not, nor one this process started (the grader's helper).  Where the ranks are not this
    process's own (a graded run's sandbox), every process of their uid and cgroup started after them counts."""
    marker = f"{os.getpid()}{time.monotonic_ns() % 10**6}"  # (digits: each sleep's seconds are 3x.<marker>)
    with not_a_subreaper():
        ranks = [
            subprocess.Popen(["sh", "-c", f"(sleep 31.{marker} &); sleep 32.{marker} & sleep 30.{marker}"]),
            subprocess.Popen(["sleep", f"30.{marker}"]),
        ]
        try:
            helper = subprocess.Popen(["sleep", f"33.{marker}"], start_new_session=True)
            subprocess.run(["setsid", "-f", "sleep", f"34.{marker}"], check=True)  # (its parent ends at once)
            deadline, wanted = time.monotonic() + 10, [f"\0{n}.{marker}\0" for n in (31, 32, 34)]
            while time.monotonic() < deadline and not all(_pids_running(w) for w in wanted):
                time.sleep(0.05)
            (orphan,), (child,), (other,) = map(_pids_running, wanted)
            found = pauses.strangers([r.pid for r in ranks])
            assert orphan in found and child in found, (found, orphan, child)
            assert other not in found and helper.pid not in found, (found, other, helper.pid)
            seen_from_elsewhere = subprocess.run(  # (a watcher the ranks do not descend from: the grader's)
                [
                    sys.executable,
                    "-c",
                    f"from disttrain_lab import pauses; print(pauses.strangers({[r.pid for r in ranks]}))",
                ],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            elsewhere = ast.literal_eval(seen_from_elsewhere.stdout.strip())
            assert other in elsewhere and orphan in elsewhere, (elsewhere, other, orphan)
        finally:
            for pid in _pids_running(marker):
                os.kill(pid, 9)
            for r in ranks:
                r.wait()
            helper.wait()
