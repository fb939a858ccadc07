"""Corpus preparation: the default corpus (size, determinism, split by file) and its errors."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from data_state.corpus import EOD_TOKEN, default_corpus_files, prepare_corpus
from data_state.dataset import TokenDataset
from data_state.manifest import MANIFEST_NAME, DatasetManifest


@pytest.fixture(scope="module")
def default_twice(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The full default corpus, prepared twice into two directories (about a second each)."""
    first, second = tmp_path_factory.mktemp("corpus_a"), tmp_path_factory.mktemp("corpus_b")
    for out in (first, second):
        prepare_corpus(None, str(out), seq_len=256, progress=False, overwrite=True)
    return first, second


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_default_corpus_is_real_and_non_trivial(default_twice: tuple[Path, Path]) -> None:
    manifest = DatasetManifest.from_json((default_twice[0] / MANIFEST_NAME).read_text())
    files = manifest.sources["files"]
    total_tokens = sum(s.num_tokens for s in manifest.splits.values())
    print(f"default corpus: {len(files)} files, {total_tokens / 1e6:.1f} M tokens")
    assert manifest.sources["default_corpus"] is True
    assert len(files) > 500 and total_tokens > 10_000_000  # CPython 3.11: ~1,786 files, 31 M
    assert all(f["path"].startswith("stdlib/") and f["path"].endswith(".py") for f in files)
    assert not any("site-packages" in f["path"] for f in files)
    with TokenDataset(str(default_twice[0])) as ds:
        assert b"def " in bytes(ds.read(range(64)).reshape(-1))


def test_preparing_twice_gives_identical_bytes(default_twice: tuple[Path, Path]) -> None:
    first, second = (_tree_digest(root) for root in default_twice)
    assert first == second
    assert MANIFEST_NAME in first and any(k.startswith("train/") for k in first)
    assert not [k for k in first if ".tmp-" in k]  # atomic writes leave no temporaries


def test_split_is_by_file_and_holds_exactly_its_files(default_twice: tuple[Path, Path]) -> None:
    root = default_twice[0]
    manifest = DatasetManifest.from_json((root / MANIFEST_NAME).read_text())
    by_split: dict[str, list[str]] = {"train": [], "val": []}
    for f in manifest.sources["files"]:
        by_split[f["split"]].append(f["path"])
    assert by_split["val"] and by_split["train"]
    assert not set(by_split["val"]) & set(by_split["train"])
    sizes = {f["path"]: f["bytes"] for f in manifest.sources["files"]}
    val_share = sum(sizes[p] for p in by_split["val"]) / sum(sizes.values())
    assert 0.05 <= val_share < 0.05 + max(sizes.values()) / sum(sizes.values())
    # Each split's tokens are exactly its own files, in name order, each followed by EOD:
    # no text of a val file is anywhere in train, and vice versa.
    stdlib = {f.name: f.path for f in default_corpus_files()}
    for split, names in by_split.items():
        expected = b"".join(
            Path(stdlib[n]).read_bytes() + bytes([EOD_TOKEN]) for n in sorted(names)
        )
        with TokenDataset(str(root), split) as ds:
            got = ds.read(np.arange(len(ds))).reshape(-1).tobytes()
        assert got == expected[: len(got)]
        assert len(expected) - len(got) == manifest.splits[split].num_dropped_tokens < 256


def test_manifest_records_how_it_was_made(default_twice: tuple[Path, Path]) -> None:
    raw = json.loads((default_twice[0] / MANIFEST_NAME).read_text())
    assert raw["format"] == "baton.tokens/1" and raw["tokenizer"] == "bytes"
    assert (
        raw["vocab_size"] == 256 and raw["seq_len"] == 256 and "seq_len - 1" in raw["seq_len_note"]
    )
    assert raw["made_by"]["python"] and raw["made_by"]["val_fraction"] == 0.05
    assert all(len(f["sha256"]) == 64 for f in raw["sources"]["files"])
    for split in raw["splits"].values():
        assert split["num_tokens"] == split["num_sequences"] * 256
        for shard in split["shards"]:
            assert len(shard["sha256"]) == 64 and len(shard["tokens_sha256"]) == 64


def test_max_bytes_takes_a_sorted_prefix(tmp_path: Path) -> None:
    manifest = prepare_corpus(None, str(tmp_path), seq_len=64, max_bytes=300_000, progress=False)
    files = [f["path"] for f in manifest.sources["files"]]
    total = sum(f["bytes"] for f in manifest.sources["files"])
    everything = [f.name for f in default_corpus_files()]
    assert files == everything[: len(files)] and total <= 300_000
    assert total + os.path.getsize(default_corpus_files()[len(files)].path) > 300_000


def test_user_paths_binary_files_skipped_and_progress_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha " * 400)
    (src / "sub" / "b.md").write_text("beta " * 400)
    (src / "blob.bin").write_bytes(b"\x00\x01\x02" * 50)
    (src / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    manifest = prepare_corpus([str(src)], str(tmp_path / "ds"), seq_len=32, val_fraction=0.3)
    skipped = {Path(s["path"]).name: s["reason"] for s in manifest.sources["skipped"]}
    assert set(skipped) == {"blob.bin", "latin1.txt"} and "NUL" in skipped["blob.bin"]
    assert {f["split"] for f in manifest.sources["files"]} == {"train", "val"}
    assert "prepare: tokenizing: 100%" in capsys.readouterr().err  # plain lines, no TTY


def test_progress_draws_a_rich_bar_on_a_terminal() -> None:
    import io

    from data_state.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal, log = Terminal(), io.StringIO()
    for stream in (terminal, log):
        with Progress("prepare: test", 4_000_000, stream=stream) as bar:
            for _ in range(4):
                bar.advance(1_000_000)
    assert "100%" in terminal.getvalue() and "━" in terminal.getvalue()  # rich's bar glyph
    assert log.getvalue().count("\n") == 10 and "━" not in log.getvalue()


def test_errors_name_the_problem(tmp_path: Path) -> None:
    out = str(tmp_path / "ds")
    with pytest.raises(ValueError, match="'gpt2' is not a local file or directory; Baton never"):
        prepare_corpus(None, out, tokenizer="gpt2")
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        prepare_corpus(None, out, seq_len=1)
    with pytest.raises(ValueError, match="val_fraction"):
        prepare_corpus(None, out, val_fraction=1.5)
    with pytest.raises(ValueError, match="neither a file nor a directory"):
        prepare_corpus([str(tmp_path / "nope")], out)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("short")
    with pytest.raises(ValueError, match="fewer than one sequence of seq_len 64"):
        prepare_corpus([str(tiny)], out, seq_len=64, val_fraction=0.0, progress=False)
    prepare_corpus(None, out, seq_len=64, max_bytes=50_000, progress=False)
    with pytest.raises(ValueError, match="already holds a dataset.*overwrite"):
        prepare_corpus(None, out, seq_len=64, max_bytes=50_000, progress=False)
