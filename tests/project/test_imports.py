"""Baton's packages import cleanly and their modules form no import cycle.

* Every module of ``trainer``, ``elastic``, ``sketch_ops`` and ``data_state`` imports in a
  fresh interpreter (so no module depends on another having been imported first, and no
  optional extra is needed at import time).
* The command modules import without the S3 stack (botocore, s3fs), an install for local
  runs only.
* The import graph among those modules, built with ``ast``, is acyclic. Imports inside
  functions count too: a deferred import hides a cycle from the interpreter, not from the
  reader (``sketch_ops/layer.py`` <-> ``policy.py`` and ``trainer/on_ray/demo.py`` <->
  ``fit_cli.py`` were such circles). Imports under ``if TYPE_CHECKING:`` do not count.
  Importing ``pkg.mod`` runs the package's ``__init__`` first; that implicit edge is not
  counted.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "elastic", "sketch_ops", "data_state")


def _modules() -> dict[str, Path]:
    """Module name -> file, for every module of the packages (``pkg`` for ``__init__``)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """Baton modules that ``module`` imports anywhere (outside TYPE_CHECKING) -> first line."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        while name and name not in modules:  # `from pkg.mod import func` -> pkg.mod
            name = name.rpartition(".")[0]
        if name and name != module:
            found.setdefault(name, line)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_one(stmt)
            else:
                visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                add(f"{base}.{alias.name}", node.lineno)  # a submodule, or a name in base
        else:
            visit(node)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def _import_graph() -> dict[str, dict[str, int]]:
    modules = _modules()
    return {m: _imports(m, path, modules) for m, path in modules.items()}


def _find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for succ in sorted(graph[node]):
            if state.get(succ) == 1:
                return path[path.index(succ):] + [succ]
            if succ not in state and (cycle := dfs(succ)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := dfs(start)) is not None:
            return cycle
    return None


def test_cycle_finder_sees_deferred_and_relative_imports(tmp_path) -> None:
    """The graph builder itself: a circle closed by an import inside a function (relative,
    as sketch_ops had it) is found; one under TYPE_CHECKING is not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n\ndef f():\n    from .c import h\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pkg.a import f\ng = 1\n")
    (pkg / "c.py").write_text("def h():\n    from pkg import a\n")
    modules = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py",
               "pkg.c": pkg / "c.py"}
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert graph["pkg.a"] == {"pkg.b": 1, "pkg.c": 4}
    assert graph["pkg.b"] == {}
    assert _find_cycle(graph) == ["pkg.a", "pkg.c", "pkg.a"]
    del graph["pkg.c"]["pkg.a"]
    assert _find_cycle(graph) is None


def test_no_import_cycle_among_baton_modules() -> None:
    graph = _import_graph()
    assert {"trainer.loop", "elastic.snapshotter", "sketch_ops.layer",
            "data_state.loader"} <= set(graph)
    cycle = _find_cycle(graph)
    if cycle is not None:
        steps = [f"{a} -> {b} (line {graph[a][b]})"
                 for a, b in zip(cycle, cycle[1:], strict=False)]
        raise AssertionError("import cycle: " + "; ".join(steps) + ". Move the shared piece "
                             "into the module it belongs to (or a small leaf module).")


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    names = sorted(_modules())
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n")
    done = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_command_line_needs_no_s3_stack() -> None:
    """A local-only install (no botocore/s3fs/boto3, as on the GPU machine of the GPU check)
    still runs every command module: the S3 stack is imported only where S3 is used."""
    code = ("import sys\n"
            "for name in ('botocore', 's3fs', 'boto3', 'aiobotocore'):\n"
            "    sys.modules[name] = None  # importing it now raises ImportError\n"
            "import trainer.cli, elastic.cli, data_state.cli, trainer.report\n"
            "from elastic.storage import storage_errors\n"
            "assert storage_errors() == (OSError,), storage_errors()\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
