"""What every check of lab 4 shares: its constants and the data a case runs on."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ... import models

STEPS = 3  # training steps of every graded run
SLACK_PER_TENSOR = 16  # bytes: Adam's step counter (a 0-d tensor per parameter tensor) and the like
OPTIMIZERS = {  # what the tests wrap: (optimizer_class, defaults, fp32 bytes of state per element)
    "adam": (torch.optim.Adam, {"lr": 0.01}, 8),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}, 8),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, 4),  # its update is proportional to the gradient
}
PAUSE_S = 8.0  # the memory case's longest pause before its last step; the grader ends it once it has read each rank
TEST_DEVICE = "cpu"  # where the tests' ranks compute (setup(); the grader always runs on the CPU)
GRADED_PASSED: set[str] = set()  # the exercises whose graded cell passed, for the exercises built on them


def setup(device: str = "cpu") -> None:
    """The graded tests' state, as the lab's helper cell sets it: their ranks compute on ``device``
    (the notebook's DEVICE; the CPU under grading), and no exercise has passed its graded cell yet."""
    global TEST_DEVICE
    TEST_DEVICE = device
    GRADED_PASSED.clear()


def communication_volume(events) -> int:
    """Bytes a rank's collectives moved (section 2's accounting): reduce-scatter or all-gather of S bytes
    count S (the size of the whole input, resp. output), an all-reduce of S bytes 2S (it is a reduce-scatter
    plus an all-gather).  The lab's helpers on the CPU count the same: their all-to-all of the S-byte input,
    their N broadcasts of S/N bytes each."""
    return sum(2 * e.bytes if e.op.startswith("all_reduce") else e.bytes for e in events if e.kind == "collective")


def batches(sizes: Sequence[int], batch: int, steps: int) -> list:
    """The data of every graded run (and of the lab's pictures): ``steps`` batches of ``batch`` rows for
    an MLP of ``sizes``."""
    return [models.regression_data(batch, sizes[0], sizes[-1], seed=10 + step) for step in range(steps)]
