"""Lab 9: what ``MixedPrecisionAdam`` holds after a backward, as the OS counts it (the grade's evidence).

``checks.check_mixed_precision`` reads what the rank counts of its tensors (``dl.memory.held``): the student's
picture, which a submission can rewrite. The grade on its memory rests on :func:`check_mixed_held` instead: one rank
forked fresh trains an fp16 MLP of 3 layers of 2048 × 2048 (Ψ = 12.6 M parameters) with the student's
``MixedPrecisionAdam`` (``torch.amp.GradScaler("cpu", init_scale=1.0)``: no step skipped) and waits twice at the
grader's gate, where the grader reads its private memory (as ``kept.py`` does): before the model is made, and after
the second step's backward (the loss of that step said first, recomputed by the grader: a step of Adam on fp32
master weights had run). Then it holds 2 + 2 bytes per parameter of fp16 parameters and gradients and 12 of fp32
master weights and Adam's two moments: 16Ψ, 201 MB. The second reading less the first must lie within ``LOW`` (15)
and ``HIGH`` (17.5) bytes per parameter (measured with the solution on this project's CI host: 16.18 in a graded
round trip, 16.26 at the gate in tests/labs/test_lab09.py, 16.52 in the student's own kernel; one that keeps an fp32
copy of the gradients, 20.27). An fp32 copy of the gradients kept (20 per parameter), master weights kept in fp16
(14), Adam's moments in fp16 (12) each fail; what the first reading could hide (memory made before it and freed
after, at most ``kept.BEFORE`` = 48 MiB less the fork's own, about 24 MiB: 2 bytes per parameter) does not reach a
kept fp32 gradient's 4. The losses of both steps and the weights after them must be those of Adam on fp32 master
weights in one process (torch's ``Adam``), so junk held to look like the state is no state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import exercise, gate, models, osmemory
from .. import common
from .kept import BEFORE, hold, readings, sums

__all__ = ["check_mixed_held", "mixed_step"]

SIZES = [2048, 2048, 2048, 2048]  # 3 layers of 2048 x 2048 (+ biases): Ψ = 12.6 M
BATCH = 8
LR = 1e-3
LOW, HIGH = 15.0, 17.5  # bytes per parameter the reading may show (16: 2 + 2 + 4 + 4 + 4)
TIMEOUT = 120


def _data(sizes: list, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(batch, sizes[0], generator=generator).half(), torch.randn(batch, sizes[-1], generator=generator)


def mixed_step(optimizer_class, sizes: list = SIZES, batch: int = BATCH) -> tuple[list[float], list]:
    """In the rank (a driver calls it): held at the grader's gate before the model is made, then two steps of an fp16
    ``models.MLP(sizes)`` with ``optimizer_class(model, lr=LR, scaler=GradScaler("cpu", init_scale=1.0))``, held
    again after the second step's backward (its loss said first).  Returns the two losses and each parameter's
    sums after the second step."""
    door = gate.connect(0)
    if door is not None:
        door.start()
    hold(door)  # read before the model is made
    model = models.MLP(sizes, seed=0).half()
    optimizer = optimizer_class(model, lr=LR, scaler=torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000))
    x, y = _data(sizes, batch)
    losses = []
    for step in range(2):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        losses.append(loss.item())
        optimizer.backward(loss)
        if step == 1:
            if door is not None:
                door.say(loss.item())
            hold(door)  # read after a backward, Adam's state made by the first step
        optimizer.step()
    if door is not None:
        door.close()
    return losses, [sums(p) for p in model.parameters()]


def _mixed_driver(sizes, batch):
    """Driver (runs in your kernel): your MixedPrecisionAdam on an fp16 MLP, read by the grader before the model is
    made and after the second step's backward."""
    from disttrain_lab.labtests.lab09.mixed import mixed_step

    return mixed_step(MixedPrecisionAdam, sizes, batch)  # noqa: F821  (the notebook's)


def master_step(model: torch.nn.Module, master: list, adam: torch.optim.Optimizer) -> None:
    """The reference's step on fp32 master weights: the model's gradients as fp32, Adam, the model's weights back
    from the master copies (rounded to the model's dtype)."""
    for p, m in zip(model.parameters(), master):
        m.grad = p.grad.float()
    adam.step()
    adam.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p, m in zip(model.parameters(), master):
            p.copy_(m)


def _reference(sizes: list, batch: int) -> tuple[list[float], list]:
    """Here (no student code): the same two steps, Adam (torch's) on fp32 master weights of the fp16 model.  What
    it frees is returned to the OS (``osmemory.returning``): in the student's own kernel, freed memory kept in the
    kernel's heap would show in the next fresh rank's count (it reuses, writes and frees it there)."""
    with osmemory.returning():
        model = models.MLP(sizes, seed=0).half()
        master = [p.detach().float().requires_grad_() for p in model.parameters()]
        adam = torch.optim.Adam(master, lr=LR)
        x, y = _data(sizes, batch)
        losses = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x).float(), y)
            losses.append(loss.item())
            loss.backward()
            master_step(model, master, adam)
        weights = [sums(p) for p in model.parameters()]
        del model, master, adam, loss
    return losses, weights


def check_mixed_held(sizes: list = SIZES, batch: int = BATCH) -> None:
    """Exercise 3, from the OS: your ``MixedPrecisionAdam`` on an fp16 MLP of ``sizes`` (Ψ = 12.6 M), on one rank
    forked fresh: its private memory after the second step's backward, less before the model was made, 15 to 17.5
    bytes per parameter (16: fp16 parameters and gradients, fp32 master weights and Adam's moments), at most 48 MiB
    before; the losses (the second said before the reading) and the weights after two steps those of torch's Adam
    on fp32 master weights here."""
    psi = sum(a * b + b for a, b in zip(sizes, sizes[1:]))
    case = f"MixedPrecisionAdam on an fp16 MLP {sizes} (Ψ = {psi / 1e6:.1f} M), 2 steps"
    graded = exercise.graded()
    run = common.run_or_fail(
        _mixed_driver,
        1,
        (sizes, batch),
        case,
        "do zero_grad, backward and step finish?",
        timeout=TIMEOUT,
        memory=True,
        gate=[[None], [None]] if graded else None,
    )
    losses, weights = run.results[0]
    want_losses, want_weights = _reference(sizes, batch)
    before, after = readings(run, case, want_losses[1], "after the second step's backward", 1e-3)
    for step, (got, want) in enumerate(zip(losses, want_losses)):
        assert abs(got - want) <= 1e-3 * max(1.0, abs(want)), (
            f"{case}: the loss of step {step + 1} was {got:.6g}; Adam on fp32 master weights gives {want:.6g}"
        )
    for i, ((total, _, squares), (want_total, magnitude, want_squares)) in enumerate(zip(weights, want_weights)):
        near = abs(total - want_total) <= 1e-3 * magnitude + 1e-6
        assert near and abs(squares - want_squares) <= 1e-3 * want_squares, (
            f"{case}: parameter {i} after 2 steps: sum {total:.6g}, sum of squares {squares:.6g}; Adam on fp32 master "
            f"weights, rounded to fp16, gives {want_total:.6g} and {want_squares:.6g}"
        )
    # under grading the ranks are forked from a kernel that has used no GPU; in the student's own kernel after CUDA
    # they are fresh interpreters, whose imports alone are hundreds of MiB: the bound is the grader's (see above)
    if exercise.graded():
        assert before <= BEFORE, (
            f"{case}: the rank held {before / 2**20:,.1f} MiB before the model was made, as the OS counts its private "
            f"memory; the test allows {BEFORE / 2**20:g} MiB"
        )
    per = (after - before) / psi
    assert LOW <= per <= HIGH, (
        f"{case}: the rank held {(after - before) / 2**20:,.1f} MiB more after the second step's backward than before "
        f"the model was made ({per:.2f} bytes per parameter), as the OS counts its private memory; MixedPrecisionAdam "
        f"keeps 2 + 2 bytes per parameter of fp16 parameters and gradients and 12 of fp32 master weights and Adam's "
        f"moments (16), and the test allows {LOW:g} to {HIGH:g}"
        + (": keep no fp32 copy of the gradients between steps" if per > HIGH else "")
        + (": are the master weights and Adam's moments fp32?" if per < LOW else "")
    )
    if not graded:  # (the student's own kernel: show what it read)
        print(f"{case}: held {per:.2f} bytes per parameter after a backward, as the OS counts it (16)")
