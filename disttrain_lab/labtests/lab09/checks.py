"""Lab 9's graded tests (memory): each check runs the student's code on one rank in a *driver* (a
function below whose source ``exercise.run`` sends to the student's kernel, where it is defined among
the notebook's names), and compares what came back with references computed here: what autograd saved, read
from the graph's own nodes (``saved_by_the_graph``, not the kit's ``dl.memory.SavedActivations``), torch's own
``GradScaler`` and
``torch.utils.checkpoint``, Adam on fp32 master weights where the model is, and the lab's α–β model of
overlapping.  What a test measures, and how, is the lab's given code (its locked cells: ``gpt_step``,
``train_with_scaler``, ``mixed_precision_run``, ``offload_run``, ``offload_turns`` ...): a driver calls
it in the ranks, and a check takes it from the notebook (``common.given``) for the references, as the
graded cells did when they held these checks.

A driver uses only the notebook's names (the student's classes and functions, the given code,
``torch``, ``models`` of the setup cell) and imports what it needs of this module inside its body."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.utils.checkpoint

from ... import checks, exercise, models
from .. import common
from . import offload
from .kept import kept_by

__all__ = [
    "check_checkpoint",
    "check_checkpoint_args",
    "check_loss_scaler",
    "check_mixed_precision",
    "check_mode_error",
    "check_offload",
    "check_recompute",
    "check_saved_bytes",
    "saved_by_the_graph",
    "check_saving",
    "check_scaler_pattern",
    "pattern_scales",
]

TIMEOUT = 60  # seconds a test's run may take


def _run(driver: Callable, args: tuple, case: str) -> list:
    """``driver`` on one rank: its result; a run that does not finish fails the test, saying which case."""
    try:
        return exercise.run(driver, 1, args, timeout=TIMEOUT).results[0]
    except exercise.ExerciseTimeout as e:
        raise AssertionError(f"{case} did not finish within {TIMEOUT} s\n{e}") from None


# --------------------------------------------------------------------------------------
# What the drivers import in the ranks (public: code that runs elsewhere uses it, the hidden
# tests' own drivers too; none of it uses the notebook's names)
# --------------------------------------------------------------------------------------
def pattern_scales(scaler, pattern: str) -> list[float]:
    """The scale after each step of ``pattern`` ("O": a gradient overflows, ".": a good step), with
    ``scaler`` (a ``DynamicLossScaler`` or a ``torch.amp.GradScaler``) stepping a one-parameter SGD:
    each step scales a loss, backpropagates it, makes the gradient ``inf`` where the pattern says so,
    then ``step`` and ``update``."""
    if set(pattern) - {"O", "."}:
        raise ValueError(f"a pattern holds 'O' (an overflow) and '.' (a good step) only, got {pattern!r}")
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    scales = []
    for step in pattern:
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(weight.sum()).backward()
        if step == "O":
            with torch.no_grad():
                weight.grad.fill_(float("inf"))
        scaler.step(optimizer)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return scales


def _block_and_input(s, b, h, a, seed=0):
    """One block of a models.GPT of this shape, and an input that requires grad."""
    cfg = models.GPTConfig(vocab=8, seq_len=s, d_model=h, n_heads=a, n_layers=1)
    x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    return models.GPT(cfg, seed=seed).blocks[0], x


def saved_by_the_graph(module: torch.nn.Module, inputs: tuple) -> int:
    """The bytes of the distinct storages autograd saved for the backward of ``module(*inputs)``, the module's
    parameters left out, read from the graph itself: every node reachable from the output, and each tensor it
    exposes as a ``_saved_*`` attribute (torch's generated nodes name every variable they saved so).  A count
    independent of the hooks the exercise asks for (``saved_tensors_hooks``, and the kit's ``SavedActivations``
    built on them), so that neither is the grader's answer; the two agree on every case graded."""
    parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
    with torch.enable_grad():
        out = module(*inputs)
    stack = [o.grad_fn for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    seen: dict[int, int] = {}
    visited: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except RuntimeError:  # (a saved value that cannot be unpacked here: none of the graded modules')
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in parameters:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return sum(seen.values())


def module_and_inputs(case):
    """The module ``case`` = (kind, shape) names and its inputs: one GPT block of (s, b, h, a), an MLP of
    those sizes on 5 rows, or a Linear(in, out) on 3 rows."""
    kind, shape = case
    if kind == "block":
        module, x = _block_and_input(*shape)
        inputs = (x,)
    elif kind == "mlp":
        module, inputs = models.MLP(list(shape), seed=0), (torch.randn(5, shape[0], requires_grad=True),)
    else:
        module, inputs = torch.nn.Linear(*shape), (torch.ones(3, shape[0], requires_grad=True),)
    return module, inputs


# --------------------------------------------------------------------------------------
# Drivers: run in the student's kernel, among the notebook's names (their source is sent)
# --------------------------------------------------------------------------------------
def _saved_bytes_of(case):
    """Driver (runs in your kernel): saved_bytes of a module built from `case`, and whether it changed it."""
    from disttrain_lab.labtests.lab09.checks import module_and_inputs

    module, inputs = module_and_inputs(case)
    before = [p.detach().clone() for p in module.parameters()]
    nbytes = saved_bytes(module, *inputs)  # noqa: F821  (the notebook's)
    return nbytes, all(torch.equal(p, q) for p, q in zip(before, module.parameters()))


def _scaler_run(options, steps):
    """Driver (runs in your kernel): train_with_scaler with your DynamicLossScaler."""
    return train_with_scaler(DynamicLossScaler(**options), steps)  # noqa: F821  (the notebook's)


def _scaler_pattern(options, pattern):
    """Driver (runs in your kernel): your DynamicLossScaler through the steps of ``pattern``."""
    from disttrain_lab.labtests.lab09.checks import pattern_scales

    return pattern_scales(DynamicLossScaler(**options), pattern)  # noqa: F821  (the notebook's)


def _mixed_run(steps, options, dtype):
    """Driver (runs in your kernel): the given mixed_precision_run with your MixedPrecisionAdam."""
    return mixed_precision_run(steps, options, dtype)  # noqa: F821  (the notebook's)


def _checkpoint_step(shape, seed):
    """Driver (runs in your kernel): gpt_step through your checkpoint around every block, and without
    (the same process: the same threads, so the same order of additions, bit for bit)."""
    return (
        gpt_step(checkpointed_blocks, math_attend, seed=seed, shape=shape),  # noqa: F821  (the notebook's)
        gpt_step(lambda m, t: m(t), math_attend, seed=seed, shape=shape),  # noqa: F821  (the notebook's)
    )


def _checkpoint_args_run():
    """Driver: checkpoint of a function with a tensor, a number and a tensor that needs no grad."""
    w = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    x = torch.linspace(-1, 1, 4 * 2).reshape(4, 2).requires_grad_()
    y = checkpoint(lambda x, k, c: torch.tanh(x @ w) * k + c, x, 3.0, torch.ones(3))  # noqa: F821  (the notebook's)
    y.sum().backward()
    return y.detach(), x.grad, w.grad


def _recompute_step(mode, shape, seed):
    """Driver (runs in your kernel): gpt_step through recompute_forward with torch's checkpoint."""
    step = lambda m, t: recompute_forward(  # noqa: F821  (the notebook's)
        m, t, mode, lambda fn, *args: torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)
    )
    return (
        gpt_step(step, seed=seed, shape=shape),  # noqa: F821  (the notebook's)
        gpt_step(lambda m, t: m(t), math_attend, seed=seed, shape=shape),  # noqa: F821  (the notebook's)
    )


def _recompute_mode(mode):
    """Driver (runs in your kernel): recompute_forward of a small GPT in ``mode``."""
    return recompute_forward(models.GPT(models.GPTConfig()), torch.zeros(1, 4, dtype=torch.long), mode)  # noqa: F821


def _offload(steps, overlap, latency, bandwidth, sizes):
    """Driver (runs in your kernel): the given offload_run with your OffloadAdam."""
    return offload_run(steps, overlap, latency, bandwidth, sizes)  # noqa: F821  (the notebook's)


def _offload_turns(pairs, sizes, latency, bandwidth, flops):
    """Driver (runs in your kernel): the given offload_turns with your OffloadAdam."""
    return offload_turns(pairs, sizes, latency, bandwidth, flops)  # noqa: F821  (the notebook's)


# --------------------------------------------------------------------------------------
# The checks, one or two per exercise
# --------------------------------------------------------------------------------------
def check_saved_bytes(case: tuple) -> None:
    """Exercise 1: ``saved_bytes(module, *inputs)`` of the module ``case`` = (kind, shape) names ("linear",
    "mlp" or "block") returns an int, the bytes autograd saved for its backward with each storage once and
    the module's parameters left out (read from the graph itself: ``saved_by_the_graph``), and leaves the module
    unchanged."""
    nbytes, unchanged = _run(_saved_bytes_of, (case,), f"saved_bytes on {case}")
    want = saved_by_the_graph(*module_and_inputs(case))  # (here, where no student code runs)
    assert isinstance(nbytes, int) and not isinstance(nbytes, bool), f"saved_bytes must return an int, got {nbytes!r}"
    assert unchanged, f"saved_bytes on {case}: the module's parameters changed"
    assert nbytes == want, (
        f"saved_bytes on {case}: {nbytes} B, but autograd saved {want} B (each storage once, "
        f"the module's parameters left out)"
    )


def check_loss_scaler(options: dict, steps: int = 12) -> None:
    """Exercise 2: ``DynamicLossScaler(**options)`` driving the given ``train_with_scaler`` for ``steps``
    steps takes and skips the same steps, keeps the same scales and gives the same master weights, bit for
    bit, as ``torch.amp.GradScaler("cpu", **options)``."""
    case = f"DynamicLossScaler({', '.join(f'{k}={v!r}' for k, v in options.items())}), {steps} steps"
    scales, stepped, master = _run(_scaler_run, (options, steps), case)
    want_scales, want_stepped, want_master = common.given("train_with_scaler")(
        torch.amp.GradScaler("cpu", **options), steps
    )
    assert list(stepped) == want_stepped, (
        f"{case}: steps taken {list(stepped)}, torch.amp.GradScaler's {want_stepped} "
        f"(skip the step when a gradient is inf or NaN after unscaling)"
    )
    assert list(scales) == want_scales, f"{case}: scales {list(scales)}, torch.amp.GradScaler's {want_scales}"
    for i, (a, b) in enumerate(zip(master, want_master)):
        checks.assert_close(a, b, rtol=0, atol=0, what=f"{case}: master weight {i} against GradScaler's")


def check_scaler_pattern(options: dict, pattern: str) -> None:
    """Exercise 2: ``DynamicLossScaler(**options)`` through the overflows of ``pattern`` ("O" overflows,
    "." a good step: ``pattern_scales``) keeps the scales ``torch.amp.GradScaler("cpu", **options)`` keeps:
    an overflow backs off *and* resets the count of good steps, so growth needs ``growth_interval`` good
    steps in a row."""
    case = f"DynamicLossScaler({', '.join(f'{k}={v!r}' for k, v in options.items())}) through {pattern!r}"
    got = _run(_scaler_pattern, (options, pattern), case)
    want = pattern_scales(torch.amp.GradScaler("cpu", **options), pattern)
    if list(got) != want:
        first = next(i for i, (a, b) in enumerate(zip(list(got) + [None] * len(want), want)) if a != b)
        raise AssertionError(
            f"{case}: scales {list(got)}, torch.amp.GradScaler's {want}; they part at step {first} "
            f"({pattern[: first + 1]!r}): after an overflow, back off and reset the count of good steps; grow "
            f"only after growth_interval good steps in a row"
        )


def check_mixed_precision(options: dict, steps: int = 12, dtype: str = "float16") -> None:
    """Exercise 3: ``MixedPrecisionAdam`` on a 16-bit model (the given ``mixed_precision_run``, with
    ``torch.amp.GradScaler("cpu", **options)``): in fp16, the scales and weights of fp32 master weights
    stepped by Adam (``train_with_scaler``), rounded; the parameters stay ``dtype``; in the student's own kernel
    also, by the rank's count (``dl.memory.held``), after a backward it holds 2 + 2 bytes per parameter of 16-bit
    parameters and gradients and 12 of master weights and Adam's moments (under grading that is read from the OS:
    ``mixed.check_mixed_held``)."""
    case = f"MixedPrecisionAdam, {dtype} model, GradScaler({options}), {steps} steps"
    scales, weights, held = _run(_mixed_run, (steps, options, dtype), case)
    want_scales, _, want_master = common.given("train_with_scaler")(torch.amp.GradScaler("cpu", **options), steps)
    if dtype == "float16":
        assert list(scales) == want_scales, f"{case}: scales {list(scales)}, the reference's {want_scales}"
        for i, (w, m) in enumerate(zip(weights, want_master)):
            checks.assert_close(
                w,
                m.half(),
                rtol=0,
                atol=0,
                what=f"{case}: parameter {i}, against fp32 master weights stepped by Adam, rounded to fp16",
            )
    psi, tensors = sum(w.numel() for w in weights), len(weights)
    assert all(w.dtype == getattr(torch, dtype) for w in weights), f"{case}: the model's parameters must stay {dtype}"
    if exercise.graded():  # the rank's own count is the student's self-check (the grade: mixed.check_mixed_held)
        return
    assert held["parameters"] == 2 * psi, (
        f"{case}: {held['parameters']} B of parameters, expected 2 per parameter ({2 * psi})"
    )
    assert held["gradients"] == 2 * psi, (
        f"{case}: {held['gradients']} B of gradients after backward, expected the "
        f"16-bit gradients only, 2 per parameter ({2 * psi}); keep no fp32 gradient"
    )
    state = held["optimizer_state"] + held["other"]
    assert 12 * psi <= state <= 12 * psi + 64 * tensors, (
        f"{case}: {state} B of optimizer state and master weights, expected 12 per parameter ({12 * psi}): "
        f"fp32 master weights and Adam's two moments"
    )


def check_checkpoint(shape: tuple = (64, 4, 64, 4), seed: int = 0) -> None:
    """Exercise 4: ``checkpoint`` around each block of a 2-block GPT of (s, b, h, a) = ``shape`` (the given
    ``gpt_step``, ``checkpointed_blocks``) gives the loss and gradients of no checkpointing bit for bit (in the
    same process), and the model's own here within a tolerance; in the student's own kernel also, by the rank's
    count, keeps nothing inside the blocks, only their two inputs, and runs each block's forward twice (under
    grading what it keeps is read from the OS: ``kept.check_kept``)."""
    case = f"checkpoint around each block of a 2-block GPT, (s, b, h, a) = {shape}"
    (kept, calls, loss, grads), (_, _, there_loss, there_grads) = _run(_checkpoint_step, (shape, seed), case)
    gpt_step, math_attend = common.given("gpt_step"), common.given("math_attend")
    model_kept, _, model_loss, model_grads = gpt_step(lambda m, t: m(t), math_attend, seed=seed, shape=shape)  # here
    s, b, h, a = shape
    if not exercise.graded():  # the rank's own counts: the student's self-check (the grade: kept.check_kept, the OS)
        assert calls == {0: 2, 1: 2}, (
            f"{case}: forward calls per block {calls}, expected 2 (the forward, then once in backward)"
        )
        inside = {k: v for k, v in kept.items() if k.startswith("blocks")}
        assert not inside, f"{case}: kept {inside} inside the blocks; a checkpointed block keeps nothing"
        assert kept.get("", 0) == 2 * 4 * s * b * h, (
            f"{case}: kept {kept.get('', 0)} B outside the modules, expected "
            f"the two blocks' inputs, 2 × 4·s·b·h = {2 * 4 * s * b * h} B"
        )
    assert loss == there_loss, f"{case}: loss {loss}, without checkpointing {there_loss}"
    for name, g in model_grads.items():
        checks.assert_close(
            grads[name],
            there_grads[name],
            rtol=0,
            atol=0,
            what=f"{case}: the gradient of {name}, against no checkpointing in the same process",
        )
        checks.assert_close(
            grads[name], g, rtol=1e-4, atol=1e-6, what=f"{case}: the gradient of {name}, against the model's own"
        )


def check_checkpoint_args() -> None:
    """Exercise 4: ``checkpoint(fn, x, 3.0, c)`` of a function with a tensor, a number and a tensor that
    needs no grad gives torch's ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` output and
    gradients (of the input and of the weight fn uses), bit for bit."""
    y, gx, gw = _run(_checkpoint_args_run, (), "checkpoint with non-tensor arguments")
    w = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    x = torch.linspace(-1, 1, 4 * 2).reshape(4, 2).requires_grad_()
    want = torch.utils.checkpoint.checkpoint(
        lambda x, k, c: torch.tanh(x @ w) * k + c, x, 3.0, torch.ones(3), use_reentrant=True
    )
    want.sum().backward()
    for got, ref, what in (
        (y, want.detach(), "the output"),
        (gx, x.grad, "the input's gradient"),
        (gw, w.grad, "the weight's gradient"),
    ):
        checks.assert_close(
            got, ref, rtol=0, atol=0, what=f"checkpoint(fn, x, 3.0, c): {what}, against torch.utils.checkpoint"
        )


def check_recompute(shape: tuple = (64, 4, 64, 4), seed: int = 0) -> None:
    """Exercise 5: ``recompute_forward`` of a 2-block GPT of (s, b, h, a) = ``shape`` with torch's checkpoint
    gives, in each mode, the model's own loss and gradients (bit for bit in the same process); in the student's
    own kernel also, by the rank's count, "none" keeps what the model keeps, "selective" that less the a·s×s
    softmax output and the mask of each block, one forward per block, "full" only the blocks' two inputs instead
    of what is inside them, two forwards per block (under grading what each keeps is read from the OS:
    ``kept.check_kept``)."""
    s, b, h, a = shape
    gpt_step, math_attend = common.given("gpt_step"), common.given("math_attend")
    model_kept, _, model_loss, model_grads = gpt_step(lambda m, t: m(t), math_attend, seed=seed, shape=shape)
    for mode in ("none", "selective", "full"):
        case = f"recompute_forward(mode={mode!r}) on a 2-block GPT, (s, b, h, a) = {shape}"
        (kept, calls, loss, grads), (_, _, there_loss, there_grads) = _run(_recompute_step, (mode, shape, seed), case)
        assert loss == there_loss, f"{case}: loss {loss}, the model's own forward {there_loss}"
        for name, g in model_grads.items():
            checks.assert_close(
                grads[name],
                there_grads[name],
                rtol=0,
                atol=0,
                what=f"{case}: the gradient of {name}, against the model's own in the same process",
            )
            checks.assert_close(
                grads[name], g, rtol=1e-4, atol=1e-6, what=f"{case}: the gradient of {name}, against the model's own"
            )
        if exercise.graded():  # the rank's own counts are the student's self-check (the grade: kept.check_kept)
            continue
        total, plain, expected = sum(kept.values()), sum(model_kept.values()), kept_by(mode, model_kept, shape)
        if mode == "none":
            assert total == plain, f"{case}: kept {total} B, the model's own forward {plain} B"
            assert calls == {0: 1, 1: 1}, f"{case}: forward calls per block {calls}, expected 1"
        elif mode == "selective":  # softmax output (4·a·s²·b B) and the mask gone; Q, K, V kept instead of their copies
            assert total == expected, (
                f"{case}: kept {total} B, expected {expected} B: no a·s×s softmax "
                f"output, Q, K and V kept for the recomputation"
            )
            assert calls == {0: 1, 1: 1}, (
                f"{case}: forward calls per block {calls}, expected 1 (only attention's core again)"
            )
        else:
            assert total == expected, (
                f"{case}: kept {total} B, expected {expected} B: nothing inside the blocks, "
                f"their two inputs ({2 * 4 * s * b * h} B) instead"
            )
            assert calls == {0: 2, 1: 2}, f"{case}: forward calls per block {calls}, expected 2"


def check_mode_error() -> None:
    """Exercise 5: any other mode (``"all"``) makes ``recompute_forward`` raise a ValueError that names the
    valid modes."""
    try:
        _run(_recompute_mode, ("all",), "recompute_forward(..., mode='all')")
    except exercise.ExerciseError as e:
        if e.exc_type != "ValueError":
            raise
        assert "selective" in e.exc_message, f"the ValueError should name the valid modes: {e.exc_message}"
        return
    raise AssertionError("recompute_forward(..., mode='all') should raise a ValueError naming the valid modes")


def check_offload(
    overlap: bool, steps: int = 3, latency: float = 10e-6, bandwidth: float = 2.5e10, sizes: list | None = None
) -> None:
    """Exercise 6: ``OffloadAdam(overlap=overlap)`` on the MLP ``sizes`` (the given ``OFFLOAD_SIZES``
    unless given) over an emulated link (the given ``offload_run``) gives the weights of Adam on fp32 master
    weights on the device (``on_device_adam``) and moves 2Ψ bytes down and 2Ψ up per step (fp16): from the link's
    log, in the student's own kernel.  Under grading, from what the grader read of the link instead
    (``offload.check_offload_held``: the weights, and each step's gradients down and weights up, by content).
    Whether the gradients went during backward is ``offload.check_overlap_held``'s."""
    if exercise.graded():
        return offload.check_offload_held(overlap, steps, latency, bandwidth, sizes)
    sizes = common.given("OFFLOAD_SIZES") if sizes is None else sizes
    case = f"OffloadAdam(overlap={overlap}) on MLP {sizes}, {steps} steps"
    weights, log, times, psi = _run(_offload, (steps, overlap, latency, bandwidth, sizes), case)
    for i, (w, r) in enumerate(zip(weights, common.given("on_device_adam")(steps, sizes))):
        checks.assert_close(
            w, r, rtol=0, atol=0, what=f"{case}: parameter {i}, against Adam on fp32 master weights on the device"
        )
    down = sum(n for d, n, *_ in log if d == "down")
    up = sum(n for d, n, *_ in log if d == "up")
    assert down == steps * 2 * psi, (
        f"{case}: {down} B went down the link, expected 2Ψ per step = {steps * 2 * psi} (fp16 gradients)"
    )
    assert up == steps * 2 * psi, (
        f"{case}: {up} B went up the link, expected 2Ψ per step = {steps * 2 * psi} (fp16 weights)"
    )


def check_saving(sizes: list, latency: float, bandwidth: float, flops: float, pairs: int = 6) -> None:
    """Exercise 6's self-check, not graded (its times are the rank's own clock, and its device and link are emulated
    inside the rank): on an emulated device of ``flops`` FLOP/s and a link of ``bandwidth`` B/s (the given
    ``offload_turns``, serial and overlapped steps in turns), overlapping saves per step (from the start of backward
    to the first weight sent up, median of ``pairs``) what the lab's α–β model (``predicted_saving``) predicts, at
    least half of it (a busy machine's sleeps run late: the saving seen at load 10-14 was 0.68 of the model's, and
    1.30 at load 12-31; 1.59 on a fresh clone's suite, 6 Dec: no upper bound, for a saving above the model's is the
    machine's, and a submission that sends nothing fails the byte counts). Where the first ``pairs`` disagree by
    more than 25 %, twice as many more are timed and the medians of all are compared, as the self-check does: the
    sleeps that emulate the device and the link then run late, more often in the serial step's chain of them (the
    hidden case saved 50.9 ms against 39.3 in a suite at load 12-31); a step that overlaps nothing saves nothing
    however many pairs are timed."""
    case = f"OffloadAdam on MLP {sizes}, an emulated device of {flops:g} FLOP/s, a link of {bandwidth:g} B/s"
    predicted_saving = common.given("predicted_saving")
    steps, timeline = {"serial": [], "overlapped": []}, []
    for more in (pairs, 2 * pairs):
        more_steps, more_timeline = _run(_offload_turns, (more, sizes, latency, bandwidth, flops), case)
        timeline += more_timeline
        for mode in steps:
            steps[mode] += more_steps[mode]
        predicted = float(np.median([predicted_saving(r, b, latency, bandwidth) for r, b in timeline]))
        saved = float(np.median([w for _, w in steps["serial"]]) - np.median([w for _, w in steps["overlapped"]]))
        if abs(saved - predicted) <= 0.25 * predicted:
            break
    assert saved >= 0.5 * predicted, (
        f"{case}: the overlapped steps saved {saved * 1e3:.1f} ms each (from the start of backward to the first weight "
        f"sent up, median of {len(steps['serial'])}), the α–β model predicts {predicted * 1e3:.1f} ms (accepted: at "
        f"least half of that): start each gradient's copy in its hook and wait for it only in step()"
    )
