"""Under autograding only (hangs.py): a hang ends with the launcher's report inside the cell's limit,
and a student's function that hung is not waited for again by later launches and cells."""

from __future__ import annotations

import re
import textwrap

import pytest

from tests.helpers import run_python


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_under_grading_a_function_that_hung_is_not_waited_for_again(tmp_path):
    # Under autograding (NBGRADER_EXECUTION=autograde): a launch the cell's limit interrupts says where each rank
    # was; a function that ran past a launch's own timeout (the lab's word that it hangs) is not waited for again:
    # later launches that call it, still defined as it was (directly, from another function, from a test's
    # driver), stop at once, saying what happened then, instead of each waiting its own limit; redefined, it runs.
    script = textwrap.dedent("""
        import signal, tempfile, threading, time, os
        import disttrain_lab as dl
        import torch.distributed as dist

        def spins(x):
            while True:
                pass

        STARTED = os.path.join(os.environ["SPIN_DIR"], f"spinning-{os.getpid()}")

        def calls_it():
            if dist.get_rank() == 1:
                open(STARTED, "w").close()
                return spins(1)
            return 0

        def interrupt_once_spinning():   # the grader's interrupt, once rank 1 spins (a loaded machine starts slowly)
            while not os.path.exists(STARTED):
                time.sleep(0.05)
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt_once_spinning, daemon=True).start()
        try:
            dl.launch(calls_it, 2, timeout=60)
        except KeyboardInterrupt:
            print("=== INTERRUPTED", flush=True)
        try:
            dl.launch(calls_it, 2, timeout=8)       # (an interrupt alone is no verdict: this one runs)
        except dl.LaunchTimeout:
            print("=== TIMED OUT", flush=True)
        started = time.monotonic()
        try:
            dl.launch(lambda: spins(2), 2, timeout=60)
        except dl.RankError as exc:
            print("=== AT ONCE", round(time.monotonic() - started, 1), exc.exc_type, exc.exc_message, flush=True)
        from disttrain_lab import protocol, serving
        driver = protocol.Driver("_drive", "def _drive():\\n    return spins(3)\\n")   # a test's, by its source
        started = time.monotonic()
        error = serving.run(protocol.Request(target=driver, world_size=2, inputs=[()] * 2, timeout=60.0)).failure
        print("=== DRIVER", round(time.monotonic() - started, 1), error.kind, error.message[:80], flush=True)

        def spins(x):
            return x

        print("=== REDEFINED", dl.launch(calls_it, 2, timeout=60), flush=True)
    """)
    out = run_python(
        ["-c", script], timeout=240, env={"NBGRADER_EXECUTION": "autograde", "SPIN_DIR": str(tmp_path)}
    ).stdout
    interrupted = out.split("=== INTERRUPTED")[0]
    assert "interrupted: stopped all 2 ranks" in interrupted, out
    # (the loop's two lines, `while True:` and `pass`: the stack is sampled on either)
    assert "rank 1: running Python code" in interrupted and re.search(
        r"calls_it \(line 15\) → spins \(line [78]\)", interrupted
    ), out
    assert "=== TIMED OUT" in out, out
    seconds, kind, message = out.split("=== AT ONCE ")[1].split("=== DRIVER")[0].split(" ", 2)
    assert float(seconds) < 10 and kind == "SkippedAfterHang", out
    assert "spins is not run again: when an earlier cell ran it under grading, it did not finish within" in message
    assert "rank 1: running Python code" in message and re.search(r"spins \(line [78]\)", message), message
    seconds, kind, message = out.split("=== DRIVER ")[1].split("\n")[0].split(" ", 2)
    assert float(seconds) < 10 and kind == "ExerciseTimeout", message
    assert message.startswith("_drive was stopped at once: spins is not run again"), message
    assert "=== REDEFINED [0, 1]" in out, out


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_under_grading_a_function_a_cells_limit_interrupted_is_not_waited_for_again(tmp_path):
    # A self-check that calls the student's function in the kernel itself (no launch, so no launch timeout):
    # the grader interrupts the cell at its limit, then asks the kernel which notebook function the interrupt
    # stopped (hangs.remember_interrupted, from IPython's sys.last_traceback); later launches stop at once.
    script = textwrap.dedent("""
        import signal, sys, tempfile, threading, time, os
        import disttrain_lab as dl
        import torch.distributed as dist

        def spins(x):
            while True:
                pass

        def _lab_helper(fn):        # only a student's function (one of the names given) is blamed
            return fn(1)

        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            _lab_helper(spins)
        except KeyboardInterrupt:   # (what IPython keeps of a cell's error)
            sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
        blamed = dl.hangs.remember_interrupted("the cell In[7]", 30, ["spins", "unrelated"])
        print("=== BLAMED", blamed, flush=True)
        try:
            if blamed:
                spins(3)            # called in the kernel itself, it stops too
        except dl.hangs.SkippedAfterHang as exc:
            print("=== HERE AT ONCE", str(exc)[:40], flush=True)
        started = time.monotonic()
        try:
            dl.launch(lambda: spins(2), 2, timeout=60 if blamed else 1)
        except dl.RankError as exc:
            print("=== AT ONCE", round(time.monotonic() - started, 1), exc.exc_type, exc.exc_message, flush=True)

        STARTED = os.path.join(os.environ["SPIN_DIR"], f"spinning-{os.getpid()}")

        def spins_too(x):
            open(STARTED, "w").close()
            while True:
                pass

        def calls_it():
            return spins_too(1) if dist.get_rank() == 1 else 0

        def interrupt_once_spinning():
            while not os.path.exists(STARTED):
                time.sleep(0.05)
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt_once_spinning, daemon=True).start()
        try:                        # the cell's limit stops a launch: the ranks' stacks say where
            dl.launch(calls_it, 2, timeout=120)
        except KeyboardInterrupt:
            sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
        blamed = dl.hangs.remember_interrupted("the cell In[8]", 30, ["calls_it", "spins_too"])
        print("=== BLAMED IN A LAUNCH", blamed, flush=True)
        if blamed:
            try:
                dl.launch(calls_it, 2, timeout=60)
            except dl.RankError as exc:
                print("=== LAUNCH AT ONCE", exc.exc_message.replace("\\n", " | "), flush=True)
    """)
    out = run_python(
        ["-c", script], timeout=120, env={"NBGRADER_EXECUTION": "autograde", "SPIN_DIR": str(tmp_path)}
    ).stdout
    assert "=== BLAMED spins" in out and "=== HERE AT ONCE spins is not run again" in out, out
    seconds, kind, message = out.split("=== AT ONCE ")[1].split(" ", 2)
    assert float(seconds) < 10 and kind == "SkippedAfterHang", out
    assert message.startswith(
        "spins is not run again: when the cell In[7] ran it under grading, it did not finish within the cell's 30 s "
        "limit"
    ), message
    assert re.search(r"interrupted it in spins \(line [67]\), still running Python code", message), message
    assert "=== BLAMED IN A LAUNCH spins_too" in out, out
    told = out.split("=== LAUNCH AT ONCE ")[1]
    assert told.startswith("spins_too is not run again: when the cell In[8] ran it under grading"), told
    assert "the cell's limit interrupted a launch; where each unfinished rank was:" in told, told
    assert re.search(r"rank 1: running Python code.*calls_it \(line \d+\) → spins_too \(line \d+\)", told), told
    # not under grading: an interrupt is only an interrupt
    out = run_python(["-c", script], timeout=120, env={"NBGRADER_EXECUTION": "", "SPIN_DIR": str(tmp_path)}).stdout
    assert "=== BLAMED None" in out, out


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_under_grading_a_launch_reports_a_hang_before_the_cells_limit():
    # The grader tells the student's kernel each cell's limit (hangs.cell_limit, a quiet run before the cell):
    # a launch in that cell that asks for more than is left of it is capped, so the hang ends with the launcher's
    # own report (which rank, doing what, in which function) and not with the cell's interrupt. The cap holds for
    # that cell only: a later cell (In[n+1]: the grader's runs during test cells among them) is not capped.
    script = textwrap.dedent("""
        import time
        import disttrain_lab as dl
        import torch.distributed as dist

        def spins(x):
            while True:
                pass

        dl.hangs.cell_limit(10)      # as the grader does before the cell
        started = time.monotonic()
        try:
            dl.launch(lambda: spins(1) if dist.get_rank() else 0, 2, timeout=120)
        except dl.LaunchTimeout as exc:
            print("=== CAPPED", round(time.monotonic() - started, 1), str(exc).replace("\\n", " | "), flush=True)
        print("=== LEFT", dl.hangs.capped(120), flush=True)
        dl.hangs._CELL = (dl.hangs._CELL[0], -1, 10)   # the same deadline, bound to another cell
        print("=== OTHER CELL", dl.hangs.capped(120), flush=True)
    """)
    out = run_python(["-c", script], timeout=120, env={"NBGRADER_EXECUTION": "autograde"}).stdout
    seconds, told = out.split("=== CAPPED ")[1].split("\n")[0].split(" ", 1)
    assert float(seconds) < 10, out  # within the cell's 10 s, less the margin for the report
    assert "not every rank finished within the timeout of" in told and "rank 1: running Python code" in told, told
    assert re.search(r"<lambda> \(line \d+\) → spins \(line [78]\)", told), told
    assert "this cell's 10 s time limit when graded; the launch asked for 120 s" in told, told
    assert "=== LEFT (1.0, " in out, out  # nothing left of the cell: a launch still gets its minimum
    assert "=== OTHER CELL (120, None)" in out, out
    # not under grading, nothing is capped
    out = run_python(["-c", script.replace("timeout=120)", "timeout=3)")], timeout=120, env={"NBGRADER_EXECUTION": ""})
    assert "=== LEFT (120, None)" in out.stdout, out.stdout
