"""Grading that a student cannot cheat or harm (issue 16): one crafted submission per
weakness class, graded in one batch between two honest classmates ("a_honest" is graded
before every attacker, "z_honest" after).  Each attacker gets exactly its deserved score,
the classmates keep theirs, the gradebook, solutions and other students' files are
untouched, and nothing is left running or on disk.

Every test cell runs in the grader kernel, which holds no student code; the student's
functions run on ranks of the student's kernel (``dl.exercise.run``) and only data comes
back.  What a submission does to its own kernel (hooks, rebound names, the kit's functions
replaced) reaches no test: at most it breaks the student's own runs, which then fail.

The batch needs a host that can sandbox (root, cgroup v1 memory+pids, namespaces), as CI
has; elsewhere it is skipped with the reason, and the report test proves the grader says
loudly that it graded without isolation.
"""

from __future__ import annotations

import copy
import hashlib
import html
import os
from pathlib import Path

import nbformat
import pytest

from disttrain_lab import checks, confine, grading, wire
from disttrain_lab.grading import cells, cgroups, kernels, reaper, sandbox
from tests.grading.test_grading import (
    FIXTURE_LIMITS,
    FIXTURES,
    HAS_LAUNCH,
    Course,
    feedback,
    grade_id,
    processes_with,
    submit,
    with_solution,
)
from tests.notebooks import load

CAN_SANDBOX = sandbox.problem() is None
needs_sandbox = pytest.mark.skipif(not CAN_SANDBOX, reason=f"this host cannot sandbox: {sandbox.problem()}")
pytestmark = pytest.mark.timeout(900)

MARKER = "h16-escapee-marker"  # in the command line of every process an attacker leaves behind
SECRET_NAME = "H16_GRADER_API_TOKEN"  # in the grader's environment while it grades (never the kernel's)
LIMITS = dict(FIXTURE_LIMITS, student_memory=1536 * 2**20, student_pids=256, sandbox="on")

WRONG_MEAN = "def mean(xs):\n    return 0\n"
MEAN_OK = "def mean(xs):\n    return sum(xs) / len(xs)\n"

# ex_mean's solution cell of each attacker (fixture 00_basics: add 1 + mean 2 + scale 1)
ATTACKS = {
    # 1. hooks that turn a failing test cell into a passing one
    "c1_hooks": WRONG_MEAN
    + (
        "ip = get_ipython()\n"
        "ip.set_custom_exc((AssertionError,), lambda *a, **k: None)\n"
        "def _clear(result):\n    result.error_in_exec = None\n"
        "ip.events.register('post_run_cell', _clear)\n"
    ),
    "c1_ast_transformer": WRONG_MEAN
    + (
        "import ast\n"
        "class _NoAssert(ast.NodeTransformer):\n"
        "    def visit_Assert(self, node):\n        return ast.Pass()\n"
        "get_ipython().ast_transformers.append(_NoAssert())\n"
    ),
    "c1_input_transformer": WRONG_MEAN + "get_ipython().input_transformers_post.append(lambda lines: ['pass\\n'])\n",
    # ... and one that also answers IPython's user expressions itself (how a check inside its
    # kernel would be asked): the grader asks the student's kernel nothing that way
    "c1_forged_user_expressions": WRONG_MEAN
    + (
        "ip = get_ipython()\n"
        "ip.set_custom_exc((AssertionError,), lambda *a, **k: None)\n"
        "def _clear(result):\n    result.error_in_exec = None\n"
        "ip.events.register('post_run_cell', _clear)\n"
        "ip.user_expressions = lambda expressions: {k: {'status': 'ok', 'metadata': {},\n"
        "    'data': {'text/plain': \"([], [], '0' * 64)\"}} for k in expressions}\n"
    ),
    "c1_hooks_during_test": (
        "def mean(xs):\n"
        "    ip = get_ipython()\n"
        "    ip.set_custom_exc((AssertionError,), lambda *a, **k: None)\n"
        "    ip.events.register('post_run_cell', lambda result: setattr(result, 'error_in_exec', None))\n"
        "    return 0\n"
    ),
    # 4. the grader's files: the gradebook, the solutions, another student's submission;
    # and the grader's environment (a token, the course's paths, its HOME)
    "c4_files": (
        "import os, json, sqlite3\n"
        "_found, _roots = {}, ['@COURSE@', os.environ.get('DISTTRAIN_COURSE_DIR', ''), os.environ.get('DISTTRAIN_SOURCE_DIR', ''),\n"
        "                      os.path.expanduser('~'), os.path.abspath('../../..')]\n"
        "for _root in [r for r in _roots if r and r != '/']:\n"
        "    for _dir, _, _files in os.walk(_root):\n"
        "        for _f in _files:\n"
        "            _found.setdefault(_f, []).append(os.path.join(_dir, _f))\n"
        "        if sum(map(len, _found.values())) > 20000:\n"
        "            break\n"
        "def mean(xs):\n    return 0\n"
        "for _name, _p in [(n, p) for n, ps in _found.items() for p in ps]:\n"
        "    try:\n"
        "        if _name == 'gradebook.db':\n"
        "            _db = sqlite3.connect(_p)\n"
        "            _db.execute('UPDATE grade SET manual_score = 0')\n"
        "            _db.commit()\n"
        "        elif _name == '00_basics.ipynb' and 'BEGIN SOLUTION' in open(_p).read():\n"
        "            for _cell in json.load(open(_p))['cells']:\n"
        "                if 'def mean' in ''.join(_cell['source']):\n"
        "                    exec(''.join(_cell['source']))\n"
        "        elif _name == '00_basics.ipynb' and 'z_honest' in _p:\n"
        "            open(_p, 'w').write('{}')\n"
        "    except Exception:\n"
        "        pass\n"
        # the repository's git objects hold every solution: a readable .git would be a leak
        "import disttrain_lab as _dl\n"
        "_git = os.path.join(os.path.dirname(os.path.dirname(_dl.__file__)), '.git')\n"
        "try:\n"
        "    _leak = bool(os.listdir(_git)) if os.path.isdir(_git) else os.path.getsize(_git) > 0\n"
        "except OSError:\n"
        "    _leak = False\n"
        f"_leak = _leak or '{SECRET_NAME}' in os.environ or any('@COURSE@' in v for v in os.environ.values())\n"
        "if _leak:\n"
        "    def mean(xs):\n"
        "        return sum(xs) / len(xs)\n"
    ),
    # 5. a process that leaves the kernel's group, keeps changing pid and kills later kernels
    "c5_escape": MEAN_OK
    + (
        "import subprocess, sys\n"
        "_code = '''\n"
        "import os, sys, time, signal\n"
        "root = sys.argv[1].encode()\n"
        "while True:\n"
        "    if os.fork():\n"
        "        os._exit(0)\n"
        "    os.setsid()\n"
        "    for pid in os.listdir('/proc'):\n"
        "        try:\n"
        "            if pid.isdigit() and int(pid) not in (os.getpid(), int(sys.argv[2])) \\\n"
        "                    and b'ipykernel' in open('/proc/%s/cmdline' % pid, 'rb').read() \\\n"
        "                    and root in open('/proc/%s/cmdline' % pid, 'rb').read() + open('/proc/%s/environ' % pid, 'rb').read():\n"
        "                os.kill(int(pid), signal.SIGKILL)\n"
        "        except OSError:\n"
        "            pass\n"
        "    time.sleep(0.2)\n"
        "'''\n"
        f"subprocess.Popen([sys.executable, '-c', _code, '@ROOT@', str(os.getpid()), '{MARKER}'],\n"
        "                 start_new_session=True)\n"
    ),
    # 6. shared memory: RLIMIT_DATA does not count it, and /dev/shm outlives a kernel
    "c6_shm": MEAN_OK
    + (
        "try:\n"
        f"    with open('/dev/shm/{MARKER}', 'wb') as _f:\n"
        "        for _ in range(12):\n"
        "            _f.write(b'x' * 2**28)\n"
        "except OSError:\n"
        "    pass\n"
    ),
}
# each attacker's scores: its wrong mean() gets nothing, its honest add() and scale() keep their
# points, but for the input transformer, which turns every later cell of its own kernel into
# `pass` (scale() is never defined there: "there is no function named 'scale'")
FULL = {"test_add": 1.0, "test_mean": 2.0, "test_scale": 1.0, "total": 4.0}
DESERVED = (
    {name: dict(FULL, test_mean=0.0, total=2.0) for name in ATTACKS}
    | {"c5_escape": FULL, "c6_shm": FULL}
    | {"c1_input_transformer": {"test_add": 1.0, "test_mean": 0.0, "test_scale": 0.0, "total": 1.0}}
)


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _host_leftovers() -> list[str]:
    found = [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if MARKER in n]
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and MARKER.encode() in open(f"/proc/{entry}/cmdline", "rb").read():
                found.append(f"pid {entry}")
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    course = Course(tmp_path_factory.mktemp("attacked"), "00_basics", FIXTURES, LIMITS)
    course.do_release()
    sol = course.solution
    for name, source in ATTACKS.items():  # an attacker knows where the course lives on the host
        submit(
            course.course,
            name,
            course.lab,
            with_solution(
                sol, "ex_mean", source.replace("@COURSE@", str(course.course)).replace("@ROOT@", str(course.root))
            ),
        )
    # 8. a flipped `grade` flag on a test cell (nbgrader's checksum check failed the whole notebook)
    flipped = copy.deepcopy(sol)
    [cell] = [c for c in flipped.cells if grade_id(c) == "test_mean"]
    cell.metadata.nbgrader["grade"] = False
    submit(course.course, "c8_flipped_flag", course.lab, flipped)
    submit(course.course, "a_honest", course.lab, sol)
    submit(course.course, "z_honest", course.lab, sol)
    course.source_digest = _digest(FIXTURES)
    course.others_digest = _digest(course.course / "submitted" / "z_honest")
    # the cgroups this grading makes (another grading on a shared host makes its own)
    course.cgroups, genuine_init = [], sandbox.Cgroup.__init__

    def recording_init(self, relative):
        course.cgroups.append(relative)
        genuine_init(self, relative)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sandbox.Cgroup, "__init__", recording_init)
        mp.setenv(SECRET_NAME, "grader-secret-" + os.urandom(8).hex())
        course.results = course.grade(one_process_per_student=False)
    course.table = grading.scores(course.lab, course.course)
    course.leftovers = _host_leftovers()
    return course


@pytest.mark.slow
@needs_sandbox
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_attacker_gets_exactly_its_deserved_score(attacked, attack):
    assert attacked.results[attack].returncode == 0, attacked.results[attack].output[-3000:]
    assert attacked.table[attack] == DESERVED[attack]
    said = {
        grade_id(c): [o.get("evalue", "") for o in c.outputs if o.output_type == "error"]
        for c in attacked.autograded(attack).cells
        if grade_id(c) in ("test_mean", "test_scale")
    }
    if attack == "c1_hooks_during_test":  # mean() holds the kernel's shell: it cannot even reach a rank
        [why] = said["test_mean"]
        assert "dl.launch cannot send argument 1 (function) to the ranks" in why, said
    elif DESERVED[attack]["test_mean"] == 0:  # the grader kernel's own assertion, on the student's value
        assert said["test_mean"] == ["mean([1, 2, 3]) should be 2"], said
    if attack == "c1_input_transformer":
        assert said["test_scale"] == [
            "there is no function named 'scale' in the notebook: run the cell that defines it"
        ]


@pytest.mark.slow
@needs_sandbox
def test_classmates_files_and_host_are_untouched(attacked):
    full = {"test_add": 1.0, "test_mean": 2.0, "test_scale": 1.0, "total": 4.0}
    assert attacked.table["a_honest"] == full and attacked.table["z_honest"] == full
    assert attacked.table["c8_flipped_flag"] == full  # 8: restored from the gradebook, not zeroed
    assert _digest(FIXTURES) == attacked.source_digest
    assert _digest(attacked.course / "submitted" / "z_honest") == attacked.others_digest
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{attacked.course / 'gradebook.db'}") as gb:
        manual = [
            g.manual_score
            for s in gb.find_assignment("00_basics").submissions
            for nb in s.notebooks
            for g in nb.grades
            if g.manual_score is not None
        ]
    assert manual == []
    assert attacked.leftovers == []  # 5, 6: no escaped process, no /dev/shm file
    assert not processes_with(str(attacked.course))
    assert not list(attacked.tmp.iterdir())
    assert attacked.cgroups, "the grading made no cgroup to check"
    assert not [d for name in attacked.cgroups for d in sandbox.Cgroup(name).dirs if d.exists()]


@pytest.mark.slow
@needs_sandbox
def test_feedback_shows_messages_not_hidden_tests(attacked):
    honest, wrong = (
        feedback(attacked.course, "a_honest", "00_basics"),
        feedback(attacked.course, "c1_hooks", "00_basics"),
    )
    for page in (honest, wrong):
        page = html.unescape(page)
        assert page and "BEGIN HIDDEN TESTS" not in page
        assert 'run("mean", 1, ([5],))' not in page and 'run("mean", 1, ([1, 2],))' not in page
    assert "mean([1, 2, 3]) should be 2" in wrong  # 7: the failing message is there


@pytest.mark.slow
@needs_sandbox
def test_grade_report_flags_for_a_human(attacked):
    report = (attacked.course / "reports" / "00_basics.txt").read_text()
    assert "isolation: every kernel sandboxed" in report
    blocks = {b.split(":", 1)[0]: b for b in report.split("\n") if b and not b.startswith(" ")}
    assert "nothing flagged" in blocks["a_honest"] and "nothing flagged" in blocks["z_honest"]
    section = report.split("c1_hooks_during_test:")[1].split("\nc4")[0]
    assert "IPython hook APIs" in section
    assert "process or file-system probing" in report.split("c4_files:")[1].split("\nc5")[0]
    assert "ctypes" not in report.split("a_honest:")[1].split("\n")[0]


# ----------------------------------------------------------------------------------------
# 2. names the tests use, and code objects; 3. a forged trace (fixture 00_launch: allsum 2 +
# ring_next 1 + shift 1 points; shift's test checks the bytes the OS counted between the ranks)

ALLSUM_WRONG = "def allsum():\n    return 0.0\n"
FAKE_LAUNCH = "lambda fn, world_size, *a, **k: [world_size * (world_size + 1) / 2.0] * world_size"
# the right answer without a byte moved (the test's inputs are torch.full(rank)), and the
# sends the test looks for appended to the rank's own recorder
FORGED_SHIFT = (
    "def shift(x):\n"
    "    from disttrain_lab import trace as _t\n"
    "    rank, n = dist.get_rank(), dist.get_world_size()\n"
    "    _t._REC.events.append((rank, 'send', 'p2p', 0.0, 0.0, (rank + 1) % n, None, x.nbytes, None, '', {}))\n"
    "    return torch.full_like(x, float((rank - 1) % n))\n"
)
# the right values, carried through /dev/shm instead of torch.distributed (one barrier: a few bytes)
SHARED_MEMORY_SHIFT = (
    "def shift(x):\n"
    "    rank, n = dist.get_rank(), dist.get_world_size()\n"
    "    torch.save(x, f'/dev/shm/h16-shift-{n}-{rank}')\n"
    "    dist.barrier()\n"
    "    return torch.load(f'/dev/shm/h16-shift-{n}-{(rank - 1) % n}')\n"
)
LAUNCH_ATTACKS = {
    # dl rebound in the student's kernel: the tests' dl is the grader kernel's own
    "c2_rebind_dl": (
        "ex_allsum",
        ALLSUM_WRONG + f"class _FakeDL:\n    launch = staticmethod({FAKE_LAUNCH})\ndl = _FakeDL()\n",
    ),
    # the kit's launch given other code in the student's kernel: every run there after it is broken
    "c2_code_swap": ("ex_allsum", ALLSUM_WRONG + f"dl.launch.__code__ = ({FAKE_LAUNCH}).__code__\n"),
    # a Run method replaced: the kit refuses to launch in that kernel from then on (integrity.verify)
    "c2_class_patch": (
        "ex_shift",
        "def shift(x):\n    return torch.full_like(x, float((dist.get_rank() - 1) % dist.get_world_size()))\n"
        "dl.Run.bytes_sent = lambda self, rank: 2**20\n",
    ),
    "c3_forged_trace": ("ex_shift", FORGED_SHIFT),
    "c3_shared_memory": ("ex_shift", SHARED_MEMORY_SHIFT),
}
LAUNCH_DESERVED = {
    "c2_rebind_dl": {"test_allsum": 0.0, "test_ring_next": 1.0, "test_shift": 1.0, "total": 2.0},
    "c2_code_swap": {"test_allsum": 0.0, "test_ring_next": 0.0, "test_shift": 0.0, "total": 0.0},
    "c2_class_patch": {"test_allsum": 2.0, "test_ring_next": 1.0, "test_shift": 0.0, "total": 3.0},
    "c3_forged_trace": {"test_allsum": 2.0, "test_ring_next": 1.0, "test_shift": 0.0, "total": 3.0},
    "c3_shared_memory": {"test_allsum": 2.0, "test_ring_next": 1.0, "test_shift": 0.0, "total": 3.0},
}
# what the OS counted decides: the right values arrived, no payload crossed between the ranks
NOT_SENT = (
    "shift on 2 ranks (each sends its 1 MiB once): rank 0 should send rank 1 1,048,576 bytes (its payload), "
    "but the operating system counted"
)


def _errors(course: Course, student: str, test: str) -> list[str]:
    [cell] = [c for c in course.autograded(student).cells if grade_id(c) == test]
    return [html.unescape(o.get("evalue", "")) for o in cell.outputs if o.output_type == "error"]


@pytest.mark.slow
@needs_sandbox
@pytest.mark.skipif(not HAS_LAUNCH, reason="dl.launch has not landed")
def test_rebound_names_swapped_code_and_forged_traces(tmp_path):
    course = Course(tmp_path, "00_launch", FIXTURES, dict(LIMITS, cell_timeout=60))
    course.do_release()
    for name, (exercise, source) in LAUNCH_ATTACKS.items():
        submit(course.course, name, course.lab, with_solution(course.solution, exercise, source))
    submit(course.course, "a_honest", course.lab, course.solution)
    submit(course.course, "z_honest", course.lab, course.solution)
    results = course.grade(one_process_per_student=False)
    table = grading.scores(course.lab, course.course)
    assert all(r.returncode == 0 for r in results.values())
    assert table["a_honest"]["total"] == table["z_honest"]["total"] == 4
    for name in LAUNCH_ATTACKS:
        assert table[name] == LAUNCH_DESERVED[name], name
    assert _errors(course, "c2_rebind_dl", "test_allsum") == ["on 2 ranks allsum() should give 3.0 everywhere"]
    for test in ("test_allsum", "test_ring_next", "test_shift"):  # the fake launch gave no run back
        [said] = _errors(course, "c2_code_swap", test)
        assert said.startswith("the run stopped: "), (test, said)
    [said] = _errors(course, "c2_class_patch", "test_shift")
    assert "TamperingError: grading relies on torch's and disttrain_lab's own functions" in said, said
    assert "disttrain_lab.Run.bytes_sent was replaced or added" in said, said
    [said] = _errors(course, "c3_forged_trace", "test_shift")
    assert said.startswith(NOT_SENT) and "Data that is returned without being sent does not count" in said, said
    [said] = _errors(course, "c3_shared_memory", "test_shift")
    if confine.host_problem() is None:  # a graded run's ranks are confined: the file in /dev/shm is refused
        assert "raised" in said and "Permission denied" in said, said
    else:
        assert said.startswith(NOT_SENT) and "Data that is returned without being sent does not count" in said, said
    report = (course.course / "reports" / "00_launch.txt").read_text()
    assert "the tracer's internals" in report.split("c3_forged_trace:")[1].split("\nc3_shared")[0]
    assert "/dev/shm" in report.split("c3_shared_memory:")[1].split("\nz_honest")[0]
    assert "nothing flagged" in report.split("a_honest:")[1].split("\n")[0]
    assert not processes_with(str(course.course)) and not list(course.tmp.iterdir())


def _forged_shift():
    # (a driver: its source runs in the ranks as it is, so it imports what it uses)
    import torch
    import torch.distributed as dist

    from disttrain_lab import trace as _t

    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.full((2**18,), float(rank))
    _t._REC.events.append((rank, "send", "p2p", 0.0, 0.0, (rank + 1) % n, None, x.nbytes, None, "", {}))
    return torch.full_like(x, float((rank - 1) % n))


def _honest_shift():
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    x, got = torch.full((2**18,), float(rank)), torch.empty(2**18)
    req = dist.isend(x, (rank + 1) % n)
    dist.recv(got, (rank - 1) % n)
    req.wait()
    return got


@pytest.mark.skipif(not HAS_LAUNCH, reason="dl.launch has not landed")
@pytest.mark.skipif(wire.available() is not None, reason=str(wire.available()))
def test_a_forged_trace_fools_the_trace_but_not_the_operating_system():
    # the attack is real: the trace alone cannot tell the forged shift from the honest one ...
    import disttrain_lab as dl

    runs = {
        name: dl.exercise.run(fn, 2, timeout=60) for name, fn in (("forged", _forged_shift), ("honest", _honest_shift))
    }
    for run in runs.values():
        assert [float(t[0]) for t in run.results] == [1.0, 0.0]
        assert [checks.sends(run.trace, r)[0].bytes for r in range(2)] == [2**20, 2**20]
    # ... what the OS counted can: every byte the honest ranks sent crossed between them, none of the forged
    assert [runs["honest"].traffic.between(r, 1 - r) >= 2**20 for r in range(2)] == [True, True]
    assert runs["forged"].traffic.source == runs["honest"].traffic.source == "os"
    assert runs["forged"].traffic.total < checks.WIRE_SLACK, runs["forged"].traffic.describe()
    with pytest.raises(AssertionError, match="Data that is returned without being sent does not count"):
        checks.assert_traffic(runs["forged"], {(0, 1): 2**20, (1, 0): 2**20}, "shift on 2 ranks")
    checks.assert_traffic(runs["honest"], {(0, 1): 2**20, (1, 0): 2**20}, "shift on 2 ranks")


# ----------------------------------------------------------------------------------------
# cheap checks, no grading run


def test_partial_credit_is_clamped_to_the_cells_points():
    cell = nbformat.v4.new_code_cell("1", metadata={"nbgrader": {"grade": True, "points": 2}})
    cell.outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "1e9"}, execution_count=1)]
    cells.clamp_partial_credit(cell)
    assert cell.outputs[0].data["text/plain"] == "2.0"
    cell.outputs[0].data["text/plain"] = "-3"
    cells.clamp_partial_credit(cell)
    assert cell.outputs[0].data["text/plain"] == "0.0"


def test_a_host_that_cannot_sandbox_or_cap_grades_no_one_unless_told(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "problem", lambda: "the grader does not run as root")
    for mode in ("auto", "on", "limited"):
        with pytest.raises(grading.SandboxRefused, match="cannot isolate a student: the grader does not run as root"):
            grading.Limits(sandbox=mode).sandboxed()
    with pytest.raises(grading.SandboxRefused, match="set DISTTRAIN_SANDBOX=off to grade trusted code unsandboxed"):
        grading.Limits().sandboxed()
    assert grading.Limits(sandbox="off").sandboxed() == (False, "switched off (sandbox='off' / DISTTRAIN_SANDBOX=off)")
    path = grading.grade_report("00_basics", [], {}, tmp_path, "the grader does not run as root")
    assert "isolation: NONE: the grader does not run as root" in path.read_text()
    # a sandbox without caps or filter: refused by default, graded when the setting says so
    monkeypatch.setattr(sandbox, "problem", lambda: None)
    lacking = ("NO memory or process cap for the whole student: no cgroup memory or pids controller at /x",)
    monkeypatch.setattr(sandbox, "missing", lambda: lacking)
    for mode in ("auto", "on"):
        with pytest.raises(grading.SandboxRefused, match="lacks: NO memory or process cap.*DISTTRAIN_SANDBOX=limited"):
            grading.Limits(sandbox=mode).sandboxed()
    assert grading.Limits(sandbox="limited").sandboxed() == (True, None)
    with pytest.raises(ValueError, match="sandbox must be one of 'auto', 'on', 'limited', 'off'"):
        grading.Limits(sandbox="yes")


def test_grade_refuses_before_grading_anyone(tmp_path, monkeypatch, capsys):
    from disttrain_lab import cli

    monkeypatch.setattr(sandbox, "problem", lambda: None)
    monkeypatch.setattr(sandbox, "missing", lambda: ("NO syscall filter: no libseccomp.so.2",))
    monkeypatch.delenv("DISTTRAIN_SANDBOX", raising=False)
    submitted = tmp_path / "submitted" / "alice" / "00_basics"
    submitted.mkdir(parents=True)
    (submitted / "00_basics.ipynb").write_text("{}")
    assert cli.main(["grade", "00_basics", "--course-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "refused: the sandbox on this host lacks: NO syscall filter: no libseccomp.so.2" in err
    assert "DISTTRAIN_SANDBOX=limited" in err and not (tmp_path / "autograded").exists()


def test_doctor_describes_the_grading_host():
    text = sandbox.describe()
    assert text.startswith("grading sandbox: ")
    if sandbox.problem() is None:
        offered = cgroups.host()
        assert f"cgroup {offered['version']}" in text
        assert ("memory and process caps: yes" in text) == (sandbox.caps_problem() is None)
        assert ("syscall filter: yes" in text) == ("NO syscall filter" not in " ".join(sandbox.missing()))
        assert ("auto REFUSES" in text) == bool(sandbox.missing())
    # the doctor's line on the ranks' own confinement (confine.py; the sandbox's module runs without the package)
    from disttrain_lab import cli

    ranks_apart = confine.host_problem()
    said = f"NO: {ranks_apart}" if ranks_apart else f"yes (ABI {confine.abi()[0]})"
    line = f"a graded run's ranks confined (Landlock: no files, signals or abstract sockets between them): {said}"
    assert line in cli._grading_host(), cli._grading_host()


def test_the_kernel_sees_an_allowlist_of_the_graders_environment():
    grader = {
        "PATH": "/usr/bin",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "2",
        "DISTTRAIN_LAB_BACKEND": "gloo",
        SECRET_NAME: "x",
        "HOME": "/root",
        "DISTTRAIN_COURSE_DIR": "/srv/course",
        "PYTHONPATH": "/kit/src:/root/lib",
    }
    env = sandbox.kernel_env(grader, home="/tmp/home", runtime="/tmp/.kernel", keep=["/kit"])
    assert {k: env[k] for k in ("PATH", "LC_ALL", "OMP_NUM_THREADS", "DISTTRAIN_LAB_BACKEND")} == {
        k: grader[k] for k in ("PATH", "LC_ALL", "OMP_NUM_THREADS", "DISTTRAIN_LAB_BACKEND")
    }
    assert SECRET_NAME not in env and "DISTTRAIN_COURSE_DIR" not in env
    assert env["HOME"] == "/tmp/home" and env["PYTHONPATH"] == "/kit/src"  # only the kit's entry


def test_scan_flags_hostile_constructs_only_in_student_cells(tmp_path):
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell(
                "import ctypes\nget_ipython().events.register('post_run_cell', f)",
                metadata={"nbgrader": {"grade_id": "ex", "solution": True, "locked": False}},
            ),
            nbformat.v4.new_code_cell(
                "import gc", metadata={"nbgrader": {"grade_id": "t", "grade": True, "locked": True}}
            ),
            nbformat.v4.new_code_cell("def mean(xs):\n    return sum(xs) / len(xs)"),
        ]
    )
    nbformat.write(nb, tmp_path / "x.ipynb")
    flags = grading.scan_submission(tmp_path / "x.ipynb")
    assert len(flags) == 2 and all(" in ex: " in f for f in flags), flags
    assert any(f.startswith("IPython hook APIs") for f in flags) and any("ctypes" in f for f in flags)


def _collectives_on_the_group_object():
    import torch
    import torch.distributed as dist

    import disttrain_lab as dl

    pg = dist.distributed_c10d._get_default_group()
    with dl.region("student"):
        pg.allreduce([torch.ones(4)]).wait()  # not through dist.all_reduce
        if dist.get_rank() == 0:
            pg.send([torch.ones(3)], 1, 0).wait()
        else:
            pg.recv([torch.zeros(3)], 0, 0).wait()
    return dist.get_rank()


@pytest.mark.skipif(not HAS_LAUNCH, reason="dl.launch has not landed")
def test_collectives_called_on_a_process_group_are_traced():
    # 3. a "p2p only" check cannot be passed by calling the collective on the group object
    import disttrain_lab as dl
    from disttrain_lab import checks

    student = checks.within(dl.launch(_collectives_on_the_group_object, 2, trace=True, timeout=60), "student")
    assert sorted((e.rank, e.op, e.bytes) for e in student.events) == [
        (0, "all_reduce", 16),
        (0, "send", 12),
        (1, "all_reduce", 16),
        (1, "recv", 12),
    ]
    assert [e.peer for e in checks.sends(student, 0)] == [1]
    with pytest.raises(AssertionError, match="called the collective all_reduce"):
        checks.assert_only_p2p(student, "ring")


@pytest.mark.slow
def test_a_kernel_that_dies_while_starting_is_started_again(tmp_path):
    # 8. one failed start used to fail the student's whole grading
    import sys

    from jupyter_client.manager import AsyncKernelManager

    starts = []

    class DiesOnFirstStart(AsyncKernelManager):
        def format_kernel_cmd(self, extra_arguments=None):
            starts.append(1)
            cmd = super().format_kernel_cmd(extra_arguments)
            return [sys.executable, "-c", "raise SystemExit(3)"] if len(starts) == 1 else cmd

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    executor = grading.RobustExecute(kernel_manager_class=DiesOnFirstStart, timeout=60, startup_timeout=60)
    nb, _ = executor.preprocess(nb, {"metadata": {"path": str(tmp_path)}})
    assert len(starts) == 2
    assert nb.cells[0].outputs[0].text == "42\n"


def test_verify_untampered_sees_swapped_code_objects_and_defaults():
    # 2. the in-rank check (integrity.py) compared identities only: same object, other code, passed
    from disttrain_lab import checks, integrity

    genuine = checks.sample_tensor.__defaults__
    checks.sample_tensor.__defaults__ = (None, 1)
    try:
        with pytest.raises(integrity.TamperingError, match="default arguments of disttrain_lab.checks.sample_tensor"):
            checks.verify_untampered()
    finally:
        checks.sample_tensor.__defaults__ = genuine
    code = checks.passed.__code__
    # code that claims to come from the kit's own file (so the file check alone would pass it)
    checks.passed.__code__ = (lambda message: None).__code__.replace(co_filename=checks.__file__)
    try:
        with pytest.raises(integrity.TamperingError, match="disttrain_lab.checks.passed"):
            checks.verify_untampered()
    finally:
        checks.passed.__code__ = code
    checks.verify_untampered()


# ----------------------------------------------------------------------------------------
# concurrent students: two sandboxes at once (as `grade --jobs` runs them), no grading needed

_NEIGHBOUR = """
import os, socket, sys
server = socket.create_server(('127.0.0.1', 0))      # as a rank's rendezvous would
print('ready', server.getsockname()[1], flush=True)
sys.stdin.readline()
print('alive', flush=True)
"""
_PROBER = """
import json, os, signal, socket, sys
seen, marker = [], sys.argv[1][::-1].encode()    # (given reversed: its own command line has it too)
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        if marker in open('/proc/%s/cmdline' % pid, 'rb').read():
            seen.append(int(pid))
    except OSError:
        pass
try:
    os.kill(int(sys.argv[2]), signal.SIGKILL)         # the neighbour's pid as the host sees it
    kill = 'sent'
except OSError as exc:
    kill = type(exc).__name__
try:
    socket.create_connection(('127.0.0.1', int(sys.argv[3])), timeout=30).close()
    connect = 'connected'
except OSError as exc:
    connect = type(exc).__name__
print(json.dumps({'seen': seen, 'kill': kill, 'connect': connect, 'pids': sorted(map(int, filter(str.isdigit, os.listdir('/proc'))))}),
      flush=True)
sys.stdin.readline()
os.kill(-1, signal.SIGKILL)                           # everything this uid may signal
"""


def _sandboxed(tmp_path: Path, uid: int, cgroup: str, code: str, *args: str):
    import subprocess
    import sys

    work = tmp_path / f"work-{uid}"
    work.mkdir()
    the_spec = sandbox.spec(
        uid=uid,
        memory=256 * 2**20,
        pids=32,
        data_limit=0,
        cgroup=cgroup,
        hide=[*kernels.hidden_paths(), str(tmp_path)],
        keep=kernels.kept_paths(),
    )
    return subprocess.Popen(
        sandbox.command(the_spec, [sys.executable, "-c", code, *args]),
        cwd=work,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _kernel_of(wrapper: int) -> int:
    """The host pid of the command a sandbox runs (wrapper -> init -> command)."""
    [init] = reaper.children(wrapper)
    [command] = reaper.children(init)
    return command


def _cgroups_of(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return {
        c: path
        for _, controllers, path in (line.split(":", 2) for line in lines)
        for c in controllers.split(",")
        if c in ("memory", "pids")
    }


@needs_sandbox
def test_two_sandboxes_at_once_cannot_see_or_signal_each_other(tmp_path):
    import json

    cgroup = f"{cgroups.base()}/test-{os.getpid()}-{tmp_path.name}"
    neighbour = _sandboxed(tmp_path, 64124, cgroup, _NEIGHBOUR, MARKER + "-neighbour")
    prober = None
    try:
        ready, port = neighbour.stdout.readline().split()
        assert ready == "ready"
        neighbour_pid = _kernel_of(neighbour.pid)
        prober = _sandboxed(tmp_path, 64123, cgroup, _PROBER, (MARKER + "-neighbour")[::-1], str(neighbour_pid), port)
        report = json.loads(prober.stdout.readline())
        prober_pid = _kernel_of(prober.pid)
        # neither sees the other: its /proc shows its own namespace (init and itself)
        assert report["seen"] == [] and report["kill"] == "ProcessLookupError" and report["pids"] == [1, 2], report
        assert report["connect"] == "ConnectionRefusedError", report  # its own loopback, not the neighbour's
        mine, theirs = _cgroups_of(prober_pid), _cgroups_of(neighbour_pid)
        assert set(mine) == set(theirs) == {"memory", "pids"}
        for c in mine:  # one cgroup per kernel, below the run's, never shared
            assert mine[c] != theirs[c] and mine[c].startswith(f"/{cgroup}/") and theirs[c].startswith(f"/{cgroup}/")
        assert [_uid(prober_pid), _uid(neighbour_pid)] == [64123, 64124]
        prober.stdin.write("go\n")
        prober.stdin.flush()
        assert prober.wait(timeout=120) != 0  # it killed itself (and nothing else)
        neighbour.stdin.write("still there?\n")
        neighbour.stdin.flush()
        assert neighbour.stdout.readline() == "alive\n"
        assert neighbour.wait(timeout=120) == 0
    finally:
        for proc in (neighbour, prober):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        sandbox.Cgroup(cgroup).destroy()
    assert not [d for d in sandbox.Cgroup(cgroup).dirs if d.exists()]


_CAPPED_AND_FILTERED = """
import ctypes, errno, json, os, threading, time
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    return 'allowed' if libc.syscall(nr, *args) >= 0 else errno.errorcode[ctypes.get_errno()]
report = {'cgroup': open('/proc/self/cgroup').read()}
report['unshare'] = 'allowed' if libc.unshare(0x10000000) == 0 else errno.errorcode[ctypes.get_errno()]  # NEWUSER
report['ptrace'] = call(101, 16, 1, 0, 0)          # PTRACE_ATTACH to init (x86_64 numbers)
report['bpf'] = call(321, 0, 0, 0)
report['io_uring_setup'] = call(425, 1, 0)
report['keyctl'] = call(250, 0, 0)
try:                                                  # the grader's reference (lab 13's): withheld
    from torchao.float8 import Float8LinearConfig
    report['torchao'] = 'imported'
except ImportError as exc:
    report['torchao'] = type(exc).__name__
threads = 0
try:                                                  # the process cap: 32 for the whole student
    for _ in range(100):
        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
        threads += 1
except RuntimeError:
    pass
report['threads'] = threads
print(json.dumps(report), flush=True)
os._exit(0)
"""


@needs_sandbox
@pytest.mark.skipif(sandbox.missing() != (), reason=f"this host's sandbox lacks: {sandbox.missing()}")
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the probe calls x86_64 syscall numbers")
def test_a_sandboxed_kernel_is_capped_and_filtered(tmp_path):
    import json

    cgroup = f"{cgroups.base()}/test-{os.getpid()}-{tmp_path.name}"
    proc = _sandboxed(tmp_path, 64125, cgroup, _CAPPED_AND_FILTERED)
    try:
        report = json.loads(proc.stdout.readline())
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sandbox.Cgroup(cgroup).destroy()
    assert f"/{cgroup}/kernel-" in report["cgroup"], report["cgroup"]
    assert {k: report[k] for k in ("unshare", "ptrace", "bpf", "io_uring_setup", "keyctl")} == dict.fromkeys(
        ("unshare", "ptrace", "bpf", "io_uring_setup", "keyctl"), "EPERM"
    ), report
    assert 10 < report["threads"] < 32, report  # what init, the interpreter and its threads leave of 32
    # torchao, installed here for the grader (lab 13's reference), is withheld from the student's kernel: its
    # folder hidden (kernels.reference_paths), so `torch alone` is the sandbox's fact, not the ranks' report
    assert kernels.reference_paths(), "torchao is not installed here: the grader's extra installs it"
    assert report["torchao"] == "ModuleNotFoundError", report


def _uid(pid: int) -> int:
    [line] = [x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("Uid:")]
    return int(line.split()[1])


# ----------------------------------------------------------------------------------------
# a grader without root: kernels under bubblewrap (run for real: the grading as another uid)

UNPRIVILEGED = 64200
# as root, in a private mount namespace: make each path given reachable by "other" (a 0755
# tmpfs over its first ancestor that is not, the path bound back), then exec the command
_OPEN_PATHS = """
import os, subprocess, sys, tempfile
sep = sys.argv.index('--')
subprocess.run(['mount', '--make-rprivate', '/'], check=True)
for need in sys.argv[1:sep]:
    parts = need.strip('/').split('/')
    for i in range(1, len(parts)):
        ancestor = '/' + '/'.join(parts[:i])
        if not os.stat(ancestor).st_mode & 0o001:
            stash = tempfile.mkdtemp()
            subprocess.run(['mount', '--rbind', need, stash], check=True)
            subprocess.run(['mount', '-t', 'tmpfs', '-o', 'mode=0755', 'tmpfs', ancestor], check=True)
            os.makedirs(need, exist_ok=True)
            subprocess.run(['mount', '--move', stash, need], check=True)
            os.rmdir(stash)  # (empty again: the host's temp folder keeps nothing of the test)
            break
os.execvp(sys.argv[sep + 1], sys.argv[sep + 1:])
"""
_SANDBOXED_AS_IS = """
import sys
from disttrain_lab import grading
try:
    print('GRADES', grading.Limits(sandbox=sys.argv[1]).sandboxed())
except grading.SandboxRefused as refused:
    print('REFUSED', refused)
"""
_GRADE_AS_IS = """
import json, sys
from pathlib import Path
from disttrain_lab import grading
from disttrain_lab.grading import sandbox
root, fixtures = Path(sys.argv[1]), Path(sys.argv[2])
assert sandbox.method() == 'bwrap', sandbox.problem()
results = grading.autograde('00_basics', course=root / 'course', source=fixtures, release_from=root / 'release',
                            limits=grading.Limits(**json.loads(sys.argv[3])), tmp_root=str(root / 'tmp'),
                            one_process_per_student=False)
print('SCORES', json.dumps({'rc': {s: r.returncode for s, r in results.items()},
                            'scores': grading.scores('00_basics', root / 'course')}))
"""


def _can_drop_root() -> str | None:
    import shutil

    if os.geteuid() != 0:
        return "needs root to start the grading as another user"
    missing = [t for t in ("bwrap", "setpriv", "unshare", "mount") if shutil.which(t) is None]
    return f"missing {', '.join(missing)} (Debian: apt-get install bubblewrap util-linux mount)" if missing else None


# what a kernel under bwrap reports of its caps and filter (its memory cgroup's limit, a user namespace)
_CAPS_PROBE = MEAN_OK + (
    "import ctypes as _c, json as _j, os as _o\n"
    "_mem = [l.split(':', 2)[2] for l in open('/proc/self/cgroup').read().splitlines() if ':memory:' in l]\n"
    "_limit = open('/sys/fs/cgroup/memory' + _mem[0] + '/memory.limit_in_bytes').read().strip() if _mem else None\n"
    "_libc = _c.CDLL(None, use_errno=True)\n"
    "_ns = 'allowed' if _libc.unshare(0x10000000) == 0 else _o.strerror(_c.get_errno())\n"
    "print('BWRAP-CAPS', _j.dumps({'memory': _mem, 'limit': _limit, 'unshare': _ns}))\n"
)


def _delegate(base: str, uid: int) -> list[Path]:
    """As an administrator would (grader/README.md, 'Host requirements'): the cgroup v1 base,
    created and given to the grader's user."""
    made = []
    for controller in ("memory", "pids", "cpu"):
        root = Path("/sys/fs/cgroup") / controller
        if (root / "cgroup.procs").exists():
            (root / base).mkdir()
            for path in [root / base, *(root / base).iterdir()]:
                os.chown(path, uid, uid)
            made.append(root / base)
    return made


@pytest.mark.slow
@pytest.mark.skipif(_can_drop_root() is not None, reason=str(_can_drop_root()))
@pytest.mark.skipif(
    cgroups.host()["version"] not in ("v1", "hybrid"), reason="delegates a cgroup v1 base (this host: v2 or none)"
)
def test_a_grader_without_root_sandboxes_with_bubblewrap(tmp_path):
    import json
    import subprocess
    import sys

    course = Course(tmp_path, "00_basics", FIXTURES, None)
    course.do_release()  # (as root: the release is not under test)
    for name in ("c4_files", "c6_shm"):
        source = ATTACKS[name].replace("@COURSE@", str(course.course)).replace("@ROOT@", str(tmp_path))
        submit(course.course, name, course.lab, with_solution(course.solution, "ex_mean", source))
    submit(course.course, "c6_caps", course.lab, with_solution(course.solution, "ex_mean", _CAPS_PROBE))
    submit(course.course, "a_honest", course.lab, course.solution)
    others = _digest(course.course / "submitted" / "a_honest")
    (tmp_path / "home").mkdir()
    subprocess.run(["chown", "-R", f"{UNPRIVILEGED}:{UNPRIVILEGED}", str(tmp_path)], check=True)
    needs = sorted({sys.base_prefix, sys.prefix, str(grading.REPO_ROOT), str(tmp_path)})
    env = dict(os.environ, HOME=str(tmp_path / "home"), **{SECRET_NAME: "grader-secret-" + os.urandom(8).hex()})

    def as_grader(code: str, *args: str, **more_env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["unshare", "--mount", sys.executable, "-I", "-c", _OPEN_PATHS, *needs, "--"]
            + ["setpriv", f"--reuid={UNPRIVILEGED}", f"--regid={UNPRIVILEGED}", "--clear-groups"]
            + [sys.executable, "-c", code, *args],
            cwd=grading.REPO_ROOT,
            env=dict(env, **more_env),
            capture_output=True,
            text=True,
            timeout=900,
        )

    # no cgroup delegated to the grader: no caps, so the default refuses, saying what would do
    refused = as_grader(_SANDBOXED_AS_IS, "auto")
    assert "REFUSED" in refused.stdout, refused.stdout + refused.stderr
    assert "NO memory or process cap" in refused.stdout and "delegate it to the grader's user" in refused.stdout
    assert "DISTTRAIN_SANDBOX=limited" in refused.stdout
    # delegated as grader/README.md says: graded, capped and filtered
    base = f"disttrain-test-{os.getpid()}"
    delegated = _delegate(base, UNPRIVILEGED)
    try:
        run = as_grader(
            _GRADE_AS_IS,
            str(tmp_path),
            str(FIXTURES),
            json.dumps(dict(LIMITS, sandbox="on")),
            DISTTRAIN_CGROUP_BASE=base,
        )
    finally:
        cgroups.Cgroup(base).destroy()
    assert not [d for d in delegated if d.exists()]
    [line] = [x for x in run.stdout.splitlines() if x.startswith("SCORES ")] or [
        run.stdout[-3000:] + run.stderr[-3000:]
    ]
    assert line.startswith("SCORES "), line
    got = json.loads(line[len("SCORES ") :])
    assert set(got["rc"].values()) == {0}, run.stdout[-3000:]
    full = {"test_add": 1.0, "test_mean": 2.0, "test_scale": 1.0, "total": 4.0}
    assert got["scores"]["a_honest"] == full and got["scores"]["c6_shm"] == full
    assert got["scores"]["c4_files"]["total"] == 2.0  # no secret, no gradebook, no solutions, no .git
    assert "LIMITED isolation" in run.stdout and "NO memory or process cap" not in run.stdout
    assert got["scores"]["c6_caps"] == full
    [caps] = [
        json.loads(o["text"].split("BWRAP-CAPS ", 1)[1])
        for c in load(course.course / "autograded" / "c6_caps" / course.lab / f"{course.lab}.ipynb").cells
        for o in c.get("outputs", [])
        if "BWRAP-CAPS " in o.get("text", "")
    ]
    assert caps["memory"] and caps["memory"][0].startswith(f"/{base}/disttrain-grade-"), caps
    assert caps["limit"] == str(LIMITS["student_memory"]) and caps["unshare"] == "Operation not permitted", caps
    report = (course.course / "reports" / "00_basics.txt").read_text()
    assert "isolation: every kernel sandboxed" in report and "isolation LIMITED: the grader is not root" in report
    assert _digest(course.course / "submitted" / "a_honest") == others
    assert _host_leftovers() == [] and not processes_with(str(course.course)) and not list(course.tmp.iterdir())
