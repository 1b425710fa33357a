"""Caps for one student's processes, and one step that kills them all: a cgroup, on cgroup v1
or v2, whichever the host has.

A grading host is one of three kinds (``host()`` says which, and what it offers):

- **v2** (Debian 11+, Ubuntu 22.04+, RHEL 9, current Kubernetes nodes): one hierarchy at
  ``/sys/fs/cgroup``.  A node gets ``memory.max`` and ``memory.swap.max = 0`` (no swapping
  around the cap), ``pids.max`` and an equal ``cpu.weight``; every node above it has the
  controllers switched on in ``cgroup.subtree_control`` (v2 hands a controller down only
  where the parent enables it, and only to nodes that hold no process themselves); and
  ``cgroup.kill`` kills every process in it in one step, with no race against a fork.
- **v1** (this project's CI host, older hosts): one hierarchy per controller,
  ``/sys/fs/cgroup/{memory,pids,cpu}``: ``memory.limit_in_bytes`` (and
  ``memory.memsw.limit_in_bytes`` where swap is accounted), ``pids.max``, ``cpu.shares``.
  v1 has no ``cgroup.kill``; killing loops until the node is empty (``pids.max`` bounds
  how long a fork bomb can keep it busy).
- **hybrid** (v1 controllers, and a v2 hierarchy without controllers at
  ``/sys/fs/cgroup/unified``): caps from v1, and the kill from v2's ``cgroup.kill``.

Nodes live below a *base* (``DISTTRAIN_CGROUP_BASE``, relative to each hierarchy's root,
default ``disttrain-lab``): as root the grader creates it; a grader that is not root gets
caps only where an administrator delegated the base to it (created it and gave it to the
grader's user: ``grader/README.md``, "Host requirements").

Run as a file by ``run_sandbox.py`` (loaded by path, under ``python -I``), so it imports
nothing but the standard library.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

MOUNT = Path("/sys/fs/cgroup")
BASE_ENV = "DISTTRAIN_CGROUP_BASE"
DEFAULT_BASE = "disttrain-lab"

# Every student's kernel gets the same CPU weight, and so does every grading step (one
# student) beside it: under contention the CPU is split evenly between the students graded
# at once, however many processes each runs; alone, a student may use every core.  Within a
# step, the grader's own side (nbgrader and the grader kernel, ``steps.py``) is a node of the
# same weight beside the student's kernel: a grader kernel recomputing a reference cannot
# starve the ranks it times, nor they it.  (A quota
# or a cpuset per job would also stop a spinner, but would idle cores an honest student could
# use whenever the classmate beside it waits.)  v1's default share and v2's default weight.
CPU_SHARES = 1024
CPU_WEIGHT = 100
V2_CONTROLLERS = ("memory", "pids", "cpu")


def base() -> str:
    """Where the grader's nodes live, relative to each hierarchy's root."""
    return os.environ.get(BASE_ENV, "").strip().strip("/") or DEFAULT_BASE


def host(mount: Path = MOUNT) -> dict:
    """What this host's cgroups offer: ``{"version": "v2" | "v1" | "hybrid" | None, "caps":
    [the caps a node gets: "memory", "pids", "cpu"], "kill": "cgroup.kill" or "loop"}``."""
    if (mount / "cgroup.controllers").exists():  # one v2 hierarchy
        offered = _read(mount / "cgroup.controllers").split()
        return {"version": "v2", "caps": [c for c in V2_CONTROLLERS if c in offered], "kill": "cgroup.kill"}
    caps = [c for c in ("memory", "pids") if (mount / c / "cgroup.procs").exists()]
    caps += ["cpu"] if (mount / "cpu" / "cpu.shares").exists() else []
    unified = (mount / "unified" / "cgroup.procs").exists()
    if not caps:
        return {"version": "v2" if unified else None, "caps": [], "kill": "cgroup.kill" if unified else None}
    return {"version": "hybrid" if unified else "v1", "caps": caps, "kill": "cgroup.kill" if unified else "loop"}


def problem(mount: Path = MOUNT) -> str | None:
    """Why a node below the base cannot cap memory and processes here (None: it can).  Tries
    it: creates a node with both caps, puts nothing in it, removes it."""
    offered = host(mount)
    missing = [c for c in ("memory", "pids") if c not in offered["caps"]]
    if offered["version"] is None:
        return f"no cgroup hierarchy is mounted at {mount}"
    if missing:
        have = offered["caps"] or "none"
        return f"no cgroup {' or '.join(missing)} controller at {mount} ({offered['version']}: {have})"
    probe = Cgroup(f"{base()}/probe-{os.getpid()}-{time.monotonic_ns()}", mount)
    try:
        probe.create(memory=2**30, pids=64)
    except OSError as exc:
        return f"cannot create a capped cgroup below {base()!r} ({offered['version']}): {exc}" + (
            " -- delegate it to the grader's user, see grader/README.md 'Host requirements'"
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT)
            else ""
        )
    finally:
        probe.destroy(timeout=5)
    return None


class Cgroup:
    """One node, ``relative`` below each hierarchy's root (v2: the one; v1: memory, pids and
    cpu where mounted; hybrid: those and the controller-less v2 one, for the kill)."""

    def __init__(self, relative: str, mount: Path = MOUNT):
        self.relative, self.mount = relative.strip("/"), mount
        self.offered = host(mount)
        version = self.offered["version"]
        self.v2 = (mount if version == "v2" else mount / "unified") / self.relative if version else None
        if version == "v2" or version is None:
            self.v1: dict[str, Path] = {}
        else:
            # (a cpu hierarchy the grader may not write -- a base delegated for memory and pids
            # only -- gives no CPU weight; the caps stand without it)
            self.v1 = {
                c: mount / c / self.relative
                for c in self.offered["caps"]
                if c != "cpu" or _may_create(mount / c / self.relative)
            }
            # hybrid: v2's node only kills; a grader without root keeps to the v1 base delegated
            # to it (v2 would also want the grader's own node below a delegated one to move a process)
            if version == "v1" or os.geteuid() != 0:
                self.v2 = None
        self.dirs = [*self.v1.values(), *([self.v2] if self.v2 is not None else [])]

    def create(self, memory: int | None, pids: int | None) -> Cgroup:
        """Make the node (and the ones above it) and cap it: ``memory`` bytes (swap included),
        ``pids`` processes and threads (None: no cap of that kind), the CPU weight of every
        other node."""
        for c, d in self.v1.items():
            d.mkdir(parents=True, exist_ok=True)
            if (c == "memory" and memory is None) or (c == "pids" and pids is None):
                continue
            if c == "memory":
                (d / "memory.limit_in_bytes").write_text(str(memory))
                if (d / "memory.memsw.limit_in_bytes").exists():  # no swapping around the cap
                    (d / "memory.memsw.limit_in_bytes").write_text(str(memory))
            elif c == "pids":
                (d / "pids.max").write_text(str(pids))
            elif c == "cpu":  # the node's weight, and its grading step's
                for node in (d, d.parent):
                    (node / "cpu.shares").write_text(str(CPU_SHARES))
        if self.v2 is None:
            return self
        if self.offered["version"] != "v2":  # hybrid: the kill only
            self.v2.mkdir(parents=True, exist_ok=True)
            return self
        self._make_v2_path()
        caps = self.offered["caps"]
        if "memory" in caps and memory is not None:
            _write(self.v2 / "memory.max", str(memory))
            if (self.v2 / "memory.swap.max").exists():
                _write(self.v2 / "memory.swap.max", "0")
        if "pids" in caps and pids is not None:
            _write(self.v2 / "pids.max", str(pids))
        if "cpu" in caps:
            for node in (self.v2, self.v2.parent):
                if (node / "cpu.weight").exists():
                    _write(node / "cpu.weight", str(CPU_WEIGHT))
        return self

    def _make_v2_path(self) -> None:
        """Each node from the mount down to this one, the controllers switched on for the
        children of each (a node that enables them for its children holds no process: v2's
        rule; the grader's own processes stay where they are, outside the base)."""
        node, wanted = self.mount, [c for c in self.offered["caps"]]
        for part in Path(self.relative).parts:
            have = _read(node / "cgroup.subtree_control").split()
            need = [c for c in wanted if c not in have]
            if need:
                _write(node / "cgroup.subtree_control", " ".join(f"+{c}" for c in need))
            node = node / part
            node.mkdir(exist_ok=True)

    def add(self, pid: int) -> None:
        """Move ``pid`` in (before it runs anything of the student's)."""
        for d in self.dirs:
            _write(d / "cgroup.procs", str(pid))

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            for node in [d, *[p for p in d.rglob("*") if p.is_dir()]] if d.is_dir() else []:
                try:
                    found |= {int(x) for x in _read(node / "cgroup.procs").split()}
                except OSError:
                    pass
        return found

    def kill(self) -> None:
        """SIGKILL every process in it and below it: v2's ``cgroup.kill`` in one step where the
        node has one (no fork can slip past it), else each process it lists."""
        if self.v2 is not None and (self.v2 / "cgroup.kill").exists():
            try:
                _write(self.v2 / "cgroup.kill", "1")
                return
            except OSError:
                pass  # (gone meanwhile, or an old kernel): the loop below
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def destroy(self, timeout: float = 30.0) -> None:
        """Kill whatever is left in it (and below it), then remove it and its children."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.pids():
                break
            self.kill()
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for d in self.dirs:
            below = sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) if d.is_dir() else []
            for node in [*below, d]:
                _rmdir(node)


def _may_create(path: Path) -> bool:
    """Whether this process may make ``path`` (it may write its nearest existing ancestor)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return os.access(path, os.W_OK)


def _read(path: Path) -> str:
    with open(path) as f:
        return f.read()


def _write(path: Path, value: str) -> None:
    # cgroup files take one write, unbuffered; an error comes back from this write
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _rmdir(path: Path) -> None:
    for _ in range(100):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)  # the last killed task is still leaving the cgroup
