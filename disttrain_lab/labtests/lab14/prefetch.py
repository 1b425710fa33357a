"""Lab 14's overlap beyond DDP: ``sharded_step``, one training step of an FSDP-style model whose layers are whole one
or two at a time, the next layer's all-gather prefetched while this one computes; graded against one process (the
values) and on the grader's capture of the wire at its gate (the overlap): the notebook's exercise 5.

The student writes ``sharded_step(shards, layer, x, y, prefetch=True) -> float``, called on every rank of N:

- ``shards[i]``: this rank's shard of layer i's parameters, an ``nn.Parameter`` of c = ceil(k/N) elements: rank r
  holds elements [r·c, (r+1)·c) of the layer's k parameters flattened (its weight's, then its bias's) and padded
  with zeros to N·c (lab 4's padding);
- ``layer(i, flat, h)``: runs layer i on ``h`` with its whole flat parameters ``flat`` (N·c elements, the padding
  ignored), differentiable in both; call it once per layer in a step: backward goes through the graph it made;
- ``x``, ``y``: this rank's own rows (data parallelism): the loss is ``F.mse_loss(out, y)`` on them;
- forward: all-gather layer i's shards (``dist.all_gather_single``) before running it; with ``prefetch``, post the
  all-gather of layer i + 1 (``async_op=True``) *before* running layer i, and wait for it only when layer i + 1
  begins, so the gather crosses the network while layer i computes; never more than one layer ahead (a rank holds
  at most two layers whole); free each layer's whole parameters once its forward is done
  (``flat.untyped_storage().resize_(0)``, as FSDP2 frees them) and gather them again for its backward, the last
  layer's too; without ``prefetch``, post each gather only when its layer begins;
- backward, last layer first: the same, mirrored: with ``prefetch`` post the gather of layer i − 1 before running
  layer i's backward; reduce-scatter each layer's whole gradient as it is ready (``dist.reduce_scatter_single``,
  the average over the ranks, ``op=ReduceOp.AVG``), so that ``shards[i].grad`` ends as this rank's shard of the
  gradient averaged over the ranks (what DDP's gradients are, sharded); return this rank's loss (a float).

That is the schedule of torch's FSDP2 (``fully_shard`` on each layer): the sharded parameters are the module's
parameters between steps, unsharded just in time, prefetched one module ahead (``set_modules_to_forward_prefetch``,
and the backward prefetch it does by default), resharded after forward, gradients reduce-scattered.

**How the grader sees the overlap.**  A gather posted early crosses the wire while the layer before it computes, but
the wire shows no computing.  The grader makes a moment of it instead, as lab 3 does for DDP's overlap (``gate.py``):
the driver's ``layer`` holds every rank at the grader's gate inside every layer's forward, and inside every layer's
backward (where its output gets its gradient), and the grader answers each hold (a tensor, drawn at grading time,
added to that layer's output, or to its output's gradient) only once every rank is held and their bytes have
stopped growing.  Which layers are held is no secret to keep: all of them are, so a submission cannot prefetch for
the held layers alone.  Its capture of the wire then names each payload by its value (each layer's shard of each
rank: the grader drew them) and places it against the holds' answers:

- every shard crosses from its rank to the other exactly twice: the forward's gather, then the backward's;
- with ``prefetch``: for every layer i, the forward gather of layer i + 1 had crossed before the grader answered
  the hold inside layer i's forward, that of layer i + 2 crossed after it; the backward gather of layer i − 1 had
  crossed before the grader answered the hold inside layer i's backward, that of layer i − 2 after it;
- no backward gather crossed before the grader answered the hold inside the last layer's forward;
- without: each layer's gather crossed after the grader answered the hold inside the layer before it (forward) or
  after it (backward).

Posting a gather early is not overlapping: a rank that waits for each gather as soon as it posts it passes those
rules and hides nothing.  With ``prefetch`` a second run tells them apart (``_check_ahead``): both ranks hold at
every layer, and the grader keeps one inside layer k's forward (the rank and k drawn at grading time, told to
neither: ``gate.Behind``) while it lets the other go on to its hold inside layer k + 1's, which it can only reach by
running layer k + 1 while layer k + 2's gather, not yet posted by the held rank, is in flight; and the same in
backward.  A hold is answered only once the ranks' bytes settled (``Seen.settled``);
where the grader's patience ended first, the run is unobserved, never read.  That a layer's whole parameters are
really freed after its forward (a rank could keep them, or a copy, and gather again for show) is read from the OS,
in a third run on 2 ranks on four 2048 x 2048 layers, 16 MiB each whole (``_check_freed``): the grader holds every
rank before the step and inside each layer's forward and reads its private memory there; inside the last layer's
forward (and without prefetch inside every layer's) a rank may hold at most the exercise's two layers whole
(``FREED_LAYERS``), what it freed given back to the OS first (``osmemory.trim``, at every hold); a rank that keeps
each layer, or a copy of each, holds four.  The reduce-scatters' payloads are read for what they carried, on every
number of ranks (``_check_reduce_scattered``: every entry of each rank's own gradient of each layer, the grader's, in
what it sent, as it is or in a partial sum with the other ranks'); what a rank frees in backward is not read.

A rank cannot put a gather's bytes on the wire before it has posted it, and cannot go on past a hold before the
grader answers; so a gather that crossed while every rank was held was posted before the layer that holds, and one
that crossed after was not (the rank could not tell when the grader would answer).  Gathering every layer at once
shows the later gathers before the answer; gathering once and keeping the layer whole shows each shard once.  The
wire's order is read on 2 ranks, where each shard has one way to go; other runs on their values and what their
reduce-scatters carried.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch
import torch.nn.functional as F

from ... import carried, checks, exercise, gate, osmemory
from ...wire import Unobserved
from ...wiretimeline import Timeline
from .. import common
from .common import ms, seen
from .wireorder import timed_payloads

__all__ = ["TIMEOUT", "TOLERANCE", "WIDTHS", "check_sharded_step", "shard_layers"]

WIDTHS = (5, 8, 7, 9, 6, 3)  # the model's widths: five Linear layers, Tanh after each but the last
ROWS = 2  # rows per rank
TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # float32: the ranks' average adds up in another order
TIMEOUT = 60.0  # seconds: five tiny layers, ten holds

_HINT = (
    "does every rank make the same collective calls in the same order (each layer's all-gather, forward and "
    "backward, and each reduce-scatter), and wait for each all-gather before running its layer?"
)


# What crosses: the driver (dl.exercise.run defines it where the notebook's code runs) -----------------------------


def _sharded_step_in_rank(shards, shapes, x, y, prefetch):
    """A driver: this rank's shards as ``nn.Parameter`` s, the layer function (``F.linear``, Tanh but after the last
    layer; under grading, held at the grader's gate inside each layer's forward and its backward, the grader's
    answer added to the output, then to its gradient), the notebook's sharded_step on them, and, as data, each
    shard's .grad (None where unset) and what it returned."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from disttrain_lab import gate

    door = gate.connect(dist.get_rank())
    last = len(shapes) - 1

    def layer(i, flat, h):
        d_out, d_in = shapes[i]
        out = F.linear(h, flat[: d_out * d_in].view(d_out, d_in), flat[d_out * d_in : d_out * d_in + d_out])
        if i < last:
            out = torch.tanh(out)
        if door is not None:
            out = door.held(out + door.wait(out.shape))
        return out

    params = [nn.Parameter(s.clone()) for s in shards]
    if door is not None:
        door.start()  # (a mark: the holds' windows start here)
    loss = sharded_step(params, layer, x, y, prefetch=prefetch)  # noqa: F821  (the notebook's)
    if door is not None:
        door.close()
    grads = [None if q.grad is None else q.grad.detach().clone() for q in params]
    return {"grads": grads, "loss": loss.detach().clone() if isinstance(loss, torch.Tensor) else loss}


# The grader's model and data ----------------------------------------------------------------------------------------


def _draw(n: int, seed: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """Each layer's (weight, bias) and the batch x (ROWS·n, WIDTHS[0]), y (ROWS·n, WIDTHS[-1]); float32, from
    ``seed``."""
    g = torch.Generator().manual_seed(seed)
    layers = [
        (torch.randn(d_out, d_in, generator=g) / d_in**0.5, torch.randn(d_out, generator=g) / 4)
        for d_in, d_out in zip(WIDTHS[:-1], WIDTHS[1:])
    ]
    return layers, torch.randn(ROWS * n, WIDTHS[0], generator=g), torch.randn(ROWS * n, WIDTHS[-1], generator=g)


def _padded(flat: torch.Tensor, n: int) -> torch.Tensor:
    """``flat`` padded with zeros to n·ceil(k/n) elements."""
    c = -(-flat.numel() // n)
    return torch.cat([flat, flat.new_zeros(n * c - flat.numel())])


def shard_layers(layers, n: int) -> list[list[torch.Tensor]]:
    """``[rank][layer]``: each rank's shard of each layer's flat parameters (weight, then bias), padded."""
    padded = [_padded(torch.cat([w.flatten(), b]), n) for w, b in layers]
    return [[p.chunk(n)[r].clone() for p in padded] for r in range(n)]


def _held_layers() -> list[int]:
    """The layer inside which each hold comes, in the order the ranks reach them: every layer's forward, first to
    last, then every layer's backward, last to first."""
    count = len(WIDTHS) - 1
    return list(range(count)) + list(reversed(range(count)))


def _answers(n: int) -> list[list[torch.Tensor]]:
    """The grader's answers, drawn now: per hold (``_held_layers``), per rank, a tensor of that layer's output's
    shape (ROWS, width)."""
    g = torch.Generator().manual_seed(secrets.randbits(31))
    return [[torch.randn(ROWS, WIDTHS[i + 1], generator=g) / 4 for _ in range(n)] for i in _held_layers()]


def _one_process(layers, x, y, n: int, answers) -> tuple[list[float], list[list[torch.Tensor]]]:
    """Each rank's loss on its rows, and ``[rank][layer]`` its shard of the flat gradients averaged over the ranks,
    from ``loss.backward()`` in one process, each rank's rows in turn, with the grader's answers (if any) added where
    the rank was held (``_local_gradients``: each rank's own, before the average)."""
    losses, flats = _local_gradients(layers, x, y, n, answers)
    averaged = [_padded(sum(f[i] for f in flats) / n, n) for i in range(len(layers))]
    return losses, [[a.chunk(n)[r] for a in averaged] for r in range(n)]


def _local_gradients(layers, x, y, n: int, answers) -> tuple[list[float], list[list[torch.Tensor]]]:
    """Each rank's loss on its rows, and ``[rank][layer]`` the flat gradient of that loss alone (what the rank
    reduce-scatters), from ``loss.backward()`` in one process, with the grader's answers (if any) added where the rank
    was held."""
    last = len(layers) - 1
    losses, flats = [], []
    for r, (xs, ys) in enumerate(zip(x.tensor_split(n), y.tensor_split(n))):
        params = [(w.clone().requires_grad_(), b.clone().requires_grad_()) for w, b in layers]
        h = xs
        for i, (w, b) in enumerate(params):
            h = F.linear(h, w, b)
            if i < last:
                h = torch.tanh(h)
            if answers is not None:
                h = h + answers[i][r]
                h.register_hook(lambda grad, added=answers[2 * last + 1 - i][r]: grad + added)
        loss = F.mse_loss(h, ys)
        loss.backward()
        losses.append(loss.item())
        flats.append([torch.cat([w.grad.flatten(), b.grad]) for w, b in params])
    return losses, flats


def _check_reduce_scattered(case: str, run: exercise.ExerciseRun, local: list[list[torch.Tensor]]) -> None:
    """Under grading: what each rank sent in the step's collectives other than its all-gathers (gloo's reduce-scatter
    all-reduces the whole input and keeps the rank's chunk, so on the wire it is an all-reduce) carried every nonzero
    entry of its own gradient of each layer (``local[rank][layer]``, the grader's, ``_local_gradients``), as it is or
    in a sum with the other ranks' (divided by N or not: the average), whatever the algorithm's steps
    (``carried.sums_found``, within 1e-4 of the terms' magnitudes or 1e-6 of the layer's largest entry).  Gradients
    averaged some other way (the launcher's store), with zeros of the right size reduce-scattered, or with only the
    share a ring sends as it is (which once passed), fail.  In the student's own kernel (no capture) nothing is
    read."""
    sent = carried.sends(run, case)
    if sent is None:
        return
    n = run.world_size
    for rank in range(n):
        skipped = ("all_gather", "barrier", "send/recv")
        pool = carried.words_sent([p for src, _, slot, p in sent if src == rank and carried.kind(slot) not in skipped])
        for i, flat in enumerate(local[rank]):
            want = flat.detach().numpy()
            nonzero = want != 0
            if not nonzero.any():
                continue
            others = [local[r][i].detach().numpy()[nonzero] for r in range(n) if r != rank]
            atol = 1e-6 * float(np.abs(want).max())
            found = carried.sums_found(pool, want[nonzero], others, rtol=1e-4, atol=atol)
            assert found.all(), (
                f"{case}: rank {rank}'s reduce-scatter of layer {i}'s gradient should carry each of its own gradient's "
                f"{found.size} nonzero entries (the grader's loss.backward() on its rows in one process), as it is or "
                f"in a sum with the other ranks' (every step of the reduction sends what the rank has summed so "
                f"far); the grader's capture of the wire found {int(found.sum())} in what it sent besides its "
                "all-gathers. The gradients must travel in the reduce-scatter itself"
            )


# Reading what came back (untrusted data) ---------------------------------------------------------------------------


def _check_values(case: str, results, want_losses, want_grads) -> None:
    for rank, found in enumerate(results):
        if type(found) is not dict or set(found) != {"grads", "loss"} or type(found["grads"]) is not list:
            raise AssertionError(f"{case}: expected the driver's record from rank {rank}, got {seen(found)}")
        if len(found["grads"]) != len(want_grads[rank]):
            raise AssertionError(f"{case}: rank {rank}: expected one gradient per layer, got {seen(found['grads'])}")
        for i, (grad, want) in enumerate(zip(found["grads"], want_grads[rank])):
            what = f"{case}: rank {rank}: shards[{i}].grad"
            if grad is None:
                raise AssertionError(
                    f"{what} is None; every layer's shard ends with its share of the gradient averaged over the ranks "
                    "(dist.reduce_scatter_single(..., op=dist.ReduceOp.AVG))"
                )
            checks.assert_close(
                grad,
                want,
                what=(
                    f"{what}, against loss.backward() in one process on each rank's rows, the layer's flat gradient "
                    f"averaged over the ranks, padded, this rank's {want.numel()} elements"
                ),
                **TOLERANCE,
            )
        loss, want_loss = found["loss"], want_losses[rank]
        if type(loss) is not float or not abs(loss - want_loss) <= TOLERANCE["atol"] + TOLERANCE["rtol"] * abs(
            want_loss
        ):
            raise AssertionError(
                f"{case}: rank {rank} returned loss {seen(loss)}; F.mse_loss(out, y) on its rows is {want_loss:.6f} "
                "(a float: loss.item())"
            )


def _named(payloads: list[tuple[float, float, int, bytes]], by_value: dict[bytes, tuple[int, int]]):
    """(first byte, last byte, name) of each time a reference value crossed in ``payloads`` (one direction's, in
    order, with gloo's slots), whole in one payload or cut into several of one slot (gloo's all-gather sends a buffer
    in pieces, and two collectives in flight interleave their pieces on a connection): the value's bytes found in the
    slot's joined payloads, beginning and ending where payloads do.  Other payloads (the reduce-scatters' sums, whose
    values are graded on the shards' gradients) are passed over."""
    by_slot: dict[int, list[tuple[float, float, int, bytes]]] = {}
    for sent in payloads:
        by_slot.setdefault(sent[2], []).append(sent)
    found = []
    for sends in by_slot.values():
        joined = b"".join(p for *_, p in sends)
        starts, ends, at = {}, {}, 0
        for k, (*_, payload) in enumerate(sends):
            starts[at] = k
            at += len(payload)
            ends[at] = k
        for value, name in by_value.items():
            at = joined.find(value)
            while at >= 0:
                if at in starts and at + len(value) in ends:
                    found.append((sends[starts[at]][0], sends[ends[at + len(value)]][1], name))
                at = joined.find(value, at + 1)
    return sorted(found)


def _crossings(case: str, timeline: Timeline, shards) -> dict[tuple[int, int], list[tuple[float, float]]]:
    """On 2 ranks: (layer, rank) -> (first byte, last byte) of each crossing of that rank's shard of that layer to
    the other rank, in order; fails unless each crossed exactly twice, from its own rank."""
    by_value = {s.numpy().tobytes(): (i, r) for r, rank_shards in enumerate(shards) for i, s in enumerate(rank_shards)}
    times: dict[tuple[int, int], list[tuple[float, float]]] = {name: [] for name in by_value.values()}
    wrong = []
    for src, dst in ((0, 1), (1, 0)):
        for first, last, name in _named(timed_payloads(timeline, src, dst), by_value):
            if name[1] != src:
                wrong.append(f"rank {name[1]}'s shard of layer {name[0]} crossed from rank {src} at {ms(first)}")
            times[name].append((first, last))
    problems = wrong + [
        f"rank {r}'s shard of layer {i} crossed {len(t)} time(s)" + (" at " + ", ".join(ms(a) for a, _ in t)) * bool(t)
        for (i, r), t in sorted(times.items())
        if len(t) != 2
    ]
    if problems:
        raise AssertionError(
            f"{case}: the grader's capture of the wire does not show each layer's shards gathered twice, once for its "
            "forward and once for its backward: "
            + "; ".join(problems[:4])
            + (" ..." if len(problems) > 4 else "")
            + ". Free each layer's whole parameters after its forward and all-gather them again for its backward "
            "(the last layer's too), one all-gather of each layer each time."
        )
    return times


def _listed(problems: list[str], shown: int) -> str:
    """The first ``shown`` problems, and how many more."""
    return "; ".join(problems[:shown]) + (f" (and {len(problems) - shown} more)" if len(problems) > shown else "")


def _check_overlap(case: str, run: exercise.ExerciseRun, shards, prefetch: bool) -> None:
    """The gathers' crossings against the grader's holds, one inside each layer's forward and backward (see the
    module docstring)."""
    if not run.gate.settled:
        raise Unobserved(
            f"{case}: at some hold the ranks' bytes had not stopped growing when the grader's patience ended, so what "
            "crossed before its answer cannot be read as what the ranks had posted (a host too busy to grade on)"
        )
    times = _crossings(case, run.timeline, shards)
    count = len(WIDTHS) - 1
    cut = {}  # (pass, layer) -> when the grader answered the hold inside it
    for k, i in enumerate(_held_layers()):
        cut["forward" if k < count else "backward", i] = run.gate.hold_window(k)[1]  # (Unobserved: no answer seen)
    gathers = {  # (pass, layer) -> (first byte, last byte) of that gather, both shards
        (way, i): (min(times[i, r][k][0] for r in (0, 1)), max(times[i, r][k][1] for r in (0, 1)))
        for k, way in enumerate(("forward", "backward"))
        for i in range(count)
    }
    problems = []
    turn = cut["forward", count - 1]  # no backward gather before the forward's last layer ran
    for i in range(count):
        if gathers["backward", i][0] < turn:
            problems.append(
                f"layer {i}'s backward all-gather began crossing at {ms(gathers['backward', i][0])}, and the grader "
                f"answered its hold inside the last layer's forward at {ms(turn)}: gathered for backward before the "
                "forward was done (each layer is freed after its forward and gathered again for its backward)"
            )
    for (way, i), answered_at in cut.items():
        step = 1 if way == "forward" else -1
        ahead, beyond = i + step, i + 2 * step
        if not 0 <= ahead < count:
            continue
        first, last = gathers[way, ahead]
        answered = f"the grader answered its hold inside layer {i}'s {way} at {ms(answered_at)}"
        if prefetch and last > answered_at:
            problems.append(
                f"layer {ahead}'s {way} all-gather crossed from {ms(first)} to {ms(last)}, and {answered}: it was "
                f"posted after layer {i}'s {way} began, not before it (prefetch)"
            )
        if not prefetch and first < answered_at:
            problems.append(
                f"layer {ahead}'s {way} all-gather began crossing at {ms(first)}, and {answered}: with "
                f"prefetch=False it is posted only when layer {ahead}'s {way} begins"
            )
        if prefetch and 0 <= beyond < count and gathers[way, beyond][0] < answered_at:
            problems.append(
                f"layer {beyond}'s {way} all-gather began crossing at {ms(gathers[way, beyond][0])}, and {answered}: "
                "two layers ahead; prefetch one layer only (a rank holds at most two layers whole)"
            )
    if problems:
        raise AssertionError(
            f"{case}: on the grader's capture of the wire, "
            + _listed(problems, 4)
            + ". With prefetch, post layer i + 1's all-gather (async_op=True) before running layer i, and wait for it "
            "when layer i + 1 begins; in backward, layer i − 1's before running layer i's backward."
        )


# The graded check ----------------------------------------------------------------------------------------------------


def check_sharded_step(case: str, n: int, prefetch: bool = True) -> None:
    """``sharded_step(shards, layer, x, y, prefetch)`` on ``n`` ranks, five layers of ``WIDTHS`` whose weights and
    batch the grader draws.  (a) Every shard's .grad and every rank's loss are one process's (``loss.backward()`` on
    each rank's rows; the flat gradient averaged over the ranks, this rank's shard), to ``TOLERANCE``; (b) under
    grading on 2 ranks, the grader's capture of the wire at its holds (inside every layer, forward and backward) shows
    each shard gathered twice and the gathers prefetched one layer ahead (or, with ``prefetch=False``, not at all):
    see the module docstring; (c) under grading on 2 ranks, each layer freed after its forward, on the OS's count of
    each rank's memory (``_check_freed``).  In the student's own kernel (no gate, no capture) only (a) is checked;
    where grading could not observe, ``Unobserved`` is raised, never a pass."""
    if n < 2:
        raise ValueError(f"n = {n}: sharding needs 2 ranks or more")
    layers, x, y = _draw(n, secrets.randbits(31))  # weights nobody sees before the run
    shards = shard_layers(layers, n)
    shapes = [tuple(w.shape) for w, _ in layers]
    rows = list(zip(x.tensor_split(n), y.tensor_split(n)))
    answers = _answers(n) if exercise.graded() else None
    inputs = [(shards[r], shapes, xs, ys, prefetch) for r, (xs, ys) in enumerate(rows)]
    label = f"{case} (prefetch={prefetch}, {n} ranks, {len(layers)} layers)"
    run = common.run_or_fail(
        _sharded_step_in_rank, n, inputs, label, _HINT, timeout=TIMEOUT, timeline=True, content=True, gate=answers
    )
    want_losses, want_grads = _one_process(layers, x, y, n, answers)
    _check_values(label, run.results, want_losses, want_grads)
    _check_reduce_scattered(label, run, _local_gradients(layers, x, y, n, answers)[1])
    if run.timeline.source != "trace" and n == 2:  # grading: the overlap, on the wire the grader captured
        _check_overlap(label, run, shards, prefetch)
        if prefetch:
            _check_ahead(label, layers, x, y, shards, shapes)
        _check_freed(case, prefetch)


def _check_ahead(case: str, layers, x, y, shards, shapes) -> None:
    """Under grading, on 2 ranks: a second run, both ranks held inside every layer's forward and backward as in the
    first, in which the grader lets one rank (``behind``, drawn now) wait inside layer k's forward while it lets the
    other (``ahead``) go on to its hold inside layer k + 1's, then the same inside layer j's backward and layer
    j − 1's (k and j drawn now; ``gate.Behind``: the ranks are given nothing that says where or which).  The ahead
    rank gets there only if it ran layer k + 1 while layer k + 2's gather, which the held rank has not posted, was
    still in flight: a rank that waits for each gather as soon as it posts it (nothing overlaps) stops at that wait,
    and the grader, after ``gatekeeper.HELD_WAIT``, lets the held rank go without it (``Seen.ranks_ahead``).

    This run is captured too, and read as the first is for what crossed: each shard gathered twice, each rank's
    gradients in its reduce-scatters.  Its holds answer nothing (``gate.Behind``), so a rank can tell it from the
    first; a rank that then moved the shards and the gradients some other way (the launcher's store), posting no
    gather it could wait for, would reach any hold it is let go to."""
    count = len(WIDTHS) - 1
    behind = secrets.randbelow(2)
    k, j = secrets.randbelow(count - 2), 2 + secrets.randbelow(count - 2)
    apart = {k: behind, count + (count - 1 - j): behind}  # (the holds: every forward, then every backward)
    holds = [gate.Behind([None, None], apart[h]) if h in apart else [None, None] for h in range(2 * count)]
    rows = list(zip(x.tensor_split(2), y.tensor_split(2)))
    inputs = [(shards[r], shapes, xs, ys, True) for r, (xs, ys) in enumerate(rows)]
    label = f"{case}, rank {1 - behind} let go a layer ahead of rank {behind}"
    run = common.run_or_fail(
        _sharded_step_in_rank, 2, inputs, label, _HINT, timeout=TIMEOUT, timeline=True, content=True, gate=holds
    )
    want_losses, want_grads = _one_process(layers, x, y, 2, None)
    _check_values(label, run.results, want_losses, want_grads)
    _crossings(label, run.timeline, shards)  # (Unobserved where the capture is missing: the test fails)
    _check_reduce_scattered(label, run, _local_gradients(layers, x, y, 2, None)[1])
    ahead = 1 - behind
    for hold, (way, held_in, at, posted) in zip(
        sorted(apart), (("forward", k, k + 1, k + 2), ("backward", j, j - 1, j - 2))
    ):
        if ahead not in run.gate.ranks_ahead(hold):
            raise AssertionError(
                f"{label}: the grader held rank {behind} inside layer {held_in}'s {way} and let rank {ahead} go on to "
                f"its hold inside layer {at}'s {way}; it did not get there before the grader's patience ran out. Rank "
                f"{ahead} has "
                f"layer {at}'s gather (both ranks posted it a layer early) and must run layer {at}'s {way} while "
                f"layer {posted}'s gather, which rank {behind} has not posted yet, is in flight: wait for a gather "
                f"when its layer begins, not when you post it"
            )


# Freed after forward: the grader's reading of each rank's memory from the OS --------------------------------------

FREED_WIDTHS = (2048,) * 5  # four 2048 x 2048 layers: each whole layer 16 MiB of float32, above the OS count's noise
FREED_LAYERS = 2  # whole layers a reading may hold: the exercise's two (the solution: 1.05); a copy of each is four
FREED_MARGIN = 12 * 2**20  # bytes a reading may hold above FREED_LAYERS whole layers (measured: see _check_freed)


def _freed_in_rank(seed, widths, prefetch):
    """A driver: this rank's shards and rows drawn from ``seed`` here (16 MiB layers: drawn where they are used, not
    sent), held at the grader's gate once before the step and inside each layer's forward, once its output is
    made (the grader reads the rank's memory at each hold), the notebook's sharded_step; returns each shard's
    gradient as (sum, sum of magnitudes, sum of squares) and the loss."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from disttrain_lab import gate

    rank, n = dist.get_rank(), dist.get_world_size()
    door = gate.connect(rank)
    shapes = list(zip(widths[1:], widths[:-1]))
    last = len(shapes) - 1
    params = []
    for i, (d_out, d_in) in enumerate(shapes):
        c = -(-(d_out * d_in + d_out) // n)
        drawn = torch.Generator().manual_seed(seed + 1000 * i + rank)
        params.append(nn.Parameter(torch.randn(c, generator=drawn) / d_in**0.5))
    rows = torch.Generator().manual_seed(seed + 999 + 1000 * len(shapes) + rank)
    x, y = torch.randn(2, widths[0], generator=rows), torch.randn(2, widths[-1], generator=rows)

    def layer(i, flat, h):
        d_out, d_in = shapes[i]
        out = F.linear(h, flat[: d_out * d_in].view(d_out, d_in), flat[d_out * d_in : d_out * d_in + d_out])
        if i < last:
            out = torch.tanh(out)
        if door is not None:
            door.hold()  # (the grader reads this rank's memory: layer i's forward done, its output made)
        return out

    if door is not None:
        door.start()
        door.hold()  # (read before the step: the shards alone)
    loss = sharded_step(params, layer, x, y, prefetch=prefetch)  # noqa: F821  (the notebook's)
    if door is not None:
        door.close()
    sums = []
    for q in params:
        g = None if q.grad is None else q.grad.detach().double()
        sums.append(None if g is None else [float(g.sum()), float(g.abs().sum()), float(g.square().sum())])
    return {"sums": sums, "loss": loss.detach().clone() if isinstance(loss, torch.Tensor) else loss}


def _freed_reference(seed: int, widths, n: int) -> tuple[list[float], list[list[tuple]]]:
    """Here (no student code): what ``_freed_in_rank`` draws, each rank's loss on its rows and ``[rank][layer]`` the
    sums of its shard of the gradients averaged over the ranks, from ``loss.backward()`` in one process."""
    shapes = list(zip(widths[1:], widths[:-1]))
    shards = []
    for r in range(n):
        row = []
        for i, (d_out, d_in) in enumerate(shapes):
            c = -(-(d_out * d_in + d_out) // n)
            row.append(torch.randn(c, generator=torch.Generator().manual_seed(seed + 1000 * i + r)) / d_in**0.5)
        shards.append(row)
    layers = []
    for i, (d_out, d_in) in enumerate(shapes):
        flat = torch.cat([shards[r][i] for r in range(n)])
        layers.append((flat[: d_out * d_in].view(d_out, d_in), flat[d_out * d_in : d_out * d_in + d_out]))
    xs, ys = [], []
    for r in range(n):
        rows = torch.Generator().manual_seed(seed + 999 + 1000 * len(shapes) + r)
        xs.append(torch.randn(2, widths[0], generator=rows))
        ys.append(torch.randn(2, widths[-1], generator=rows))
    losses, grads = [], []
    sums = [torch.zeros(d_out * d_in + d_out, dtype=torch.float64) for d_out, d_in in shapes]
    for r in range(n):
        params = [(w.clone().requires_grad_(), b.clone().requires_grad_()) for w, b in layers]
        h = xs[r]
        for i, (w, b) in enumerate(params):
            h = F.linear(h, w, b)
            if i < len(params) - 1:
                h = torch.tanh(h)
        loss = F.mse_loss(h, ys[r])
        loss.backward()
        losses.append(loss.item())
        for i, (w, b) in enumerate(params):
            sums[i] += torch.cat([w.grad.flatten(), b.grad]).double()
    for r in range(n):
        row = []
        for s in sums:
            c = -(-s.numel() // n)
            mine = torch.cat([s / n, s.new_zeros(n * c - s.numel())]).chunk(n)[r]
            row.append(common.sums(mine))
        grads.append(row)
    return losses, grads


def _check_freed(case: str, prefetch: bool) -> None:
    """Under grading, on 2 ranks: a third run, on four 2048 x 2048 layers (``FREED_WIDTHS``: 16 MiB each, whole), the
    grader holding every rank once before the step and inside each layer's forward, once its output is made, and
    reading each rank's private memory from the OS there (``Seen.memory_at``).  Above what it held before the step, a
    rank may hold at most ``FREED_LAYERS`` (2) layers whole there and ``FREED_MARGIN`` more: inside the last
    layer's forward, and without ``prefetch`` inside every layer's.  With ``prefetch`` the holds before the last are not
    read: the next layer's gather is in flight there, and until it completes gloo's all-gather holds what it received
    in a buffer of its own as well as in the rank's tensor.  Measured with the solution, in whole layers: 1.05 to 1.06
    at the last layer's hold and 1.04 to 1.06 at every hold without prefetch (four runs each way here); 1.36 to 3.06
    at the other holds with prefetch.  Readings of 2.11, 3.07, 3.09 and 4.08 at the last hold, in full suites and
    beside busy processes, were the allocator's, not the rank's: a fresh rank's threads (gloo's) carve their blocks out
    of the free blocks the pytest worker's ended threads left in their arenas, and glibc keeps them when freed; made on
    purpose (``tests/labs/test_lab14_prefetch.py``), the solution read 4.05 layers, and 1.05 once every hold gives what
    is free back to the OS first (``osmemory.trim``).  A rank that
    keeps every layer whole after its forward, or a copy of each (and gathers again for backward, for show), holds
    four inside the last layer's forward (4.05 to 4.06).  The gradients and losses are one process's, so a rank that
    skipped the work holds nothing for it in vain."""
    widths, n = FREED_WIDTHS, 2
    count = len(widths) - 1
    whole = 4 * n * -(-(widths[1] * widths[0] + widths[1]) // n)  # one layer's gathered flat, in bytes
    seed = secrets.randbits(30)
    label = f"{case} (prefetch={prefetch}, 2 ranks, {count} layers of {widths[0]} x {widths[1]}, memory read)"
    run = common.run_or_fail(
        _freed_in_rank,
        n,
        [(seed, widths, prefetch)] * n,
        label,
        _HINT,
        timeout=TIMEOUT,
        memory=True,
        gate=[[None, None] for _ in range(count + 1)],
    )
    with osmemory.returning():  # (what the reference frees goes back to the OS: not in the next fresh rank's count)
        want_losses, want_sums = _freed_reference(seed, widths, n)
    for rank, found in enumerate(run.results):
        if type(found) is not dict or set(found) != {"sums", "loss"} or type(found["sums"]) is not list:
            raise AssertionError(f"{label}: expected the driver's record from rank {rank}, got {seen(found)}")
        loss, want_loss = found["loss"], want_losses[rank]
        if type(loss) is not float or not abs(loss - want_loss) <= 1e-4 * max(1.0, abs(want_loss)):
            raise AssertionError(
                f"{label}: rank {rank} returned loss {seen(loss)}; F.mse_loss(out, y) on its rows is {want_loss:.6f}"
            )
        for i, (got, want) in enumerate(zip(found["sums"], want_sums[rank])):
            (total, _, squares), (want_total, magnitude, want_squares) = got or (None, 0, None), want
            if got is None or not (
                abs(total - want_total) <= 1e-4 * magnitude + 1e-9
                and abs(squares - want_squares) <= 1e-3 * want_squares
            ):
                raise AssertionError(
                    f"{label}: rank {rank}: shards[{i}].grad has sum {seen(total)} and sum of squares "
                    f"{seen(squares)}; one process's gradient, averaged over the ranks, this rank's shard: "
                    f"{want_total:.6g} and {want_squares:.6g}"
                )
    problems = []
    for rank in range(n):
        before = run.gate.memory_at(0, rank)
        for i in range(count):
            if prefetch and i < count - 1:  # (the next gather in flight: gloo's buffer and the rank's, not read)
                continue
            held = run.gate.memory_at(i + 1, rank) - before
            if held > FREED_LAYERS * whole + FREED_MARGIN:
                problems.append(
                    f"rank {rank} held {held / 2**20:,.1f} MiB more inside layer {i}'s forward than before the step "
                    f"({held / whole:.2f} whole layers of {whole / 2**20:.1f} MiB; the test allows {FREED_LAYERS}, and "
                    f"{FREED_MARGIN / 2**20:g} MiB)"
                )
    if problems:
        raise AssertionError(
            f"{label}: as the OS counts each rank's private memory at the grader's holds, "
            + _listed(problems, 3)
            + ". Free each layer's whole parameters after its forward "
            "(flat.untyped_storage().resize_(0)) and keep no copy of them: gather them again for its backward."
        )
