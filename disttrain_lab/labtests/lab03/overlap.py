"""Lab 3's overlap and all-reduces, as the grader observes them: what crossed the wire while the backward was held.

Under grading a data-parallel wrapper's overlap is read from the grader's gate (``gate.py``), not from
the ranks' trace.  The graded step's backward is held at a place chosen so that a whole first bucket
(exercise 4: the first parameter) lies above it (``gate_position``, below); the grader's answer,
``answers()`` (one tensor per rank, drawn at grading time), is added to the gradient there, so no
gradient below it is right before the answer came.  The test then holds:

- what each rank sent the others while held (``wiretimeline.Timeline.sends_between``, on the grader's
  capture) to the gradients of the buckets above the gate, which it recomputes on each rank's shard:
  some message must hold, value for value up to one common factor (a wrapper may divide by N first),
  four consecutive values of one parameter's gradient summed over some of the ranks (a reduction
  passes partial sums; ``assert_crossed_while_held``); a message too short for that (a bucket of fewer
  than four values a rank, cut by gloo into a piece a rank) must hold only such sums, each one as it is
  or divided by N (``_all_sums``), where no larger bucket lies above;
- every step's messages (``assert_steps_all_reduce``), in every graded case, held or not: the driver marks
  each micro-step at the grader's gate (``gate.Seen.windows``), gloo's slot names each collective call, so
  their number and sizes are read off the wire against the rule (one per parameter, or the bucket rule's),
  a micro-step under no_sync() sends nothing, and every call's messages must hold the ranks' gradients of
  its step, recomputed on each rank's shard;
- the parameters after training to a single process that adds each rank's answer at its rows
  (``reference``): a rank that did not wait for its answer, or computed the layers below without it,
  ends with other parameters.

- that backward does not stop at a hook until the network is done (``assert_backward_ran_on``): every rank
  is held before and after each step's backward, and in one step (drawn at grading time, not the last) the
  grader keeps one rank (drawn too) before its backward, so its gradients join no all-reduce, while it lets
  every other rank on to its hold after its own backward (``gate.Behind``: no rank is told which step, or
  which rank).  Each gets there only if its hooks posted their all-reduces with ``async_op=True`` and waited
  for none of them (the waits belong in ``finish_gradient_synchronization()``): a blocking all-reduce, or a
  wait, in a hook stops its backward until the held rank joins.  The grader lets the held rank go once every
  other is there, or after ``gatekeeper.HELD_WAIT`` seconds.

The gate sits at a module's output (``gate_position``): in an ``nn.Sequential``, the first layer output, in
backward's order, where a whole bucket has its gradients and a trainable layer lies below (the input of the lowest
layer that holds a parameter of the first bucket); in the tied autoencoder, its encoder's output (its weight, used
again by the decoder, is whole only after the encoder's backward: its decoder's bias alone lies above).  A wrapper
may post its buckets in the rule's order, each once those before it are posted, as torch's DDP does (``crossing``).
Where there is no such place, nothing is left to overlap, so "during backward" is not graded there, only the
probe's rule above: every bucket is ready only as the backward's last layer ends (a frozen first layer under 1 KiB
buckets: the first bucket takes the lowest trainable layer's bias; the MLP under 1.5 KiB buckets, whose first
bucket reaches layer 0's bias), or may wait for one that is (the tied model under 200-byte buckets, whose first
bucket in the rule's order, the encoder's bias, is the last ready).  A gate after the last layer would hold
nothing its answer could change, and a rank that only said it was held could send its all-reduces meanwhile.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ... import carried
from ...exercise import ExerciseRun
from ..common import drawn
from .common import batches, bucket_names, graded_model

__all__ = [
    "answers",
    "assert_backward_ran_on",
    "assert_crossed_while_held",
    "assert_steps_all_reduce",
    "crossing",
    "gate_position",
    "ready_at",
    "reference",
    "where",
]

WINDOW = 4  # consecutive values a message must share with a gradient (up to one factor): 4 ranks cut
# the wide layer's 48 gradients into messages of 6
SUMS_FOUND = 0.95  # of a sender's nonzero words in a call that must be sums of the step's gradients
ALIGNED = 1 - 1e-6  # cosine of two windows taken for the same values (float32 sums in another order: ~1e-12 off)
ANSWER_SCALE = 0.01  # the answers' spread, near the size of the gradients at the gate


def gate_position(kind: str, bucket_mb: float | None) -> str | None:
    """The name of the module of the model (``model.get_submodule(name)``) at whose *output* the grader holds the
    backward: the first place, in backward's order, where a whole bucket (exercise 4: a parameter) has its
    gradients and a trainable layer still lies below, whose gradients need the grader's answer (``crossing``).
    In an ``nn.Sequential``, a layer's output; in the tied autoencoder, its encoder's.  None where there is no
    such place (see the module docstring)."""
    model = graded_model(kind, 0)
    if isinstance(model, nn.Sequential):
        candidates = [str(i) for i in reversed(range(len(model) - 1))]
    else:
        candidates = [name for name, _ in model.named_children()]
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    for at in candidates:
        if crossing(kind, bucket_mb, at) and trainable - set(ready_at(kind, at)):  # (something above, and below)
            return at
    return None


def crossing(kind: str, bucket_mb: float | None, at: str) -> list[list[str]]:
    """The buckets (``bucket_names``) an overlapping wrapper has posted when the backward reaches the gate at
    ``at``'s output (``ready_at``): one a parameter (exercise 4), every one whose gradients are all whole there;
    with ``bucket_mb``, those of the rule's buckets before the first that is not whole there, since a wrapper may
    post its buckets in the rule's order, each once those before it are posted, as torch's DDP does (``reducer.hpp``:
    "reduced in a predetermined order"): in the tied model the rule's first bucket is the last whole."""
    ready = set(ready_at(kind, at))
    buckets = bucket_names(graded_model(kind, 0), bucket_mb)
    if bucket_mb is None:
        return [bucket for bucket in buckets if set(bucket) <= ready]
    whole = [set(bucket) <= ready for bucket in buckets]
    return buckets[: whole.index(False) if False in whole else len(buckets)]


def where(kind: str, at: str) -> str:
    """The gate's place in words, for messages."""
    if isinstance(graded_model(kind, 0), nn.Sequential):
        return f"the input of layer {int(at) + 1} of the model"
    return f"the output of the model's {at}"


class _Mark(torch.autograd.Function):
    """Identity forward; backward notes which parameters have their gradients by then (as the gate's own
    ``gate._Held`` waits: a node of the graph, run after the gradients accumulated above it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, note: Callable[[], None]) -> torch.Tensor:
        ctx.note = note
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.note()
        return grad, None


def ready_at(kind: str, at: str) -> list[str]:
    """The trainable parameters whose gradients are whole when the backward reaches the gate at ``at``'s output
    (none where it does not reach it): read from one backward of the model, by which of them have a gradient there."""
    model = graded_model(kind, 0)
    seen: list[str] = []

    def note() -> None:
        seen.extend(name for name, p in model.named_parameters() if p.grad is not None)

    def mark(_module, _args, output):
        return _Mark.apply(output, note) if output.requires_grad else None

    handle = model.get_submodule(at).register_forward_hook(mark)
    x, y = batches(kind, 4, 1)[0]
    F.mse_loss(model(x), y).backward()
    handle.remove()
    return seen


def _rows(batch: int, n: int, rank: int, micro_steps: int) -> torch.Tensor:
    """The rows of the whole batch that rank ``rank``'s last micro-batch holds (as the driver splits it)."""
    return torch.arange(batch).tensor_split(n)[rank].tensor_split(micro_steps)[-1]


def answers(kind: str, batch: int, n: int, micro_steps: int, at: str) -> list[torch.Tensor]:
    """Each rank's answer at the gate: a tensor of its last micro-batch's activations' shape at ``at``'s output,
    from a seed drawn now (nothing the student's kernel receives holds it before the gate opens)."""
    model, width = graded_model(kind, 0), []
    handle = model.get_submodule(at).register_forward_hook(lambda _module, _args, out: width.append(out.shape[-1]))
    model(batches(kind, 1, 1)[0][0])
    handle.remove()
    generator = drawn()
    return [
        torch.randn(len(_rows(batch, n, r, micro_steps)), width[0], generator=generator) * ANSWER_SCALE
        for r in range(n)
    ]


def reference(
    kind: str, batch: int, steps: int, micro_steps: int, n: int, at: str | None, given: list[torch.Tensor] | None
) -> tuple[nn.Module, list[list[dict[str, torch.Tensor]]]]:
    """One process training on the whole batch, each rank's answer added (divided by N, as the ranks'
    gradients are averaged) to the gradient at ``at``'s output at that rank's rows in the last step;
    and, for each step, each rank's own gradients of every trainable parameter (its shard's loss as
    ``shard_loss`` scales it, summed over its micro-batches, its answer added at the gate in the last step's
    last one), what its all-reduces carry: ``local[step][rank][name]``.  ``given`` None: no gate (plain
    training)."""
    model = graded_model(kind, 0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    local: list[list[dict[str, torch.Tensor]]] = []
    for step, (x, y) in enumerate(batches(kind, batch, steps)):
        gated = given is not None and at is not None and step == steps - 1
        local.append(
            [_local_gradients(model, x, y, batch, n, r, micro_steps, at, given[r] if gated else None) for r in range(n)]
        )
        optimizer.zero_grad()
        handle = None
        if gated:
            added = torch.zeros(batch, given[0].shape[1])
            for r in range(n):
                added[_rows(batch, n, r, micro_steps)] = given[r] / n

            def add(_module, _args, output, added=added):
                output.register_hook(lambda g: g + added)

            handle = model.get_submodule(at).register_forward_hook(add)
        F.mse_loss(model(x), y).backward()
        if handle is not None:
            handle.remove()
        optimizer.step()
    return model, local


def _local_gradients(model, x, y, batch, n, rank, micro_steps, at, answer) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s gradients of every trainable parameter in the step, from the parameters before it:
    its micro-batches' losses, ``answer`` (where not None) added to the gradient at ``at``'s output in the last
    one."""
    model = copy.deepcopy(model)
    xs, ys = x.tensor_split(n)[rank], y.tensor_split(n)[rank]
    pieces = list(zip(xs.tensor_split(micro_steps), ys.tensor_split(micro_steps)))
    for i, (xm, ym) in enumerate(pieces):
        handle = None
        if i == len(pieces) - 1 and answer is not None:

            def add(_module, _args, output):
                output.register_hook(lambda g: g + answer)

            handle = model.get_submodule(at).register_forward_hook(add)
        (F.mse_loss(model(xm), ym) * (len(xm) * n / batch)).backward()
        if handle is not None:
            handle.remove()
    return {name: p.grad.detach().reshape(-1).clone() for name, p in model.named_parameters() if p.grad is not None}


def _known(local: list[dict[str, torch.Tensor]], names: list[str]) -> torch.Tensor:
    """Every run of WINDOW values of the gradients ``names``, summed over any set of ranks, scaled to length 1."""
    found = [
        _windows(torch.stack([local[r][name].double() for r in ranks]).sum(0))
        for size in range(1, len(local) + 1)
        for ranks in itertools.combinations(range(len(local)), size)
        for name in names
        if local[0][name].numel() >= WINDOW
    ]
    return torch.cat(found) if found else torch.zeros(0, WINDOW, dtype=torch.float64)


def _sums(local: list[dict[str, torch.Tensor]], names: list[str]) -> torch.Tensor:
    """Every value an all-reduce of the gradients ``names`` can carry, sorted: each element summed over any set
    of ranks, as it is and divided by N (a wrapper may divide first)."""
    n = len(local)
    found = [
        torch.stack([local[r][name].double() for r in ranks]).sum(0) / factor
        for size in range(1, n + 1)
        for ranks in itertools.combinations(range(n), size)
        for name in names
        for factor in (1, n)
    ]
    return torch.cat(found).sort().values if found else torch.zeros(0, dtype=torch.float64)


def _all_sums(payload: bytes, sums: torch.Tensor) -> bool:
    """Whether every float32 value of a short message is one of ``sums`` (``_sums``), to float32's rounding of a
    sum taken in another order."""
    if not len(sums):
        return False
    values = torch.frombuffer(bytearray(payload), dtype=torch.float32).double()
    at = torch.searchsorted(sums, values)
    below, above = sums[(at - 1).clamp(min=0)], sums[at.clamp(max=len(sums) - 1)]
    nearest = torch.minimum((below - values).abs(), (above - values).abs())
    return bool((nearest <= 1e-5 * values.abs() + 1e-7 * sums.abs().max()).all())


def _holds_each(payloads: list[bytes], known: torch.Tensor, sums: torch.Tensor | None = None) -> list[bool | None]:
    """Whether each message holds WINDOW consecutive values of ``known``'s (up to one factor); a message too short
    for that, whether every value of it is one of ``sums`` (``_all_sums``), where given; else None (too short
    to tell, or not float32 values).  In one product: every message's float32 values joined, their runs of WINDOW
    taken once, each run given to the message it lies within (a run across two messages is dropped)."""
    result: list[bool | None] = [None] * len(payloads)
    if sums is not None:
        for i, p in enumerate(payloads):
            if p and not len(p) % 4 and len(p) < 4 * WINDOW:
                result[i] = _all_sums(p, sums)
    kept = [i for i, p in enumerate(payloads) if not len(p) % 4 and len(p) >= 4 * WINDOW]
    if not kept:
        return result
    for i in kept:
        result[i] = False
    sizes = torch.tensor([len(payloads[i]) // 4 for i in kept])
    ends = sizes.cumsum(0)
    values = torch.frombuffer(bytearray(b"".join(payloads[i] for i in kept)), dtype=torch.float32).double()
    runs = values.unfold(0, WINDOW, 1)
    first = torch.arange(len(runs))
    owner = torch.searchsorted(ends, first, right=True)  # the message each run begins in
    norms = runs.norm(dim=1)
    inside = (first + WINDOW <= ends[owner.clamp(max=len(kept) - 1)]) & (norms > 1e-30)
    if not len(known) or not inside.any():
        return result
    hit = ((runs[inside] / norms[inside, None]) @ known.T >= ALIGNED).any(1)
    for j in owner[inside][hit].unique().tolist():
        result[kept[j]] = True
    return result


def _windows(values: torch.Tensor) -> torch.Tensor:
    """Every run of WINDOW consecutive values, each scaled to length 1 (runs of zeros dropped)."""
    runs = values.double().unfold(0, WINDOW, 1)
    norms = runs.norm(dim=1, keepdim=True)
    keep = norms.squeeze(1) > 1e-30
    return runs[keep] / norms[keep]


def assert_crossed_while_held(
    run: ExerciseRun, case: str, local: list[dict[str, torch.Tensor]], buckets: list[list[str]], place: str
) -> None:
    """Fail unless every rank sent the others, while its backward was held at the gate (at ``place``, in words),
    a message of the all-reduce of a bucket of ``buckets`` (``crossing``; see the module docstring) that holds
    its gradients: WINDOW consecutive values of a bucket's (up to one factor), among the buckets of WINDOW
    values a rank or more where there is one (a message of such a call holds WINDOW values); where every such
    bucket is smaller (the tied model's decoder bias: gloo cuts a call into about one piece a rank), a message
    whose every value is one of the bucket's gradients summed over some ranks (``_all_sums``)."""
    start, cut = run.gate.window()
    n = run.world_size
    large = [b for b in buckets if sum(local[0][name].numel() for name in b) >= WINDOW * n]
    names = [name for bucket in large or buckets for name in bucket]
    known, sums = _known(local, names), None if large else _sums(local, names)
    for rank in range(n):
        sent = [m for dst in range(n) if dst != rank for _, m in run.timeline.sends_between(rank, dst, start, cut)]
        assert any(_holds_each(sent, known, sums)), (
            f"{case}: the grader held rank {rank}'s backward at {place} (the parameters above it had their "
            f"gradients; those below needed the grader's answer) and watched the wire: while held, rank {rank} sent "
            f"the other ranks {len(sent)} message(s) ({', '.join(f'{len(m):,} B' for m in sent[:8]) or 'none'}), "
            f"none holding the gradients of {', '.join(names)}. Overlap means an all-reduce posted from a gradient "
            f"hook (async_op=True), once its bucket's gradients are all ready, crosses the wire while backward goes "
            f"on below; all-reduces posted only in finish_gradient_synchronization(), after backward, cross after it"
        )


def assert_steps_all_reduce(
    run: ExerciseRun,
    case: str,
    local: list[list[dict[str, torch.Tensor]]],
    micro_steps: int,
    trainable: int,
    sizes: list[int] | None,
    rule: str,
    interrupted: bool = False,
) -> None:
    """Fail unless each step's messages, read from the grader's capture between the marks of its micro-steps
    (``gate.Seen.windows``), are all-reduces of the step's gradients: nothing in a micro-step under no_sync();
    in the last, calls whose sizes add up to the ``trainable`` bytes and, with ``sizes``, are those (in any
    order: one per parameter, or the bucket rule's ``rule``); each message holding the ranks' gradients of that
    step (``local[step]``, summed over some ranks, up to one factor).  Gloo gives each collective call a slot of
    its own (``gloo_ops.sends``); one all-reduce of B bytes carries 2·(N − 1)·B bytes of payload in all."""
    windows = run.gate.windows()
    n, steps = run.world_size, len(local)
    assert len(windows) == steps * micro_steps, (
        f"{case}: the grader's gate saw {len(windows)} micro-step(s) where the driver runs {steps * micro_steps}"
    )
    for step in range(steps):
        known, sums = _known(local[step], list(local[step][0])), _sums(local[step], list(local[step][0]))
        for micro in range(micro_steps):
            start, end = windows[step * micro_steps + micro]
            last = micro == micro_steps - 1
            per_call: dict[int, int] = {}
            sent = [
                (src, dst, slot, payload)
                for src in range(n)
                for dst in range(n)
                if src != dst
                for slot, payload in run.timeline.sends_between(src, dst, start, end)
            ]
            judged: dict[int, list[bool]] = {}  # each call's messages long enough to judge: hold gradients?
            for (src, dst, slot, payload), holds in zip(sent, _holds_each([m[3] for m in sent], known, sums)):
                assert last, (
                    f"{case}: in step {step}, micro-step {micro} (under no_sync()) rank {src} sent rank {dst} "
                    f"{len(payload):,} B, as the grader's capture of the wire read it; under no_sync() "
                    f"gradients only accumulate, and nothing crosses until the last micro-step"
                )
                per_call[slot] = per_call.get(slot, 0) + len(payload)
                if holds is not None:
                    judged.setdefault(slot, []).append(holds)
            # (per call, not per message: a message cut across two parameters of a flattened bucket may hold
            # fewer than 4 values of each, in whatever order the bucket was flattened)
            empty = [slot for slot, holds in judged.items() if not any(holds)]
            assert not empty, (
                f"{case}: in step {step}, {len(empty)} collective call(s) of "
                f"{[round(per_call[slot] / (2 * (n - 1))) for slot in empty]} B carried messages that hold none of the "
                f"ranks' gradients of that step, as the grader's capture of the wire read them. What crosses in a "
                f"training step must be the gradients themselves"
            )
            if not last:
                continue
            _assert_every_word_a_sum(sent, sums, f"{case}: in step {step}")
            got = [total / (2 * (n - 1)) for _, total in sorted(per_call.items())]
            shown = [int(g) if g == int(g) else round(g, 1) for g in got]
            lead = (
                f"{case}: the grader's capture of the wire saw {len(got)} collective call(s) in step {step}, of "
                f"{shown} B each as all-reduces (gloo's messages of one call carry 2·(N − 1) times its bytes)"
            )
            if not got and interrupted:
                lead += (
                    " (an exception raised inside `with ddp.no_sync():` and caught before training left the hooks "
                    "switched off? restore the state in `finally:`: the exception is raised at the yield, and a "
                    "line after it never runs)"
                )
            assert sum(got) == trainable, (
                f"{lead}; the trainable gradients are {trainable} B, all-reduced once each step (each parameter "
                f"once, even when used twice; frozen ones not at all)"
            )
            if sizes is not None:
                assert sorted(got) == sorted(sizes), (
                    f"{lead}; expected {len(sizes)} all-reduce(s) of {sorted(sizes)} B: {rule}"
                )


def _assert_every_word_a_sum(sent: list, sums: torch.Tensor, where: str) -> None:
    """Every sender's messages in each call (joined in the order they crossed, one stream per receiver: gloo cuts
    a message where it likes) hold the step's sums and nothing else: at least ``SUMS_FOUND`` (95 %) of their
    nonzero float32 words are among ``sums`` (each gradient element summed over a set of ranks, as it is or
    divided by N, whatever the flattening), and at least half the words are nonzero.  One message of each call
    that holds real sums beside others of junk or zeros (the values passed some other way) fails."""
    streams: dict[tuple[int, int, int], bytes] = {}
    for src, dst, slot, payload in sent:
        if carried.kind(slot) != "barrier":  # (a barrier's messages carry no values)
            streams[src, dst, slot] = streams.get((src, dst, slot), b"") + payload
    for (src, dst, _), joined in sorted(streams.items()):
        words = torch.frombuffer(bytearray(joined[: len(joined) // 4 * 4]), dtype=torch.float32).double()
        if not len(words) or not len(sums):
            continue
        nonzero = words[(words != 0) & torch.isfinite(words)]
        found = carried.words_found(sums.numpy(), nonzero.numpy(), rtol=1e-5, atol=1e-7 * float(sums.abs().max()))
        assert 2 * len(nonzero) >= len(words) and found >= SUMS_FOUND * len(nonzero), (
            f"{where}, rank {src} sent rank {dst} {len(words)} float32 values in one collective call, "
            f"{len(nonzero)} of them nonzero, and {found} of those are sums of the ranks' gradients of that step "
            f"(each element over some of the ranks, as it is or divided by N), as the grader's capture of the wire "
            f"read them; an all-reduce of the gradients carries nothing else (at least {SUMS_FOUND:.0%} of its "
            "nonzero values such sums, and at least half of its values nonzero)"
        )


def assert_backward_ran_on(run: ExerciseRun, case: str, probe: int, hold: int) -> None:
    """Fail unless, while the grader kept rank ``probe`` behind before its backward at its ``hold``-th hold, every
    other rank's backward returned (each held after it: ``Seen.ranks_ahead``; see the module docstring)."""
    missing = sorted(set(range(run.world_size)) - {probe} - set(run.gate.ranks_ahead(hold)))
    assert not missing, (
        f"{case}: in step {hold // 2} the grader held rank {probe} before its backward (so its gradients joined no "
        f"all-reduce), and rank(s) {missing} did not finish their backward meanwhile: a hook that waits for its "
        f"all-reduce (a blocking dist.all_reduce, or a work's wait()) stops backward until every rank has joined. "
        f"Post each all-reduce with async_op=True from the hook and wait for the works in "
        f"finish_gradient_synchronization(), after backward"
    )
