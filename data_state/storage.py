"""Where dataset bytes live: the data side of Baton's one storage layer.

Every byte of a dataset (shards, `dataset.json`, probes) moves through
`elastic.storage.storage_io.Storage`: local paths and `s3://` URIs, the AWS endpoint from the
environment, deadlines and retries on S3, atomic writes (local: temp + fsync + rename; S3: one
PUT), exact range reads and range merging with one constant (`MERGE_HOLE_BYTES`). That module
is a leaf (it imports only the standard library, fsspec and two standard-library-only elastic
modules, and `elastic/__init__` loads nothing eagerly): `data_state` imports it and nothing
else from Baton, and `elastic` never imports `data_state`.

Contract (what the data side adds on top):
- `resolve(uri, storage_options, *, retry_deadline_s=60.0, follow_links=False)` returns
  `(Storage, root)`; `uri` is a plain local path, `file://...` or `s3://bucket/prefix`
  (anything else: `ValueError` naming the scheme). Below a dataset directory nothing is read,
  written or removed through a link, and only regular files are read (the storage layer's
  rule); `follow_links=True` is for the sources of `baton data prepare` only (a person's own
  files, maybe a cache of links), where links are followed but FIFOs are still refused.
  Explicit `storage_options` win over the environment. On S3 a request that keeps failing
  transiently raises `StorageUnavailableError` (an `OSError`) after `retry_deadline_s`.
- `read_span(io, path, start, end)` returns exactly bytes `[start, end)`; a missing or
  truncated file is a `DatasetError` naming it and the fix.
- `write_atomic(io, path, data)`: the file appears whole or not at all.
- `RangeFile(size, fetch, held=())`: a seekable read-only file of `size` bytes whose reads are
  answered from `held` `(offset, bytes)` pieces when one covers them, else by
  `fetch(start, end)` (e.g. an exact `Storage.read_range`); what pyarrow and `io.BufferedReader`
  read through.
- `merge_ranges(ranges, hole_limit=)` is the layer's; `Storage.hole_limit` is its default
  (0 on local disk, `MERGE_HOLE_BYTES` on S3).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from data_state.manifest import DatasetError
from elastic.storage import (
    MERGE_HOLE_BYTES,
    Storage,
    TruncatedError,
    merge_ranges,
)

__all__ = ["MERGE_HOLE_BYTES", "RangeFile", "Storage", "TruncatedError", "join", "merge_ranges",
           "read_span", "resolve", "write_atomic"]


def resolve(uri: str, storage_options: Mapping[str, Any] | None = None, *,
            retry_deadline_s: float = 60.0, follow_links: bool = False) -> tuple[Storage, str]:
    """The storage holding `uri` and the path of `uri` inside it (no trailing slash)."""
    if not uri:
        raise ValueError("dataset URI is empty: pass a local directory or s3://bucket/prefix")
    try:
        io = Storage(uri, dict(storage_options or {}), retry_deadline_s=retry_deadline_s,
                     follow_links=follow_links)
    except ValueError as err:
        if "unsupported URI scheme" not in str(err):
            raise
        scheme = uri.partition("://")[0]
        raise ValueError(f"unsupported dataset URI scheme {scheme!r} in {uri!r}: use a local "
                         "path or s3://") from None
    return io, io.root


def join(path: str, *parts: str) -> str:
    return "/".join([path.rstrip("/"), *(p.strip("/") for p in parts)])


def write_atomic(io: Storage, path: str, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old state or all of `data`."""
    io.write_file(path, data)


def read_span(io: Storage, path: str, start: int, end: int) -> bytes:
    """Bytes `[start, end)` of `path`; `DatasetError` naming the file if they are not there."""
    try:
        return io.read_range(path, start, end)
    except FileNotFoundError:
        raise DatasetError(
            f"{path} is missing (it was there when the dataset was opened): copy it back or "
            "prepare the dataset again"
        ) from None
    except TruncatedError as err:
        raise DatasetError(
            f"short read from {path}: {err}; the file is truncated or was replaced: prepare "
            "the dataset again"
        ) from None


class RangeFile(io.RawIOBase):
    """A read-only, seekable file served from held pieces, falling back to `fetch` (contract
    above)."""

    def __init__(self, size: int, fetch: Callable[[int, int], bytes],
                 held: Sequence[tuple[int, bytes]] = ()) -> None:
        super().__init__()
        self._size, self._fetch, self._held, self._pos = size, fetch, held, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._pos + size)
        start, self._pos = self._pos, max(self._pos, end)
        if end <= start:
            return b""
        for piece_start, piece in self._held:
            if piece_start <= start and end <= piece_start + len(piece):
                return piece[start - piece_start : end - piece_start]
        return self._fetch(start, end)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)
