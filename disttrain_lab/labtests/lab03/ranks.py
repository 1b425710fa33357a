"""Lab 3's drivers: sent to the student's kernel as source, defined there among the notebook's names,
they build the student's classes, train on every rank and return data."""

from __future__ import annotations

import torch
from torch import nn

from ... import exercise, trace
from ...trace import Run


# --------------------------------------------------------------------------------------
# Drivers: run in the student's kernel, among the notebook's names (its functions and classes,
# torch, dist, nn, dl ...); anything else they import themselves.
# --------------------------------------------------------------------------------------
def _shards(x, world_size):
    """A driver: every rank's shard of ``x`` from your ``shard``, as it returned them (``before``) and after
    ``x`` changed in place (``after``: a view of x shows the change, a copy does not)."""

    shards = [shard(x, rank, world_size) for rank in range(world_size)]  # noqa: F821  (the notebook's)
    before = [s.clone() if isinstance(s, torch.Tensor) else s for s in shards]
    x.add_(1)
    return before, shards


def _broadcast_in_rank(kind):
    """A driver: your broadcast_parameters on a model built from this rank's own seed; the parameters after."""
    import torch.distributed as dist

    import disttrain_lab as dl
    from disttrain_lab.labtests.lab03.common import graded_model

    model = graded_model(kind, seed=dist.get_rank()).to(dl.device())
    broadcast_parameters(model)  # noqa: F821  (the notebook's)
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


def _train_in_rank(
    wrapper,
    kind,
    batch,
    steps,
    micro_steps=1,
    bucket_mb=None,
    graders=None,
    interrupted=False,
    nested=False,
    gate_at=None,
    around=False,
):
    """A driver: in a rank, wrap a model built from *this rank's* seed (so the wrapper must broadcast rank 0's
    parameters) in your class ``wrapper`` (with ``bucket_mb=`` when given), train it data-parallel for ``steps``
    steps, each of ``micro_steps`` micro-batches (all but the last under ddp.no_sync()), as a torch DDP user
    would.  ``graders``: the grader's own code for the exercise this one is built on, used instead of yours when
    yours did not pass its test: ("broadcast_parameters", the function's name, its source), or ("BucketedDDP",
    the name of a function that makes the class, its source).  ``interrupted``: before training, an exception is
    raised inside ``with ddp.no_sync():`` and caught, as a training loop that skips a failed micro-batch does.
    ``nested``: inside each micro-step's no_sync(), before its backward, a second no_sync() is opened and closed
    (as a helper the loop calls may do): the outer one must still hold.  Under grading each micro-step begins at
    the grader's word, and the run ends with one more (the grader's marks: ``disttrain_lab.gate``; none in the
    student's own notebook); ``gate_at``: the last step's last micro-batch is held in backward at the output of
    the model's module ``gate_at`` by the grader's gate; ``around``: every step's last micro-batch is held
    before its backward and after it (the grader keeps one rank, drawn, behind before one backward, told to none:
    ``overlap.assert_backward_ran_on``).
    Returns the parameters, and the events
    of the rank's trace with its dl.region marks (dl.exercise.run's run.trace leaves those out)."""
    import contextlib

    import torch.distributed as dist

    import disttrain_lab as dl
    from disttrain_lab import gate as gates
    from disttrain_lab.devices import backend_name
    from disttrain_lab.labtests.lab03.common import batches, graded_model

    rank, world_size = dist.get_rank(), dist.get_world_size()
    make_ddp = {  # the notebook's classes
        "NaiveDDP": lambda: NaiveDDP,  # noqa: F821
        "OverlappedDDP": lambda: OverlappedDDP,  # noqa: F821
        "BucketedDDP": lambda: BucketedDDP,  # noqa: F821
        "AccumulatingDDP": lambda: AccumulatingDDP,  # noqa: F821
    }[wrapper]()
    routed = []  # the parameters exercise 6's override of grad_ready would have seen (BucketedDDP only)
    if wrapper == "BucketedDDP":  # as AccumulatingDDP extends it: a subclass that overrides grad_ready

        def grad_ready(self, param, _yours=make_ddp.grad_ready):
            routed.append(1)
            return _yours(self, param)

        make_ddp = type(make_ddp.__name__, (make_ddp,), {"grad_ready": grad_ready})
    bases, swapped = make_ddp.__bases__, None  # swapped: (names, yours), put back at the end
    if graders is not None:
        replaces, name, source = graders
        space = {"__name__": "graders", "torch": torch, "dist": dist, "nn": nn}
        exec(source, space)
        if replaces == "broadcast_parameters":  # NaiveDDP(model) broadcasts with the grader's
            names = make_ddp.__init__.__globals__
            swapped = (names, names.get(replaces))
            names[replaces] = space[name]
        elif bases == (BucketedDDP,):  # noqa: F821  (AccumulatingDDP on the grader's BucketedDDP)
            make_ddp.__bases__ = (space[name](),)
    gate = gates.connect(rank)
    try:
        model = graded_model(kind, seed=rank).to(dl.device())
        if gate is not None and gate_at is not None:
            gate.after(model.get_submodule(gate_at))
        ddp = make_ddp(model) if bucket_mb is None else make_ddp(model, bucket_mb=bucket_mb)
        if not isinstance(ddp, nn.Module) or getattr(ddp, "module", None) is not model:
            raise TypeError(
                f"{type(ddp).__name__}(model) should be an nn.Module whose .module is the model it "
                f"wraps, like torch's DistributedDataParallel (call super().__init__(), then "
                f"self.module = module)"
            )
        optimizer = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1)
        if interrupted:
            failure = RuntimeError("a micro-batch failed inside no_sync()")
            try:
                with ddp.no_sync():
                    raise failure
            except RuntimeError as e:
                if e is not failure:
                    raise
            else:
                raise AssertionError(
                    "an exception raised inside `with ddp.no_sync():` did not come out of it: "
                    "no_sync() swallowed it; restore the state in `finally:` and let it go on"
                )
        for step, (x, y) in enumerate(batches(kind, batch, steps)):
            x, y = x.tensor_split(world_size)[rank].to(dl.device()), y.tensor_split(world_size)[rank].to(dl.device())
            optimizer.zero_grad()
            for micro, (xm, ym) in enumerate(zip(x.tensor_split(micro_steps), y.tensor_split(micro_steps))):
                last = micro == micro_steps - 1
                if gate is not None:
                    gate.start()  # (every rank's earlier messages are done: a micro-step's window opens)
                with contextlib.nullcontext() if last else ddp.no_sync():
                    if nested and not last:
                        with ddp.no_sync():  # closing it must leave the outer no_sync() in force
                            pass
                    if gate is not None and gate_at is not None and last and step == steps - 1:
                        gate.arm()
                    loss = shard_loss(ddp, xm, ym, batch)  # noqa: F821  (the notebook's)
                    held = gate is not None and around and last
                    if held:
                        gate.wait(torch.Size([1]))  # (held before its backward: it has posted nothing this step)
                    with dl.region("backward", step=step, micro=micro, last=last):
                        loss.backward()
                    if held:
                        gate.wait(torch.Size([1]))  # (held once its backward returned)
            with dl.region("finish", step=step):
                ddp.finish_gradient_synchronization()
            optimizer.step()
        if gate is not None:
            gate.start()  # (the last step's messages are done: its window closes)
    finally:
        if gate is not None:
            gate.close()
        if make_ddp.__bases__ != bases:
            make_ddp.__bases__ = bases
        if swapped is not None:
            swapped[0]["broadcast_parameters"] = swapped[1]
    return {
        "parameters": {name: p.detach().cpu() for name, p in model.named_parameters()},
        "routed": len(routed),
        "events": dl.trace.set_recording(True),
        "backend": backend_name(),
    }


def _traced(run: exercise.ExerciseRun) -> Run:
    """The ranks' trace of a run of _train_in_rank, each rank's events as its driver handed them back."""
    events = [e for rank, result in enumerate(run.results) for e in trace.to_events(result["events"]) if e.rank == rank]
    return Run(
        results=[result["parameters"] for result in run.results],
        events=sorted(events, key=lambda e: e.start),
        world_size=run.world_size,
        backend=run.results[0]["backend"],
    )
