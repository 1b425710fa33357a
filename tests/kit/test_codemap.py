"""A rank's traceback names the cell its code was written in, whatever the pickler keeps."""

from __future__ import annotations

import pickle
import types

import pytest

from disttrain_lab import codemap

CELL = "<cell-7>"  # stands for IPython's file name of a notebook cell
SOURCE = """
def helper(x):
    y = x + 1
    return 1 / (y - y)

def outer():
    def inner():
        return helper(3)
    return (lambda: inner())()

class Model:
    def go(self):
        return outer()
"""


def _hide_files(code: types.CodeType) -> types.CodeType:
    """What cloudpickle 3.1.3 does to every code object it rebuilds: the file name is gone."""
    consts = tuple(_hide_files(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename="<dynamic-code>", co_consts=consts)


def _as_a_rank_sees_it(namespace: dict) -> dict:
    for name in ("helper", "outer"):
        namespace[name].__code__ = _hide_files(namespace[name].__code__)
    namespace["Model"].go.__code__ = _hide_files(namespace["Model"].go.__code__)
    return namespace


def test_frames_name_the_real_file_after_a_pickler_hid_it():
    namespace: dict = {}
    exec(compile(SOURCE, CELL, "exec"), namespace)
    _, where = codemap.dumps(namespace["Model"]().go)
    # every code object reachable from the method: the method, the helper it calls through
    # globals, the nested function and the lambda (and library functions, by their own file)
    assert sum(file == CELL for file in where.values()) == 5
    rank = _as_a_rank_sees_it(namespace)
    with pytest.raises(ZeroDivisionError) as caught:
        rank["Model"]().go()
    sent = pickle.loads(pickle.dumps(codemap.frames_of(caught.value.__traceback__)))  # plain data
    assert [f[0] for f in sent[1:]] == ["<dynamic-code>"] * 5
    frames = codemap.relocate(sent, where)
    assert [(f[0], f[1], f[2]) for f in frames[1:]] == [
        (CELL, 13, "go"),
        (CELL, 9, "outer"),
        (CELL, 9, "<lambda>"),
        (CELL, 8, "inner"),
        (CELL, 4, "helper"),
    ]
    assert frames[0][0] == __file__ and frames[0][3]  # code not pickled keeps its file and line text
    assert all(f[3] is None for f in frames[1:])  # the line is looked up where the cell is known


def test_the_key_survives_cloudpickle_and_tells_apart_same_named_code():
    import cloudpickle

    namespace: dict = {}
    exec(compile(SOURCE, CELL, "exec"), namespace)
    rebuilt = cloudpickle.loads(cloudpickle.dumps(namespace["helper"]))
    assert codemap.code_key(rebuilt.__code__) == codemap.code_key(namespace["helper"].__code__)
    other: dict = {}
    exec(compile(SOURCE.replace("y - y", "y - y + 0"), "<cell-8>", "exec"), other)
    assert codemap.code_key(other["helper"].__code__) != codemap.code_key(namespace["helper"].__code__)
    # frames a rank sent without keys (an older kit's worker) are shown as they came
    assert codemap.relocate([("f.py", 1, "f", "x")], {}) == [("f.py", 1, "f", "x")]
