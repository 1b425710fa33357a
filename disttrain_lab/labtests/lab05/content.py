"""What a pipeline's messages must hold, recomputed in one process: the activation each stage sends
the next and the gradient each stage sends back, micro-batch by micro-batch and step by step.

The grader trains the same MLP in one process as the pipeline does (the same stages, the same
micro-batches, SGD on the whole batch's gradient), keeping at every stage boundary each micro-batch's
activation and the gradient of the step's loss with respect to it.  A stage that scales each
micro-batch's loss by rows / batch (as the exercise asks) sends exactly that gradient; one that scales
the accumulated gradient at the end instead sends it times batch / rows, and both are taken.  Values
are compared within the tests' tolerance (``TOLERANCE``: another order of adding over micro-batches
moves the last bits), so junk of the right size fails while the student's order of computing does not
(``carried.assert_values_carried``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import carried, models
from ...exercise import ExerciseRun
from .stages import TOLERANCE, _batches, _even_stages, _rows, _sizes


def reference_messages(p: int, batch: int, m: int, steps: int) -> dict[tuple[int, int], list[list[torch.Tensor]]]:
    """For ``carried.assert_values_carried``: on the link from stage s to s + 1, step by step, what each
    forward message may hold (any micro-batch of that step: the order is the wire's own check), and on the
    link back, what each gradient may hold (either scaling)."""
    model = models.MLP(_sizes(p), seed=0)
    stages = _even_stages(model, p)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    forward = {(s, s + 1): [] for s in range(p - 1)}
    backward = {(s + 1, s): [] for s in range(p - 1)}
    for x, y in _batches(p, batch, steps):
        optimizer.zero_grad()
        acts, grads = {s: [] for s in range(p - 1)}, {s: [] for s in range(p - 1)}
        for rows, xs, ys in zip(_rows(batch, m), x.tensor_split(m), y.tensor_split(m)):
            out, kept = xs, []
            for s, stage in enumerate(stages):
                out = stage(out)
                if s < p - 1:
                    out.retain_grad()
                    kept.append(out)
            (F.mse_loss(out, ys) * rows / batch).backward()
            for s, a in enumerate(kept):
                acts[s].append(a.detach().clone())
                grads[s] += [a.grad.detach().clone(), a.grad.detach() * batch / rows]
        optimizer.step()
        for s in range(p - 1):
            forward[(s, s + 1)] += [acts[s]] * m
            backward[(s + 1, s)] += [grads[s]] * m
    return {**forward, **backward}


def check_wire_content(case: str, run: ExerciseRun, p: int, batch: int, m: int, steps: int) -> None:
    """Every activation and gradient that crossed a link, as the grader's capture saw it, holds one of its
    step's micro-batches' values as one process computes them (nothing is checked in the student's own
    notebook, where there is no capture)."""
    carried.assert_values_carried(
        run, reference_messages(p, batch, m, steps), case, what="activation or gradient message", **TOLERANCE
    )
