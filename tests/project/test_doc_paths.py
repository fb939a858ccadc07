"""Docstrings, comments and the documents (README, docs/, benchmarks/reports/) name only files
that exist, and the documents link only to files and headings that exist.

A file named in prose (``elastic/format/records.py``, ``tests/sketch/test_sketch_fusions.py``,
``recipes/tiny.toml``) must be in the repository: a name with a directory resolves from the
repository root, the naming file's directory or its parent; a bare name (``policy.py``)
matches some file of the repository. Documents a page places outside the repository
(in backticks, under ``../shared/``) count as present by their bare name. Data files a run
writes (``run.json``, ``manifest.json``, benchmark results) are not checked: only source and
document types are. A Markdown link (``[text](target#anchor)``) that is not a URL must resolve
from the linking page's directory, and its anchor must be a heading of the target page (as
GitHub derives anchors from headings).
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("trainer", "elastic", "sketch_ops", "data_state", "tests", "benchmarks")
# A path-like word ending in a source or document type, not part of a longer word or URL.
PATH_RE = re.compile(
    r"(?<![\w./-])((?:\.\./)?(?:[\w.-]+/)*[\w-]+\.(?:py|md|toml|yaml|yml|sh|ini|cfg))(?![\w/]|\.\w)")
OUTSIDE_RE = re.compile(r"`\.\./[\w.-]+/([\w.-]+)`")  # a page naming a file of ../shared/
DOCUMENTS = ("README.md", "docs/*.md", "benchmarks/reports/*.md")
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


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


def documents() -> list[Path]:
    """The repository's Markdown pages that the checks cover."""
    return sorted(p for pattern in DOCUMENTS for p in ROOT.glob(pattern))


def _outside_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line, text) of a Markdown page outside its fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _outside_lines(page.read_text()):
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            base = anchor(match.group(1))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


def _broken_links(page: Path) -> Iterator[str]:
    for line, text in _outside_lines(page.read_text()):
        for target in LINK_RE.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file_part, _, fragment = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}:{line}: {target}"
            if not dest.exists() or ROOT not in dest.parents and dest != ROOT:
                yield f"{where} (no such file in the repository)"
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                yield f"{where} (no heading with that anchor)"


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
    module.write_text('"""See elastic/format/records.py and nowhere/gone.py."""\n'
                      'X = "not/prose.py"  # but this comment names gone2.py\n')
    found = [ref for _, text in _prose(module) for ref in PATH_RE.findall(text)]
    assert found == ["elastic/format/records.py", "nowhere/gone.py", "gone2.py"]
    assert PATH_RE.findall("https://x.io/a.py, a.py.bak, `../shared/DESIGN.md`") == [
        "../shared/DESIGN.md"]


def test_prose_names_only_files_that_exist() -> None:
    pages = documents()
    assert {"README.md", "design.md", "running.md"} <= {p.name for p in pages}
    names = _repo_files() | {n for p in pages for n in OUTSIDE_RE.findall(p.read_text())}
    files = pages + [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))]
    missing = [m for p in files for m in _missing(p, names)]
    assert not missing, "files named but not in the repository:\n" + "\n".join(missing)


def test_documents_link_only_to_files_and_headings_that_exist() -> None:
    broken = [b for page in documents() for b in _broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_anchor_follows_github() -> None:
    assert anchor("4. BASIS sketched linear layers (the maths)") == \
        "4-basis-sketched-linear-layers-the-maths"
    assert anchor('Which layers: `include = "auto"` and `baton sketch-plan`') == \
        "which-layers-include--auto-and-baton-sketch-plan"
    assert LINK_RE.findall("see [a](b.md#c) and [d](https://x.io)") == ["b.md#c", "https://x.io"]
