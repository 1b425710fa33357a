"""What feedback shows, and limits that see everything (issue 24, classes 5 and 6): one
crafted submission per weakness, graded in one batch of `--jobs 2` beside honest
classmates while a second grading run grades another course on the same host.

Class 5: hidden tests printed from IPython's history or from the running test's frame,
HTML/JavaScript in the feedback page, host paths read from /proc/*/cmdline.  Class 6: a
huge display update, GBs written to /var/tmp and /run/lock, a host unix socket, a spinner
beside a classmate, two gradings at once sharing a uid.  Each gets exactly its deserved
score, the classmates keep theirs, no output or feedback shows a hidden test, and nothing
is left on the host (files, processes, cgroups, uid leases).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import socket
import threading
from pathlib import Path

import nbformat
import pytest

from disttrain_lab import grading
from disttrain_lab.grading import cgroups, hidden_tests, kernels, sandbox, uids
from tests.grading.test_grading import FIXTURE_LIMITS, FIXTURES, Course, feedback, grade_id, processes_with, submit
from tests.notebooks import load

CAN_SANDBOX = sandbox.method() == "root"
needs_sandbox = pytest.mark.skipif(not CAN_SANDBOX, reason=f"needs the root sandbox: {sandbox.problem()}")
pytestmark = pytest.mark.timeout(900)

MARKER = "h24-caps-marker"  # in every file, process and socket an attacker would leave behind
LIMITS = dict(FIXTURE_LIMITS, student_memory=1536 * 2**20, student_pids=256, sandbox="on")
# (each hidden test of the fixture, by what only its line says)
HIDDEN = [
    'run("add", 1, (-1, 1))',
    'run("add", 1, (2.5, 0.5))',
    'run("mean", 1, ([1, 2],))',
    'run("mean", 1, ([5],))',
    'run("scale", 1, ([], 2))',
]
VISIBLE_MEAN = 'run("mean", 1, ([1, 2, 3],))'  # test_mean's visible line

ADD_OK = "def add(a, b):\n    return a + b\n"
MEAN_OK = "def mean(xs):\n    return sum(xs) / len(xs)\n"
SCALE_OK = "def scale(xs, k):\n    return [k * x for x in xs]\n"
# every submission says which uid and cgroups its kernel had, and when it ran
PROBE = (
    "import json as _json, os as _os, time as _time\n"
    "print('CAPS-PROBE', _json.dumps({'uid': _os.getuid(), 'start': _time.time(), "
    "'cgroup': open('/proc/self/cgroup').read()}))\n"
)
END = "print('CAPS-END', _time.time())\n"

# (ex_add, ex_mean, ex_scale) solution cells of each student (fixture 00_basics: 1 + 2 + 1 points)
STUDENTS = {
    # a session of its own, four processes spinning while it sleeps: its classmate is graded beside it.
    # They spin at nice 19: its group still asks for every core it can get (what its classmate must
    # withstand), and its own ranks, whose cold start imports torch, are not starved by its own spinners
    # (at nice 0 they were, on CI under load: 49 s for test_add's first run, and that point lost)
    "a_spinner": (
        PROBE + ADD_OK + "import subprocess as _sp, sys as _sys\n"
        "for _ in range(4):\n"
        f"    _sp.Popen([_sys.executable, '-c', 'import os\\nos.nice(19)\\nwhile True: pass', '{MARKER}'],\n"
        "              start_new_session=True)\n",
        MEAN_OK + "_time.sleep(6)\n",
        SCALE_OK + "_time.sleep(6)\n" + END,
    ),
    # honest, and busy: three seconds of sleep (the spinner starts meanwhile), then some work
    "b_honest": (
        PROBE + ADD_OK + "_time.sleep(3)\n",
        MEAN_OK + "_t0 = _time.time()\n_x = sum(i * i for i in range(3_000_000))\n"
        "print('CAPS-WORK', _time.time() - _t0)\n",
        SCALE_OK + END,
    ),
    # 5. what the kernel remembers of the tests after they ran (encoded: a scrub cannot hide it)
    "c5_history": (
        PROBE + ADD_OK,
        "def mean(xs):\n    return 0\n",
        SCALE_OK
        + (
            "import base64 as _b64, linecache as _lc, sys as _sys\n"
            "_ip = get_ipython()\n"
            "_seen = [repr(In), repr(_ih), repr(_i), repr(_ii), repr(_iii)]\n"
            "_seen += [''.join(v[2]) for v in list(_lc.cache.values()) if isinstance(v, tuple) and len(v) > 2]\n"
            "_seen += [repr(list(_ip.history_manager.get_range(raw=True)))]\n"
            "_seen += [repr(list(_ip.history_manager.get_tail(100, raw=True)))]\n"
            "_seen.append('last_traceback=%s' % (getattr(_sys, 'last_traceback', None) is not None))\n"
            "print('CAPS-SEEN', _b64.b64encode('\\n'.join(_seen).encode()).decode())\n"
        )
        + END,
    ),
    # 5. the running test's source, looked for in every frame above the function as it runs:
    # each frame's file, and every line of it that names mean() or the hidden tests, printed as
    # it is and as HTML, and kept for the next cell (which prints it encoded).  (A graded run's rank may write
    # no file, confine.py: it hands what it saw to its kernel over TCP, which a confined rank may still do)
    "c5_frames": (
        PROBE + ADD_OK,
        "import socket as _sk\n"
        "_C5 = _sk.socket()\n"
        "_C5.bind(('127.0.0.1', 0))\n"
        "_C5.listen(16)\n"
        "_C5_PORT = _C5.getsockname()[1]\n"
        "def mean(xs):\n"
        "    import sys, linecache\n"
        "    from IPython.display import HTML, display\n"
        "    seen, frame = [], sys._getframe(1)\n"
        "    while frame is not None:\n"
        "        seen.append('FRAME ' + frame.f_code.co_filename)\n"
        "        seen += [l for l in linecache.getlines(frame.f_code.co_filename) if 'mean' in l or 'HIDDEN' in l]\n"
        "        frame = frame.f_back\n"
        "    print(''.join(seen))\n"
        "    display(HTML('<pre>' + ''.join(seen).replace(' ', '&nbsp;') + '</pre>'))\n"
        "    import socket\n"
        "    with socket.create_connection(('127.0.0.1', _C5_PORT), timeout=10) as s:\n"
        "        s.sendall('\\n'.join(seen).encode())\n"
        "    return sum(xs) / len(xs)\n",
        SCALE_OK + "import base64 as _b64\n"
        "_C5.settimeout(5)\n"
        "_got = b''\n"
        "while True:\n"
        "    try:\n"
        "        _c, _ = _C5.accept()\n"
        "    except OSError:\n"
        "        break\n"
        "    _c.settimeout(5)\n"
        "    while _chunk := _c.recv(1 << 16):\n"
        "        _got += _chunk + b'\\n'\n"
        "    _C5.settimeout(0.5)\n"
        "print('CAPS-FRAMES', _b64.b64encode(_got).decode())\n" + END,
    ),
    # 5. scripts in outputs (and in a markdown cell of its own, added below)
    "c5_html": (
        PROBE + ADD_OK + "from IPython.display import HTML, Javascript, Markdown, display\n"
        f"display(HTML('<script>document.title = \"{MARKER}-js\"</script>'\n"
        f"             '<img src=x onerror=\"alert(1)\"><b>{MARKER}-bold</b>'))\n"
        f"display(Javascript('alert(\"{MARKER}-javascript\")'))\n"
        f"display(Markdown('<script>alert(\"{MARKER}-md\")</script>'))\n",
        MEAN_OK,
        SCALE_OK + END,
    ),
    # 5. the sandbox's init names the hidden host paths on its command line
    "c5_cmdline": (
        PROBE + ADD_OK + "import base64 as _b64\n"
        "_lines = []\n"
        "for _p in filter(str.isdigit, _os.listdir('/proc')):\n"
        "    try:\n"
        "        _lines.append(open('/proc/%s/cmdline' % _p, 'rb').read().decode(errors='replace'))\n"
        "    except OSError as _e:\n"
        "        _lines.append(type(_e).__name__)\n"
        "try:\n"
        "    _lines.append('environ of 1: ' + open('/proc/1/environ', 'rb').read().decode(errors='replace'))\n"
        "except OSError as _e:\n"
        "    _lines.append('environ of 1: ' + type(_e).__name__)\n"
        "print('CAPS-CMDLINE', _b64.b64encode('\\n'.join(_lines).encode()).decode())\n",
        MEAN_OK,
        SCALE_OK + END,
    ),
    # 6. one display shown 20 times, then updated with 10 MB (and 50 x 100 kB)
    "c6_display": (
        PROBE + ADD_OK + "from IPython.display import display\n"
        "_h = display('small', display_id=True)\n"
        "for _ in range(20):\n"
        "    display('again', display_id=_h.display_id)\n",
        MEAN_OK + "_h.update('y' * 10_000_000)\nfor _ in range(50):\n    _h.update('z' * 100_000)\n",
        SCALE_OK + END,
    ),
    # 6. GBs into the world-writable folders of the host, and into folders only root may write
    "c6_disk": (
        PROBE + ADD_OK + "_report = {}\n"
        "for _d in ['/var/tmp', '/run/lock', '/var/lock', '@OPEN@', '/dev/mqueue', '/run', '/etc']:\n"
        "    try:\n"
        f"        with open(_d + '/{MARKER}', 'wb') as _f:\n"
        "            for _ in range(128):\n"
        "                _f.write(b'x' * 2**24)\n"
        "        _report[_d] = 'wrote 2 GiB'\n"
        "    except OSError as _e:\n"
        "        _report[_d] = _e.strerror\n"
        "print('CAPS-DISK', _json.dumps(_report))\n",
        MEAN_OK,
        SCALE_OK + END,
    ),
    # 6. the host's unix sockets: one in /run, one in a world-writable folder
    "c6_socket": (
        PROBE + ADD_OK + "import socket as _socket\n"
        "_report = {}\n"
        "for _path in ['@SOCK_RUN@', '@SOCK_OPEN@']:\n"
        "    _s = _socket.socket(_socket.AF_UNIX)\n"
        "    try:\n"
        "        _s.connect(_path)\n"
        f"        _s.sendall(b'{MARKER}')\n"
        "        _report[_path] = 'connected'\n"
        "    except OSError as _e:\n"
        "        _report[_path] = _e.strerror\n"
        "print('CAPS-SOCKET', _json.dumps(_report))\n",
        MEAN_OK,
        SCALE_OK + END,
    ),
}
DESERVED = {name: 4.0 for name in STUDENTS} | {"c5_history": 2.0}
ORDER = list(STUDENTS)  # the spinner and its classmate first: graded side by side


def _submission(solution, cells, **paths):
    nb = solution
    for exercise, source in zip(("ex_add", "ex_mean", "ex_scale"), cells):
        for key, value in paths.items():
            source = source.replace(f"@{key.upper()}@", value)
        nb = _with(nb, exercise, source)
    return nb


def _with(nb, exercise, source):
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    [cell] = [c for c in nb.cells if grade_id(c) == exercise]
    cell.source = source
    return nb


class _Server:
    """A unix socket on the host that counts the connections it accepts."""

    def __init__(self, path: str):
        self.path, self.accepted = path, 0
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(path)
        os.chmod(path, 0o777)
        self.sock.listen(8)
        self.sock.settimeout(0.5)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                self.sock.accept()[0].close()
                self.accepted += 1
            except OSError:
                pass

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sock.close()
        os.unlink(self.path)


def _printed(course: Course, student: str) -> str:
    path = course.course / "autograded" / student / course.lab / f"{course.lab}.ipynb"
    nb = load(path)
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def _tagged(text: str, tag: str) -> str:
    [line] = [x for x in text.splitlines() if x.startswith(tag + " ")]
    return line[len(tag) + 1 :]


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("caps")
    course = Course(root / "a", "00_basics", FIXTURES, LIMITS)
    other = Course(root / "b", "00_basics", FIXTURES, LIMITS)  # a second grading run on the host
    course.do_release()
    other.do_release()
    # a world-writable folder on the host's own disk, and two host sockets
    course.open_dir = Path(f"/var/lib/{MARKER}-{os.getpid()}")
    course.open_dir.mkdir(mode=0o1777)
    os.chmod(course.open_dir, 0o1777)
    servers = [_Server(f"/run/{MARKER}-{os.getpid()}.sock"), _Server(str(course.open_dir / "s.sock"))]
    try:
        paths = dict(open=str(course.open_dir), sock_run=servers[0].path, sock_open=servers[1].path)
        for name, cells in STUDENTS.items():
            submit(course.course, name, course.lab, _submission(course.solution, cells, **paths))
        nb = load(course.course / "submitted" / "c5_html" / course.lab / f"{course.lab}.ipynb")
        nb.cells.append(nbformat.v4.new_markdown_cell(f'<script>alert("{MARKER}-cell")</script> my notes'))
        submit(course.course, "c5_html", course.lab, nb)
        # the other run's student sleeps a little, so that it runs beside this run's first two
        slow = (PROBE + ADD_OK, MEAN_OK + "_time.sleep(4)\n", SCALE_OK + END)
        submit(other.course, "other_run", other.lab, _submission(other.solution, slow))
        second = threading.Thread(target=lambda: setattr(other, "results", other.grade(["other_run"])))
        second.start()
        course.results = course.grade(ORDER, jobs=2)
        second.join()
        course.accepted = [s.accepted for s in servers]
    finally:
        for server in servers:
            server.close()
    course.other = other
    course.table = grading.scores(course.lab, course.course)
    other.table = grading.scores(other.lab, other.course)
    course.printed = {s: _printed(course, s) for s in STUDENTS}
    course.printed["other_run"] = _printed(other, "other_run")
    course.probes = {s: json.loads(_tagged(p, "CAPS-PROBE")) for s, p in course.printed.items()}
    for s, p in course.printed.items():
        course.probes[s]["end"] = float(_tagged(p, "CAPS-END"))
    course.left_files = sorted(
        str(p)
        for d in ("/var/tmp", "/run/lock", "/dev/shm", "/tmp", str(course.open_dir))
        for p in Path(d).glob(f"{MARKER}*")
    )
    course.open_left = sorted(os.listdir(course.open_dir))
    os.rmdir(course.open_dir)
    return course


@pytest.mark.slow
@needs_sandbox
def test_each_submission_gets_exactly_its_deserved_score(graded):
    for student in STUDENTS:
        assert graded.results[student].returncode == 0, graded.results[student].output[-3000:]
        assert graded.table[student]["total"] == DESERVED[student], (student, graded.table[student])
    full = {"test_add": 1.0, "test_mean": 2.0, "test_scale": 1.0, "total": 4.0}
    assert graded.table["b_honest"] == full and graded.other.table["other_run"] == full
    assert graded.table["c5_history"] == dict(full, test_mean=0.0, total=2.0)


@pytest.mark.slow
@needs_sandbox
def test_graded_tests_leave_no_history_in_the_kernel(graded):
    seen = base64.b64decode(_tagged(graded.printed["c5_history"], "CAPS-SEEN")).decode()
    assert "last_traceback=False" in seen  # the failed test's traceback (and frame) was dropped
    assert "HIDDEN TESTS" not in seen and not [h for h in HIDDEN if h in seen], seen[-3000:]
    assert VISIBLE_MEAN not in seen  # no test cell at all: In, _ih, linecache, history db


@pytest.mark.slow
@needs_sandbox
def test_no_output_or_feedback_shows_a_hidden_test(graded):
    for course, students in ((graded, list(STUDENTS)), (graded.other, ["other_run"])):
        for student in students:
            nb = load(course.course / "autograded" / student / course.lab / f"{course.lab}.ipynb")
            outputs = json.dumps([c.get("outputs", []) for c in nb.cells])  # (its sources keep the tests)
            page = feedback(course.course, student, course.lab)
            assert page and "HIDDEN TESTS" not in page and "HIDDEN TESTS" not in outputs
            for text in (outputs, page):
                assert not [h for h in HIDDEN if h in text or json.dumps(h)[1:-1] in text], student
    # the function ran on a rank of the student's kernel, called by the kit's runner: no frame above
    # it holds a test (which runs in the grader kernel), and nothing it printed or displayed reached
    # the test's cell
    frames = base64.b64decode(_tagged(graded.printed["c5_frames"], "CAPS-FRAMES")).decode()
    assert "FRAME /" in frames and "disttrain_lab" in frames, frames[:3000]  # it looked: the kit's runner called it
    assert VISIBLE_MEAN not in frames and "HIDDEN TESTS" not in frames and not [h for h in HIDDEN if h in frames]
    [cell] = [
        c
        for c in load(graded.course / "autograded" / "c5_frames" / "00_basics" / "00_basics.ipynb").cells
        if grade_id(c) == "test_mean"
    ]
    assert cell.outputs == [], cell.outputs  # passed, and showed nothing of the function's


@pytest.mark.slow
@needs_sandbox
def test_feedback_runs_no_script_a_submission_wrote(graded):
    page = feedback(graded.course, "c5_html", "00_basics")
    assert f"<b>{MARKER}-bold</b>" in page  # harmless markup is kept
    for what in ("js", "javascript", "md", "cell"):
        assert not re.search(rf"<script[^>]*>[^<]*{MARKER}-{what}", page), what
    assert not re.search(r"<[a-z][^>]*\sonerror\s*=", page, re.IGNORECASE)  # (escaped, it is text)
    assert "my notes" in page


@pytest.mark.slow
@needs_sandbox
def test_kernel_command_lines_name_no_host_path(graded):
    seen = base64.b64decode(_tagged(graded.printed["c5_cmdline"], "CAPS-CMDLINE")).decode()
    assert "sandbox.py\0--init" in seen  # the sandbox's init, as the kernel sees it
    hidden = [graded.root, graded.other.root, FIXTURES, *kernels.git_paths()]  # course, temp dirs, source
    assert not [str(h) for h in hidden if str(h) in seen], seen
    assert "environ of 1: PermissionError" in seen


@pytest.mark.slow
@needs_sandbox
def test_display_updates_count_against_the_output_cap(graded):
    path = graded.course / "autograded" / "c6_display" / "00_basics" / "00_basics.ipynb"
    assert path.stat().st_size < 3 * 10**6, path.stat().st_size  # (200 MB before)
    [cell] = [c for c in load(path).cells if grade_id(c) == "ex_mean"]
    assert [o.ename for o in cell.outputs if o.output_type == "error"] == ["OutputLimitExceeded"]


@pytest.mark.slow
@needs_sandbox
def test_the_host_file_system_is_read_only_but_for_private_tmpfs(graded):
    report = json.loads(_tagged(graded.printed["c6_disk"], "CAPS-DISK"))
    assert report["/var/tmp"] == report["/run/lock"] == "No space left on device", report  # private, capped
    assert report[str(graded.open_dir)] == "Read-only file system", report
    assert report["/etc"] in ("Read-only file system", "Permission denied"), report
    assert "wrote 2 GiB" not in report.values()
    assert graded.left_files == [] and graded.open_left == []


@pytest.mark.slow
@needs_sandbox
def test_host_unix_sockets_are_out_of_reach(graded):
    report = json.loads(_tagged(graded.printed["c6_socket"], "CAPS-SOCKET"))
    assert "connected" not in report.values(), report
    assert graded.accepted == [0, 0]


@pytest.mark.slow
@needs_sandbox
def test_a_spinner_gets_its_own_cpu_group_beside_its_classmate(graded):
    def cpu_group(student):
        lines = graded.probes[student]["cgroup"].splitlines()
        return [p for _, c, p in (x.split(":", 2) for x in lines) if "cpu" in c.split(",")][0]

    spinner, honest = cpu_group("a_spinner"), cpu_group("b_honest")
    if cgroups.host()["version"] not in ("v1", "hybrid") or "cpu" not in cgroups.host()["caps"]:
        pytest.skip(f"reads cgroup v1 cpu groups (this host: {cgroups.host()})")
    # one cpu group per grading step (one student), siblings below the base: equal shares
    assert spinner.startswith(f"/{cgroups.base()}/") and honest.startswith(f"/{cgroups.base()}/")
    assert Path(spinner).parent != Path(honest).parent and Path(spinner).parent.parent == Path(honest).parent.parent
    # side by side: the classmate ran while the spinner spun, and kept its pace (generous bound)
    a, b = graded.probes["a_spinner"], graded.probes["b_honest"]
    assert b["start"] < a["end"] and a["start"] < b["end"]
    assert float(_tagged(graded.printed["b_honest"], "CAPS-WORK")) < 60  # (about 1 s on an idle core)
    assert graded.results["b_honest"].seconds < 150, graded.results["b_honest"].seconds
    assert not (cgroups.MOUNT / "cpu" / spinner.lstrip("/")).exists()


@pytest.mark.slow
@needs_sandbox
def test_gradings_at_the_same_time_never_share_a_uid(graded):
    probes = graded.probes
    overlapping = [
        (s, t)
        for s in probes
        for t in probes
        if s < t and probes[s]["start"] < probes[t]["end"] and probes[t]["start"] < probes[s]["end"]
    ]
    assert ("a_spinner", "other_run") in overlapping or ("b_honest", "other_run") in overlapping
    assert [(s, t) for s, t in overlapping if probes[s]["uid"] == probes[t]["uid"]] == []
    assert all(uids.FIRST_UID <= p["uid"] < uids.FIRST_UID + uids.SPAN for p in probes.values())


def _lease_left_behind(path) -> bool:
    """A lease file that nobody holds (its holder died without giving it back)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # held: a live grading's
    finally:
        os.close(fd)
    return True


@pytest.mark.slow
@needs_sandbox
def test_nothing_is_left_on_the_host(graded):
    used = {p["uid"] for p in graded.probes.values()}
    # every lease given back: a lease file may exist only while a grading still holds it (another
    # test's grading, beside this one under xdist, may lease the same uid after ours gave it back)
    assert not [u for u in used if _lease_left_behind(uids.LEASE_DIR / str(u))]
    assert not processes_with(str(graded.course)) and not processes_with(str(graded.other.course))
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, MARKER)]
    assert not list(graded.tmp.iterdir()) and not list(graded.other.tmp.iterdir())
    for probe in graded.probes.values():
        for line in probe["cgroup"].splitlines():  # each hierarchy's node (v1's, and v2's "0::")
            path = line.split(":", 2)[2]
            if path.startswith(f"/{cgroups.base()}/"):
                assert not [d for d in cgroups.Cgroup(path).dirs if d.exists()], path


def _cmdline_has(pid: str, marker: str) -> bool:
    try:
        return marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


# ----------------------------------------------------------------------------------------
# the parts, without a grading


def test_scrub_replaces_hidden_lines_even_behind_markup():
    lines = hidden_tests.hidden_lines(
        ["assert f(1) == 1\n### BEGIN HIDDEN TESTS\nassert f(-1) == -1\n)\n### END HIDDEN TESTS\n"]
    )
    assert lines == [hidden_tests.BEGIN, hidden_tests.END, "assert f(-1) == -1"]  # (not `)`: too short)
    assert hidden_tests.scrub_text("x\nassert f(-1) == -1\n", lines) == f"x\n{hidden_tests.MARKER}\n"
    assert hidden_tests.scrub_text("<b>assert</b>&nbsp;f(-1)  ==\u200b -1", lines) == hidden_tests.MARKER
    assert hidden_tests.scrub_text("assert f(1) == 1 and a < b", lines) == "assert f(1) == 1 and a < b"
    output = {"output_type": "display_data", "data": {"application/json": {"k": ["assert f(-1) == -1"]}}}
    assert hidden_tests.scrub(output, lines)["data"]["application/json"]["k"] == [hidden_tests.MARKER]


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
@needs_sandbox
def test_a_uid_lease_is_exclusive_and_dies_with_its_holder(tmp_path):
    import fcntl
    import subprocess
    import sys

    hold = (
        "import sys; from pathlib import Path; from disttrain_lab.grading import uids\n"
        "print(uids.lease(directory=Path(sys.argv[1])), flush=True); sys.stdin.readline()\n"
    )
    holders = [
        subprocess.Popen(
            [sys.executable, "-c", hold, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        taken = [int(h.stdout.readline()) for h in holders]
        assert len(set(taken)) == 2
        mine = uids.lease(directory=tmp_path)
        assert mine not in taken
        holders[0].kill()
        holders[0].wait()
        with open(tmp_path / str(taken[0])) as f:  # freed when its holder died, however it died
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        for h in holders:
            h.kill()
            h.wait()
