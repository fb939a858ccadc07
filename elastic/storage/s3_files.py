"""S3 objects for the storage layer (``elastic.storage.storage_io``): every request under a
deadline, retried, never lying about what is there.

``S3Files`` does for ``s3://`` objects what ``elastic.storage.local_files.LocalFiles`` does for
local paths (same method names; ``Storage`` picks one by its URI and counts the bytes), through
one s3fs filesystem (``fs``):

* **Settings** from the standard AWS environment; the endpoint (``AWS_ENDPOINT_URL_S3``, else
  ``AWS_ENDPOINT_URL``) is passed explicitly, so fsspec never hands back a filesystem cached for
  another endpoint; explicit options win. Listings are never cached (a cached "not there"
  would be a lie about a commit).
* **Deadlines and retries.** Every request runs under ``elastic.storage.retry.call_with_retries``
  (``call``): an attempt gives up after ``timeout_s`` plus ``nbytes / MIN_BYTES_PER_S`` for a
  transfer of known size (fsspec's ``sync(..., timeout=)`` cancels it however the endpoint
  misbehaves); a whole call ends within about ``retry_deadline_s`` plus that allowance.
  botocore's and s3fs's own retry loops are off.
* **Exact reads.** ``read_file`` is one GET, its length checked against Content-Length (longer
  than ``max_bytes``: refused before the body is read, ``too_large``); ``read_range`` returns
  exactly the bytes asked for (``elastic.storage.byte_ranges.short_read`` judges a short answer:
  a truncated object is definite, a cut-short response retried).
* **Writes.** Below ``multipart_threshold`` one ``PUT`` (one ``bytes`` copy); above, a multipart
  upload (``elastic.storage.s3_multipart``). ``mid_write`` runs after half the parts, or before
  the PUT. ``exclusive``: a HEAD check, then a conditional ``PUT`` (``If-None-Match: *``); a
  refused PUT, or an object a retry's HEAD finds, whose bytes equal ours counts as our own
  create (a lost answer, or aiohttp resending a PUT); different bytes raise ``FileExistsError``.
  On stores without conditional writes only the HEAD check remains.
* ``request(what, path, operation, **params)``: one raw S3 API call under the same deadlines (a
  ``get_object`` body read whole inside the attempt), for what fsspec does not expose.

Imports: stdlib, fsspec (s3fs), ``retry``, ``s3_multipart``, ``byte_ranges``, ``json_bounds``.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import fsspec
import fsspec.asyn

from elastic.storage.byte_ranges import short_read
from elastic.storage.json_bounds import too_large
from elastic.storage.retry import RetryPolicy, ShortReadError, call_with_retries, http_error
from elastic.storage.s3_multipart import multipart_upload

T = TypeVar("T")

# A transfer is allowed timeout_s plus its bytes at this rate: a 1 GiB shard must not be killed
# by a deadline meant to catch a silent endpoint.
MIN_BYTES_PER_S = 8 << 20

_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # the first one set wins


class S3Files:
    """Objects of one S3 endpoint; see the module contract."""

    def __init__(self, options: dict[str, Any], *, timeout_s: float, retry_deadline_s: float,
                 multipart_threshold: int, part_bytes: int, part_concurrency: int) -> None:
        self.timeout_s = timeout_s
        self.retry = RetryPolicy(deadline_s=retry_deadline_s)
        self.multipart_threshold = multipart_threshold
        self.part_bytes = part_bytes
        self.part_concurrency = part_concurrency
        self.fs: Any = fsspec.filesystem("s3", **_s3_options(options, timeout_s))
        # One attempt per s3fs call: our retry loop owns retrying, under one deadline.
        self.fs.retries = 1

    # ------------------------------------------------------------------ plumbing

    def call(self, what: str, path: str, attempt: Callable[[float | None], T], *,
             nbytes: int = 0, deadline_s: float | None = None) -> T:
        """``attempt(timeout)`` under the retry policy and the transfer's deadline;
        ``deadline_s`` shortens both (a call that must end sooner: a lease renew)."""
        transfer_s = nbytes / MIN_BYTES_PER_S
        policy, attempt_s = self.retry, self.timeout_s
        if deadline_s is not None:
            policy = dataclasses.replace(policy, deadline_s=min(policy.deadline_s, deadline_s))
            attempt_s = min(attempt_s, deadline_s)
        return call_with_retries(attempt, what=what, path=path, policy=policy,
                                 attempt_s=attempt_s + transfer_s, extra_s=transfer_s)

    def _aio(self, timeout: float | None, method: Callable[..., Any], *args: Any,
             **kwargs: Any) -> Any:
        """Run one s3fs coroutine on fsspec's loop; ``timeout`` cancels it (FSTimeoutError)."""
        return fsspec.asyn.sync(self.fs.loop, method, *args, timeout=timeout, **kwargs)

    async def _get(self, max_bytes: int | None = None, **params: Any) -> dict[str, Any]:
        """One ``get_object``; the body read whole and checked against Content-Length (an
        object longer than ``max_bytes`` is refused before its body is read)."""
        resp = await self.fs._call_s3("get_object", **params)
        want = resp.get("ContentLength")
        async with resp["Body"] as body:
            if max_bytes is not None and (want is None or int(want) > max_bytes):
                where = f"s3://{params.get('Bucket')}/{params.get('Key')}"
                data = await body.read(max_bytes + 1)
                if want is not None or len(data) > max_bytes:
                    raise too_large(where, int(want) if want is not None else len(data),
                                    max_bytes)
            else:
                data = await body.read()
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

    # ------------------------------------------------------------------ reads

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        def attempt(timeout: float | None) -> bytes:
            bucket, key, _ = self.fs.split_path(path)
            # One GET (s3fs's cat would HEAD first and split large objects), checked whole.
            body: bytes = self._aio(timeout, self._get, max_bytes, Bucket=bucket,
                                    Key=key)["Body"]
            return body

        return self.call("read", path, attempt)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        def attempt(timeout: float | None) -> bytes:
            if end == start:
                return b""
            try:
                data = bytes(self._aio(timeout, self.fs._cat_file, path, start=start, end=end))
            except OSError as err:
                if not _range_refused(err):
                    raise
                data = b""  # S3 refuses a range that starts past the end (416)
            if len(data) != end - start:
                short_read(path, start, end, len(data), self._size(path, timeout))
            return data

        return self.call("read", path, attempt, nbytes=end - start)

    def kind(self, path: str) -> str | None:
        """"file", "directory" (a prefix) or None (nothing there)."""
        info = self.call("exists", path, lambda t: self._info(path, t))
        return None if info is None else str(info.get("type", "file"))

    def size(self, path: str) -> int:
        return self.call("size", path, lambda t: self._size(path, t))

    def listdir(self, directory: str) -> list[str]:
        def attempt(timeout: float | None) -> list[str]:
            try:
                entries = self._aio(timeout, self.fs._ls, directory, detail=False, refresh=True)
            except (FileNotFoundError, NotADirectoryError):
                return []
            return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

        return self.call("list", directory, attempt)

    def find(self, directory: str) -> dict[str, Any]:
        """Every object below ``directory``: full path -> fsspec's details."""
        found: dict[str, Any] = self.call(
            "list", directory, lambda t: self._aio(t, self.fs._find, directory, detail=True))
        return found

    # ------------------------------------------------------------------ writes

    def write(self, path: str, data: bytes | memoryview, *, durable: bool,
              mid_write: Callable[[], None] | None, exclusive: bool) -> None:
        """Create or replace the object (S3 writes are durable once answered)."""
        view = memoryview(data).cast("B")
        if len(view) >= self.multipart_threshold:
            multipart_upload(functools.partial(self.request, "write", path), view,
                             part_bytes=self.part_bytes, concurrency=self.part_concurrency,
                             exclusive=exclusive, mid_write=mid_write)
            return
        if mid_write is not None:
            mid_write()
        self._put(path, data if isinstance(data, bytes) else view.tobytes(),
                  exclusive=exclusive)

    def _put(self, path: str, data: bytes, *, exclusive: bool) -> None:
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

        self.call("write", path, attempt, nbytes=len(data))

    def _holds(self, path: str, data: bytes, timeout: float | None) -> bool:
        head = self._head(path, timeout)
        if head is None or int(head.get("ContentLength", -1)) != len(data):
            return False
        bucket, key, _ = self.fs.split_path(path)
        return bool(self._aio(timeout, self._get, Bucket=bucket, Key=key)["Body"] == data)

    def makedirs(self, directory: str) -> None:
        """S3 has no directories (a prefix exists once an object does)."""

    def remove(self, path: str) -> None:
        def attempt(timeout: float | None) -> None:
            try:
                self._aio(timeout, self.fs._rm_file, path)
            except FileNotFoundError:
                pass

        self.call("delete", path, attempt)

    def remove_many(self, paths: Sequence[str]) -> None:
        for i in range(0, len(paths), 1000):  # DeleteObjects takes at most 1000 keys
            self._delete_batch(list(paths[i:i + 1000]))

    def _delete_batch(self, batch: list[str]) -> None:
        self.call("delete", batch[0], lambda t: self._aio(t, self.fs._bulk_delete, batch))

    def remove_tree(self, directory: str) -> None:
        prefix = directory.rstrip("/") + "/"
        self.remove_many([name for name, info in self.find(directory).items()
                          if name.startswith(prefix) and info.get("type") != "directory"])

    def copy(self, source: str, target: str, *, nbytes: int = 0) -> None:
        """A server-side copy (``nbytes`` sizes its deadline)."""
        self.call("copy", source, lambda t: self._aio(t, self.fs._cp_file, source, target),
                  nbytes=nbytes)

    # ------------------------------------------------------------------ raw S3

    def request(self, what: str, path: str, operation: str, *, deadline_s: float | None = None,
                **params: Any) -> dict[str, Any]:
        """One S3 API ``operation`` on the object at ``path`` under the deadlines and
        retries (``deadline_s``: a shorter one); a ``get_object`` body comes back read whole
        (bytes, length checked)."""
        bucket, key, _ = self.fs.split_path(path)
        params = {"Bucket": bucket, "Key": key, **params}
        nbytes = len(params.get("Body", b""))

        def attempt(timeout: float | None) -> dict[str, Any]:
            if operation == "get_object":
                return self._aio(timeout, self._get, **params)
            return self._aio(timeout, self.fs._call_s3, operation, **params)

        try:
            return self.call(what, path, attempt, nbytes=nbytes, deadline_s=deadline_s)
        finally:
            self.fs.invalidate_cache(path)


def _range_refused(err: BaseException) -> bool:
    code, status = http_error(err.__cause__ or err)
    return status == 416 or code in ("InvalidRange", "416") or "InvalidRange" in str(err)


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
