"""The package's two halves and how they may import each other (STYLE.md, principle 13).

The student kit is the top of ``disttrain_lab`` (and ``bench/``); the grading wing is
``disttrain_lab/grading/``; ``cli.py`` is the top floor that dispatches to both.  Read from
the source with ``ast`` (every import, at module level or inside a function, relative ones
resolved): no import circle anywhere in the package; nothing outside the grading wing but
``cli.py`` imports it; no module takes an underscored name from another module.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

PACKAGE = REPO / "disttrain_lab"
GRADING = "disttrain_lab.grading"
TOP_FLOOR = "disttrain_lab.cli"

# Known exceptions, to be emptied as the modules named are reworked (each is (module, what)).
KNOWN_PRIVATE_USES: set[tuple[str, str]] = set()
KNOWN_CIRCLE_EDGES: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _imports(name: str, source: str, is_package: bool, modules) -> tuple[set[str], set[str]]:
    """(the ``modules`` that module ``name`` imports, the underscored names it takes from the others)."""
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    targets, private, bound = set(), set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    targets.add(alias.name)
                    bound[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            if origin not in modules:
                continue
            for alias in node.names:
                if f"{origin}.{alias.name}" in modules:  # a module: from . import trace
                    targets.add(f"{origin}.{alias.name}")
                    bound[alias.asname or alias.name] = f"{origin}.{alias.name}"
                else:  # a name: from .trace import Run
                    targets.add(origin)
                    if _is_private(alias.name):
                        private.add(f"{origin}.{alias.name}")

    def module_of(node) -> str | None:
        if isinstance(node, ast.Name):
            return bound.get(node.id)
        if isinstance(node, ast.Attribute):
            parent = module_of(node.value)
            return f"{parent}.{node.attr}" if parent and f"{parent}.{node.attr}" in modules else None
        return None

    for node in ast.walk(tree):  # trace._REC, dl.trace._REC: an underscored name of a module
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = module_of(node.value)
            if owner is not None and owner != name:
                private.add(f"{owner}.{node.attr}")
    targets.discard(name)
    return targets, private


GRAPH, PRIVATE = {}, {}
for _name, _path in MODULES.items():
    GRAPH[_name], PRIVATE[_name] = _imports(_name, _path.read_text(), _path.name == "__init__.py", MODULES)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_every_kind_of_import():
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c", "pkg.sub.d"}
    source = (
        "import os\n"
        "from . import d\n"  # a sibling module
        "from ..a import thing, _hidden, __version__\n"  # names of a module (one underscored)
        "import pkg.b\n"
        "def f():\n"
        "    from pkg import a as alias\n"  # absolute, in a function
        "    import pkg.sub.d as dee\n"
        "    return alias._secret, pkg.b._other, dee._own, d.public\n"
    )
    targets, private = _imports("pkg.sub.c", source, False, modules)
    assert targets == {"pkg.a", "pkg.b", "pkg.sub.d"}
    assert private == {"pkg.a._hidden", "pkg.a._secret", "pkg.b._other", "pkg.sub.d._own"}
    assert _imports("pkg.sub", "from . import c\nfrom .. import b\n", True, modules)[0] == {"pkg.sub.c", "pkg.b"}
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    # and in the package: the CLI's dispatch (in a function) reaches the grading wing
    assert {"disttrain_lab.grading.course", "disttrain_lab.grading.classgrade"} <= GRAPH[TOP_FLOOR]
    assert {m for m in MODULES if m.startswith(GRADING + ".")} >= {
        f"{GRADING}.{m}"
        for m in (
            "classgrade",
            "cell_times",
            "cells",
            "config",
            "course",
            "execute",
            "grader_kernel",
            "install_source",
            "kernels",
            "run_sandbox",
            "sandbox",
            "steps",
            "submission",
        )
    }


def test_no_import_circle_anywhere_in_the_package():
    graph = {m: {t for t in targets if (m, t) not in KNOWN_CIRCLE_EDGES} for m, targets in GRAPH.items()}
    assert _circles(graph) == [], "modules that import each other, directly or around a circle"
    for edge in KNOWN_CIRCLE_EDGES:  # an exception that no longer exists is taken off the list
        assert edge[1] in GRAPH[edge[0]], f"{edge} is no longer imported: remove it from KNOWN_CIRCLE_EDGES"


def test_the_student_kit_never_imports_the_grading_wing():
    wrong = {
        m: sorted(t for t in targets if t == GRADING or t.startswith(GRADING + "."))
        for m, targets in GRAPH.items()
        if not (m == GRADING or m.startswith(GRADING + ".")) and m != TOP_FLOOR
    }
    assert {m: t for m, t in wrong.items() if t} == {}, "grading may use the kit, never the reverse"


def _unit(module: str) -> str:
    """Where a name's privacy ends: its module, but a lab's checks grown into a package
    (``disttrain_lab.labtests.lab08``: a module a section, one lab's tests) are one unit."""
    parts = module.split(".")
    if parts[:2] == ["disttrain_lab", "labtests"] and len(parts) > 3:
        return ".".join(parts[:3])
    return module


def test_no_module_takes_an_underscored_name_from_another():
    used = {(m, name) for m, names in PRIVATE.items() for name in names if _unit(m) != _unit(name.rpartition(".")[0])}
    assert sorted(used - KNOWN_PRIVATE_USES) == [], "use a public name (or make one) instead"
    assert sorted(KNOWN_PRIVATE_USES - used) == [], "fixed: take it off KNOWN_PRIVATE_USES"


@pytest.mark.slow  # over 3 s: the full suite runs it, the fast tier does not
def test_importing_the_kit_loads_nothing_of_the_grading_wing():
    # what a student's kernel does; the grading wing needs the instructor's tools (nbgrader)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, disttrain_lab, disttrain_lab.bench; "
            "print(sorted(m for m in sys.modules if m.startswith('disttrain_lab.grading') "
            "or m.split('.')[0] in ('nbgrader', 'rich')))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_sandbox_runs_as_a_file_without_the_package():
    # the grader starts it with `python -I FILE` (no package on the path): it imports nothing of the
    # package, and nor do the siblings it loads by their paths (run_sandbox._sibling); container
    # mode's wrapper likewise (run_container._sibling)
    siblings = {
        "run_sandbox": {"cgroups", "syscall_filter", "kernel_env", "run_bwrap"},
        "run_bwrap": {"syscall_filter", "kernel_env", "trees"},  # (through run_sandbox's loader, handed to it)
        "run_container": {"syscall_filter", "kernel_env", "trees"},
    }
    for program, expected in siblings.items():
        text = (PACKAGE / "grading" / f"{program}.py").read_text()
        by_path = re.findall(r'(?:_sibling|host\.sibling)\("(\w+)"\)', text)
        assert set(by_path) == expected, program
        for module in (program, *by_path):
            assert GRAPH[f"disttrain_lab.grading.{module}"] == set(), module
    # the grader's side: the program, its two siblings, and the reaper of the grader's own processes
    grading = {
        f"disttrain_lab.grading.{m}"
        for m in ("run_sandbox", "run_bwrap", "kernel_env", "cgroups", "syscall_filter", "reaper")
    }
    assert GRAPH["disttrain_lab.grading.sandbox"] == grading


def test_ruff_finds_nothing_to_lint_or_format():
    # pyproject.toml's [tool.ruff]: the whole tree, the kit, the tests and the scripts
    ruff = Path(sys.executable).parent / "ruff"
    root = PACKAGE.parent
    for command in (["check", "--no-cache", "."], ["format", "--check", "--no-cache", "."]):
        out = subprocess.run([str(ruff), *command], cwd=root, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"ruff {' '.join(command)}:\n{out.stdout}{out.stderr}"
