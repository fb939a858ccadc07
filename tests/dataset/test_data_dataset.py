"""TokenDataset: random access across shards and row groups, the cache, identity, and errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from data_state.corpus import prepare_corpus
from data_state.dataset import TokenDataset
from data_state.manifest import MANIFEST_NAME, DatasetError
from data_state.storage import merge_ranges


def _prepare(out: Path, *, seq_len: int = 32) -> None:
    # ~200 KB of the default corpus, cut into many small shards and row groups.
    prepare_corpus(
        None,
        str(out),
        seq_len=seq_len,
        max_bytes=200_000,
        rows_per_group=16,
        sequences_per_shard=1000,
        progress=False,
    )


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ds")
    _prepare(out)
    return out


def _stream(root: Path) -> np.ndarray:
    """The train split's tokens read straight from the Parquet files with pyarrow."""
    import pyarrow.parquet as pq

    manifest = json.loads((root / MANIFEST_NAME).read_text())
    blobs = [
        b"".join(pq.read_table(root / s["path"]).column("tokens").to_pylist())
        for s in manifest["splits"]["train"]["shards"]
    ]
    return np.frombuffer(b"".join(blobs), dtype=np.uint8)


def test_random_access_matches_the_stored_stream(dataset_dir: Path) -> None:
    stream = _stream(dataset_dir)
    with TokenDataset(str(dataset_dir)) as ds:
        assert len(ds.manifest.splits["train"].shards) >= 3
        assert len(ds) * ds.seq_len == len(stream)
        order = np.random.default_rng(0).permutation(len(ds))[:500]
        got = ds.read(np.concatenate([order, order[:7]]))  # repeats are fine
        for row, i in zip(got, np.concatenate([order, order[:7]]), strict=True):
            assert np.array_equal(row, stream[i * 32 : (i + 1) * 32])
        assert np.array_equal(ds[len(ds) - 1], stream[-32:])
        assert ds.read([]).shape == (0, 32)
        batch = ds.batch(range(3))
        assert batch.dtype == torch.int64 and np.array_equal(batch.numpy(), ds.read(range(3)))


def test_cache_is_bounded_and_reads_only_needed_groups(dataset_dir: Path) -> None:
    row_group_bytes = 16 * 32
    with TokenDataset(str(dataset_dir), cache_bytes=4 * row_group_bytes) as ds:
        ds.read([0])
        assert ds.stats["groups_fetched"] == 1 and ds.stats["requests"] == 1
        ds.read([1, 2, 15])  # same row group: served from the cache
        assert ds.stats["groups_fetched"] == 1 and ds.stats["cache_hits"] == 1
        ds.read(np.arange(0, 16 * 10, 16))  # ten row groups; the cache keeps four
        assert ds.stats["groups_fetched"] == 10
        assert ds._cached_bytes <= 4 * row_group_bytes
        ds.read([0])  # evicted long ago
        assert ds.stats["groups_fetched"] == 11


def test_fingerprint_is_content_not_location(dataset_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(dataset_dir, copy)
    other = tmp_path / "other"
    _prepare(other, seq_len=64)
    with TokenDataset(str(dataset_dir)) as a, TokenDataset(str(copy)) as b:
        with TokenDataset(str(other)) as c, TokenDataset(str(dataset_dir), "val") as v:
            assert a.fingerprint == b.fingerprint
            assert len({a.fingerprint, c.fingerprint, v.fingerprint}) == 3


def test_verify_passes_then_catches_a_rewritten_shard(dataset_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(dataset_dir, copy)
    with TokenDataset(str(copy)) as ds:
        ds.verify()
    shard = copy / "train" / "part-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x55
    shard.write_bytes(bytes(data))
    with TokenDataset(str(copy)) as ds, pytest.raises(DatasetError, match="part-00001.parquet"):
        ds.verify()


@pytest.fixture
def broken(dataset_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "broken"
    shutil.copytree(dataset_dir, copy)
    return copy


def test_missing_dataset_and_bad_manifest(broken: Path, tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not a prepared dataset.*baton data prepare"):
        TokenDataset(str(tmp_path / "nothing"))
    with pytest.raises(DatasetError, match="no split 'test'"):
        TokenDataset(str(broken), "test")
    (broken / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(DatasetError, match="dataset.json is not valid JSON"):
        TokenDataset(str(broken))
    (broken / MANIFEST_NAME).write_text(json.dumps({"format": "other/9"}))
    with pytest.raises(DatasetError, match="format is 'other/9'"):
        TokenDataset(str(broken))


def test_missing_shard_is_named(broken: Path) -> None:
    (broken / "train" / "part-00002.parquet").unlink()
    with pytest.raises(DatasetError, match="part-00002.parquet listed in the manifest is missing"):
        TokenDataset(str(broken))


def test_corrupt_shard_is_named(broken: Path) -> None:
    shard = broken / "train" / "part-00000.parquet"
    data = bytearray(shard.read_bytes())
    data[-6:-4] = b"XX"  # the footer's closing magic bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match="part-00000.parquet is corrupt"):
        TokenDataset(str(broken))
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(DatasetError, match="part-00000.parquet is .* bytes, the manifest says"):
        TokenDataset(str(broken))


def test_corrupt_row_group_is_caught_by_page_checksums(broken: Path) -> None:
    shard = broken / "train" / "part-00001.parquet"
    with TokenDataset(str(broken)) as ds:
        start, end = ds._readers[1].byte_range(3)
    data = bytearray(shard.read_bytes())
    data[(start + end) // 2] ^= 0xFF  # inside row group 3's compressed page
    shard.write_bytes(bytes(data))
    with TokenDataset(str(broken)) as ds:
        first_of_shard_1 = int(ds._shard_starts[1])
        ds.read([first_of_shard_1])  # row group 0 of the same shard is intact
        with pytest.raises(DatasetError, match=r"part-00001.parquet is corrupt \(row group 3"):
            ds.read([first_of_shard_1 + 3 * 16])


def test_manifest_and_shard_mismatch(broken: Path, tmp_path: Path) -> None:
    manifest = json.loads((broken / MANIFEST_NAME).read_text())
    train = manifest["splits"]["train"]
    train["shards"][0]["num_sequences"] += 1  # consistent totals, wrong shard
    train["num_sequences"] += 1
    train["num_tokens"] += manifest["seq_len"]
    (broken / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(
        DatasetError, match="part-00000.parquet holds 1000 sequences but the manifest says 1001"
    ):
        TokenDataset(str(broken))
    train["num_sequences"] += 5
    (broken / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match="lists .* sequences but its shards hold"):
        TokenDataset(str(broken))


def test_shard_from_another_dataset(broken: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    _prepare(other, seq_len=64)
    manifest = json.loads((broken / MANIFEST_NAME).read_text())
    foreign = other / "train" / "part-00000.parquet"
    shutil.copy(foreign, broken / "train" / "part-00000.parquet")
    manifest["splits"]["train"]["shards"][0]["num_bytes"] = foreign.stat().st_size
    (broken / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match="part-00000.parquet"):
        TokenDataset(str(broken))


@pytest.mark.parametrize("path", ["../outside/train/part-00000.parquet", "/etc/hostname",
                                  "train/../../x.parquet", "train\\part-00000.parquet",
                                  "train//part-00000.parquet", "./train/part-00000.parquet"])
def test_a_shard_path_outside_the_dataset_is_refused(broken: Path, tmp_path: Path,
                                                      path: str) -> None:
    # P8: the manifest is untrusted; a shard it names is read only from inside the dataset.
    outside = tmp_path / "outside" / "train"
    outside.mkdir(parents=True)
    shutil.copy(broken / "train" / "part-00000.parquet", outside / "part-00000.parquet")
    manifest = json.loads((broken / MANIFEST_NAME).read_text())
    manifest["splits"]["train"]["shards"][0]["path"] = path
    (broken / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match="must be a relative path of plain names inside"):
        TokenDataset(str(broken))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("num_sequences", "1000", "num_sequences must be a non-negative integer"),
    ("num_bytes", 12.5, "num_bytes must be a non-negative integer"),
    ("num_bytes", True, "num_bytes must be a non-negative integer"),
    ("path", 5, "shard path 5 must be"),
    ("sha256", "abc", "sha256 must be 64 lowercase hex digits"),
    ("extra", 1, "must have exactly the fields"),
])
def test_a_mistyped_shard_field_is_one_dataset_error(broken: Path, field: str, value: object,
                                                     message: str) -> None:
    manifest = json.loads((broken / MANIFEST_NAME).read_text())
    manifest["splits"]["train"]["shards"][0][field] = value
    (broken / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=message):
        TokenDataset(str(broken))


def test_a_shard_that_changes_while_it_is_opened_is_a_dataset_error(dataset_dir: Path) -> None:
    # Shrunk between the size and the read, then grown back to the manifest's size: what was
    # read belongs to no single version of the file.
    from data_state.shards import ShardReader, TruncatedError

    with TokenDataset(str(dataset_dir)) as ds:
        info = ds.manifest.split("train").shards[0]

    class Flaky:
        def size(self, path: str) -> int:
            return info.num_bytes

        def read_range(self, path: str, start: int, end: int) -> bytes:
            raise TruncatedError(f"{path} ends before byte {end}")

    reader = ShardReader(Flaky(), info.path, info, seq_len=32, dtype=np.uint8)
    with pytest.raises(DatasetError, match="changed while it was read"):
        reader.open()


def test_index_out_of_range(dataset_dir: Path) -> None:
    with TokenDataset(str(dataset_dir)) as ds, pytest.raises(IndexError, match="out of range"):
        ds.read([0, len(ds)])


def test_merge_ranges_joins_small_holes_only() -> None:
    ranges = [(100, 200), (0, 50), (230, 300), (10_000, 10_100)]
    spans = merge_ranges(ranges, hole_limit=40)  # gaps: 50, 30, 9700
    assert spans == [(0, 50, [1]), (100, 300, [0, 2]), (10_000, 10_100, [3])]
    assert merge_ranges(ranges, hole_limit=10**6)[0][:2] == (0, 10_100)
    with pytest.raises(ValueError, match="invalid byte range"):
        merge_ranges([(5, 2)], hole_limit=0)
