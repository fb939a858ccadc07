"""Random access to the sequences of one split of a prepared dataset (local or `s3://`).

Contract:
- `TokenDataset(uri, split)` reads `dataset.json` and every shard's footer (nothing else),
  and checks them against each other; any problem raises `DatasetError` naming the file.
- `len(ds)` is the number of sequences; `ds[i]` is sequence i as a `(seq_len,)` array,
  `ds.read(indices)` a `(k, seq_len)` array in the order given (the stored dtype) and
  `ds.batch(indices)` the same as an int64 torch tensor. Sequence numbering is the
  shards' order in the manifest, then row order.
- Only the row groups holding the requested sequences are fetched, so a worker reads what it
  trains on (on object stores, plus the holes `storage.merge_ranges` finds cheaper to read
  than to skip; `hole_limit` defaults to the storage layer's: 0 on local disk,
  `MERGE_HOLE_BYTES` (4 MiB) on S3). All I/O goes through `data_state.storage` (deadlines and
  retries on S3: a store failing longer than `storage_retry_s` raises
  `StorageUnavailableError`, an `OSError`).
  Decoded row groups stay in a small LRU cache bounded in bytes (`cache_bytes`).
- `fingerprint` identifies the split's content (see `manifest.py`); data cursors carry it.
- The tokenizer the tokens were made with: `vocab_size`, `eod_token`, `special_tokens` and
  `tokenizer_sha256` (None for bytes) come from the manifest; `tokenizer` loads it (the
  stored `tokenizer.json`, checked against its SHA-256, or the byte tokenizer) on first use,
  and `decode(ids)` turns token ids back into text with it.
- On S3, the row groups one `read` needs are fetched concurrently by a small thread pool
  (request latency, not bandwidth, bounds random reads from object stores). `close()` (or
  leaving a `with` block) ends those threads. Local reads run in the caller's thread.
- `read` is safe to call from several threads.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from data_state import storage
from data_state.manifest import MANIFEST_NAME, DatasetError, DatasetManifest
from data_state.shards import ShardReader
from data_state.tokenizer import ByteTokenizer, Tokenizer, from_stored
from elastic.storage import MAX_JSON_BYTES, RefusedEntryError

if TYPE_CHECKING:  # torch is imported by batch() only: read() serves numpy without it
    import torch

_GroupKey = tuple[int, int]  # (shard number, row group number)


def read_manifest(uri: str, storage_options: Mapping[str, Any] | None = None) -> DatasetManifest:
    """The validated manifest of the dataset at `uri` (`DatasetError` if absent or bad)."""
    fs, root = storage.resolve(uri, storage_options)
    return _load_manifest(fs, root, uri)


def _load_manifest(fs: storage.Storage, root: str, uri: str) -> DatasetManifest:
    path = storage.join(root, MANIFEST_NAME)
    try:
        text = fs.read_file(path, max_bytes=MAX_JSON_BYTES)
    except FileNotFoundError:
        raise DatasetError(
            f"{path} not found: {uri} is not a prepared dataset (run "
            f"`baton data prepare --out {uri}`)"
        ) from None
    except (RefusedEntryError, ValueError) as err:  # a link, a FIFO, larger than any manifest
        raise DatasetError(f"{err}: prepare the dataset again") from None
    return DatasetManifest.from_json(text, where=path)


def load_stored_tokenizer(fs: storage.Storage, root: str, manifest: DatasetManifest
                          ) -> Tokenizer:
    """The tokenizer a prepared dataset was made with (see `TokenDataset.tokenizer`)."""
    if manifest.tokenizer_file is None:
        return ByteTokenizer()
    path = storage.join(root, manifest.tokenizer_file)
    try:
        data = fs.read_file(path)
    except FileNotFoundError:
        raise DatasetError(f"{path} (the dataset's tokenizer) is missing: copy it back or "
                           "prepare the dataset again") from None
    if hashlib.sha256(data).hexdigest() != manifest.tokenizer_sha256:
        raise DatasetError(f"{path} differs from the tokenizer the manifest names (SHA-256): "
                           "it was replaced; restore it or prepare the dataset again")
    try:
        return from_stored(data, name=path, eos_id=manifest.eod_token or 0)
    except ValueError as err:
        raise DatasetError(str(err)) from None


class TokenDataset:
    """Fixed-length token sequences of one split; see the module docstring."""

    def __init__(
        self,
        uri: str,
        split: str = "train",
        *,
        cache_bytes: int = 64 << 20,
        max_concurrency: int = 8,
        hole_limit: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        storage_retry_s: float = 60.0,
    ) -> None:
        if cache_bytes < 0 or max_concurrency < 1 or (hole_limit or 0) < 0:
            raise ValueError(
                "TokenDataset needs cache_bytes >= 0, max_concurrency >= 1, hole_limit >= 0; "
                f"got {cache_bytes}, {max_concurrency}, {hole_limit}"
            )
        self.uri, self.split = uri, split
        self._fs, self._root = storage.resolve(
            uri, storage_options, retry_deadline_s=storage_retry_s
        )
        manifest_path = storage.join(self._root, MANIFEST_NAME)
        if hole_limit is None:  # local random reads are cheap: read only what is asked for
            hole_limit = self._fs.hole_limit
        self.manifest = _load_manifest(self._fs, self._root, uri)
        info = self.manifest.split(split, where=manifest_path)
        self.seq_len = self.manifest.seq_len
        self.dtype = np.dtype(self.manifest.token_dtype)
        self.fingerprint = self.manifest.fingerprint(split)
        self.vocab_size = self.manifest.vocab_size
        self.eod_token = self.manifest.eod_token
        self.special_tokens = dict(self.manifest.special_tokens)
        self.tokenizer_sha256 = self.manifest.tokenizer_sha256
        self._tokenizer: Tokenizer | None = None
        self._readers = [
            ShardReader(
                self._fs,
                storage.join(self._root, s.path),
                s,
                seq_len=self.seq_len,
                dtype=self.dtype,
            )
            for s in info.shards
        ]
        self._pool: ThreadPoolExecutor | None = None
        if max_concurrency > 1 and not self._fs.is_local:
            self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="baton-data-io")
        try:
            self._map(lambda r: r.open(), self._readers)
        except BaseException:
            self.close()  # no I/O threads left behind by a dataset that failed to open
            raise
        counts = [s.num_sequences for s in info.shards]
        self._shard_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._num_sequences = int(self._shard_starts[-1])
        self._hole_limit, self._cache_bytes = hole_limit, cache_bytes
        self._cache: OrderedDict[_GroupKey, np.ndarray] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "bytes_fetched": 0, "groups_fetched": 0, "cache_hits": 0}

    def __len__(self) -> int:
        return self._num_sequences

    def __getitem__(self, index: int) -> np.ndarray:
        return self.read([index])[0]

    def read(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Sequences `indices` as a `(len(indices), seq_len)` array of the dataset's dtype."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self._num_sequences):
            bad = int(idx.min()) if idx.min() < 0 else int(idx.max())
            raise IndexError(
                f"sequence {bad} out of range for {self.uri} split {self.split!r} "
                f"({self._num_sequences} sequences)"
            )
        shard = np.searchsorted(self._shard_starts, idx, side="right") - 1
        row = idx - self._shard_starts[shard]
        group = np.empty_like(row)
        for s in np.unique(shard):
            sel = shard == s
            group[sel] = np.searchsorted(self._readers[s].row_starts, row[sel], side="right") - 1
        keys = list(zip(shard.tolist(), group.tolist(), strict=True))
        groups = self._groups(dict.fromkeys(keys))
        out = np.empty((idx.size, self.seq_len), dtype=self.dtype)
        for i, (key, r) in enumerate(zip(keys, row.tolist(), strict=True)):
            out[i] = groups[key][r - self._readers[key[0]].row_starts[key[1]]]
        return out

    def batch(self, indices: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Sequences `indices` as a `(len(indices), seq_len)` int64 tensor, ready for a model."""
        import torch

        return torch.from_numpy(self.read(indices).astype(np.int64))

    @property
    def tokenizer(self) -> Tokenizer:
        """The dataset's tokenizer (module docstring); `DatasetError` if the stored file is
        missing or is not the one the manifest names."""
        if self._tokenizer is None:
            self._tokenizer = load_stored_tokenizer(self._fs, self._root, self.manifest)
        return self._tokenizer

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Token ids as text, with the dataset's tokenizer (special tokens shown)."""
        return self.tokenizer.decode(np.asarray(ids).reshape(-1).tolist())

    def verify(self) -> None:
        """Read every shard whole and check both checksums; `DatasetError` names a bad one."""
        for reader in self._readers:
            blob = storage.read_span(self._fs, reader.path, 0, reader.info.num_bytes)
            if hashlib.sha256(blob).hexdigest() != reader.info.sha256:
                raise DatasetError(f"shard {reader.path}: file checksum differs from the manifest")
            tokens = hashlib.sha256()
            for g in range(reader.num_row_groups):
                start, end = reader.byte_range(g)
                tokens.update(reader.decode(g, blob[start:end]).tobytes())
            if tokens.hexdigest() != reader.info.tokens_sha256:
                raise DatasetError(f"shard {reader.path}: token checksum differs from the manifest")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> TokenDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"TokenDataset({self.uri!r}, split={self.split!r}, sequences={len(self)}, "
            f"seq_len={self.seq_len}, fingerprint={self.fingerprint!r})"
        )

    # -- internals -----------------------------------------------------------------------

    def _groups(self, keys: Iterable[_GroupKey]) -> dict[_GroupKey, np.ndarray]:
        """Decoded row groups for `keys`: cache hits, plus one fetch for all the misses."""
        found: dict[_GroupKey, np.ndarray] = {}
        with self._lock:
            for key in keys:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    found[key] = self._cache[key]
                    self.stats["cache_hits"] += 1
        missing = [k for k in keys if k not in found]
        if not missing:
            return found
        tasks = []
        for s in sorted({k[0] for k in missing}):
            wanted = [g for (shard, g) in missing if shard == s]
            ranges = [self._readers[s].byte_range(g) for g in wanted]
            for start, end, members in storage.merge_ranges(ranges, hole_limit=self._hole_limit):
                tasks.append((s, start, end, [(wanted[m], ranges[m]) for m in members]))
        for fetched in self._map(self._fetch_span, tasks):
            found.update(fetched)
        with self._lock:
            for key in missing:
                self._remember(key, found[key])
        return found

    def _fetch_span(
        self, task: tuple[int, int, int, list[tuple[int, tuple[int, int]]]]
    ) -> dict[_GroupKey, np.ndarray]:
        s, start, end, members = task
        reader = self._readers[s]
        blob = storage.read_span(self._fs, reader.path, start, end)
        with self._lock:
            self.stats["requests"] += 1
            self.stats["bytes_fetched"] += len(blob)
            self.stats["groups_fetched"] += len(members)
        return {
            (s, g): reader.decode(g, blob[g_start - start : g_end - start])
            for g, (g_start, g_end) in members
        }

    def _remember(self, key: _GroupKey, rows: np.ndarray) -> None:
        if key in self._cache or rows.nbytes > self._cache_bytes:
            return
        self._cache[key] = rows
        self._cached_bytes += rows.nbytes
        while self._cached_bytes > self._cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self._cached_bytes -= evicted.nbytes

    def _map(self, fn: Any, items: list[Any]) -> list[Any]:
        if self._pool is None or len(items) < 2:
            return [fn(item) for item in items]
        return list(self._pool.map(fn, items))
