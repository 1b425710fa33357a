"""The timing machinery every benchmark shares: turns, medians, the lab's own functions, ports,
the command line's common options and the progress bar of a sweep; and the pieces of their
printed tables (the width of the version column, a ratio cell, an MLP's parameter count)."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
from tqdm.auto import tqdm


def slowest_median(per_rank: list[list[float]]) -> float:
    """Median over repeats of the slowest rank's seconds: a step of several ranks ends
    when its last rank does.  ``per_rank[r][i]`` is rank r's time in repeat i."""
    return statistics.median(max(times) for times in zip(*per_rank))


def free_port() -> int:
    """A port the OS says is free now (port 0), for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def functions_from_notebook(path, names, given: bool = False) -> dict:
    """The functions ``names`` as a lab notebook defines them: runs its setup cell and every
    code cell made only of imports, ``def``s, ``class``es and constant assignments (solution
    cells, given helpers), never test cells (graded or read-only), benchmarks or plots.  Names the notebook does
    not define are left out of the result.  ``given=True`` also runs read-only definitions the
    lab gives (locked cells whose grade id does not name a test, e.g. Lab 8's ``Plan``)."""
    import nbformat  # not a dependency of the kit (Jupyter brings it): only reading a notebook needs it

    nb = nbformat.read(str(path), as_version=4)
    namespace = {"__name__": "__lab_notebook__"}  # not importable: cloudpickle sends the functions by value

    def definitions_only(source: str) -> bool:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return False
        allowed = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)
        return bool(tree.body) and all(
            isinstance(node, allowed)
            or (
                isinstance(node, (ast.Assign, ast.AnnAssign))
                and node.value is not None
                and isinstance(node.value, (ast.Constant, ast.Dict, ast.Tuple, ast.List))
            )
            for node in tree.body
        )

    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        setup = meta.get("grade_id") == "setup"
        given_definition = given and "test" not in meta.get("grade_id", "test")
        if cell.cell_type != "code" or meta.get("grade") or (meta.get("locked") and not (setup or given_definition)):
            continue  # graded tests and read-only test helpers
        if setup or definitions_only(cell.source):
            with contextlib.redirect_stdout(io.StringIO()):  # the setup cell's doctor line
                exec(
                    compile(cell.source, f"{path}:{meta.get('grade_id', 'cell')}", "exec", dont_inherit=True), namespace
                )  # not this module's __future__ imports
    return {name: namespace[name] for name in names if callable(namespace.get(name))}


_NOT_COMMUNICATION = ("wait", "wrap", "recv")  # c10d ops that move no data here (waits, wrappers, receives)


def collective_bytes_counter():
    """A dispatch mode adding up the bytes of every c10d collective called under it.

    torch's tensor parallelism calls the functional collectives (``_c10d_functional``), which
    the kit's trace does not see; this counts both kinds the same way, at the dispatcher (point-to-point
    sends too: ``c10d.send``).  ``with counter: ...``, then ``counter.bytes``, ``counter.calls``.
    """
    from torch.utils._python_dispatch import TorchDispatchMode  # torch's private module: only this counter needs it

    class CollectiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes, self.calls = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional") and not any(
                word in func.__name__ for word in _NOT_COMMUNICATION
            ):
                tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                self.bytes += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
                self.calls += 1
            return func(*args, **(kwargs or {}))

    return CollectiveBytes()


def take_turns(runners: dict, repeats: int, warmup: int) -> dict:
    """In each rank: seconds of each ``runners[name]()`` call, the names taking turns (the order
    rotated every round, so none always goes first), a barrier before each; ``warmup`` rounds
    are left out.  Returns name -> list of ``repeats`` seconds.  Call it on all ranks."""
    names, seconds = list(runners), {}
    for i in range(warmup + repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            runners[name]()
            if i >= warmup:
                seconds.setdefault(name, []).append(time.perf_counter() - start)
    return seconds


def progress(iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it"):
    """A progress bar over a benchmark sweep, on stderr: ``tqdm.auto``, so a notebook shows a
    widget and a terminal a text bar.  ``DISTTRAIN_LAB_PROGRESS=0`` turns it off."""
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        leave=False,
        file=sys.stderr,
        disable=os.environ.get("DISTTRAIN_LAB_PROGRESS", "1") == "0",
    )


# --------------------------------------------------------------------------------------
# The command line: each benchmark module has NAME, HELP, add_arguments(parser), run(args)
# --------------------------------------------------------------------------------------
def add_notebook_argument(parser, lab: str) -> None:
    """``--notebook``: the lab notebook whose functions a benchmark measures."""
    parser.add_argument(
        "--notebook",
        help=f"the lab notebook whose functions to measure (default: "
        f"{os.path.join('solutions', lab)}, else the same under labs/)",
    )


def functions_from_lab(args, lab: str, names, what: str, given: bool = False) -> dict | None:
    """``names`` as the lab notebook (``--notebook``, else solutions/``lab``, else labs/``lab``) defines them
    (``given``: also its read-only definitions, see :func:`functions_from_notebook`); ``None`` (having said
    why on stderr) if there is no notebook."""
    path = args.notebook or next(
        (p for p in (os.path.join("solutions", lab), os.path.join("labs", lab)) if os.path.exists(p)), None
    )
    if path is None or not os.path.exists(path):
        print(
            f"no notebook to take the {what} from: pass --notebook PATH (looked for "
            f"{path or 'solutions/' + lab + ' and labs/' + lab})",
            file=sys.stderr,
        )
        return None
    functions = functions_from_notebook(path, names, given=given)
    missing = [name for name in names if name not in functions]
    print(f"{what} from {path}" + (f" (not defined there: {', '.join(missing)})" if missing else ""))
    return functions


def mlp_parameters(sizes) -> int:
    """Weights and biases of an MLP whose layers have these widths (``sizes[0]`` inputs)."""
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))


def version_width(rows: list[dict], least: int) -> int:
    """The width of a table's version column: its longest version, at least ``least``, plus 2."""
    return max(least, *(len(r["version"]) for r in rows)) + 2


def ratio_cell(row: dict, width: int) -> str:
    """``row["ratio"]`` as "1.23x" right-aligned in ``width`` characters, "-" where there is none."""
    return f"{row['ratio']:>{width - 1}.2f}x" if "ratio" in row else f"{'-':>{width}}"
