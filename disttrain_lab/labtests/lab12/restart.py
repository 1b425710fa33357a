"""Lab 12's part 3 check: ``train_with_checkpoints`` survives a rank the grader kills.

The job is the grader's: 2 ranks of FSDP training the wide MLP (:data:`.mlp.WIDE`), from a checkpoint
the grader wrote of its own run from a seed drawn at grading time (``step_<start>`` in a folder of the
grader's naming), so no student process can compute the answer without following the checkpoints.

1. **The first attempt**: the student's function resumes from that checkpoint and trains; as rank 1
   begins step ``kill_at + 1`` the grader's step function kills it (``SIGKILL``); the launch must fail
   with that rank killed.  The grader then reads the checkpoints it saved (a driver of its own returns the
   files; the grader kernel reads them, running nothing in them): at each multiple ``k`` of ``every`` from
   ``start`` to ``kill_at`` a complete ``step_<k>`` holding the training at step ``k`` (every value the
   exercise names, within 1e-10 of the grader's run).
2. **The second attempt**, the job started again as torchrun's agent would: fresh ranks, a model
   initialised otherwise, the same folder, in which the grader has left, as a save cut short by the
   failure would, a folder ``step_<n>`` with data files and no ``.metadata``, one checkpoint interval
   past the newest complete one.  The student's function must resume from the newest *complete*
   checkpoint and train on to ``total``.  That checkpoint, once read, is replaced by the grader's own of
   another training at the same step (a seed drawn at grading time), so the right parameters exist only by
   loading that very folder: a second attempt that replays the steps from the grader's first checkpoint
   without a word on the wire, and a first attempt that saves nothing, earn nothing (``tests/labs/
   test_lab12.py``).

The checkpoints are files: the two attempts' ranks may write beneath the job's folder (``exercise.run``'s
``writable``), where a graded run's ranks otherwise write nothing.

Graded: the first attempt's checkpoints, each rank's parameters against the grader's run (of the checkpoint
it put in place) continued in one process (1e-10), and the
steps the second attempt ran, counted from the wire: the bytes each rank sent, as the operating system
counted them, against the bytes of one step measured by the grader's own run of its training on the
same ranks (:func:`_calibrate`, no student code), so that a restart from an older checkpoint (more
steps run again) fails though its parameters are right.  Where the host cannot count (a student's own
notebook: ``traffic.source == "trace"``) only the values are checked.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from ... import exercise
from ...exercise import ExerciseError
from . import checkpoint, checkpoint_files, mlp

__all__ = ["RESTART_LAYOUT", "attempt", "check_restart", "driver_for_restart", "newest_complete"]

RESTART_LAYOUT = "fsdp"
_DRIVER_FOR_RESTART: list[Callable] = []


def newest_complete(start: int, every: int, kill_at: int) -> int:
    """The step of the newest complete checkpoint when rank 1 is killed after ``kill_at`` steps: the last
    multiple of ``every`` saved after the grader's ``start``, else ``start``."""
    saved = kill_at // every * every
    return saved if saved > start else start


def attempt(train_with_checkpoints, name, total, every, seed, files, start, kill_at, partial):
    """One attempt of the job in this rank: the folder ``name`` in the kernel's working directory
    (``files``: the grader's checkpoint put at ``step_<start>`` first, in place of what was there;
    ``partial``: ``(step, files)``, a save cut short, put there first), a model from ``seed``, then
    ``train_with_checkpoints(folder, t, total, every, step)`` where ``step`` is the kit's ``train_step`` and,
    when ``kill_at`` is set, kills rank 1 as it begins step ``kill_at + 1`` (``SIGKILL``).  Returns the step it
    resumed from and the parameters whole."""
    import os
    import shutil
    import signal

    import torch.distributed as dist

    from disttrain_lab.labtests.lab12 import mlp

    folder = os.path.abspath(name)  # in the kernel's working directory: the run's one writable folder
    if dist.get_rank() == 0:
        for step, pieces in ((start, files), partial or (None, None)):
            if pieces:  # (in place of whatever was there)
                shutil.rmtree(os.path.join(folder, f"step_{step}"), ignore_errors=True)
            for file, data in (pieces or {}).items():
                os.makedirs(os.path.join(folder, f"step_{step}"), exist_ok=True)
                with open(os.path.join(folder, f"step_{step}", file), "wb") as f:
                    f.write(data)
    dist.barrier()
    t = mlp.training("fsdp", seed, mlp.WIDE)
    taken = [0]

    def step(training):
        if kill_at is not None and start + taken[0] == kill_at and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # the grader's failure: this rank dies as the step begins
        taken[0] += 1
        mlp.train_step(training)

    resumed = train_with_checkpoints(folder, t, total, every, step)
    resumed = resumed if isinstance(resumed, int) else repr(resumed)[:80]
    return {"resumed": resumed, "params": mlp.full_parameters(t.model)}


def _attempt(name, total, every, seed, files, start, kill_at, partial):
    """Driver: one attempt on your train_with_checkpoints, save_checkpoint and load_checkpoint."""
    from disttrain_lab.labtests.lab12 import restart

    return restart.attempt(train_with_checkpoints, name, total, every, seed, files, start, kill_at, partial)  # noqa: F821


def _calibrate(steps):
    """Driver (no student code): ``steps`` steps of the grader's training in the part's layout."""
    from disttrain_lab.labtests.lab12 import mlp

    t = mlp.training("fsdp", 0, mlp.WIDE)
    for _ in range(steps):
        mlp.train_step(t)
    return 0


def _saved(name, steps, most):
    """Driver (no student code): the files of each ``name/step_<k>`` for ``k`` in ``steps`` (None for a folder
    missing), regular files only, at most ``most`` bytes in all."""
    import os

    found, left = {}, most
    for k in steps:
        folder = os.path.join(name, f"step_{k}")
        if os.path.islink(folder) or not os.path.isdir(folder):
            found[k] = None
            continue
        found[k] = {}
        for file in sorted(os.listdir(folder))[:64]:
            path = os.path.join(folder, file)
            if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) > left:
                continue
            with open(path, "rb") as f:
                found[k][file] = f.read(left)
            left -= len(found[k][file])
    return found


def _remove(name):
    """Driver (no student code): the job's checkpoints removed (a confined rank may empty the folder, not
    remove it from the kernel's working directory: an empty folder stays there)."""
    import shutil

    shutil.rmtree(name, ignore_errors=True)
    return 0


def driver_for_restart(graders: Callable | None = None, *, afresh: bool = False) -> Callable:
    """The driver ``train_with_checkpoints`` is graded with: one on the notebook's own ``save_checkpoint`` and
    ``load_checkpoint`` where they pass their visible checks, else ``graders`` (the grader's, from the graded
    cell's hidden tests; None in a student's notebook, where failing ones then fail this check saying so),
    so that the restart is graded on its own.  Decided once (``afresh``: again)."""
    if afresh:
        _DRIVER_FOR_RESTART.clear()
    if not _DRIVER_FOR_RESTART:
        try:
            checkpoint.check_save("dp2xtp2", 3)
            checkpoint.check_load("fsdp", 3, 6)
            _DRIVER_FOR_RESTART.append(_attempt)
        except Exception as e:  # an AssertionError, or the student's code raised in a rank
            if graders is None:
                raise AssertionError(
                    "train_with_checkpoints uses save_checkpoint and load_checkpoint, which do not pass "
                    "exercises 4 and 5's checks yet: fix them first (the grader grades the restart with "
                    f"its own).\n{e}"
                ) from None
            _DRIVER_FOR_RESTART.append(graders)
    return _DRIVER_FOR_RESTART[0]


def _other_training(seed: int) -> int:
    """The seed of the training whose checkpoint the grader puts in place of the one the second attempt resumes
    from: drawn at grading time (the visible case's, seed 0: a fixed other)."""
    return secrets.randbits(62) if seed else 11


def _check_first_saves(case: str, name: str, seed: int, start: int, every: int, kill_at: int) -> None:
    """The first attempt saved, at each multiple ``k`` of ``every`` after ``start`` up to ``kill_at``, a complete
    checkpoint ``step_<k>`` holding the training at step ``k`` (the grader's files read in the grader kernel)."""
    steps = [k for k in range(start + 1, kill_at + 1) if k % every == 0]
    if not steps:
        return
    saved = exercise.run(_saved, 1, (name, steps, checkpoint_files.MAX_BYTES * len(steps)), timeout=60, writable=name)
    found = saved.results[0] if isinstance(saved.results[0], dict) else {}
    for k in steps:
        files = found.get(k)
        words = f"{case}: after the first attempt (from the grader's step_{start}), step_{k}"
        assert isinstance(files, dict) and all(isinstance(v, bytes) for v in files.values()), (
            f"{words} is missing: the first attempt ran steps {start + 1} to {kill_at} and saves after each step n "
            f'with n % {every} == 0, as save_checkpoint(f"{{folder}}/step_{{n}}", ...)'
        )
        assert ".metadata" in files, (
            f"{words} holds {sorted(files)[:6]} and no .metadata: a save that returned on every rank is complete"
        )
        checkpoint.check_holds(words, files, mlp.reference(k, seed, mlp.WIDE), k)


def check_restart(
    total: int, every: int, kill_at: int, start: int = 2, seed: int | None = 0, driver: Callable | None = None
) -> None:
    """``train_with_checkpoints`` on 2 FSDP ranks from the grader's checkpoint after ``start`` steps, rank 1
    killed after ``kill_at`` steps, the job started again: the first attempt saved every ``every`` steps (read by
    the grader), and the second, from the newest complete checkpoint (the grader's own put in its place), ends on
    the grader's parameters after ``total`` steps, having run only the steps since."""
    if not start < kill_at < total:
        raise ValueError(f"the kill must fall between the start and the end: {start} < {kill_at} < {total}")
    seed = secrets.randbits(62) if seed is None else seed
    driver = driver or _attempt
    resume = newest_complete(start, every, kill_at)
    case = (
        f"2 ranks from the grader's checkpoint at step {start}, saving every {every} steps, rank 1 killed after "
        f"step {kill_at}, restarted, to step {total}"
    )
    name = f".lab12-restart-{secrets.token_hex(6)}"  # a folder of the kernel's working directory
    files, _ = checkpoint.grader_checkpoint(start, seed, mlp.WIDE)
    # a save cut short by the failure: the data files of the next checkpoint, no .metadata
    cut = {k: v for k, v in files.items() if k != ".metadata"}
    fresh = (secrets.randbits(62), secrets.randbits(62)) if seed else (7, 8)
    # the checkpoint the second attempt resumes from: the grader's own, of another training, in place of the one
    # the first attempt saved (read first): only a restart that loads that very folder ends on the grader's values
    swapped, t = checkpoint.grader_checkpoint(resume, _other_training(seed), mlp.WIDE)
    try:
        try:
            exercise.run(
                driver, 2, (name, total, every, fresh[0], files, start, kill_at, None), timeout=120, writable=name
            )
        except ExerciseError as e:
            assert "rank 1" in str(e) and "SIGKILL" in str(e), (
                f"{case}: the first attempt should end with rank 1 killed by the grader (SIGKILL) as it began "
                f"step {kill_at + 1}; it failed otherwise: {e}"
            )
        else:
            raise AssertionError(
                f"{case}: the first attempt ran to its end, though rank 1 is killed as it begins step "
                f"{kill_at + 1}: call train_step(t) once for each step, from the step resumed at"
            )
        _check_first_saves(case, name, seed, start, every, kill_at)
        run = exercise.run(
            driver,
            2,
            (name, total, every, fresh[1], swapped, resume, None, (resume + every, cut)),
            timeout=120,
            writable=name,
        )
    finally:
        exercise.run(_remove, 1, (name,), timeout=30, writable=name)
    for _ in range(resume, total):
        mlp.train_step(t)
    want = {n: p.detach() for n, p in t.model.named_parameters()}
    for rank, got in enumerate(run.results):
        if not isinstance(got, dict) or not isinstance(got.get("params"), dict):
            raise AssertionError(f"{case}: rank {rank}'s second attempt returned no parameters")
        for n, w in want.items():
            g = got["params"].get(n)
            same = hasattr(g, "shape") and g.shape == w.shape and g.dtype == w.dtype
            err = float((g - w).abs().max()) if same else float("nan")
            assert same and err <= checkpoint.TOLERANCE_RESHARD, (
                f"{case}: after step {total} rank {rank}'s {n} differs from one process trained without a break "
                f"by {err:.3g} (allowed {checkpoint.TOLERANCE_RESHARD:g})"
            )
    # the steps run again, from the wire (the student's own machine cannot count: the values say enough there)
    calibration = exercise.run(_calibrate, 2, (2,), timeout=60).traffic if run.traffic.source != "trace" else None
    for rank in range(2 if calibration is not None else 0):
        per_step = calibration.sent(rank) / 2
        ran = run.traffic.sent(rank) / per_step
        steps = total - resume
        assert steps - 0.5 <= ran < steps + 1.5, (
            f"{case}: rank {rank} sent {run.traffic.sent(rank):,} bytes in the second attempt, as the operating "
            f"system counted them: {ran:.2f} steps of {per_step:,.0f} bytes (the grader's own step on these ranks); "
            f"resumed from step {resume}, it runs {steps} ({run.traffic.describe()})"
        )
    for rank, got in enumerate(run.results):  # (what the ranks say: after what the grader observed)
        assert got["resumed"] == resume, (
            f"{case}: the second attempt should resume from step {resume}, the newest complete checkpoint "
            f"(step_{resume + every} has no .metadata: a save cut short); rank {rank}'s returned {got['resumed']}"
        )
