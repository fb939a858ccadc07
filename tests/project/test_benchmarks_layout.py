"""The benchmarks stay scripts one reads in a sitting, one package per family.

- `benchmarks/` holds at its top level only what the families share (`common.py`,
  `common_training.py`); every benchmark lives in a family package
  (`benchmarks/<family>/`: its script, the sides it compares, its worker), one level deep, whose
  `__init__` docstring says what the family measures and how to run it
  (`python -m benchmarks.<family>.<script>`). Each family imports.
- Every module of `benchmarks/` is at most 300 lines, has a docstring, and no function over 80
  lines.
- No benchmark starts itself again through hidden flags (`sys.argv[0]`, `__file__` handed to a
  subprocess, `argparse.SUPPRESS`), edits `sys.path`, or loads another file by path: worker
  processes are named modules (`python -m benchmarks.<family>.worker`), started through
  `common.start_worker` / `run_worker`, and each one named exists in the starting family and
  has a `worker_main`.
- A benchmark imports from `benchmarks` only its own family's modules and the shared `common` /
  `common_training`.
- Every script builds its command line through `common.arg_parser`, so `--help` names the command
  that runs it (`usage: python -m benchmarks.<family>.<script>`), not its file.
- Every `python -m benchmarks.…` command the README, docs/, the reports, the tests, the
  benchmarks and `benchmarks/gpu_check.sh` show names a module that exists and runs as a
  script (it has a `__main__` guard), and every family's script is shown somewhere.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SHARED = {"common", "common_training"}
MAX_LINES, MAX_FUNCTION_LINES = 300, 80
# `python -m benchmarks.x.y` in prose and shell, `"-m", "benchmarks.x.y"` in an argument list.
COMMAND_RE = re.compile(r"""-m["',\s]+benchmarks\.([\w.]*\w)""")
SHOWN_IN = ("README.md", "docs/*.md", "benchmarks/reports/*.md", "benchmarks/**/*.py",
            "benchmarks/gpu_check.sh", "tests/**/*.py", "Makefile")
THIS_FILE = Path(__file__).resolve()  # its commands are made-up examples for the checker


def _pages(root: Path, patterns: tuple[str, ...]) -> Iterator[Path]:
    for pattern in patterns:
        for page in sorted(root.glob(pattern)):
            if page.is_file() and "__pycache__" not in page.parts and page.resolve() != THIS_FILE:
                yield page


def families(root: Path = BENCHMARKS) -> list[str]:
    return sorted(p.parent.name for p in root.glob("*/__init__.py"))


def modules(root: Path = BENCHMARKS) -> list[Path]:
    return sorted(root.rglob("*.py"))


MODULES = modules()


def layout_problems(root: Path) -> Iterator[str]:
    """What breaks the layout under `root`: a script at the top level that is not shared, a
    folder of scripts that is not a family package, a package nested in a family."""
    for path in sorted(root.glob("*.py")):
        if path.stem not in SHARED | {"__init__"}:
            yield f"benchmarks/{path.name}: a benchmark at the top level; put it in its family"
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        scripts = [p for p in folder.rglob("*.py") if "__pycache__" not in p.parts]
        if scripts and not (folder / "__init__.py").exists():
            yield f"benchmarks/{folder.name}/: scripts but no __init__.py"
        for script in scripts:
            if script.parent != folder:
                yield f"{script.relative_to(root.parent)}: families are one level deep"


def command_problems(root: Path, patterns: tuple[str, ...] = SHOWN_IN) -> Iterator[str]:
    """Every `python -m benchmarks.<module>` shown under `root` whose module does not exist
    there or has no `__main__` guard."""
    for page in _pages(root, patterns):
        for match in COMMAND_RE.finditer(page.read_text()):
            name = match.group(1)
            target = root / "benchmarks" / (name.replace(".", "/") + ".py")
            if not target.exists():
                yield f"{page.relative_to(root)}: python -m benchmarks.{name}: no such module"
            elif "__name__ == \"__main__\"" not in target.read_text():
                yield f"{page.relative_to(root)}: benchmarks.{name} does not run as a script"


def shown_commands(root: Path = ROOT) -> set[str]:
    return {m.group(1) for page in _pages(root, SHOWN_IN)
            for m in COMMAND_RE.finditer(page.read_text())}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _family(path: Path) -> str | None:
    """The family a module belongs to; None for the shared modules at the top level."""
    return path.parent.name if path.parent != BENCHMARKS else None


def _id(path: Path) -> str:
    return str(path.relative_to(BENCHMARKS))


def test_the_top_level_holds_only_the_shared_modules_and_families() -> None:
    assert len(families()) >= 10, families()
    assert {"snapshot_scale", "snapshot_stall", "sketch_quality", "sketch_llama", "sketch_memory",
            "recovery", "data_prepare", "gpu_scale"} <= set(families())
    problems = list(layout_problems(BENCHMARKS))
    assert not problems, "\n".join(problems)


def test_the_layout_check_finds_what_breaks_it(tmp_path: Path) -> None:
    root = tmp_path / "benchmarks"
    (root / "fam" / "deeper").mkdir(parents=True)
    (root / "loose").mkdir()
    for name in ("__init__.py", "common.py", "fam/__init__.py", "fam/run.py",
                 "flat_bench.py", "loose/run.py", "fam/deeper/x.py"):
        (root / name).write_text('"""x"""\n')
    assert list(layout_problems(root)) == [
        "benchmarks/flat_bench.py: a benchmark at the top level; put it in its family",
        "benchmarks/fam/deeper/x.py: families are one level deep",
        "benchmarks/loose/: scripts but no __init__.py"]


@pytest.mark.parametrize("family", families())
def test_each_family_imports_and_says_how_to_run_it(family: str) -> None:
    package = importlib.import_module(f"benchmarks.{family}")
    doc = package.__doc__ or ""
    shown = re.findall(rf"python -m benchmarks\.{family}\.(\w+)", doc)
    assert shown, f"benchmarks/{family}/__init__.py: its docstring shows no command"
    for script in shown:
        assert (BENCHMARKS / family / f"{script}.py").exists(), f"{family}: no {script}.py"


@pytest.mark.parametrize("path", MODULES, ids=_id)
def test_each_module_reads_in_one_sitting(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{_id(path)}: {lines} lines (at most {MAX_LINES}): split it"
    tree = _tree(path)
    assert ast.get_docstring(tree), f"{_id(path)}: no module docstring"
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, f"{_id(path)}: {node.name} is {length} lines"


@pytest.mark.parametrize("path", MODULES, ids=_id)
def test_no_module_calls_itself_through_hidden_flags(path: Path) -> None:
    source = path.read_text()
    for pattern, why in ((r"sys\.argv\[0\]", "re-runs itself"),
                         (r"argparse\.SUPPRESS", "has hidden flags"),
                         (r"sys\.path\.(insert|append)", "edits sys.path"),
                         (r"spec_from_file_location", "loads a file by path")):
        assert not re.search(pattern, source), f"{_id(path)} {why}: use a named module"
    for node in ast.walk(_tree(path)):
        # `__file__` only to find the repository, never in a command line.
        if isinstance(node, ast.List | ast.Tuple):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            assert "__file__" not in names, f"{_id(path)} passes __file__ to a command"


def _imported_families(tree: ast.Module) -> Iterator[str]:
    """The family (or shared module) each `benchmarks` import of a module names."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            yield "<relative>"
        elif isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
            yield (node.module or "").split(".")[1]
        elif isinstance(node, ast.Import):
            yield from (a.name.split(".")[1] for a in node.names
                        if a.name.startswith("benchmarks."))


@pytest.mark.parametrize("path", MODULES, ids=_id)
def test_benchmarks_import_only_their_own_family_and_the_shared_modules(path: Path) -> None:
    for target in _imported_families(_tree(path)):
        assert target in SHARED or target == _family(path), (
            f"{_id(path)} imports benchmarks.{target}: shared pieces go to common.py "
            "(imports are absolute: benchmarks.<family>.<module>)")


def test_every_script_builds_its_command_line_through_common() -> None:
    direct = [_id(path) for path in MODULES
              if path.name != "common.py" and "ArgumentParser(" in path.read_text()]
    assert not direct, f"use common.arg_parser(__doc__, __spec__) in: {direct}"


@pytest.mark.parametrize("script", ["recovery.run", "data_prepare.run"])
def test_a_script_s_usage_names_its_command(script: str) -> None:
    shown = subprocess.run([sys.executable, "-m", f"benchmarks.{script}", "--help"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, check=True).stdout
    assert shown.startswith(f"usage: python -m benchmarks.{script} ["), shown
    doc = ast.get_docstring(_tree(BENCHMARKS / (script.replace(".", "/") + ".py"))) or ""
    assert shown.split("\n\n")[1].split()[:4] == doc.split()[:4], shown  # its description


def test_every_worker_started_is_a_module_of_its_family_with_an_entry_point() -> None:
    started: set[tuple[str, str | None]] = set()
    for path in MODULES:
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("start_worker", "run_worker") and node.args
                    and isinstance(node.args[0], ast.Constant)):
                started.add((str(node.args[0].value), _family(path)))
    assert {"sketch_memory.worker", "sketch_quality.worker", "snapshot_scale.worker",
            "recovery.worker", "recovery.survivors_worker", "data_prepare.worker",
            "sketch_llama.worker"} <= {name for name, _ in started}
    for name, family in started:
        assert name.split(".")[0] == family, f"benchmarks/{family} starts another's {name}"
        worker = BENCHMARKS / (name.replace(".", "/") + ".py")
        assert worker.exists(), f"no benchmarks/{name.replace('.', '/')}.py"
        assert "worker_main(" in worker.read_text(), f"{name} has no worker_main entry point"


def test_every_command_shown_names_a_module_that_runs() -> None:
    problems = list(command_problems(ROOT))
    assert not problems, "\n".join(problems)
    shown = shown_commands()
    assert {"snapshot_scale.run", "sketch_memory.run", "gpu_scale.run"} <= shown
    unshown = [f for f in families() if not any(c.startswith(f + ".") for c in shown)]
    assert not unshown, f"families whose script no page or test shows: {unshown}"


def test_the_command_check_finds_a_stale_module(tmp_path: Path) -> None:
    (tmp_path / "benchmarks" / "fam").mkdir(parents=True)
    (tmp_path / "benchmarks" / "fam" / "run.py").write_text('if __name__ == "__main__":\n    1\n')
    (tmp_path / "benchmarks" / "fam" / "sides.py").write_text('"""no guard"""\n')
    (tmp_path / "README.md").write_text(
        "`python -m benchmarks.fam.run --quick`, `python -m\nbenchmarks.fam_old`.\n"
        "`python -m benchmarks.fam.sides`\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text('run([sys.executable, "-m", "benchmarks.gone"])\n')
    assert list(command_problems(tmp_path)) == [
        "README.md: python -m benchmarks.fam_old: no such module",
        "README.md: benchmarks.fam.sides does not run as a script",
        "tests/t.py: python -m benchmarks.gone: no such module"]
