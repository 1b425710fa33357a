"""Lab 9: what recomputation keeps for backward, as the OS counts it (the grade's evidence), not as the rank says.

``checks.check_checkpoint`` and ``check_recompute`` read what the rank counts of autograd's saved tensors
(``dl.memory.SavedActivations``) and of its blocks' forward calls: the student's picture, which a submission
can rewrite.  The grade on memory rests on :func:`check_kept` instead.  The grader runs a 2-block GPT of
(s, b, h, a) = ``SHAPE`` = (1024, 1, 512, 16) on one rank forked fresh for the run, each block's softmax output
(a·s²·b fp32 values, 64 MiB) far above the process's own noise, and reads the rank's private memory
(``/proc/<pid>/smaps_rollup``) twice, while the rank waits at the grader's gate (``gate.py``; the grader checks
from ``/proc`` that its main thread is blocked reading the gate, the same wait before and after the reading):

1. **before the forward**, the model and tokens made: at most the model's parameters + ``BEFORE`` (48 MiB);
2. **where backward begins**: the forward done, its loss said to the grader first (``Gate.say``: the grader
   recomputes it), and the backward held at the final LayerNorm's input, before any block's backward; the
   grader's answer there, a tensor drawn at grading time, is added to that gradient, so the blocks' backward ran
   after the reading (their gradients must be the grader's run with the answer added).

The second reading less the first is what autograd keeps for backward, plus the rank's own noise.  Against the
kit's count made here of what each way keeps (``memory.SavedActivations`` of the plain model; selective: less
the two blocks' softmax outputs and masks; full and ``checkpoint``: less everything inside the blocks, plus their
two inputs), measured with the solution at the grader's gate on this project's CI host (in a graded round trip and in
tests/labs/test_lab09.py, within 0.3 MiB of each other):

=============  ============  ============  ====================
way            kept (kit)    read          allowed
=============  ============  ============  ====================
none           198.1 MiB     200.0 MiB     kit − 8 .. kit + 16
selective      68.1 MiB      70.3 MiB      kit − 8 .. kit + 16
full           8.0 MiB       9.9 MiB       at most kit + 16
checkpoint     8.0 MiB       9.6 MiB       at most kit + 16
=============  ============  ============  ====================

Before the forward it held 47 to 50 MiB (the parameters 26.2 MiB; the rest is the fork's, more where the process it
was forked from writes much meanwhile: a page that process writes after the fork becomes this one's alone).  So
an identity ``checkpoint`` (everything kept: +190 MiB), a "selective" that recomputes nothing (+130), a "full"
that recomputes attention's core alone (+60) each fails by more than the margins plus what memory made before
the first reading and freed during the forward could hide (``BEFORE`` less the fork's own: about 24 MiB).  That
the forward ran twice needs no count: a checkpointed block that kept nothing and still gives the right gradients
has run its forward again.  What this does not see: a rank that keeps its activations outside itself while it
waits (a file it wrote), which the lab's rules forbid, and a "selective" that recomputes the whole block but
holds 60 MiB of something else to look like it: the grade reads memory, not what backward computed
(docs/architecture.md).

In the student's own notebook no grader holds a gate: the rank pauses in ``time.sleep`` at the same two places
instead (``osmemory.pause``), and the kernel reads it there (``run.memory``), with no answer to add.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ... import checks, exercise, gate, memory, models, osmemory
from .. import common
from ..common import sums

__all__ = ["BEFORE", "PAUSE_S", "SHAPE", "check_kept", "hold", "kept_step", "readings", "sums"]

SHAPE = (1024, 1, 512, 16)  # (s, b, h, a): each block's softmax output 64 MiB (a·s²·b fp32 values)
BEFORE = 48 * 2**20  # the most a rank may hold before the forward above its model's parameters
BELOW, ABOVE = 8 * 2**20, 16 * 2**20  # what the reading may fall below and rise above the kit's count of what is kept
PAUSE_S = 30.0  # the longest pause in the student's own kernel (its watch ends it once it has read the rank)
TIMEOUT = 120  # seconds a run may take
WAYS = ("checkpoint", "none", "selective", "full")


class _PauseInBackward(torch.autograd.Function):
    """Identity forward; its backward pauses where the kernel's watch reads the rank (the student's own notebook)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        osmemory.pause(PAUSE_S)
        return grad


def kept_step(forward: Callable, prepare: Callable, seed: int, shape: tuple = SHAPE) -> tuple[float, dict]:
    """In the rank (a driver calls it): a 2-block ``models.GPT`` of ``shape`` (``prepare(model)`` first), held at
    the grader's gate before ``forward(model, tokens)`` and where backward begins (see the module docstring), then
    backward.  Returns the loss and each gradient's sums (``sums``: a few numbers, so that the kernel that relays
    them allocates little that a later fresh rank could count as its own)."""
    s, b, h, a = shape
    cfg = models.GPTConfig(vocab=32, seq_len=s, d_model=h, n_heads=a, n_layers=2)
    model = prepare(models.GPT(cfg, seed=seed))
    tokens = torch.randint(0, cfg.vocab, (b, s), generator=torch.Generator().manual_seed(seed))
    door = gate.connect(0)
    if door is not None:
        door.start()  # (a mark: the grader counts the rank's bytes from here)
    hold(door)  # read before the forward
    if door is not None:
        door.at(model.norm)
        door.arm()  # read where backward begins, held until the grader's answer
    else:
        model.norm.register_forward_pre_hook(lambda module, args: (_PauseInBackward.apply(args[0]), *args[1:]))
    loss = models.lm_loss(forward(model, tokens), torch.roll(tokens, -1, dims=1))
    if door is not None:
        door.say(loss.item())
    loss.backward()
    if door is not None:
        door.close()
    return loss.item(), {name: sums(p.grad) for name, p in model.named_parameters()}


def _kept_driver(way, seed, shape):
    """Driver (runs in your kernel): a 2-block GPT through your checkpoint around each block, or your
    recompute_forward in mode ``way`` with torch's checkpoint, read by the grader before the forward and where
    backward begins."""
    from disttrain_lab.labtests.lab09.kept import kept_step

    if way == "checkpoint":
        return kept_step(checkpointed_blocks, lambda m: use_attention(m, math_attend), seed, shape)  # noqa: F821
    torchs = lambda fn, *args: torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)  # noqa: E731
    return kept_step(lambda m, t: recompute_forward(m, t, way, torchs), lambda m: m, seed, shape)  # noqa: F821


def _reference(seed: int, shape: tuple, answer: torch.Tensor | None) -> tuple[float, dict, dict]:
    """Here (no student code): the plain model with the lab's math attention (its given ``use_attention`` and
    ``math_attend``): its loss, its gradients with ``answer`` added where the rank's backward is held, and the
    kit's count of what autograd saved, by module."""
    s, b, h, a = shape
    cfg = models.GPTConfig(vocab=32, seq_len=s, d_model=h, n_heads=a, n_layers=2)
    with osmemory.returning():  # (in the student's kernel: freed here, not in the next fresh rank's count)
        model = common.given("use_attention")(models.GPT(cfg, seed=seed), common.given("math_attend"))
        tokens = torch.randint(0, cfg.vocab, (b, s), generator=torch.Generator().manual_seed(seed))
        if answer is not None:

            def add_answer(module, args):
                args[0].register_hook(lambda g: g + answer)

            model.norm.register_forward_pre_hook(add_answer)
        with memory.SavedActivations(model) as saved:
            logits = model(tokens)
        loss = models.lm_loss(logits, torch.roll(tokens, -1, dims=1))
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        said, by_layer = loss.item(), dict(saved.by_layer)
        del model, logits, loss
    return said, grads, by_layer


def kept_by(way: str, by_layer: dict, shape: tuple) -> int:
    """What ``way`` keeps for backward, from the kit's count of the plain model's ``by_layer``."""
    s, b, h, a = shape
    plain = sum(by_layer.values())
    if way == "none":
        return plain
    if way == "selective":  # each block's softmax output (4·a·s²·b B) and mask (s² B) recomputed
        return plain - 2 * (4 * a * s * s * b + s * s)
    inside = sum(v for k, v in by_layer.items() if k.startswith("blocks"))
    return plain - inside + 2 * 4 * s * b * h  # the two blocks' inputs instead of what is inside them


def _answer(shape: tuple) -> torch.Tensor:
    """A tensor drawn now (at grading time: no student process has it) for the held gradient, (b, s, h)."""
    s, b, h, _ = shape
    return 1e-4 * torch.randn(b, s, h, generator=common.drawn())


def check_kept(way: str, seed: int = 0, shape: tuple = SHAPE) -> None:
    """Exercises 4 and 5, from the OS: ``way`` "checkpoint" (your ``checkpoint`` around each block,
    ``checkpointed_blocks``) or a ``recompute_forward`` mode ("none", "selective", "full", with torch's
    checkpoint) on a 2-block GPT of ``shape``, on one rank forked fresh: the rank's private memory where backward
    begins, less before the forward, within 8 MiB below and 16 MiB above what that way keeps (the kit's count
    made here: see the module docstring), at most the parameters + 48 MiB before the forward; the loss said
    before the reading and the gradients (with the grader's answer added where backward was held) those of the
    plain model here."""
    if way not in WAYS:
        raise ValueError(f"way must be one of {WAYS}, got {way!r}")
    s, b, h, a = shape
    what = "your checkpoint around each block" if way == "checkpoint" else f"recompute_forward(mode={way!r})"
    case = f"{what} on a 2-block GPT, (s, b, h, a) = {shape}"
    answer = _answer(shape) if exercise.graded() else None
    run = common.run_or_fail(
        _kept_driver,
        1,
        (way, seed, shape),
        case,
        "does the forward finish?",
        timeout=TIMEOUT,
        memory=True,
        gate=None if answer is None else [[None], [answer]],
    )
    (loss, grads) = run.results[0]
    want_loss, want_grads, by_layer = _reference(seed, shape, answer)
    before, at_backward = readings(run, case, want_loss, "before backward began", 1e-4)
    parameters = sum(4 * p.numel() for p in want_grads.values())
    # under grading the ranks are forked from a kernel that has used no GPU; in the student's own kernel after CUDA
    # they are fresh interpreters, whose imports alone are hundreds of MiB: the bound is the grader's (see above)
    if exercise.graded():
        assert before <= parameters + BEFORE, (
            f"{case}: the rank held {before / 2**20:,.1f} MiB before the forward, as the OS counts its private memory; "
            f"the model's parameters are {parameters / 2**20:,.1f} MiB and the test allows {BEFORE / 2**20:g} MiB more"
        )
    kept, want = at_backward - before, kept_by(way, by_layer, shape)
    low = -float("inf") if way in ("checkpoint", "full") else want - BELOW
    assert low <= kept <= want + ABOVE, (
        f"{case}: the rank held {kept / 2**20:,.1f} MiB more where backward begins than before the forward, as the "
        f"OS counts its private memory; {way} keeps {want / 2**20:,.1f} MiB for backward (the plain model "
        f"{sum(by_layer.values()) / 2**20:,.1f} MiB, each block's softmax output {4 * a * s * s * b / 2**20:g} MiB), "
        f"and the test allows "
        + (f"{BELOW / 2**20:g} MiB less and " if low > -float("inf") else "")
        + f"{ABOVE / 2**20:g} MiB more"
        + _which(kept, by_layer, shape)
    )
    checks.assert_close(
        torch.tensor(loss), torch.tensor(want_loss), rtol=1e-5, atol=1e-6, what=f"{case}: the loss, the model's own"
    )
    for name, g in want_grads.items():
        # (an element within 1e-4 of its own size or 1e-6, as the checks above hold whole gradients: the sums alike)
        (total, _, squares), (want_total, want_magnitude, want_squares) = grads[name], sums(g)
        close = math.isclose(total, want_total, abs_tol=1e-4 * want_magnitude + 1e-6 * g.numel())
        assert close and math.isclose(squares, want_squares, rel_tol=3e-4, abs_tol=1e-12 * g.numel()), (
            f"{case}: the gradient of {name}: sum {total:.6g}, sum of squares {squares:.6g}; the plain model's "
            + ("with the grader's answer added where backward was held " if answer is not None else "")
            + f"{want_total:.6g} and {want_squares:.6g}"
        )
    if run.gate.source == "none":  # (the student's own kernel: show what it read)
        print(
            f"{case}: held {before / 2**20:,.1f} MiB before the forward (parameters {parameters / 2**20:,.1f}), "
            f"kept {kept / 2**20:,.1f} MiB for backward, as the OS counts it ({way}: {want / 2**20:,.1f})"
        )


def readings(run: exercise.ExerciseRun, case: str, loss: float, when: str, rtol: float) -> tuple[int, int]:
    """The rank's private memory at its two holds (under grading: the grader's readings at its gate, the loss the
    rank said before the second within ``rtol`` of ``loss``, the grader's own; in the student's own kernel: its
    watch's, at the driver's two pauses)."""
    seen = run.gate
    if seen.source != "none":
        said = seen.said(1)
        assert len(said) == 1 and abs(said[0] - loss) <= rtol * max(1.0, abs(loss)), (
            f"{case}: the rank said the loss was {list(said)} {when}; the model's loss is {loss:.6g}: did it run "
            "before the grader read the memory?"
        )
        return seen.memory_at(0), seen.memory_at(1)
    if not run.memory.later:
        raise AssertionError(f"{case}: the rank's memory was read {1 if run.memory.bytes else 0} times, not twice")
    return run.memory.of(0), run.memory.later[0].of(0)


def hold(door: gate.Gate | None) -> None:
    """In the rank: wait at the grader's gate, where it reads this rank's memory; in the student's own kernel (no
    gate), pause where the kernel's watch reads it."""
    if door is not None:
        door.hold()
    else:
        osmemory.pause(PAUSE_S)


def _which(kept: int, by_layer: dict, shape: tuple) -> str:
    """Which way's memory ``kept`` looks like, where it is another's."""
    for way in ("none", "selective", "full"):
        want = kept_by(way, by_layer, shape)
        if want - BELOW <= kept <= want + ABOVE:
            return f": that is what {way!r} keeps"
    return ""
