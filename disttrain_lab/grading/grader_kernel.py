"""The grader kernel: a second kernel that holds no student code, where every graded test cell
is run, always as the lab's release has it (its source read from the lab's source notebook,
hidden tests in; never the submission's copy).  It starts in a fresh folder with the grader's
own interpreter and kit and the lab's ``data/``, runs the lab's locked cells and the exercise
runner (``remote.py``), and reaches the student's kernel only through that runner:
``dl.exercise.run`` (and ``dl.predictions.fetch``, a one-rank run of it) asks the student's
kernel to run the student's function and reads back data only.

A test cell the grader has no release copy of (no lab named, no source notebook for the lab,
or no test of that ``grade_id`` in it) fails closed: it gets an error saying why and scores 0;
it never runs, in either kernel.

``GraderKernel`` is a mixin of ``execute.RobustExecute``: it swaps the grader kernel in for
one test cell, then makes sure the student's kernel answers again (interrupted, else
restarted and replayed by the cell loop)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import nbformat
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import ensure_async, run_sync
from nbclient.exceptions import CellTimeoutError, DeadKernelError

from . import cell_times, handoff
from .cells import clamp_partial_credit, error_output, grade_id, is_instructor_cell, is_test_cell, student_functions
from .config import source_dir
from .kernels import socket_root

# how a test (or a locked helper cell) reaches the student's code from the grader kernel
_REACHES_STUDENT_CODE = re.compile(r"\b(?:exercise\.run|predictions\.fetch)\(")
KERNEL_EXCHANGE = "/tmp/.kernel/ipc"  # the sandboxed kernel's view of its socket folder (run_sandbox.py)
# seconds the grader kernel may take to start and run the lab's locked cells (its set-up is the
# grader's time: a test's limit starts once it is ready)
GRADER_READY_SECONDS = 300


def _source_cells(lab: str | None, notebook: str | None = None):
    """The code cells of the lab's source notebooks (of ``notebook`` alone where named); none
    without a lab, nor of a notebook that cannot be read."""
    if not lab:
        return
    for path in sorted((source_dir() / lab).glob("*.ipynb")):
        if notebook is not None and path.stem != notebook:
            continue
        try:
            nb = nbformat.read(path, as_version=4)
        except Exception:  # noqa: BLE001  (not a notebook: nothing to trust)
            continue
        yield from (c for c in nb.cells if c.cell_type == "code")


def release_tests(lab: str | None, notebook: str | None = None) -> dict[str, str]:
    """grade_id -> source of every test cell of the lab's release source (hidden tests in):
    what the grader kernel runs for a test cell of that grade_id."""
    return {grade_id(c): c.source for c in _source_cells(lab, notebook) if is_test_cell(c)}


def release_locked_cells(lab: str | None, notebook: str | None = None) -> list[str]:
    """The sources of the lab's locked cells of the instructor (its set-up, the tests' helpers),
    in order, as its release source has them: what the grader kernel runs before any test.  Never
    the submission's: a cell a student marked locked is still the student's."""
    return [c.source for c in _source_cells(lab, notebook) if is_instructor_cell(c)]


def tests_reach_student_code(lab: str) -> bool:
    """Whether ``lab``'s graded tests can reach the student's code at all: they run in the grader
    kernel, which holds none of it, so a test cell (or a locked cell of the instructor's that
    defines its helpers) must call ``dl.exercise.run`` or ``dl.predictions.fetch``."""
    return any(
        _REACHES_STUDENT_CODE.search(c.source) for c in _source_cells(lab) if is_test_cell(c) or is_instructor_cell(c)
    )


def runs_as_release(source: str, release: str) -> bool:
    """Whether a test cell's ``source`` runs exactly the release's code: it is the release's, or
    the release's behind whole comment lines only (nbgrader's note atop a test cell it put back)."""
    if source == release:
        return True
    prefix = source[: len(source) - len(release)]
    if not source.endswith(release) or not prefix.endswith("\n"):
        return False
    return all(not line.strip() or line.lstrip().startswith("#") for line in prefix.splitlines())


def _ungradable(lab: str | None, tests: dict[str, str], test_id: str) -> str | None:
    """Why the test cell ``test_id`` cannot be graded (said to the student), or None."""
    if not lab:
        return "the grader was not told which lab this notebook belongs to, so it has no release copy of its tests"
    if not tests:
        return f"the grader has no release copy of lab {lab}'s tests (its source notebook is not in the course)"
    if test_id not in tests:
        return f"lab {lab}'s release has no test named {test_id!r}"
    return None


class GraderKernel:
    """The grader-kernel methods of ``RobustExecute`` (see the module docstring)."""

    def _grade_test(self, cell, index: int):
        """Every test cell: run in the grader kernel with the release's source for its grade_id,
        else failed closed with an error saying why (0 points, never run anywhere)."""
        test_id = grade_id(cell)
        why = _ungradable(self._lab, self._release_tests, test_id)
        if why is not None:
            self._notes.append(f"{test_id}: not graded (scored 0): {why}")
            cell.outputs = [
                error_output(
                    "GradingError",
                    f"this test could not be graded: {why}. A test runs only as the lab's release has it, "
                    "so it scores 0; please tell your instructor",
                )
            ]
            return cell
        if not runs_as_release(cell.source, self._release_tests[test_id]):
            self._notes.append(f"{test_id}: the submission's copy differs from the release's; the release's ran")
            cell.source = self._release_tests[test_id]
        return self._run_on_grader(cell, index)

    def _tell_grader_kernel(self) -> None:
        """Where the student's (new) kernel is, for the grader kernel's exercise runner."""
        if not hasattr(self, "_grader_dir"):
            return
        if self.sandbox == "on":
            host_dir, kernel_dir = os.path.dirname(self.km.ip), KERNEL_EXCHANGE
        elif self.sandbox == "container":  # no mounts: both see the kernel's own folder (kernels.py) at one path
            host_dir = kernel_dir = os.path.dirname(self.km.ip)
        else:
            if self._exchange is None:
                self._exchange = tempfile.mkdtemp(prefix="exchange-")
            host_dir = kernel_dir = self._exchange
        handoff.write_settings(
            Path(self._grader_dir) / "student-kernel.json",
            connection_file=self.km.connection_file,
            kernel_pid=getattr(getattr(self.km, "provisioner", None), "pid", None),
            host_dir=host_dir,
            kernel_dir=kernel_dir,
        )

    def _start_grader(self) -> None:
        """The grader kernel: the grader's own interpreter and kit, a fresh folder holding only
        the lab's ``data/`` from its source (no submission on its path); the lab's locked cells,
        from its release source, and the exercise runner are queued in it at once, so it gets
        ready while the student's cells run (a test cell's request queues behind them)."""

        async def start():
            km = AsyncKernelManager(kernel_name=self.kernel_name or "python3")
            # ZMQ over unix sockets in a folder of its own (0700): no TCP port to pick, so no race
            # with the other processes of a busy host for one (a kernel whose port was taken between
            # its choice and its bind dies while starting), and nothing another uid can connect to
            sockets = tempfile.mkdtemp(prefix="grader-kernel-", dir=socket_root())
            self._kernels_made().append(("folder", sockets))
            km.transport, km.ip = "ipc", os.path.join(sockets, "g")
            folder = tempfile.mkdtemp(prefix="work-", dir=self._grader_dir)
            data = source_dir() / (self._lab or "") / "data"
            if self._lab and data.is_dir():  # the lab's own data files, as the release has them
                shutil.copytree(data, os.path.join(folder, "data"), symlinks=False)
            env = dict(os.environ, MPLBACKEND="agg")  # (no figure of a test is shown)
            await ensure_async(km.start_kernel(cwd=folder, env=env, extra_arguments=["--HistoryManager.enabled=False"]))
            kc = km.client()
            kc.start_channels()
            return km, kc

        self._grader = run_sync(start)()
        self._grader_ready = False
        settings = str(Path(self._grader_dir) / "student-kernel.json")
        queued = list(self._release_locked)
        queued.append(f"from disttrain_lab.grading import remote as _remote\n_remote.install({settings!r})\n")
        for code in queued:
            self._grader[1].execute(code, silent=True, store_history=False, allow_stdin=False, stop_on_error=False)

    def _stop_grader(self) -> None:
        if self._grader is None:
            return
        km, kc = self._grader
        self._grader = None

        async def stop():
            kc.stop_channels()
            try:
                await ensure_async(km.shutdown_kernel(now=True))
            except Exception as exc:  # already gone
                self.log.debug("stopping the grader kernel: %s", exc)

        run_sync(stop)()

    def _wait_for_grader(self) -> str | None:
        """Wait until the grader kernel has run what was queued in it (the lab's locked cells, the
        runner): its start-up is not the test's time.  None once it is ready, else why not."""
        if self._grader_ready:
            return None
        student = (self.km, self.kc)
        for attempt in range(self.startup_retries + 1):
            wait = max(1.0, min(GRADER_READY_SECONDS, self._deadline - time.monotonic()))
            self.km, self.kc = self._grader
            try:
                reply = self._run_quietly("", timeout=wait)  # answered after everything queued before it
                break
            except DeadKernelError:
                provisioner = self._grader[0].provisioner
                code = run_sync(provisioner.poll)() if provisioner is not None else None
                died = f"the grader's own kernel died while it started (the lab's locked cells; exit code {code})"
                self._notes.append(f"{died}; attempt {attempt + 1} of {self.startup_retries + 1}")
                self.log.warning("%s; attempt %d of %d", died, attempt + 1, self.startup_retries + 1)
            finally:
                self.km, self.kc = student
            if attempt == self.startup_retries:
                return died
            self._stop_grader()
            self._start_grader()
        if reply is None:
            return f"the grader's own kernel was not ready within {wait:.0f} s (it runs the lab's locked cells first)"
        self._grader_ready = True
        return None

    def _run_on_grader(self, cell, index: int):
        """Run a test cell in the grader kernel; the student's kernel only serves the runs
        the test asks for.  A student kernel left busy or dead is restarted afterwards."""
        if self._grader is None:  # (it ended: a test before this one ran past its limit)
            self._start_grader()
        key = cell_times.cell_key(cell)
        not_ready = self._wait_for_grader()
        if not_ready is not None:
            self._notes.append(f"{grade_id(cell)}: not graded (scored 0): {not_ready}")
            cell.outputs = [error_output("GradingError", f"this test could not be run: {not_ready}; it scores 0")]
            self._stop_grader()  # (the next test starts a fresh one)
            return cell
        remaining = self._deadline - time.monotonic()
        limit = int(max(1, min(self._cell_limits.get(key) or self._plain_limit or remaining, remaining)))
        student, cell_timeout, on_timeout = (self.km, self.kc), self.timeout, self.error_on_timeout
        self.km, self.kc = self._grader
        self.timeout = limit
        # the grader kernel's runs end within this limit, each with the launcher's own report of a hang
        handoff.write_cell(Path(self._grader_dir), grade_id(cell), time.monotonic() + limit, student_functions(self.nb))
        self.error_on_timeout = {  # past its limit the grader kernel is interrupted, the test fails
            "ename": "CellTimeoutError",
            "evalue": "",
            "traceback": [
                f"\x1b[0;31mCellTimeoutError\x1b[0m: this test ran longer than the {limit} s allowed when "
                "grading (a function of yours that does not finish?) and was stopped"
            ],
        }
        self._last_status = None
        self._output_bytes, self._output_capped = 0, False  # (the cap is per cell: this test's own output)
        started = time.monotonic()
        try:
            cell = self.execute_cell(cell, index, execution_count=self._prompts[index], store_history=False)
        except (DeadKernelError, CellTimeoutError) as exc:
            cell.outputs.append(
                error_output(
                    type(exc).__name__, f"the test did not finish within {limit} s when graded; this exercise gets 0"
                )
            )
            self.km, self.kc = student
            self._stop_grader()
        finally:
            self.km, self.kc = student
            self.timeout, self.error_on_timeout = cell_timeout, on_timeout
            self._cell_seconds[key] = round(time.monotonic() - started, 3)
        if self._last_status != "ok" and not any(o.output_type == "error" for o in cell.outputs):
            cell.outputs.append(
                error_output(
                    "GradingError",
                    f"the test did not pass (the grader kernel answered {self._last_status!r})"
                    if self._last_status is not None  # None: no execute reply (a skipped cell)
                    else "the grader kernel never ran this test (no reply came), so it cannot have passed",
                )
            )
        if any(o.output_type == "error" and o.ename == "CellTimeoutError" for o in cell.outputs):
            # the interrupt's traceback is the grader's own code: the limit is what the student needs
            cell.outputs = [
                o for o in cell.outputs if not (o.output_type == "error" and o.ename == "KeyboardInterrupt")
            ]
        clamp_partial_credit(cell)
        if not self._kernel_answers(timeout=2):  # busy with a run the test gave up on, or dead
            try:
                run_sync(self.km.interrupt_kernel)()
            except Exception as exc:  # noqa: BLE001  (gone: restarted below)
                self.log.debug("interrupting the student's kernel: %s", exc)
            if not self._kernel_answers():
                self._restart_and_replay()
        return cell
