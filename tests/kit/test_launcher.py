"""dl.launch: results, prints, errors, deadlocks, timeouts, cleanup, concurrency, torchrun."""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch
import torch._dynamo  # noqa: F401  (its cache folder is made as it is imported: not by a launch in a test below)
import torch.distributed as dist

import disttrain_lab as dl
from disttrain_lab import devices, pool, ranks
from disttrain_lab.status import Blocked
from tests.helpers import REPO, child_pids, gpu_count, needs_gpus, run_python, run_torchrun, survivors, tmp_listing

# --- what a student writes -------------------------------------------------------------


def rank_times_ten():
    return dist.get_rank() * 10


def add(x, y=0):
    return x + y + (dist.get_rank() if dist.is_initialized() else 0)


def tensor_of_rank(n):
    return torch.full((n,), float(dist.get_rank()))


def raises_on_rank_one():
    if dist.get_rank() == 1:
        values = [1, 2, 3]
        return values[7]  # IndexError on this line
    t = torch.zeros(1)
    dist.recv(t, src=1)  # rank 0 would wait forever: the launcher must stop it


def both_receive_first():
    t = torch.zeros(4)
    dist.recv(t, src=1 - dist.get_rank())


def tags_disagree():
    t = torch.zeros(4)
    if dist.get_rank() == 0:
        dist.send(t, dst=1, tag=1)
    else:
        dist.recv(t, src=0, tag=2)


def collectives_of_two_groups_crossed():
    # each rank waits in a collective of a group the other is not calling yet: what the ranks'
    # call logs cannot tell from a slow peer (test_matching.py), so it is reported at the timeout
    pair = dist.new_group([0, 1])
    groups = [pair, None] if dist.get_rank() == 0 else [None, pair]
    for group in groups:
        dist.all_reduce(torch.ones(3), group=group)


def spins_forever_on_rank_one():
    if dist.get_rank() == 1:
        while True:
            pass


def ping_pong_forever():
    # matched calls, but the loop never ends: at the deadline either rank may sit in a send
    t = torch.zeros(4)
    while True:
        if dist.get_rank() == 0:
            dist.send(t, dst=1)
            dist.recv(t, src=1)
        else:
            dist.recv(t, src=0)
            dist.send(t, dst=0)


def prints_pid_then_sleeps():
    print("pid", os.getpid(), flush=True)
    time.sleep(1000)


# --- results ---------------------------------------------------------------------------


def test_returns_each_ranks_value_in_rank_order():
    assert dl.launch(rank_times_ten, 4) == [0, 10, 20, 30]


def test_passes_positional_and_keyword_arguments():
    assert dl.launch(add, 3, 100, y=5) == [105, 106, 107]


def test_returns_tensors():
    out = dl.launch(tensor_of_rank, 2, 3)
    assert torch.equal(out[1], torch.ones(3))


def test_tensor_arguments_reach_every_rank():
    x = torch.arange(5.0)
    out = dl.launch(lambda t: t * (dist.get_rank() + 1), 2, x)
    assert torch.equal(out[0], x) and torch.equal(out[1], 2 * x)


def _inputs_seen(x, tag):
    """This rank's value, the shared argument, and every tensor like the per-rank ones its process holds."""
    import gc

    like = {
        float(t[0])
        for o in gc.get_objects()
        if isinstance(o, (list, tuple))
        for t in o[:64]
        if isinstance(t, torch.Tensor) and t.numel() == 5 and float(t[0]) >= 500
    }
    return float(x[0]), tag, sorted(like)


def test_per_rank_arguments_reach_their_rank_alone():
    """#42: a PerRank argument's k-th value is sent to rank k only; the ranks were forked before it existed."""
    dl.launch(rank_times_ten, 2)  # warm ranks, forked before the values below exist
    values = dl.launcher.PerRank([torch.full((5,), 500.0 + r) for r in range(2)])
    assert dl.launch(_inputs_seen, 2, values, "shared") == [(500.0, "shared", [500.0]), (501.0, "shared", [501.0])]
    with pytest.raises(ValueError, match="argument 1 is a PerRank of 3 values; a launch of 2 ranks needs one per rank"):
        dl.launch(_inputs_seen, 2, dl.launcher.PerRank([1, 2, 3]), "shared")


def _links() -> dict[int, str]:
    links = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            links[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return links


def test_a_rank_holds_no_end_of_another_ranks_channels():
    """#42: ranks are forked one after the other, so rank k was born holding the kernel's ends of the ranks forked
    before it (their control sockets, output and stack pipes): a way to write into another rank's control channel
    or read its output, which no wire shows.  Each rank now holds its own channels alone; the rest is /dev/null."""
    pool.shutdown()
    dl.launch(rank_times_ten, 3)  # a pool of 3, forked now
    workers = pool._POOL.workers
    kernel_ends = {
        w.rank: {os.readlink(f"/proc/self/fd/{fd}") for fd in (w.conn.fileno(), w.out_fd, w.stack_fd)} for w in workers
    }
    held = dl.launch(_links, 3)
    for rank, links in enumerate(held):
        others = set().union(*(ends for r, ends in kernel_ends.items() if r != rank))
        assert not others & set(links.values()), (rank, sorted(others & set(links.values())))
        assert links[0] == "/dev/null", links  # the kernel's stdin
    assert all(kernel_ends.values())


def test_a_run_that_may_not_fork_says_so():
    pool.shutdown()
    with pool.prepared_only(), pytest.raises(pool.NotPrepared, match="no warm ranks for a run of 2"):
        dl.launch(rank_times_ten, 2)
    pool.prepare(2, devices.plan(2))
    with pool.prepared_only():
        assert dl.launch(rank_times_ten, 2) == [0, 10]


def test_smaller_then_larger_world_reuses_or_rebuilds_pool():
    assert dl.launch(rank_times_ten, 2) == [0, 10]
    assert dl.launch(rank_times_ten, 3) == [0, 10, 20]
    assert dl.launch(rank_times_ten, 2) == [0, 10]


def test_prints_are_relayed_with_rank_prefix(capfd):
    def hello():
        print("hi from", dist.get_rank())

    dl.launch(hello, 2)
    out = capfd.readouterr().out
    assert "[rank 0] hi from 0" in out and "[rank 1] hi from 1" in out


def test_huge_output_is_capped(capfd):
    def chatty():
        for i in range(pool.MAX_OUTPUT_LINES + 500):
            print("line", i)
        return "done"

    assert dl.launch(chatty, 2) == ["done", "done"]
    out = capfd.readouterr().out
    assert out.count("[rank 0] line") == pool.MAX_OUTPUT_LINES
    assert "500 more lines not shown" in out


def test_random_numbers_do_not_depend_on_earlier_launches():
    # a warm rank must not carry its random state from one launch to the next
    torch.manual_seed(1234)
    first = dl.launch(lambda: torch.randn(3), 2)
    dl.launch(lambda: torch.randn(1000), 2)  # consumes random numbers in the ranks only
    torch.manual_seed(1234)
    again = dl.launch(lambda: torch.randn(3), 2)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    torch.manual_seed(1234)
    assert torch.equal(first[0], torch.randn(3)), "ranks start from the notebook's state"


def test_device_is_cpu_under_gloo():
    assert dl.launch(lambda: str(dl.device()), 2) == ["cpu", "cpu"]


def test_works_after_parent_ran_a_multithreaded_matmul():
    # the OpenMP-after-fork hang: the parent's thread pool is gone in a forked child
    a = torch.randn(1500, 1500)
    (a @ a).sum()

    def child_matmul():
        b = torch.randn(300, 300)
        return float((b @ b).abs().sum() > 0)

    assert dl.launch(child_matmul, 2, timeout=30) == [1.0, 1.0]


# --- bad arguments ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(world_size=0), "world_size must be an int from 1 to"),
        (dict(world_size=10_000), "world_size must be an int from 1 to"),
        (dict(world_size=2.0), "world_size must be an int"),
        (dict(world_size=2, timeout=0), "timeout must be a number of seconds > 0"),
        (dict(world_size=2, timeout=-1), "timeout must be a number of seconds > 0"),
        (dict(world_size=2, backend="mpi"), "backend must be one of ('gloo', 'nccl')"),
        (dict(world_size=2, device="gpu"), "device must be one of ('cpu', 'cuda')"),
        (dict(world_size=2, device="cuda:1"), "device must be one of ('cpu', 'cuda')"),
        (dict(world_size=2, device="cpu", backend="nccl"), "backend='nccl' needs device='cuda'"),
        (dict(world_size=2, device="cuda", backend="gloo"), "backend='gloo' needs device='cpu'"),
    ],
)
def test_bad_arguments_say_what_is_valid(kwargs, fragment):
    with pytest.raises(ValueError) as err:
        dl.launch(rank_times_ten, **kwargs)
    assert fragment in str(err.value)


def test_not_callable_is_refused():
    with pytest.raises(ValueError, match="pass the function itself"):
        dl.launch(add(1), 2)  # a common slip: passing the result instead of the function


# --- failures become clear errors, and stop every rank ----------------------------------


def test_exception_on_one_rank_names_rank_and_line_and_stops_others():
    start = time.perf_counter()
    with pytest.raises(dl.RankError) as err:
        dl.launch(raises_on_rank_one, 2, timeout=60)
    # stopped at once, not after the 60 s timeout (the bound leaves room for a loaded machine)
    assert time.perf_counter() - start < 30, "rank 0 blocked in recv must be stopped at once"
    e = err.value
    assert e.rank == 1 and e.exc_type == "IndexError"
    text = str(e)
    assert "rank 1 raised IndexError" in text
    last_frame = text.split("Traceback of rank 1")[1]
    assert "in raises_on_rank_one" in last_frame and "return values[7]" in last_frame
    assert "disttrain_lab/launcher.py" not in text and "cloudpickle" not in text
    assert not child_pids() or dl.launch(rank_times_ten, 2) == [0, 10]


def test_error_inside_torch_call_ends_at_students_line():
    def bad_peer():
        dist.send(torch.ones(1), dst=5)  # no rank 5 in a world of 2

    with pytest.raises(dl.RankError) as err:
        dl.launch(bad_peer, 2)
    assert "there is no rank 5" in str(err.value) and "valid ranks are 0..1" in str(err.value)
    shown = str(err.value).split("Traceback of rank")[1]
    frames = [line for line in shown.splitlines() if line.strip().startswith(("File", "Cell"))]
    assert frames and "in bad_peer" in frames[-1], shown


@pytest.mark.parametrize(
    "fn, lines, diagnosis",
    [
        (both_receive_first, ["rank 0: recv(src=1", "rank 1: recv(src=0"], "Every rank is waiting to receive"),
        (tags_disagree, ["rank 0: send(dst=1, tag=1", "rank 1: recv(src=0, tag=2"], "different tags (1 and 2)"),
        (
            collectives_of_two_groups_crossed,
            ["rank 0: all_reduce(group=[0, 1]", "rank 1: all_reduce(12 B"],
            "wait in collectives of different groups (rank 0 in group [0, 1]; rank 1 in the whole world)",
        ),
        (
            spins_forever_on_rank_one,
            ["rank 0: finished", "rank 1: running Python code", "in spins_forever_on_rank_one (line"],
            "Rank 1 kept running Python code outside any torch.distributed call, in spins_forever_on_rank_one",
        ),
        (
            ping_pong_forever,  # (each rank's line: below)
            [],
            "Not a deadlock: ",
        ),
    ],
)
def test_deadlocks_and_loops_become_a_report_within_the_timeout(fn, lines, diagnosis):
    start = time.perf_counter()
    with pytest.raises(dl.LaunchTimeout) as err:
        dl.launch(fn, 2, timeout=2)
    elapsed = time.perf_counter() - start
    assert 2 <= elapsed < 30, "the report comes at the timeout (2 s), not at some later moment"
    text = str(err.value)
    for line in lines:
        assert line in text, text
    assert diagnosis in text
    assert set(err.value.blocked) == {0, 1}
    if fn is ping_pong_forever:  # the loop, with the student's line, not a guess from the calls it was in
        # each rank still communicating, or (on a loaded host, where the other made no call in the last window)
        # caught in the send or receive the looping rank's next call answers; at least one rank is still calling
        for rank, peer in ((0, 1), (1, 0)):
            assert re.search(
                rf"rank {rank}: (running Python code, still communicating|(send\(dst|recv\(src)={peer}, 16 B\))", text
            ), text
        assert re.search(r"Not a deadlock: (ranks 0 and 1|rank [01]) kept making torch.distributed calls", text), text
        assert re.search(r"in ping_pong_forever \(line \d+\): an endless loop\?", text), text
        assert "deadlock (" not in text and "Every rank is" not in text, text


def _blocked(op: str, peer: int) -> Blocked:
    return Blocked(op, peer, 0, f"{op}({'dst' if op == 'send' else 'src'}={peer}, 16 B)", 0.0)


def test_a_loop_still_making_calls_is_not_read_as_the_call_it_was_in():
    from disttrain_lab.reports import diagnose

    both_send = {0: _blocked("send", 1), 1: _blocked("send", 0)}
    assert diagnose(both_send).startswith("Every rank is sending and no rank is receiving: a deadlock")
    stacks = {0: [("train", 3), ("exchange", 9)], 1: [("train", 3), ("exchange", 9)]}
    looping = diagnose(both_send, {0: 812, 1: 790}, stacks, 0.25)
    assert looping.startswith(
        "Not a deadlock: ranks 0 and 1 kept making torch.distributed calls until the deadline (rank 0: 812 in "
        "the last 0.25 s), in exchange (line 9): an endless loop?"
    ), looping
    # one rank loops in Python while the other waits for it: the loop is the cause, named with its line
    one = diagnose({0: None, 1: _blocked("recv", 0)}, {0: 0, 1: 0}, {0: [("spin", 4)]}, 0.25)
    assert one.startswith("Rank 0 kept running Python code outside any torch.distributed call, in spin (line 4)")
    assert "(Rank 1 waited for it meanwhile.)" in one, one


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_jupyter_shows_a_launch_error_ending_at_the_students_line():
    # IPython renders the error as a notebook does; the launcher's frames (_collect, _rank_died) must not show
    script = textwrap.dedent("""
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance(colors="NoColor")
        shell.run_cell("import os, disttrain_lab as dl\\n"
                       "def boom():\\n"
                       "    import torch.distributed as dist\\n"
                       "    if dist.get_rank() == 1:\\n"
                       "        raise ValueError('student bug')\\n")
        print("=== RankError")
        shell.run_cell("dl.launch(boom, 2)")
        print("=== RankDied")
        shell.run_cell("dl.launch(lambda: os._exit(3), 2)")
    """)
    out = run_python(["-c", script], timeout=240).stdout
    for kind, students_line, message in [
        ("RankError", "dl.launch(boom, 2)", "rank 1 raised ValueError: student bug"),
        ("RankDied", "dl.launch(lambda: os._exit(3), 2)", "exited with code 3"),
    ]:
        shown = out.split(f"=== {kind}")[1].split("===")[0]
        assert message in shown, out
        assert "launcher.py" not in shown and "_collect" not in shown and "skipping hidden" not in shown, shown
        assert "During handling of the above exception" not in shown, shown
        arrows = [line for line in shown.splitlines() if line.startswith("---->")]
        assert arrows and arrows[-1].endswith(students_line), shown


def test_rank_calling_os_exit_is_reported():
    def exits():
        if dist.get_rank() == 1:
            os._exit(3)
        time.sleep(100)

    with pytest.raises(dl.RankDied) as err:
        dl.launch(exits, 2, timeout=30)
    assert err.value.rank == 1 and err.value.exitcode == 3
    assert "exited with code 3" in str(err.value)


def _aborts():
    if dist.get_rank() == 0:
        os.abort()
    dist.barrier()


def test_rank_calling_abort_is_reported():
    with pytest.raises(dl.RankDied, match="SIGABRT") as err:
        dl.launch(_aborts, 2, timeout=30)
    # the rank's crash report (faulthandler's) goes to the launcher, which names the line
    lines, first = inspect.getsourcelines(_aborts)
    line = first + next(i for i, text in enumerate(lines) if "os.abort()" in text)
    assert f"abort() was called (os.abort, or a C++ assertion), in _aborts (line {line})" in str(err.value)


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_a_rank_that_aborts_prints_nothing_to_the_test_runners_terminal():
    # pytest's faulthandler writes to its own copy of the terminal, which a forked rank inherits
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            f"{__file__}::test_rank_calling_abort_is_reported",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert "1 passed" in out.stdout, out.stdout + out.stderr
    assert "Fatal Python error" not in out.stdout + out.stderr


def test_sys_exit_in_a_rank_is_an_error_not_a_silent_death():
    def exits():
        sys.exit(2)

    with pytest.raises(dl.RankError, match=r"sys.exit\(2\)"):
        dl.launch(exits, 2)


# a function of a notebook (of __main__: cloudpickle sends it by value, with the globals it uses)
_NOTEBOOK = {"__name__": "__main__", "threading": threading, "dist": dist}
exec(
    textwrap.dedent("""
        lock = threading.Lock()
        def uses_the_lock():
            with lock:
                return dist.get_rank()
    """),
    _NOTEBOOK,
)


def test_an_unpicklable_argument_or_global_is_named_with_the_rule():
    start = time.perf_counter()
    with pytest.raises(TypeError) as err:
        dl.launch(add, 2, 1, y={"lock": threading.Lock()})
    text = str(err.value)
    assert "dl.launch cannot send the argument y= (dict) to the ranks" in text, text
    assert "cannot pickle '_thread.lock'" in text and "by pickling them" in text and "inside the function" in text
    with pytest.raises(TypeError) as err:
        dl.launch(_NOTEBOOK["uses_the_lock"], 2)
    assert "cannot send the variable lock (lock) that uses_the_lock uses" in str(err.value), str(err.value)
    assert time.perf_counter() - start < 10  # refused before any rank starts
    assert dl.launch(add, 2, 1, y=2) == [3, 4]


def test_unpicklable_return_value_is_explained():
    with pytest.raises(dl.RankError, match="cannot be sent back"):
        dl.launch(lambda: (x for x in range(3)), 2)


def test_no_process_or_temp_file_left_after_failures(tmp_path, monkeypatch):
    # a private TMPDIR, inherited by the ranks of a fresh pool: what is in it afterwards, a launch left
    dl.shutdown()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    before_tmp = tmp_listing(str(tmp_path))
    # every rank these launches start (this process may also hold orphans of an earlier test's grading run,
    # re-parented here: grading makes the test process a child subreaper; they are not these launches' ranks)
    started: list[ranks.Rank] = []
    real_start = ranks.start
    monkeypatch.setattr(ranks, "start", lambda *a, **k: started.append(real_start(*a, **k)) or started[-1])
    for fn in (both_receive_first, spins_forever_on_rank_one):
        with pytest.raises(dl.LaunchTimeout):
            dl.launch(fn, 2, timeout=1)
    with pytest.raises(dl.RankError):
        dl.launch(raises_on_rank_one, 2)
    assert len(started) == 6, "each failed launch ran on a pool of its own"
    left = [r.pid for r in started if os.path.exists(f"/proc/{r.pid}")]
    assert left == [], f"ranks of a failed launch must be gone (and reaped): {left} of {[r.pid for r in started]}"
    dl.launch(rank_times_ten, 3)
    dl.shutdown()
    left = [r.pid for r in started if os.path.exists(f"/proc/{r.pid}")]
    assert len(started) == 9 and left == [], f"the last pool's ranks must be gone after shutdown: {left}"
    assert tmp_listing(str(tmp_path)) - before_tmp == set(), "a launch left files in TMPDIR or /dev/shm"


def test_recovers_after_a_failure():
    with pytest.raises(dl.LaunchTimeout):
        dl.launch(both_receive_first, 2, timeout=1)
    assert dl.launch(rank_times_ten, 4) == [0, 10, 20, 30]


# --- tampering -------------------------------------------------------------------------


def test_replaced_all_reduce_in_the_notebook_is_refused(monkeypatch):
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: None)
    with pytest.raises(dl.TamperingError, match="torch.distributed.all_reduce was replaced"):
        dl.launch(rank_times_ten, 2)


def test_replacing_all_reduce_inside_a_rank_is_caught():
    def cheat():
        import torch.distributed

        torch.distributed.all_reduce = lambda tensor, *a, **k: None
        return 1

    with pytest.raises(dl.TamperingError, match="all_reduce"):
        dl.launch(cheat, 2)


# --- separate processes: interrupt, concurrency, torchrun ---------------------------------


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_interrupt_stops_all_ranks():
    script = textwrap.dedent("""
        import disttrain_lab as dl, os, time, sys
        def sleeper():
            print("pid", os.getpid(), flush=True)
            time.sleep(1000)
        try:
            dl.launch(sleeper, 3, timeout=600)
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
            sys.exit(0)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = []
    while len(pids) < 3:
        line = proc.stdout.readline()
        assert line, "the script ended before its ranks started"
        if "pid" in line:
            pids.append(int(line.split()[-1]))
    proc.send_signal(signal.SIGINT)  # what Jupyter's "interrupt kernel" does
    out, _ = proc.communicate(timeout=30)
    assert "INTERRUPTED" in out
    left = survivors(pids)
    assert left == [], f"ranks {left} survived the interrupt"


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_ranks_die_with_a_killed_kernel():
    script = textwrap.dedent("""
        import disttrain_lab as dl, os, time
        def sleeper():
            print("pid", os.getpid(), flush=True)
            time.sleep(1000)
        dl.launch(sleeper, 2, timeout=600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(proc.stdout.readline().split()[-1]) for _ in range(2)]
    proc.kill()  # SIGKILL: no Python cleanup runs in the parent
    proc.wait()
    assert survivors(pids) == [], "orphaned ranks"


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_eight_users_launching_at_once_on_one_host():
    script = textwrap.dedent("""
        import disttrain_lab as dl, torch, torch.distributed as dist, sys
        def work():
            t = torch.ones(1000) * dist.get_rank()
            dist.all_reduce(t)
            return float(t[0])
        for _ in range(3):
            assert dl.launch(work, 2, timeout=120) == [1.0, 1.0]
        print("OK")
    """)
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(8)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    failed = [o for p, o in zip(procs, outs) if p.returncode != 0 or "OK" not in o]
    assert not failed, failed[0][-2000:]


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_under_torchrun_runs_in_process_and_returns_all_ranks(tmp_path):
    script = tmp_path / "lab_as_script.py"
    script.write_text(
        textwrap.dedent("""
        import os, disttrain_lab as dl, torch.distributed as dist, torch
        def step(k):
            t = torch.ones(2) * (dist.get_rank() + 1)
            dist.all_reduce(t)
            return (os.getpid(), float(t[0]) * k)
        out = dl.launch(step, 2, 10)
        run = dl.launch(step, 2, 1, trace=True)
        assert run.calls()["all_reduce"] == 2, run.calls()
        assert dl.launch(lambda v: v, 2, dl.launcher.PerRank(["a", "b"])) == ["a", "b"]  # each rank its own
        line = f"<RANK {os.environ['RANK']} OUT {[v for _, v in out]} SAME_PROCESS {out[int(os.environ['RANK'])][0] == os.getpid()}>"
        os.write(1, line.encode())  # one write: the two ranks share torchrun's stdout
    """)
    )
    proc = run_torchrun(script)
    assert proc.returncode == 0, proc.stdout[-3000:]
    reports = re.findall(r"<RANK (\d) OUT \[30.0, 30.0\] SAME_PROCESS True>", proc.stdout)
    assert sorted(reports) == ["0", "1"], proc.stdout[-3000:]


def test_torchrun_world_size_mismatch_is_explained(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="WORLD_SIZE=8"):
        dl.launch(rank_times_ten, 2)


def test_doctor_reports_backend_and_verdict():
    text = dl.doctor()
    for field in (
        "python",
        "torch",
        "CPU cores",
        "GPUs",
        "launcher",
        "gloo",
        "fork",
        "CUDA used in this process already: no",
    ):
        assert field in text
    assert text.splitlines()[-1].startswith("READY")


def test_tensor_operator_or_run_method_replaced_is_tampering(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "__ne__", lambda a, b: torch.zeros(1, dtype=torch.bool))
    with pytest.raises(dl.TamperingError, match=r"torch.Tensor.__ne__"):
        dl.launch(rank_times_ten, 2)
    monkeypatch.undo()
    monkeypatch.setattr(dl.Run, "rounds", lambda self: 1)
    with pytest.raises(dl.TamperingError, match=r"Run.rounds"):
        dl.launch(rank_times_ten, 2)


def test_an_idle_worker_that_died_is_replaced():
    pids = dl.launch(os.getpid, 2)
    os.kill(pids[1], signal.SIGKILL)
    # a worker still dying when the next launch checks the pool passes for live, then dies
    # holding its job: wait for the death this test is about
    assert survivors(pids[1:]) == []
    assert dl.launch(rank_times_ten, 2) == [0, 10]


def test_launch_from_a_thread_then_from_the_main_thread():
    pool.shutdown()  # so the thread forks the ranks
    out = []
    worker = threading.Thread(target=lambda: out.append((dl.launch(rank_times_ten, 2), pool.worker_pids())))
    worker.start()
    worker.join()
    assert out[0][0] == [0, 10]
    # the forking thread is gone: its ranks got the parent-death signal
    assert survivors(out[0][1]) == []
    assert dl.launch(rank_times_ten, 2) == [0, 10]


def test_init_process_group_in_the_function_gets_a_hint():
    def torchrun_habit():
        dist.init_process_group("gloo")

    with pytest.raises(dl.RankError, match="remove the dist.init_process_group call"):
        dl.launch(torchrun_habit, 2)


def test_os_exit_zero_is_explained():
    with pytest.raises(dl.RankDied, match=r"os._exit\(0\)"):
        dl.launch(lambda: os._exit(0), 2)


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_a_deadlock_under_torchrun_ends_with_a_message(tmp_path):
    script = tmp_path / "deadlock.py"
    script.write_text(
        textwrap.dedent("""
        import disttrain_lab as dl, torch, torch.distributed as dist
        def both_receive_first():
            t = torch.zeros(4)
            dist.recv(t, src=1 - dist.get_rank())
        dl.launch(both_receive_first, 2, timeout=3)
    """)
    )
    start = time.perf_counter()
    proc = run_torchrun(script)
    assert proc.returncode != 0 and time.perf_counter() - start < 60
    assert "not finished within the timeout of 3 s" in proc.stdout and "recv(src=" in proc.stdout, proc.stdout[-3000:]


# --- one device policy: gloo on the CPU unless a launch asks for device="cuda" ---------


def _pretend_gpus(monkeypatch, n):
    monkeypatch.setattr(devices, "_gpu_count", lambda: n)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)


def test_cpu_is_the_default_however_many_gpus(monkeypatch):
    _pretend_gpus(monkeypatch, 8)
    monkeypatch.setenv("DISTTRAIN_LAB_BACKEND", "nccl")  # the old override is not read any more
    for world_size in (1, 2, 3, 8, 9):
        chosen = dl.plan(world_size)
        assert (chosen.device, chosen.backend, chosen.start_method, chosen.group_backend) == (
            "cpu",
            "gloo",
            "fork",
            "gloo",
        ), world_size


def test_cuda_plan_is_nccl_in_fresh_interpreters(monkeypatch):
    _pretend_gpus(monkeypatch, 4)
    chosen = dl.plan(2, device="cuda")
    assert (chosen.device, chosen.backend, chosen.start_method, chosen.group_backend) == (
        "cuda",
        "nccl",
        "spawn",
        "cpu:gloo,cuda:nccl",
    )
    assert dl.plan(4, device=torch.device("cuda")).backend == "nccl"


def test_more_ranks_than_visible_gpus_names_both_numbers(monkeypatch):
    _pretend_gpus(monkeypatch, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    with pytest.raises(ValueError) as err:
        dl.launch(rank_times_ten, 3, device="cuda")
    text = str(err.value)
    assert "3 ranks need 3 GPUs" in text and "2 GPU(s) are visible" in text and "CUDA_VISIBLE_DEVICES=5,7" in text
    assert "world_size <= 2" in text and "device='cpu'" in text


def test_torchrun_checks_only_this_nodes_ranks_against_its_gpus(monkeypatch):
    _pretend_gpus(monkeypatch, 2)
    assert dl.plan(16, device="cuda", local_world_size=2).backend == "nccl"
    with pytest.raises(ValueError, match="3 ranks need 3 GPUs"):
        dl.plan(16, device="cuda", local_world_size=3)


@pytest.mark.skipif(gpu_count() > 0, reason="checks the message on a machine without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError) as err:
        dl.launch(rank_times_ten, 1, device="cuda")
    assert "device='cuda' needs a GPU, but this process sees none" in str(err.value)
    assert "Use device='cpu'" in str(err.value)


def test_cpu_ranks_never_initialise_cuda():
    def cuda_state():
        return torch.cuda.is_initialized(), str(dl.device()), os.environ.get("DISTTRAIN_LAB_RANK_DEVICE")

    assert dl.launch(cuda_state, 2) == [(False, "cpu", "cpu")] * 2
    assert not torch.cuda.is_initialized()
    assert str(dl.device()) == "cpu", "outside a rank: the CPU"


def _cpu_backward(n):
    x = torch.arange(float(n), requires_grad=True)
    (x * (dist.get_rank() + 1)).pow(2).sum().backward()
    return x.grad.tolist()


@pytest.mark.slow  # (fresh interpreters for the ranks: 16 s here)
def test_cpu_ranks_are_fresh_interpreters_once_this_process_used_cuda(monkeypatch):
    # A rank forked from a process that ran a backward on a GPU fails at its own first backward ("Unable to handle
    # autograd's threading in combination with fork-based multiprocessing": seen on an H200, lab 9's notebook with
    # DEVICE = "cuda"); test_cpu_launch_after_a_cuda_backward_here is that case on a GPU
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    chosen = dl.plan(2)
    assert (chosen.device, chosen.backend, chosen.start_method) == ("cpu", "gloo", "spawn")
    assert "this process has used CUDA" in chosen.reason, chosen.reason
    assert dl.launch(_cpu_backward, 2, 3) == [[0.0, 2.0, 4.0], [0.0, 8.0, 16.0]]
    with pytest.raises(RuntimeError, match="a graded run's ranks confine themselves as they are forked"):
        pool.prepare(2, chosen, confined=True)  # (fails closed: never unconfined ranks for a graded run)
    monkeypatch.undo()
    assert dl.plan(2).start_method == "fork"


CPU_LAUNCH_AFTER_A_CUDA_BACKWARD = """
import torch, torch.distributed as dist
import disttrain_lab as dl

def cpu_backward(n):
    x = torch.arange(float(n), requires_grad=True)
    (x * (dist.get_rank() + 1)).pow(2).sum().backward()
    return x.grad.tolist()

x = torch.ones(3, device="cuda", requires_grad=True)
(2 * x).sum().backward()  # autograd's GPU threads start in this process
assert x.grad.tolist() == [2.0] * 3
print(dl.plan(2).start_method, dl.launch(cpu_backward, 2, 3))
"""


@needs_gpus(1)
def test_cpu_launch_after_a_cuda_backward_here():
    # a process of its own, as a notebook's kernel: this one must not use CUDA (test_cuda_launch_uses_nccl_...)
    out = run_python(["-c", CPU_LAUNCH_AFTER_A_CUDA_BACKWARD], timeout=120, cwd=REPO)
    assert out.returncode == 0 and "spawn [[0.0, 2.0, 4.0], [0.0, 8.0, 16.0]]" in out.stdout, out.stdout


def test_backend_is_a_deprecated_spelling_of_device():
    with pytest.warns(DeprecationWarning, match="use device='cpu'"):
        assert dl.launch(rank_times_ten, 2, backend="gloo") == [0, 10]


@needs_gpus(1)
def test_cuda_launch_uses_nccl_on_the_ranks_own_gpu():
    # defined here so that it travels by value to the fresh interpreters
    def _on_the_gpu(n):
        x = torch.full((n,), float(dist.get_rank() + 1), device=dl.device())
        dist.all_reduce(x)  # NCCL: a CUDA tensor
        y = torch.ones(2)
        dist.all_reduce(y)  # gloo: a CPU tensor, in the same group
        return (
            str(x.device),
            torch.cuda.current_device(),
            x.cpu().tolist(),
            y.tolist(),
            os.environ.get("CUDA_VISIBLE_DEVICES"),
        )

    world = gpu_count()
    run = dl.launch(_on_the_gpu, world, 3, device="cuda", trace=True, timeout=120)
    total = float(world * (world + 1) // 2)
    assert run.backend == "nccl"
    for k, (where, current, x, y, visible) in enumerate(run.results):
        assert (where, current, x, y) == (f"cuda:{k}", k, [total] * 3, [float(world)] * 2)
        assert visible == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert not torch.cuda.is_initialized(), "the notebook's own process opened no CUDA context"
    with pytest.raises(ValueError, match=f"{world + 1} ranks need {world + 1} GPUs, but {world} GPU"):
        dl.launch(_on_the_gpu, world + 1, 3, device="cuda")
    assert dl.launch(lambda: torch.cuda.is_initialized(), 2) == [False, False], "then back on the CPU"


def test_a_stub_that_is_not_written_yet_says_so():
    def ping_pong(x):
        # YOUR CODE HERE
        raise NotImplementedError()

    with pytest.raises(dl.RankError) as err:
        dl.launch(ping_pong, 2, 1)
    assert "ping_pong is not written yet" in str(err.value)
    assert "replace `raise NotImplementedError()` with your code" in str(err.value)


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_a_class_rebased_or_redefined_in_the_kernel_is_what_warm_ranks_run():
    # A notebook class travels by value; cloudpickle keeps a class it has rebuilt and, when the same class
    # arrives again, only sets the attributes it was sent: a warm rank kept the bases of its first launch
    # (labs 3-4 grade a later exercise by swapping a class's bases) and attributes deleted since.  Each
    # launch must run the kernel's class as it is now: bases, methods, class attributes; in a warm pool,
    # and in one forked after the kernel had already sent the class (the fork inherits its table).
    script = textwrap.dedent("""
        import json
        import disttrain_lab as dl
        from disttrain_lab import pool

        class A1:
            def who(self):
                return "A1"

        class A2:
            def who(self):
                return "A2"

        class B(A1):
            tag = "first"
            extra = 1

            def name(self):
                return "B v1"

        def probe():
            b = B()
            return [c.__name__ for c in B.__mro__], b.who(), B.tag, b.name(), hasattr(B, "extra")

        seen = {"first": dl.launch(probe, 2)}
        pids = pool.worker_pids()
        B.__bases__ = (A2,)                     # rebased in the kernel, as labs 3 and 4 do
        B.tag = "second"
        del B.extra
        seen["rebased"] = dl.launch(probe, 2)
        seen["same pool"] = pool.worker_pids() == pids

        class B(A2):                            # redefined, as a student editing the cell
            tag = "third"

            def name(self):
                return "B v2"

        seen["redefined"] = dl.launch(probe, 2)
        seen["fork after"] = dl.launch(probe, 3)  # a larger pool: forked after the kernel sent B
        B.__bases__ = (A1,)
        seen["rebased again"] = dl.launch(probe, 3)
        print("SEEN", json.dumps(seen))
    """)
    out = run_python(["-c", script], timeout=240).stdout
    assert "SEEN " in out, out
    seen = json.loads(out.split("SEEN ", 1)[1])
    assert seen["first"] == [[["B", "A1", "object"], "A1", "first", "B v1", True]] * 2, seen
    assert seen["same pool"], "the second launch should have used the warm ranks"
    assert seen["rebased"] == [[["B", "A2", "object"], "A2", "second", "B v1", False]] * 2, seen
    assert seen["redefined"] == [[["B", "A2", "object"], "A2", "third", "B v2", False]] * 2, seen
    assert seen["fork after"] == [[["B", "A2", "object"], "A2", "third", "B v2", False]] * 3, seen
    assert seen["rebased again"] == [[["B", "A1", "object"], "A1", "third", "B v2", False]] * 3, seen
