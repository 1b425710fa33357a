"""The order pytest-xdist hands test files to its workers (scripts/test.sh: ``--dist loadfile
--no-loadscope-reorder``, so this order is kept instead of xdist's default of most tests first).

A test file's tests stay together on one worker (its module-scoped fixtures, e.g. one
execution of a lab notebook shared by many assertions, are made once).  The longest files
are handed out first (longest processing time first), so the run does not end with one
worker still grading while the other waits: with the browser's 9 tests handed out last
(xdist's default order) one full run ended ~1.5 min after the other worker had finished.
"""

from __future__ import annotations

import os

import pytest

from tests import roundtrip

# seconds of work per file in a full run on 2 cores (from --junitxml), the longest first;
# files not listed come after these, in pytest's order.  test_browser.py: measured by itself
# on the shared 2-core machine, the mean of two runs (329 s loaded, 241 s quiet; 404, 335 and
# 247 s before its pages loaded in the background)
SECONDS = {
    "test_grading.py": 1254,
    "test_browser.py": 285,
    "test_gradeclass.py": 170,  # 236 before the spinning submission moved to test_cell_times.py
    "test_cell_times.py": 70,  # estimated: the fixture timed once (~20 s) and graded with a 30 s limit
    "test_security.py": 192,
    "test_lab05.py": 145,
    "test_caps.py": 90,  # measured by itself: 81 s (94 s, 181 s with other sessions' tests beside it)
    "test_lab03.py": 124,
    "test_lab04.py": 105,
    "test_lab06.py": 71,
    "test_lab01.py": 70,
    "test_lab02.py": 61,
    "test_launcher.py": 53,
    "test_trusted.py": 150,
    "test_submission_data.py": 47,
    "test_lab07.py": 38,
    "test_lab09.py": 150,  # measured loaded (its helper's report): ~3.5 min slow with the round trip
    "test_lab10.py": 120,
    "test_fairness.py": 60,
    "test_lab08.py": 36,
    "test_install.py": 29,
    "test_network.py": 22,
    "test_torchrun_nodes.py": 25,
    "test_commands.py": 75,
}


# a test that may make a lab's round trip (tests/roundtrip.py) gets the round trip's time limit,
# as tests/grading/test_grading.py has: it may be the one of the two workers that makes it
ROUND_TRIP_TESTS = ("test_solution_notebook_executes_within_budget",)
ROUND_TRIP_TIMEOUT = 900


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -SECONDS.get(item.path.name, 0))  # stable: a file's own order is kept
    for item in items:
        if item.originalname in ROUND_TRIP_TESTS and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(ROUND_TRIP_TIMEOUT))


@pytest.fixture(scope="session", autouse=True)
def _shared_round_trips(tmp_path_factory):
    """Where this session's workers share the labs' round trips (tests/roundtrip.py): the
    folder above each pytest-xdist worker's own temp root (one per session)."""
    base = tmp_path_factory.getbasetemp()
    roundtrip.SHARED = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
