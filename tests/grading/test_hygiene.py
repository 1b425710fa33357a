"""Host hygiene (issue 42, item 6): grading leaves nothing in the host's temp folder, and what a
student's kernel leaves where the grader cleans up (10,000 nested folders, a folder nobody may
read, links to the grader's files and folders, a named pipe, a socket, names with newlines or
that are not UTF-8) neither stops the clean-up nor reaches past it: the classmate graded next
in the same run keeps their score, the next run on the host starts, and the grader's files a
link pointed to are still there.

``trees.remove`` is tried on such trees alone (as the grader's own, and as a student's: then
removed as the student), at its time limit and with a file it may not remove; then a grading
step killed at its time cap, a killed run's leftovers met by the next run, and a real grading
of three students whose kernels leave such trees in the one host folder they may write (the
kernel's socket folder), one of them dying after it.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from disttrain_lab import grading
from disttrain_lab.grading import cgroups, sandbox, steps, trees
from tests.grading.test_grading import FIXTURE_LIMITS, FIXTURES, Course, processes_with, submit, with_solution
from tests.notebooks import load

CAN_SANDBOX = sandbox.problem() is None and not sandbox.missing()
needs_sandbox = pytest.mark.skipif(not CAN_SANDBOX, reason=f"needs a full sandbox: {sandbox.problem()}")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to be a student's uid)")
pytestmark = pytest.mark.timeout(900)

STUDENT_UID = 64990  # (a uid of no account: what a sandboxed kernel runs as)
DEPTH = 10_000
LIMITS = dict(FIXTURE_LIMITS, student_memory=1536 * 2**20, student_pids=256, sandbox="on")

# what a hostile student leaves: defines leave_trees(where, targets, depth) -> "ok" or why not (run in a
# student's kernel, in a child that became a student's uid, and in the grader's own process)
TREES = r"""
import os, socket  # (imported before a child becomes the student, who may not read the interpreter's files)


def leave_trees(where, targets, depth):
    back = os.open(".", os.O_RDONLY)
    try:
        os.makedirs(os.path.join(where, "h42-trees"), exist_ok=True)
        top = os.open(os.path.join(where, "h42-trees"), os.O_RDONLY)
        os.fchdir(top)
        os.mkdir("deep")
        os.chdir("deep")
        for _ in range(depth):  # deeper than a path may be long: only relative steps reach the bottom
            os.mkdir("d")
            os.chdir("d")
        os.symlink(targets["file"], "link-at-the-bottom")
        os.fchdir(top)
        os.makedirs("locked/inner")
        open("locked/inner/f", "w").write("x")
        os.chmod("locked/inner", 0)
        os.chmod("locked", 0)
        for name, target in targets.items():
            os.symlink(target, "to-" + name)
        os.mkfifo("fifo")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind("sock")
        open("name\nwith\nnewlines", "w").write("x")
        os.mkdir(b"\xff\xfe-not-utf8")
        os.fchmod(top, 0o500)  # its own folder: not writable, as left
        os.close(top)
        return "ok"
    except Exception as exc:
        return repr(exc)
    finally:
        os.fchdir(back)
        os.close(back)
"""
_scope: dict = {}
exec(TREES, _scope)
leave_trees = _scope["leave_trees"]


@pytest.fixture(autouse=True)
def _removed_after(tmp_path):
    """A test's folder goes with what a failed test left in it: pytest's own clean-up (shutil.rmtree)
    dies of a deep tree, and with it the clean-up of every later session's folders."""
    yield
    trees.remove(tmp_path)


@pytest.fixture
def grader_owned(tmp_path):
    """A file and a folder of the grader's, outside any tree removed: what the links point to."""
    file, folder = tmp_path / "grader-owned.txt", tmp_path / "grader-folder"
    file.write_text("the grader's")
    folder.mkdir()
    (folder / "inside.txt").write_text("the grader's too")
    return {"file": str(file), "folder": str(folder)}


def _intact(targets: dict) -> bool:
    return (
        Path(targets["file"]).read_text() == "the grader's"
        and (Path(targets["folder"]) / "inside.txt").read_text() == "the grader's too"
    )


def _as_student(folder: Path, targets: dict, depth: int = DEPTH) -> str:
    """leave_trees in ``folder`` (made the student's) from a child that became the student (and
    entered it before: the folders above are root's)."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chown(folder, STUDENT_UID, STUDENT_UID)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # (no exec: the grader's interpreter may sit where the student cannot run it)
        try:
            os.close(read)
            os.chdir(folder)
            os.setgroups([])
            os.setresgid(STUDENT_UID, STUDENT_UID, STUDENT_UID)
            os.setresuid(STUDENT_UID, STUDENT_UID, STUDENT_UID)
            os.write(write, leave_trees(".", targets, depth).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read()
    os.waitpid(child, 0)
    return said


def _step_cgroups() -> list[Path]:
    """This process's grading steps' cgroup nodes still on the host."""
    if sandbox.caps_problem() is not None:
        return []
    return [
        node
        for parent in sandbox.Cgroup(cgroups.base()).dirs
        for node in (parent.glob(f"{steps._STEP_PREFIX}{os.getpid()}-*") if parent.is_dir() else [])
    ]


# ----------------------------------------------------------------------------------------
# trees.remove alone


@pytest.mark.slow  # (10,000 folders made and removed: 3 to 9 s)
def test_a_hostile_tree_of_the_graders_own_is_removed_and_nothing_it_links_to(tmp_path, grader_owned):
    assert leave_trees(str(tmp_path / "mine"), grader_owned, DEPTH) == "ok"
    assert trees.remove(tmp_path / "mine") == []
    assert not (tmp_path / "mine").exists() and _intact(grader_owned)


@pytest.mark.slow
@needs_root
def test_a_students_tree_is_removed_as_the_student(tmp_path, grader_owned):
    top = tmp_path / "kernel-x" / "ipc"  # (as a kernel's socket folder: the student's, in a folder of root's)
    assert _as_student(top, grader_owned) == "ok"
    (top / "request-1.pt").write_bytes(b"the grader's request")  # a grader's file in it goes too
    started = time.monotonic()
    assert trees.remove(tmp_path / "kernel-x") == []
    assert time.monotonic() - started < 60
    assert not (tmp_path / "kernel-x").exists() and _intact(grader_owned)


@needs_root
def test_only_what_the_student_could_delete_goes(tmp_path):
    top = tmp_path / "theirs"
    assert _as_student(top, {"file": "/nonexistent"}, depth=3) == "ok"
    os.chmod(top, 0o700)
    graders = top / "graders"  # (a folder of root's in it: the student could not empty it, nor can its removal)
    graders.mkdir()
    (graders / "kept").write_text("x")
    left = trees.remove(top)
    assert left and any("graders/kept" in p and "Permission denied" in p for p in left), left
    assert (graders / "kept").exists() and not (top / "h42-trees").exists()
    shutil.rmtree(top)


@needs_root
@pytest.mark.skipif(shutil.which("chattr") is None, reason="no chattr")
def test_a_file_that_cannot_be_removed_is_said_not_raised(tmp_path):
    (tmp_path / "t" / "a").mkdir(parents=True)
    stuck, other = tmp_path / "t" / "a" / "immutable", tmp_path / "t" / "other"
    stuck.write_text("x")
    other.write_text("x")
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode != 0:
        pytest.skip("this file system takes no immutable flag")
    try:
        left = trees.remove(tmp_path / "t")
        assert any("immutable" in p and "not permitted" in p for p in left), left
        assert stuck.exists() and not other.exists()
        assert "could not remove all of" in trees.said(tmp_path / "t", left)
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    assert trees.remove(tmp_path / "t") == []


MOUNTED = """
import importlib.util, json, subprocess, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("trees", sys.argv[2])  # (as run_sandbox.py loads it)
trees = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trees)
top = Path(sys.argv[1])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "none", str(top / "a" / "mounted")], check=True)
(top / "a" / "mounted" / "inside").write_text("x")
left = trees.remove(top)
print(json.dumps({"left": left, "inside": (top / "a" / "mounted" / "inside").exists(), "b": (top / "b").exists()}))
subprocess.run(["umount", str(top / "a" / "mounted")], check=True)
"""


@needs_root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare")
def test_a_mount_point_in_the_tree_is_left_and_never_entered(tmp_path):
    (tmp_path / "t" / "a" / "mounted").mkdir(parents=True)
    (tmp_path / "t" / "b").mkdir()
    done = subprocess.run(  # (in a mount namespace of its own: the host sees no mount)
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            sys.executable,
            "-c",
            MOUNTED,
            str(tmp_path / "t"),
            trees.__file__,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0 and "mount" in done.stderr and "permission denied" in done.stderr.lower():
        pytest.skip(f"cannot mount here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert any("a/mounted: a mount point; left" in p for p in found["left"]), found
    assert found["inside"] and not found["b"]
    assert trees.remove(tmp_path / "t") == []


@pytest.mark.slow  # (20,000 files made and removed: 2 to 6 s)
def test_a_tree_too_big_for_the_time_limit_is_left_and_said(tmp_path):
    wide = tmp_path / "wide"
    wide.mkdir()
    for i in range(20_000):
        (wide / f"f{i}").touch()
    started = time.monotonic()
    left = trees.remove(wide, timeout=0.05)
    assert time.monotonic() - started < 5
    assert any("not removed within 0.05 s" in p for p in left), left
    assert trees.remove(wide) == [] and not wide.exists()


def test_a_link_or_a_missing_path_is_never_followed_nor_an_error(tmp_path, grader_owned):
    (tmp_path / "link").symlink_to(grader_owned["folder"])
    assert trees.remove(tmp_path / "link") == [] and trees.remove(tmp_path / "missing") == []
    assert not (tmp_path / "link").is_symlink() and _intact(grader_owned)


# ----------------------------------------------------------------------------------------
# a grading step killed at its time cap, and what a killed run leaves for the next


# nbgrader's stand-in: a kernel's folder below the step's folder for sockets, the student's, with
# a hostile tree in it, and one in the step's temp dir; then it hangs until the step's time cap
_HANGING_STEP = (
    TREES
    + """
import json, os, sys, time
targets, uid = json.loads(sys.argv[1]), int(sys.argv[2])
ipc = os.path.join(os.environ["DISTTRAIN_SOCKET_DIR"], "kernel-x", "ipc")
os.makedirs(ipc)
os.chown(ipc, uid, uid)
if os.fork() == 0:  # (entered first: the folders above it are root's)
    os.chdir(ipc); os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
    print("socket folder:", leave_trees(".", targets, 3000), flush=True)
    os._exit(0)
os.wait()
print("temp dir:", leave_trees(os.environ["TMPDIR"], targets, 3000), flush=True)
time.sleep(600)
"""
)


# the hanging step's cap: it starts Python in the sandbox and leaves two trees 3,000 folders deep before it hangs,
# which took more than 8 s on CI's loaded machine (stop 53)
_STEP_CAP_S = 20


@pytest.mark.slow
@needs_root
def test_a_step_killed_at_its_time_cap_leaves_nothing(tmp_path, grader_owned, monkeypatch):
    private = tempfile.mkdtemp(prefix="dt42-", dir="/tmp")  # the grader's temp dir: nothing else writes there
    monkeypatch.setenv("TMPDIR", private)
    monkeypatch.setattr(tempfile, "tempdir", private)
    deep = tmp_path / ("d" * 60)  # too deep for sockets: they get a short folder of the step's own
    deep.mkdir()
    monkeypatch.setattr(steps, "_NBGRADER_CHILD", _HANGING_STEP)
    try:
        result = steps.run_nbgrader(
            [json.dumps(grader_owned), str(STUDENT_UID)], timeout=_STEP_CAP_S, tmp_root=str(deep), env={}
        )
        assert result.timed_out, result.output
        assert "socket folder: ok" in result.output and "temp dir: ok" in result.output, result.output
        assert "could not remove" not in result.output, result.output
        assert os.listdir(private) == [] and os.listdir(deep) == []
        assert _intact(grader_owned) and _step_cgroups() == []
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _dead_pid() -> int:
    pid = 4_000_000
    while Path(f"/proc/{pid}").exists():
        pid += 1
    return pid


@pytest.mark.slow
@needs_root
def test_the_next_run_removes_what_a_killed_run_left(tmp_path, grader_owned):
    stale = tmp_path / f"{steps._STEP_PREFIX}{_dead_pid()}-abcdefgh"
    assert _as_student(stale / "kernel-x" / "ipc", grader_owned) == "ok"
    said: list[str] = []
    steps.clean_stale_steps(str(tmp_path), log=said.append)  # what `disttrain-lab grade` does first
    assert said == [] and not stale.exists() and _intact(grader_owned)


# ----------------------------------------------------------------------------------------
# a real grading: three students leave trees in their kernel's socket folder (and everywhere
# else they may write); the one graded last is honest


PROBE = (
    TREES
    + """
import json as _json, os as _os
from ipykernel.connect import get_connection_file as _connection
_targets = _json.loads('@TARGETS@')
_made = {}
# the kernel's socket folder, the one host folder it may write; then its private tmpfs ones
for _i, _where in enumerate([_os.path.dirname(_json.load(open(_connection()))['ip']), _os.getcwd(),
                             _os.path.expanduser('~'), '/tmp', '/dev/shm']):
    _made[_where] = leave_trees(_where, _targets, @DEPTH@ if _i == 0 else 100)
print('H42-PROBE', _json.dumps({'made': _made, 'cgroup': open('/proc/self/cgroup').read()}), flush=True)
"""
)
MEAN_OK = "def mean(xs):\n    return sum(xs) / len(xs)\n"
STUDENTS = {  # ex_mean's solution cell (fixture 00_basics: add 1 + mean 2 + scale 1)
    "a_trees": MEAN_OK + PROBE,
    # its kernel dies (the probe's output sent first): restarted, its mean lost
    "b_trees_then_dies": MEAN_OK + PROBE + "__import__('time').sleep(1)\n_os._exit(1)\n",
    "z_honest": MEAN_OK,
}
DESERVED = {"a_trees": 4.0, "b_trees_then_dies": 2.0, "z_honest": 4.0}


def _left_in_tmp() -> list[str]:
    """The students' trees anywhere in /tmp a few folders down (where the kit makes its folders)."""
    return [p for depth in range(1, 5) for p in glob.glob("/tmp/" + "*/" * depth + "h42-trees")]


def _probe(course: Course, student: str) -> dict:
    nb = load(course.course / "autograded" / student / course.lab / f"{course.lab}.ipynb")
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    [line] = [x for x in text.splitlines() if x.startswith("H42-PROBE ")]
    return json.loads(line[len("H42-PROBE ") :])


@pytest.mark.slow
@needs_sandbox
def test_grading_hostile_trees_leaves_nothing_and_costs_no_classmate(tmp_path, grader_owned, monkeypatch):
    # the grader's own temp dir, watched: its steps' folders there, as `disttrain-lab grade` has them
    private = tempfile.mkdtemp(prefix="dt42-", dir="/tmp")
    monkeypatch.setenv("TMPDIR", private)
    monkeypatch.setattr(tempfile, "tempdir", private)
    course = Course(tmp_path, "00_basics", FIXTURES, LIMITS)
    course.tmp = Path(private)
    targets = dict(grader_owned, course=str(course.course), gradebook=str(course.course / "gradebook.db"))
    try:
        course.do_release()
        for student, source in STUDENTS.items():
            source = source.replace("@TARGETS@", json.dumps(targets)).replace("@DEPTH@", str(DEPTH))
            submit(course.course, student, course.lab, with_solution(course.solution, "ex_mean", source))
        results = course.grade(list(STUDENTS), jobs=1, feedback=False)  # one after the other, in one run
        table = grading.scores(course.lab, course.course)
        for student, deserved in DESERVED.items():
            assert results[student].returncode == 0, results[student].output[-3000:]
            assert "could not remove" not in results[student].output, results[student].output[-3000:]
            assert table[student]["total"] == deserved, (student, table[student])
        probes = {s: _probe(course, s) for s in ("a_trees", "b_trees_then_dies")}
        for probe in probes.values():  # it did leave them, in the host's folder too
            assert set(probe["made"].values()) == {"ok"}, probe["made"]
        assert _intact(grader_owned) and (course.course / "gradebook.db").is_file()
        assert os.listdir(private) == [], os.listdir(private)  # no kernel, socket or step folder
        assert _left_in_tmp() == []  # (nor one of the kit's elsewhere in /tmp)
        assert not processes_with(str(course.root))
        assert _step_cgroups() == []
        for probe in probes.values():  # the kernels' own cgroups (those of a killed one too)
            for line in probe["cgroup"].splitlines():
                path = line.split(":", 2)[2]
                if path.startswith(f"/{cgroups.base()}/"):
                    assert not [d for d in cgroups.Cgroup(path).dirs if d.exists()], path
    finally:
        trees.remove(private)
