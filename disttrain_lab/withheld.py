"""A graded prediction's expected value, withheld from feedback: a wrong prediction's message
(``predictions.assert_prediction``) says "<GIVES> <the expected value>"; before the deadline, where
a student may still resubmit, the grader's feedback says it is wrong without saying what is right.
Standard library only: nbgrader's steps (``grading.feedback_page``, ``grading.gradescope``) import
it without torch.
"""

from __future__ import annotations

import re

GIVES = "the cost model gives"  # before each expected value in assert_prediction's message
_EXPECTED = re.compile(re.escape(GIVES) + r" [-+]?\d\.\d+e[-+]\d+")


def withhold_expected(message: str, instead: str = "a different value") -> str:
    """``message`` with every expected value of ``assert_prediction``'s replaced by ``instead``:
    feedback that says a prediction is wrong without saying what is right (the grader's feedback
    before the deadline, where a student may still resubmit).

        >>> withhold_expected("bubble: predicted 2.00e-01, the cost model gives 2.73e-01")
        'bubble: predicted 2.00e-01, the cost model gives a different value'
    """
    return _EXPECTED.sub(lambda _: f"{GIVES} {instead}", message)
