"""Docstrings, comments and the README name only files that exist.

A file named in prose (``elastic/format.py``, ``tests/test_sketch_fusions.py``,
``recipes/tiny.toml``) must be in the repository: a name with a directory resolves from the
repository root, the naming file's directory or its parent; a bare name (``policy.py``)
matches some file of the repository. Documents the README places outside the repository
(``../shared/DESIGN.md``) count as present by their bare name. Data files a run writes
(``run.json``, ``manifest.json``, benchmark results) are not checked: only source and
document types are.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("trainer", "elastic", "sketch_ops", "data_state", "tests", "benchmarks")
# A path-like word ending in a source or document type, not part of a longer word or URL.
PATH_RE = re.compile(
    r"(?<![\w./-])((?:\.\./)?(?:[\w.-]+/)*[\w-]+\.(?:py|md|toml|yaml|yml|sh|ini|cfg))(?![\w/]|\.\w)")
OUTSIDE_RE = re.compile(r"`\.\./[\w.-]+/([\w.-]+)`")  # README: `../shared/DESIGN.md`


def _repo_files() -> set[str]:
    """Base names of the repository's files (hidden, cache and build folders pruned)."""
    names: set[str] = set()
    for _folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".")
                         and d not in ("__pycache__", "build", "dist")
                         and not d.endswith(".egg-info")]
        names.update(files)
    return names


def _prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every docstring and comment of a Python file; every line of a .md."""
    source = path.read_text()
    if path.suffix == ".md":
        yield from enumerate(source.splitlines(), 1)
        return
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def _missing(path: Path, names: set[str]) -> Iterator[str]:
    for line, text in _prose(path):
        for match in PATH_RE.finditer(text):
            ref = match.group(1)
            if "/" not in ref or ref.startswith("../"):  # outside: declared by the README
                found = ref.rsplit("/", 1)[-1] in names
            else:
                found = any((base / ref).exists()
                            for base in (ROOT, path.parent, path.parent.parent))
            if not found:
                yield f"{path.relative_to(ROOT)}:{line}: {ref}"


def test_path_finder_reads_prose_only(tmp_path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""See elastic/format.py and nowhere/gone.py."""\n'
                      'X = "not/prose.py"  # but this comment names gone2.py\n')
    found = [ref for _, text in _prose(module) for ref in PATH_RE.findall(text)]
    assert found == ["elastic/format.py", "nowhere/gone.py", "gone2.py"]
    assert PATH_RE.findall("https://x.io/a.py, a.py.bak, `../shared/DESIGN.md`") == [
        "../shared/DESIGN.md"]


def test_prose_names_only_files_that_exist() -> None:
    readme = ROOT / "README.md"
    names = _repo_files() | set(OUTSIDE_RE.findall(readme.read_text()))
    files = [readme] + [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))]
    missing = [m for p in files for m in _missing(p, names)]
    assert not missing, "files named but not in the repository:\n" + "\n".join(missing)
