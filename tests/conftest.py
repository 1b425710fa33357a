"""How pytest-xdist shares the suite between its workers (scripts/test.sh: ``--dist loadgroup``).

A test file's tests stay together on one worker (its module-scoped fixtures, e.g. one
execution of a lab notebook shared by many assertions, are made once), as ``--dist loadfile``
would do, except in test_grading.py, the longest file: each lab's round trip (its module
fixture ``released`` is parametrized by lab) and each other test there is a unit of its own,
so the two workers share it.  The longest units are handed out first, so the run does not
end with one worker still grading while the other waits.
"""
from __future__ import annotations

import pytest

# files whose units take longest (minutes on 2 cores), longest first
FIRST = ("test_grading.py", "test_security.py", "test_gradeclass.py", "test_browser.py")


def _group(item) -> str:
    path = item.path.name
    if path != "test_grading.py":
        return path
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "released" in callspec.params:
        return f"{path}[{callspec.params['released'][0]}]"        # one lab's release and round trip
    if "broken_batch" in item.fixturenames:
        return f"{path}[broken_batch]"                              # one grading run, many assertions
    return item.nodeid


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(_group(item)))

    def rank(item) -> int:
        return FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST)
    items.sort(key=rank)          # stable: the order inside a file is kept
