"""The recipe field reference (`docs/recipes.md`), generated from the config dataclasses.

Usage: `python -m trainer.config.recipe_doc > docs/recipes.md`.

Contract: the page is a pure function of the code. Every field of `FitConfig` and of each of
its sections (`ModelConfig`, `DataConfig`, ...) is one table row: its name, its annotation,
its default as TOML writes it, and its documentation, which is the field's own comment in
the dataclass (the comment lines right above the field, then a trailing `# ...` on its line).
A section's introduction is its class docstring. `tests/project/test_recipe_doc.py` fails when the
committed page differs from `render()` or when a field has no comment, so the reference
cannot drift from the code it describes.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import FitConfig

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "python -m trainer.config.recipe_doc > docs/recipes.md"


@dataclass(frozen=True)
class FieldDoc:
    """One row of the reference."""

    name: str
    annotation: str
    default: str
    doc: str


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line."""
    found: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = tok.string.lstrip("#").strip()
    return found


def _default(cls: type, name: str, node: ast.AnnAssign, source: str) -> str:
    """The field's default as a recipe writes it (TOML), from its source text."""
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    if field.default_factory is not dataclasses.MISSING:
        return _toml(field.default_factory())
    text = ast.get_source_segment(source, node.value) if node.value is not None else None
    if text is None or text.startswith("field("):
        return _toml(field.default)
    return {"True": "true", "False": "false", "None": "-"}.get(text, text).replace("'", '"')


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "-" if value is None else repr(value)


def field_docs(cls: type) -> list[FieldDoc]:
    """The documented fields of a config dataclass, in declaration order."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = _comments(source)
    lines = source.splitlines()
    (class_node,) = ast.parse(source).body
    assert isinstance(class_node, ast.ClassDef)
    rows = []
    for node in class_node.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        trailing = [comments[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                    if n in comments and not lines[n - 1].strip().startswith("#")]
        rows.append(FieldDoc(node.target.id, ast.unparse(node.annotation),
                             _default(cls, node.target.id, node, source),
                             " ".join(above + trailing)))
    return rows


def _cell(text: str) -> str:
    """`text` inside a table cell: pipes escaped, and angle brackets outside code spans (a
    `RUN/<dir>` would read as an HTML tag)."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _table(rows: list[FieldDoc], prefix: str) -> list[str]:
    out = ["| field | type | default | meaning |", "|---|---|---|---|"]
    out += [f"| `{prefix}{r.name}` | `{_cell(r.annotation)}` | `{_cell(r.default)}` | "
            f"{_cell(r.doc)} |" for r in rows]
    return out


def _intro(cls: type) -> str:
    return " ".join((inspect.getdoc(cls) or "").split())


def _source_path(cls: type) -> str:
    return Path(inspect.getsourcefile(cls) or "").resolve().relative_to(ROOT).as_posix()


def sections() -> list[tuple[str, type]]:
    """(the recipe's section name, its dataclass), in `FitConfig`'s order."""
    found = []
    for f in dataclasses.fields(FitConfig):
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(value):
            found.append((f.name, type(value)))
    return found


def render() -> str:
    """The whole page."""
    section_names = {name for name, _ in sections()}
    top = [r for r in field_docs(FitConfig) if r.name not in section_names]
    python_only = [r for r in top if "Callable" in r.annotation]
    top = [r for r in top if r not in python_only]
    files = sorted({_source_path(FitConfig)} | {_source_path(cls) for _, cls in sections()})
    out = [
        "# Recipe reference",
        "",
        f"<!-- Generated by `{COMMAND}` from the config dataclasses' field comments. -->",
        "<!-- Do not edit by hand: tests/project/test_recipe_doc.py fails when this page is stale."
        " -->",
        "",
        "A recipe is a TOML file: top-level keys, then one table per section. `baton fit "
        "RECIPE --set section.field=value` overrides a field (the value is parsed as TOML, "
        "else taken as a string); `trainer.load_recipe(path, overrides)` does the same from "
        "Python. An unknown section or key, a value of the wrong type or out of range stops "
        "the command before Ray starts with one line naming the dotted field "
        "([running.md](running.md#recipes-and-bad-input)). This page is generated from the "
        "fields' own comments in " + ", ".join(f"`{f}`" for f in files) + ".",
        "",
        "## Top level",
        "",
        _intro(FitConfig),
        "",
        *_table(top, ""),
    ]
    for name, cls in sections():
        out += ["", f"## `[{name}]`", "", f"`{cls.__name__}`: {_intro(cls)}", "",
                *_table(field_docs(cls), "")]
    out += ["", "## Python API only", "",
            "Not in a recipe: `FitConfig(...)` arguments for `trainer.fit`.", "",
            *_table(python_only, "")]
    return "\n".join(out) + "\n"


def undocumented() -> list[str]:
    """Dotted names of fields that have no comment (the test requires none)."""
    missing = [f"{r.name}" for r in field_docs(FitConfig) if not r.doc
               and r.name not in {name for name, _ in sections()}]
    for name, cls in sections():
        missing += [f"{name}.{r.name}" for r in field_docs(cls) if not r.doc]
    return missing


if __name__ == "__main__":
    sys.stdout.write(render())
