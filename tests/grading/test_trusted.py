"""The verdict is decided where no student code runs (issues 24, 42): lab 1's graded tests run in
a grader kernel; the student's kernel only serves the runs a test asks for, and what comes
back is read as data.  Crafted lab 1 submissions, each aimed at what used to decide inside
the student's kernel, are graded with `--jobs 2`, an honest classmate last, beside the last attacker
and after all of them (the real lab, the real sandbox): each gets exactly 0 (its solutions are blank but
for the attack), the classmate keeps 16/16, nothing runs on the grader's side, nothing is left behind.
(One classmate: a second, graded first, was a whole lab-1 grading more (#35) for what this one shows;
a classmate harmed by the class's grading is test_caps.py's subject.)
"""

from __future__ import annotations

import html
import os

import pytest

from disttrain_lab import confine, grading, wire
from disttrain_lab.grading import sandbox
from tests.grading.test_grading import (
    Course,
    all_points,
    feedback,
    grade_id,
    processes_with,
    submit,
    with_solution,
)
from tests.helpers import REPO

LAB = "01_point_to_point"
CAN_SANDBOX = sandbox.problem() is None
pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not CAN_SANDBOX, reason=f"this host cannot sandbox: {sandbox.problem()}"),
    pytest.mark.skipif(wire.available() is not None, reason=str(wire.available())),
]

MARKER = "h24-trusted-marker"  # a file of this name on the host = code ran on the grader's side
HIDDEN_LINE = "lab_tests.check_ping_pong(3, 7, 4, torch.int64)"  # a line of lab 1's hidden tests

# 1 + 7. The student's kernel answers the grader itself: right values made up from the
# request's inputs, a trace with exactly the sends and receives the test wants, the ranks'
# real process ids, and a claimed byte count; nothing is sent.
FORGED_SERVE = """
import torch
import disttrain_lab as dl
from disttrain_lab import pool as _pool, protocol as _protocol

def ping_pong(x, repeats=1):
    return x

def _answers(name, inputs):
    n = len(inputs)
    if name == "ping_pong":
        return [inputs[0][0].clone() if r < 2 else inputs[r][0] for r in range(n)]
    if name == "ring_shift":
        return [inputs[(r - 1) % n][0].clone() for r in range(n)]
    if name.startswith("broadcast"):
        return [inputs[inputs[0][1]][0].clone() for r in range(n)]
    return [None] * n

def _events(name, inputs):
    if name != "ping_pong":
        return ()
    x, repeats = inputs[0]
    nbytes, events, t = x.numel() * x.element_size(), [], 0.0
    for _ in range(repeats):
        for rank, ops in ((0, ("send", "recv")), (1, ("recv", "send"))):
            for op in ops:
                events.append(dl.Event(rank=rank, op=op, kind="p2p", start=t, end=t + 1e-4, peer=1 - rank, bytes=nbytes))
                t += 2e-4
    return tuple(events)

def _forged(comm, msg):
    if _protocol.PREPARE in (msg["content"].get("data") or {}):  # the grader's "start your ranks": yes
        comm.send({"prepared": True})
        comm.close()
        return
    request = _protocol.Request.from_bytes(bytes(msg["buffers"][0]))
    name, n, inputs = request.name, request.world_size, request.inputs
    dl.launch(lambda: None, n)                      # real ranks, whose ids check out
    record = _protocol.Record(results=_answers(name, inputs), inputs_after=[tuple(i) for i in inputs],
                              events=_events(name, inputs), pids=tuple(_pool.worker_pids()[:n]))
    comm.send({}, buffers=[record.to_bytes()])      # a valid record: only the grader's own count can tell
    comm.close()

get_ipython().kernel.comm_manager.register_target(_protocol.COMM_TARGET, _forged)
"""

# 2. A record that runs code when unpickled (a plain pickle, and one inside torch.save's zip)
PICKLE_BOMB = """
import io, os, pickle, torch
from disttrain_lab import protocol as _protocol

def ping_pong(x, repeats=1):
    return x

class _Bomb:
    def __reduce__(self):
        return (os.system, ("touch /tmp/@MARKER@",))

_calls = [0]

def _bomb(comm, msg):
    if _protocol.PREPARE in (msg["content"].get("data") or {}):  # the grader's "start your ranks": yes
        comm.send({"prepared": True})
        comm.close()
        return
    _calls[0] += 1
    record = {"version": 1, "results": [_Bomb(), _Bomb()], "inputs_after": [[], []], "events": [], "pids": [1, 2],
              "backend": "gloo", "failure": None}
    if _calls[0] % 2:
        data = pickle.dumps(record)
    else:
        buffer = io.BytesIO()
        torch.save(record, buffer)
        data = buffer.getvalue()
    comm.send({}, buffers=[data])
    comm.close()

get_ipython().kernel.comm_manager.register_target(_protocol.COMM_TARGET, _bomb)
"""

# 1. What a check inside the student's kernel would have to catch: comparisons replaced, a
# torch function mode that makes every comparison agree, hooks that swallow assertion errors,
# and a thread that keeps putting all of it back
HOOKS_AND_MODES = """
import threading, time
import torch
from torch.overrides import TorchFunctionMode
from disttrain_lab import checks

def ping_pong(x, repeats=1):
    return x

class _AllAgree(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.allclose, torch.equal, torch.isclose):
            return True
        return func(*args, **(kwargs or {}))

_AllAgree().__enter__()
get_ipython().set_custom_exc((AssertionError,), lambda *a, **k: None)

def _keep_replacing():
    while True:
        checks.assert_close = checks.assert_traffic = checks.assert_only_p2p = lambda *a, **k: None
        time.sleep(0.005)

threading.Thread(target=_keep_replacing, daemon=True).start()
"""

# 7. Data moved through shared memory, not torch.distributed: the values arrive, no byte
# crosses the ranks' network
SHARED_MEMORY = """
import os, time
import torch
import torch.distributed as dist

def ping_pong(x, repeats=1):
    rank, path = dist.get_rank(), f"/dev/shm/h24-{x.numel()}-{repeats}"
    if rank == 0:
        torch.save(x, path + ".part")
        os.replace(path + ".part", path)
    elif rank == 1:
        deadline = time.monotonic() + 10
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.001)
        x.copy_(torch.load(path))
    return x
"""

# a ping-pong's messages, in its order and of its sizes, carrying zeros (attacks 9 and 10)
ZEROS_ON_THE_WIRE = """\
    junk = torch.zeros_like(x)
    for _ in range(repeats):
        if rank == 0:
            dist.send(junk, dst=1)
            dist.recv(junk, src=1)
        else:
            dist.recv(junk, src=0)
            dist.send(junk, dst=0)"""

# 9. The data taken off the wire: rank 1 searches its own process for rank 0's input (launch used to
# send every rank all ranks' inputs, and ranks forked after a request held a copy of it), and
# the ranks send zeros in the ping-pong's order, so the bytes and their order are right
OTHERS_INPUTS = """
import gc
import torch
import torch.distributed as dist

def ping_pong(x, repeats=1):
    rank = dist.get_rank()
    if rank > 1:
        return x
    found = None
    for obj in gc.get_objects():
        if isinstance(obj, (list, tuple)):
            for item in obj[:64]:
                for t in item if isinstance(item, tuple) else (item,):
                    if (isinstance(t, torch.Tensor) and t is not x and t.shape == x.shape and t.dtype == x.dtype
                            and bool(t.any()) and not torch.equal(t, x)):
                        found = t
@ZEROS_ON_THE_WIRE@
    if rank == 1 and found is not None:
        x.copy_(found)
    return x
""".replace("@ZEROS_ON_THE_WIRE@", ZEROS_ON_THE_WIRE)

# 10. The data passed through shared memory, as in 7, and junk of the right sizes sent in the
# ping-pong's order: the bytes counted and their order are right, not what they carry (the capture
# keeps the payloads: carried.assert_carried)
SHARED_MEMORY_AND_JUNK = """
import os, time
import torch
import torch.distributed as dist

def ping_pong(x, repeats=1):
    rank, path = dist.get_rank(), f"/dev/shm/h42-{x.numel()}-{repeats}-{x.dtype}"
    if rank > 1:
        return x
    if rank == 0:
        torch.save(x, path + ".part")
        os.replace(path + ".part", path)
@ZEROS_ON_THE_WIRE@
    if rank == 1:
        deadline = time.monotonic() + 10
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.001)
        x.copy_(torch.load(path))
    return x
""".replace("@ZEROS_ON_THE_WIRE@", ZEROS_ON_THE_WIRE)

# 11. The data passed through the launcher's store (the process groups' rendezvous, in the student's
# kernel: no file, no signal, nothing confinement refuses) and junk of the right sizes on the wire
STORE_AND_JUNK = """
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

def ping_pong(x, repeats=1):
    rank, store = dist.get_rank(), _get_default_store()
    if rank > 1:
        return x
    if rank == 0:
        store.set("h42", x.numpy().tobytes())
@ZEROS_ON_THE_WIRE@
    if rank == 1:
        x.copy_(torch.frombuffer(bytearray(store.get("h42")), dtype=x.dtype))
    return x
""".replace("@ZEROS_ON_THE_WIRE@", ZEROS_ON_THE_WIRE)

# 5. Looks for the hidden tests: the kernel's input history, and every file the grader
# drops where the kernel can see it (a thread copies each one as it appears)
SNOOP = """
import glob, os, shutil, threading, time

def ping_pong(x, repeats=1):
    return x

os.makedirs("/tmp/stash", exist_ok=True)

def _copy_all():
    while True:
        for path in glob.glob("/tmp/.kernel/**", recursive=True):
            if os.path.isfile(path):
                try:
                    shutil.copy(path, "/tmp/stash/" + os.path.basename(path))
                except OSError:
                    pass
        time.sleep(0.002)

threading.Thread(target=_copy_all, daemon=True).start()
"""

SNOOP_REPORT = """
import glob
print("HISTORY:", "\\n".join(In))
for path in sorted(glob.glob("/tmp/stash/*")):
    print("FILE", path, open(path, "rb").read()[:20000])
"""

# 8. Not a ping-pong: every ping goes out before any pong comes back (the same bytes between the
# same ranks, the right values), and the rank's own trace is rewritten to read as round trips: the
# order is read from the wire (the grader's packet capture), so the ping-pong gets nothing
BATCHED_FORGED_TRACE = """
import torch.distributed as dist
from disttrain_lab import trace as _trace

def ping_pong(x, repeats=1):
    rank = dist.get_rank()
    if rank > 1:
        return x
    copies = [x.clone() for _ in range(repeats)]
    for c in copies:
        dist.send(c, dst=1) if rank == 0 else dist.recv(c, src=0)
    for c in copies:
        dist.recv(c, src=1) if rank == 0 else dist.send(c, dst=0)
    x.copy_(copies[-1])
    events = _trace._REC.events     # (rank, op, kind, start, end, ...): alternate them, times kept in order
    p2p = [e for e in events if e[2] == "p2p"]
    firsts, seconds = p2p[:repeats], p2p[repeats:]
    alternating = [e for pair in zip(firsts, seconds) for e in pair]
    times = sorted((e[3], e[4]) for e in p2p)
    forged = [e[:3] + t + e[5:] for e, t in zip(alternating, times)]
    events[:] = [e for e in events if e[2] != "p2p"] + forged
    return x
"""

# A function that never returns: the test gives up on it, the student's kernel is
# interrupted (or restarted), and the tests after it run
HANGS = """
import time

def ping_pong(x, repeats=1):
    while True:
        time.sleep(0.01)
"""

ATTACKS = {
    "batched_forged_trace": BATCHED_FORGED_TRACE,
    "forged_serve": FORGED_SERVE,
    "hangs": HANGS,
    "pickle_bomb": PICKLE_BOMB,
    "hooks_and_modes": HOOKS_AND_MODES,
    "others_inputs": OTHERS_INPUTS,
    "shared_memory": SHARED_MEMORY,
    "shared_memory_and_junk": SHARED_MEMORY_AND_JUNK,
    "store_and_junk": STORE_AND_JUNK,
    "snoop": SNOOP,
}


def _host_marker() -> list[str]:
    return [p for p in ("/tmp/" + MARKER,) if os.path.exists(p)]


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    for leftover in _host_marker():
        os.unlink(leftover)
    course = Course(tmp_path_factory.mktemp("trusted"), LAB, REPO / "solutions", None)
    course.do_release()
    blank = course.blank()
    for name, source in ATTACKS.items():
        nb = with_solution(blank, "ex_ping_pong", source.replace("@MARKER@", MARKER))
        if name == "snoop":
            nb = with_solution(nb, "ex_parameter_server_step", SNOOP_REPORT)
        submit(course.course, name, LAB, nb)
    submit(course.course, "z_honest", LAB, course.solution)
    course.results = course.grade(jobs=2)
    course.table = grading.scores(LAB, course.course)
    course.markers = _host_marker()
    return course


@pytest.mark.slow
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_each_attack_gets_nothing(graded, attack):
    assert graded.results[attack].returncode == 0, graded.results[attack].output[-3000:]
    assert graded.table[attack]["total"] == 0, graded.table[attack]


@pytest.mark.slow
def test_the_honest_classmate_keeps_full_marks_and_nothing_ran_on_the_graders_side(graded):
    full = sum(all_points(graded.solution).values())  # every point of lab 1, predictions included
    assert graded.table["z_honest"]["total"] == full
    assert graded.markers == []  # the pickle bomb never went off where the grader reads records
    assert not processes_with(str(graded.course))
    assert not list(graded.tmp.iterdir())


@pytest.mark.slow
def test_what_each_attack_is_told(graded):
    forged = feedback(graded.course, "forged_serve", LAB)
    # the made-up values were right and no byte moved; its kernel answered with ranks of its own launch, which
    # the grader sees unconfined from outside (confine.unconfined) where it can: then nothing is counted at all
    if confine.host_problem() is None:
        assert "rank 0 was not confined: no_new_privs" in forged, forged[-3000:]
        # and it tells the student that was the notebook's doing, not the instructor to change the host
        assert wire.SUBMISSION_CHANGED_THE_RANKS in html.unescape(forged) and "For the instructor" not in forged
    else:  # (an older Landlock: the filter and the check may still hold)
        assert "the operating system counted" in forged or "rank 0 was not confined" in forged, forged[-3000:]
    assert "could not be read as plain data" in feedback(graded.course, "pickle_bomb", LAB)
    shm = html.unescape(feedback(graded.course, "shared_memory", LAB))
    junk = html.unescape(feedback(graded.course, "shared_memory_and_junk", LAB))  # right sizes, junk in them
    if confine.host_problem() is None:  # a graded run's ranks are confined: the file in /dev/shm is refused
        for page in (shm, junk):
            # (torch.save says: "rank 0 raised RuntimeError: ... open file failed with strerror: Permission denied")
            assert "rank 0 raised" in page and "Permission denied" in page, page[-3000:]
    else:  # the wire says what they did not send
        assert "the operating system counted" in shm
        assert "should carry 3 message(s) of the tensor's own bytes" in junk and "found 0 of them" in junk, junk[-3000:]
    # small tensors pass through the store under what making the groups may take (wire.OffTheWire: 256 KiB a
    # rank), so the wire's content says it: the tensor's bytes never crossed
    store = html.unescape(feedback(graded.course, "store_and_junk", LAB))
    assert "found 0 of them" in store or "exchanged data with a process that is not a rank" in store, store[-3000:]
    others = html.unescape(feedback(graded.course, "others_inputs", LAB))  # no other rank's input to be found
    assert "rank 1's returned tensor: values differ" in others, others[-3000:]
    hung = feedback(graded.course, "hangs", LAB)
    assert "did not finish within" in hung and "CellTimeoutError" not in hung  # the launcher says so, in time
    batched = html.unescape(
        feedback(graded.course, "batched_forged_trace", LAB)
    )  # right bytes and values, forged trace
    assert "it crossed as 0->1 then 1->0" in batched and "each ping waiting for its pong" in batched, batched[-3000:]
    hooked = feedback(graded.course, "hooks_and_modes", LAB)  # its own kernel is what it broke
    assert "values differ" in hooked or "no valid record" in hooked or "the run stopped" in hooked, hooked[-3000:]


@pytest.mark.slow
def test_no_hidden_test_reaches_the_students_kernel_or_feedback(graded):
    page = feedback(graded.course, "snoop", LAB)
    assert "HISTORY:" in page  # the snoop ran ...
    assert HIDDEN_LINE not in page and "BEGIN HIDDEN TESTS" not in page  # ... and found none
    [cell] = [c for c in graded.autograded("snoop").cells if grade_id(c) == "ex_parameter_server_step"]
    printed = "".join(str(o.get("text", "")) for o in cell.outputs)
    assert "HISTORY:" in printed and "check_ping_pong(" not in printed and "dl.exercise.run" not in printed
