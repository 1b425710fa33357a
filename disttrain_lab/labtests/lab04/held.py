"""Lab 4: what a ZeRO rank holds, as the OS counts it (the grade's evidence), not as the rank says.

The checks in ``zero.py`` read what each rank reports of its tensors (``memory.held``): good for the
student's picture and for a message that names the tensor kept whole, but a submission can rewrite
it.  The grade on memory rests on this check instead: the grader trains a model large enough that
each stage's saving stands far above the process's own noise, on 4 ranks forked fresh for the run,
and reads each rank's private memory from ``/proc/<pid>/smaps_rollup`` while the ranks pause between
two steps (``osmemory.py``; the driver sleeps there).  At that moment a rank holds what it keeps
from one step to the next, in fp32 with Adam, in bytes per parameter:

=========  ==========  =========  ===============  =====  ======================
stage      parameters  gradients  optimizer state  total  measured (solution)
=========  ==========  =========  ===============  =====  ======================
none (DP)  4           4          8                16     16.44
ZeRO-1     4           4          8/N = 2          10     10.50
ZeRO-2     4           4/N = 1    2                7      7.47
ZeRO-3     1           1          2                4      4.49
=========  ==========  =========  ===============  =====  ======================

(N = 4; measured with the lab's solution on this project's CI host, 8 layers of 2048 × 2048, Ψ = 33.6 M:
about 0.5 bytes per parameter, 15 MB, is the rank's own, from its fork and gloo's buffers.)  A rank may hold
at most its stage's total + ``SLACK`` (1.5) bytes per parameter; the stage before holds at least 3 more.
The bytes each rank had sent by the pause, from the wire, must be at least two steps' collectives and
62 % of the run's, and the run's at most 1.6 times three steps' (``_check_pause_placed``): a pause made
before the training, after bytes sent to look like it, does not pass for one between steps 2 and 3.
The parameters after the last step must be those of the same optimizer in one process: each one's sum and sum
of squares, and its values at 2,048 of its elements drawn at random (by a seed the grader draws per kernel and
tells the ranks at its gate only once the training is over, after every byte of it crossed, from the capture:
``_check_told_after_training``; in the student's own kernel, with no gate, in the run's inputs)
within a median of 3e-7 (``_check_training``): summing the gradients in another order moves the solution's by a
median of 3e-8 at most, Adam's state kept in bfloat16 between steps (8.47 bytes per parameter at the pause, with
no sharding at all) by 2.6e-6 or more, though its sums pass.

ZeRO-3 is read again just before each layer's forward in the last step (the driver's forward pre-hooks,
after the student's gather), then just before each layer's backward (hooks the driver puts on the layers'
outputs, after the student's): a rank may hold at most two layers in full (2 × 16 MiB) more than between
steps.  Measured with the solution: 3.94 bytes per parameter before every layer's forward (4.56 between
steps, the gradients' shards since dropped by ``zero_grad``), then 3.97 before the last layer's backward up
to 4.84 before the first's (each layer's gradient shard, 4 MiB, kept as backward goes).  A rank that frees
what backward gathered only once the whole backward is done reads 5.97 before layer 3's backward (45 MiB
above between steps) and fails there.  A ``free`` that only points ``p.data`` back at the shard
leaves the gathered weight alive in what autograd saved for backward: 3.94 before layers 0 and 1, then
0.5 more per layer, 6.94 before layer 7 (+2.4 over between steps, where 2 layers are 1.0).

The processes read are the ones the kernel names as its ranks; one named in a real rank's place that
shares its connections is found (``osmemory.observed``: the connections between ranks must be open in
their two ranks alone at the pause).  What this does not see: a rank that keeps its state outside itself
during the pause, in memory made before the run (a file the kernel filled, the kernel's own memory through
a pipe) and takes it back after, or a named process relaying a real rank's messages through a pipe; the
lab's rules forbid both, the grader cannot yet observe them (docs/architecture.md).
"""

from __future__ import annotations

import functools
import math
import secrets
import statistics
from collections.abc import Callable

import torch

from ... import exercise, osmemory
from ...exercise import ExerciseRun
from ...wire import Unobserved
from .. import common
from .ranks import _train_in_rank, sampled
from .zero import _single_process, zero3_driver

__all__ = ["check_held", "per_parameter"]

WORLD_SIZE = 4
SIZES = [2048] * 9  # 8 layers of 2048 x 2048 (+ biases): Ψ = 33.6 M
STEPS = 3
BATCH = 12
SLACK = 1.5  # bytes per parameter above the stage's total
BY_PAUSE, AT_MOST = 0.62, 1.6  # where the pause falls in the run's bytes, and the run's bytes (_check_pause_placed)
LAYERS_WHOLE = 2  # ZeRO-3: layers in full at a pause before a layer's forward or backward, above one between steps
DRIFT = 3e-7  # the median |difference| from one process's parameters allowed over each parameter's sampled elements
# which elements are sampled (ranks.sampled): drawn once per kernel, by the grader; under grading a rank is told it
# only once its training is over, at the grader's gate (a float32: below 2^24), so it cannot keep those alone exact
SEED = secrets.randbits(24)
NAMES = {1: "Zero1Optimizer", 2: "Zero2Optimizer", 3: "Zero3Module"}


def per_parameter(stage: int, n: int = WORLD_SIZE) -> dict[str, float]:
    """What a rank keeps between steps at ``stage``, in bytes per parameter (fp32, Adam)."""
    return {
        "parameters": 4 / n if stage >= 3 else 4,
        "gradients": 4 / n if stage >= 2 else 4,
        "optimizer state": 8 / n if stage >= 1 else 8,
    }


def check_held(stage: int, driver: Callable | None = None) -> ExerciseRun:
    """The stage's class (``Zero1Optimizer``, ``Zero2Optimizer``, ``Zero3Module``) on 4 ranks forked for
    the run, an MLP of 8 layers of 2048 × 2048, Adam, 3 steps, paused before the last: each rank's
    private memory at the pause, read from the OS, at most the stage's bytes per parameter + 1.5 (ZeRO-3:
    also paused before each layer's forward and backward in the last step, at most 2 layers in full more); the
    parameters after the last step those of Adam in one process.  ``driver``: Zero2Optimizer's
    (``zero2_driver``), else the lab's own."""
    name, n = NAMES[stage], WORLD_SIZE
    if driver is None:
        driver = zero3_driver() if stage == 3 else _train_in_rank
    psi = sum(a * b + b for a, b in zip(SIZES, SIZES[1:]))
    case = (
        f"{name} on {n} ranks, an MLP of {len(SIZES) - 1} layers of {SIZES[0]} × {SIZES[0]} "
        f"(Ψ = {psi / 1e6:.1f} M parameters), Adam, {STEPS} steps"
    )
    hint = "do all ranks make the same collective calls, in the same order, with equal-size shards?"
    graded = exercise.graded()  # (the seed at the grader's gate after the training; in the student's kernel, given)
    run = common.run_or_fail(
        driver,
        n,
        (name, stage, "paused" if graded else f"paused {SEED}", SIZES, STEPS, BATCH, "adam"),
        case,
        hint,
        timeout=180,
        memory=True,
        gate=[[torch.tensor([float(SEED)])] * n] if graded else None,
        content=False,  # (when the gate's answer left, from the capture; not what crossed)
    )
    if graded:
        _check_told_after_training(run, case)
    _check_training(run, _reference(SEED), stage, case)
    parts = per_parameter(stage, n)
    total = sum(parts.values())
    limit = (total + SLACK) * psi
    said = ", ".join(f"{what} {b:g}" for what, b in parts.items())
    sent = run.memory.sent
    step = (3 if stage == 3 else 2) * (n - 1) / n * 4 * psi  # one step's collectives, ring-optimal
    for rank in range(n):
        held = run.memory.of(rank)  # (wire.Unobserved where the OS was not read: the test fails)
        assert held <= limit, (
            f"{case}: rank {rank} held {held / 2**20:,.0f} MiB ({held / psi:.2f} bytes per parameter) while the "
            f"ranks paused between steps {STEPS - 1} and {STEPS}, as the OS counts its private memory; ZeRO-{stage} "
            f"keeps {said} = {total:g} bytes per parameter between steps, and the test allows {total + SLACK:g} "
            f"({limit / 2**20:,.0f} MiB)" + _what_is_kept_whole(stage, held / psi)
        )
        if sent is None and run.memory.source != "os":  # (the student's kernel without ss; never the grader)
            continue
        assert sent is not None, f"{case}: the bytes the ranks had sent by the pause were not observed"
        _check_pause_placed(case, stage, rank, sent[rank], run.traffic.sent(rank), step)
    if stage == 3:
        _check_each_layer(run, case, psi)
    if run.memory.source != "os":  # (the student's own kernel: show what it read)
        print(
            f"{name}: each rank held {', '.join(f'{run.memory.of(r) / psi:.2f}' for r in range(n))} bytes per "
            f"parameter at the pause, as the OS counts it (at most {total + SLACK:g})"
        )
    return run


def _check_told_after_training(run: ExerciseRun, case: str) -> None:
    """Under grading: the seed of the elements compared (``SEED``) was told at the grader's gate (its one hold) once
    every byte of the training between the ranks had crossed, from the grader's capture: a rank that asked for it
    sooner (holding at the gate before its training) could have kept those elements alone exact."""
    seen, n = run.gate, run.world_size
    cut = seen.cuts[0] if seen.source == "wire" and seen.cuts else None
    if cut is None:
        why = seen.why or "no answer seen"
        raise Unobserved(
            f"{case}: the grader could not see when it told the ranks which elements it compares ({why}), so the "
            "values cannot be graded"
        )
    for src in range(n):
        for dst in range(n):
            after = run.timeline.bytes(src, dst) - run.timeline.crossed(src, dst, cut) if src != dst else 0
            assert after == 0, (
                f"{case}: rank {src} sent rank {dst} {after:,} bytes after the grader told the ranks, at its gate, "
                "which elements of the parameters it compares; the test's driver asks only once the last step is "
                "over, so no training may come after (did the ranks hold at the grader's gate before?)"
            )


def _check_each_layer(run: ExerciseRun, case: str, psi: int) -> None:
    """ZeRO-3 holds one layer in full at a time: at the pauses just before each layer's forward in the last step
    (the driver's forward pre-hooks, after the student's), then just before each layer's backward (the driver's
    hooks on the layers' outputs, after the student's), each rank at most ``LAYERS_WHOLE`` (2) layers in full
    more than it held between steps; by the pause before layer k's forward, each rank had sent at least 90 % of k
    layers' ring-optimal all-gathers since the pause between steps, and by the i-th pause in backward at least
    90 % of the forward's all-gathers and i more layers' (a pause made before those gathers is not one in
    backward)."""
    n, layers = WORLD_SIZE, len(SIZES) - 1
    layer_bytes = 4 * (SIZES[0] * SIZES[1] + SIZES[1])
    later = run.memory.later
    assert len(later) >= 2 * layers, (
        f"{case}: the ranks paused {len(later)} times in the last step; the test pauses them just before each of the "
        f"{layers} layers' forward (a forward pre-hook, registered after yours) and just before each layer's backward "
        f"(a hook on its output, put there by a forward hook registered after yours): {2 * layers} pauses. Does each "
        "layer's forward run through its module, layer(x), and its output reach the loss?"
    )
    for k, reading in enumerate(later):
        backward = k >= layers
        at = f"layer {layers - 1 - (k - layers) % layers}'s backward" if backward else f"layer {k}'s forward"
        for rank in range(n):
            held, between = reading.of(rank), run.memory.of(rank)
            allowed = between + LAYERS_WHOLE * layer_bytes
            assert held <= allowed, (
                f"{case}: rank {rank} held {held / 2**20:,.0f} MiB ({held / psi:.2f} bytes per parameter) just before "
                f"{at} in step {STEPS}, {(held - between) / 2**20:,.0f} MiB more than between steps "
                f"({between / psi:.2f}); ZeRO-3 holds one layer in full at a time ({layer_bytes / 2**20:,.0f} MiB "
                f"here) and the test allows {LAYERS_WHOLE}.  "
                + (
                    "Is each layer's unit freed right after its backward (in grad_ready, once its gradient is "
                    "reduce-scattered), not at the end of the whole backward?"
                    if backward
                    else "Are the earlier layers' gathered parameters freed for real?  Autograd keeps what forward "
                    "saved (nn.Linear saves its weight) until that layer's backward: free the gathered storage "
                    "(untyped_storage().resize_(0)), as FSDP does"
                )
            )
            if k < 2 * layers and reading.sent is not None and run.memory.sent is not None:
                gathers = k  # (before layer k's forward: k layers; before the i-th layer's backward: all and i more)
                since, least = reading.sent[rank] - run.memory.sent[rank], 0.9 * gathers * (n - 1) / n * layer_bytes
                assert since >= least, (
                    f"{case}: by the pause just before {at} in step {STEPS}, rank {rank} had sent {since:,} bytes "
                    f"since the pause between steps; gathering the {gathers} layers before it sends at least "
                    f"{least:,.0f}"
                )


def _check_pause_placed(case: str, stage: int, rank: int, by_pause: int, in_all: int, step: float) -> None:
    """The pause the memory was read at is the one between steps 2 and 3.  ``step``: one step's collectives,
    ring-optimal (2 × (N−1)/N × 4Ψ bytes for ZeRO-1 and -2, 3 × for ZeRO-3).  By the pause a rank had sent at
    least 2 steps' and at least ``BY_PAUSE`` (62 %) of what it sent in the whole run (2 of its 3 equal steps:
    67 %), and the whole run at most ``AT_MOST`` (1.6) times 3 steps' (the solution, whose helpers move ring-optimal
    bytes: 1.0; gloo's own ``reduce_scatter_single``, which sends an all-reduce's bytes: 1.5 for ZeRO-1 and -2,
    1.33 for ZeRO-3).  A pause made before training, after
    bytes sent to look like it, cannot meet all three: to be 62 % of the run those bytes are 1.63 times what the
    3 steps after them send, so the run is 2.63 times the 3 steps' own, and training that is correct sends at
    least an all-reduce of the gradients per step (1 ZeRO-1 step, 2/3 of a ZeRO-3 step): 2.63 × 2/3 > 1.6."""
    words = f"{case}: rank {rank} had sent {by_pause:,} bytes when the ranks paused and {in_all:,} in the whole run"
    assert by_pause >= 2 * step, f"{words}; two steps of ZeRO-{stage} send at least {2 * step:,.0f} before the pause"
    assert by_pause >= BY_PAUSE * in_all, (
        f"{words}: the pause should come after 2 of the {STEPS} steps' collectives (two thirds of the bytes), "
        f"at least {BY_PAUSE:.0%} of them"
    )
    assert in_all <= AT_MOST * STEPS * step, (
        f"{words}; {STEPS} steps of ZeRO-{stage} send {STEPS * step:,.0f} bytes with ring-optimal collectives, and "
        f"the test allows {AT_MOST:g} times that"
    )


def _what_is_kept_whole(stage: int, got: float) -> str:
    """Which stage's memory ``got`` bytes per parameter looks like, when it is a less sharded one's."""
    for fewer in range(stage - 1, -1, -1):
        if got >= sum(per_parameter(fewer).values()) - SLACK / 2:
            kept = [what for what, b in per_parameter(stage).items() if b < per_parameter(fewer)[what]]
            like = "no sharding" if fewer == 0 else f"ZeRO-{fewer}"
            return f": that is {like}'s memory; does a rank keep all of the {' and all of the '.join(kept)}?"
    return ""


@functools.cache
def _reference(seed: int) -> tuple[tuple[str, float, float, float, int, tuple[float, ...]], ...]:
    """Adam in one process on the same model and data, the same for every stage (computed once per kernel,
    after the first run): each parameter's name, sum, sum of magnitudes, sum of squares (float64), size and
    values at the elements ``sampled`` from ``seed``.  Its memory is returned to the OS: in the student's own
    kernel, what it freed would show in the next fresh ranks' count (``osmemory.py``)."""
    with osmemory.returning():
        model = _single_process("mlp", SIZES, BATCH, STEPS, "adam")
        sums = []
        for i, (name, p) in enumerate(model.named_parameters()):
            w = p.detach().double()
            at = tuple(w.reshape(-1)[sampled(w.numel(), seed + i)].tolist())
            sums.append((name, float(w.sum()), float(w.abs().sum()), float(w.square().sum()), w.numel(), at))
        del model, p, w
    return tuple(sums)


def _check_training(run: ExerciseRun, reference, stage: int, case: str) -> None:
    """Each parameter after the last step against the one process's (stage 3: the ranks' shards put together):
    its sum and sum of squares within what float32's rounding over its elements allows, and its values at the
    sampled elements (``ranks.sampled``, 2,048 a parameter) within a median of ``DRIFT`` (3e-7).

    Why the median of the elements: 3 steps of Adam (lr 0.01, eps 1e-8) on this 8-layer MLP amplify rounding.
    Summing each rank's gradient of its slice of the batch is not summing the batch's in one process; the
    difference, a float32 rounding, reaches the parameters through Adam's m / (√v + ε) (its step 1 is ±lr
    where |g| ≫ ε), changes the next forward and grows: after step 3, with the solution (ZeRO-1, -2 and -3 give
    the same bits), each weight matrix's elements differ from the one process's by a median of 2e-9 to 7.5e-9
    (the last bias's 3e-8), but a tenth of them by over 2e-8 to 7e-7 and thousands by over 1e-3 (up to 0.029):
    each sum by up to 1.3, a quarter of its tolerance, each sum of squares by up to 1.7e-5 relative (a sixth).
    A rank that shards nothing and keeps Adam's state in bfloat16 between steps (8 significant bits), its
    gradients freed, holds 8.47 bytes per parameter at the pause, within ZeRO-1's 11.5 and ZeRO-2's 8.5, and
    its sums pass (at most 0.58 of the tolerance, sums of squares 5.4e-5 relative); its state's rounding, about
    2⁻⁹ of each moment, moves every element of the later layers by a median of 1e-5 in the worst of them (5e-6
    with exp_avg_sq alone in bfloat16; 5e-6, or 2.6e-6 for exp_avg_sq alone, when it is rounded only at the
    pause, by a rank that knows when the pause comes).  ``DRIFT``: 10 times the honest worst (3e-8), 9 times
    below that gentlest forgery's worst parameter (2.6e-6).  Out of its reach: state kept to 15 of float32's
    23 mantissa bits (3 bytes a moment: 4 + 3 + 3 bytes per parameter, ZeRO-1's 10) drifts by a median of
    5e-8 at most, as much as the rounding (and a rank that recomputes the whole training after the pause
    holds nothing lossy at all)."""
    n = run.world_size
    if stage == 3:
        added = [
            tuple(map(sum, zip(*(out["sums"][i] for out in run.results)))) for i in range(len(run.results[0]["sums"]))
        ]
        joined = [[v for out in run.results for v in out["samples"][i]] for i in range(len(reference))]
        holders = {"the ranks' shards'": (added, joined)}
    else:
        holders = {f"rank {rank}'s": (out["sums"], out["samples"]) for rank, out in enumerate(run.results)}
    for whose, (sums, samples) in holders.items():
        assert len(sums) == len(samples) == len(reference), (
            f"{case}: {whose} parameters after {STEPS} steps: {len(sums)} returned, the model has {len(reference)}"
        )
        for (pname, want, magnitude, want_squares, numel, want_at), (total, squares), at in zip(
            reference, sums, samples
        ):
            close = math.isclose(total, want, abs_tol=1e-5 * magnitude + 1e-6 * numel)
            assert close and math.isclose(squares, want_squares, rel_tol=1e-4), (
                f"{case}: {whose} {pname} after {STEPS} steps: sum {total:.6g}, sum of squares {squares:.6g}; Adam "
                f"in one process gives {want:.6g} and {want_squares:.6g}"
            )
            shards = f" (is each rank's shard ceil({numel} / {n}) elements, in rank order?)" if stage == 3 else ""
            assert len(at) == len(want_at), (
                f"{case}: {whose} {pname} after {STEPS} steps: {len(at)} of the {len(want_at)} sampled elements "
                f"returned{shards}"
            )
            drift = statistics.median(abs(a - b) for a, b in zip(at, want_at))
            assert drift <= DRIFT, (
                f"{case}: {whose} {pname} after {STEPS} steps differs from Adam in one process by a median of "
                f"{drift:.2g} over {len(at):,} of its elements (drawn at random; largest "
                f"{max(abs(a - b) for a, b in zip(at, want_at)):.2g}); summing the gradients in another order moves "
                f"the solution's by a median of at most 3e-8, and the test allows {DRIFT:g}.  Is the optimizer's "
                "state kept whole in float32 from one step to the next (not in bfloat16, nor with bits dropped)?"
            )
