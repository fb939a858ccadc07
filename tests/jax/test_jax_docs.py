"""docs/jax.md is found, and the JAX exports are described where users look (issue 36
point 10: 6): the README's documentation table links it; `docs/snapshots.md` and
`baton snapshots export --help` say what `--format orbax` and `--format npz` write."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainer.cli import main as baton_main

ROOT = Path(__file__).resolve().parents[2]


def test_readme_links_the_jax_page() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Documentation"):]
    assert re.search(r"^\| \[jax\.md\]\(docs/jax\.md\) \| .*JAX", table, re.MULTILINE)
    index = ROOT / "docs" / "README.md"
    if index.exists():  # a docs index, where there is one, links it too
        assert "(jax.md)" in index.read_text()


def test_snapshots_page_describes_the_orbax_and_npz_exports() -> None:
    page = (ROOT / "docs" / "snapshots.md").read_text()
    for needle in ("--format orbax --out", "--format npz --out", "StandardCheckpointer",
                   "baton.json", "__state__", "numpy.load", "(jax.md"):
        assert needle in page, needle


def test_export_help_describes_the_orbax_and_npz_outputs(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        baton_main(["snapshots", "export", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for needle in ("Orbax checkpoint", "StandardCheckpointer().restore(OUT/state)",
                   "baton.json", "opt_state {count, mu, nu}", "__state__",
                   "numpy.load(OUT) without pickle", "a new directory for --format orbax",
                   "FILE.npz for --format npz"):
        assert needle in text, needle
