"""What the notebook adds to errors a student meets in a cell.

- A lab's stub called in the kernel (a local self-check, a prediction's function): nbgrader's
  release leaves ``raise NotImplementedError()`` with no message, which names nothing; the
  error then says which function or method is not written yet, and in which cell and line.
- ``torch.distributed`` called in a cell, outside a launch: torch advises to call
  ``init_process_group``, which is wrong advice in this kit; the error then says how to run
  it (inside the function ``dl.launch`` runs on every rank).
- A launch that failed in a cell that had made a figure to draw its run in: the figure is
  still empty, and the notebook would show its bare axes under the error; it is closed.
- Any error that passed through the kit's own code (a check that failed, an argument the kit
  refused): the kit's frames are cut from the traceback, which shows the student's cell and
  functions and the message; ``%xmode Verbose`` shows them again (a line under the error says so).

A rank's errors get the same treatment in ``reports.py`` (they come back as data).  Both
hints are IPython's custom exception handler (``shell.set_custom_exc``), installed when
``disttrain_lab`` is imported in an IPython kernel that has no handler of its own (Colab
and others may install one: theirs is kept, and the errors stay torch's and Python's).
"""

from __future__ import annotations

import sys
import traceback

from .codemap import is_internal, is_library
from .reports import LaunchError, stub_message

NOT_INITIALIZED = "Default process group has not been initialized"
OUTSIDE_A_LAUNCH = (
    "torch.distributed was called in a cell, outside a launch.  In this kit, torch.distributed calls run "
    "inside the function you launch: dl.launch(fn, world_size) starts world_size ranks, sets up the "
    "process group on each and runs fn there (do not call dist.init_process_group yourself).  For example:\n"
    "    def hello():\n"
    "        return dist.get_rank()\n"
    "    dl.launch(hello, 4)   # [0, 1, 2, 3]"
)


def hint(exc: BaseException) -> str | None:
    """The message ``exc`` should carry in a notebook, or None to leave it as it is."""
    if type(exc) is NotImplementedError and not exc.args and exc.__traceback__ is not None:
        frames = [f for f in traceback.walk_tb(exc.__traceback__) if not is_library(f[0].f_code.co_filename)]
        if not frames:
            return None
        frame, line = frames[-1]
        code = frame.f_code
        return stub_message(getattr(code, "co_qualname", code.co_name), code.co_filename, line)
    if isinstance(exc, ValueError) and exc.args and NOT_INITIALIZED in str(exc.args[0]):
        return f"{exc.args[0]}\n\n{OUTSIDE_A_LAUNCH}"
    return None


def close_empty_figures() -> list[int]:
    """Close the open matplotlib figures with nothing drawn on any of their axes (a notebook's
    inline backend shows a cell's open figures after it, under its error); their numbers."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return []
    closed = []
    for number in plt.get_fignums():
        fig = plt.figure(number)
        if fig.axes and not any(ax.has_data() or ax.texts or ax.artists for ax in fig.axes):
            plt.close(fig)
            closed.append(number)
    return closed


def without_kit_frames(tb):
    """``tb`` with the frames of the kit's own code unlinked, and how many; as it was where every
    frame is the kit's or none is (nothing of the student's would be left to show, or nothing to cut)."""
    head, frames, cut = tb, [], 0
    while tb is not None:
        if is_internal(tb.tb_frame.f_code.co_filename):
            cut += 1
        else:
            frames.append(tb)
        tb = tb.tb_next
    if not cut or not frames:
        return head, 0
    for frame, after in zip(frames, frames[1:]):
        frame.tb_next = after
    frames[-1].tb_next = None
    return frames[0], cut


HANDLED = (Exception,)  # every error a cell raises: all may pass through the kit's code
KIT_FRAMES_NOTE = "({} of disttrain_lab's own code not shown: `%xmode Verbose` shows {})"


def _handler(shell, etype, value, tb, tb_offset=None):
    """IPython's custom exception handler: the usual traceback, with the hint as the message
    (the handler shows it: IPython's ``run_code`` drops what a handler returns), without the kit's
    frames unless the shell's traceback mode is Verbose."""
    better = hint(value)
    if better is not None:
        value.args = (better,)
    if isinstance(value, LaunchError):
        close_empty_figures()
    cut = 0
    if getattr(getattr(shell, "InteractiveTB", None), "mode", "") != "Verbose":
        trimmed, cut = without_kit_frames(tb)
        tb = trimmed if cut else tb
    shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
    if cut:
        print(KIT_FRAMES_NOTE.format(f"{cut} frame{'s' * (cut > 1)}", "them" if cut > 1 else "it"), file=sys.stderr)


def _shell():
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


def install() -> bool:
    """Give the kernel's shell the hints; False where there is no IPython shell, or it has a
    custom exception handler already (which is kept)."""
    shell = _shell()
    if shell is None or not hasattr(shell, "set_custom_exc"):
        return False
    if shell.custom_exceptions and shell.custom_exceptions != HANDLED:
        return False
    shell.set_custom_exc(HANDLED, _handler)
    return True
