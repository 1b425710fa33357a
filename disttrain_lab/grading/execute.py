"""Executing a submission: ``RobustExecute``, nbgrader's ``Execute`` made to survive whatever a
student's notebook does (dead kernels, ignored interrupts, floods of output), in a sandboxed
kernel where the host allows it.

This module is the cell loop: each cell's time limit, what the grader writes into a cell that
failed, restarting and replaying after a dead or stuck kernel, and the output cap.  There is one
way a graded test cell is run: in the grader kernel (``grader_kernel.GraderKernel``), a second
kernel that holds no student code, with the release's source for its ``grade_id``; the test
reaches the student's functions only through ``dl.exercise.run`` (and ``dl.predictions.fetch``),
which asks the student's kernel to run them and reads back data only.  A test cell the grader
has no release copy of fails closed (0 points, never run).  The student's kernel runs every
other cell; it itself (sandbox, memory limit, quiet runs) is ``kernels.StudentKernel``; what a
cell is (a test, a locked cell) is ``cells.py``."""

from __future__ import annotations

import json
import os
import tempfile
import time

from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbgrader.preprocessors import Execute
from traitlets import Float, Integer, Unicode

from . import cell_times, trees
from .cells import error_output, is_instructor_cell, is_test_cell, student_functions
from .grader_kernel import GraderKernel, release_locked_cells, release_tests
from .kernels import StudentKernel

NOTES_FILE = ".disttrain-grading.json"  # next to the autograded notebook; read by the grade report


_HANGS = "__import__('disttrain_lab.hangs', fromlist=['_'])"  # the kit's hangs module, in the student's kernel


def _remember_interrupted(cell, limit: int, student_functions: list[str]) -> str:
    """Code for the student's kernel, after ``cell`` ran past its limit: see hangs.remember_interrupted."""
    label = f"the cell In[{cell.execution_count}]" if cell.get("execution_count") else "an earlier cell"
    return f"{_HANGS}.remember_interrupted({label!r}, {limit!r}, {student_functions!r})"


def _cell_limit(limit: int) -> str:
    """Code for the student's kernel, before a cell it runs with history: see hangs.cell_limit."""
    return f"{_HANGS}.cell_limit({limit!r})"


def _prompt(count: int) -> str:
    """Code for the student's kernel, before a cell it runs with history (and before ``_cell_limit``,
    which binds the limit to that count): that cell becomes ``In[count]``, so the tracebacks and the
    kit's messages name the cell as the feedback shows it.  A kernel whose IPython the student
    broke keeps its own count (the limit still follows)."""
    return f"try:\n    __import__('IPython').get_ipython().execution_count = {count!r}\nexcept Exception:\n    pass"


def prompt_numbers(nb) -> dict[int, int]:
    """{index of each code cell that runs: its ``In[n]``}: its place among them in the notebook's
    order, as a fresh "Run All" numbers them.  Graded tests run in the grader kernel, without
    history, so no kernel's own count would give them theirs."""
    runs = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()]
    return {index: n for n, index in enumerate(runs, start=1)}


class RobustExecute(GraderKernel, StudentKernel, Execute):
    """nbgrader's Execute, made to survive any submission (see the module docstring)."""

    notebook_timeout = Integer(1500, help="wall-clock seconds for the whole notebook").tag(config=True)
    memory_limit = Integer(4 * 2**30, help="RLIMIT_DATA bytes per kernel/rank process; 0 = none").tag(config=True)
    max_output_bytes = Integer(2_000_000, help="output kept per cell; more fails the cell").tag(config=True)
    probe_timeout = Integer(10, help="seconds an interrupted kernel has to answer again").tag(config=True)
    startup_retries = Integer(2, help="times a kernel that dies while starting is started again").tag(config=True)
    sandbox = Unicode("off", help="'on': every kernel runs in disttrain_lab.grading.sandbox; 'off': as the grader").tag(
        config=True
    )
    sandbox_uid = Integer(64123, help="unprivileged uid (and gid) the sandboxed kernel runs as").tag(config=True)
    student_memory = Integer(
        8 * 2**30, help="bytes for a sandboxed kernel and all it starts, /dev/shm and /tmp included"
    ).tag(config=True)
    student_pids = Integer(512, help="processes and threads for a sandboxed kernel and all it starts").tag(config=True)
    cell_time_scale = Float(1.0, help="multiplies the per-cell limits derived from the solution's cell times").tag(
        config=True
    )

    # -- the notebook loop ---------------------------------------------------------------

    def preprocess(self, nb, resources=None, km=None):
        self._deadline = time.monotonic() + self.notebook_timeout
        self._replayable: list[int] = []  # earlier cells that rebuild the kernel's state
        self._instructor_cells: list[int] = []
        self._kernel_kwargs = {}
        self._notes: list[str] = []
        self._last_status = None
        self._output_bytes, self._output_capped = 0, False
        self._cell_seconds: dict[str, float] = {}  # this run's time per cell (recorded for the solution)
        ids = (resources or {}).get("nbgrader") or {}
        lab, notebook = ids.get("assignment"), ids.get("notebook")
        self._probe = cell_times.probe()  # (this host's speed and load now; the solution's is recorded)
        self._host_factor, host = cell_times.host_factor(lab, self._probe) if lab else (1.0, "")
        self._cell_limits = cell_times.limits_for(lab, self.cell_time_scale * self._host_factor) if lab else {}
        # a cell the record does not know: the plain limit, stretched by the host's probe the same way
        self._plain_limit = int(self.timeout * self._host_factor + 0.5) if self.timeout else None
        # the lab's own cells before the student's first (its setup: a cold kernel importing torch) get at least
        # cell_times.FLOOR, stretched: no student code has run yet, and a loaded host took 18-50 s there
        self._setup_cells = set()
        for i, c in enumerate(nb.cells):
            if c.cell_type == "code" and c.source.strip() and not is_instructor_cell(c):
                break
            self._setup_cells.add(i)
        self._host = host
        self._lab = lab
        self._prompts = prompt_numbers(nb)
        # what every test cell runs as, and what the grader kernel runs first: the lab's release source
        self._release_tests = release_tests(lab, notebook)
        self._release_locked = release_locked_cells(lab, notebook)
        self._grader = None  # (manager, client) of the grader kernel
        self._grader_ready = False
        self._grader_dir = tempfile.mkdtemp(prefix="grader-")  # hidden from the sandbox with the temp dir
        self._exchange = None
        try:
            if self._release_tests and any(is_test_cell(c) for c in nb.cells):
                self._start_grader()  # it boots, and runs the lab's locked cells, while the student's cells run
            return super().preprocess(nb, resources, km)
        finally:
            self._stop_grader()
            if self.km is not None and self.owns_km:  # (nbclient stops the kernel it ran, not one that failed to start)
                self._stop_kernel()
            self.clean_kernels()
            # the exchange (unsandboxed: the student's kernel writes there) is removed like a kernel's folder
            for folder in (self._grader_dir, self._exchange):
                left = trees.said(folder, trees.remove(folder)) if folder else ""
                if left:
                    self.log.warning(left)
            self._write_notes(resources)

    def preprocess_cell(self, cell, resources, index):
        self._check_assign_resources(resources)
        if cell.cell_type != "code" or not cell.source.strip():
            return cell, self.resources
        remaining = self._deadline - time.monotonic()
        if remaining < 1:
            cell.outputs = [
                error_output(
                    "NotebookTimeout",
                    (
                        f"not run: the whole notebook may take at most {self.notebook_timeout} s "
                        "when graded, and the cells above used it up"
                    ),
                )
            ]
            return cell, self.resources
        if is_test_cell(cell):  # the one way a test is graded: grader_kernel.py
            return self._grade_test(cell, index), self.resources
        key = cell_times.cell_key(cell)
        # the solution's own time for this cell, times a generous factor (cell_times.py), else the cell limit
        limit = self._cell_limits.get(key) or self._plain_limit or remaining
        if index in self._setup_cells:
            limit = max(limit, cell_times.FLOOR * self._host_factor)
        limit = int(max(1, min(limit, remaining)))
        cell_timeout = self.timeout
        self.timeout = limit
        self.error_on_timeout = {
            "ename": "CellTimeoutError",
            "evalue": "",
            "traceback": [
                f"\x1b[0;31mCellTimeoutError\x1b[0m: this cell ran longer than the {limit} s "
                "allowed when grading (an infinite loop, a deadlock, a long sleep?) and was stopped"
            ],
        }
        self._output_bytes, self._output_capped = 0, False
        started = time.monotonic()
        try:
            # its launches report a hang before the limit interrupts the cell
            self._run_quietly(_prompt(self._prompts[index]) + "\n" + _cell_limit(limit), timeout=10)
            cell = self.execute_cell(cell, index, execution_count=self._prompts[index], store_history=True)
        except DeadKernelError:
            cell.outputs.append(
                error_output(
                    "DeadKernelError",
                    (
                        "the kernel died while running this cell (os._exit / crash / out of memory); "
                        "it was restarted and the cells above were run again"
                    ),
                )
            )
            self._restart_and_replay()
            return cell, self.resources
        except CellTimeoutError:
            cell.outputs.append(
                error_output(
                    "CellTimeoutError",
                    (
                        f"this cell ran longer than the {limit} s allowed when grading and did not stop "
                        "when interrupted; the kernel was restarted and the cells above were run again"
                    ),
                )
            )
            self._restart_and_replay()
            return cell, self.resources
        finally:
            self.timeout = cell_timeout
            self._cell_seconds[key] = round(time.monotonic() - started, 3)
        if is_instructor_cell(cell):
            self._record_instructor_cell(index)
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if any(o.ename == "CellTimeoutError" for o in errors):
            # a student's function the interrupt stopped in this cell is not waited for again by later
            # launches (the graded tests' among them): the kernel is asked once it answers again
            if not self._kernel_answers(_remember_interrupted(cell, limit, student_functions(self.nb))):
                cell.outputs.append(
                    error_output(
                        "CellTimeoutError",
                        (
                            "the cell did not stop when interrupted; the kernel was restarted and "
                            "the cells above were run again"
                        ),
                    )
                )
                self._restart_and_replay()
        elif not errors or time.monotonic() - started < 10:
            self._replayable.append(index)
        return cell, self.resources

    # -- the student's kernel ---------------------------------------------------------------

    def _kernel_started(self) -> None:
        """A (new) student's kernel answers: tell the grader kernel where it is."""
        self._tell_grader_kernel()

    def _record_instructor_cell(self, index: int) -> None:
        """A locked cell of the instructor's ran: it is replayed after a restart, whatever it raised."""
        if index not in self._instructor_cells:
            self._instructor_cells.append(index)

    async def _check_raise_for_error(self, cell, cell_index, exec_reply):
        self._last_status = (exec_reply or {}).get("content", {}).get("status")
        return await super()._check_raise_for_error(cell, cell_index, exec_reply)

    def _write_notes(self, resources) -> None:
        """What the grader noted (a test it could not grade, a test's copy it did not run), the
        sandbox and the cells' times, for the grade report (never shown to the student)."""
        path = (resources or {}).get("metadata", {}).get("path")
        if path and os.path.isdir(path):
            with open(os.path.join(path, NOTES_FILE), "w") as f:
                json.dump(
                    {
                        "notes": self._notes,
                        "sandbox": self.sandbox,
                        "cell_seconds": self._cell_seconds,
                        "probe": self._probe,
                        "cell_limit_factor": self._host_factor,
                        "cell_limit_host": self._host,
                    },
                    f,
                    indent=1,
                )

    # -- restart and replay ----------------------------------------------------------------

    def _restart_and_replay(self) -> None:
        self._stop_kernel()
        self.km = self.create_kernel_manager()
        self.start_new_kernel()
        self.start_new_kernel_client()
        for index in sorted(set(self._replayable) | set(self._instructor_cells)):
            remaining = self._deadline - time.monotonic()
            if remaining < 1:
                return
            try:
                reply = self._run_quietly(self.nb.cells[index].source, timeout=min(self.timeout, remaining))
            except DeadKernelError:
                reply = None
            if reply is None:  # it hangs or kills the kernel now: drop it and start over
                for kept in (self._replayable, self._instructor_cells):
                    if index in kept:
                        kept.remove(index)
                self._restart_and_replay()
                return

    # -- output cap ------------------------------------------------------------------------

    # every message that puts bytes into the notebook counts against the cap: nbclient
    # applies a display update (update_display_data, or a display_data/execute_result
    # reusing a display_id) to every output showing that display without calling `output`,
    # and keeps widget state (comm messages) in the notebook's metadata
    _OUTPUT_MESSAGES = ("stream", "display_data", "execute_result", "error", "update_display_data")

    def process_message(self, msg, cell, cell_index):
        msg_type = msg.get("msg_type", "")
        if msg_type in self._OUTPUT_MESSAGES or msg_type.startswith("comm"):
            content = msg.get("content") or {}
            size = len(json.dumps(content, default=str, ensure_ascii=False))
            size += sum(len(b) for b in msg.get("buffers") or [])
            display_id = (content.get("transient") or {}).get("display_id")
            shown = sum(map(len, self._display_id_map.get(display_id, {}).values())) if display_id else 0
            self._output_bytes += size * (shown + 1)
            if self._output_bytes > self.max_output_bytes:
                if not self._output_capped:
                    self._output_capped = True
                    cell.outputs.append(
                        error_output(
                            "OutputLimitExceeded",
                            (
                                f"this cell printed more than {self.max_output_bytes // 1000} kB; the rest "
                                "of its output was dropped and the cell counts as failed"
                            ),
                        )
                    )
                return None
        return super().process_message(msg, cell, cell_index)
