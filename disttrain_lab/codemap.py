"""Where the code a rank runs was written: notebook cells survive the trip to the ranks.

A launched function travels to its ranks by value (cloudpickle), and a code object rebuilt
there carries whatever file name the pickler chose to keep.  cloudpickle 3.1.3 writes
``"<dynamic-code>"`` for every one (so that payloads are deterministic), and a rank's
traceback would name no cell.  So the kit does not rely on it: while pickling, the parent
records each function's code object (and the code nested in it: lambdas, inner functions,
comprehensions) under a key computed from what every pickler must keep to rebuild the code
(its qualified name, first line and bytecode); a rank sends that key with each frame of its
traceback, and the parent puts the real file name (e.g. IPython's cell file) back.

    payload, where = dumps((fn, args, kwargs))    # in the parent
    frames = frames_of(exc.__traceback__)         # in the rank: (file, line, name, text, key)
    frames = relocate(frames, where)              # in the parent: (file, line, name, text)
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import traceback
import types

import cloudpickle

from . import pickling

__all__ = ["dumps", "code_key", "frames_of", "relocate", "is_internal", "is_library"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=4096)
def is_internal(filename: str) -> bool:
    """Code of the kit itself (or cloudpickle's, which carries functions to the ranks)."""
    return os.path.abspath(filename).startswith(_PACKAGE_DIR) or "cloudpickle" in filename


@functools.lru_cache(maxsize=4096)
def is_library(filename: str) -> bool:
    """Code of the kit, torch or an installed package: not the student's."""
    f = os.path.abspath(filename)
    return is_internal(f) or f"{os.sep}torch{os.sep}" in f or f"{os.sep}site-packages{os.sep}" in f


def code_key(code: types.CodeType) -> str:
    """A name for ``code`` that is the same before and after pickling, whichever pickler."""
    h = hashlib.blake2b(digest_size=12)
    for part in (getattr(code, "co_qualname", code.co_name), str(code.co_firstlineno)):
        h.update(part.encode("utf-8", "backslashreplace") + b"\0")
    h.update(code.co_code)
    return h.hexdigest()


def _record(code: types.CodeType, where: dict[str, str]) -> None:
    where[code_key(code)] = code.co_filename
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _record(const, where)


class _RecordingPickler(pickling.Pickler):
    """cloudpickle's pickler (``pickling``'s: float8 tensors too), noting the real file of every function it
    pickles by value (functions, lambdas, methods of classes defined in cells, helpers they call)."""

    def __init__(self, file, where: dict[str, str]):
        super().__init__(file, protocol=cloudpickle.DEFAULT_PROTOCOL)
        self._where = where

    def reducer_override(self, obj):
        if isinstance(obj, types.FunctionType):
            _record(obj.__code__, self._where)
        return super().reducer_override(obj)


def dumps(obj) -> tuple[bytes, dict[str, str]]:
    """``pickling.dumps(obj)``, and the real file of each code object it carries, by key."""
    where: dict[str, str] = {}
    with io.BytesIO() as file:
        _RecordingPickler(file, where).dump(obj)
        return file.getvalue(), where


def frames_of(tb) -> list[tuple]:
    """A traceback's frames as (file, line, function, source line, code key): plain data."""
    keys = [code_key(frame.f_code) for frame, _ in traceback.walk_tb(tb)]
    return [(f.filename, f.lineno, f.name, f.line, key) for f, key in zip(traceback.extract_tb(tb), keys)]


def relocate(frames: list, where: dict[str, str]) -> list[tuple]:
    """The frames a rank sent, each with the file its code was really written in (the source
    line is then looked up again where that file is known: the parent's cells)."""
    out = []
    for frame in frames:
        filename, lineno, name, text = frame[:4]
        real = where.get(frame[4]) if len(frame) > 4 else None
        if real is not None and real != filename:
            filename, text = real, None
        out.append((filename, lineno, name, text))
    return out
