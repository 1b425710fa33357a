"""Lab 9: what ``OffloadAdam`` moved over the host link, and whether it moved the gradients during backward, as the
grader reads them (the grade's evidence), not as the link's log says.

``checks.check_offload`` and the self-check read ``HostLink.log``: the rank's own account, which a submission can
rewrite (a log of the right sizes and times, with nothing sent).  Under grading the same exercise is graded here.
One rank, forked for the run, trains the fp16 MLP of the test's widths with your ``OffloadAdam`` over a
``HostLink`` made with the grader's gate (``gate.py``): each copy's bytes go to the grader as the copy is asked for
(``Gate.link``).  In each step the grader holds the backward twice, answering each hold with a tensor drawn at
grading time and added to the gradient there:

1. **at its top** (the model's output): no parameter's gradient of the step exists before this answer;
2. **at the second linear layer's input** (``model[2]``): every layer above has its gradients, the first layer
   has none yet, and what the grader adds there enters only the first layer's.

So the grader knows, from its own reading, which copies came before the second hold's answer, and it recomputes
every gradient and weight (both answers added, Adam on fp32 master weights, in the grader kernel):

- ``check_offload``: per step, the gradients that went down are the model's fp16 gradients, each found whole
  (2Ψ bytes), and the weights that came up are the step's fp16 weights (2Ψ bytes); the model's weights at the end
  are Adam's on the device, bit for bit;
- ``check_overlap_held``: with ``overlap=True`` the gradients of every layer above the second hold had gone down
  before its answer (so from hooks during backward: a copy made after backward returns comes later, and no
  gradient of the step exists before the first hold's answer), and with ``overlap=False`` none had; either way the
  first layer's gradients, which hold the second answer, went down after it (the backward went on from the hold).

What this does not grade: the time the overlap saves (``checks.check_saving``: timed on the rank's clock, on an
emulated device and link that run inside the rank, so a submission could time itself as it likes): the exercise's
self-check shows it, against the α–β model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import checks, exercise, gate, models
from ...hostlink import HostLink
from ...network import Network
from .. import common
from .mixed import master_step

__all__ = ["check_offload_held", "check_overlap_held", "held_steps"]

ANSWER = 1e-3  # the scale of the grader's answers, about the gradients' own at the holds (fp16 keeps them)
BATCH = 64
TIMEOUT = 60  # seconds a run may take


class _Added(torch.autograd.Function):
    """Identity forward; its backward adds ``answer`` to the gradient (the grader's reference of a held backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
        ctx.answer = answer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad + ctx.answer.to(grad.device, grad.dtype), None


def held_steps(optimizer_class, steps: int, overlap: bool, latency: float, bandwidth: float, sizes: list) -> list:
    """In the rank (the driver calls it with your ``OffloadAdam``): ``steps`` steps on the fp16 MLP ``sizes`` over a
    ``HostLink`` whose copies also go to the grader's gate, each backward held at the model's output and at
    ``model[2]``'s input (see the module docstring).  Returns the model's parameters."""
    model = models.MLP(list(sizes), seed=0).half()
    data = models.regression_data(BATCH, sizes[0], sizes[-1], seed=1)
    x, y = data.x.half(), data.y
    door = gate.connect(0)
    if door is not None:
        door.start()  # (the grader's first answer: its rounds begin)
        door.at(model[2])
    with HostLink(Network(latency=latency, bandwidth=bandwidth), gate=door) as link:
        optimizer = optimizer_class(model, link, lr=1e-3, overlap=overlap)
        for _ in range(steps):
            optimizer.zero_grad()
            if door is not None:
                door.arm()  # (held at model[2]'s input, in this forward's backward)
            out = model(x)
            if door is not None:
                out = door.held(out)  # (and at the output: the first of the step's two holds)
            F.mse_loss(out.float(), y).backward()
            optimizer.step()
    if door is not None:
        door.close()
    return [p.detach().clone() for p in model.parameters()]


def _offload_driver(steps, overlap, latency, bandwidth, sizes):
    """Driver (runs in your kernel): your OffloadAdam on an fp16 MLP over the emulated host link, the grader reading
    what it carries and holding each step's backward twice."""
    from disttrain_lab.labtests.lab09.offload import held_steps

    return held_steps(OffloadAdam, steps, overlap, latency, bandwidth, sizes)  # noqa: F821  (the notebook's)


def _answers(steps: int, sizes: list) -> list[list[torch.Tensor]]:
    """Each hold's answer, drawn now (at grading time: no student process has them before the grader hands each
    over): per step, one at the output (batch, sizes[-1]) and one at model[2]'s input (batch, sizes[1])."""
    drawn = common.drawn()
    return [
        [ANSWER * torch.randn(BATCH, width, generator=drawn)] for _ in range(steps) for width in (sizes[-1], sizes[1])
    ]


def _reference(steps: int, sizes: list, answers: list) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Here (no student code): each step's fp16 gradients (the grader's answers added where the rank's backward is
    held) and fp16 weights after it, with Adam on fp32 master weights where the model is."""
    model = models.MLP(list(sizes), seed=0).half()
    data = models.regression_data(BATCH, sizes[0], sizes[-1], seed=1)
    x, y = data.x.half(), data.y
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    adam = torch.optim.Adam(master, lr=1e-3)
    grads, weights = [], []
    for step in range(steps):
        top, middle = answers[2 * step][0], answers[2 * step + 1][0]
        model.zero_grad(set_to_none=True)
        handle = model[2].register_forward_pre_hook(lambda _m, args, a=middle: (_Added.apply(args[0], a), *args[1:]))
        F.mse_loss(_Added.apply(model(x), top).float(), y).backward()
        handle.remove()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        master_step(model, master, adam)
        weights.append([p.detach().clone() for p in model.parameters()])
    return grads, weights


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def _held_run(overlap: bool, steps: int, latency: float, bandwidth: float, sizes: list, case: str):
    """The graded run and the grader's reference: (the rank's weights, the link's copies, grads, weights)."""
    if len(sizes) < 3:
        raise ValueError(f"sizes must make at least two linear layers (the second hold is at model[2]), got {sizes}")
    answers = _answers(steps, sizes)
    run = common.run_or_fail(
        _offload_driver,
        1,
        (steps, overlap, latency, bandwidth, list(sizes)),
        case,
        "does every step finish (zero_grad, backward, step)?",
        timeout=TIMEOUT,
        gate=answers,
    )
    held = [run.gate.ranks_held(h) for h in range(2 * steps)]
    assert all(h == (0,) for h in held), (
        f"{case}: the grader held the rank's backward at {sum(h == (0,) for h in held)} of its {2 * steps} holds (two "
        "a step: at the output, and at the second linear layer's input); does each step run one forward and one "
        "backward of the model?"
    )
    grads, weights = _reference(steps, sizes, answers)
    return run.results[0], run.gate.link_data(0), grads, weights


def check_offload_held(
    overlap: bool, steps: int = 3, latency: float = 10e-6, bandwidth: float = 2.5e10, sizes: list | None = None
) -> None:
    """Exercise 6, under grading, from what the grader read of the host link: each step's gradients went down (each
    parameter's fp16 gradient found whole, 2Ψ bytes in all) and its weights came up (each fp16 parameter after the
    step, 2Ψ bytes), and the model's weights at the end are Adam's on fp32 master weights on the device, bit for
    bit (see the module docstring)."""
    sizes = list(common.given("OFFLOAD_SIZES") if sizes is None else sizes)
    case = f"OffloadAdam(overlap={overlap}) on MLP {sizes}, {steps} steps"
    final, link, grads, weights = _held_run(overlap, steps, latency, bandwidth, sizes, case)
    for i, (w, r) in enumerate(zip(final, weights[-1])):
        checks.assert_close(
            w, r, rtol=0, atol=0, what=f"{case}: parameter {i}, against Adam on fp32 master weights on the device"
        )
    psi = sum(g.numel() for g in grads[0])
    for way, want_all in (("down", grads), ("up", weights)):
        total = sum(len(data) for direction, _, data in link if direction == way)
        assert total == steps * 2 * psi, (
            f"{case}: {total:,} B went {way} the link as the grader read it, expected 2Ψ per step = "
            f"{steps * 2 * psi:,} (fp16 {'gradients' if way == 'down' else 'weights'})"
        )
        for step, want in enumerate(want_all):
            # a step's copies: after its first hold's answer, before the next step's (holds 2·step + 1 and + 2)
            stream = b"".join(d for direction, h, d in link if direction == way and h in (2 * step + 1, 2 * step + 2))
            missing = [i for i, t in enumerate(want) if _as_bytes(t) not in stream]
            assert not missing, (
                f"{case}: step {step + 1}: parameters {missing}'s fp16 "
                + (
                    "gradients (with the grader's answers added where it held the backward) did not go down the link"
                    if way == "down"
                    else "weights after the step did not come up the link"
                )
                + f" between that step's backward and the next; {len(stream):,} B went {way} then: copy each "
                + ("parameter's .grad" if way == "down" else "updated master weight, as the parameter's dtype")
            )


def check_overlap_held(
    overlap: bool, steps: int = 2, latency: float = 10e-6, bandwidth: float = 2.5e10, sizes: list | None = None
) -> None:
    """Exercise 6's overlap: under grading, from what the grader read of the host link while it held each step's
    backward at the second linear layer's input (see the module docstring), every layer above it had sent its
    gradients down by then with ``overlap=True`` (from their post-accumulate-grad hooks), none had with
    ``overlap=False``; in the student's own kernel, from the link's log (``sent_during_backward``)."""
    sizes = list(common.given("OFFLOAD_SIZES") if sizes is None else sizes)
    case = f"OffloadAdam(overlap={overlap}) on MLP {sizes}, {steps} steps"
    if not exercise.graded():
        _, log, times, _ = exercise.run(
            "offload_run", 1, (steps, overlap, latency, bandwidth, sizes), timeout=TIMEOUT
        ).results[0]
        during = common.given("sent_during_backward")(log, times)
        assert all(during) if overlap else not any(during), (
            f"{case}: gradients handed to the link during each step's backward: {during}; "
            + ("send each one from its post-accumulate-grad hook" if overlap else "overlap=False sends them after it")
        )
        return
    _, link, grads, _ = _held_run(overlap, steps, latency, bandwidth, sizes, case)
    above = len(list(models.MLP(sizes)[0].parameters()))  # (the first layer's: the gradients below the hold)
    for step in range(steps):
        before = b"".join(d for direction, h, d in link if direction == "down" and h == 2 * step + 1)
        sent = [i for i, g in enumerate(grads[step]) if i >= above and _as_bytes(g) in before]
        if overlap:
            want = list(range(above, len(grads[step])))
            assert sent == want, (
                f"{case}: step {step + 1}: while the grader held the backward at the second linear layer's input, "
                f"the gradients of parameters {sent} of the layers above it had gone down the link, of {want}: "
                "with overlap=True start each gradient's copy in its post-accumulate-grad hook, as backward makes it"
            )
        else:
            assert not before, (
                f"{case}: step {step + 1}: {len(before):,} B went down the link while the grader held the backward; "
                "overlap=False sends the gradients after backward, in step()"
            )
        # the first layer's gradients hold the second answer: the backward went on below the hold after it was answered
        after = b"".join(d for direction, h, d in link if direction == "down" and h == 2 * step + 2)
        late = [i for i, g in enumerate(grads[step]) if i < above and _as_bytes(g) not in after]
        assert not late, (
            f"{case}: step {step + 1}: the gradients of parameters {late} of the first layer, with the grader's "
            "answer added at the second linear layer's input, did not go down the link after the grader answered "
            "there: did the backward go on from the grader's answer?"
        )
