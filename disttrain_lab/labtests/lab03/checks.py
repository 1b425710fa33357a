"""Lab 3's checks, against one process training the same model on the whole batch."""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Callable

import torch

from ... import carried, checks, exercise, gate, models
from ...trace import Run
from .. import common
from .common import (
    _COLLECTIVES_IN_ORDER,
    GRADED_PASSED,
    TOLERANCE,
    _device,
    batches,
    bucket_sizes,
    graded_model,
    per_parameter,
)
from .overlap import (
    answers,
    assert_backward_ran_on,
    assert_crossed_while_held,
    assert_steps_all_reduce,
    crossing,
    gate_position,
    reference,
    where,
)
from .ranks import _broadcast_in_rank, _shards, _traced, _train_in_rank

# --------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------
_BUCKET_RULE = (
    "the bucket rule's: fill buckets with the trainable parameters in *reverse* order of model.parameters() "
    "(the order backward makes their gradients ready), closing a bucket when the next parameter would push it "
    "past bucket_mb · 2**20 bytes"
)


def check_shard(n_rows: int, world_size: int) -> None:
    """``shard(x, rank, world_size)`` (exercise 1): rank r's rows are ``x.tensor_split(world_size)[r]``
    (contiguous, the first ``n_rows % world_size`` ranks one row more, none dropped), returned as a
    view of ``x``, not a copy."""
    x = torch.arange(n_rows * 2).view(n_rows, 2)
    run = exercise.run(_shards, 1, (x.clone(), world_size), timeout=30)
    before, after = run.results[0]
    for rank in range(world_size):
        got, want = before[rank], x.tensor_split(world_size)[rank]
        checks.assert_close(
            got,
            want,
            what=f"shard of {n_rows} rows, rank {rank} of {world_size} (the first "
            f"{n_rows % world_size} ranks get {n_rows // world_size + 1} rows, the others "
            f"{n_rows // world_size}; none dropped)",
        )
        view = torch.equal(after[rank], want + 1) or got.numel() == 0  # a copy does not see x change
        assert view, "shard should return a view (a slice), not a copy"


def check_broadcast_parameters(kind: str, n: int, device: str | None = None) -> None:
    """``broadcast_parameters(model)`` (exercise 2): on n ranks, each with the model ``kind`` built from
    its own seed, every rank ends with rank 0's parameters exactly, frozen ones too, and each rank but 0
    received at least their bytes over the network, as the operating system counted them (a rank that
    rebuilds rank 0's model from rank 0's seed has not broadcast it), and under grading each of rank 0's
    parameters crossed, byte for byte, into every other rank, from one rank or another (a tree's), in the
    grader's capture of the wire.  In a notebook whose host cannot count (no ``ss``: ``run.traffic.source ==
    "trace"``) only the values are checked."""
    case = f"broadcast_parameters on {n} ranks ({kind} model)"
    run = common.run_or_fail(
        _broadcast_in_rank,
        n,
        (kind,),
        case,
        "do all ranks broadcast the same parameters in the same order?",
        timeout=60,
        device=_device(device),
        content=True,
    )
    common.assert_parameters_match(
        run.results,
        graded_model(kind, seed=0),  # rank 0's, built here
        lambda rank, name: (
            f"{case}: rank {rank}'s {name} against rank 0's (every parameter, frozen ones too, is copied from rank 0)"
        ),
        rtol=0,
        atol=0,
    )
    if run.traffic.source == "trace":  # (the student's own machine cannot count: the values say enough there)
        return
    nbytes = sum(p.numel() * p.element_size() for p in graded_model(kind, seed=0).parameters())
    for rank in range(1, n):
        assert run.traffic.received(rank) >= nbytes, (
            f"{case}: rank {rank} received {run.traffic.received(rank):,} bytes over the network, as the operating "
            f"system counted them; rank 0's parameters are {nbytes:,} bytes. Every rank must receive them from "
            f"rank 0 (dist.broadcast); building rank 0's values some other way is not a broadcast "
            f"({run.traffic.describe()})"
        )
    for name, p in graded_model(kind, seed=0).named_parameters():  # (each on its own: in any order, or flattened)
        carried.assert_carried(run, {(None, rank): [p.detach()] for rank in range(1, n)}, f"{case}, {name}")


def check_ddp(
    name: str,
    wrapper: str,
    kind: str,
    n: int,
    batch: int,
    steps: int = 3,
    micro_steps: int = 1,
    all_reduces: int | None = None,
    overlap: bool = False,
    buckets: list[int] | None = None,
    bucket_mb: float | None = None,
    graders: tuple[str, str, str] | None = None,
    interrupted: bool = False,
    device: str | None = None,
    nested: bool = False,
) -> Run:
    """Train your class ``wrapper`` on n ranks; per step: none under no_sync(); exactly the trainable gradients
    all-reduced, in ``all_reduces`` calls or, with ``buckets``, in all-reduces of those byte sizes (under
    grading read off the wire between the grader's marks of each micro-step: ``overlap.assert_steps_all_reduce``;
    in your own notebook, from the trace); with ``overlap``, communication during backward (under grading from
    the grader's gate: ``overlap.assert_crossed_while_held``, where a trainable layer lies below the first
    bucket) and each all-reduce posted with async_op=True and waited for only after
    backward (under grading from its probe: ``overlap.assert_backward_ran_on``); then compare every rank with
    single-process SGD on the full batch.  ``interrupted``: an exception is raised
    inside no_sync() first (the steps after it must communicate); ``nested``: a no_sync() opened and closed inside
    each micro-step's no_sync() (the outer one must still hold).  ``graders``: the grader's own version of the
    exercise ``wrapper`` is built on, used instead of yours (``broadcast_that_passed``,
    ``bucketed_ddp_that_passed``).  ``device``: where the ranks compute (None: the CPU under the grader, else the
    notebook's DEVICE).  Returns the ranks' trace."""
    case = (
        f"{name} on {n} ranks ({kind} model, batch {batch}, {steps} steps"
        + (f", {micro_steps} micro-steps" if micro_steps > 1 else "")
        + (", a no_sync() opened and closed inside each no_sync()" if nested else "")
        + (", after an exception inside no_sync())" if interrupted else ")")
    )
    at = gate_position(kind, bucket_mb) if overlap else None  # where the grader holds the backward, if anywhere
    around = overlap and n > 1 and steps > 1  # every step's backward held before and after
    # under grading the driver marks each micro-step at the grader's gate, holds the ranks before and after each
    # step's backward, where the grader keeps one rank (``probe``, drawn now) behind before the backward of one step
    # (``probed``, not the last), and holds the last step's backward where ``at``
    probe, probed = (secrets.randbelow(n), secrets.randbelow(steps - 1)) if around else (None, None)
    given = answers(kind, batch, n, micro_steps, at) if at is not None else None
    holds = []
    for step in range(steps if around else 0):
        holds.append(gate.Behind([None] * n, probe) if step == probed else [None] * n)
        holds += [given] if given is not None and step == steps - 1 else []
        holds.append([None] * n)
    holds += [given] if given is not None and not around else []
    ran = common.run_or_fail(
        _train_in_rank,
        n,
        (wrapper, kind, batch, steps, micro_steps, bucket_mb, graders, interrupted, nested, at, around),
        case,
        _COLLECTIVES_IN_ORDER,
        timeout=60,
        device=_device(device),
        gate=holds or [None] * n,
    )
    model = graded_model(kind, seed=0)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    # a grader was there (in the student's own notebook there is none): the steps as the grader observed them
    observed = ran.gate.source != "none"
    held = at is not None and observed
    expected = None
    if observed:
        expected, local = reference(kind, batch, steps, micro_steps, n, at, given if held else None)
        per_param = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
        sizes = buckets or (per_param if all_reduces is not None else None)
        rule = (
            _BUCKET_RULE
            if buckets
            else f"one per trainable parameter, {all_reduces} in all"
            if all_reduces is not None
            else ""
        )
        assert_steps_all_reduce(ran, case, local, micro_steps, trainable, sizes, rule, interrupted)
        if probe is not None:
            assert_backward_ran_on(ran, case, probe, 2 * probed)
        if held:
            assert_crossed_while_held(ran, case, local[-1], crossing(kind, bucket_mb, at), where(kind, at))
    run = _traced(ran)
    if interrupted and not observed:  # the first backward after the exception must post its all-reduces again
        for rank in range(n):
            first = next(e for e in run.by_rank(rank) if e.kind == "region" and e.name == "backward")
            assert [e for e in run.select(op="all_reduce", rank=rank) if e.start < first.end], (
                f"{case}: rank {rank}'s first backward after an exception was raised inside `with ddp.no_sync():` "
                f"(and caught) posted no all-reduce: no_sync() left require_sync False, so the hooks stayed switched "
                f"off.  Restore it in `finally:` (`try: yield` / `finally: ...`): the exception is raised at the "
                f"yield, and a line after it never runs"
            )
    if wrapper == "BucketedDDP":  # exercise 6 extends the class by overriding grad_ready
        hooks = steps * micro_steps * sum(1 for p in model.parameters() if p.requires_grad)
        for rank, result in enumerate(ran.results):
            assert result["routed"] == hooks, (
                f"{case}: rank {rank}: a subclass that overrides grad_ready (as AccumulatingDDP does in exercise 6) "
                f"saw {result['routed']} calls where backward made {hooks} gradients ready ({steps} steps of "
                f"{sum(1 for p in model.parameters() if p.requires_grad)} trainable parameters): register "
                f"self.grad_ready as every parameter's hook, and route every hook through it"
            )
    if not observed:  # (under grading: all from the wire and the gate, above)
        for rank in range(n):
            regions = [e for e in run.by_rank(rank) if e.kind == "region"]
            for step in range(steps):
                _check_step(case, run, rank, step, regions, trainable, overlap, all_reduces, buckets)
    if expected is None:  # (the student's own notebook)
        expected = models.train_single_process(graded_model(kind, seed=0), batches(kind, batch, steps), lr=0.1)
    common.assert_parameters_match(
        run.results,
        expected,
        lambda rank, pname: (
            f"{case}: rank {rank}'s {pname} after {steps} steps, against one process training on the "
            f"whole batch (rank {rank} started from its own random weights: rank 0's must be broadcast "
            f"first; gradients are averaged, SUM / N"
            + (
                "; in the last step the grader's answer at its gate was added to the gradient of the layers below "
                "it, so a rank that did not wait for it ends elsewhere)"
                if held
                else ")"
            )
        ),
        **TOLERANCE,
    )
    return run


def _check_step(
    case: str,
    run: Run,
    rank: int,
    step: int,
    regions: list,
    trainable: int,
    overlap: bool,
    all_reduces: int | None,
    buckets: list[int] | None,
) -> None:
    """Rank ``rank``'s all-reduces in training step ``step``, read from its trace (see check_ddp), in the
    student's own notebook: under grading the steps' all-reduces are read off the wire, overlap at the grader's
    gate and probe, and where no gate has a layer below it, there is nothing left to overlap
    (``overlap.gate_position``)."""
    backward = [e for e in regions if e.name == "backward" and e.meta["step"] == step]
    [finish] = [e for e in regions if e.name == "finish" and e.meta["step"] == step]
    last = next(e for e in backward if e.meta["last"])
    calls = [e for e in run.select(op="all_reduce", rank=rank) if backward[0].start <= e.start <= finish.end]
    early = [e for e in calls if e.start < last.start]
    assert not early, (
        f"{case}: rank {rank} all-reduced during a micro-step under no_sync() "
        f"({len(early)} calls in step {step}); under no_sync() gradients only accumulate"
    )
    if overlap:
        assert calls and calls[0].start < last.end, (
            f"{case}: rank {rank}'s first all-reduce of step {step} started after backward ended: "
            f"post it from a gradient hook, during backward"
        )
    if overlap:
        blocking = [e for e in calls if "request" not in e.meta]  # a call without async_op=True
        assert not blocking, (
            f"{case}: rank {rank} made {len(blocking)} blocking all-reduce call(s) in step {step} "
            f"(no async_op=True): backward stops at each until the network is done, so nothing overlaps. "
            f"Post each all-reduce with async_op=True from the hook and wait for the works in "
            f"finish_gradient_synchronization()"
        )
        waits = [
            e
            for e in run.by_rank(rank)
            if e.kind == "wait" and e.name == "all_reduce" and last.start <= e.start <= finish.end
        ]
        blocked = [e for e in waits if e.start < last.end]
        assert len(waits) == len(calls) and not blocked, (
            f"{case}: rank {rank} should post each all-reduce with async_op=True during backward and "
            f"wait for all of them in finish_gradient_synchronization(), so communication overlaps the "
            f"rest of backward; in step {step} it posted {len(calls)}, waited for {len(waits)}, "
            f"{len(blocked)} of the waits inside backward (no overlap)"
        )
    total = sum(e.bytes for e in calls)
    assert total == trainable, (
        f"{case}: in step {step} rank {rank} all-reduced {total} bytes; the trainable gradients are "
        f"{trainable} bytes (each parameter once, even when used twice; frozen ones not at all)"
    )
    if all_reduces is not None:
        assert len(calls) == all_reduces, (
            f"{case}: in step {step} rank {rank} made {len(calls)} all-reduce calls, expected {all_reduces}"
        )
    if buckets is not None:
        got = [e.bytes for e in calls]
        assert sorted(got) == sorted(buckets), (
            f"{case}: in step {step} rank {rank}'s all-reduces carried {got} B; expected {buckets} B: {_BUCKET_RULE}"
            + (" (forward order gives other buckets)" if len(got) == len(buckets) else "")
        )


def _that_passed(exercise_id: str, replaces: str, graders: Callable | None, note: str) -> tuple[str, str, str] | None:
    """None: the student's version of ``exercise_id``, which passed its graded test (or the grader's is not
    at hand: ``graders`` is defined only in a graded cell's hidden tests); else the grader's, for the driver
    to use instead: (``replaces``, its name, its source)."""
    if exercise_id not in GRADED_PASSED:
        print(note)
    if exercise_id in GRADED_PASSED or graders is None:
        return None
    return replaces, graders.__name__, inspect.getsource(graders)


def broadcast_that_passed(graders: Callable | None) -> tuple[str, str, str] | None:
    """None: NaiveDDP with your broadcast_parameters, if that passed its graded test; else the grader's own
    (``graders``, defined in the graded cell's hidden tests), for the driver to build NaiveDDP with instead of
    yours: ("broadcast_parameters", its name, its source)."""
    return _that_passed(
        "broadcast_parameters",
        "broadcast_parameters",
        graders,
        "(broadcast_parameters has not passed its graded test yet: the grader checks average_gradients with its own)",
    )


def bucketed_ddp_that_passed(graders: Callable | None) -> tuple[str, str, str] | None:
    """None: AccumulatingDDP on your BucketedDDP, if that passed its graded test; else the grader's own
    (``graders``, a function of the graded cell's hidden tests that makes the class), for the driver to put
    under AccumulatingDDP instead of yours: ("BucketedDDP", the function that makes it, its source)."""
    return _that_passed(
        "bucketed_ddp",
        "BucketedDDP",
        graders,
        "(BucketedDDP has not passed its graded test yet: the grader checks no_sync() on its own BucketedDDP)",
    )


def check_average_gradients(
    kind: str,
    n: int,
    batch: int,
    graders: tuple[str, str, str] | None = None,
    one_per_parameter: bool = True,
    device: str | None = None,
) -> None:
    """``average_gradients(model)`` (exercise 3), through ``NaiveDDP``: every rank trains exactly like one
    process on the whole batch (gradients summed, then divided by N); with ``one_per_parameter``, one
    all-reduce per trainable parameter per step (frozen ones not communicated).  ``graders``:
    ``broadcast_that_passed(...)``."""
    check_ddp(
        "NaiveDDP",
        "NaiveDDP",
        kind,
        n,
        batch=batch,
        all_reduces=per_parameter(kind) if one_per_parameter else None,
        graders=graders,
        device=device,
    )


def check_overlapped_ddp(kind: str, n: int, batch: int, device: str | None = None) -> None:
    """``OverlappedDDP`` (exercise 4): trains like one process on the whole batch, one all-reduce per
    trainable parameter, each posted with async_op=True from a gradient hook during backward and waited
    for only in finish_gradient_synchronization(), after backward."""
    check_ddp(
        "OverlappedDDP",
        "OverlappedDDP",
        kind,
        n,
        batch=batch,
        all_reduces=per_parameter(kind),
        overlap=True,
        device=device,
    )


def check_bucketed_ddp(kind: str, n: int, batch: int, bucket_mb: float, device: str | None = None) -> None:
    """``BucketedDDP(model, bucket_mb)`` (exercise 5): trains like one process on the whole batch, one async
    all-reduce per bucket of the bucket rule's sizes (``bucket_sizes``: reverse order of model.parameters()),
    posted during backward (overlap is graded only where there are two buckets or more: a single bucket is
    ready only as backward ends; under grading, during backward only where a trainable layer lies below a whole
    bucket: ``overlap.gate_position``)."""
    buckets = bucket_sizes(graded_model(kind, 0), bucket_mb)
    check_ddp(
        f"BucketedDDP(bucket_mb={bucket_mb:.6g})",
        "BucketedDDP",
        kind,
        n,
        batch,
        bucket_mb=bucket_mb,
        buckets=buckets,
        overlap=len(buckets) > 1,  # (one bucket is ready only as backward ends: nothing can overlap)
        device=device,
    )


def check_no_sync(
    kind: str,
    n: int,
    batch: int,
    micro_steps: int,
    bucket_mb: float = 1 / 1024,
    interrupted: bool = False,
    graders: tuple[str, str, str] | None = None,
    device: str | None = None,
    nested: bool = False,
) -> None:
    """``AccumulatingDDP.no_sync()`` (exercise 6): with ``micro_steps`` micro-batches per step, all but the
    last under no_sync(), no all-reduce inside no_sync(), the last one's buckets as BucketedDDP's, and the
    result of one process on the whole batch; ``interrupted``: after an exception raised (and caught) inside
    no_sync(), the next steps communicate again; ``nested``: a no_sync() opened and closed inside each one
    leaves the outer in force (the previous state restored, not True).  ``graders``:
    ``bucketed_ddp_that_passed(...)``."""
    buckets = bucket_sizes(graded_model(kind, 0), bucket_mb)
    check_ddp(
        "AccumulatingDDP with no_sync()",
        "AccumulatingDDP",
        kind,
        n,
        batch,
        micro_steps=micro_steps,
        bucket_mb=bucket_mb,
        buckets=buckets,
        overlap=len(buckets) > 1,  # (one bucket is ready only as backward ends: nothing can overlap)
        graders=graders,
        interrupted=interrupted,
        device=device,
        nested=nested,
    )
