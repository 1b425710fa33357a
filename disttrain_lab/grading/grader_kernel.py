"""The grader kernel: a second kernel that holds no student code, where the graded test cells
of a lab whose tests run the student's code through ``dl.exercise.run`` are run (a test cell
of the release, its source exactly the release's).  It starts in a fresh folder with the
grader's own interpreter and kit and the lab's ``data/``, runs the lab's locked cells and the
exercise runner (``remote.py``), and reaches the student's kernel only through that runner.

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

from . import cell_times, remote
from .cells import clamp_partial_credit, error_output, grade_id, is_instructor_cell, is_test_cell, student_functions
from .config import source_dir

# a test cell that runs the student's code through dl.exercise.run is graded in the grader kernel
_RUNS_EXERCISES = re.compile(r"\bexercise\.run\(")
KERNEL_EXCHANGE = "/tmp/.kernel/ipc"  # the sandboxed kernel's view of its socket folder (run_sandbox.py)


def release_tests(lab: str | None) -> tuple[dict[str, str], bool]:
    """grade_id -> source of every test cell of the lab's release source (hidden tests in),
    and whether the lab's tests reach student code through ``dl.exercise.run`` (a test cell
    or a locked cell of the instructor calls it): then they run in the grader kernel."""
    found: dict[str, str] = {}
    uses_exercises = False
    if not lab:
        return found, uses_exercises
    for path in sorted((source_dir() / lab).glob("*.ipynb")):
        try:
            nb = nbformat.read(path, as_version=4)
        except Exception:  # noqa: BLE001  (not a notebook: nothing to trust)
            continue
        for cell in nb.cells:
            if cell.cell_type != "code" or not (is_test_cell(cell) or is_instructor_cell(cell)):
                continue
            uses_exercises = uses_exercises or bool(_RUNS_EXERCISES.search(cell.source))
            if is_test_cell(cell):
                found[grade_id(cell)] = cell.source
    return found, uses_exercises


def lab_runs_on_grader(lab: str) -> bool:
    """Whether ``lab``'s graded tests run in the grader kernel (see ``GraderKernel._on_grader``)."""
    return release_tests(lab)[1]


class GraderKernel:
    """The grader-kernel methods of ``RobustExecute`` (see the module docstring)."""

    def _on_grader(self, cell) -> bool:
        """A test cell of the release (its source exactly the release's) of a lab whose tests
        run the student's code through ``dl.exercise.run`` (in a test cell or a locked helper
        cell): graded in the grader kernel."""
        if not is_test_cell(cell) or not self._uses_exercises:
            return False
        return self._release_tests.get(grade_id(cell)) == cell.source

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
        remote.write_settings(
            Path(self._grader_dir) / "student-kernel.json",
            connection_file=self.km.connection_file,
            kernel_pid=getattr(getattr(self.km, "provisioner", None), "pid", None),
            host_dir=host_dir,
            kernel_dir=kernel_dir,
        )

    def _start_grader(self, nb) -> None:
        """The grader kernel: the grader's own interpreter and kit, a fresh folder holding only
        the lab's ``data/`` from its source (no submission on its path); the lab's locked cells
        (restored from the gradebook) and the exercise runner are queued in it at once, so it
        gets ready while the student's cells run (a test cell's request queues behind them)."""

        async def start():
            km = AsyncKernelManager(kernel_name=self.kernel_name or "python3")
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
        settings = str(Path(self._grader_dir) / "student-kernel.json")
        queued = [c.source for c in nb.cells if c.cell_type == "code" and is_instructor_cell(c)]
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

    def _run_on_grader(self, cell, index: int):
        """Run a test cell in the grader kernel; the student's kernel only serves the runs
        the test asks for.  A student kernel left busy or dead is restarted afterwards."""
        if self._grader is None:  # (it ended: a test before this one ran past its limit)
            self._start_grader(self.nb)
        key = cell_times.cell_key(cell)
        remaining = self._deadline - time.monotonic()
        limit = int(max(1, min(self._cell_limits.get(key) or self.timeout or remaining, remaining)))
        student, cell_timeout, on_timeout = (self.km, self.kc), self.timeout, self.error_on_timeout
        self.km, self.kc = self._grader
        self.timeout = limit
        # the grader kernel's runs end within this limit, each with the launcher's own report of a hang
        remote.write_cell(Path(self._grader_dir), grade_id(cell), time.monotonic() + limit, student_functions(self.nb))
        self.error_on_timeout = {  # past its limit the grader kernel is interrupted, the test fails
            "ename": "CellTimeoutError",
            "evalue": "",
            "traceback": [
                f"\x1b[0;31mCellTimeoutError\x1b[0m: this test ran longer than the {limit} s allowed when "
                "grading (a function of yours that does not finish?) and was stopped"
            ],
        }
        self._last_status = None
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
                error_output("GradingError", f"the test did not pass (the kernel answered {self._last_status!r})")
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
