"""Turn what a failed rank reported into the error a student reads in the cell.

Every message names the rank, says what it was doing, and points at the student's own
line (frames inside disttrain_lab, cloudpickle and torch are trimmed from the end).
"""

from __future__ import annotations

import linecache
import os
import re
import signal

from . import trace
from .codemap import is_internal, is_library


class LaunchError(RuntimeError):
    """Something went wrong on the ranks of a ``dl.launch``; all ranks were stopped."""

    def _render_traceback_(self) -> list[str]:
        """What IPython (Jupyter) shows for this error: the usual traceback, cut where the kit's
        own frames begin, so that it ends at the student's line that called ``dl.launch`` (the
        ranks' tracebacks are in the message).  IPython always shows the frame that raised,
        ``__tracebackhide__`` or not, hence this hook."""
        import types

        from IPython import get_ipython

        shell = get_ipython()
        if shell is None:
            raise NotImplementedError("not in IPython")  # IPython then shows the usual traceback
        kept, tb = [], self.__traceback__
        while tb is not None and not tb.tb_frame.f_globals.get("__name__", "").startswith(__package__ + "."):
            kept.append(tb)
            tb = tb.tb_next
        trimmed = None
        for entry in reversed(kept):
            trimmed = types.TracebackType(trimmed, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
        return shell.InteractiveTB.structured_traceback(type(self), self, trimmed)


class RankError(LaunchError):
    """A rank raised an exception.  ``str(e)`` shows the rank's traceback, ending at your line."""

    def __init__(self, message: str, rank: int, exc_type: str, exc_message: str, remote_traceback: str):
        super().__init__(message)
        self.rank, self.exc_type, self.exc_message = rank, exc_type, exc_message
        self.remote_traceback = remote_traceback


class RankDied(LaunchError):
    """A rank's process ended without returning (``os._exit``, ``abort``, a crash, out of memory)."""

    def __init__(self, message: str, rank: int, exitcode: int | None):
        super().__init__(message)
        self.rank, self.exitcode = rank, exitcode


class LaunchTimeout(LaunchError):
    """Not every rank finished within the timeout.  ``blocked`` says what each rank was doing;
    ``stacks``: the functions of your code each stuck rank was in, outermost first, as
    (function, line)."""

    def __init__(self, message: str, blocked: dict[int, str], stacks: dict[int, list[tuple[str, int]]] | None = None):
        super().__init__(message)
        self.blocked, self.stacks = blocked, stacks or {}


class CollectiveMismatch(LaunchTimeout):
    """Ranks called a collective in ways that cannot match (another op, size, dtype or root,
    or some ranks never call it), seen in the ranks' call logs (``matching.py``) and stopped at once:
    the launch would have waited until its timeout (or gloo aborted a rank), so it is a
    ``LaunchTimeout`` that came early.  ``mismatch``: each rank's call."""

    def __init__(self, message: str, blocked: dict[int, str], stacks: dict, mismatch):
        super().__init__(message, blocked, stacks)
        self.mismatch = mismatch


def cell_name(filename: str) -> str:
    """'Cell In[5]' for code typed in a notebook cell, else the file name."""
    try:
        from IPython import get_ipython

        count = get_ipython().compile._filename_map.get(filename)
        if count is not None:
            return f"Cell In[{count}]"
    except Exception:
        pass
    return f'File "{filename}"'


def _format_frames(frames: list[tuple]) -> str:
    lines = []
    for filename, lineno, name, text in frames:
        text = text or linecache.getline(filename, lineno).strip()
        lines.append(f"  {cell_name(filename)}, line {lineno}, in {name}")
        if text:
            lines.append(f"    {text}")
    return "\n".join(lines)


def stub_message(name: str, filename: str, line: int) -> str:
    """What a lab's stub (``raise NotImplementedError()`` under "# YOUR CODE HERE") says when
    it runs, on a rank or in the notebook's kernel (``hints.py``)."""
    return (
        f"{name} is not written yet ({cell_name(filename)}, line {line} still raises the stub's "
        "NotImplementedError): replace `raise NotImplementedError()` with your code, run that cell, "
        "then run this one again."
    )


def _in_functions(frames: list[tuple[str, int]]) -> str:
    """', in f (line 3) → g (line 7)': where in the student's functions a rank was."""
    return ", in " + " → ".join(f"{name} (line {line})" for name, line in frames) if frames else ""


def rank_error(rank: int, info: dict, others: list[int]) -> RankError:
    frames = [f for f in info["frames"] if not is_internal(f[0])]
    # end at the student's own line: drop trailing frames inside torch / site-packages
    while len(frames) > 1 and is_library(frames[-1][0]) and not all(is_library(f[0]) for f in frames):
        frames.pop()
    shown = _format_frames(frames)
    if "initialize the default process group twice" in info["message"]:
        info = {
            **info,
            "message": info["message"] + "  (dl.launch already set up the process group on "
            "every rank: remove the dist.init_process_group call from your function.)",
        }
    if info["type"] == "NotImplementedError" and not info["message"] and frames:
        # a lab's stub: `raise NotImplementedError()` under "# YOUR CODE HERE"
        info = {**info, "message": stub_message(info.get("qualname") or frames[-1][2], frames[-1][0], frames[-1][1])}
    message = (
        f"rank {rank} raised {info['type']}: {info['message']}\n\n"
        f"Traceback of rank {rank} (most recent call last):\n{shown}\n"
        f"{info['type']}: {info['message']}"
    )
    if others:
        message += f"\n\n(The other ranks, {', '.join(map(str, others))}, were stopped.)"
    full = _format_frames([f for f in info["frames"] if not is_internal(f[0])])
    return RankError(message, rank, info["type"], info["message"], full)


_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<name>\S+)\s*$')


def stack_frames(text: str) -> list[tuple[str, int]]:
    """(function, line) of the frames of a rank's faulthandler dump inside the launched function
    that are not the kit's, torch's or another library's, outermost first (faulthandler writes
    the innermost first; a forked rank's stack also holds the kernel's frames of the fork)."""
    frames: list[tuple[str, int]] = []
    for line in reversed(text.splitlines()):
        found = _FRAME.match(line)
        if found is None:
            continue
        if found["name"] == "_run_job" and os.path.basename(found["file"]) == "worker.py":
            frames = []  # what ran the job: the launched function's frames come after it
        elif not is_library(found["file"]):
            frames.append((found["name"], int(found["line"])))
    return frames


def rank_doing(
    status: trace.Blocked | None,
    now: float,
    frames: list[tuple[str, int]] | None = None,
    calls: int = 0,
    window: float = 0,
) -> str:
    """What a stuck rank was doing: the torch.distributed call it was blocked in (its status
    slot), or running Python code (``calls``: still entering calls, that many in the last
    ``window`` seconds); and in which of your functions (``stack_frames``)."""
    if calls:
        doing = (
            f"running Python code, still communicating ({calls:,} torch.distributed calls in the last {window:.2g} s)"
        )
    elif status is None:
        doing = "running Python code (not in a torch.distributed call)"
    else:
        doing = f"{status.text} for {now - status.since:.1f} s"
    return doing + _in_functions(frames)


def died_error(rank: int, code: int | None, blocked, frames: list[tuple[str, int]], others: list[int]) -> RankDied:
    """The error of a rank whose process ended without returning: ``code`` its exit status
    (negative: the signal), ``blocked`` the torch.distributed call it was in (or None), ``frames``
    where in the student's code (``stack_frames`` of its crash report)."""
    where = _in_functions(frames)
    if code is not None and code < 0:
        sig = signal.Signals(-code).name
        hint = {
            "SIGABRT": "abort() was called (os.abort, or a C++ assertion)",
            "SIGSEGV": "it crashed (segmentation fault)",
            "SIGKILL": "it was killed, often for using too much memory",
        }.get(sig, "")
        if sig == "SIGABRT" and blocked is not None:
            hint = (
                f"gloo aborted it inside {blocked.text}{where}: gloo aborts a rank that receives a message "
                "of another size than its tensor (a send and its recv, or the ranks of a collective, must "
                "use tensors of the same size and dtype)"
            )
            where = ""
        how = f"was killed by {sig}" + (f": {hint}" if hint else "")
    else:
        how = f"exited with code {code}" + (
            " (os._exit or sys.exit inside the rank?)"
            if code
            else " before returning a value (os._exit(0) inside the rank?)"
        )
    return RankDied(
        f"rank {rank} ended without returning: its process {how}{where}. "
        f"The other ranks ({', '.join(map(str, others))}) were stopped.",
        rank,
        code,
    )


def timeout_error(
    states: dict,
    now: float,
    timeout: float,
    stacks: dict | None = None,
    calls: dict[int, int] | None = None,
    window: float = 0,
) -> LaunchTimeout:
    """The error of a launch whose ranks did not all finish: ``states`` what each rank was in at
    the deadline (``"finished"``, a ``Blocked`` call, None: outside any call), ``stacks`` where in
    your code (``stack_frames``), ``calls`` how many torch.distributed calls each entered in the
    ``window`` seconds after the deadline (a rank still making calls is looping, not deadlocked)."""
    blocked: dict[int, str] = {}
    stacks = {rank: frames for rank, frames in (stacks or {}).items() if frames}
    calls = calls or {}
    for rank, s in states.items():
        blocked[rank] = (
            "finished" if s == "finished" else rank_doing(s, now, stacks.get(rank), calls.get(rank, 0), window)
        )
    lines = [f"not every rank finished within the timeout of {timeout:g} s; all ranks were stopped."]
    lines += [f"  rank {r}: {what}" for r, what in sorted(blocked.items())]
    lines.append(diagnose(states, calls, stacks, window))
    return LaunchTimeout("\n".join(lines), blocked, stacks)


def mismatch_error(
    mismatch, states: dict, now: float, stacks: dict | None = None, died: str = ""
) -> CollectiveMismatch:
    """The error of ranks whose call logs do not match (``matching.Mismatch``), with what each rank
    was doing when they were stopped (``states``, as for :func:`timeout_error`); ``died``: how a
    rank that ended meanwhile ended (gloo aborts a rank that receives a message of another size)."""
    stacks = {rank: frames for rank, frames in (stacks or {}).items() if frames}
    blocked = {
        r: s if isinstance(s, str) else rank_doing(s, now, stacks.get(r)) for r, s in states.items()
    }  # (a str: "finished", or how a rank ended)
    lines = [*_mismatch_lines(mismatch), ""]
    lines.append(
        "All ranks were stopped as soon as this was seen (gloo does not check: the ranks would have waited "
        "until the timeout, or gloo aborted one):"
    )
    lines += [f"  rank {r}: {what}" for r, what in sorted(blocked.items())]
    return CollectiveMismatch("\n".join(lines), blocked, stacks, mismatch)


_MISMATCH_RULES = {
    "ops": "every rank of a group must call the same collectives in the same order",
    "sizes": "every rank must pass a tensor of the same size to it",
    "dtypes": "every rank must pass tensors of the same dtype to it",
    "roots": "every rank must name the same root (src or dst)",
}


def _call_text(call) -> str:
    """One rank's call from its call log (``matching.Call``): 'all_reduce(4 elements, float32), in f (line 5)'."""
    side = "src" if call.op in ("broadcast", "scatter") else "dst"
    what = [
        f"{side}={call.root}" if call.root >= 0 else "",
        f"{call.elements:,} elements" if call.elements >= 0 else "",
    ]
    what.append(call.dtype)
    where = _in_functions([(call.function, call.line)]) if call.function else ""
    return f"{call.op}({', '.join(w for w in what if w)}){where}"


def _mismatch_lines(mismatch) -> list[str]:
    """The rule a ``matching.Mismatch`` broke, and each rank's call."""
    first = mismatch.calls[0]
    if mismatch.what == "missing":
        who = _ranks(list(mismatch.returned))
        lines = [
            f"rank {first.rank} waits in collective #{first.k} of the whole world, which {who} returned without "
            "calling: every rank of a group must call the same collectives in the same order."
        ]
    else:
        lines = [
            f"{_ranks(sorted({c.rank for c in mismatch.calls}))} entered collective #{first.k} of their group with "
            f"different {mismatch.what}: {_MISMATCH_RULES[mismatch.what]}."
        ]
    return lines + [f"  rank {c.rank}: {_call_text(c)}" for c in mismatch.calls]


def _ranks(ranks: list[int]) -> str:
    """'rank 1', 'ranks 0 and 1', 'ranks 0, 2 and 3'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _endless_loop(running: list[int], waiting: list[int], calls: dict, stacks: dict, window: float) -> str:
    """Ranks still running at the deadline, in Python or still making calls: a loop that never
    ends (not a deadlock, however their last call looked), with the student's line."""
    where = next((f", in {stacks[r][-1][0]} (line {stacks[r][-1][1]})" for r in running if stacks.get(r)), "")
    communicating = [r for r in running if calls.get(r)]
    if communicating:
        r = communicating[0]
        what = (
            f"Not a deadlock: {_ranks(running)} kept making torch.distributed calls until the deadline "
            f"(rank {r}: {calls[r]:,} in the last {window:.2g} s){where}: an endless loop?"
        )
    else:
        what = (
            f"{_ranks(running).capitalize()} kept running Python code outside any torch.distributed call{where}: "
            "an endless loop, or a very long computation?"
        )
    if waiting:
        what += f"  ({_ranks(waiting).capitalize()} waited for {'it' if len(running) == 1 else 'them'} meanwhile.)"
    return (
        what
        + "  Check what ends the loop (does its condition ever change?), or raise timeout= if the work is just slow."
    )


def diagnose(states: dict, calls: dict[int, int] | None = None, stacks: dict | None = None, window: float = 0) -> str:
    """One sentence on the likely cause, from what each rank is blocked in; a rank that kept
    entering calls after the deadline (``calls``) or ran outside any call is looping, not blocked."""
    calls, stacks = calls or {}, stacks or {}
    running = [r for r, s in sorted(states.items()) if s != "finished" and (s is None or calls.get(r))]
    waiting = {r: s for r, s in states.items() if isinstance(s, trace.Blocked) and r not in running}
    finished = [r for r, s in states.items() if s == "finished"]
    if running:
        return _endless_loop(running, sorted(waiting), calls, stacks, window)

    def kind(s: trace.Blocked) -> str:
        op = s.op.split(":")[-1]
        return "recv" if op in ("recv", "irecv") else "send" if op in ("send", "isend") else op

    for r, s in waiting.items():
        if kind(s) in ("recv", "send") and s.peer in finished:
            verb = "a message from" if kind(s) == "recv" else "to send to"
            return (
                f"Rank {r} waits {verb} rank {s.peer}, but rank {s.peer} already returned: a matching "
                f"{'send' if kind(s) == 'recv' else 'recv'} is missing (or uses another rank or tag)."
            )
    for r, s in waiting.items():
        other = waiting.get(s.peer) if s.peer is not None else None
        if other is not None and other.peer == r and {kind(s), kind(other)} == {"send", "recv"} and s.tag != other.tag:
            return (
                f"Ranks {r} and {s.peer} talk to each other with different tags ({s.tag} and {other.tag}): "
                f"a recv only matches a send with the same tag."
            )
    joining = [r for r, s in waiting.items() if s.op == "init_process_group"]
    if joining:
        return (
            f"Rank(s) {joining} were still joining the process group: the machine may be overloaded; "
            f"try again, or raise timeout=."
        )
    setup = [r for r, s in waiting.items() if s.op in trace.SETUP_OPS]
    if setup:
        return (
            f"Rank(s) {setup} wait in {waiting[setup[0]].op}: every rank of the world must call "
            f"dist.new_group (with the same ranks, in the same order), even ranks that are not in the new group."
        )
    kinds = {kind(s) for s in waiting.values()}
    if kinds == {"recv"}:
        return (
            "Every rank is waiting to receive and no rank is sending: a deadlock.  Let one side send "
            "first (e.g. even ranks send then receive, odd ranks receive then send), or post the "
            "sends with isend before receiving."
        )
    if kinds == {"send"}:
        return (
            "Every rank is sending and no rank is receiving: a deadlock (a blocking send waits for the "
            "matching receive).  Order the calls so that each send meets a receive, or use isend/irecv."
        )
    collectives = {kind(s) for s in waiting.values()} - {"recv", "send"}
    groups = {s.group for s in waiting.values() if kind(s) in collectives}
    if collectives and len(groups) > 1:
        where = "; ".join(
            f"rank {r} in {'the whole world' if s.group is None else 'group ' + str(list(s.group))}"
            for r, s in sorted(waiting.items())
        )
        return (
            f"The ranks wait in collectives of different groups ({where}): every rank of a group must call "
            "the same collectives in the same order (this one calls them on another group first)."
        )
    if collectives and (finished or len(kinds) > 1):
        return (
            "Some ranks are inside a collective that other ranks did not call (or called in another "
            "order): every rank of the group must call the same collectives in the same order."
        )
    return "The ranks are waiting on each other in a cycle: a deadlock."
