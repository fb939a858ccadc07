"""Corpus inputs: JSON Lines, Parquet, `save_to_disk` datasets and globs; bad rows skipped and
counted; the same bytes for 1 and 2 worker processes (and, slow, on a local Ray); bad input
is one clear line. Documents are docstrings of the Python standard library."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_state import sources
from data_state.corpus import prepare_corpus
from data_state.dataset import TokenDataset
from data_state.manifest import MANIFEST_NAME
from trainer.cli.data import register


def _docstrings() -> list[str]:
    import bisect
    import colorsys
    import fnmatch
    import heapq
    import shlex
    import textwrap

    docs = []
    for module in (textwrap, shlex, colorsys, bisect, heapq, fnmatch):
        docs += [inspect.getdoc(v) for _, v in sorted(vars(module).items())
                 if callable(v) and inspect.getdoc(v)]
    unique = list(dict.fromkeys(d for d in docs if d))  # re-exported names repeat docstrings
    return [*unique, "naïve café, 日本語 — non-ASCII survives"]


DOCS = _docstrings()


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs are named by relative paths: a row's split hashes its file's name as given, so
    names under pytest's numbered tmp directories would change the split from run to run."""
    monkeypatch.chdir(tmp_path)


def _documents(root: Path, split: str) -> list[str]:
    with TokenDataset(str(root), split) as ds:
        stream = ds.read(np.arange(len(ds))).reshape(-1)
        ends = [int(e) for e in np.flatnonzero(stream == ds.eod_token)]
        if not ends or ends[-1] != len(stream) - 1:
            ends.append(len(stream))
        starts = [0, *(e + 1 for e in ends[:-1])]
        return [ds.decode(stream[s:e]) for s, e in zip(starts, ends, strict=True)]


def _both_splits(root: Path) -> tuple[list[str], list[str]]:
    return _documents(root, "train"), _documents(root, "val")


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _write_jsonl(path: Path) -> None:
    lines = [json.dumps({"text": d, "id": i}).encode() for i, d in enumerate(DOCS)]
    bad = [b'{"id": "no text field"}', b'{"text": 42}', b'{"text": "   "}', b"{not json",
           b'{"text": "caf\xe9"}', b"[1, 2]"]
    for i, row in enumerate(bad):  # spread among the good rows
        lines.insert(3 + 7 * i, row)
    path.write_bytes(b"\n".join(lines) + b"\n")


EXPECTED_BAD = {"missing field": 1, "not a string": 1, "empty": 1, "invalid JSON": 1,
                "not UTF-8": 1, "not a JSON object": 1}


def _check_split(train: list[str], val: list[str]) -> None:
    assert train and val and not set(train) & set(val)
    for split in (train, val):  # each split keeps the input order: a subsequence of DOCS
        it = iter(DOCS)
        assert all(doc in it for doc in split)
    assert sorted(train + val) == sorted(DOCS)


def test_jsonl_rows_bad_rows_counted_and_ranges_cut_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_jsonl(tmp_path / "docs.jsonl")
    out = tmp_path / "ds"
    manifest = prepare_corpus(["docs.jsonl"], str(out), seq_len=2,
                              val_fraction=0.3, progress=False)
    _check_split(*_both_splits(out))
    assert manifest.sources["skipped_rows"] == EXPECTED_BAD
    (row_input,) = manifest.sources["row_inputs"]
    assert row_input["train_rows"] + row_input["val_rows"] == len(DOCS)
    # Work units of 300 bytes cut the file mid-line everywhere: the same dataset comes out.
    monkeypatch.setattr(sources, "UNIT_BYTES", 300)
    prepare_corpus(["docs.jsonl"], str(tmp_path / "small_units"), seq_len=2,
                   val_fraction=0.3, progress=False)
    assert _tree(tmp_path / "small_units") == _tree(out)


def test_parquet_column_with_nulls_and_row_groups(tmp_path: Path) -> None:
    values = [*DOCS[:10], None, *DOCS[10:]]
    pq.write_table(pa.table({"content": values, "n": list(range(len(values)))}),
                   tmp_path / "part.parquet", row_group_size=7)
    out = tmp_path / "ds"
    manifest = prepare_corpus(["part.parquet"], str(out), seq_len=2,
                              val_fraction=0.3, text_column="content", progress=False)
    _check_split(*_both_splits(out))
    assert manifest.sources["skipped_rows"] == {"missing field": 1}
    assert manifest.made_by["text_column"] == "content"
    with pytest.raises(ValueError, match="--text-column 'text': .*part.parquet has no such "
                                         "column \\(columns: content, n\\)"):
        prepare_corpus(["part.parquet"], str(tmp_path / "x"), progress=False)


def test_save_to_disk_dataset_and_dataset_dict(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": DOCS})
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    assert len(list((tmp_path / "saved").glob("*.arrow"))) >= 2
    out = tmp_path / "ds"
    prepare_corpus(["saved"], str(out), seq_len=2, val_fraction=0.3,
                   progress=False)
    _check_split(*_both_splits(out))
    half = len(DOCS) // 2
    datasets.DatasetDict({"a": datasets.Dataset.from_dict({"text": DOCS[:half]}),
                          "b": datasets.Dataset.from_dict({"text": DOCS[half:]})}
                         ).save_to_disk(str(tmp_path / "dict"))
    manifest = prepare_corpus(["dict"], str(tmp_path / "ds2"), seq_len=2,
                              val_fraction=0.3, progress=False)
    assert [r["path"].split("/")[-2] for r in manifest.sources["row_inputs"]] == ["a", "b"]
    _check_split(*_both_splits(tmp_path / "ds2"))


def test_globs_pick_files_and_kinds(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "a.jsonl")
    (tmp_path / "notes.txt").write_text(DOCS[0])
    manifest = prepare_corpus(["*.jsonl"], str(tmp_path / "ds"), seq_len=2,
                              val_fraction=0.3, progress=False)
    assert [r["path"] for r in manifest.sources["row_inputs"]] == ["a.jsonl"]
    assert manifest.sources["files"] == []
    with pytest.raises(ValueError, match="matches no files"):
        prepare_corpus([str(tmp_path / "*.md")], str(tmp_path / "x"), progress=False)


def test_same_bytes_for_one_and_two_workers(tmp_path: Path) -> None:
    """Mixed inputs, a trained BPE (two passes), small units: serial == 2 processes."""
    (tmp_path / "src").mkdir()
    _write_jsonl(tmp_path / "src" / "rows.jsonl")
    for i, doc in enumerate(DOCS[:20]):
        (tmp_path / "src" / f"doc{i:02d}.txt").write_text(doc)
    runs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        prepare_corpus(["src"], str(out), seq_len=16, val_fraction=0.2,
                       train_tokenizer=300, workers=workers, progress=False)
        runs[workers] = _tree(out)
    assert runs[1] == runs[2] and "tokenizer.json" in runs[1]


def test_ray_shard_plans_cut_like_the_serial_writer(tmp_path: Path) -> None:
    """Without Ray: the Ray path's stage 2 (`plan_shards` on unit token counts, then a task
    building each shard from pieces of the unit objects stage 1 writes) gives the serial
    `SplitWriter`'s files and `SplitInfo`, for uneven units, empty ones and a dropped tail."""
    from data_state import ray_tokenize, storage
    from data_state.split_writer import SplitWriter

    rng = np.random.default_rng(7)
    counts = [{"train": int(rng.integers(0, 40)) * (i % 5 != 2), "val": int(rng.integers(0, 9))}
              for i in range(30)]
    streams = {s: [rng.integers(0, 60_000, c[s]).astype(np.uint16) for c in counts]
               for s in sources.SPLITS}
    layout = ray_tokenize.ShardLayout(str(tmp_path / "ray"), None, "uint16", seq_len=5,
                                      rows_per_group=2, per_shard=3)
    for unit in range(len(counts)):  # as stage 1 writes them: splits in order, little-endian
        blob = b"".join(streams[s][unit].astype("<u2").tobytes() for s in sources.SPLITS)
        (tmp_path / "ray" / ray_tokenize.TEMP_DIR).mkdir(parents=True, exist_ok=True)
        (tmp_path / "ray" / ray_tokenize.TEMP_DIR / f"unit-{unit:06d}.bin").write_bytes(blob)
    io, root = storage.resolve(str(tmp_path / "serial"))
    for split in sources.SPLITS:
        writer = SplitWriter(io, root, split, seq_len=5, dtype=np.dtype(np.uint16),
                             rows_per_group=2, per_shard=3)
        for part in streams[split]:
            writer.append(part)
        serial = writer.finish(where="serial")
        plans = list(ray_tokenize.plan_shards(counts, split, seq_len=5, per_shard=3))
        out = ray_tokenize._write_shards({"plan": np.array([json.dumps(p) for p in plans])},
                                         layout)
        infos = [json.loads(i) for i in out["info"]]
        assert [i.pop("index") for i in infos] == list(range(len(serial.shards))) != []
        assert all(i.pop("split") == split for i in infos)
        assert [dataclasses.asdict(s) for s in serial.shards] == infos
        assert serial.num_dropped_tokens == sum(map(len, streams[split])) % 5
    shards = {p: d for p, d in _tree(tmp_path / "ray").items() if p.endswith(".parquet")}
    assert shards == _tree(tmp_path / "serial")


@pytest.mark.slow
def test_ray_path_writes_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray Data on a local Ray (2 CPUs, in this process) == the serial run; the shards are
    written on the cluster (only token counts reach the driver) and no temporary object
    stays behind, after success or after a refused split."""
    ray = pytest.importorskip("ray")
    from data_state.parallel import UnitResult

    monkeypatch.setenv("BATON_SKIP_CODE_CHECK", "1")
    _write_jsonl(tmp_path / "rows.jsonl")
    monkeypatch.setattr(sources, "UNIT_BYTES", 2000)  # several units; planned in the driver
    kwargs: dict[str, Any] = dict(seq_len=16, val_fraction=0.2, train_tokenizer=300,
                                  progress=False, sequences_per_shard=4)  # several shards
    prepare_corpus(["rows.jsonl"], str(tmp_path / "serial"), **kwargs)
    received: list[UnitResult] = []
    decode = UnitResult.from_bytes

    def spy(blob: bytes) -> UnitResult:
        received.append(decode(blob))
        return received[-1]

    monkeypatch.setattr(UnitResult, "from_bytes", staticmethod(spy))
    started = not ray.is_initialized()
    if started:
        # "local": our own cluster, never one another process left running on this machine
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        prepare_corpus(["rows.jsonl"], str(tmp_path / "ray"), use_ray=True, **kwargs)
        tokenizing = [r for r in received if r.token_counts]
        with pytest.raises(ValueError, match="fewer than one sequence of seq_len 100000"):
            prepare_corpus(["rows.jsonl"], str(tmp_path / "short"), use_ray=True,
                           **{**kwargs, "seq_len": 100_000, "train_tokenizer": None})
    finally:
        if started:
            ray.shutdown()
    serial = _tree(tmp_path / "serial")
    assert _tree(tmp_path / "ray") == serial
    assert len([p for p in serial if p.startswith("train/")]) > 2
    assert not (tmp_path / "ray" / ".prepare-tmp").exists()
    assert not (tmp_path / "short" / ".prepare-tmp").exists()
    assert not list((tmp_path / "short").rglob("*.parquet"))  # refused before stage 2
    assert tokenizing and all(not r.tokens for r in received)  # counts, never token arrays
    total = sum(r.token_counts["train"] for r in tokenizing)
    manifest = json.loads((tmp_path / "serial" / MANIFEST_NAME).read_text())
    train = manifest["splits"]["train"]
    assert total == train["num_tokens"] + train["num_dropped_tokens"]


# -- bad input: one line each, through the CLI ------------------------------------------


def baton_data(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="baton")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["data", *argv])
    return int(args.func(args))


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert baton_data(["prepare", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("baton data prepare: "), err
    return err


def test_bad_inputs_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "ds")
    (tmp_path / "rows.jsonl").write_text('{"body": "text under another name"}\n' * 3)
    err = _one_line_error(capsys, ["--out", out, str(tmp_path / "rows.jsonl")])
    assert "no usable text" in err and "3 row(s) missing field" in err and "--text-field" in err

    (tmp_path / "bad.json").write_text('{"model": 1}')
    err = _one_line_error(capsys, ["--out", out, "--tokenizer", str(tmp_path / "bad.json")])
    assert "bad.json is not a valid tokenizers file" in err

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.jsonl").write_text('{"text": ""}\n{"text": "  "}\n')
    err = _one_line_error(capsys, ["--out", out, str(empty)])
    assert "no usable text" in err and "2 row(s) empty" in err

    err = _one_line_error(capsys, ["--out", out, "--tokenizer", "mistralai/Mistral-7B-v0.1"])
    assert "not a local file or directory; Baton never downloads" in err

    err = _one_line_error(capsys, ["--out", out, "--train-tokenizer", "100", str(empty)])
    assert "at least 257 ids" in err
    assert not os.path.exists(os.path.join(out, MANIFEST_NAME))


def test_prepare_with_a_trained_bpe_then_inspect_decodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_jsonl(tmp_path / "rows.jsonl")
    out = str(tmp_path / "ds")
    assert baton_data(["prepare", "--quiet", "--out", out, "--seq-len", "32",
                       "--val-fraction", "0.2", "--train-tokenizer", "400",
                       "rows.jsonl"]) == 0
    printed = capsys.readouterr().out
    assert "rows skipped: missing field" in printed and "vocab 400 (uint16)" in printed
    assert baton_data(["inspect", out, "--show", "1", "--split", "train"]) == 0
    shown = capsys.readouterr().out
    assert "<|endoftext|>" in shown or any(doc[:20] in shown for doc in DOCS)
    with TokenDataset(out) as ds:
        assert ds.decode(ds[0]) in shown


def test_s3_sources_prefix_and_glob_give_the_local_dataset(s3_bucket: str,
                                                            tmp_path: Path) -> None:
    """Inputs on S3 (moto): a prefix and a glob are read through the storage layer, and the
    tokens equal those of the same files prepared from local disk."""
    import boto3

    _write_jsonl(tmp_path / "rows.jsonl")
    (tmp_path / "notes.txt").write_text(DOCS[0] * 20)
    client = boto3.client("s3")
    for name in ("rows.jsonl", "notes.txt"):
        client.put_object(Bucket=s3_bucket, Key=f"corpus/{name}",
                          Body=(tmp_path / name).read_bytes())
    manifest = prepare_corpus([f"s3://{s3_bucket}/corpus"], f"s3://{s3_bucket}/ds", seq_len=8,
                              val_fraction=0.0, progress=False)
    assert manifest.sources["skipped_rows"] == EXPECTED_BAD
    assert [f["path"] for f in manifest.sources["files"]] == [
        f"s3://{s3_bucket}/corpus/notes.txt"]
    globbed = prepare_corpus([f"s3://{s3_bucket}/corpus/*.jsonl"], str(tmp_path / "g"),
                             seq_len=8, val_fraction=0.0, progress=False)
    local = prepare_corpus(["rows.jsonl"], str(tmp_path / "l"), seq_len=8, val_fraction=0.0,
                           progress=False)
    assert globbed.splits["train"].shards == local.splits["train"].shards
