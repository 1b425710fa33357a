"""Lab 12's part 2 checks: ``save_checkpoint`` judged by the files it wrote, ``load_checkpoint`` by the
training it resumes from a checkpoint the grader wrote.

**The save.**  The grader's driver trains :mod:`.mlp`'s MLP in a layout on the student's ranks and
calls ``save_checkpoint`` with a path in each rank's fsspec memory file system; the files come back
as data and the grader kernel reads them itself (:func:`.checkpoint_files.read_checkpoint`: nothing in
them is run), then compares every value the exercise names (parameters, Adam's moments and step, the
step, the loader's generator state) with its own run of the same training in one process.

**The load.**  The grader writes, in the grader kernel, a checkpoint of its own run trained from a seed
drawn there at grading time (``secrets``), which no student process receives; the student's ranks get
only its files, a model initialised from another seed, and the number of steps to train on to.  Their
parameters after training on must equal the grader's run continued in one process: a right answer
exists only by restoring what the files hold (a load that replays a training from the start, or
computes the answer from this module's visible seed, fails every hidden case).  The visible cases use
seed 0, the notebook's.
"""

from __future__ import annotations

import secrets

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from ... import exercise
from . import checkpoint_files, mlp

__all__ = ["CHECKPOINT", "TOLERANCE_RESHARD", "check_holds", "check_load", "check_save"]

TOLERANCE_RESHARD = 1e-10
CHECKPOINT = "memory://lab12/checkpoint"  # fsspec's in-memory file system: a graded rank writes no file


def _train_and_save(layout, steps, path, seed):
    """Driver: the grader's training in ``layout`` for ``steps`` steps, then your save_checkpoint(path, ...);
    returns the files this rank wrote (fsspec's memory file system: the rank writes no file)."""
    from disttrain_lab.labtests.lab12 import checkpoint_files, mlp

    checkpoint_files.clear_memory_files(path)
    t = mlp.training(layout, seed)
    for _ in range(steps):
        mlp.train_step(t)
    save_checkpoint(path, t.model, t.optimizer, steps, t.generator)  # noqa: F821  (the notebook's)
    files = checkpoint_files.memory_files(path)
    checkpoint_files.clear_memory_files(path)
    return files


def _load_and_train(layout, total, path, files, seed):
    """Driver: a model initialised from ``seed`` in ``layout``, your load_checkpoint(path, ...) from the files
    given, then training on to step ``total``; returns the step loaded and the parameters whole."""
    from disttrain_lab.labtests.lab12 import checkpoint_files, mlp

    checkpoint_files.clear_memory_files(path)
    checkpoint_files.put_memory_files(path, files)
    t = mlp.training(layout, seed)
    step = load_checkpoint(path, t.model, t.optimizer, t.generator)  # noqa: F821  (the notebook's)
    checkpoint_files.clear_memory_files(path)
    if not isinstance(step, int) or not 0 <= step <= total:
        return {"step": repr(step)[:80], "params": {}}
    for _ in range(step, total):
        mlp.train_step(t)
    return {"step": step, "params": mlp.full_parameters(t.model)}


def _seed(seed: int | None) -> int:
    return secrets.randbits(62) if seed is None else seed


def _case(layout: str) -> str:
    return f"{mlp.RANKS[layout]} rank{'s' if mlp.RANKS[layout] > 1 else ''} ({layout})"


def _expected(t: mlp.Training, steps: int) -> dict[str, object]:
    """What the exercise says a checkpoint of ``t`` at ``steps`` holds, by DCP's flattened names."""
    want: dict[str, object] = {"step": steps, "loader": t.generator.get_state()}
    by_param = dict(zip(map(id, t.model.parameters()), (n for n, _ in t.model.named_parameters())))
    for name, p in t.model.named_parameters():
        want[f"model.{name}"] = p.detach()
    for p, state in t.optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            want[f"optim.state.{by_param[id(p)]}.{key}"] = state[key]
    return want


def check_save(layout: str, steps: int, seed: int | None = 0) -> None:
    """``save_checkpoint`` after ``steps`` steps in ``layout``: the files hold, under the names the
    exercise gives, every value of one process's run of the same training (within 1e-10)."""
    seed = _seed(seed)
    case = f"saved after {steps} steps on {_case(layout)}"
    run = exercise.run(_train_and_save, mlp.RANKS[layout], (layout, steps, CHECKPOINT, seed), timeout=120)
    files: dict[str, bytes] = {}
    writers: dict[str, set[int]] = {}
    for rank, written in enumerate(run.results):
        if not isinstance(written, dict) or not all(isinstance(v, bytes) for v in written.values()):
            raise AssertionError(f"{case}: the checkpoint's files of rank {rank} could not be read back")
        for name, data in written.items():
            if name in files and files[name] != data:
                raise AssertionError(f"{case}: ranks wrote different contents to {name}")
            files[name] = data
            writers.setdefault(name, set()).add(rank)
    assert files, (
        f"{case}: save_checkpoint wrote nothing at {CHECKPOINT!r}: call "
        "torch.distributed.checkpoint.save(state, checkpoint_id=path) on every rank"
    )
    _check_every_rank_saved(case, files, writers, len(run.results))
    check_holds(case, files, mlp.reference(steps, seed), steps)


def check_holds(case: str, files: dict[str, bytes], t: mlp.Training, steps: int) -> None:
    """The checkpoint ``files`` (read here, nothing in them run: ``checkpoint_files.read_checkpoint``) holds, under
    the names the exercise gives, every value of the training ``t`` after ``steps`` steps (within 1e-10)."""
    try:
        got = checkpoint_files.read_checkpoint(files)
    except checkpoint_files.CheckpointUnreadable as exc:
        raise AssertionError(f"{case}: the checkpoint's files {sorted(files)} cannot be read: {exc}") from None
    want = _expected(t, steps)
    for key, w in want.items():
        assert key in got, (
            f"{case}: the checkpoint holds no {key!r} (it holds {sorted(got)[:8]}...): save "
            '{"model": ..., "optim": ... (get_state_dict), "step": step, "loader": generator.get_state()}'
        )
        g = got[key]
        if isinstance(w, int):
            assert g == w and isinstance(g, int), f"{case}: {key!r} should be the int {w}, the checkpoint holds {g!r}"
            continue
        same = isinstance(g, torch.Tensor) and g.shape == w.shape
        if key == "loader":
            assert same and torch.equal(g, w), f"{case}: 'loader' is not the loader's generator state at step {steps}"
            continue
        err = float((g.double() - w.double()).abs().max()) if same else float("nan")
        assert same and err <= TOLERANCE_RESHARD, (
            f"{case}: {key!r} differs from one process's run of the same training by {err:.3g} "
            f"(allowed {TOLERANCE_RESHARD:g}; shape {tuple(w.shape)})"
        )


def _check_every_rank_saved(case: str, files: dict[str, bytes], writers: dict[str, set[int]], n: int) -> None:
    """A collective save: every rank holds a shard of the model (each layout shards every weight), and DCP's save
    writes each rank's pieces into a file of its own, so by ``.metadata`` every rank wrote a file, no other rank
    wrote, that holds a piece of the model.  One rank writing the whole checkpoint (from a single-process run of
    the same seed) holds every value and fails here."""
    try:
        holding = checkpoint_files.files_holding(files, "model.")
    except checkpoint_files.CheckpointUnreadable as exc:
        raise AssertionError(f"{case}: the checkpoint's files {sorted(files)} cannot be read: {exc}") from None
    own = {rank: {name for name in holding if writers.get(name) == {rank}} for rank in range(n)}
    missing = [rank for rank, names in own.items() if not names]
    written = ", ".join(f"{name} by rank(s) {sorted(writers.get(name, ()))}" for name in sorted(holding))
    assert not missing, (
        f"{case}: every rank holds a shard of the model, and a collective save (torch.distributed.checkpoint.save "
        f"on every rank) writes each rank's pieces into a file of its own; by the checkpoint's .metadata, rank(s) "
        f"{', '.join(map(str, missing))} wrote no file holding a piece of the model (the files holding its pieces: "
        f"{written or 'none'})"
    )


def grader_checkpoint(steps: int, seed: int, hidden: int = mlp.HIDDEN) -> tuple[dict[str, bytes], mlp.Training]:
    """The grader's own checkpoint of the training of ``seed`` (``hidden`` wide) after ``steps`` steps, written
    in this process in the form the exercise gives, and that training (to continue it)."""
    t = mlp.reference(steps, seed, hidden)
    model_state, optim_state = get_state_dict(t.model, t.optimizer)
    state = {"model": model_state, "optim": optim_state, "step": steps, "loader": t.generator.get_state()}
    return checkpoint_files.write_checkpoint(state, "memory://lab12/grader"), t


def check_load(layout: str, steps: int, total: int, seed: int | None = 0) -> None:
    """``load_checkpoint`` of the grader's checkpoint after ``steps`` steps, on ``layout``, then training
    on to ``total``: the step restored is ``steps``, and every rank's parameters equal the grader's run
    continued in one process (within 1e-10)."""
    seed = _seed(seed)
    case = f"the grader's checkpoint after {steps} steps, resumed on {_case(layout)}"
    files, t = grader_checkpoint(steps, seed)
    fresh = secrets.randbits(62) if seed else 7  # other weights, another loader: only the files restore them
    run = exercise.run(_load_and_train, mlp.RANKS[layout], (layout, total, CHECKPOINT, files, fresh), timeout=120)
    for _ in range(steps, total):
        mlp.train_step(t)
    want = {name: p.detach() for name, p in t.model.named_parameters()}
    for rank, got in enumerate(run.results):
        if not isinstance(got, dict) or not isinstance(got.get("params"), dict):
            raise AssertionError(f"{case}: rank {rank}'s run returned no parameters")
        assert got["step"] == steps, (
            f"{case}: load_checkpoint should return the step saved, {steps}; rank {rank}'s returned {got['step']}"
        )
        for name, w in want.items():
            g = got["params"].get(name)
            same = isinstance(g, torch.Tensor) and g.shape == w.shape and g.dtype == w.dtype
            err = float((g - w).abs().max()) if same else float("nan")
            assert same and err <= TOLERANCE_RESHARD, (
                f"{case}: after {total} steps rank {rank}'s {name} differs from one process trained without a "
                f"break by {err:.3g} (allowed {TOLERANCE_RESHARD:g}): the parameters, Adam's state (its moments "
                "and step), the step and the loader's generator must all come back"
            )
