"""``Storage``: local paths and ``s3://`` behind one interface, never lying, never hanging; what
every caller of the storage layer (``elastic.storage``, whose face gives its import rule) uses.

``Storage(uri, storage_options=None, *, timeout_s=30.0, retry_deadline_s=60.0)``: one root,
``uri`` a local path (made absolute), ``file://PATH`` or ``s3://bucket/prefix`` (else
``ValueError``); ``path(*parts)`` joins under it as ``str`` (a ``Path`` collapses ``s3://``).

* **S3 settings, deadlines, retries, conditional writes**: ``elastic.storage.s3_files``. Local
  paths: one plain call, no deadline, no retries.
* **Exact reads.** ``read_range(path, start, end)`` returns exactly ``end - start`` bytes or
  raises: fewer from an object long enough is a transient ``ShortReadError`` (retried on S3);
  an object ending before ``end`` a definite ``TruncatedError`` (a ``SnapshotIntegrityError``).
  ``read_file``: one GET of a small object, longer than ``max_bytes`` refused unread.
* **One rule for every caller.** Below ``root`` no local entry is acted on through a link, and
  only regular files are read, opened non-blocking (``plain_files``: ``RefusedEntryError``);
  ``read_json(path, where=...)``, bounded (``json_bounds``: one-line ``JSONBoundsError``), is the
  one way to read a run's or dataset's JSON. ``follow_links=True``: a person's own inputs only.
* **Ranges.** ``read_ranges`` merges ranges into few requests (holes up to ``MERGE_HOLE_BYTES``
  on S3, none locally); ``read_into(path, [(offset, [buffer, ...]), ...])`` fills caller-owned
  buffers exactly (local ``preadv``; S3 spans wasting at most ``READ_INTO_MAX_WASTE``, 1/16).
* **Atomic writes.** ``write_file(path, data)`` (bytes or any buffer) never leaves a partial
  ``path``: locally a fsynced temporary file renamed over it, no copy (``durable=False`` skips
  the fsyncs, for probes; ``spare_dir`` reuses a spare file, ``elastic.storage.spares``); on S3
  one ``PUT`` or, from ``multipart_threshold``, a multipart upload. ``mid_write``: a fault hook.
  ``exclusive=True`` raises ``FileExistsError`` if the name exists (local: a hard link; S3: a
  conditional PUT, an ambiguous outcome settled by comparing bytes, so callers that must tell
  writers apart put a unique token in the content).
* ``listdir`` (``[]`` when absent), ``find`` (name -> size), ``exists``/``isfile``/``isdir``/
  ``size``, ``remove`` (missing is fine), ``remove_many``, ``remove_tree``, ``copy``, ``makedirs``
  (no-op on S3); ``s3_request``: one raw S3 call (the lease's); ``stats`` counts reads, writes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from elastic.storage.byte_ranges import MERGE_HOLE_BYTES, READ_INTO_MAX_WASTE, merge_ranges
from elastic.storage.json_bounds import MAX_JSON_BYTES
from elastic.storage.json_bounds import loads as loads_json
from elastic.storage.local_files import LocalFiles
from elastic.storage.s3_files import S3Files
from elastic.storage.s3_multipart import MIN_PART_BYTES

# S3 objects at least this large go up as multipart uploads, in parts of PART_BYTES sent by
# PART_CONCURRENCY threads: one S3 connection streams ~50-100 MB/s, so a multi-GB shard needs
# several, and a failed part is re-sent alone. Memory: PART_CONCURRENCY x PART_BYTES.
MULTIPART_THRESHOLD_BYTES = 128 << 20
PART_BYTES = 64 << 20
PART_CONCURRENCY = 4


@dataclass
class IOStats:
    range_reads: int = 0
    bytes_read: int = 0
    files_written: int = 0


class Storage:
    """One filesystem root (local or ``s3://``); see the module contract."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None, *,
                 timeout_s: float = 30.0, retry_deadline_s: float = 60.0,
                 multipart_threshold: int | None = None, part_bytes: int | None = None,
                 part_concurrency: int | None = None, follow_links: bool = False) -> None:
        if timeout_s <= 0 or retry_deadline_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) and retry_deadline_s "
                             f"({retry_deadline_s}) must be positive")
        # Read at construction (not as default values) so a test can lower the module's.
        threshold = MULTIPART_THRESHOLD_BYTES if multipart_threshold is None \
            else multipart_threshold
        part = PART_BYTES if part_bytes is None else part_bytes
        concurrency = PART_CONCURRENCY if part_concurrency is None else part_concurrency
        if part < MIN_PART_BYTES or concurrency < 1:
            raise ValueError(f"part_bytes ({part}) must be at least {MIN_PART_BYTES} (S3's "
                             f"minimum part) and part_concurrency ({concurrency}) at least 1")
        self.is_local, self.root = _locate(uri)
        self.uri = uri.rstrip("/") or "/"
        options = dict(storage_options or {})
        self._files: LocalFiles | S3Files = LocalFiles(
            options, self.root, follow=follow_links) if self.is_local else S3Files(
            options, timeout_s=float(timeout_s), retry_deadline_s=float(retry_deadline_s),
            multipart_threshold=threshold, part_bytes=part, part_concurrency=concurrency)
        self.fs: Any = self._files.fs
        self.hole_limit = 0 if self.is_local else MERGE_HOLE_BYTES
        self.stats = IOStats()
        self._stats_lock = threading.Lock()

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *(p.strip("/") for p in parts)])

    def _count(self, *, read: int | None = None, written: int = 0) -> None:
        with self._stats_lock:
            if read is not None:
                self.stats.range_reads += 1
                self.stats.bytes_read += read
            self.stats.files_written += written

    # ------------------------------------------------------------------ reads

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """The whole object at ``path`` (meant for small files: one GET under ``timeout_s``);
        a local one only as a regular file reached without a link (module contract); more
        than ``max_bytes`` is refused before it is read."""
        data = self._files.read_file(path, max_bytes)
        self._count(read=len(data))
        return data

    def read_json(self, path: str, *, where: str | None = None,
                  max_bytes: int = MAX_JSON_BYTES, nonfinite: bool = False) -> Any:
        """The JSON value of the file at ``path``, read and parsed within bounds (module
        contract): ``JSONBoundsError`` (a ``ValueError``, one line starting with ``where``,
        default the path) for a file too large, malformed, too deep or with numbers out of
        range; ``OSError`` when it cannot be read (``FileNotFoundError``, a refused entry)."""
        where = where or path
        return loads_json(self.read_file(path, max_bytes=max_bytes), where,
                          max_bytes=max_bytes, nonfinite=nonfinite)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Exactly bytes ``[start, end)`` of ``path`` (see "Exact reads")."""
        if start < 0 or end < start:
            raise ValueError(f"{path}: invalid byte range ({start}, {end})")
        data = self._files.read_range(path, start, end)
        self._count(read=len(data))
        return data

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]], *,
                    hole_limit: int | None = None) -> list[bytes]:
        """The bytes of each range, in the order given, read as merged spans."""
        out: list[bytes] = [b""] * len(ranges)
        hole = self.hole_limit if hole_limit is None else hole_limit
        for start, end, members in merge_ranges(ranges, hole_limit=hole):
            view = memoryview(self.read_range(path, start, end))
            for i in members:
                out[i] = bytes(view[ranges[i][0] - start: ranges[i][1] - start])
        return out

    def read_into(self, path: str, reads: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        """Fill buffers with bytes of ``path``: each read is ``(offset, buffers)`` and its
        buffers take consecutive bytes from ``offset`` on, exactly as many as they hold (else
        ``TruncatedError``). Local: ``preadv`` straight into the buffers, no intermediate
        copy. S3: the ranges are fetched as merged spans (like ``read_ranges``) and copied
        into the buffers."""
        if isinstance(self._files, LocalFiles):
            self._files.read_into(path, reads, lambda got: self._count(read=got))
            return
        wants = [(offset, offset + sum(len(b) for b in bufs)) for offset, bufs in reads]
        for start, end, members in merge_ranges(wants, hole_limit=self.hole_limit,
                                                max_waste=READ_INTO_MAX_WASTE):
            span = memoryview(self.read_range(path, start, end))
            for i in members:
                pos = wants[i][0] - start
                for buf in reads[i][1]:
                    buf[:] = span[pos: pos + len(buf)]
                    pos += len(buf)

    def exists(self, path: str) -> bool:
        return self._files.kind(path) is not None

    def isfile(self, path: str) -> bool:
        return self._files.kind(path) == "file"

    def isdir(self, path: str) -> bool:
        return self._files.kind(path) == "directory"

    def size(self, path: str) -> int:
        return self._files.size(path)

    def listdir(self, directory: str) -> list[str]:
        """Names (last path component) directly under ``directory``, sorted; [] when absent."""
        return self._files.listdir(directory)

    def find(self, directory: str) -> dict[str, int]:
        """Every file under ``directory`` (recursively): relative name -> size."""
        prefix = directory.rstrip("/") + "/"
        return {name[len(prefix):]: int(info.get("size", 0))
                for name, info in self._files.find(directory).items()
                if name.startswith(prefix) and info.get("type") != "directory"}

    # ------------------------------------------------------------------ writes

    def write_file(self, path: str, data: bytes | memoryview, *, durable: bool = True,
                   mid_write: Callable[[], None] | None = None,
                   exclusive: bool = False, spare_dir: str | None = None) -> None:
        """Atomically create or replace ``path`` with ``data`` (``exclusive``: create only,
        ``FileExistsError`` if it exists); see "Atomic writes" and "Create-only writes".
        ``spare_dir`` (local stores; S3 has no use for it): reuse a spare file from there
        (``elastic.storage.spares``)."""
        if isinstance(self._files, LocalFiles):
            self._files.write(path, data, durable=durable, mid_write=mid_write,
                              exclusive=exclusive, spare_dir=spare_dir)
        else:
            self._files.write(path, data, durable=durable, mid_write=mid_write,
                              exclusive=exclusive)
        self._count(written=1)

    def makedirs(self, directory: str) -> None:
        """Local: ``mkdir -p``. S3 has no directories (a prefix exists once an object does)."""
        self._files.makedirs(directory)

    def remove(self, path: str) -> None:
        """Delete one file; a missing one is not an error."""
        self._files.remove(path)

    def remove_many(self, paths: Sequence[str]) -> None:
        self._files.remove_many(paths)

    def remove_tree(self, directory: str) -> None:
        """Delete ``directory`` and everything below it (nothing there is not an error)."""
        self._files.remove_tree(directory)

    def copy(self, source: str, target: str, *, nbytes: int = 0) -> None:
        """Copy one file (S3: a server-side copy; ``nbytes`` sizes its deadline)."""
        self._files.copy(source, target, nbytes=nbytes)

    # ------------------------------------------------------------------ raw S3

    def s3_request(self, what: str, path: str, operation: str, *,
                   deadline_s: float | None = None, **params: Any) -> dict[str, Any]:
        """One S3 API ``operation`` on the object at ``path`` under the deadlines and
        retries (``deadline_s``: end sooner than ``retry_deadline_s``); a ``get_object`` body
        comes back read whole (bytes, length checked)."""
        if isinstance(self._files, LocalFiles):
            raise ValueError(f"{path}: {operation} is an S3 request; this storage is local")
        return self._files.request(what, path, operation, deadline_s=deadline_s, **params)


def absolute_uri(uri: str) -> str:
    """``uri`` with a relative local path made absolute against this process's working
    directory; ``s3://``/``file://`` URIs and ``""`` unchanged. A driver hands its run and
    dataset locations to workers whose working directory is another (Ray Train's), where a
    relative path would name somewhere else."""
    if not uri or "://" in uri:
        return uri
    return os.path.abspath(uri)


def _locate(uri: str) -> tuple[bool, str]:
    """(is the URI local, its path in its filesystem); ValueError for other schemes."""
    if not uri:
        raise ValueError("storage URI is empty; pass a directory path or s3://bucket/prefix")
    scheme, sep, rest = uri.partition("://")
    if sep and scheme not in ("s3", "s3a", "file", "local"):
        raise ValueError(f"unsupported URI scheme {scheme!r} in {uri!r}: use a local path "
                         "or s3://bucket/prefix")
    if not sep or scheme in ("file", "local"):
        return True, os.path.abspath(rest if sep else uri).rstrip("/") or "/"
    return False, rest.rstrip("/")
