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
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

KEY_PLACEHOLDER = "__DISTTRAIN_GUARD_KEY__"  # in guard_program.py: where program() puts the key
PROGRAM = Path(__file__).with_name("guard_program.py").read_text()


def program(key: bytes) -> str:
    """The guard's source to run in a kernel, signing its answers with ``key`` (fresh per kernel)."""
    return PROGRAM.replace(KEY_PLACEHOLDER, key.hex())


def signature(key: bytes, nonce: str, result: tuple) -> str:
    """What the guard's HMAC over ``(problems, notes, traced_bytes)`` must be (the grader's side)."""
    return hmac.new(key, (nonce + repr(result)).encode(), hashlib.sha256).hexdigest()
