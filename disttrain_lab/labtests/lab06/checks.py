"""Lab 6's checks, one per exercise, against the dense layers in one process."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ... import carried, checks, models, wirecalls
from .. import common, tp_partials
from .common import _F_G_PHASES, _MLP_PHASES, GRADED_PASSED, STAND_IN_FOR
from .ranks import (
    _build_layer,
    _build_mlp,
    _call_parallel_groups,
    _f_g_in_rank,
    _linear_in_rank,
    _mlp_in_rank,
    _mlp_standing_in,
    _train_2d_in_rank,
    batches_2d,
    chunk,
)
from .reading import (
    _assert_all_reduces,
    _assert_group_inputs_carried,
    _assert_wire_calls_of_groups,
    _communication,
    _compare_parameters,
    _describe,
    _expect_value_error,
    _expected_slices,
    _group_of,
    _phases,
    _run,
)


# --------------------------------------------------------------------------------------
# The checks, one per exercise
# --------------------------------------------------------------------------------------
def check_parallel_linear(
    n: int, d_in: int, d_out: int, batch: int = 3, bias: bool = True, tp_size: int | None = None
) -> None:
    """Exercise 1: ``ColumnParallelLinear`` and ``RowParallelLinear`` built from one full layer on n ranks
    (in groups of ``tp_size``, else all ranks) only compute; column's output and gradients are this rank's
    rows of the full layer's, row's partial sums over a group add up to the full output (the bias on group
    rank 0 only); each holds only its slices as fresh copies (no view of the full weight)."""
    tp_size = tp_size or n
    case = f"a {d_in} -> {d_out} layer{'' if bias else ' without bias'} on {n} ranks" + (
        f" (groups of {tp_size})" if tp_size != n else ""
    )
    run = _run(_linear_in_rank, n, (d_in, d_out, batch, bias, tp_size), case)
    for rank in range(n):
        calls = _communication(run, rank)
        assert not calls, (
            f"{case}: the layers only compute (the all-reduce is exercise 2's g), but rank {rank} "
            f"made: {_describe(calls, n)}"
        )
    checks.assert_traffic(run, {}, f"{case}: the layers only compute (the all-reduce is exercise 2's g)")
    full = models.MLP([d_in, d_out], seed=1, bias=bias)[0]
    x, dy = checks.sample_tensor((batch, d_in), seed=2), checks.sample_tensor((batch, d_out), seed=3)
    y = full(x)
    y.backward(dy)
    for rank, got in enumerate(run.results):
        position = rank % tp_size
        rows, cols = chunk(d_out, tp_size, position), chunk(d_in, tp_size, position)
        checks.assert_close(
            got["y_column"],
            y.detach()[:, rows],
            what=(
                f"{case}: rank {rank}'s ColumnParallelLinear output, against output features "
                f"{rows.start}..{rows.stop - 1} of the full layer's"
            ),
        )
        expected = {"weight": (full.weight.detach()[rows], full.weight.grad[rows])}
        if bias:
            expected["bias"] = (full.bias.detach()[rows], full.bias.grad[rows])
        _compare_parameters(got["column"], expected, what=f"{case}: rank {rank}'s ColumnParallelLinear")
        assert got["column_bytes"] == 4 * sum(v.numel() for v, _ in expected.values()), (
            f"{case}: rank {rank}'s ColumnParallelLinear holds {got['column_bytes']} B of parameter storage, its "
            f"slices are {4 * sum(v.numel() for v, _ in expected.values())} B: keep a copy of the slice "
            f"(.clone()), not a view into the full weight"
        )
    for start in range(0, n, tp_size):
        group = range(start, start + tp_size)
        total = sum(run.results[r]["y_row"] for r in group)
        checks.assert_close(
            total,
            y.detach(),
            what=(
                f"{case}: the RowParallelLinear partial sums of ranks {tuple(group)} added up (what the all-reduce of "
                f"exercise 2 will do), against the full layer's output (the bias must be added exactly once: by "
                f"group rank 0)"
            ),
            rtol=1e-5,
            atol=1e-5,
        )
    for rank, got in enumerate(run.results):
        position = rank % tp_size
        cols = chunk(d_in, tp_size, position)
        expected = {"weight": (full.weight.detach()[:, cols], full.weight.grad[:, cols])}
        if bias and position == 0:
            expected["bias"] = (full.bias.detach(), full.bias.grad)
        _compare_parameters(got["row"], expected, what=f"{case}: rank {rank}'s RowParallelLinear")
        assert got["row_bytes"] == 4 * sum(v.numel() for v, _ in expected.values()), (
            f"{case}: rank {rank}'s RowParallelLinear holds {got['row_bytes']} B of parameter storage, its "
            f"slices are {4 * sum(v.numel() for v, _ in expected.values())} B: keep a copy, not a view"
        )


def check_linear_not_divisible(kind: str, n: int, d_in: int, d_out: int) -> None:
    """Exercise 1: a layer whose split dimension does not divide by the n ranks (``kind`` "column": its
    out_features, "row": its in_features) raises a ValueError saying "divisible"."""
    name = {"column": "ColumnParallelLinear", "row": "RowParallelLinear"}[kind]
    _expect_value_error(_build_layer, n, (kind, d_in, d_out), case=f"{name}(nn.Linear({d_in}, {d_out})) on {n} ranks")


def check_f_and_g(n: int, batch: int, d: int, tp_size: int | None = None) -> None:
    """Exercise 2: on n ranks (in groups of ``tp_size``, else all ranks), f is the identity forward and
    all-reduces (SUM over its group) the gradient backward; g all-reduces a copy forward (its input left
    unchanged) and is the identity backward: one all-reduce of the tensor each, in its own phase, over
    the group."""
    tp_size = tp_size or n
    case = f"f and g on {n} ranks" + (f" in groups of {tp_size}" if tp_size != n else "") + f", ({batch}, {d}) tensors"
    run = _run(_f_g_in_rank, n, (batch, d, tp_size), case)
    nbytes = batch * d * 4
    if wirecalls.observed(run):  # (grading: the calls from the grader's capture; the values below tell f from g)
        _assert_wire_calls_of_groups(
            run,
            tp_size,
            [("all_reduce", nbytes)] * 2,
            f"{case}: f's backward all-reduces the gradient over its group and g's forward its input; their "
            "other passes are the identity",
            case,
        )
        _assert_group_inputs_carried(
            run,
            tp_size,
            [
                lambda rank: [checks.sample_tensor((batch, d), seed=20 + rank)],
                lambda rank: [checks.sample_tensor((batch, d), seed=10 + rank)],
            ],
            ["f's backward, of each rank's gradient", "g's forward, of each rank's input"],
            case,
        )
    for rank, got in enumerate(run.results):
        group = _group_of(rank, tp_size)
        if not wirecalls.observed(run):  # (the student's own kernel: the ranks' trace, phase by phase)
            calls = _phases(run, rank, _F_G_PHASES, case)
            _assert_all_reduces(
                run,
                calls["f forward"],
                rank,
                0,
                nbytes,
                group,
                f"{case}: f's forward is the identity (did you swap f and g?)",
            )
            _assert_all_reduces(
                run,
                calls["f backward"],
                rank,
                1,
                nbytes,
                group,
                f"{case}: f's backward all-reduces the gradient over its group",
            )
            _assert_all_reduces(
                run, calls["g forward"], rank, 1, nbytes, group, f"{case}: g's forward all-reduces over its group"
            )
            _assert_all_reduces(
                run,
                calls["g backward"],
                rank,
                0,
                nbytes,
                group,
                f"{case}: g's backward is the identity (did you swap f and g?)",
            )
        checks.assert_close(
            got["f"],
            checks.sample_tensor((batch, d), seed=1),
            what=f"{case}: rank {rank}'s f(x), against x (f's forward is the identity: did you swap f and g?)",
        )
        checks.assert_close(
            got["f grad"],
            sum(checks.sample_tensor((batch, d), seed=20 + r) for r in group),
            what=f"{case}: rank {rank}'s gradient through f, against the SUM of the gradients of ranks {group}",
        )
        checks.assert_close(
            got["g"],
            sum(checks.sample_tensor((batch, d), seed=10 + r) for r in group),
            what=f"{case}: rank {rank}'s g(x), against the SUM of x over ranks {group} (did you swap f and g?)",
        )
        checks.assert_close(
            got["g grad"],
            checks.sample_tensor((batch, d), seed=30 + rank),
            what=f"{case}: rank {rank}'s gradient through g, against its own upstream gradient (identity)",
        )
        assert not got["g input changed"], (
            f"{case}: g changed its input in place on rank {rank}: all-reduce a copy (x.clone()) and return that"
        )


def _standing_in(own: bool = False) -> tuple[str, ...]:
    """The notebook's classes the grader's stand-ins replace in exercise 3's runs: those of exercises 1 and 2
    that have not passed their graded tests (none with ``own``); says so once per kernel."""
    if own:
        return ()
    missing = [exercise for exercise in STAND_IN_FOR if exercise not in GRADED_PASSED]
    replace = tuple(name for exercise in missing for name in STAND_IN_FOR[exercise])
    common.say_standing_in(
        missing,
        f"TensorParallelMLP is graded with the grader's stand-in for {', '.join(replace)}, so that a mistake there "
        "does not cost this exercise too",
    )
    return replace


def check_tp_mlp(n: int, sizes: list, batch: int = 4, tp_size: int | None = None, own: bool = False) -> None:
    """Exercise 3: ``TensorParallelMLP`` of the dense MLP ``sizes`` on n ranks (in groups of ``tp_size``,
    else all ranks) gives the dense output and input gradient on every rank, with one all-reduce of the
    output forward (g, none between the two layers) and one of the input gradient backward (f), over its
    group; each rank's ``column``/``row`` parameters and gradients are its slices of the dense ones, and
    it holds nothing more.

    One mistake costs one exercise: where exercise 1 or 2 has not passed its graded test (``GRADED_PASSED``),
    the grader's stand-ins (``ranks.STAND_INS``) replace those classes, unless ``own``; what they do is
    then not graded here (the slices and bytes the layers hold; all-reduce rather than the stand-in's
    all-gather), only what this exercise adds: the output, the input gradient, one communication forward
    after the two layers and one backward."""
    tp_size = tp_size or n
    replace = _standing_in(own)
    layers = "ColumnParallelLinear" not in replace
    op = "all_reduce" if "CopyToTensorParallel" not in replace else "all_gather"
    case = (
        f"TensorParallelMLP({' -> '.join(map(str, sizes))}) on {n} ranks"
        + (f" in groups of {tp_size}" if tp_size != n else "")
        + f", batch {batch}"
        + (f", with the grader's {', '.join(replace)}" if replace else "")
    )
    if replace:
        run = _run(_mlp_standing_in, n, (sizes, batch, tp_size, list(replace)), case)
    else:
        run = _run(_mlp_in_rank, n, (sizes, batch, tp_size), case)
    out_bytes, in_bytes = (batch * sizes[-1] * 4, batch * sizes[0] * 4) if op == "all_reduce" else (None, None)
    dense = models.MLP(sizes, seed=3)
    x = checks.sample_tensor((batch, sizes[0]), seed=4).requires_grad_()
    y = dense(x)
    y.backward(checks.sample_tensor((batch, sizes[-1]), seed=5))
    if wirecalls.observed(run):  # (grading: the calls from the grader's capture, in the order each group made them)
        _assert_wire_calls_of_groups(
            run,
            tp_size,
            [(op, out_bytes), (op, in_bytes)],
            f"{case}: one {op.replace('_', '-')} forward, of the output (g), none between the two layers, "
            "and one backward, of the input gradient (f)",
            case,
        )
        dy = checks.sample_tensor((batch, sizes[-1]), seed=5)
        forward, backward = tp_partials.mlp_partials(dense, x, dy, tp_size)
        _assert_group_inputs_carried(
            run,
            tp_size,
            [lambda rank: forward[rank % tp_size], lambda rank: backward[rank % tp_size]],
            [
                "the forward's all-reduce (g), of each rank's partial output (its RowParallelLinear's)",
                "the backward's all-reduce (f), of each rank's partial input gradient (its ColumnParallelLinear's)",
            ],
            case,
        )
    for rank in range(n):
        group = _group_of(rank, tp_size)
        if not wirecalls.observed(run):  # (the student's own kernel: the ranks' trace, phase by phase)
            calls = _phases(run, rank, _MLP_PHASES, case)
            _assert_all_reduces(
                run,
                calls["forward"],
                rank,
                1,
                out_bytes,
                group,
                f"{case}, forward: one all-reduce, of the output (g), none between the two layers",
                op,
            )
            _assert_all_reduces(
                run,
                calls["backward"],
                rank,
                1,
                in_bytes,
                group,
                f"{case}, backward: one all-reduce, of the input gradient (f)",
                op,
            )
    dense_bytes = sum(p.numel() * 4 for p in dense.parameters())
    for rank, got in enumerate(run.results):
        position = rank % tp_size
        checks.assert_close(
            got["y"], y.detach(), what=f"{case}: rank {rank}'s output, against the dense MLP's", rtol=1e-5, atol=1e-5
        )
        checks.assert_close(
            got["x grad"],
            x.grad,
            what=f"{case}: rank {rank}'s input gradient, against the dense MLP's",
            rtol=1e-4,
            atol=1e-5,
        )
        if not layers:  # (the stand-in layers keep whole weights: the slices are exercise 1's)
            continue
        expected = _expected_slices(dense, tp_size, position)
        _compare_parameters(got["params"], expected, what=f"{case}: rank {rank}'s slices")
        should_hold = 4 * sum(v.numel() for v, _ in expected.values())
        assert got["bytes"] == should_hold, (
            f"{case}: rank {rank} holds {got['bytes']} B of parameters; its slices are {should_hold} B "
            f"(about 1/{tp_size} of the dense {dense_bytes} B): keep only the slices"
        )


def check_mlp_not_divisible(n: int, sizes: list) -> None:
    """Exercise 3: a TensorParallelMLP whose hidden width does not divide by the n ranks raises the
    layers' ValueError saying "divisible" (graded once exercise 1, whose layers raise it, has passed)."""
    if "parallel_linear" not in GRADED_PASSED:
        print(
            "(the ValueError comes from exercise 1's layers, which have not passed their graded test: not graded here)"
        )
        return
    _expect_value_error(
        _build_mlp, n, (sizes,), case=f"TensorParallelMLP(MLP({sizes})) on {n} ranks (hidden {sizes[1]})"
    )


def train_2d_driver(graders: Callable | None = None) -> Callable:
    """The driver ``check_2d`` runs train_2d with, decided once per graded cell: one that builds the
    student's TensorParallelMLP where it and the exercises it builds on passed their graded tests
    (``GRADED_PASSED``) or, in the student's notebook (no ``graders``), where it passes exercise 3's check on
    its own pieces (groups of 2 on 4 ranks); else ``graders`` (the grader's own, in the cell's hidden tests),
    so that train_2d is graded on its own; without ``graders`` that failure is raised, saying to fix
    exercise 3 first."""
    if {"parallel_linear", "f_and_g", "tp_mlp"} <= GRADED_PASSED:
        return _train_2d_in_rank
    try:
        if graders is not None:
            raise AssertionError("exercise 3, or one it builds on, has not passed its graded test")
        check_tp_mlp(4, [8, 8, 3], batch=3, tp_size=2, own=True)
        return _train_2d_in_rank
    except Exception as e:  # an AssertionError, or the student's code raised in a rank
        if graders is None:
            raise AssertionError(
                f"train_2d builds on your TensorParallelMLP, which does not pass exercise 3's "
                f"check yet; fix exercise 3 first (the grader grades train_2d with its own)."
                f"\n{e}"
            ) from None
        return graders


def check_2d(driver: Callable, n: int, tp_size: int, sizes: tuple = (6, 16, 4), batch: int = 8, steps: int = 3) -> None:
    """Exercise 4: ``train_2d`` on n ranks with TP groups of ``tp_size`` (and DP groups across them),
    run by ``driver`` (``train_2d_driver``): every rank's communication stays inside its TP group
    (at least one all-reduce a step) or its DP group (each parameter's gradient once a step, the
    parameters held as copies); each rank's trained slices equal its slices of one process training the
    dense MLP on the whole batches."""
    dp_size = n // tp_size
    case = (
        f"train_2d on {n} ranks, tp_size={tp_size} ({dp_size} data-parallel group(s) of {tp_size} "
        f"tensor-parallel ranks), MLP {' -> '.join(map(str, sizes))}, batch {batch}, {steps} steps"
    )
    run = _run(driver, n, (list(sizes), batch, steps, tp_size), case)
    world = tuple(range(n))
    wire = wirecalls.observed(run)  # (grading: the grader's capture; the student's own kernel: the ranks' trace)
    read: dict[tuple, tuple] = {}  # each group's calls on the wire, read once

    def group_calls(group: tuple) -> tuple:
        if group not in read:
            read[group] = wirecalls.group_calls(run, group, case)
        return read[group]

    local = _local_slice_gradients(sizes, batch, steps, tp_size, dp_size) if wire and dp_size > 1 else None
    for rank in range(n):
        tp, dp = _group_of(rank, tp_size), tuple(range(rank % tp_size, n, tp_size))
        inside = f"its TP group {tp} (tensor-parallel all-reduces) or its DP group {dp} (gradient averaging)"
        if wire:
            wirecalls.assert_stays_in(run, rank, {*tp, *dp}, inside, case)
        else:
            calls = _communication(run, rank)
            stray = [e for e in calls if (e.group or world) not in (tp, dp)]
            assert not stray, (
                f"{case}: rank {rank}'s communication must stay inside {inside}; it also made: "
                f"{_describe(stray[:3], n)}"
            )
        if tp_size > 1:
            if wire:
                sent_in, found = group_calls(tp)
                in_tp = min(sent_in[rank], sum(kind == "all_reduce" for kind, _ in found))
            else:
                in_tp = sum(1 for e in calls if (e.group or world) == tp and e.op == "all_reduce")
            assert in_tp >= steps, (
                f"{case}: rank {rank} made {in_tp} all-reduces in its TP group {tp}; "
                f"the TensorParallelMLP needs at least one per step (g)"
            )
        if dp_size > 1:
            if wire:  # (each all-reduce's tensor, from the bytes its ring put on the wire)
                in_dp = sum(size for kind, size in group_calls(dp)[1] if kind == "all_reduce")
            else:
                in_dp = sum(e.bytes for e in calls if (e.group or world) == dp and e.op == "all_reduce")
            held, stored = run.results[rank][1], run.results[rank][2]
            assert stored == held, (
                f"{case}: rank {rank}'s parameters are {held} B but hold {stored} B of storage: "
                f"exercise 1's layers keep a view into the full weight; keep a copy (.clone())"
            )
            assert in_dp == steps * held, (
                f"{case}: rank {rank} all-reduced {in_dp} B in its DP group {dp} over {steps} steps; its gradients "
                f"are {held} B a step (each of its parameters' gradients once per step)"
            )
            if wire:
                of = {r: local[r % tp_size][r // tp_size] for r in dp}
                carried.assert_gradients_all_reduced(run, rank, dp, of, case, 1e-4)
    if wire and tp_size > 1:
        _tp_outputs_on_the_wire(run, _tp_outputs_2d(sizes, batch, steps, tp_size, dp_size), tp_size, steps, case)
    dense = models.MLP(list(sizes), seed=11)
    reference = models.train_single_process(dense, batches_2d(sizes, batch, steps), lr=0.1)
    for rank, (params, _, _) in enumerate(run.results):
        expected = _expected_slices(reference, tp_size, rank % tp_size, grads=False)
        assert set(params) == set(expected), (
            f"{case}: rank {rank}: expected the parameters {sorted(expected)}, got {sorted(params)}"
        )
        for name, (value, _) in expected.items():
            checks.assert_close(
                params[name][0],
                value,
                what=(
                    f"{case}: rank {rank}'s {name} after training, against its slice of one process training the "
                    f"dense MLP on the whole batches (gradients averaged over the DP group: SUM / {dp_size})"
                ),
                rtol=1e-4,
                atol=1e-5,
            )


def _local_slice_gradients(sizes, batch: int, steps: int, tp_size: int, dp_size: int) -> list[list[list]]:
    """[TP position][DP rank][step]: the gradient of that rank's loss on its DP shard of the step's batch with
    respect to its TP slices (all of them, flat), in one process, along the dense training the ranks must match
    (SGD, lr 0.1, on the whole batches: the DP ranks' mean)."""
    dense = models.MLP(list(sizes), seed=11)
    optimizer = torch.optim.SGD(dense.parameters(), lr=0.1)
    found = [[[] for _ in range(dp_size)] for _ in range(tp_size)]
    for x, y in batches_2d(sizes, batch, steps):
        for d, (xs, ys) in enumerate(zip(x.tensor_split(dp_size), y.tensor_split(dp_size))):
            dense.zero_grad()
            F.mse_loss(dense(xs), ys).backward()
            for position in range(tp_size):
                slices = _expected_slices(dense, tp_size, position)
                found[position][d].append(torch.cat([grad.reshape(-1) for _, grad in slices.values()]).numpy().copy())
        optimizer.zero_grad()
        F.mse_loss(dense(x), y).backward()
        optimizer.step()
    return found


def _tp_outputs_2d(sizes, batch: int, steps: int, tp_size: int, dp_size: int) -> list[list[list]]:
    """[DP rank][step]: each TP position's partial output of the MLP on that DP rank's shard of the step's batch (its
    hidden slice through its rows of the second layer: what g all-reduces; ``tp_partials.mlp_partials``), in one
    process, along the dense training the ranks must match (SGD, lr 0.1, on the whole batches)."""
    dense = models.MLP(list(sizes), seed=11)
    optimizer = torch.optim.SGD(dense.parameters(), lr=0.1)
    found: list[list[list]] = [[] for _ in range(dp_size)]
    for x, y in batches_2d(sizes, batch, steps):
        for d, xs in enumerate(x.tensor_split(dp_size)):
            with torch.no_grad():
                found[d].append(tp_partials.mlp_partials(dense, xs, None, tp_size)[0])
        optimizer.zero_grad()
        F.mse_loss(dense(x), y).backward()
        optimizer.step()
    return found


def _tp_outputs_on_the_wire(run, outputs: list, tp_size: int, steps: int, case: str) -> None:
    """Under grading: at each step, one of each TP group's all-reduces of that step (the group's calls, in the order
    it made them, the same number each step) carried g's sum: every message a piece of a sum, over ranks that
    include its sender, of the ranks' partial outputs on their DP shard (``_tp_outputs_2d``;
    ``carried.assert_reduced_carried``).  An MLP trained some other way (one process, the launcher's store) with
    all-reduces of zeros fails."""
    for start in range(0, run.world_size, tp_size):
        group = tuple(range(start, start + tp_size))
        owed = outputs[start // tp_size]
        calls = [payloads for kind, payloads in wirecalls.call_payloads(run, group, case) if kind == "all_reduce"]
        per_step = len(calls) // steps
        for step, partials in enumerate(owed):
            mine = {r: partials[r - start] for r in group}
            largest = len(group) * max(float(t.abs().max()) for ts in mine.values() for t in ts)
            for payloads in calls[step * per_step : (step + 1) * per_step]:
                try:  # (within 1e-3, or 1e-4 of the largest sum: the ranks' training drifts by rounding, lab 8's)
                    carried.assert_reduced_carried(payloads, mine, case, "g", tolerance=(1e-3, 1e-4 * largest))
                except AssertionError:
                    continue
                break
            else:
                raise AssertionError(
                    f"{case}: at step {step + 1}, ranks {group} (a TP group) should all-reduce each rank's partial "
                    "output of the MLP on its DP shard (g: its hidden slice through its rows of the second layer, the "
                    f"grader's along the dense training in one process); none of their {per_step} all-reduce(s) of "
                    "that step "
                    "carried it (each message a piece of a sum, over ranks that include its sender, of the ranks' "
                    "partials). What a rank all-reduces must be the data itself, not zeros while the sums travel some "
                    "other way"
                )


def check_groups_not_divisible(n: int, tp_size: int) -> None:
    """Exercise 4: ``parallel_groups(tp_size)`` where the world size n does not divide by ``tp_size``
    raises a ValueError saying "divisible"."""
    _expect_value_error(_call_parallel_groups, n, (tp_size,), case=f"parallel_groups({tp_size}) on {n} ranks")
