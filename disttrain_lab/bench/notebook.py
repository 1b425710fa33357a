"""A lab's own functions, read from its notebook: the benchmarks measure the implementations a lab
notebook defines (this package holds no solutions).  functions_from_notebook runs the notebook's
definition cells only; functions_from_lab finds the notebook (``--notebook``, add_notebook_argument;
else solutions/, else labs/)."""

from __future__ import annotations

import ast
import contextlib
import io
import os

from .command import NotMeasured


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


def add_notebook_argument(parser, lab: str) -> None:
    """``--notebook``: the lab notebook whose functions a benchmark measures."""
    parser.add_argument(
        "--notebook",
        help=f"the lab notebook whose functions to measure (default: "
        f"{os.path.join('solutions', lab)}, else the same under labs/)",
    )


def functions_from_lab(args, lab: str, names, what: str, given: bool = False) -> dict:
    """``names`` as the lab notebook (``--notebook``, else solutions/``lab``, else labs/``lab``) defines them
    (``given``: also its read-only definitions, see :func:`functions_from_notebook`); :class:`NotMeasured`
    (saying why) if there is no notebook."""
    path = args.notebook or next(
        (p for p in (os.path.join("solutions", lab), os.path.join("labs", lab)) if os.path.exists(p)), None
    )
    if path is None or not os.path.exists(path):
        raise NotMeasured(
            f"no notebook to take the {what} from: pass --notebook PATH (looked for "
            f"{path or 'solutions/' + lab + ' and labs/' + lab})"
        )
    functions = functions_from_notebook(path, names, given=given)
    missing = [name for name in names if name not in functions]
    print(f"{what} from {path}" + (f" (not defined there: {', '.join(missing)})" if missing else ""))
    return functions
