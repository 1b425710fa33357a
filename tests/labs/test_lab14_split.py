"""Lab 14's exercise 3 (under construction): zero bubble's split backward, ``backward_input`` (I) and
``backward_weight`` (W), graded against torch's own ``out.backward(grad_out)`` on the grader's copy of each stage;
and the graded predictions of a schedule's bubble and of the activations a rank holds.

- Right functions pass (I by ``torch.autograd.grad`` keeping the graph, W by ``backward(inputs=params)``), and so
  does a W that recomputes the forward from x (how W gets its values is free).
- Forgeries fail, each naming the rule: an I that computes everything (``out.backward(grad_out)``, with or
  without keeping the graph) sets the weights' gradients; a W that overwrites .grad is caught on the second
  micro-batch; an I that returns grad_out is not x's gradient; an I that returns a list is not a tensor.
- End to end as test_lab14_schedule: the functions stood in as ``__main__``'s, run through ``dl.exercise.run``
  on one rank in this process.
"""

from __future__ import annotations

import pytest
import torch

from disttrain_lab import exercise
from disttrain_lab.labtests import lab14
from disttrain_lab.predictions import PredictionError
from tests.helpers import notebook_names

CASES = [((6, 9, 4), 5), ((3, 8, 8, 2), 3), ((7, 2), 1)]  # (widths, batch): uneven, three layers, one Linear


# The functions, right and wrong ----------------------------------------------------------------------------------


def backward_input(stage, x, out, grad_out):
    """I: x's gradient only, the graph kept for W."""
    (grad_x,) = torch.autograd.grad(out, x, grad_out, retain_graph=True)
    return grad_x


def backward_weight(stage, x, out, grad_out):
    """W: the parameters' gradients, added into .grad."""
    out.backward(grad_out, inputs=list(stage.parameters()))


def weight_by_recomputing(stage, x, out, grad_out):
    """W from scratch: a fresh forward of x (allowed: the values are right)."""
    stage(x.detach()).backward(grad_out)


def input_computing_everything(stage, x, out, grad_out):
    """A forgery: the full backward in I (the weights' gradients too), the graph kept so W still runs."""
    out.backward(grad_out, retain_graph=True)
    return x.grad


def input_computing_everything_once(stage, x, out, grad_out):
    """The same, the graph freed: W then raises."""
    out.backward(grad_out)
    return x.grad


def weight_overwriting(stage, x, out, grad_out):
    """A forgery: .grad set to this micro-batch's gradient, not added to."""
    params = list(stage.parameters())
    for q, g in zip(params, torch.autograd.grad(out, params, grad_out, retain_graph=True)):
        q.grad = g


@pytest.fixture
def notebook(monkeypatch):
    """Set the notebook's functions (``__main__``'s, where ``dl.exercise.run`` looks them up)."""
    return lambda **functions: notebook_names(monkeypatch, functions)


# The graded check, end to end ----------------------------------------------------------------------------------


def test_the_right_functions_pass(notebook):
    notebook(backward_input=backward_input, backward_weight=backward_weight)
    lab14.check_split_backward(CASES)


def test_a_w_that_recomputes_the_forward_passes(notebook):
    notebook(backward_input=backward_input, backward_weight=weight_by_recomputing)
    lab14.check_split_backward(CASES)


@pytest.mark.parametrize("forgery", [input_computing_everything, input_computing_everything_once])
def test_an_i_that_computes_the_weights_gradients_fails(notebook, forgery):
    notebook(backward_input=forgery, backward_weight=backward_weight)
    with pytest.raises(AssertionError) as caught:
        lab14.check_split_backward(CASES)
    said = str(caught.value)
    assert said.startswith(
        "stage Linear/Tanh widths (6, 9, 4), batch 5, F0, I0, W0: backward_input on micro-batch 0: afterwards "
        "0.weight.grad is set (largest entry "
    ), said
    assert (
        "backward_input must leave the weights' gradients to backward_weight: every parameter's .grad None (or zero)"
        in said
    )


def test_a_w_that_overwrites_fails_on_the_second_micro_batch(notebook):
    notebook(backward_input=backward_input, backward_weight=weight_overwriting)
    with pytest.raises(AssertionError) as caught:
        lab14.check_split_backward(CASES)
    said = str(caught.value)
    assert said.startswith(
        "stage Linear/Tanh widths (6, 9, 4), batch 5, F0, F1, I0, I1, W0, W1: after backward_weight on micro-batch 1: "
        "0.weight.grad differs from the sum of both micro-batches' gradients by "
    ), said
    assert said.endswith(
        "it is micro-batch 1's gradient alone: backward_weight must add into .grad, as loss.backward() does, not "
        "overwrite it (W of each micro-batch accumulates)"
    ), said


def test_an_i_that_returns_grad_out_fails(notebook):
    notebook(backward_input=lambda stage, x, out, grad_out: grad_out, backward_weight=backward_weight)
    with pytest.raises(
        AssertionError,
        match=r"backward_input on micro-batch 0 returned Tensor of shape \(5, 4\), torch.float64; expected the "
        r"gradient of the stage's input: .*: shape \(5, 6\), torch.float64$",
    ):
        lab14.check_split_backward(CASES)
    # the same shape (a square stage): the values are wrong
    notebook(backward_input=lambda stage, x, out, grad_out: grad_out.clone(), backward_weight=backward_weight)
    with pytest.raises(AssertionError) as caught:
        lab14.check_split_backward([((4, 4), 3)])
    assert "returned a gradient that differs from torch's x.grad (after out.backward(grad_out)) by " in str(
        caught.value
    )


def test_what_is_not_a_tensor_fails_as_data_or_as_the_run(notebook):
    notebook(backward_input=lambda stage, x, out, grad_out: backward_input(stage, x, out, grad_out).tolist())
    notebook(backward_weight=backward_weight)
    with pytest.raises(AssertionError, match=r"backward_input on micro-batch 0 returned list \[\["):
        lab14.check_split_backward(CASES)
    notebook(backward_input=lambda stage, x, out, grad_out: (g for g in grad_out))  # a generator: not data
    with pytest.raises(exercise.ExerciseError, match="cannot be sent back to the notebook"):
        lab14.check_split_backward(CASES)


def test_an_exception_is_reported_after_the_rules_before_it(notebook):
    def raises(stage, x, out, grad_out):
        raise ValueError("no W today")

    notebook(backward_input=backward_input, backward_weight=raises)
    with pytest.raises(AssertionError, match=r"F0, I0, W0: your function raised ValueError: no W today$"):
        lab14.check_split_backward(CASES)


def test_the_self_check_runs_the_shown_case_in_this_kernel(capsys):
    lab14.self_check_split_backward(backward_input, backward_weight)
    assert "\N{WHITE HEAVY CHECK MARK} backward_input and backward_weight on widths (5, 7, 3), batch 4" in (
        capsys.readouterr().out
    )
    with pytest.raises(AssertionError, match="must leave the weights' gradients to backward_weight"):
        lab14.self_check_split_backward(input_computing_everything, backward_weight)
    with pytest.raises(AssertionError, match="must add into .grad"):
        lab14.self_check_split_backward(backward_input, weight_overwriting)
    assert lab14.SHOWN_SPLIT not in CASES


# The predictions ---------------------------------------------------------------------------------------------------


def test_the_right_predictions_pass():
    lab14.check_bubble_prediction(0.125, "Interleaved1F1B", 4, 2, 12)
    lab14.check_bubble_prediction(0.1251, "Interleaved1F1B", 4, 2, 12)  # the same to 3 significant figures
    lab14.check_bubble_prediction(torch.tensor(0.125), "Interleaved1F1B", 4, 2, 12)
    lab14.check_held_prediction(5.5, "Interleaved1F1B", 4, 2, 8)
    # the last rank: (v − 1)·p warm-up forwards of its first chunk, no hops to wait for, and one more in the steady state
    lab14.check_held_prediction(2.5, "Interleaved1F1B", 4, 2, 8, rank=3)
    lab14.check_bubble_prediction(0.125, "InterleavedZeroBubble", 4, 1, 8)  # ZB-H1, F = I = W = 1


def test_a_wrong_prediction_fails_without_the_answer():
    with pytest.raises(PredictionError) as caught:
        lab14.check_bubble_prediction(0.375 / 2 + 0.0625, "Interleaved1F1B", 4, 2, 12)
    said = str(caught.value)
    assert said.startswith(
        "your prediction of the bubble of Interleaved1F1B (p = 4, v = 2, m = 12) is 0.25, which is not the simulated "
        "schedule's to 3 significant figures: the bubble is the time the step's ranks stand idle beside the busiest rank's "
        "work"
    ), said
    assert "0.125" not in said and "1.25" not in said and "1/8" not in said
    with pytest.raises(PredictionError) as caught:
        lab14.check_held_prediction(4, "Interleaved1F1B", 4, 2, 8)
    said = str(caught.value)
    assert said.startswith(
        "your prediction of the activations rank 0 holds at its peak under Interleaved1F1B (p = 4, v = 2, m = 8) is 4, "
        "which is not what rank 0's order holds to 3 significant figures: "
    ), said
    assert "5.5" not in said and "11/2" not in said


@pytest.mark.parametrize(
    "value, words",
    [
        (None, "is not filled in yet"),
        (..., "is not filled in yet"),
        ("0.125", "should be a number, got str '0.125'"),
        (True, "should be a number, got bool True"),
        ([0.125], "should be a number, got list"),
        (float("nan"), "should be a finite number, got nan"),
        (torch.tensor([0.1, 0.2]), "should be a number, got Tensor"),
    ],
)
def test_what_is_not_a_number_is_refused(value, words):
    with pytest.raises(PredictionError, match=words.replace("(", r"\(").replace("[", r"\[")):
        lab14.check_bubble_prediction(value, "Interleaved1F1B", 4, 2, 12)
    with pytest.raises(PredictionError, match="should be|not filled in"):
        lab14.check_held_prediction(value, "Interleaved1F1B", 4, 2, 8)


def test_a_case_torch_refuses_or_a_schedule_unknown_is_the_grader_s_mistake():
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        lab14.check_bubble_prediction(0.1, "Interleaved1F1B", 2, 2, 5)
    with pytest.raises(ValueError, match="valid schedules are"):
        lab14.check_held_prediction(1, "ZeroBubble", 4, 2, 8)
    with pytest.raises(ValueError, match="needs 0 ≤ rank < p = 4"):
        lab14.check_held_prediction(1, "Interleaved1F1B", 4, 2, 8, rank=4)


def test_an_i_that_frees_the_graph_fails_when_w_runs(notebook):
    def frees(stage, x, out, grad_out):
        return torch.autograd.grad(out, x, grad_out)[0]

    notebook(backward_input=frees, backward_weight=backward_weight)
    with pytest.raises(AssertionError, match=r"F0, I0, W0: your function raised RuntimeError: .*I must keep the graph"):
        lab14.check_split_backward(CASES)


def test_nan_is_never_within_the_tolerance(notebook):
    notebook(backward_input=lambda stage, x, out, grad_out: backward_input(stage, x, out, grad_out) * float("nan"))
    notebook(backward_weight=backward_weight)
    with pytest.raises(AssertionError, match=r"differs from torch's x.grad .* by nan at most"):
        lab14.check_split_backward(CASES)
