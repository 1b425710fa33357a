"""Executing a submission: ``RobustExecute``, nbgrader's ``Execute`` made to survive whatever a
student's notebook does (dead kernels, ignored interrupts, hooks, replaced names), in a sandboxed
kernel where the host allows it."""

from __future__ import annotations

import ast
import atexit
import hmac
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from queue import Empty

import nbformat
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import ensure_async, run_sync
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbgrader.preprocessors import Execute
from traitlets import Float, Integer, Unicode

from . import cell_times, guard, hidden_tests, remote, sandbox, uids
from .cells import grade_id, is_instructor_cell, is_test_cell
from .config import REPO_ROOT, course_dir, source_dir

# a test cell that runs the student's code through dl.exercise.run is graded in the grader kernel
_RUNS_EXERCISES = re.compile(r"\bexercise\.run\(")
KERNEL_EXCHANGE = "/tmp/.kernel/ipc"  # the sandboxed kernel's view of its socket folder (sandbox.py)


def _error_output(ename: str, message: str) -> nbformat.NotebookNode:
    # an error output is what makes nbgrader give a graded cell 0 points
    return nbformat.v4.new_output(
        "error", ename=ename, evalue=message, traceback=[f"\x1b[0;31m{ename}\x1b[0m: {message}"]
    )


NOTES_FILE = ".disttrain-grading.json"  # next to the autograded notebook; read by the grade report


def _clamp_partial_credit(cell) -> None:
    """nbgrader reads a number a test cell returns as partial credit and fails the whole
    notebook when it exceeds the cell's points: keep it within [0, points]."""
    points = float(cell.metadata.nbgrader.get("points", 0))
    for output in cell.outputs:
        if output.output_type == "execute_result":
            try:
                value = float(output.get("data", {}).get("text/plain", ""))
            except (TypeError, ValueError):
                return
            if not 0 <= value <= points:
                output.data["text/plain"] = repr(min(max(value, 0.0), points))
            return


def _names_used(source: str) -> list[str]:
    return sorted(set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", source)))


def _names_bound(source: str) -> list[str]:
    """Top-level names a cell binds (imports, defs, classes, plain assignments)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    names = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names += [(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names += [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
    return names


# Run by the grader when the guard's answer was forged: drop the shell's own methods that
# a solution cell shadowed on the instance (user_expressions evaluates the guard's call).
_REPAIR_SHELL = (
    "_ip = get_ipython()\n"
    "for _n in ('user_expressions', 'run_cell', 'run_cell_async', 'run_ast_nodes', 'run_code', 'ev', 'ex',\n"
    "           'showtraceback', '_showtraceback', 'set_custom_exc', 'transform_cell'):\n"
    "    vars(_ip).pop(_n, None)\n"
    "del _ip, _n\n"
)


def _remember_interrupted(cell, limit: int, student_functions: list[str]) -> str:
    """Code for the student's kernel, after ``cell`` ran past its limit: see launcher.remember_interrupted."""
    label = f"the cell In[{cell.execution_count}]" if cell.get("execution_count") else "an earlier cell"
    launcher = "__import__('disttrain_lab.launcher', fromlist=['_'])"
    return f"{launcher}.remember_interrupted({label!r}, {limit!r}, {student_functions!r})"


def _guard_call(function: str, names: list[str], *extra: str) -> str:
    args = ", ".join([repr(names), *map(repr, extra)])
    return f"__import__('sys').modules['_disttrain_grading_guard'].{function}({args})"


def _release_tests(lab: str | None) -> tuple[dict[str, str], bool]:
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
    """Whether ``lab``'s graded tests run in the grader kernel (see ``RobustExecute._on_grader``)."""
    return _release_tests(lab)[1]


def _growth(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


class SandboxKernelManager(AsyncKernelManager):
    """Starts the kernel through disttrain_lab/grading/sandbox.py (set ``sandbox_spec`` first)."""

    sandbox_spec: dict = {}

    def format_kernel_cmd(self, extra_arguments=None):
        return sandbox.command(self.sandbox_spec, super().format_kernel_cmd(extra_arguments))


def _git_paths(root: Path = REPO_ROOT) -> list[str]:
    """The repository's git data: its objects hold every solution and hidden test.  In a
    worktree ``.git`` is a file naming the real git directory (and its common one)."""
    git = root / ".git"
    if not git.is_file():
        return [str(git)]
    found = [str(git)]
    text = git.read_text(errors="replace").strip()
    if text.startswith("gitdir:"):
        gitdir = (root / text[len("gitdir:") :].strip()).resolve()
        found.append(str(gitdir))
        common = gitdir / "commondir"
        if common.is_file():
            found.append(str((gitdir / common.read_text().strip()).resolve()))
    return found


def _hidden_paths() -> list[str]:
    """What a sandboxed kernel must not see: the course (gradebook, every submission),
    the solutions and the repository's git data (which holds them too), the grading temp
    dir, the grader's home, and $DISTTRAIN_SANDBOX_HIDE."""
    extra = [p for p in os.environ.get("DISTTRAIN_SANDBOX_HIDE", "").split(os.pathsep) if p]
    return [str(course_dir()), str(source_dir()), *_git_paths(), tempfile.gettempdir(), os.path.expanduser("~"), *extra]


def _kept_paths() -> list[str]:
    """What it must read: the interpreter and the kit (bound back read-only where hidden)."""
    return sorted({sys.base_prefix, sys.prefix, str(REPO_ROOT)})


class RobustExecute(Execute):
    """nbgrader's Execute, made to survive any submission (see the module docstring)."""

    notebook_timeout = Integer(1500, help="wall-clock seconds for the whole notebook").tag(config=True)
    memory_limit = Integer(4 * 2**30, help="RLIMIT_DATA bytes per kernel/rank process; 0 = none").tag(config=True)
    max_output_bytes = Integer(2_000_000, help="output kept per cell; more fails the cell").tag(config=True)
    probe_timeout = Integer(10, help="seconds an interrupted kernel has to answer again").tag(config=True)
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
        self._guard_ready = False
        self._instructor_cells: list[int] = []
        self._kernel_kwargs = {}
        self._notes: list[str] = []
        self._last_status = None
        self._output_bytes, self._output_capped = 0, False
        self._cell_seconds: dict[str, float] = {}  # this run's time per cell (recorded for the solution)
        lab = ((resources or {}).get("nbgrader") or {}).get("assignment")
        self._cell_limits = cell_times.limits_for(lab, self.cell_time_scale) if lab else {}
        self._lab = lab
        self._release_tests, self._uses_exercises = _release_tests(lab)
        self._grader = None  # (manager, client) of the grader kernel
        self._grader_dir = tempfile.mkdtemp(prefix="grader-")  # hidden from the sandbox with the temp dir
        self._exchange = None
        try:
            if self._uses_exercises:  # it boots, and runs the lab's locked cells, while the student's cells run
                self._start_grader(nb)
            return super().preprocess(nb, resources, km)
        finally:
            self._stop_grader()
            shutil.rmtree(self._grader_dir, ignore_errors=True)
            if self._exchange and self.sandbox != "on":
                shutil.rmtree(self._exchange, ignore_errors=True)
            self._write_notes(resources)

    def preprocess_cell(self, cell, resources, index):
        self._check_assign_resources(resources)
        if cell.cell_type != "code" or not cell.source.strip():
            return cell, self.resources
        remaining = self._deadline - time.monotonic()
        if remaining < 1:
            cell.outputs = [
                _error_output(
                    "NotebookTimeout",
                    (
                        f"not run: the whole notebook may take at most {self.notebook_timeout} s "
                        "when graded, and the cells above used it up"
                    ),
                )
            ]
            return cell, self.resources
        if self._on_grader(cell):
            return self._run_on_grader(cell, index), self.resources
        names = _names_used(cell.source) if is_test_cell(cell) else []
        traffic = None
        if is_test_cell(cell):
            replaced, notes, traced = self._guard("before_test", names)
            traffic = (traced, self._loopback_bytes())
            self._notes += [f"{grade_id(cell)}: put back before the test: {n}" for n in notes]
            if replaced:
                self._notes.append(f"{grade_id(cell)}: replaced before the test (scored 0): {', '.join(replaced)}")
                cell.outputs = [
                    _error_output(
                        "TamperingError",
                        (
                            "grading relies on the genuine " + ", ".join(replaced) + ", but code above "
                            "replaced it; this exercise gets 0 (the originals were put back for the rest)"
                        ),
                    )
                ]
                return cell, self.resources
        key = cell_times.cell_key(cell)
        # the solution's own time for this cell, times a generous factor (cell_times.py), else the cell limit
        limit = int(max(1, min(self._cell_limits.get(key) or self.timeout or remaining, remaining)))
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
        self._last_status = None
        try:
            # a test cell leaves no input history (In, _ih, _i...) its student code could print
            cell = self.execute_cell(cell, index, store_history=not is_test_cell(cell))
        except DeadKernelError:
            cell.outputs.append(
                _error_output(
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
                _error_output(
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
        timed_out = any(o.output_type == "error" and o.ename == "CellTimeoutError" for o in cell.outputs)
        if is_test_cell(cell) and not timed_out:
            self._run_quietly(hidden_tests.forget_program(cell.source), timeout=30)  # its cached source
            changed, _, traced = self._guard("after_test", names)
            claimed, counted = _growth(traffic[0], traced), _growth(traffic[1], self._loopback_bytes())
            if changed:  # the student's code, called by the test, changed what the test relies on
                self._notes.append(f"{grade_id(cell)}: changed while the test ran: {', '.join(changed)}")
                cell.outputs.append(
                    _error_output(
                        "TamperingError",
                        (
                            "while this test ran, code it called changed " + ", ".join(changed) + "; the result "
                            "cannot be trusted, so this exercise gets 0 (the originals were put back)"
                        ),
                    )
                )
            elif claimed is not None and counted is not None and claimed > counted:
                self._notes.append(
                    f"{grade_id(cell)}: the trace claims {claimed} B sent point to point, "
                    f"the operating system counted {counted} B"
                )
                cell.outputs.append(
                    _error_output(
                        "TrafficError",
                        (
                            f"the traces of this test's launches say the ranks sent {claimed:,} bytes point to "
                            f"point, but the operating system counted only {counted:,} bytes on the ranks' network "
                            "while the cell ran (it counts every byte sent between ranks, headers included, so it "
                            "can only be more): the trace was altered, or data moved some other way than "
                            "torch.distributed; this exercise gets 0"
                        ),
                    )
                )
            elif self._last_status != "ok" and not any(o.output_type == "error" for o in cell.outputs):
                cell.outputs.append(
                    _error_output(
                        "GradingError",
                        f"the test did not pass (the kernel answered {self._last_status!r})"
                        if self._last_status is not None  # None: no execute reply (a skipped cell)
                        else "the kernel never ran this test (no reply came), so it cannot have passed",
                    )
                )
            _clamp_partial_credit(cell)
        elif is_instructor_cell(cell):
            self._record_instructor_names(index)
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if any(o.ename == "CellTimeoutError" for o in errors):
            # a student's function the interrupt stopped in this cell is not waited for again by later
            # launches (the graded tests' among them): the kernel is asked once it answers again
            remember = "pass" if is_test_cell(cell) else _remember_interrupted(cell, limit, self._student_functions())
            if not self._kernel_answers(remember):
                cell.outputs.append(
                    _error_output(
                        "CellTimeoutError",
                        (
                            "the cell did not stop when interrupted; the kernel was restarted and "
                            "the cells above were run again"
                        ),
                    )
                )
                self._restart_and_replay()
        elif not is_test_cell(cell) and (not errors or time.monotonic() - started < 10):
            self._replayable.append(index)
        return cell, self.resources

    # -- kernel start: memory limit and the tampering guard -------------------------------

    def create_kernel_manager(self):
        km = super().create_kernel_manager()
        if self.sandbox == "on":
            km.__class__ = SandboxKernelManager
            km.sandbox_spec = sandbox.spec(
                # a uid no other grading on the host uses (uids.py), else one per parallel job
                uid=uids.sandbox_uid(self.sandbox_uid, int(os.environ.get("DISTTRAIN_SANDBOX_SLOT", "0")))
                if sandbox.method() == "root"
                else self.sandbox_uid + int(os.environ.get("DISTTRAIN_SANDBOX_SLOT", "0")),
                memory=self.student_memory,
                pids=self.student_pids,
                data_limit=self.memory_limit,
                cgroup=os.environ.get("DISTTRAIN_SANDBOX_CGROUP", "disttrain-lab/plain"),
                hide=_hidden_paths(),
                keep=_kept_paths(),
            )
            # the sandbox has its own network namespace: ZMQ over unix sockets in a folder
            # made for this kernel (the sandbox binds it in and removes it); a unix socket's
            # path holds at most 107 bytes, so a deep temp dir gives way to /tmp
            where = tempfile.gettempdir() if len(tempfile.gettempdir()) < 60 else "/tmp"
            km.transport, km.ip = "ipc", os.path.join(tempfile.mkdtemp(prefix="ipc-", dir=where), "k")
            atexit.register(shutil.rmtree, os.path.dirname(km.ip), True)  # (a killed wrapper cannot)
        elif self.sandbox != "off":
            raise ValueError(f"RobustExecute.sandbox must be 'on' or 'off', got {self.sandbox!r}")
        return km

    def start_new_kernel(self, **kwargs):
        # a restarted kernel starts where the first one did (the submission's folder)
        kwargs = self._kernel_kwargs = kwargs or getattr(self, "_kernel_kwargs", {})
        super().start_new_kernel(**kwargs)
        pid = getattr(getattr(self.km, "provisioner", None), "pid", None)
        if self.memory_limit and pid and self.sandbox != "on":  # (the sandbox sets it before the kernel starts)
            import resource

            # hard and soft: the kernel cannot raise it back; ranks it forks/spawns inherit it
            resource.prlimit(pid, resource.RLIMIT_DATA, (self.memory_limit, self.memory_limit))

    startup_retries = Integer(2, help="times a kernel that dies while starting is started again").tag(config=True)

    def start_new_kernel_client(self):
        for attempt in range(self.startup_retries + 1):
            try:
                kc = super().start_new_kernel_client()
                break
            except RuntimeError as exc:  # "Kernel died before replying to kernel_info"
                if attempt == self.startup_retries:
                    raise
                self.log.warning("the kernel died while starting (%s); starting it again", exc)
                if self.km is not None:
                    self._stop_kernel()
                self.km = self.create_kernel_manager()
                self.start_new_kernel()
        self._tell_grader_kernel()
        self._guard_key = secrets.token_bytes(32)  # signs the guard's answers (guard.py)
        self._guard_ready = self._run_quietly(guard.program(self._guard_key), timeout=120) is not None
        return kc

    def _guard(self, function: str, names: list[str]) -> tuple[list[str], list[str], int | None]:
        """(problems, notes, traced bytes) from the guard in the kernel; see
        disttrain_lab/grading/guard.py.  An answer that is not the guard's own (signed) is a
        problem; the grader then puts back IPython's own evaluation methods and asks once
        more, so that later tests are graded on their merits."""
        if not self._guard_ready:
            return [], [], None
        problems, notes, traced = self._ask_guard(function, names)
        if problems and problems[0].startswith("grading guard"):
            self._run_quietly(_REPAIR_SHELL, timeout=30)
            again, notes, traced = self._ask_guard(function, names)
            problems = (
                problems + [p for p in again if not p.startswith("grading guard")]
                if not (again and again[0].startswith("grading guard"))
                else again
            )
        return problems, notes, traced

    def _ask_guard(self, function: str, names: list[str]) -> tuple[list[str], list[str], int | None]:
        nonce = secrets.token_hex(16)
        reply = self._run_quietly("", timeout=30, expression=_guard_call(function, names, nonce))
        if reply is None:  # busy past 30 s (or gone): a clean state cannot be shown
            return ["grading guard (it did not answer within 30 s)"], [], None
        result = reply.get("user_expressions", {}).get("r", {})
        if result.get("status") != "ok":
            return ["grading guard (it was removed)"], [], None
        try:
            problems, notes, traced, mac = ast.literal_eval(result["data"]["text/plain"])
            problems, notes = list(problems), list(notes)
        except (KeyError, ValueError, SyntaxError, TypeError):
            return ["grading guard (it was altered)"], [], None
        if not (
            isinstance(mac, str)
            and hmac.compare_digest(mac, guard.signature(self._guard_key, nonce, (problems, notes, traced)))
        ):
            return ["grading guard (its answer was not the guard's own: IPython's evaluation was replaced)"], [], None
        return [str(p) for p in problems], [str(n) for n in notes], traced if isinstance(traced, int) else None

    def _loopback_bytes(self) -> int | None:
        """What the OS counted on the kernel's loopback so far (sandbox.loopback_bytes)."""
        pid = getattr(getattr(self.km, "provisioner", None), "pid", None)
        return sandbox.loopback_bytes(pid) if pid else None

    def _record_instructor_names(self, index: int) -> None:
        if index not in self._instructor_cells:
            self._instructor_cells.append(index)
        names = _names_bound(self.nb.cells[index].source)
        if self._guard_ready and names:
            self._run_quietly("", timeout=30, expression=_guard_call("record", names))

    async def _check_raise_for_error(self, cell, cell_index, exec_reply):
        self._last_status = (exec_reply or {}).get("content", {}).get("status")
        return await super()._check_raise_for_error(cell, cell_index, exec_reply)

    def _write_notes(self, resources) -> None:
        """What the guard put back or caught, for the grade report (never shown to the student)."""
        path = (resources or {}).get("metadata", {}).get("path")
        if path and os.path.isdir(path):
            with open(os.path.join(path, NOTES_FILE), "w") as f:
                json.dump(
                    {"notes": self._notes, "sandbox": self.sandbox, "cell_seconds": self._cell_seconds}, f, indent=1
                )

    # -- the grader kernel: tests that never run in the student's kernel --------------------

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

    def _student_functions(self) -> list[str]:
        """The functions the submission's solution cells define (a hang is blamed on one of these)."""
        names = set()
        for cell in self.nb.cells:
            if cell.cell_type == "code" and cell.get("metadata", {}).get("nbgrader", {}).get("solution"):
                try:
                    tree = ast.parse(cell.source)
                except SyntaxError:
                    continue
                names.update(n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        return sorted(names)

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
        remote.write_cell(Path(self._grader_dir), grade_id(cell), time.monotonic() + limit, self._student_functions())
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
            cell = self.execute_cell(cell, index, store_history=False)
        except (DeadKernelError, CellTimeoutError) as exc:
            cell.outputs.append(
                _error_output(
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
                _error_output("GradingError", f"the test did not pass (the kernel answered {self._last_status!r})")
            )
        if any(o.output_type == "error" and o.ename == "CellTimeoutError" for o in cell.outputs):
            # the interrupt's traceback is the grader's own code: the limit is what the student needs
            cell.outputs = [
                o for o in cell.outputs if not (o.output_type == "error" and o.ename == "KeyboardInterrupt")
            ]
        _clamp_partial_credit(cell)
        if not self._kernel_answers(timeout=2):  # busy with a run the test gave up on, or dead
            try:
                run_sync(self.km.interrupt_kernel)()
            except Exception as exc:  # noqa: BLE001  (gone: restarted below)
                self.log.debug("interrupting the student's kernel: %s", exc)
            if not self._kernel_answers():
                self._restart_and_replay()
        return cell

    # -- restart and replay ----------------------------------------------------------------

    def _kernel_answers(self, code: str = "pass", timeout: float | None = None) -> bool:
        try:
            return self._run_quietly(code, timeout=timeout or self.probe_timeout) is not None
        except DeadKernelError:
            return False

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
            if index in self._instructor_cells:
                self._record_instructor_names(index)

    def _stop_kernel(self) -> None:
        async def stop():
            if self.kc is not None:
                self.kc.stop_channels()
            try:
                await ensure_async(self.km.shutdown_kernel(now=True))
            except Exception as exc:  # already dead: nothing to stop
                self.log.debug("stopping the kernel: %s", exc)
            try:
                await ensure_async(self.km.cleanup_resources())
            except Exception as exc:
                self.log.debug("cleaning up the kernel: %s", exc)

        run_sync(stop)()
        self.kc, self.km = None, None

    def _run_quietly(self, code: str, timeout: float, expression: str | None = None) -> dict | None:
        """Execute code without recording outputs; the reply content, or None on timeout."""

        async def run():
            msg_id = self.kc.execute(
                code,
                silent=True,
                store_history=False,
                allow_stdin=False,
                stop_on_error=False,
                user_expressions={"r": expression} if expression else None,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    msg = await ensure_async(
                        self.kc.shell_channel.get_msg(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
                    )
                except Empty:
                    if not await ensure_async(self.kc.is_alive()):
                        raise DeadKernelError("Kernel died") from None
                    continue
                if msg["parent_header"].get("msg_id") == msg_id:
                    return msg["content"]
            return None

        return run_sync(run)()

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
                        _error_output(
                            "OutputLimitExceeded",
                            (
                                f"this cell printed more than {self.max_output_bytes // 1000} kB; the rest "
                                "of its output was dropped and the cell counts as failed"
                            ),
                        )
                    )
                return None
        return super().process_message(msg, cell, cell_index)
