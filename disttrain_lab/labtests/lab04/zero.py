"""Lab 4's exercises 2-4: training with ZeRO stages 1-3 on ranks (``ranks``), against one process."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ... import carried, checks, exercise, memory
from ...exercise import ExerciseRun
from .. import common
from .common import (
    GRADED_PASSED,
    OPTIMIZERS,
    SLACK_PER_TENSOR,
    STEPS,
    TEST_DEVICE,
    batches,
    communication_volume,
)
from .ranks import _model, _shared, _train_in_rank, _train_zero3_standing_in

# --------------------------------------------------------------------------------------
# Exercises 2-4: training with ZeRO on ranks, against one process
# --------------------------------------------------------------------------------------


def _gathered_for_backward(model: nn.Module, sizes: Sequence[int]) -> list[int]:
    """The sizes of the parameters ZeRO-3 all-gathers for backward: the units (minus shared parameters) of the
    layers a gradient reaches, i.e. whose output needs one.  Found with torch's own forward hooks."""
    reached, shared = set(), set(_shared(model))
    layers = memory.layers_with_parameters(model)

    def record(name, output):
        if output.requires_grad:
            reached.add(name)

    hooks = [
        layer.register_forward_hook(lambda m, args, out, name=name: record(name, out)) for name, layer in layers.items()
    ]
    model(batches(sizes, 1, 1)[0].x)
    for hook in hooks:
        hook.remove()
    return [
        p.numel()
        for name, layer in layers.items()
        if name in reached
        for p in layer.parameters(recurse=False)
        if p not in shared
    ]


_WHAT_THE_TEST_DOES = {
    stage: (
        "What the test does, on every rank: build the model (the same on every rank), "
        + (
            "wrap it, Zero3Module(model, shared=...), and build the optimizer on its parameters (the shards); "
            if stage == 3
            else f"build Zero{stage}Optimizer(model.parameters(), optimizer_class, **defaults); "
        )
        + "then per step: zero_grad(), the loss of this rank's slice of the batch (x.tensor_split(N)[rank]), "
        "backward(), step().  Nothing averages the gradients before "
        + (
            "grad_ready: it reduce-scatters each gradient and divides it by N, so each rank's shard of the "
            "gradient is the mean over ranks, and the optimizer updates the shards."
            if stage == 3
            else "step(): step() reduce-scatters each gradient"
            + (" (ZeRO-2: as soon as backward makes it)" if stage == 2 else "")
            + ", divides by N, updates this rank's shard and all-gathers the parameters."
        )
    )
    for stage in (1, 2, 3)
}


def _single_process(
    kind: str,
    sizes: Sequence[int],
    batch: int,
    steps: int,
    opt: str,
    lr_scale: float = 1,
) -> nn.Module:
    """The reference: the same optimizer in one process, on the whole batch (``lr_scale``: a larger learning rate)."""
    model = _model(kind, sizes)
    optimizer_class, defaults, _ = OPTIMIZERS[opt]
    defaults = {**defaults, "lr": defaults["lr"] * lr_scale}
    optimizer = optimizer_class([p for p in model.parameters() if p.requires_grad], **defaults)
    for x, y in batches(sizes, batch, steps):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return model


def _trajectory(
    kind: str, sizes: Sequence[int], batch: int, steps: int, opt: str, n: int, stage: int
) -> tuple[list, list]:
    """The reference's training (``_single_process``) step by step, in one process: each step's gradient of each
    rank's loss on its slice of the batch (``x.tensor_split(n)[rank]``: what it must reduce-scatter; the step's is
    their mean), its trainable parameters' flat; and the parameters before the first step and after each (what the
    ranks all-gather: ZeRO-3 every parameter, frozen ones too; ZeRO-1 and 2 the trainable ones), flat."""
    model = _model(kind, sizes)
    optimizer_class, defaults, _ = OPTIMIZERS[opt]
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_class(trainable, **defaults)
    flat = lambda tensors: torch.cat([t.detach().reshape(-1) for t in tensors]).numpy().copy()  # noqa: E731
    gathered = list(model.parameters()) if stage == 3 else trainable
    gradients, parameters = [], [flat(gathered)]
    for x, y in batches(sizes, batch, steps):
        grads = []
        for xs, ys in zip(x.tensor_split(n), y.tensor_split(n)):
            optimizer.zero_grad()
            F.mse_loss(model(xs), ys).backward()
            grads.append(flat(p.grad for p in trainable))
        gradients.append(grads)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        parameters.append(flat(gathered))
    return gradients, parameters


def _check_gradients_carried(run: ExerciseRun, case: str, local: list[list], unsent: int) -> None:
    """Under grading: at each step, each rank's local gradient (``_trajectory``) must be in what it sent in
    all-to-alls (the helpers' reduce-scatter), as fp32 words, whatever their order or flattening (``_found``),
    either as it is or divided by N: every nonzero entry but those of the rank's own shard, which stays
    (``unsent``: Σ ceil(k/N) over the trainable parameters).  Gradients passed some other way (the launcher's
    store) with something else of the right size in the all-to-alls fail."""
    sent = carried.sends(run, case)
    if sent is None:  # (the student's own kernel: no capture)
        return
    n = run.world_size
    for rank in range(n):
        joined: dict[tuple[int, int], bytes] = {}
        for src, dst, slot, payload in sent:
            if src == rank and carried.kind(slot) == "all_to_all":
                joined[dst, slot] = joined.get((dst, slot), b"") + payload
        pool = carried.words_sent(list(joined.values()))
        for step, grads in enumerate(local):
            want = grads[rank][grads[rank] != 0]
            found = max(_found(pool, want / scale) for scale in (1, n))
            assert found >= want.size - unsent, (
                f"{case}: at step {step + 1} rank {rank}'s reduce-scatters should carry its gradient (the grader's own "
                f"training in one process: {want.size} nonzero entries, all but its own shard's, at most {unsent}, "
                f"sent to the others); the grader's capture of the wire found {found} of them in what rank {rank} "
                "sent in all-to-alls. The gradients must travel in the reduce-scatter itself"
            )


def _check_parameters_carried(run: ExerciseRun, case: str, parameters: list, stage: int) -> None:
    """Under grading: the parameters the ranks all-gather (the helpers' broadcasts, or all-gathers) are the
    training's, read from the grader's capture: every nonzero entry of the reference's parameters after each step
    (ZeRO-3: before each, gathered for its forward) among the fp32 words the ranks sent in those calls (each
    rank's shard comes from its owner).  Parameters passed some other way, with zeros in the all-gather, fail."""
    sent = carried.sends(run, case)
    if sent is None:  # (the student's own kernel: no capture)
        return
    joined: dict[tuple[int, int, int], bytes] = {}
    for src, dst, slot, payload in sent:
        if carried.kind(slot) in ("broadcast", "all_gather"):
            joined[src, dst, slot] = joined.get((src, dst, slot), b"") + payload
    pool = carried.words_sent(list(joined.values()))
    gathered = parameters[:-1] if stage == 3 else parameters[1:]
    for step, values in enumerate(gathered):
        want = values[values != 0]
        found = _found(pool, want)
        assert found == want.size, (
            f"{case}: the ranks' all-gathers should carry the parameters {'before' if stage == 3 else 'after'} step "
            f"{step + 1} (the grader's own training in one process: {want.size} nonzero entries, each from the rank "
            f"that owns it); the grader's capture of the wire found {found} of them in what the ranks sent in "
            "all-gathers (the helpers' broadcasts). The parameters must travel in the all-gather itself"
        )


def _found(pool, want) -> int:
    """How many of ``want`` lie in the sorted ``pool``: within a relative 1e-4, or 1e-5 of its largest entry (the
    ranks' parameters after a few steps of Adam differ from the reference's in their last bits, and so do the
    smallest entries of their gradients)."""
    return carried.words_found(pool, want, rtol=1e-4, atol=1e-5 * np.abs(want).max()) if want.size else 0


def _check_zero3_frees(run: ExerciseRun, case: str) -> None:
    """ZeRO-3: a layer's full parameters exist only while that layer (or a layer around it) runs."""
    for rank, out in enumerate(run.results):
        for moment, layer, held in out["snapshots"]:
            full = [name for name, b in held.items() if b >= out["full_bytes"][name]]
            around = [
                name for name in out["full_bytes"] if name != layer and (name == "" or layer.startswith(name + "."))
            ]
            allowed = around + ([layer] if moment in ("forward", "backward") else [])
            extra = [name for name in full if name not in allowed]
            assert not extra, (
                f"{case}: rank {rank}, at the {moment} of layer {layer!r}, still held the full parameters of layer(s) "
                f"{extra} ({[held[n] for n in extra]} B): free a layer's gathered parameters right after its forward "
                f"and after its backward (ZeRO-3 holds a full layer only while it, or a layer around it, runs)"
            )
        assert out["snapshots"], f"{case}: no layer's forward was seen"


def _check_zero(
    name: str,
    stage: int,
    n: int,
    sizes: Sequence[int],
    batch: int = 12,
    steps: int = STEPS,
    kind: str = "mlp",
    opt: str = "adam",
    driver: Callable = _train_in_rank,
) -> ExerciseRun:
    """The notebook's class ``name`` on n ranks, trained by ``driver`` through dl.exercise.run: memory against
    the formula, then the parameters against the same optimizer in one process (computed here), then
    communication from the ranks' trace."""
    case = f"{name} on {n} ranks, {kind} model {sizes}, {OPTIMIZERS[opt][0].__name__}({OPTIMIZERS[opt][1]})"
    hint = "do all ranks make the same collective calls, in the same order, with equal-size shards?"
    try:
        run = common.run_or_fail(
            driver,
            n,
            (name, stage, kind, sizes, steps, batch, opt),
            case,
            hint,
            timeout=60,
            device=TEST_DEVICE,
            content=True,  # (under grading, what crossed between the ranks: the communication's volume)
        )
    except exercise.ExerciseError as e:
        if stage == 3 and kind == "tied" and e.exc_type == "RuntimeError":
            raise AssertionError(
                f"{e}\n(the tied weight, used by the encoder and again by the model's own forward, "
                f"was not whole when one of them ran: a shared parameter belongs to the root unit; "
                f"gather it in the root's before_forward and free it only in grad_ready)"
            ) from None
        raise
    reference = _single_process(kind, sizes, batch, steps, opt)
    shapes = [p.shape for p in reference.parameters()]
    frozen = [not p.requires_grad for p in reference.parameters()]
    for rank, out in enumerate(run.results):
        assert len(out["params"]) == len(shapes), (
            f"{case}: rank {rank}'s model has {len(out['params'])} parameters, the model has {len(shapes)}"
        )
        if stage == 3:  # rank r holds [r·c, (r+1)·c) of each padded flat tensor
            wrong = [
                f"{tuple(p.shape)} for a{' frozen' * f} parameter of shape {tuple(s)}"
                for p, s, f in zip(out["params"], shapes, frozen)
                if tuple(p.shape) != (math.ceil(math.prod(s) / n),)
            ]
            assert not wrong, (
                f"{case}: rank {rank}: after step(), each parameter's .data should be this rank's shard, 1-D of "
                f"ceil(k/N) elements; found {', '.join(wrong)}"
                + (
                    "; a frozen parameter never reaches grad_ready: free it in after_backward, once its layer's "
                    "backward is done (the gradient of the layer's input is computed), or at the end of backward if "
                    "that input needs no gradient" * any(" frozen " in w for w in wrong)
                )
            )
    numels = [p.numel() for p in reference.parameters()]
    trainable = [p.numel() for p in reference.parameters() if p.requires_grad]

    shard = lambda ks: sum(math.ceil(k / n) for k in ks)  # (a lambda: a `def shard` is lab 3's exercise)

    slack = SLACK_PER_TENSOR * len(numels)
    # 1. memory, measured after the last backward: at most the rank's padded shard of each sharded part
    roles = {
        "parameters": (4, 3, numels),
        "gradients": (4, 2, trainable),
        "optimizer_state": (OPTIMIZERS[opt][2], 1, trainable),
    }
    free_hint = {
        "gradients": ": free the gradient you do not own (after reduce-scattering p.grad, set p.grad = None "
        "and keep only your shard's)",
        "optimizer_state": ": build the wrapped optimizer over this rank's shards only",
        "parameters": ": keep only this rank's shard of each parameter between layers",
    }
    for role, (nbytes, first_stage, ks) in roles.items():
        sharded = stage >= first_stage
        high = nbytes * (shard(ks) if sharded else sum(ks)) + slack
        for rank, out in enumerate(run.results):
            got = out["held"][role]
            assert got <= high, (
                f"{case}: rank {rank} holds {got} B of {role.replace('_', ' ')} after backward; ZeRO-{stage} "
                + (
                    f"shards it, so a rank holds at most its padded shard, {nbytes} B × Σ ceil(k/N) = {high - slack} B "
                    f"(+{slack} B slack), not the whole model's {nbytes * sum(ks)} B{free_hint[role]}"
                    if sharded
                    else f"keeps it whole: {nbytes * sum(ks)} B"
                )
            )
        together = sum(out["held"][role] for out in run.results)
        assert together >= nbytes * sum(ks) * (1 if sharded else n), (
            f"{case}: the {n} ranks together hold {together} B of {role.replace('_', ' ')}; the model needs "
            f"{nbytes * sum(ks)} B " + ("spread over the ranks" if sharded else "on every rank")
        )
    limit = sum(nbytes * (shard(ks) if stage >= first else sum(ks)) for nbytes, first, ks in roles.values()) + slack
    for rank, out in enumerate(run.results):
        assert out["held"]["total"] <= limit, (
            f"{case}: rank {rank} holds {out['held']['total']} B in all ({out['held']['other']} B in other tensors "
            f"your class keeps); the formula allows {limit} B"
        )
    if stage == 3 and n > 1:  # (on one rank a shard is the whole tensor: nothing to free)
        _check_zero3_frees(run, case)
    # 2. training: exactly the same optimizer in one process on the whole batch
    if stage == 3:  # the ranks' shards of each padded flat tensor, put together here
        together = [
            torch.cat([out["params"][i].reshape(-1) for out in run.results])[: math.prod(s)].view(s)
            for i, s in enumerate(shapes)
        ]
        params = {"the ranks' shards, put together,": together}
    else:
        params = {f"rank {rank}'s": out["params"] for rank, out in enumerate(run.results)}
    for whose, got_params in params.items():
        for (pname, want), got in zip(reference.named_parameters(), got_params):
            what = f"{case}: {whose} {pname} after {steps} steps (the reference is the same optimizer in one process)"
            try:
                checks.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6, what=what)
            except AssertionError as e:
                # SGD is linear in the gradient: N times the gradient is N times the learning rate
                summed = dict(_single_process(kind, sizes, batch, steps, opt, lr_scale=n).named_parameters())
                if opt == "sgd" and torch.allclose(got, summed[pname].detach(), rtol=1e-4, atol=1e-5):
                    raise AssertionError(
                        f"{e}\nEvery update is {n} times too large: divide the reduce-scattered "
                        f"gradient by N = {n}, so each rank's shard holds the mean over ranks, "
                        f"not the sum"
                    ) from None
                raise AssertionError(f"{e}\n{_WHAT_THE_TEST_DOES[stage]}") from None
    # 3. communication per step and per rank: 2Ψ (stages 1-2) or 3Ψ (stage 3), within padding; under grading
    #    from the grader's capture of the wire (``_wire_volume``), in the student's own notebook from the trace
    student = run.trace
    if stage == 3:  # all-gather every layer for forward, again for backward those a gradient reaches (a
        # frozen one too when the layers below it train; a shared parameter stays whole from
        # forward to its gradient: gathered once); reduce-scatter the trainable ones
        again = _gathered_for_backward(reference, sizes)
        low = 4 * (sum(numels) + sum(again) + sum(trainable))
        high = 4 * n * (shard(numels) + shard(again) + shard(trainable))
    else:
        low, high = 4 * 2 * sum(trainable), 4 * 2 * n * shard(trainable)
    if stage != 3:
        words = "2Ψ"
    elif sum(again) == sum(trainable) - sum(p.numel() for p in _shared(reference)):
        if _shared(reference):
            words = "3Ψ − Ψ_shared"
        else:
            words = "3Ψ" if len(trainable) == len(numels) else "Ψ + 2Ψ_trainable"
    else:
        words = "Ψ (forward) + Ψ of the layers a gradient reaches (backward) + Ψ_trainable"
    hint = (
        "; all-gather each layer's parameters before its forward and again before its backward"
        + (", a shared parameter once, in the root's before_forward" if _shared(reference) else "")
        if stage == 3
        else ""
    )
    wired = run.timeline.source != "trace"  # the grader's capture (unobserved: reading it raises, the test fails)
    if wired:
        # the calls' kinds first (gloo's own reduce-scatter is an all-reduce on the wire: its messages, its bytes)
        _check_wire_kinds(run, case, stage)
        local, parameters = _trajectory(kind, sizes, batch, steps, opt, n, stage)
        _check_gradients_carried(run, case, local, shard(trainable))
        _check_parameters_carried(run, case, parameters, stage)
        total = _wire_volume(run)
        volume = total / (n - 1) / steps
        assert low <= volume <= high, (
            f"{case}: by the grader's capture of the wire, the ranks' collectives moved {volume:.0f} B per step and "
            f"rank (gloo's payloads between the ranks, {total} B in all over {steps} steps: a collective that moves V "
            f"bytes per rank in section 2's accounting carries (N − 1)·V in all, N = {n}); ZeRO-{stage} moves "
            f"{words} = {low} B per step (up to {high} B with padding): reduce-scatter the gradients once and "
            "all-gather the parameters" + hint
        )
        return run
    for rank in range(n):  # in the student's own kernel: the ranks' trace
        ops = set(student.calls(rank))
        reduce_ops = {op for op in ops if op.startswith("all_reduce")}
        if run.backend == "gloo":  # gloo's own reduce-scatter: an all-reduce on the wire (_check_wire_kinds)
            reduce_ops |= {op for op in ops if op.startswith("reduce_scatter")}
        assert not reduce_ops, (
            f"{case}: rank {rank} called {sorted(reduce_ops)}; ZeRO-{stage} reduce-scatters the "
            "gradients (each rank needs only its shard's) instead of all-reducing them, with section 4's "
            "reduce_scatter (on gloo, dist.reduce_scatter_single all-reduces the whole input and keeps the rank's "
            "chunk: the grader's capture of the wire sees an all-reduce)"
        )
        # the lab's helpers build them on gloo from an all-to-all (reduce-scatter) and broadcasts (all-gather)
        scatters = any(op.startswith(("reduce_scatter", "all_to_all")) for op in ops)
        gathers = any(op.startswith(("all_gather", "broadcast")) for op in ops)
        assert scatters and gathers, (
            f"{case}: rank {rank} should reduce-scatter gradients and all-gather parameters (the lab's "
            f"reduce_scatter and all_gather); it called {sorted(ops)}"
        )
        volume = communication_volume(student.by_rank(rank)) / steps
        assert low <= volume <= high, (
            f"{case}: rank {rank}'s collectives moved {volume:.0f} B per step; ZeRO-{stage} moves {words} = "
            f"{low} B per step (up to {high} B with padding)" + hint
        )
    return run


def _check_wire_kinds(run: ExerciseRun, case: str, stage: int) -> None:
    """Under grading, the kinds of the ranks' collectives, read from the slots of gloo's messages on the wire
    (``carried.calls_made``): no all-reduce, an all-gather of the parameters (the helpers' broadcasts, or an
    all-gather) and something else that carries the gradients (the helpers' all-to-all).  gloo's own
    reduce-scatter clones its input, all-reduces all of it and keeps the rank's chunk: on the wire it is an
    all-reduce (its slot's kind, twice a reduce-scatter's bytes), which no capture can tell from one, so it fails
    here as one would (section 4: use the helpers)."""
    made = carried.calls_made(run, case)
    for rank in range(run.world_size):
        seen = {kind for kind, senders in made.items() if rank in senders}
        assert "all_reduce" not in seen, (
            f"{case}: rank {rank} sent an all-reduce's messages on the wire (the grader's capture: the kinds of its "
            f"calls were {sorted(seen)}); ZeRO-{stage} reduce-scatters the gradients (each rank needs only its "
            "shard's) with section 4's reduce_scatter, an all-to-all on the CPU.  gloo's own reduce-scatter "
            "(dist.reduce_scatter_single) all-reduces the whole input and keeps the rank's chunk, so on the wire it "
            "is an all-reduce too: use the helpers"
        )
        gathers = seen & {"broadcast", "all_gather"}  # (the helpers' all-gather is N broadcasts on the CPU)
        assert gathers and seen - gathers - {"barrier"}, (
            f"{case}: rank {rank} should reduce-scatter the gradients and all-gather the parameters (section 4's "
            f"reduce_scatter and all_gather); on the wire (the grader's capture) it sent messages of {sorted(seen)}"
        )


def _wire_volume(run: ExerciseRun) -> int:
    """Every payload byte of gloo's messages between the run's ranks, each counted once, as the grader's
    capture kept them (``wiretimeline.Timeline.messages``).  Whatever gloo's algorithm (a tree or a ring, one message
    or several), a reduce-scatter of S bytes per rank carries (N − 1)·S in all, an all-gather of S bytes (its
    output) as much, an all-reduce twice: (N − 1) times the sum of the ranks' volumes, N times one rank's."""
    n = run.world_size
    return sum(len(m) for src in range(n) for dst in range(n) if src != dst for m in run.timeline.messages(src, dst))


def check_zero1(n: int, sizes: Sequence[int], *, batch: int = 12, kind: str = "mlp", opt: str = "adam") -> ExerciseRun:
    """Exercise 2, ``Zero1Optimizer(params, optimizer_class, **defaults)`` wrapping the optimizer ``opt``
    ("adam", "adamw", "sgd") on n ranks, an MLP of ``sizes`` (``kind``: "frozen", "tied" for the models with a
    frozen layer or a tied weight), 3 steps: the same parameters as the same optimizer in one process on the
    whole batch (the mean gradient: ÷ N); after backward a rank holds the optimizer's state for its padded
    shard only (parameters and gradients whole); per step its collectives move 2Ψ (reduce-scatter the
    gradients, all-gather the parameters; no all-reduce).  Returns the run (``run.results[r]["held"]``)."""
    return _check_zero("Zero1Optimizer", 1, n, sizes, batch=batch, kind=kind, opt=opt)


def zero2_driver(graders: Callable | None = None) -> Callable:
    """The driver Zero2Optimizer is graded with: the lab's own (Zero2Optimizer on the student's
    Zero1Optimizer) once that passed its graded cell, else ``graders`` (the grader's ZeRO-1 under it,
    defined in the graded cell's hidden tests: None in a student's notebook), so that a mistake in
    exercise 2 does not cost exercise 3's points."""
    if "zero1" in GRADED_PASSED:
        return _train_in_rank
    print("(Zero1Optimizer has not passed its graded test yet: the grader checks Zero2Optimizer on its own)")
    return graders or _train_in_rank


def check_zero2(
    n: int,
    sizes: Sequence[int],
    *,
    batch: int = 12,
    kind: str = "mlp",
    opt: str = "adam",
    driver: Callable | None = None,
) -> ExerciseRun:
    """Exercise 3, ``Zero2Optimizer(Zero1Optimizer)``, as :func:`check_zero1` checks ZeRO-1, and: after
    backward a rank holds only its shard of the gradients (each reduce-scattered as soon as backward made it,
    the full one freed); 2Ψ per step, no all-reduce.  ``driver``: :func:`zero2_driver`'s (default: on the
    student's Zero1Optimizer)."""
    return _check_zero("Zero2Optimizer", 2, n, sizes, batch=batch, kind=kind, opt=opt, driver=driver or _train_in_rank)


def check_zero3(n: int, sizes: Sequence[int], *, batch: int = 12, kind: str = "mlp", opt: str = "adam") -> ExerciseRun:
    """Exercise 4, ``Zero3Module(model, shared=())`` and the optimizer ``opt`` built on its parameters, as
    :func:`check_zero1` checks ZeRO-1 (``kind`` also "finetuned": a first layer training its bias only and a
    frozen next layer), and: after step() every parameter's ``.data`` is this rank's 1-D shard of ceil(k/N)
    elements, frozen ones too; after backward a rank holds its shard of parameters, gradients and state; a
    layer's full parameters exist only while it (or a layer around it) runs its forward or backward; a
    shared (tied) weight stays whole from the root's forward to its gradient; per step the collectives move
    3Ψ (Ψ forward + Ψ of the layers a gradient reaches + Ψ trainable; a shared weight gathered once).
    Until Zero1Optimizer has passed its graded test (``GRADED_PASSED``), the grader's ``shard_size`` and
    ``padded_flat`` stand in for exercise 2's, so that a mistake there does not cost this exercise too."""
    return _check_zero("Zero3Module", 3, n, sizes, batch=batch, kind=kind, opt=opt, driver=zero3_driver())


def zero3_driver() -> Callable:
    """The driver Zero3Module is graded with: on the notebook's shard_size and padded_flat once exercise 2
    passed its graded cell, else on the grader's."""
    if "zero1" in GRADED_PASSED:  # (exercise 2 wrote the helpers Zero3Module uses)
        return _train_in_rank
    common.say_standing_in(
        ["Zero1Optimizer, whose exercise wrote shard_size and padded_flat,"],
        "Zero3Module is graded with the grader's shard_size and padded_flat in the place of yours",
    )
    return _train_zero3_standing_in
