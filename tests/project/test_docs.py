"""The documents stay a user's guide, and the cheap commands they show keep working.

- README.md stays short (at most 250 lines): everything else lives in docs/. Its documentation
  table lists every page of docs/.
- Every module of the four source packages and of benchmarks/ opens with a docstring of at most
  30 lines: its contract. Longer reasons go to docs/design.md (a benchmark's method to its
  report), measurements to benchmarks/reports/.
- No README, docs/ or benchmarks/reports/ line speaks of work sessions ("the eighth session",
  "this session"): a page says what is true now, a report when it was measured.
- The commands the docs show that run in seconds without Ray are run here, in-process, as the
  docs write them (paths replaced by temporary ones): `baton --help`, `baton fit --help`,
  `baton sketch-plan` on the tiny recipe, `baton data prepare` and `inspect`, `baton fit` on the
  tiny recipe with the worker loop in place of Ray's fit (`tests/inprocess_fit.py`), then
  `runs ls`, `snapshots ls|show|verify|export` and `report` on that run. Each command's shape
  must appear in some page, so a page that changes a command changes this test too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from inprocess_fit import InProcessFit
from test_doc_paths import documents

from trainer.cli import main

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
SOURCE_PACKAGES = ("trainer", "elastic", "sketch_ops", "data_state")
DOCSTRING_CHECKED = (*SOURCE_PACKAGES, "benchmarks")
DOCSTRING_MAX_LINES = 30
SESSION_WORDS = re.compile(
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(st|nd|rd|th)|"
    r"this|previous|earlier)\s+(GPU\s+)?session\b", re.IGNORECASE)


def _pages_text() -> str:
    return "\n".join(p.read_text() for p in documents())


def _shown(command: str) -> None:
    """`command` (as the docs write it) appears in a page."""
    assert command in _pages_text(), f"no page shows `{command}`; update this test with the docs"


def test_the_readme_is_a_short_guide() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}); move detail to docs/")
    assert lines[3:5] == [
        "make demo   # creates .venv, installs Baton, runs the elastic demo on a local 3-node "
        "Ray cluster (~2 min)",
        "make test   # same set-up, then the whole test suite (what CI runs)"]


def test_the_readme_lists_every_page_of_docs() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme.split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| \[[^\]]+\]\(docs/([\w.-]+\.md)\)", table, re.MULTILINE))
    pages = {page.name for page in (ROOT / "docs").glob("*.md")}
    assert not pages - listed, f"docs/ pages missing from README's table: {sorted(pages - listed)}"
    assert not listed - pages, f"README's table names pages docs/ lacks: {sorted(listed - pages)}"


def long_module_docstrings(root: Path, packages: tuple[str, ...] = DOCSTRING_CHECKED,
                           limit: int = DOCSTRING_MAX_LINES) -> list[str]:
    """`path: N lines` for every module under `packages` whose docstring runs past `limit`."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
            if doc is not None and len(doc.splitlines()) > limit:
                found.append(f"{path.relative_to(root)}: {len(doc.splitlines())} lines")
    return found


def test_the_docstring_check_finds_a_long_one(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "bench" / "family").mkdir(parents=True)
    lines = [f"line {i}" for i in range(DOCSTRING_MAX_LINES + 1)]
    (tmp_path / "pkg" / "fits.py").write_text('"""' + "\n".join(lines[:-1]) + '\n"""\n')
    (tmp_path / "pkg" / "sub" / "long.py").write_text('"""' + "\n".join(lines) + '\n"""\nX = 1\n')
    (tmp_path / "pkg" / "none.py").write_text("X = 1\n")
    (tmp_path / "bench" / "family" / "run.py").write_text('"""' + "\n".join(lines) + '\n"""\n')
    assert long_module_docstrings(tmp_path, ("pkg",)) == [
        f"pkg/sub/long.py: {DOCSTRING_MAX_LINES + 1} lines"]
    assert long_module_docstrings(tmp_path, ("pkg", "bench")) == [
        f"pkg/sub/long.py: {DOCSTRING_MAX_LINES + 1} lines",
        f"bench/family/run.py: {DOCSTRING_MAX_LINES + 1} lines"]


def test_module_docstrings_state_their_contract_briefly() -> None:
    found = long_module_docstrings(ROOT)
    assert not found, (
        f"module docstrings over {DOCSTRING_MAX_LINES} lines (state the contract; reasons go to "
        "docs/design.md, a benchmark's method and measurements to benchmarks/reports/):\n"
        + "\n".join(found))


def test_no_page_speaks_of_work_sessions() -> None:
    assert SESSION_WORDS.search("run on 5 December, tenth session")
    assert SESSION_WORDS.search("the 11th session") and SESSION_WORDS.search("Second GPU session")
    assert not SESSION_WORDS.search("a run trained in sessions; the next session continues")
    found = [f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
             for page in documents()
             for number, line in enumerate(page.read_text().splitlines(), 1)
             if SESSION_WORDS.search(line)]
    assert not found, "pages that speak of work sessions:\n" + "\n".join(found)


def _baton(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    """Run `baton ARGV` in-process: (exit code, stdout + stderr)."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit_:  # --help
        code = int(exit_.code or 0)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _baton(capsys, ["--help"])
    assert code == 0
    for command in ("data", "snapshots", "fit", "report", "demo", "runs", "sketch-plan"):
        assert re.search(rf"^\s+{command}\b", text, re.MULTILINE), command
        _shown(f"baton {command}")
    code, text = _baton(capsys, ["fit", "--help"])
    assert code == 0
    for flag in ("--run-dir", "--set", "--until", "--time-limit", "--reschedule", "--from",
                 "--data-cursor", "--force-takeover"):
        assert flag in text
        _shown(flag)


def test_sketch_plan_on_the_tiny_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    _shown("baton sketch-plan recipes/tiny.toml")
    code, text = _baton(capsys, ["sketch-plan", "recipes/tiny.toml"])
    assert code == 0, text
    assert "blocks.0.mlp.proj" in text and "sketched" in text and "measured" in text


def test_data_prepare_and_inspect(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _shown("baton data prepare --out data/stdlib")
    _shown("baton data inspect data/stdlib --verify --show 1")
    out = str(tmp_path / "stdlib")
    code, text = _baton(capsys, ["data", "prepare", "--out", out, "--max-bytes", "200000",
                                 "--seq-len", "32", "--quiet"])
    assert code == 0, text
    code, text = _baton(capsys, ["data", "inspect", out, "--verify", "--show", "1"])
    assert code == 0, text


def test_a_run_and_the_commands_that_read_it(
    capsys: pytest.CaptureFixture[str], fake_fit: InProcessFit, tmp_path: Path,
    tiny_dataset: str,
) -> None:
    """`baton fit` as the docs show it (the tiny recipe, the worker loop in this process),
    then every read-only command the docs run on a run directory."""
    _shown("baton fit recipes/default.toml --run-dir runs/my-run")
    run = str(tmp_path / "runs" / "my-run")
    code, text = _baton(capsys, ["fit", "recipes/tiny.toml", "--run-dir", run,
                                 "--set", f'data.uri="{tiny_dataset}"', "--set", "steps=8",
                                 "--set", "eval.every=0"])
    assert code == 0, text
    commands = [
        ("baton runs ls", ["runs", "ls", str(tmp_path / "runs")], "my-run"),
        ("baton snapshots ls RUN_URI", ["snapshots", "ls", run], "8"),
        ("baton snapshots show RUN_URI", ["snapshots", "show", run], "model."),
        ("baton snapshots verify RUN_URI", ["snapshots", "verify", run], ""),
        ("baton snapshots export RUN_URI [STEP] --out model.safetensors",
         ["snapshots", "export", run, "--out", str(tmp_path / "model.safetensors")], ""),
        ("baton report runs/my-run --out my-run.png",
         ["report", run, "--out", str(tmp_path / "my-run.png")], ""),
    ]
    for shown, argv, expected in commands:
        _shown(shown)
        code, text = _baton(capsys, argv)
        assert code == 0 and expected in text, (shown, code, text)
    assert (tmp_path / "model.safetensors").stat().st_size > 0
    assert (tmp_path / "my-run.png").stat().st_size > 0
