"""A student's cgroup (disttrain_lab/grading/cgroups.py) on the hosts courses run (issue 40):
every cap enforced by this host's kernel (cgroup v1 here: memory, processes), the kill of
cgroup v2 (``cgroup.kill``) on this host's real cgroup2 mount (hybrid: v2 without
controllers, which ``cgroup.procs`` and ``cgroup.kill`` do not need), what v2 writes where
it has the controllers, and a host that cannot cap named as such.

Unproven here: the kernel enforcing v2's ``memory.max``/``pids.max`` (this host binds those
controllers to v1); test_v2_caps_are_written_where_the_controllers_are checks what is written.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from disttrain_lab.grading import cgroups, steps

HOST = cgroups.host()
ROOT = os.geteuid() == 0
needs_v1_caps = pytest.mark.skipif(
    not ROOT or HOST["version"] not in ("v1", "hybrid") or {"memory", "pids"} - set(HOST["caps"]),
    reason=f"needs root and cgroup v1 memory and pids controllers (this host: {HOST})",
)
needs_v2_mount = pytest.mark.skipif(
    not ROOT or HOST["kill"] != "cgroup.kill", reason=f"needs root and a cgroup2 mount (this host: {HOST})"
)


@pytest.fixture
def node(request):
    group = cgroups.Cgroup(f"{cgroups.base()}/test-{os.getpid()}-{request.node.name[:40]}")
    yield group
    group.destroy()
    assert not [d for d in group.dirs if d.exists()], "the cgroup was not removed"


def _run_in(group: cgroups.Cgroup, code: str, **kw) -> subprocess.CompletedProcess:
    """``python -c code`` as a member of ``group`` from its first instruction."""
    return subprocess.run(
        [sys.executable, "-I", "-c", textwrap.dedent(code)],
        preexec_fn=lambda: group.add(os.getpid()),
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )


@needs_v1_caps
def test_memory_cap_is_enforced(node):
    node.create(memory=96 * 2**20, pids=64)
    run = _run_in(
        node,
        """
        chunks = []
        for i in range(64):                      # 512 MiB in 8 MiB pieces, every page touched
            chunks.append(bytearray(8 * 2**20))
            print(i, flush=True)
        """,
    )
    assert run.returncode == -9, (run.returncode, run.stderr[-500:])  # the OOM killer, inside the cap
    reached = len(run.stdout.split()) * 8
    assert 32 <= reached <= 96, f"died after {reached} MiB, expected about the cap's 96 MiB"


@needs_v1_caps
def test_process_cap_is_enforced(node):
    node.create(memory=2**30, pids=24)
    run = _run_in(
        node,
        """
        import os, threading, time
        started = 0
        try:
            for _ in range(200):
                threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
                started += 1
        except RuntimeError as exc:                  # "can't start new thread"
            print('refused', started, exc, flush=True)
        else:
            print('allowed', started, flush=True)
        os._exit(0)
        """,
    )
    kind, started = run.stdout.split()[:2]
    assert kind == "refused" and int(started) < 24, run.stdout


@needs_v1_caps
def test_the_kill_leaves_nothing_even_of_a_process_that_keeps_forking(node):
    node.create(memory=2**30, pids=64)
    proc = subprocess.Popen(
        [sys.executable, "-I", "-c", "import os, time\nwhile True:\n    os.fork() or time.sleep(0.01)\n"],
        preexec_fn=lambda: node.add(os.getpid()),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while len(node.pids()) < 32 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(node.pids()) >= 32  # the process cap keeps it below 64
    node.destroy(timeout=30)
    proc.wait(timeout=30)
    assert not [d for d in node.dirs if d.exists()]


@needs_v2_mount
def test_v2_kill_on_the_real_cgroup2_mount(node):
    """cgroup.procs and cgroup.kill on this host's cgroup2 mount: every process of the node
    (a tree that ignores SIGTERM and keeps forking) dies in one write, without the loop."""
    node.create(memory=2**30, pids=128)
    assert node.v2 is not None and (node.v2 / "cgroup.kill").exists(), node.dirs
    proc = subprocess.Popen(
        [
            sys.executable,
            "-I",
            "-c",
            "import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "for _ in range(20):\n    os.fork() or time.sleep(0.05)\ntime.sleep(600)\n",
        ],
        preexec_fn=lambda: node.add(os.getpid()),
    )
    deadline = time.monotonic() + 30
    in_v2 = set()
    while len(in_v2) < 21 and time.monotonic() < deadline:
        in_v2 = {int(p) for p in (node.v2 / "cgroup.procs").read_text().split()}
        time.sleep(0.05)
    assert proc.pid in in_v2 and len(in_v2) >= 21
    cgroups._write(node.v2 / "cgroup.kill", "1")  # what Cgroup.kill writes first, alone
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while (node.v2 / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not (node.v2 / "cgroup.procs").read_text().split()
    assert "populated 0" in (node.v2 / "cgroup.events").read_text()


def _fake_v2(root: Path, relative: str, controllers: str = "cpu memory pids") -> Path:
    """A folder laid out as a cgroup2 mount whose nodes down to ``relative`` exist with the
    files the kernel would create (a plain folder: mkdir makes no interface files)."""
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("")
    node = root
    for part in Path(relative).parts:
        node = node / part
        node.mkdir()
        for name in ("cgroup.subtree_control", "cgroup.procs", "cgroup.kill", "cpu.weight", "memory.max"):
            (node / name).write_text("")
        (node / "pids.max").write_text("")
        (node / "memory.swap.max").write_text("")
    return node


def test_v2_caps_are_written_where_the_controllers_are(tmp_path):
    leaf = _fake_v2(tmp_path, "disttrain-lab/step-1/kernel-2")
    group = cgroups.Cgroup("disttrain-lab/step-1/kernel-2", mount=tmp_path)
    assert group.offered == {"version": "v2", "caps": ["memory", "pids", "cpu"], "kill": "cgroup.kill"}
    assert group.dirs == [leaf] and group.v1 == {}
    group.create(memory=3 * 2**30, pids=512)
    assert (leaf / "memory.max").read_text() == str(3 * 2**30)
    assert (leaf / "memory.swap.max").read_text() == "0"  # no swapping around the cap
    assert (leaf / "pids.max").read_text() == "512"
    assert (leaf / "cpu.weight").read_text() == (leaf.parent / "cpu.weight").read_text() == "100"
    # each node above the leaf hands the three controllers down (v2 gives a child only those)
    for node in (tmp_path, tmp_path / "disttrain-lab", leaf.parent):
        assert (node / "cgroup.subtree_control").read_text() == "+memory +pids +cpu", node
    assert (leaf / "cgroup.subtree_control").read_text() == ""  # the leaf holds the processes
    group.add(1234)
    assert (leaf / "cgroup.procs").read_text() == "1234"


def test_a_host_without_the_controllers_is_named(tmp_path, monkeypatch):
    _fake_v2(tmp_path, "x", controllers="cpu io")
    assert cgroups.host(tmp_path)["caps"] == ["cpu"]
    assert cgroups.problem(tmp_path) == f"no cgroup memory or pids controller at {tmp_path} (v2: ['cpu'])"
    assert cgroups.problem(tmp_path / "nothing") == f"no cgroup hierarchy is mounted at {tmp_path / 'nothing'}"
    monkeypatch.setenv(cgroups.BASE_ENV, "/delegated/grading/")
    assert cgroups.base() == "delegated/grading"


@needs_v1_caps
def test_a_grader_without_root_and_without_delegation_gets_no_caps_and_is_told_how():
    # cgroups.py alone, as run_sandbox.py loads it (standard library only: no package, no venv);
    # its source on stdin (the pytest and repository folders are root's only)
    code = (
        "import sys, types\n"
        "cgroups = types.ModuleType('cgroups')\n"
        "sys.modules['cgroups'] = cgroups\n"
        "exec(compile(sys.stdin.read(), 'cgroups.py', 'exec'), cgroups.__dict__)\n"
        "print(cgroups.problem())\n"
    )
    run = subprocess.run(
        ["setpriv", "--reuid=64201", "--regid=64201", "--clear-groups", sys.executable, "-I", "-c", code],
        input=Path(cgroups.__file__).read_text(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert f"cannot create a capped cgroup below {cgroups.base()!r}" in run.stdout, run.stdout + run.stderr
    assert "delegate it to the grader's user" in run.stdout


@needs_v1_caps
def test_a_steps_grader_side_has_a_cpu_node_beside_its_students_kernel(node):
    """steps.py: the nbgrader process joins ``<step>/grader`` before it runs anything, so the
    grader kernel it starts and the student's kernel (``<step>/kernel-N``) weigh the same."""
    join, unjoined = steps._grader_node(node.relative)
    assert unjoined == "" and set(join) == {steps._JOIN}
    child = subprocess.run(
        [sys.executable, "-c", steps._CHILD_SETUP + "print(open('/proc/self/cgroup').read())"],
        env={**os.environ, **join},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    where = {c: path for _, cs, path in (x.split(":", 2) for x in child.stdout.split()) for c in cs.split(",")}
    for c in ("memory", "pids", *(["cpu"] if "cpu" in HOST["caps"] else [])):
        assert where[c] == f"/{node.relative}/grader", (c, where)
    kernel = cgroups.Cgroup(f"{node.relative}/kernel-1").create(memory=2**30, pids=64)
    if "cpu" in HOST["caps"]:
        shares = {
            p.name: (p / "cpu.shares").read_text() for p in (kernel.v1["cpu"], kernel.v1["cpu"].parent / "grader")
        }
        assert shares == {"kernel-1": "1024\n", "grader": "1024\n"}
    # uncapped: the grader's side has no memory or process cap of the student's
    grader = cgroups.MOUNT / "memory" / node.relative / "grader"
    assert int((grader / "memory.limit_in_bytes").read_text()) > 2**40
