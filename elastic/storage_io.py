"""Baton's one storage layer: local paths and ``s3://`` behind fsspec, never lying, never hanging.

Import rule (kept true by ``tests/test_storage_io.py``)
-------------------------------------------------------
This module is a *leaf*: it imports the standard library, fsspec, and from Baton only
``elastic.errors``, ``elastic.retry`` and ``elastic.s3_multipart``, which import nothing but the
standard library.
``elastic/__init__`` loads its submodules lazily, so ``import elastic.storage_io`` pulls in
neither torch nor Ray. That is what lets ``data_state`` use it without depending on the rest of
``elastic`` (and ``elastic`` never imports ``data_state``). No other Baton module imports fsspec
or s3fs: every byte Baton stores or loads (snapshots, the lease, datasets, metrics, probes)
goes through a ``Storage``.

Contract
--------
``Storage(uri, storage_options=None, *, timeout_s=30.0, retry_deadline_s=60.0)``: one
filesystem root. ``uri`` is a local path, ``file://PATH`` or ``s3://bucket/prefix``; any other
scheme raises ``ValueError``. ``root`` is ``uri`` as a path of that filesystem (local: absolute)
and ``path(*parts)`` joins under it; every method takes such a path (URIs stay ``str``: a
``Path`` would collapse the ``//`` of ``s3://``).

* **S3 settings** come from the standard AWS environment; the endpoint is
  ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``, passed explicitly so that a filesystem
  cached by fsspec for another endpoint is never handed back. Explicit ``storage_options`` win.
  Listings are never cached (a cached "not there" would be a lie about a commit).
* **Deadlines and retries.** Every S3 request runs under ``elastic.retry.call_with_retries``
  (which failures are transient, backoff, ``StorageUnavailableError`` when the deadline
  passes, definite errors raised at once, as is). One attempt gives up after ``timeout_s``,
  plus ``nbytes / MIN_BYTES_PER_S`` for a transfer of known size so a large object gets the
  time its bytes need: fsspec's ``sync(..., timeout=)`` cancels it however the endpoint
  misbehaves (accepts TCP and never answers, trickles bytes). A whole call, retries included,
  ends within about ``retry_deadline_s`` (plus the same transfer allowance). botocore's and
  s3fs's own retry loops are off (one HTTP attempt per s3fs call); the policy is
  ``storage.retry`` (a ``RetryPolicy``, time injectable). Local paths: one plain call, no
  deadline, no retries.
* **Exact reads.** ``read_range(path, start, end)`` returns exactly ``end - start`` bytes or
  raises: fewer bytes from an object long enough is a transient cut-short response
  (``ShortReadError``, retried); an object that ends before ``end`` is a definite
  ``TruncatedError`` (a ``SnapshotIntegrityError``, never retried). ``read_file`` is one GET
  of a whole (small) object, its length checked against the response's Content-Length.
* **Range merging.** ``read_ranges(path, ranges)`` fetches many ranges of one object with few
  requests: ranges whose gap is at most ``hole_limit`` are read as one span (``merge_ranges``),
  a span never grows past ``MAX_SPAN_BYTES``. ``hole_limit`` is ``MERGE_HOLE_BYTES`` on S3 and 0
  on local disk (see the constants for why).
* **Atomic writes.** ``write_file(path, data)``: local bytes go to ``NAME.tmp-*`` in the same
  directory, are fsync'ed, renamed over ``NAME``, and the directory is fsync'ed
  (``durable=False`` skips both fsyncs, for probes); a crash leaves at most a temporary file,
  never a partial ``NAME``. S3: an object smaller than ``multipart_threshold`` is one ``PUT``
  (one ``bytes`` copy of it); a larger one is a multipart upload (``elastic.s3_multipart``:
  parts of ``part_bytes`` sent by ``part_concurrency`` threads, each part retried on its
  own, no copy of the whole object; the object appears at completion, and any failure
  aborts the upload, so it never appears partial). ``mid_write`` is a fault-injection hook
  (called after half the bytes went to the temporary file or up as parts, or before the
  PUT).
* **Create-only writes** (``exclusive=True``) raise ``FileExistsError`` if the name exists.
  Local: ``os.link(tmp, NAME)`` (atomic; the existing file is untouched), or ``O_EXCL`` on a
  filesystem without hard links (there a reader may briefly see a partial file). S3: a HEAD
  check, then a conditional ``PUT`` with ``If-None-Match: *`` (AWS S3 and moto refuse it
  atomically with 412; a multipart upload's completion carries the same condition). A lost
  answer makes the outcome ambiguous (a retry, or aiohttp's
  silent resend of a PUT on a dropped keep-alive connection, then meets our own object), so
  when the conditional PUT is refused, or a retry's HEAD finds the object, its bytes are
  compared with ours: equal counts as our create, different raises ``FileExistsError``. So a
  concurrent writer of byte-identical content is indistinguishable from us; callers that
  must tell writers apart put a unique token in the content. *On stores without conditional
  writes* only the HEAD check remains: two writers racing between HEAD and PUT can both
  succeed (last PUT wins). A store that rejects the header (501) raises ``OSError``; it never
  silently overwrites.
* **Listing and deleting.** ``listdir`` (names directly under a directory, ``[]`` when it is
  absent), ``find`` (every object below, relative name -> size), ``exists``/``isfile``/
  ``isdir``/``size``, ``remove`` (a missing name is not an error), ``remove_many``,
  ``remove_tree``, ``copy``, ``makedirs`` (S3 has no directories: a no-op there).
* ``s3_request(what, path, operation, **params)``: one raw S3 API call (e.g. a conditional
  ``put_object``) under the same deadlines and retries, for callers that need S3 semantics
  fsspec does not expose (the run lease). A response body is read whole inside the attempt.
* **Reads into buffers.** ``read_into(path, [(offset, [buffer, ...]), ...])`` fills
  caller-owned buffers (e.g. the memory of the tensors a restore loads) with exact reads:
  local ``preadv`` straight into them; S3 spans merged as above, copied in, except that a
  span's holes stay at most ``READ_INTO_MAX_WASTE`` (1/16) of the bytes it wants.
* **Buffer writes.** ``write_file`` takes ``bytes`` or any buffer (a ``memoryview`` of a
  tensor's memory): locally it is written as is, without a copy; an S3 ``PUT`` gets one
  ``bytes`` copy, a multipart upload one copy per part in flight.
* ``stats`` counts reads and writes, so tests can show that a restore touched no storage.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec
import fsspec.asyn

from elastic.errors import SnapshotIntegrityError
from elastic.retry import RetryPolicy, ShortReadError, call_with_retries, http_error
from elastic.s3_multipart import MIN_PART_BYTES, multipart_upload

T = TypeVar("T")

# Ranges of one object closer than this are read as one span on S3. An object store charges a
# fixed latency per request (about 8 ms against the moto server on this machine, tens of ms on
# real S3) and streams hundreds of MB/s after it, so reading a hole of a few MB is cheaper than
# a second request. Local random reads cost no request latency: there the hole is 0 (only
# adjacent or overlapping ranges merge), so nothing is read that was not asked for.
MERGE_HOLE_BYTES = 4 << 20
# ``read_into`` (a snapshot restore's reads) merges ranges only while a span's holes stay at
# most this fraction of the bytes it wants: a resharded restore asks for every other piece of
# a file (the halves of chunks another rank needs lie between), and reading those holes would
# double its bytes.
READ_INTO_MAX_WASTE = 1 / 16
# One merged span never grows past this (a single range larger than it is read as is), so the
# memory a merged read holds stays bounded.
MAX_SPAN_BYTES = 64 << 20
# A transfer is allowed timeout_s plus its bytes at this rate: a 1 GiB shard must not be killed
# by a deadline meant to catch a silent endpoint.
MIN_BYTES_PER_S = 8 << 20
# S3 objects at least this large go up as multipart uploads, in parts of PART_BYTES sent by
# PART_CONCURRENCY threads: one S3 connection streams ~50-100 MB/s, so a multi-GB shard needs
# several, and a failed part is re-sent alone. Memory: PART_CONCURRENCY x PART_BYTES.
MULTIPART_THRESHOLD_BYTES = 128 << 20
PART_BYTES = 64 << 20
PART_CONCURRENCY = 4

_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # the first one set wins
_NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP)


class TruncatedError(SnapshotIntegrityError):
    """An object ends before the bytes asked for: definite, never retried."""


@dataclass
class IOStats:
    range_reads: int = 0
    bytes_read: int = 0
    files_written: int = 0


def merge_ranges(ranges: Sequence[tuple[int, int]], *, hole_limit: int,
                 max_waste: float | None = None) -> list[tuple[int, int, list[int]]]:
    """Group byte ranges of one object into spans ``(start, end, indices of member ranges)``.

    Ranges are taken by start; a range joins the current span when the gap to it is at most
    ``hole_limit`` and the span stays within ``MAX_SPAN_BYTES`` and, with ``max_waste``, when
    the span's holes stay at most ``max_waste`` times the bytes its members want (so what is
    read is at most ``1 + max_waste`` times what is asked for, however small the ranges)."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i])
    spans: list[tuple[int, int, list[int]]] = []
    holes = wanted = 0  # of the current span
    for i in order:
        start, end = ranges[i]
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range ({start}, {end})")
        if spans:
            s_start, s_end, members = spans[-1]
            hole, more = max(0, start - s_end), max(0, end - max(start, s_end))
            if start - s_end <= hole_limit and max(end, s_end) - s_start <= MAX_SPAN_BYTES \
                    and (max_waste is None or holes + hole <= max_waste * (wanted + more)):
                members.append(i)
                spans[-1] = (s_start, max(end, s_end), members)
                holes, wanted = holes + hole, wanted + more
                continue
        spans.append((start, end, [i]))
        holes, wanted = 0, end - start
    return spans


class Storage:
    """One filesystem root (local or ``s3://``); see the module contract."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None, *,
                 timeout_s: float = 30.0, retry_deadline_s: float = 60.0,
                 multipart_threshold: int | None = None, part_bytes: int | None = None,
                 part_concurrency: int | None = None) -> None:
        if timeout_s <= 0 or retry_deadline_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) and retry_deadline_s "
                             f"({retry_deadline_s}) must be positive")
        # Read at construction (not as default values) so a test can lower the module's.
        self.multipart_threshold = MULTIPART_THRESHOLD_BYTES if multipart_threshold is None \
            else multipart_threshold
        self.part_bytes = PART_BYTES if part_bytes is None else part_bytes
        self.part_concurrency = PART_CONCURRENCY if part_concurrency is None \
            else part_concurrency
        if self.part_bytes < MIN_PART_BYTES or self.part_concurrency < 1:
            raise ValueError(f"part_bytes ({self.part_bytes}) must be at least "
                             f"{MIN_PART_BYTES} (S3's minimum part) and "
                             f"part_concurrency ({self.part_concurrency}) at least 1")
        self.is_local, self.root = _locate(uri)
        self.uri = uri.rstrip("/") or "/"
        self.timeout_s = float(timeout_s)
        self.retry = RetryPolicy(deadline_s=float(retry_deadline_s))
        options = dict(storage_options or {})
        if self.is_local:
            self.fs: Any = fsspec.filesystem("file", **options)
        else:
            self.fs = fsspec.filesystem("s3", **_s3_options(options, self.timeout_s))
            # One attempt per s3fs call: our retry loop owns retrying, under one deadline.
            self.fs.retries = 1
        self.hole_limit = 0 if self.is_local else MERGE_HOLE_BYTES
        self.stats = IOStats()
        self._stats_lock = threading.Lock()

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *(p.strip("/") for p in parts)])

    # ------------------------------------------------------------------ plumbing

    def _io(self, what: str, path: str, attempt: Callable[[float | None], T], *,
            nbytes: int = 0) -> T:
        """Local: one plain call. S3: ``attempt(timeout)`` under the retry policy."""
        if self.is_local:
            return attempt(None)
        transfer_s = nbytes / MIN_BYTES_PER_S
        return call_with_retries(attempt, what=what, path=path, policy=self.retry,
                                 attempt_s=self.timeout_s + transfer_s, extra_s=transfer_s)

    def _aio(self, timeout: float | None, method: Callable[..., Any], *args: Any,
             **kwargs: Any) -> Any:
        """Run one s3fs coroutine on fsspec's loop; ``timeout`` cancels it (FSTimeoutError)."""
        return fsspec.asyn.sync(self.fs.loop, method, *args, timeout=timeout, **kwargs)

    def _count(self, *, read: int | None = None, written: int = 0) -> None:
        with self._stats_lock:
            if read is not None:
                self.stats.range_reads += 1
                self.stats.bytes_read += read
            self.stats.files_written += written

    # ------------------------------------------------------------------ reads

    def read_file(self, path: str) -> bytes:
        """The whole object at ``path`` (meant for small files: one GET under ``timeout_s``)."""
        def attempt(timeout: float | None) -> bytes:
            if self.is_local:
                with open(path, "rb") as fh:
                    return fh.read()
            bucket, key, _ = self.fs.split_path(path)
            # One GET (s3fs's cat would HEAD first and split large objects), checked whole.
            resp = self._aio(timeout, self._get, Bucket=bucket, Key=key)
            return resp["Body"]

        data = self._io("read", path, attempt)
        self._count(read=len(data))
        return data

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Exactly bytes ``[start, end)`` of ``path`` (see "Exact reads")."""
        if start < 0 or end < start:
            raise ValueError(f"{path}: invalid byte range ({start}, {end})")

        def attempt(timeout: float | None) -> bytes:
            if self.is_local:
                with open(path, "rb") as fh:
                    fh.seek(start)
                    data = fh.read(end - start)
            elif end == start:
                data = b""
            else:
                try:
                    data = bytes(self._aio(timeout, self.fs._cat_file, path, start=start,
                                           end=end))
                except OSError as err:
                    if not _range_refused(err):
                        raise
                    data = b""  # S3 refuses a range that starts past the end (416)
            if len(data) != end - start:
                self._short_read(path, start, end, len(data), timeout)
            return data

        data = self._io("read", path, attempt, nbytes=end - start)
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
        wants = [(offset, offset + sum(len(b) for b in bufs)) for offset, bufs in reads]
        if not self.is_local:
            for start, end, members in merge_ranges(wants, hole_limit=self.hole_limit,
                                                    max_waste=READ_INTO_MAX_WASTE):
                span = memoryview(self.read_range(path, start, end))
                for i in members:
                    pos = wants[i][0] - start
                    for buf in reads[i][1]:
                        buf[:] = span[pos: pos + len(buf)]
                        pos += len(buf)
            return
        with open(path, "rb") as fh:
            for (offset, bufs), (start, end) in zip(reads, wants, strict=True):
                got = _preadv_exact(fh, list(bufs), offset)
                if got != end - start:
                    self._short_read(path, start, end, got, None)
                self._count(read=got)

    def _short_read(self, path: str, start: int, end: int, got: int,
                    timeout: float | None) -> None:
        """Fewer bytes than asked: the object is truncated (definite) or the answer was cut
        short (transient, retried)."""
        size = os.path.getsize(path) if self.is_local else self._size(path, timeout)
        if size < end:
            raise TruncatedError(
                f"{path}: wanted bytes [{start}, {end}) but the file ends at {size}; truncated")
        raise ShortReadError(errno.EIO, f"got {got} of {end - start} bytes; response cut short",
                             path)

    async def _get(self, **params: Any) -> dict[str, Any]:
        """One ``get_object``; the body read whole and checked against Content-Length."""
        resp = await self.fs._call_s3("get_object", **params)
        async with resp["Body"] as body:
            data = await body.read()
        want = resp.get("ContentLength")
        if want is not None and len(data) != int(want):
            raise ShortReadError(errno.EIO, f"got {len(data)} of {want} bytes; response cut "
                                 "short", f"{params.get('Bucket')}/{params.get('Key')}")
        return {**resp, "Body": bytes(data)}

    def _info(self, path: str, timeout: float | None) -> dict[str, Any] | None:
        """One uncached HEAD (or listing for a prefix); None when nothing is there."""
        try:
            return self._aio(timeout, self.fs._info, path, refresh=True)
        except FileNotFoundError:
            return None

    def _head(self, path: str, timeout: float | None) -> dict[str, Any] | None:
        """One HEAD of an object (no listing fallback); None when it is absent."""
        bucket, key, _ = self.fs.split_path(path)
        try:
            return self._aio(timeout, self.fs._call_s3, "head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None

    def _size(self, path: str, timeout: float | None) -> int:
        info = self._info(path, timeout)
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", path)
        return int(info["size"])

    def _kind(self, path: str) -> str | None:
        """"file", "directory" or None (nothing there)."""
        if self.is_local:
            return ("directory" if os.path.isdir(path) else
                    "file" if os.path.exists(path) else None)
        info = self._io("exists", path, lambda t: self._info(path, t))
        return None if info is None else str(info.get("type", "file"))

    def exists(self, path: str) -> bool:
        return self._kind(path) is not None

    def isfile(self, path: str) -> bool:
        return self._kind(path) == "file"

    def isdir(self, path: str) -> bool:
        return self._kind(path) == "directory"

    def size(self, path: str) -> int:
        if self.is_local:
            return os.path.getsize(path)
        return self._io("size", path, lambda t: self._size(path, t))

    def listdir(self, directory: str) -> list[str]:
        """Names (last path component) directly under ``directory``, sorted; [] when absent."""
        def attempt(timeout: float | None) -> list[str]:
            try:
                if self.is_local:
                    return sorted(os.listdir(directory))
                entries = self._aio(timeout, self.fs._ls, directory, detail=False, refresh=True)
            except (FileNotFoundError, NotADirectoryError):
                return []
            return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

        return self._io("list", directory, attempt)

    def find(self, directory: str) -> dict[str, int]:
        """Every file under ``directory`` (recursively): relative name -> size."""
        def attempt(timeout: float | None) -> dict[str, Any]:
            if self.is_local:
                return self.fs.find(directory, detail=True)
            return self._aio(timeout, self.fs._find, directory, detail=True)

        found = self._io("list", directory, attempt)
        prefix = directory.rstrip("/") + "/"
        return {name[len(prefix):]: int(info.get("size", 0)) for name, info in found.items()
                if name.startswith(prefix) and info.get("type") != "directory"}

    # ------------------------------------------------------------------ writes

    def write_file(self, path: str, data: bytes | memoryview, *, durable: bool = True,
                   mid_write: Callable[[], None] | None = None,
                   exclusive: bool = False) -> None:
        """Atomically create or replace ``path`` with ``data`` (``exclusive``: create only,
        ``FileExistsError`` if it exists); see "Atomic writes" and "Create-only writes"."""
        view = memoryview(data).cast("B")
        if self.is_local:
            _write_local(path, view, durable=durable, mid_write=mid_write, exclusive=exclusive)
        elif len(view) >= self.multipart_threshold:
            request = functools.partial(self.s3_request, "write", path)
            multipart_upload(request, view, part_bytes=self.part_bytes,
                             concurrency=self.part_concurrency, exclusive=exclusive,
                             mid_write=mid_write)
        else:
            if mid_write is not None:
                mid_write()
            self._write_s3(path, data if isinstance(data, bytes) else view.tobytes(),
                           exclusive=exclusive)
        self._count(written=1)

    def _write_s3(self, path: str, data: bytes, *, exclusive: bool) -> None:
        tries = 0

        def attempt(timeout: float | None) -> None:
            nonlocal tries
            tries += 1
            if exclusive and self._head(path, timeout) is not None:
                # Found before our PUT: ours only if an earlier attempt landed unanswered.
                if tries > 1 and self._holds(path, data, timeout):
                    return
                raise FileExistsError(errno.EEXIST, "exists (checked before PUT)", path)
            try:
                self._aio(timeout, self.fs._pipe_file, path, data,
                          mode="create" if exclusive else "overwrite")
            except FileExistsError:
                # Refused by the store; but aiohttp resends an idempotent PUT on a dropped
                # keep-alive connection, so the refused PUT may be the echo of our own.
                if self._holds(path, data, timeout):
                    return
                raise

        self._io("write", path, attempt, nbytes=len(data))

    def _holds(self, path: str, data: bytes, timeout: float | None) -> bool:
        head = self._head(path, timeout)
        if head is None or int(head.get("ContentLength", -1)) != len(data):
            return False
        bucket, key, _ = self.fs.split_path(path)
        return self._aio(timeout, self._get, Bucket=bucket, Key=key)["Body"] == data

    def makedirs(self, directory: str) -> None:
        """Local: ``mkdir -p``. S3 has no directories (a prefix exists once an object does)."""
        if self.is_local:
            os.makedirs(directory, exist_ok=True)

    def remove(self, path: str) -> None:
        """Delete one file; a missing one is not an error."""
        def attempt(timeout: float | None) -> None:
            try:
                if self.is_local:
                    os.remove(path)
                else:
                    self._aio(timeout, self.fs._rm_file, path)
            except FileNotFoundError:
                pass

        self._io("delete", path, attempt)

    def remove_many(self, paths: Sequence[str]) -> None:
        if self.is_local:
            for p in paths:
                self.remove(p)
            return
        for i in range(0, len(paths), 1000):  # DeleteObjects takes at most 1000 keys
            self._delete_batch(list(paths[i:i + 1000]))

    def _delete_batch(self, batch: list[str]) -> None:
        self._io("delete", batch[0], lambda t: self._aio(t, self.fs._bulk_delete, batch))

    def remove_tree(self, directory: str) -> None:
        """Delete ``directory`` and everything below it (nothing there is not an error)."""
        if self.is_local:
            if os.path.isdir(directory):
                self.fs.rm(directory, recursive=True)
            return
        self.remove_many([f"{directory.rstrip('/')}/{n}" for n in self.find(directory)])

    def copy(self, source: str, target: str, *, nbytes: int = 0) -> None:
        """Copy one file (S3: a server-side copy; ``nbytes`` sizes its deadline)."""
        if self.is_local:
            self.fs.copy(source, target)
            return
        self._io("copy", source, lambda t: self._aio(t, self.fs._cp_file, source, target),
                 nbytes=nbytes)

    # ------------------------------------------------------------------ raw S3

    def s3_request(self, what: str, path: str, operation: str, **params: Any) -> dict[str, Any]:
        """One S3 API ``operation`` on the object at ``path`` under the deadlines and
        retries; a ``get_object`` body comes back read whole (bytes, length checked)."""
        if self.is_local:
            raise ValueError(f"{path}: {operation} is an S3 request; this storage is local")
        bucket, key, _ = self.fs.split_path(path)
        params = {"Bucket": bucket, "Key": key, **params}
        nbytes = len(params.get("Body", b""))

        def attempt(timeout: float | None) -> dict[str, Any]:
            if operation == "get_object":
                return self._aio(timeout, self._get, **params)
            return self._aio(timeout, self.fs._call_s3, operation, **params)

        try:
            return self._io(what, path, attempt, nbytes=nbytes)
        finally:
            self.fs.invalidate_cache(path)


# ---------------------------------------------------------------------- helpers


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


def _range_refused(err: BaseException) -> bool:
    code, status = http_error(err.__cause__ or err)
    return status == 416 or code in ("InvalidRange", "416") or "InvalidRange" in str(err)


def _preadv_exact(fh: Any, bufs: list[memoryview], offset: int) -> int:
    """Read into ``bufs`` from ``offset`` until they are full or the file ends; the bytes
    read. One ``preadv`` fills several buffers; the loop covers short reads."""
    bufs = [b.cast("B") if b.format != "B" else b for b in bufs if len(b)]
    total = 0
    while bufs:
        if hasattr(os, "preadv"):
            n = os.preadv(fh.fileno(), bufs, offset)
        else:  # no preadv on this platform: one buffer at a time
            fh.seek(offset)
            n = fh.readinto(bufs[0]) or 0
        if n <= 0:
            break
        total, offset = total + n, offset + n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs.pop(0))
        if n:
            bufs[0] = bufs[0][n:]
    return total


def _write_local(path: str, view: memoryview, *, durable: bool,
                 mid_write: Callable[[], None] | None, exclusive: bool) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as fh:
            half = len(view) // 2
            fh.write(view[:half])
            if mid_write is not None:
                fh.flush()
                mid_write()
            fh.write(view[half:])
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        if exclusive:
            _link_exclusive(tmp, path, view, durable=durable)
        else:
            os.replace(tmp, path)
    finally:
        # No temp file stays behind a completed, refused or failed write; a crash still may.
        if os.path.exists(tmp):
            os.unlink(tmp)
    if durable:
        fsync_dir(directory)


def _link_exclusive(tmp: str, path: str, view: memoryview, *, durable: bool) -> None:
    try:
        os.link(tmp, path)  # atomic; EEXIST -> FileExistsError, the old file untouched
    except OSError as err:
        if isinstance(err, FileExistsError) or err.errno not in _NO_HARD_LINKS:
            raise
        # A filesystem without hard links: O_EXCL is atomic too, but a reader can see the
        # file before its bytes are all there.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, view)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)


def _s3_options(options: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Our deadlines (botocore's retries off), fresh listings and the endpoint from the
    standard AWS environment variables, all as defaults under the caller's options."""
    config = {"connect_timeout": min(timeout_s, 10.0), "read_timeout": timeout_s,
              # One HTTP attempt per call: call_with_retries retries, under one deadline.
              "retries": {"max_attempts": 1, "mode": "standard"}}
    options["config_kwargs"] = {**config, **options.get("config_kwargs", {})}
    options.setdefault("use_listings_cache", False)
    endpoint = next((os.environ[k] for k in _ENDPOINT_ENV if os.environ.get(k)), None)
    client_kwargs = options.get("client_kwargs", {})
    if endpoint and "endpoint_url" not in client_kwargs and "endpoint_url" not in options:
        options["client_kwargs"] = {**client_kwargs, "endpoint_url": endpoint}
    return options


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable; filesystems that refuse are ignored."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
