"""The benchmarks stay scripts one reads in a sitting (benchmarks/common.py holds what they share).

- Every module of `benchmarks/` is at most 300 lines, has a docstring, and no function over 80
  lines.
- No benchmark starts itself again through hidden flags (`sys.argv[0]`, `__file__` handed to a
  subprocess, `argparse.SUPPRESS`), edits `sys.path`, or loads another file by path: worker
  processes are named modules (`python -m benchmarks.<name>_worker`), started through
  `common.start_worker` / `run_worker`, and each one named exists and has a `worker_main`.
- A benchmark imports from `benchmarks` only its own modules (`sketch_quality_*` for
  `sketch_quality`) and the shared `common` / `common_training`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MODULES = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "__init__.py")
SHARED = {"common", "common_training"}
MAX_LINES, MAX_FUNCTION_LINES = 300, 80


def _family(name: str) -> str:
    """The benchmark a module belongs to: the shortest module name it is or extends with `_`."""
    names = [p.stem for p in MODULES]
    return min((n for n in names if name == n or name.startswith(n + "_")), key=len)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_each_module_reads_in_one_sitting(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name}: {lines} lines (at most {MAX_LINES}): split it"
    tree = _tree(path)
    assert ast.get_docstring(tree), f"{path.name}: no module docstring"
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, f"{path.name}: {node.name} is {length} lines"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_module_calls_itself_through_hidden_flags(path: Path) -> None:
    source = path.read_text()
    for pattern, why in ((r"sys\.argv\[0\]", "re-runs itself"),
                         (r"argparse\.SUPPRESS", "has hidden flags"),
                         (r"sys\.path\.(insert|append)", "edits sys.path"),
                         (r"spec_from_file_location", "loads a file by path")):
        assert not re.search(pattern, source), f"{path.name} {why}: use a named module"
    for node in ast.walk(_tree(path)):
        # `__file__` only to find the repository, never in a command line.
        if isinstance(node, ast.List | ast.Tuple):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            assert "__file__" not in names, f"{path.name} passes __file__ to a command"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_benchmarks_import_only_their_own_modules_and_the_shared_ones(path: Path) -> None:
    family = _family(path.stem)
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
            targets = [(node.module or "").split(".")[1]]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".")[1] for a in node.names
                       if a.name.startswith("benchmarks.")]
        else:
            continue
        for target in targets:
            assert target in SHARED or _family(target) == family, (
                f"{path.name} imports benchmarks.{target}: shared pieces go to common.py")


def test_every_worker_started_is_a_named_module_with_an_entry_point() -> None:
    started = set()
    for path in MODULES:
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("start_worker", "run_worker") and node.args
                    and isinstance(node.args[0], ast.Constant)):
                started.add(str(node.args[0].value))
    assert {"sketch_memory_worker", "sketch_quality_worker", "snapshot_scale_worker",
            "recovery_worker", "data_prepare_worker", "sketch_llama_worker"} <= started
    for name in started:
        worker = BENCHMARKS / f"{name}.py"
        assert worker.exists(), f"no benchmarks/{name}.py"
        assert "worker_main(" in worker.read_text(), f"{name} has no worker_main entry point"
