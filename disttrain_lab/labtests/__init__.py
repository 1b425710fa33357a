"""The graded tests of the labs, one module per lab (``lab01`` ... ``lab12``), and what they share
(``common``).

A lab's graded cell is a short call of its module's check for that exercise, on the cases the
text asks for; the hidden cases are more calls, in the cell's hidden block (``### BEGIN HIDDEN
TESTS``), which the student never receives.  What a check verifies is what the exercise's text
states; the check itself is visible, as any self-check (``lab01.check_ping_pong??`` in a notebook,
or this folder), and it is the same code whether it runs in the student's notebook or, under
grading, in the grader kernel, which holds no student code (it reaches the student's functions
only through ``dl.exercise.run`` and ``dl.predictions.fetch``).

Nothing here defines a solution or a graded answer: references come from torch itself or from
single-process runs (lab 12's traces are built with their answers: each a sum of the lengths it was laid
out from), and an answer that must stay hidden (a prediction's cost model, a hidden
reference) stays in the cell's hidden block.

A lab made by ``disttrain-lab new-lab --root DIR`` outside the kit's own checkout has its checks in
``DIR/disttrain_lab/labtests/``; naming that folder in ``DISTTRAIN_LABTESTS`` (``os.pathsep``
between several) where the kernels run makes them importable here too.
"""

import os

__path__ += [p for p in os.environ.get("DISTTRAIN_LABTESTS", "").split(os.pathsep) if p and os.path.isdir(p)]
