"""Under grading, a notebook function that hung is not waited for again.

A lab graded by nbgrader runs every cell with a time limit; a student's function that hangs
would cost that limit in every later cell (and test) that calls it.  So, only when
``NBGRADER_EXECUTION`` is ``autograde``, the kit remembers the notebook function a hang was
stuck in and, while it is still defined as it was, replaces it with a stand-in that raises
:class:`SkippedAfterHang` at once, saying what happened the first time:

- around every ``dl.launch`` (:func:`around_launch`, which this module registers with
  ``launcher.add_hook``): the stand-ins are what the launch sends to the ranks (:func:`stubbed`,
  :func:`hung_before`), and a launch that ran past its own timeout (the lab's word that a
  function hangs) is remembered (:func:`remember_hang`);
- ``serving.run`` does the same for the grader's runs, only for the student's own functions
  (:func:`stub_only`, the grader's list);
- the grader runs :func:`remember_interrupted` in the student's kernel after it interrupted a
  cell at its limit (``grading/execute.py`` sends the call as code).

And a hang ends with the launcher's own report (which rank, blocked in what, in which of the
student's functions) inside the cell's limit, not with the cell's interrupt: before each cell it
runs in the student's kernel the grader tells :func:`cell_limit` that cell's limit, and
the launch's timeout is capped to what is left of it (:func:`capped`), less the seconds a
timed-out launch needs to stop its ranks and say so.

This module is part of the student kit: it imports nothing of the grading wing, and the
launcher imports nothing of it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Iterator
from types import FunctionType

from .launcher import Pending, add_hook
from .reports import CollectiveMismatch, LaunchTimeout

_GRADING = os.environ.get("NBGRADER_EXECUTION") == "autograde"
_HUNG: dict[str, tuple[FunctionType, str]] = {}  # name -> (the function that hung, what happened)
_STUB_ONLY: set[str] | None = None  # while the grader's request runs: only these names (its own list)
_CELL: tuple[float, int | None, float] | None = None  # the graded cell's (deadline, In[n], limit): cell_limit

REPORT_MARGIN = 4.0  # seconds a timed-out launch needs to stop its ranks and the cell to say so
# seconds: the least a launch is worth: a cell's own launch gets at least this however little is
# left of the limit (``capped``); a grader's run with less left is not started (grading/remote.py)
MIN_LAUNCH = 1.0


class SkippedAfterHang(Exception):
    """Raised on a rank, under grading, by a notebook function that did not finish in an earlier
    cell: it is not run (nor waited for) again."""


def _execution_count() -> int | None:
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return getattr(shell, "execution_count", None)


def cell_limit(seconds: float) -> None:
    """Under grading, run by the grader in the student's kernel just before a cell (a quiet run,
    which leaves ``In[n]`` as it is): that cell may run ``seconds``.  It holds for that cell only
    (the one that becomes ``In[n]``), not for the grader's own runs during later test cells."""
    global _CELL
    if _GRADING:
        _CELL = (time.monotonic() + seconds, _execution_count(), seconds)


def capped(timeout: float) -> tuple[float, str | None]:
    """A launch's ``timeout``, under grading no later than the end of the cell's limit less
    ``REPORT_MARGIN`` (so the launch, not the cell's interrupt, says what hung), and why it was
    capped (None where it was not)."""
    if _CELL is None or not _GRADING or _CELL[1] != _execution_count():
        return timeout, None
    deadline, _, limit = _CELL
    left = deadline - time.monotonic() - REPORT_MARGIN
    if left >= timeout:
        return timeout, None
    return max(round(left, 1), MIN_LAUNCH), (
        f"what was left of this cell's {limit:g} s time limit when graded; the launch asked for {timeout:g} s"
    )


def _stub(name: str, message: str) -> FunctionType:
    def stub(*args, **kwargs):
        raise SkippedAfterHang(message)

    stub.__name__ = stub.__qualname__ = name
    return stub


@contextlib.contextmanager
def stubbed(messages: dict[str, str]) -> Iterator[dict[FunctionType, FunctionType]]:
    """Within: each notebook function named in ``messages`` is replaced by one that raises
    ``SkippedAfterHang(message)`` (what a launch pickles meanwhile runs that instead); then put back.
    Gives {the function: its stand-in}, for a function passed as an argument itself."""
    notebook = vars(sys.modules["__main__"])
    kept = {n: notebook[n] for n in messages if isinstance(notebook.get(n), FunctionType)}
    stubs = {n: _stub(n, messages[n]) for n in kept}
    try:
        notebook.update(stubs)
        yield {kept[n]: stubs[n] for n in kept}
    finally:
        notebook.update(kept)


@contextlib.contextmanager
def stub_only(names) -> Iterator[None]:
    """Within: of the functions that hung in this kernel, stop at once only those in ``names``
    (the grader's run of a test: the functions of the student's solution cells)."""
    global _STUB_ONLY
    saved, _STUB_ONLY = _STUB_ONLY, set(names)
    try:
        yield
    finally:
        _STUB_ONLY = saved


def hung_before() -> dict[str, str]:
    """Under grading: the notebook functions that hung in an earlier launch and are still defined
    as they were, each with why it is not run again (see ``stubbed``); otherwise none."""
    if not _GRADING:
        return {}
    notebook = vars(sys.modules["__main__"])
    return {
        name: message
        for name, (fn, message) in _HUNG.items()
        if notebook.get(name) is fn and (_STUB_ONLY is None or name in _STUB_ONLY)
    }


def remember_hang(exc: LaunchTimeout) -> None:
    """Under grading: remember the notebook function a launch that ran past its timeout was stuck
    in (see ``_stuck_in``), so that later launches stop at once instead of waiting for it again.
    (A timeout is the lab's own word that a function hangs; ``dl.launch`` calls this.)"""
    if not _GRADING:
        return
    name = _stuck_in(exc.stacks, exc.blocked, _STUB_ONLY)  # (the grader's run: only the student's functions)
    if name is None:
        return
    notebook = vars(sys.modules["__main__"])
    fn = notebook[name]
    if name not in _HUNG or _HUNG[name][0] is not fn:
        shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
        cell = "a graded test" if _STUB_ONLY is not None else "an earlier cell"
        if shell is not None and _STUB_ONLY is None:
            cell = f"the cell In[{shell.execution_count}]"
        message = _not_run_again(name, cell, "its timeout", str(exc))
        _HUNG[name] = (fn, message)
        if _STUB_ONLY is not None:  # one of the student's functions (the grader says which): the cells
            notebook[name] = _stub(name, message)  # that call it in this kernel, not on ranks, stop too


def _stuck_in(stacks: dict, blocked: dict, allowed: set[str] | None) -> str | None:
    """The innermost notebook function (of ``allowed``, if given) in the stuck ranks' stacks, those
    of ranks looping in Python before those waiting in torch; a lab's own helpers (``_``) left out."""
    notebook = vars(sys.modules["__main__"])
    ranks = sorted(stacks, key=lambda r: not str(blocked.get(r, "running Python")).startswith("running Python"))
    for name in (name for rank in ranks for name, _ in reversed(stacks[rank])):
        fn = notebook.get(name)
        if isinstance(fn, FunctionType) and fn.__module__ == "__main__" and not name.startswith("_"):
            if allowed is None or name in allowed:
                return name
    return None


def _not_run_again(name: str, cell: str, limit: str, what: str) -> str:
    return (
        f"{name} is not run again: when {cell} ran it under grading, it did not finish within {limit}, "
        f"and grading waits for a function that hangs only once. What happened then:\n{what}"
    )


def remember_interrupted(cell: str, limit: float, student_functions: list[str]) -> str | None:
    """Under grading, run by the grader in the student's kernel once a cell that ran past its
    limit was interrupted: the student's function the interrupt stopped (of ``student_functions``,
    those the submission's solution cells define) is not waited for again, by later launches nor
    by later cells that call it here (as for a graded launch that timed out, ``remember_hang``).
    Where the interrupt stopped a launch, the function is the one its ranks were stuck in (the
    launch's report); otherwise the innermost of the cell's own frames.  Gives its name, or None."""
    value, tb = getattr(sys, "last_value", None), getattr(sys, "last_traceback", None)
    if not _GRADING or not isinstance(value, KeyboardInterrupt) or tb is None:
        return None
    notebook = vars(sys.modules["__main__"])
    name = what = None
    if getattr(value, "stacks", None):  # a launch: where each unfinished rank was (warmpool.py)
        name = _stuck_in(value.stacks, value.blocked, set(student_functions))
        ranks = "".join(f"\n  rank {r}: {doing}" for r, doing in sorted(value.blocked.items()))
        what = f"the cell's limit interrupted a launch; where each unfinished rank was:{ranks}"
    else:
        for frame, line in reversed(list(traceback.walk_tb(tb))):
            fn = notebook.get(frame.f_code.co_name)
            if frame.f_code.co_name in student_functions and isinstance(fn, FunctionType):
                if fn.__code__ is frame.f_code:
                    name = frame.f_code.co_name
                    what = f"the cell's limit interrupted it in {name} (line {line}), still running Python code"
                    break
    if name is None:
        return None
    message = _not_run_again(name, cell, f"the cell's {limit:g} s limit", what)
    _HUNG[name] = (notebook[name], message)
    notebook[name] = _stub(name, message)
    return name


@contextlib.contextmanager
def around_launch(pending: Pending) -> Iterator[None]:
    """Under grading, around every ``dl.launch``: the notebook's functions that hung before are
    sent to the ranks as their stand-ins, the timeout is capped to what is left of the cell's
    limit, and a launch that runs past its timeout is remembered (``remember_hang``)."""
    if not _GRADING:
        yield
        return
    with contextlib.ExitStack() as stack:
        stubs = stack.enter_context(stubbed(hung_before()))  # (the ranks get what is defined now)
        if isinstance(pending.fn, FunctionType):
            pending.fn = stubs.get(pending.fn, pending.fn)
        pending.args = tuple(stubs.get(a, a) if isinstance(a, FunctionType) else a for a in pending.args)
        pending.timeout, pending.timeout_why = capped(pending.timeout)
        if pending.timeout_why is not None:  # the ranks' start (a cold pool forks) counts against the cell too
            pending.deadline = time.monotonic() + pending.timeout
        try:
            yield
        except CollectiveMismatch:
            raise  # seen at once, whatever the timeout: not a hang to remember
        except LaunchTimeout as exc:
            stack.close()  # the notebook's own functions back first
            remember_hang(exc)
            raise


add_hook(around_launch)
