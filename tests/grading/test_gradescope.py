"""Grading on Gradescope (issue 43, item 2): `disttrain-lab gradescope` packs the fixture lab
00_basics, the package is unpacked in Gradescope's documented layout (a folder standing for
/autograder), and `run_autograder` grades there:

- an honest notebook (the solution) on this host, in the kit's sandbox: its results.json gives,
  per test, the scores `disttrain-lab grade` gave the same notebook (the lab's round trip);
- in a process with only Docker's default capabilities and a seccomp filter refusing new
  namespaces (Gradescope's container), the default package refuses: every test 0, saying why
  and which setting the instructor can choose;
- there, the package built with `--sandbox container` grades a hostile notebook (it tries to
  read the solution and the gradebook, and leaves a process behind that keeps writing its own
  results.json) to exactly the scores `disttrain-lab grade` gives it in the full sandbox: as
  another uid, it reads nothing of the grader's, writes no results, and outlives nothing.

Three gradings in all (the honest one's reference is the round trip's).  Needs root, a host that
sandboxes, unshare/setpriv/ss: elsewhere skipped with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook

from disttrain_lab import cli, grading
from disttrain_lab.grading import config, gradescope, run_container, sandbox, syscall_filter
from tests.roundtrip import FIXTURE_LIMITS, FIXTURES, Course, load, round_trip, submit, with_solution

LAB = "00_basics"
DOCKER_CAPS = (  # Docker's default capabilities (docs.docker.com, "Runtime privilege and Linux capabilities")
    "chown,dac_override,fsetid,fowner,mknod,net_raw,setgid,setuid,setfcap,setpcap,net_bind_service,sys_chroot,kill,"
    "audit_write"
)
TOOLS = ("unshare", "setpriv", "mount", "ss")
WHY_NOT = (
    "needs root"
    if os.geteuid() != 0
    else f"no {', '.join(t for t in TOOLS if not shutil.which(t))}"
    if not all(shutil.which(t) for t in TOOLS)
    else f"no syscall filter: {syscall_filter.problem()}"
    if syscall_filter.problem()
    else None
)
needs_container = pytest.mark.skipif(
    WHY_NOT is not None, reason=f"cannot stand in for Gradescope's container: {WHY_NOT}"
)
pytestmark = pytest.mark.timeout(900)

MARKER = "gradescope-hostile-writer"  # in the command line of the process the hostile notebook leaves behind

# Run a command as in Gradescope's container: a mount namespace of its own where a folder that keeps
# the interpreter from other users (this host's /root) is opened (tmpfs over it, the interpreter
# bound back: as an image's /usr is), then root with Docker's default capabilities only, under a
# seccomp filter that refuses new namespaces (what Docker's default profile does without CAP_SYS_ADMIN).
HARNESS = r"""
import os, subprocess, sys
caps, filter_path, *cmd = sys.argv[1:]

def closed_above(path):
    parts = os.path.realpath(path).split(os.sep)
    return next((os.sep.join(parts[:i]) for i in range(2, len(parts)) if not os.stat(os.sep.join(parts[:i])).st_mode & 1), None)

subprocess.run(["mount", "--make-rprivate", "/"], check=True)
# the interpreter, and the checkout the kit runs from (a clone below a 0700 folder: mktemp -d)
checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(filter_path))))
for kept in sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), checkout}):
    top = closed_above(kept)
    if top:
        hold = f"/tmp/.gradescope-hold-{os.getpid()}"
        os.makedirs(hold)
        for step in (["--bind", kept, hold], ["-t", "tmpfs", "-o", "mode=0755,size=1m", "tmpfs", top]):
            subprocess.run(["mount", *step], check=True)
        os.makedirs(kept, exist_ok=True)
        subprocess.run(["mount", "--move", hold, kept], check=True)
        os.rmdir(hold)
inner = (
    "import importlib.util, os, sys\n"
    "spec = importlib.util.spec_from_file_location('sf', sys.argv[1])\n"
    "sf = importlib.util.module_from_spec(spec); spec.loader.exec_module(sf); sf.install()\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)
bounding = "-all," + ",".join("+" + c for c in caps.split(","))
os.execvp("setpriv", ["setpriv", "--bounding-set", bounding, "--", sys.executable, "-I", "-c", inner, filter_path, *cmd])
"""


def in_container(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    harness = [sys.executable, "-I", "-c", HARNESS, DOCKER_CAPS, syscall_filter.__file__, *cmd]
    return subprocess.run(["unshare", "--mount", "--", *harness], env=env, capture_output=True, text=True, timeout=600)


def unpack(package: Path, base: Path, notebook) -> tuple[Path, Path]:
    """Gradescope's layout (gradescope-autograders.readthedocs.io/en/latest/specs/) under ``base``:
    autograder/source (the zip), autograder/run_autograder, autograder/submission, autograder/results;
    and the kit where setup.sh puts it (opt/kit: readable by every user).  (root, kit)"""
    root = base / "autograder"
    with zipfile.ZipFile(package) as z:
        z.extractall(root / "source")
        for info in z.infolist():
            os.chmod(root / "source" / info.filename, info.external_attr >> 16 & 0o777)
    shutil.copy(root / "source" / "run_autograder", root / "run_autograder")
    (root / "results").mkdir()
    submit_to = root / "submission"
    submit_to.mkdir()
    nbformat.write(notebook, submit_to / f"{LAB}.ipynb")
    kit = base / "opt" / "kit"
    shutil.copytree(root / "source" / "kit", kit)
    return root, kit


def environment(root: Path, kit: Path, **extra) -> dict:
    """run_autograder's environment: the fixture's limits, this venv's interpreter, the packed kit first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "DISTTRAIN_SANDBOX" and not k.startswith("PYTEST")}
    limits = config.Limits(**FIXTURE_LIMITS).environment()
    limits.pop("DISTTRAIN_SANDBOX")  # the package's own setting
    env.update(limits, DISTTRAIN_AUTOGRADER_DIR=str(root), DISTTRAIN_PYTHON=sys.executable, PYTHONPATH=str(kit))
    env.update(extra)
    return env


def by_grade_id(results: dict) -> dict[str, float]:
    """{grade_id: score}: a test is named "exercise (grade_id)", or its grade_id alone."""
    return {re.search(r"(test_\w+)\)?$", t["name"]).group(1): t["score"] for t in results["tests"]}


def hostile_notebook(blank, results_files: list[Path], solutions: list[Path], heartbeat: Path):
    """The blank lab, its three exercises done by a student who cheats where it can."""
    writer = (
        f"import json, os, time  # {MARKER}\n"
        f"paths = {[str(p) for p in results_files]!r}\n"
        "end = time.time() + 120\n"
        "while time.time() < end:\n"
        f"    open({str(heartbeat) + '/'!r} + str(os.getuid()), 'w').close()  # (where /tmp is the container's)\n"
        "    for p in paths:\n"
        "        try:\n"
        "            with open(p, 'w') as f:\n"
        "                json.dump({'score': 1000, 'output': 'PWNED'}, f)\n"
        "        except OSError:\n"
        "            pass\n"
        "    time.sleep(0.2)\n"
    )
    add = (  # right, and a process of its own, in a session of its own, writing its own results.json
        "def add(a, b):\n    return a + b\n\n"
        "import subprocess as _sp, sys as _sys\n"
        f"_sp.Popen([_sys.executable, '-c', {writer!r}], start_new_session=True)\n"
    )
    mean = (  # wrong, unless it can read the instructor's solution (the package's source, the gradebook)
        "def mean(xs):\n    raise NotImplementedError('not done')\n\n"
        "import glob as _glob\n"
        f"for _path in [*{[str(p) for p in solutions]!r}, *_glob.glob('/tmp/*/course/gradebook.db')]:\n"
        "    try:\n"
        "        with open(_path, 'rb') as _f:\n"
        "            _found = ('return sum(xs)' + ' / len(xs)').encode() in _f.read()\n"
        "    except OSError:\n"
        "        continue\n"
        "    if _found:\n"
        "        def mean(xs):\n            return sum(xs) / len(xs)\n"
    )
    scale = (  # right only where the kernel does not run as root
        "import os as _os\n\ndef scale(xs, k):\n    return [k * x for x in xs] if _os.getuid() != 0 else None\n"
    )
    return with_solution(with_solution(with_solution(blank, "ex_add", add), "ex_mean", mean), "ex_scale", scale)


def leftovers() -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and MARKER.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            pass
    return found


# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The round trip's course of 00_basics (released, two students graded), a package of it built by
    the Python API (default: auto) and one by the command line (--sandbox container), and a folder
    every user may enter for the layouts (pytest's own tmp is root's alone)."""
    trip = round_trip(LAB, FIXTURES, FIXTURE_LIMITS)
    work = tmp_path_factory.mktemp("gradescope")
    course = Course(work, LAB, FIXTURES, FIXTURE_LIMITS)
    shutil.copytree(trip.course.course, course.course)
    shutil.copytree(trip.course.release, course.release)
    default = work / "autograder.zip"
    gradescope.build(LAB, default, course=course.course, source=FIXTURES, release=course.release)
    container = work / "autograder-container.zip"
    env = {"DISTTRAIN_SOURCE_DIR": str(FIXTURES), "DISTTRAIN_RELEASE_DIR": str(course.release)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        args = [
            "gradescope",
            LAB,
            "--out",
            str(container),
            "--course-dir",
            str(course.course),
            "--sandbox",
            "container",
        ]
        assert cli.main(args) == 0
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    base = Path(tempfile.mkdtemp(prefix="disttrain-gradescope-test-", dir="/tmp"))
    os.chmod(base, 0o755)
    yield trip, course, default, container, base
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow  # (the round trip it packs is graded, once per session)
def test_the_package_holds_what_gradescope_runs_and_no_student(packed):
    trip, course, default, container, _ = packed
    with zipfile.ZipFile(default) as z:
        names = set(z.namelist())
        modes = {i.filename: i.external_attr >> 16 & 0o777 for i in z.infolist()}
        setup = z.read("setup.sh").decode()
        settings = json.loads(z.read(gradescope.PACKAGE))
        db = z.read("lab/gradebook.db")
    assert {"setup.sh", "run_autograder", "kit/pyproject.toml", "kit/grader/nbgrader_config.py"} <= names
    assert {f"lab/source/{LAB}/{LAB}.ipynb", f"lab/release/{LAB}/{LAB}.ipynb", "lab/gradebook.db"} <= names
    assert "kit/disttrain_lab/grading/gradescope.py" in names and not any("__pycache__" in n for n in names)
    assert modes["setup.sh"] == modes["run_autograder"] == 0o755
    assert subprocess.run(["bash", "-n", "-c", setup]).returncode == 0
    # the kit with the instructor's extra, torch only through the pinned `torch` extra (torch==X), CPU build
    assert '-e "$PREFIX/kit[grader,torch]"' in setup and "download.pytorch.org/whl/cpu" in setup
    installs = [shlex.split(line) for line in setup.splitlines() if " install " in line and "pip" in line]
    assert installs and not any("torch" in words or any(w.startswith("torch") for w in words) for words in installs)
    assert re.search(r'torch = \["torch==[\d.]+"\]', (Path(config.REPO_ROOT) / "pyproject.toml").read_text())
    assert settings["sandbox"] == "auto" and settings["hidden_visibility"] == "after_due_date"
    assert [(t["grade_id"], t["max_score"], t["hidden"]) for t in settings["tests"]] == [
        ("test_add", 1.0, True),
        ("test_mean", 2.0, True),
        ("test_scale", 1.0, True),
    ]
    # the course's gradebook, its students gone (their names and grades never leave the course)
    unpacked = course.root / "packed.db"
    unpacked.write_bytes(db)
    with Gradebook(f"sqlite:///{unpacked}") as gb:
        assert [a.name for a in gb.assignments] == [LAB] and gb.students == []
    assert b"blank" not in db and b"full" not in db.replace(b"fully", b"")
    with zipfile.ZipFile(container) as z:
        assert json.loads(z.read(gradescope.PACKAGE))["sandbox"] == "container"


@pytest.mark.slow
@pytest.mark.skipif(sandbox.problem() is not None or bool(sandbox.missing()), reason="this host cannot sandbox")
def test_run_autograder_gives_grades_scores(packed):
    trip, course, default, _, base = packed
    root, kit = unpack(default, base / "honest", load(FIXTURES / LAB / f"{LAB}.ipynb"))
    started = time.monotonic()
    done = subprocess.run(
        ["bash", str(root / "run_autograder")], env=environment(root, kit), capture_output=True, text=True, timeout=600
    )
    print(f"run_autograder (honest, the kit's sandbox): {time.monotonic() - started:.0f} s")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((root / "results" / "results.json").read_text())
    expected = {k: v for k, v in trip.table["full"].items() if k != "total"}
    assert by_grade_id(results) == expected and results["score"] == trip.table["full"]["total"] == 4
    assert [t["name"] for t in results["tests"]] == [
        "Fixture: basics (test_add)",
        "Mean (test_mean)",
        "Mean (test_scale)",
    ]
    assert all(t["visibility"] == "after_due_date" and t["status"] == "passed" for t in results["tests"])
    assert "the kit's sandbox" in results["output"] and results["stdout_visibility"] == "hidden"
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700  # the package, the submission, the results: root's only


@pytest.mark.slow
@needs_container
def test_in_gradescopes_container_it_refuses_by_default_and_grades_as_stated_in_container_mode(packed):
    trip, course, default, container, base = packed
    heartbeat = base / "heartbeat"
    heartbeat.mkdir(mode=0o1777)
    os.chmod(heartbeat, 0o1777)
    home = base / "home"
    home.mkdir(mode=0o700)  # the grader's home (HOME): root's alone, as /root is in an image
    roots = [base / "refused" / "autograder", base / "container" / "autograder"]
    hostile = hostile_notebook(
        course.blank(),
        [r / "results" / "results.json" for r in roots],
        [r / "source" / "lab" / "source" / LAB / f"{LAB}.ipynb" for r in roots],
        heartbeat,
    )
    # what `disttrain-lab grade` gives the hostile notebook, in the kit's sandbox
    submit(course.course, "hostile", LAB, hostile)
    course.grade(["hostile"], feedback=False)
    expected = {k: v for k, v in grading.scores(LAB, course.course)["hostile"].items() if k != "total"}
    assert expected == {"test_add": 1.0, "test_mean": 0.0, "test_scale": 1.0}
    for p in heartbeat.iterdir():
        p.unlink()

    # the default package refuses: every test 0, saying what and which setting
    root, kit = unpack(default, base / "refused", hostile)
    done = in_container(["bash", str(root / "run_autograder")], environment(root, kit, HOME=str(home)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    refused = json.loads((root / "results" / "results.json").read_text())
    assert refused["score"] == 0 and all(t["score"] == 0 for t in refused["tests"])
    for said in [refused["output"], *(t["output"] for t in refused["tests"])]:
        assert "Not graded" in said and "cannot make mount, pid, IPC and network namespaces" in said
        assert "--sandbox container" in said
    assert not list(heartbeat.iterdir())  # no student code ran

    # container mode grades, with the guarantees stated
    root, kit = unpack(container, base / "container", hostile)
    started = time.monotonic()
    done = in_container(["bash", str(root / "run_autograder")], environment(root, kit, HOME=str(home)))
    print(f"run_autograder (hostile, container mode): {time.monotonic() - started:.0f} s")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results_file = root / "results" / "results.json"
    results = json.loads(results_file.read_text())
    assert by_grade_id(results) == expected  # read neither solution nor gradebook; not root
    assert results["score"] == 2 and "container mode (DISTTRAIN_SANDBOX=container)" in results["output"]
    # (its mean() raised on the rank the grader kernel's test ran it on)
    assert "ExerciseError: mean failed on a rank: rank 0 raised NotImplementedError: not done" in [
        t.get("output") for t in results["tests"]
    ]
    # its writer ran, as a uid of container mode's, and is gone; results.json stays the grader's
    beats = list(heartbeat.iterdir())
    assert beats and all(run_container.UID_FIRST <= int(p.name) for p in beats)
    before = {p: p.stat().st_mtime for p in beats}
    time.sleep(1.5)
    assert {p: p.stat().st_mtime for p in beats} == before and leftovers() == []
    assert json.loads(results_file.read_text()) == results and "PWNED" not in results_file.read_text()
    assert not list(Path("/tmp").glob("kernel-*/work"))  # each kernel's own folder, removed


def test_a_lab_never_released_is_refused(monkeypatch, capsys, tmp_path):
    # (every option's help: tests/kit/test_commands.py, test_every_option_of_every_command_has_help)
    monkeypatch.setenv("DISTTRAIN_SOURCE_DIR", str(FIXTURES))
    out = tmp_path / "autograder.zip"
    assert cli.main(["gradescope", LAB, "--out", str(out), "--course-dir", str(tmp_path / "none")]) == 1
    assert "release the lab first" in capsys.readouterr().err and not out.exists()


# ----------------------------------------------------------------------------------------
# container mode's parts, without grading


def test_container_is_a_mode_that_says_what_it_is(monkeypatch, tmp_path):
    assert "container" in config.SANDBOX_MODES
    monkeypatch.setattr(run_container, "problem", lambda: "the grader lacks the capabilities CAP_SETUID")
    with pytest.raises(config.SandboxRefused, match="DISTTRAIN_SANDBOX=container cannot grade here: the grader lacks"):
        config.Limits(sandbox="container").sandboxed()
    monkeypatch.setattr(run_container, "problem", lambda: None)
    isolated, why = config.Limits(sandbox="container").sandboxed()
    assert not isolated and why.startswith(config.CONTAINER) and "NOT isolated" in why
    assert "grading in container mode" in config.isolation_notice(why)
    assert "WITHOUT isolation" in config.isolation_notice("switched off")
    report = grading.grade_report(LAB, [], {}, tmp_path, why).read_text()
    assert f"isolation: {why}" in report and "ran as the grader" not in report


STUDENT_SOCKETS = r"""
import os, socket, time
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
c = socket.create_connection(srv.getsockname()); a, _ = srv.accept()
c.sendall(b"x" * 1000); a.recv(2000)
print(os.getpid(), flush=True)
time.sleep(60)
"""

# in the container, as the grader: the student's code (argv[2]) started as another uid (argv[1]); a probe goes on
# from here, in a `try:` whose `finally:` kills the student
AS_STUDENT = r"""
import json, os, subprocess, sys, time
uid, student_code = int(sys.argv[1]), sys.argv[2]

def become():
    os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)

student = subprocess.Popen([sys.executable, "-I", "-c", student_code], preexec_fn=become, stdout=subprocess.PIPE, text=True)
"""

# a student's process holding a TCP connection, and what the grader sees of it
PROBE = (
    AS_STUDENT
    + r"""
from disttrain_lab import wire
from disttrain_lab.grading import remote
try:
    pid = int(student.stdout.readline())
    found = {"pid": pid, "reader": remote.reader(os.getpid())}
    for user in (None, uid):
        try:
            owner = wire.owners([pid], user=user)
            found[f"as {user}"] = sorted({owner[s.inode] for s in wire.snapshot(user=user).values() if s.inode in owner})
        except RuntimeError:  # its /proc/<pid>/fd could not be read
            found[f"as {user}"] = "unread"
    found["pids"] = remote.host_pids([pid], os.getpid(), uid) == [pid]
    found["pids of another uid"] = remote.host_pids([pid], os.getpid(), uid + 1)
finally:
    student.kill()
print(json.dumps(found))
"""
)


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
@needs_container
def test_the_grader_reads_another_uids_sockets_as_that_uid_in_a_container():
    """Root without CAP_SYS_PTRACE cannot read another uid's /proc/<pid>/fd, so it sees no owner of
    its sockets (the count would fail); read as that uid (setpriv, effective ids only: remote.reader,
    wire.owners) it does."""
    uid = run_container.UID_FIRST + 12345
    done = in_container([sys.executable, "-c", PROBE, str(uid), STUDENT_SOCKETS], dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    pid = found.pop("pid")
    assert found == {"reader": uid, "as None": "unread", f"as {uid}": [pid], "pids": True, "pids of another uid": None}


# in the container: a student's rank (another uid) holding 50 MiB, paused as lab 4's driver pauses (osmemory.pause)
STUDENT_PAUSES = r"""
import os, signal, time
ballast = bytearray(50 * 2**20)
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
class Woken(Exception):
    pass
def woken(*_):
    raise Woken
signal.signal(signal.SIGUSR2, woken)
print(os.getpid(), flush=True)
started = time.monotonic()
try:
    time.sleep(60)
except Woken:
    pass
print(round(time.monotonic() - started, 2), flush=True)
"""

PROBE_MEMORY = (
    AS_STUDENT
    + r"""
from disttrain_lab import osmemory
try:
    pid = int(student.stdout.readline())
    found = {}
    held = osmemory.Watch([pid]).start()
    time.sleep(1)
    held = held.stop()
    found["as None"] = held.why if held.bytes is None else held.bytes
    watch = osmemory.Watch([pid], user=uid).start()
    slept = float(student.stdout.readline())
    held = watch.stop()
    found[f"as {uid}"] = (held.bytes is not None and held.bytes[0] > 50 * 2**20) or (held.why or held.bytes)
    found["woken"] = slept < 30
finally:
    student.kill()
print(json.dumps(found))
"""
)


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
@needs_container
def test_the_grader_reads_another_uids_memory_as_that_uid_in_a_container():
    """Lab 4's memory from the OS in Gradescope's container: root without CAP_SYS_PTRACE cannot read another
    uid's /proc/<pid>/smaps_rollup nor see it pause; the watch run as that uid (osmemory.Watch(user=...),
    pauses.py) reads it and ends its pause."""
    uid = run_container.UID_FIRST + 12346
    done = in_container([sys.executable, "-c", PROBE_MEMORY, str(uid), STUDENT_PAUSES], dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert "could not be read" in found.pop("as None") and found == {f"as {uid}": True, "woken": True}, found


# in the container: a student's rank (another uid) waiting for the gate's answer in its main thread, as gate.py waits
STUDENT_AT_THE_GATE = r"""
import os, socket, struct
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
c = socket.create_connection(srv.getsockname()); a, _ = srv.accept()
c.settimeout(None)
c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", 60, 0))
print(os.getpid(), os.fstat(c.fileno()).st_ino, flush=True)
c.recv(1)
"""

PROBE_GATE = (
    AS_STUDENT
    + r"""
from disttrain_lab import pauses
from disttrain_lab.grading import gatewatch
try:
    pid, inode = map(int, student.stdout.readline().split())
    time.sleep(0.5)  # (into its recv)
    found = {"inode": inode}
    for user in (None, uid):
        try:
            found[f"as {user}"] = gatewatch.receiving(pid, user)
        except PermissionError:
            found[f"as {user}"] = "refused"
        try:
            found[f"memory as {user}"] = gatewatch.read_as(user, pauses.memory_while_receiving, "--memory", pid)
        except PermissionError:
            found[f"memory as {user}"] = "refused"
finally:
    student.kill()
print(json.dumps(found))
"""
)


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
@needs_container
def test_the_gate_sees_a_held_rank_wait_as_that_uid_in_a_container():
    """#42: the gatekeeper's check that a held rank's main thread waits on its gate connection reads
    /proc/<pid>/syscall and /proc/<pid>/fd, which root without CAP_SYS_PTRACE may not read for another uid; read
    as that uid (pauses.py --receiving, setpriv's effective ids) it sees the wait, so an honest rank in
    Gradescope's container is held, not unobserved; and its private memory while it waits (lab 9), likewise."""
    uid = run_container.UID_FIRST + 12347
    done = in_container([sys.executable, "-c", PROBE_GATE, str(uid), STUDENT_AT_THE_GATE], dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    memory = found.pop(f"memory as {uid}")
    assert found == {
        "inode": found["inode"],
        "as None": "refused",
        f"as {uid}": found["inode"],
        "memory as None": "refused",
    }, found
    # ... and lab 9's reading of its memory while it waits there (pauses.py --memory): the same socket, some bytes
    assert memory[0] == found["inode"] and memory[1] > 0, memory


def test_a_failed_predictions_expected_value_is_withheld_until_the_due_date(tmp_path, monkeypatch):
    # Gradescope shows results while a student may still resubmit: the value shows only after the
    # due date it writes into submission_metadata.json, as the feedback page does (config.show_expected)
    monkeypatch.delenv("DISTTRAIN_SHOW_EXPECTED", raising=False)
    assert not gradescope._expected_shown(tmp_path)  # no metadata: no due date known
    for due, shown in (("2000-01-01T00:00:00.000000-07:00", True), ("2999-01-01T00:00:00.000000+00:00", False)):
        (tmp_path / "submission_metadata.json").write_text(json.dumps({"assignment": {"due_date": due}}))
        assert gradescope._expected_shown(tmp_path) is shown, due
    monkeypatch.setenv("DISTTRAIN_SHOW_EXPECTED", "always")
    assert gradescope._expected_shown(tmp_path)
