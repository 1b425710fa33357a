"""Lab 7's exercises 5-6: ``topk_hook`` and (stretch) ``powersgd_hook`` on DDP, against training with
torch's own all-reduce and ``powerSGD_hook``."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ... import carried, checks, models, wirecalls
from ...launcher import launch
from .. import common
from .common import _HOOK_SIZES, GRADED_PASSED, _bytes_sent, _hook_calls, _hook_calls_sent, _run
from .ranks import _torch_powersgd_sent, _train_dense, _train_replayed, _train_topk


# --------------------------------------------------------------------------------------
# Exercise 5: topk_hook
# --------------------------------------------------------------------------------------
def _hook_data(n, sizes):
    """Each rank's share (x, y) of a fixed regression set."""
    data = models.regression_data(256, sizes[0], sizes[-1], seed=1)
    return [(data.x[rank::n], data.y[rank::n]) for rank in range(n)]


def hook_driver(graders: Callable | None = None) -> tuple[Callable, tuple]:
    """The driver the topk_hook checks run and its extra arguments, decided once per graded cell: topk_hook
    on the notebook's topk_compress, ErrorFeedback and sparse_all_reduce where those passed their graded
    tests, else on ``graders`` (the grader's own copies of those that did not, in the cell's hidden tests)."""
    replace = [
        name
        for name, exercise_name in (
            ("topk_compress", "topk"),
            ("ErrorFeedback", "error_feedback"),
            ("sparse_all_reduce", "sparse_all_reduce"),
        )
        if exercise_name not in GRADED_PASSED
    ]
    if replace:
        print(f"({', '.join(replace)} has not passed its graded test yet: the grader checks topk_hook on its own copy)")
        if graders is not None:
            return graders, (tuple(replace),)
    return _train_topk, ()


def _check_future(run, case):
    for rank, got in enumerate(run.results):
        for kind, value, buffer, *_ in got["seen"]:
            assert kind == "Future", (
                f"{case}: topk_hook must return a future (a torch.futures.Future, or the "
                f"torch._C.Future of work.get_future().then(...)); rank {rank}'s returned a {kind}"
            )
            assert value == buffer, (
                f"{case}: the future's value must be a tensor of the bucket's shape and dtype "
                f"{buffer}, rank {rank}'s is {value}"
            )


def _check_average(run, case):
    """At density 1 (everything sent) each call's future must hold the average of the ranks' bucket gradients."""
    n = run.world_size
    for call in range(len(run.results[0]["seen"])):
        gradients = [run.results[rank]["seen"][call][3] for rank in range(n)]
        average = sum(gradients) / n
        for rank in range(n):
            value = run.results[rank]["seen"][call][4]
            if (
                n > 1
                and torch.allclose(value, average * n, rtol=1e-5, atol=1e-6)
                and not torch.allclose(value, average)
            ):
                raise AssertionError(
                    f"{case}: rank {rank}'s future at call {call} holds the sum over the {n} ranks, not "
                    f"the average: divide by the world size (DDP copies the future's value into .grad as it is)"
                )
            checks.assert_close(
                value,
                average,
                what=f"{case}: rank {rank}'s future at call {call}: at density 1 every "
                f"entry is sent, so it must be the average over ranks of bucket.buffer()",
                rtol=1e-5,
                atol=1e-6,
            )


def _check_compressed_bytes(run, case, density, steps):
    """Only the compressed pieces travel: per rank and step at most k values + k int64 indices.  Under grading,
    from the grader's capture: what each rank sent in the hooks' all-gathers, at most N - 1 times its piece (an
    all-gather relays the others' pieces, of the same size), and any other collective of the hooks' below one
    dense gradient in all (DDP's own bucket rebuild broadcasts a few integers); in the student's own kernel,
    from the ranks' trace (its own piece of each collective)."""
    numel = sum(p.numel() for p in run.results[0]["params"])
    k, n = math.ceil(density * numel), run.world_size
    for rank in range(n):
        seen = _hook_calls_sent(run, rank, case)
        if seen is None:
            per_step = _bytes_sent(run, rank) / steps
            assert per_step <= k * 12, (
                f"{case}: rank {rank} sent {per_step:.0f} B per step; the compressed gradient is "
                f"at most {k * 12} B (k = {k} values + indices), the dense one {4 * numel} B"
            )
            continue
        gathered, other = seen
        assert gathered / steps <= (n - 1) * k * 12, (
            f"{case}: the grader's capture of the wire saw rank {rank} send {gathered / steps:.0f} B per step in "
            f"the hooks' all-gathers; its compressed gradient is at most {k * 12} B (k = {k} values + indices), "
            f"which each of the other {n - 1} ranks needs once: at most {(n - 1) * k * 12} B. The dense one is "
            f"{4 * numel} B"
        )
        assert other < 4 * numel, (
            f"{case}: the grader's capture of the wire saw rank {rank} send {other} B in collectives other than "
            f"all-gathers once training began (DDP's own bucket rebuild broadcasts a few integers; the dense "
            f"gradient is {4 * numel} B): topk_hook sends its pieces by all-gather alone"
        )


def _local_gradients(n: int, steps: int, sizes=_HOOK_SIZES, lr: float = 0.1) -> list[list[torch.Tensor]]:
    """Each step's gradient of each rank's loss on its share of the data (``_hook_data``), all parameters flat,
    in one process: the same MLP and SGD as the ranks, updated by the ranks' average (DDP's training, which
    the hook at density 1 must match)."""
    model, data = models.MLP(list(sizes), seed=0), _hook_data(n, sizes)
    found = []
    for _ in range(steps):
        grads = []
        for x, y in data:
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        found.append(grads)
        with torch.no_grad():
            average, at = sum(grads) / n, 0
            for p in model.parameters():
                p -= lr * average[at : at + p.numel()].view_as(p)
                at += p.numel()
    return found


def _check_gradients_carried(run, case: str, steps: int) -> None:
    """Under grading, at density 1 (every entry sent): each rank's local gradient at each step, computed here in
    one process (``_local_gradients``), must be among the 4-byte words it sent in the hooks' all-gathers (float32,
    within the rounding of the ranks' own averaging: a relative 1e-4, or 1e-6 of the step's largest entry, for
    entries near zero: measured 4.3e-9 of it beyond the relative bound, 7 Dec), every nonzero entry.  A hook that passes
    the gradients some other way (the launcher's store) with something else of the right size on the wire fails."""
    calls = carried.collective_payloads(run, case)
    if calls is None:  # (the student's own kernel: no capture)
        return
    hooks = {slot for slot, _ in _hook_calls(calls)}
    for rank, _ in enumerate(run.results):
        sent = carried.words_sent(
            [
                payload
                for src, _, slot, payload in carried.sends(run, case) or []
                if src == rank and slot in hooks and carried.kind(slot) == "all_gather"
            ]
        )
        for step, grads in enumerate(_local_gradients(run.world_size, steps)):
            want = grads[rank].numpy()
            want = want[want != 0]
            scale = float(np.abs(want).max()) if want.size else 0.0
            missing = want.size - carried.words_found(sent, want, rtol=1e-4, atol=1e-6 * scale)
            assert missing == 0, (
                f"{case}: at density 1 the hooks' all-gathers should carry every entry of each rank's gradient; "
                f"of rank {rank}'s {want.size} nonzero entries at step {step + 1} (the grader's own training in "
                f"one process), the grader's capture of the wire did not find {missing} in what rank {rank} sent. "
                "The gradients must travel in the hook's all-gather itself"
            )


def _piece(payload: bytes, numel: int, case: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's top-k piece of one step as it crossed: k int64 indices and k fp32 values (12 bytes an entry), the
    indices first or the values first; the indices must lie in the bucket, each once."""
    k, left = divmod(len(payload), 12)
    if not left and k:
        for at_indices, at_values in ((slice(0, 8 * k), slice(8 * k, None)), (slice(4 * k, None), slice(0, 4 * k))):
            indices = torch.frombuffer(bytearray(payload[at_indices]), dtype=torch.int64)
            if bool(((indices >= 0) & (indices < numel)).all()) and indices.unique().numel() == k:
                return indices, torch.frombuffer(bytearray(payload[at_values]), dtype=torch.float32)
    raise AssertionError(
        f"{case}: at step {step + 1} rank {rank} sent {len(payload)} B in the hook's all-gathers, which the grader "
        f"cannot read as its top-k piece: k int64 indices (each in 0..{numel - 1}, each once) and k fp32 values, "
        "12 bytes an entry, the indices first or the values first (one all-gather of both, or one of each)"
    )


def _wire_averages(run, case: str, steps: int) -> list[torch.Tensor] | None:
    """Each step's average gradient as the hooks' all-gathers carried it, read from the grader's capture (None in
    the student's own kernel): every rank's piece (its own part of each of the step's all-gathers, joined)
    scattered into the bucket and summed, divided by the number of ranks.  One bucket (the graded model's 5,508
    parameters are far below DDP's 25 MiB)."""
    calls = carried.collective_payloads(run, case)
    if calls is None:
        return None
    gathers = [slot for slot, _ in _hook_calls(calls) if carried.kind(slot) == "all_gather"]
    per_step, left = divmod(len(gathers), steps)
    assert per_step and not left, (
        f"{case}: the grader's capture of the wire shows {len(gathers)} all-gathers in the hooks over {steps} steps; "
        "topk_hook sends each step's piece in the same all-gathers every step (one, or one of indices and one of "
        "values)"
    )
    numel, n = sum(p.numel() for p in run.results[0]["params"]), run.world_size
    sent: dict[tuple[int, int], bytes] = {}
    for src, _, slot, payload in carried.sends(run, case) or []:
        sent[slot, src] = sent.get((slot, src), b"") + payload  # (gloo sends a piece in chunks)
    # gloo's ring all-gather: a rank sends its own piece first, then relays the others' (N - 1 pieces in all)
    own = {key: payload[: len(payload) // (n - 1)] for key, payload in sent.items()}
    averages = []
    for step in range(steps):
        total = torch.zeros(numel, dtype=torch.float64)
        for rank in range(n):
            piece = b"".join(own.get((slot, rank), b"") for slot in gathers[step * per_step : (step + 1) * per_step])
            indices, values = _piece(piece, numel, case, rank, step)
            total.index_add_(0, indices, values.double())
        averages.append((total / n).float())
    return averages


def _final_loss(run, case: str, steps: int) -> float:
    """Rank 0's final loss: under grading, the grader's own, from replaying the training with the averages the
    wire carried (``_wire_averages``, ``ranks._train_replayed``); in the student's own kernel, the rank's."""
    averages = _wire_averages(run, case, steps)
    if averages is None:
        return run.results[0]["losses"][-1]
    return launch(_train_replayed, 2, averages, timeout=120)[0][-1]


def check_hook_exact(driver: tuple[Callable, tuple], n: int, steps: int = 3) -> None:
    """Exercise 5: torch DDP with ``topk_hook`` at density 1 on n ranks (run by ``driver``, ``hook_driver``)
    gets a future of the bucket's shape and dtype holding the average of the ranks' gradients, trains
    exactly like DDP's own all-reduce, and sends only its compressed pieces."""
    hook, extra = driver
    case = f"torch DDP with topk_hook at density 1.0 on {n} ranks"
    mine = _run(hook, n, [(x, y, 1.0, True, steps, *extra) for x, y in _hook_data(n, _HOOK_SIZES)], case, content=True)
    _check_future(mine, case)
    _check_average(mine, case)
    reference = launch(_train_dense, n, steps, timeout=60)
    for rank in range(n):
        for i, (p, q) in enumerate(zip(mine.results[rank]["params"], reference[rank]["params"])):
            checks.assert_close(
                p,
                q,
                what=f"{case}: rank {rank}'s parameter {i} after {steps} steps, against default_hooks.allreduce_hook",
                rtol=1e-5,
                atol=1e-6,
            )
    _check_compressed_bytes(mine, case, 1.0, steps)
    _check_gradients_carried(mine, case, steps)


def check_training(
    driver: tuple[Callable, tuple], density: float = 0.01, steps: int = 300, tolerance: float = 0.25
) -> tuple[float, float, float]:
    """Exercise 5: on 2 ranks, 1 % top-k with error feedback (``state.feedback[bucket.index()]``, kept from
    step to step) reaches dense training's final loss within 25 %, and without it
    (``TopKState(error_feedback=False)``) the loss is clearly worse; each sends only its compressed pieces.
    Under grading both final losses are the grader's: it replays each run's training with the averages the
    hooks' all-gathers carried (``_final_loss``); the ranks' own losses are for the student's picture."""
    hook, extra = driver
    case = f"2 ranks, {steps} steps of SGD, top-k at {density:.0%}"
    dense = launch(_train_dense, 2, steps, timeout=120)[0]["losses"][-1]
    data = _hook_data(2, _HOOK_SIZES)
    with_ef = _run(hook, 2, [(x, y, density, True, steps, *extra) for x, y in data], case, content=True)
    without = _run(hook, 2, [(x, y, density, False, steps, *extra) for x, y in data], case, content=True)
    _check_future(with_ef, case)
    _check_compressed_bytes(with_ef, case, density, steps)
    ef_loss, plain_loss = _final_loss(with_ef, case, steps), _final_loss(without, case, steps)
    assert ef_loss <= dense * (1 + tolerance), (
        f"{case}: with error feedback the final loss is {ef_loss:.4f}, more than "
        f"{tolerance:.0%} above dense training's {dense:.4f}: with "
        f"state.error_feedback, topk_hook must compress through the bucket's "
        f"ErrorFeedback, state.feedback[bucket.index()], kept from step to step"
    )
    assert plain_loss >= 1.5 * ef_loss, (
        f"{case}: without error feedback (TopKState(error_feedback=False)) the final "
        f"loss is {plain_loss:.4f}, not clearly worse than with it ({ef_loss:.4f}): "
        f"does topk_hook skip the ErrorFeedback when state.error_feedback is False?"
    )
    return dense, ef_loss, plain_loss


# --------------------------------------------------------------------------------------
# Exercise 6 (stretch): powersgd_hook
# --------------------------------------------------------------------------------------
def check_powersgd(n: int, rank: int, sizes: tuple = (9, 17, 11, 5), steps: int = 6, factor: float = 1.25) -> None:
    """Exercise 6: torch DDP (one bucket) with ``powersgd_hook`` at matrix rank ``rank`` on n ranks returns a
    Future of the bucket's shape and dtype, the same average on every rank, keeps error feedback across steps
    (``state.error_dict[bucket.index()]`` = gradient + old error - the average), puts torch's
    ``powerSGD_hook``'s bytes on the wire, and its average's median relative error is at most ``factor`` ×
    torch's + 0.02.  Its run and torch's are the notebook's own (``powersgd_helpers``, beside the self-check).
    Under grading, what each all-reduce carried is held to what torch's hook all-reduces there, run by the grader
    from the exercise's first Qs (``_check_powersgd_carried``): the ranks' own averages and errors, which the
    checks above read, are theirs to report; the wire's content is not."""
    lab_steps, torch_steps, relative_errors = (
        common.given(name) for name in ("_lab_powersgd_steps", "_torch_powersgd_steps", "_relative_errors")
    )
    case = f"torch DDP (one bucket) with powersgd_hook at rank {rank} on {n} ranks, MLP {list(sizes)}"
    mine = _run(lab_steps, n, (rank, steps, sizes), case, content=True)
    reference = launch(torch_steps, n, rank, steps, sizes, trace=True, timeout=60)
    for step in range(steps):
        kind, gradient, _, out, _ = mine.results[0][step]
        assert kind == "Future", (
            f"{case}: powersgd_hook must return a torch.futures.Future, step {step}'s returned a {kind}"
        )
        assert (tuple(out.shape), out.dtype) == (tuple(gradient.shape), gradient.dtype), (
            f"{case}: the future's value must have the bucket's shape and dtype {tuple(gradient.shape)}, "
            f"{gradient.dtype}; step {step}'s has {tuple(out.shape)}, {out.dtype}"
        )
        for r in range(1, n):
            checks.assert_close(
                mine.results[r][step][3],
                out,
                what=f"{case}: step {step}, rank {r}'s average against rank 0's "
                f"(every rank must return the same average)",
            )
        if step < 2:
            continue
        for r in range(n):
            _, gradient, before, out, after = mine.results[r][step]
            assert after is not None, (
                f"{case}: after step {step} rank {r}'s state.error_dict[bucket.index()] is not set: "
                f"error feedback keeps (gradient + old error) - average"
            )
            assert step == 2 or before is not None, (
                f"{case}: at step {step} rank {r} has no error from the step before: "
                f"error feedback must carry state.error_dict across steps"
            )
            checks.assert_close(
                after,
                gradient + (0 if before is None else before) - out,
                what=f"{case}: step {step}, rank {r}'s error feedback: state.error_dict[bucket.index()] must be "
                f"(gradient + old error) - the returned average",
                rtol=1e-4,
                atol=1e-5,
            )
    # the all-reduces' bytes: under grading from the grader's capture (each call's slot and payload), in the
    # student's own kernel from the ranks' trace; torch's from the run the grader made of it
    torchs = sum(e.meta.get("in_bytes", e.bytes) for e in reference.collectives(rank=0) if e.op.endswith("all_reduce"))
    calls = carried.collective_payloads(mine, case)
    if calls is None:
        yours = sum(e.meta.get("in_bytes", e.bytes) for e in mine.trace.collectives(rank=0))
    else:
        yours = sum(carried.all_reduce_sizes(calls, n, case))
        # the hook's exchange is all-reduces alone: any other call of the hooks' (DDP's bucket rebuild after the
        # first step broadcasts a few integers) must stay below one bucket's bytes in all (a dense gradient sent
        # some other way carries that much each step)
        others = [(slot, total) for slot, total in _hook_calls(calls) if carried.kind(slot) != "all_reduce"]
        bucket = 4 * sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
        assert sum(total for _, total in others) < bucket, (
            f"{case}: once training began, the grader's capture of the wire saw "
            f"{', '.join(sorted({carried.kind(slot) for slot, _ in others}))} "
            f"carrying {sum(total for _, total in others)} B as well as the all-reduces (DDP's own bucket rebuild "
            f"broadcasts a few integers; a bucket is {bucket} B): torch's powerSGD_hook communicates through "
            f"all-reduces alone, and its bytes are the hook's to match"
        )
    where = "the grader's capture of the wire saw" if calls is not None else "your ranks' trace says"
    assert yours == torchs, (
        f"{case}: {where} all-reduces of {yours} B in all in {steps} steps, torch's powerSGD_hook's are {torchs} B: "
        f"all Ps in one all-reduce (n·r' each), all Qs in another (m·r'), only matrices with "
        f"(n + m)·r'·min_compression_rate < n·m compressed, the rest in one all-reduce"
    )
    if calls is not None:
        _check_powersgd_carried(mine, launch(_torch_powersgd_sent, n, rank, steps, sizes, timeout=60), case)
    yours, torchs = (float(np.median(relative_errors(results))) for results in (mine.results, reference.results))
    assert yours <= factor * torchs + 0.02, (
        f"{case}: the median relative error of your average is {yours:.3f}, torch's powerSGD_hook's {torchs:.3f} "
        f"(at most {factor} × that + 0.02 allowed): orthogonalise P after its all-reduce, then Q = Mᵀ P, average P Qᵀ"
    )


def _check_powersgd_carried(run, reference: list[list[torch.Tensor]], case: str) -> None:
    """Under grading: every message of each all-reduce of the hooks' (``wirecalls.call_payloads``, in the order the
    ranks made them) holds a piece of a sum, over ranks that include its sender, of what the rules give each rank
    to all-reduce there (``carried.assert_reduced_carried``): torch's ``powerSGD_hook`` run by the grader on the
    same training from the exercise's first Qs (``ranks._torch_powersgd_sent``): the plain steps' buckets (as they
    are, or divided by the world size), then at each compressed step the uncompressed gradients, the Ps and the Qs.
    Up to the signs of the factors' columns (an orthogonalisation may flip a column, the same on every rank:
    ``magnitudes``), within 1e-3 relative or 1e-4 of the call's largest sum (torch orthogonalises P by Gram-Schmidt
    at r' <= 2, the exercise by any QR).  Since each step's Ps depend on the last step's average and error, a hook
    that all-reduces zeros of the right sizes and takes the average another way (the launcher's store) fails, and
    so does one whose average or error feedback differs from the rules'."""
    n = run.world_size
    made = [
        payloads
        for kind, payloads in wirecalls.call_payloads(run, range(n), case)
        if kind == "all_reduce" and any(map(any, payloads.values()))
    ]
    calls = [[reference[r][i] for r in range(n)] for i in range(len(reference[0])) if reference[0][i].numel()]
    assert len(made) == len(calls), (
        f"{case}: the grader's capture of the wire shows {len(made)} all-reduces with data in the hooks; torch's "
        f"powerSGD_hook makes {len(calls)}: one a step in the first 2 (the given plain all-reduce), then 3 a step "
        "(the uncompressed gradients, all the Ps, all the Qs)"
    )
    for call, (payloads, inputs) in enumerate(zip(made, calls)):
        largest = n * max(float(t.abs().max()) for t in inputs)
        plain = call < 2  # (the given plain steps: the bucket as it is, or as torch's divided by the world size)
        carried.assert_reduced_carried(
            payloads,
            {r: [inputs[r] * n, inputs[r]] if plain else [inputs[r]] for r in range(n)},
            case,
            f"all-reduce {call + 1} of the hooks' {len(calls)} (what torch's powerSGD_hook all-reduces there, from the "
            "same first Qs, the grader's run)",
            tolerance=(1e-3, 1e-4 * largest),
            magnitudes=True,
        )
