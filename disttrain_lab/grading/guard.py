"""The grading guard that runs inside a graded kernel: its program is ``guard_program.py``,
which ``program(key)`` reads as text and ``execute.RobustExecute`` sends into each kernel
before any student code (it is never imported, by the grader or by a student).

Before each graded test cell ``before_test(names)`` puts back what a solution cell could
have changed to turn a failing test into a passing one:

* IPython's hooks: custom exception handlers, ``events`` callbacks (``post_run_cell`` ...),
  input and AST transformers, the display hook and formatters, a trace function,
  ``builtins.__import__``, methods set on the shell or its classes;
* the modules in ``sys.modules`` and the names the test cell uses for them (``checks``,
  ``dl``, ``torch``, ``dist`` ...), and names bound by the instructor's locked cells;
* the functions of ``torch.distributed`` and ``disttrain_lab``: identity *and* code
  objects (``__code__``, ``__defaults__``, ``__kwdefaults__``); the methods of the kit's
  classes (``Run.bytes_sent`` ...) and the modules its modules call (``launcher.tracer``).

It returns ``(problems, notes)``: problems fail the test (a replaced kit or torch
function: the result cannot be trusted), notes are only reported (the genuine object was
put back, so the test itself decides).  ``after_test(names)`` runs right after the test
cell: anything changed *while the test ran* is a problem, so the cell fails.

Both also answer how many point-to-point bytes the traced launches so far claim to have
sent over gloo (every ``Run`` that ``dl.launch`` returns is shown to the guard through
``disttrain_lab.trace._RUN_OBSERVERS``): the grader compares the growth of that count over a
test cell with the bytes the operating system counted on the ranks' network in the same
time, so a trace whose events were forged (sends that never happened) fails the test.

Its answers are signed: the grader sends the guard a fresh key with its source and a fresh
nonce with every call, and the guard returns ``(problems, notes, traced_bytes, hmac)``.  A solution cell
that replaces how IPython evaluates the grader's expression (``shell.user_expressions``, the
formatters) to answer "nothing changed" cannot sign that answer, so the test fails.

This is in-kernel defence: it stops every hook and rebinding a notebook can do through
public APIs; code that digs into the guard's own state (``gc``, frames, ``ctypes``) is out
of its reach and is flagged for a human by ``submission.scan_submission``.

The grader's side is here too: ``program`` and ``signature``, and ``ask`` / ``answer``, the
client that calls the guard in a kernel and checks its signed answer.
"""

from __future__ import annotations

import ast
import hashlib
import hmac
import secrets
from collections.abc import Callable
from pathlib import Path

# (problems, notes, traced bytes): what the guard answers, as the grader reads it
Answer = tuple[list[str], list[str], int | None]

KEY_PLACEHOLDER = "__DISTTRAIN_GUARD_KEY__"  # in guard_program.py: where program() puts the key
PROGRAM = Path(__file__).with_name("guard_program.py").read_text()


def program(key: bytes) -> str:
    """The guard's source to run in a kernel, signing its answers with ``key`` (fresh per kernel)."""
    return PROGRAM.replace(KEY_PLACEHOLDER, key.hex())


def signature(key: bytes, nonce: str, result: tuple) -> str:
    """What the guard's HMAC over ``(problems, notes, traced_bytes)`` must be (the grader's side)."""
    return hmac.new(key, (nonce + repr(result)).encode(), hashlib.sha256).hexdigest()


# Run by the grader when the guard's answer was forged: drop the shell's own methods that
# a solution cell shadowed on the instance (user_expressions evaluates the guard's call).
REPAIR_SHELL = (
    "_ip = get_ipython()\n"
    "for _n in ('user_expressions', 'run_cell', 'run_cell_async', 'run_ast_nodes', 'run_code', 'ev', 'ex',\n"
    "           'showtraceback', '_showtraceback', 'set_custom_exc', 'transform_cell'):\n"
    "    vars(_ip).pop(_n, None)\n"
    "del _ip, _n\n"
)


def call(function: str, names: list[str], *extra: str) -> str:
    """The expression that calls the guard's ``function`` in the kernel."""
    args = ", ".join([repr(names), *map(repr, extra)])
    return f"__import__('sys').modules['_disttrain_grading_guard'].{function}({args})"


def ask(run_quietly: Callable[..., dict | None], key: bytes, function: str, names: list[str]) -> Answer:
    """(problems, notes, traced bytes) from one call of the guard, its signature checked;
    ``run_quietly(code, timeout=, expression=)`` runs code in the kernel and returns the
    reply's content (None when none came in time)."""
    nonce = secrets.token_hex(16)
    reply = run_quietly("", timeout=30, expression=call(function, names, nonce))
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
    if not (isinstance(mac, str) and hmac.compare_digest(mac, signature(key, nonce, (problems, notes, traced)))):
        return ["grading guard (its answer was not the guard's own: IPython's evaluation was replaced)"], [], None
    return [str(p) for p in problems], [str(n) for n in notes], traced if isinstance(traced, int) else None


def answer(run_quietly: Callable[..., dict | None], key: bytes, function: str, names: list[str]) -> Answer:
    """``ask``; an answer that is not the guard's own (signed) is a problem, and the grader
    then puts back IPython's own evaluation methods and asks once more, so that later tests
    are graded on their merits."""
    problems, notes, traced = ask(run_quietly, key, function, names)
    if problems and problems[0].startswith("grading guard"):
        run_quietly(REPAIR_SHELL, timeout=30)
        again, notes, traced = ask(run_quietly, key, function, names)
        problems = (
            problems + [p for p in again if not p.startswith("grading guard")]
            if not (again and again[0].startswith("grading guard"))
            else again
        )
    return problems, notes, traced
