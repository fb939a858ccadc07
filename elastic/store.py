"""The snapshot store: one run directory on a local path or ``s3://`` (fsspec).

Contract
--------
``SnapshotStore(run_uri, storage_options=None, *, timeout_s=30.0, retry_deadline_s=60.0)``
reads and writes ``RUN/run.json``, ``RUN/snapshots/<step>/...`` and ``RUN/quarantine/...``.
It never lies and never hangs:

* **Deadlines and retries.** Every S3 request runs under ``elastic.retry`` (see its
  contract: which failures are transient, backoff, ``StorageUnavailableError`` when the
  deadline passes, definite errors raised at once, as is). One attempt gives up after
  ``timeout_s``, plus ``nbytes / _MIN_BYTES_PER_S`` for a transfer of known size so a large
  shard gets the time its bytes need: fsspec's ``sync(..., timeout=)`` cancels it however
  the endpoint misbehaves (accepts TCP and never answers, trickles bytes). A whole call,
  retries included, ends within about ``retry_deadline_s`` (plus the same transfer
  allowance). botocore's and s3fs's own retry loops are switched off (one HTTP attempt per
  s3fs call); ``call_with_retries`` owns retrying, its time injectable through
  ``store.retry`` (a ``RetryPolicy``). Reads, listings and whole-object writes are retried.
  Local paths have no deadline and no retries.
* **Short reads.** A read that returns fewer bytes than asked is a transient cut-short
  response (``ShortReadError``, retried) when the object is long enough, and a definite
  ``SnapshotIntegrityError`` ("truncated") when the object itself is shorter.
* **Atomic writes.** Local: bytes go to ``NAME.tmp-*`` in the same directory, are fsync'ed
  (``durable=True``) and renamed, so a crashed writer leaves at most a temp file. S3: one
  ``PUT`` (or a multipart upload completed in one call) is atomic per object.
* **Exclusive create** (``write_file(..., exclusive=True)``) raises ``FileExistsError`` if
  the name exists. Local: ``os.link(tmp, path)`` (atomic; the existing file is untouched).
  S3: a HEAD check, then a conditional ``PUT`` with ``If-None-Match: *`` (AWS S3 and moto
  refuse it atomically with 412). A lost answer makes the outcome ambiguous (a retry, or
  aiohttp's silent resend of a PUT on a dropped keep-alive connection, then meets our own
  object), so when the conditional PUT is refused, or a retry's HEAD finds the object, its
  bytes are compared with ours: equal counts as our create (success), different raises
  ``FileExistsError``. So a concurrent writer of byte-identical content is indistinguishable
  from us; callers that need to tell writers apart put a unique token in the content.
  *On stores without conditional writes* (S3-compatible servers that ignore
  ``If-None-Match``) only the HEAD check remains: a create of a name that already exists is
  refused, but two writers racing between the HEAD and the PUT can both succeed and the
  last PUT wins, i.e. exclusivity is not guaranteed under concurrency there. A store that
  rejects the header (501) raises ``OSError``; it never silently overwrites.
* A snapshot is *committed* iff its ``manifest.json`` exists. Other step directories are
  uncommitted leftovers that readers ignore.
* **Quarantine, never delete.** ``quarantine_step`` moves a rejected snapshot to
  ``RUN/quarantine/<step>[-k]/`` with ``reason.json``. Local: one directory rename (the
  reason is written into the directory first, so it moves with it). S3: claim the target
  by an exclusive create of ``reason.json``, copy every object, check the copies' sizes,
  then delete the originals manifest first; nothing is deleted before its copy exists. A
  crash mid-way leaves the snapshot committed where it was (and a partial copy).
* ``stats`` counts storage reads, so tests can show that a restore touched no storage.
"""

from __future__ import annotations

import errno
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec
import fsspec.asyn

from elastic.errors import ManifestError, SnapshotIntegrityError, StorageUnavailableError
from elastic.format import MANIFEST_NAME, Manifest, step_dirname
from elastic.retry import RetryPolicy, ShortReadError, call_with_retries, http_error

T = TypeVar("T")

QUARANTINE_DIR = "quarantine"
REASON_NAME = "reason.json"

# A transfer is allowed timeout_s plus its bytes at this rate: a 1 GiB shard must not be
# killed by a deadline meant to catch a silent endpoint.
_MIN_BYTES_PER_S = 8 << 20


@dataclass
class StoreStats:
    range_reads: int = 0
    bytes_read: int = 0
    files_written: int = 0


# ---------------------------------------------------------------------- the store


class SnapshotStore:
    def __init__(self, run_uri: str, storage_options: dict[str, Any] | None = None, *,
                 timeout_s: float = 30.0, retry_deadline_s: float = 60.0) -> None:
        if not run_uri:
            raise ValueError("run_uri is empty; pass a directory path or s3://bucket/prefix")
        if timeout_s <= 0 or retry_deadline_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) and retry_deadline_s "
                             f"({retry_deadline_s}) must be positive")
        self.run_uri = run_uri.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.retry = RetryPolicy(deadline_s=float(retry_deadline_s))
        options = dict(storage_options or {})
        if self.run_uri.startswith("s3://"):
            options = _s3_options(options, self.timeout_s)
        self.fs, self.root = fsspec.core.url_to_fs(self.run_uri, **options)
        self.is_local = "file" in _protocols(self.fs)
        if "s3" in _protocols(self.fs):
            # One attempt per s3fs call: our retry loop owns retrying, under one deadline.
            self.fs.retries = 1
        self.stats = StoreStats()
        self._stats_lock = threading.Lock()

    # ------------------------------------------------------------------ plumbing

    def _io(self, what: str, path: str, attempt: Callable[[float | None], T], *,
            nbytes: int = 0) -> T:
        """Local: one plain call. S3: ``attempt(timeout)`` under the retry policy."""
        if self.is_local:
            return attempt(None)
        transfer_s = nbytes / _MIN_BYTES_PER_S
        return call_with_retries(attempt, what=what, path=path, policy=self.retry,
                                 attempt_s=self.timeout_s + transfer_s, extra_s=transfer_s)

    def _aio(self, timeout: float | None, method: Callable[..., Any], *args: Any,
             **kwargs: Any) -> Any:
        """Run one s3fs coroutine on fsspec's loop; ``timeout`` cancels it (FSTimeoutError)."""
        return fsspec.asyn.sync(self.fs.loop, method, *args, timeout=timeout, **kwargs)

    def _s3(self, what: str, path: str, method: Callable[..., Any], *args: Any,
            nbytes: int = 0, **kwargs: Any) -> Any:
        """One s3fs coroutine call, with deadline and retries."""
        return self._io(what, path, lambda t: self._aio(t, method, *args, **kwargs),
                        nbytes=nbytes)

    def _count_read(self, n: int) -> None:
        with self._stats_lock:
            self.stats.range_reads += 1
            self.stats.bytes_read += n

    # ------------------------------------------------------------------ paths

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def step_path(self, step: int, name: str = "") -> str:
        base = self.path("snapshots", step_dirname(step))
        return f"{base}/{name}" if name else base

    # ------------------------------------------------------------------ writes

    def write_file(self, path: str, data: bytes | memoryview, *, durable: bool = True,
                   mid_write: Callable[[], None] | None = None,
                   exclusive: bool = False) -> None:
        """Atomically create ``path`` with ``data`` (see the module contract; ``exclusive``
        raises ``FileExistsError`` if ``path`` exists). ``mid_write`` is a fault-injection
        hook called after half the bytes went to the temporary file (local) or before the
        PUT (S3)."""
        view = memoryview(data).cast("B")
        if self.is_local:
            _write_local(path, view, durable=durable, mid_write=mid_write, exclusive=exclusive)
        else:
            if mid_write is not None:
                mid_write()
            self._write_s3(path, data if isinstance(data, bytes) else view.tobytes(),
                           exclusive=exclusive)
        with self._stats_lock:
            self.stats.files_written += 1

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
        return bytes(self._aio(timeout, self.fs._cat_file, path)) == data

    def write_json(self, path: str, obj: Any, *, durable: bool = True,
                   exclusive: bool = False) -> None:
        self.write_file(path, json.dumps(obj, indent=1).encode(), durable=durable,
                        exclusive=exclusive)

    # ------------------------------------------------------------------ reads

    def read_range(self, path: str, start: int, end: int) -> bytes:
        def attempt(timeout: float | None) -> bytes:
            if self.is_local:
                data = bytes(self.fs.cat_file(path, start=start, end=end))
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
        self._count_read(len(data))
        return data

    def _short_read(self, path: str, start: int, end: int, got: int,
                    timeout: float | None) -> None:
        """Fewer bytes than asked: the file is truncated (definite) or the answer was cut
        short (transient, retried)."""
        size = int(self.fs.size(path)) if self.is_local else self._size(path, timeout)
        if size < end:
            raise SnapshotIntegrityError(
                f"{path}: wanted bytes [{start}, {end}) but the file ends at {size}; truncated")
        raise ShortReadError(errno.EIO, f"got {got} of {end - start} bytes; response cut short",
                             path)

    def read_file(self, path: str) -> bytes:
        def attempt(timeout: float | None) -> bytes:
            if self.is_local:
                return bytes(self.fs.cat_file(path))
            # One GET (s3fs would otherwise HEAD first and split large objects): this is for
            # small files (manifests, receipts), read under timeout_s; shards use read_range.
            return bytes(self._aio(timeout, self.fs._cat_file, path, max_concurrency=1))

        data = self._io("read", path, attempt)
        self._count_read(len(data))
        return data

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

    def exists(self, path: str) -> bool:
        if self.is_local:
            return bool(self.fs.exists(path))
        return self._io("exists", path, lambda t: self._info(path, t) is not None)

    def size(self, path: str) -> int:
        if self.is_local:
            return int(self.fs.size(path))
        return self._io("size", path, lambda t: self._size(path, t))

    def _list(self, directory: str) -> list[str]:
        """Names (last path component) directly under ``directory``; [] when it is absent."""
        def attempt(timeout: float | None) -> list[str]:
            try:
                if self.is_local:
                    entries = self.fs.ls(directory, detail=False)
                else:
                    entries = self._aio(timeout, self.fs._ls, directory, detail=False,
                                        refresh=True)
            except FileNotFoundError:
                return []
            return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

        return self._io("list", directory, attempt)

    def _find(self, directory: str) -> dict[str, int]:
        """Every object under ``directory`` (recursively): relative name -> size."""
        def attempt(timeout: float | None) -> dict[str, Any]:
            if self.is_local:
                return self.fs.find(directory, detail=True)
            return self._aio(timeout, self.fs._find, directory, detail=True)

        found = self._io("list", directory, attempt)
        prefix = directory.rstrip("/") + "/"
        return {name[len(prefix):]: int(info.get("size", 0)) for name, info in found.items()
                if name.startswith(prefix) and info.get("type") != "directory"}

    def step_files(self, step: int) -> list[str]:
        """The file names in snapshot ``step``'s directory (none when it is absent)."""
        return self._list(self.step_path(step))

    # ------------------------------------------------------------------ snapshots

    def all_steps(self) -> list[int]:
        """Every step directory, committed or not, ascending."""
        self.fs.invalidate_cache()
        return sorted(int(n) for n in self._list(self.path("snapshots")) if n.isdigit())

    def committed_steps(self) -> list[int]:
        return [s for s in self.all_steps() if self.exists(self.step_path(s, MANIFEST_NAME))]

    def load_manifest(self, step: int) -> Manifest:
        path = self.step_path(step, MANIFEST_NAME)
        try:
            data = self.read_file(path)
        except FileNotFoundError as err:
            raise ValueError(f"{path}: no manifest; snapshot {step} is not committed") from err
        if self.is_local and os.path.islink(path):
            raise ManifestError(f"{path}: is a symbolic link; a snapshot's files must be "
                                "plain files inside it")
        return Manifest.from_bytes(data, where=path, step=step)

    def write_manifest(self, manifest: Manifest, *,
                       mid_write: Callable[[], None] | None = None,
                       exclusive: bool = False) -> None:
        self.write_file(self.step_path(manifest.step, MANIFEST_NAME), manifest.to_bytes(),
                        mid_write=mid_write, exclusive=exclusive)

    def delete_step(self, step: int) -> None:
        """Remove a snapshot. The manifest goes first so a reader never sees a committed
        snapshot with missing shards."""
        self._remove(self.step_path(step, MANIFEST_NAME))
        directory = self.step_path(step)
        if self.is_local:
            if os.path.isdir(directory):
                self.fs.rm(directory, recursive=True)
            return
        names = list(self._find(directory))
        self._remove_many([f"{directory}/{n}" for n in names])

    def delete_files(self, step: int, names: list[str]) -> None:
        """Remove only the named files of snapshot ``step`` (missing ones are ignored), e.g.
        one generation's files, leaving another generation's beside them untouched."""
        for name in names:
            if not name or "/" in name or "\\" in name or name in (".", ".."):
                raise ValueError(f"delete_files: {name!r} is not a plain file name")
        self._remove_many([self.step_path(step, n) for n in names])

    def _remove(self, path: str) -> None:
        def attempt(timeout: float | None) -> None:
            try:
                if self.is_local:
                    os.remove(path)
                else:
                    self._aio(timeout, self.fs._rm_file, path)
            except FileNotFoundError:
                pass

        self._io("delete", path, attempt)

    def _remove_many(self, paths: list[str]) -> None:
        if self.is_local:
            for p in paths:
                self._remove(p)
            return
        for i in range(0, len(paths), 1000):  # DeleteObjects takes at most 1000 keys
            self._s3("delete", paths[i], self.fs._bulk_delete, paths[i:i + 1000])

    def ensure_run_json(self, info: dict[str, Any]) -> None:
        """Write ``run.json`` once (the first writer wins; later runs keep it)."""
        try:
            self.write_json(self.path("run.json"), info, exclusive=True)
        except FileExistsError:
            pass

    def read_run_json(self) -> dict[str, Any] | None:
        path = self.path("run.json")
        if not self.exists(path):
            return None
        return json.loads(self.read_file(path))

    # ------------------------------------------------------------------ quarantine

    def quarantine_step(self, step: int, reason: str) -> str:
        """Move snapshot ``step`` to ``RUN/quarantine/<step>[-k]/`` with ``reason.json``;
        returns the new location. Never deletes anything that has not been copied."""
        source = self.step_path(step)
        record = {"step": step, "reason": str(reason), "time": time.time()}
        body = json.dumps(record, indent=1).encode()
        if self.is_local:
            return self._quarantine_local(step, source, body)
        return self._quarantine_s3(step, source, body)

    def _quarantine_targets(self, step: int) -> list[str]:
        """Free quarantine names for ``step`` in order (``<step>``, ``<step>-2``, ...)."""
        taken = set(self._list(self.path(QUARANTINE_DIR)))
        base = step_dirname(step)
        names = [base] + [f"{base}-{k}" for k in range(2, len(taken) + 3)]
        return [self.path(QUARANTINE_DIR, n) for n in names if n not in taken]

    def _quarantine_local(self, step: int, source: str, body: bytes) -> str:
        if not os.path.isdir(source):
            raise FileNotFoundError(errno.ENOENT, f"snapshot {step} has no directory", source)
        # Written inside the snapshot first, so the one rename moves snapshot and reason.
        _write_local(os.path.join(source, REASON_NAME), memoryview(body), durable=True,
                     mid_write=None, exclusive=False)
        os.makedirs(self.path(QUARANTINE_DIR), exist_ok=True)
        for target in self._quarantine_targets(step):
            try:
                os.rename(source, target)  # fails if a non-empty target appeared meanwhile
            except OSError as err:
                if err.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    continue
                raise
            _fsync_dir(os.path.dirname(source))
            _fsync_dir(self.path(QUARANTINE_DIR))
            return target
        raise FileExistsError(errno.EEXIST, "no free quarantine name", source)

    def _quarantine_s3(self, step: int, source: str, body: bytes) -> str:
        objects = {n: s for n, s in self._find(source).items() if n != REASON_NAME}
        if not objects:
            raise FileNotFoundError(errno.ENOENT, f"snapshot {step} has no objects", source)
        target = self._claim_quarantine(step, body)
        for name in objects:  # copy everything first
            self._s3("copy", f"{source}/{name}", self.fs._cp_file, f"{source}/{name}",
                     f"{target}/{name}", nbytes=objects[name])
        copied = self._find(target)
        missing = [n for n, size in objects.items() if copied.get(n) != size]
        if missing:
            raise StorageUnavailableError(
                f"{target}: copies of {missing} are missing or differ in size; the snapshot "
                "stays where it is")
        # The manifest goes first: from then on readers no longer see step as committed.
        names = sorted(objects, key=lambda n: n != MANIFEST_NAME)
        self._remove(f"{source}/{names[0]}")
        self._remove_many([f"{source}/{n}" for n in names[1:]])
        return target

    def _claim_quarantine(self, step: int, body: bytes) -> str:
        # The exclusive create of reason.json is the claim: two quarantines of one step never
        # share a target (where the store has conditional writes).
        for target in self._quarantine_targets(step):
            try:
                self.write_file(f"{target}/{REASON_NAME}", body, exclusive=True)
                return target
            except FileExistsError:
                continue
        raise FileExistsError(errno.EEXIST, "no free quarantine name", self.step_path(step))

    def quarantined(self) -> list[dict[str, Any]]:
        """Rows ``{"step", "where", "reason", "time"}`` for every quarantined snapshot, by
        step. ``reason.json`` is untrusted input: an unreadable one gives reason None."""
        rows = []
        for name in self._list(self.path(QUARANTINE_DIR)):
            match = re.fullmatch(r"(\d+)(?:-\d+)?", name)
            if match is None:
                continue
            where = self.path(QUARANTINE_DIR, name)
            reason, when = _read_reason(self, f"{where}/{REASON_NAME}")
            rows.append({"step": int(match.group(1)), "where": where, "reason": reason,
                         "time": when})
        return sorted(rows, key=lambda r: (r["step"], r["where"]))


def _range_refused(err: BaseException) -> bool:
    code, status = http_error(err.__cause__ or err)
    return status == 416 or code in ("InvalidRange", "416") or "InvalidRange" in str(err)


def _read_reason(store: SnapshotStore, path: str) -> tuple[str | None, float | None]:
    try:
        record = json.loads(store.read_file(path))
    except (FileNotFoundError, ValueError):
        return None, None
    if not isinstance(record, dict):
        return None, None
    reason, when = record.get("reason"), record.get("time")
    return (reason if isinstance(reason, str) else None,
            float(when) if isinstance(when, int | float) and not isinstance(when, bool)
            else None)


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
            os.link(tmp, path)  # atomic; EEXIST -> FileExistsError, the old file untouched
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        # Keep no temp file behind on a refused or failed write; a crash still may.
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if durable:
        _fsync_dir(directory)


def _s3_options(options: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Our deadlines as defaults under the caller's options, and the endpoint from the
    standard AWS environment variables."""
    config = {"connect_timeout": min(timeout_s, 10.0), "read_timeout": timeout_s,
              # One HTTP attempt per call: call_with_retries retries, under one deadline.
              "retries": {"max_attempts": 1, "mode": "standard"}}
    options["config_kwargs"] = {**config, **options.get("config_kwargs", {})}
    # Listings must be fresh: a cached "not there" would be a lie about a commit.
    options.setdefault("use_listings_cache", False)
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    client_kwargs = options.get("client_kwargs", {})
    if endpoint and "endpoint_url" not in client_kwargs:
        options["client_kwargs"] = {**client_kwargs, "endpoint_url": endpoint}
    return options


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def _fsync_dir(directory: str) -> None:
    # The rename is durable only once the directory entry is; ignore filesystems that refuse.
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
