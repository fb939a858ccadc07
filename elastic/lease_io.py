"""Storage primitives of the run lease: the atomic create, conditional replace and conditional
delete of ``RUN/lease.json`` on local disk and on S3, and the probe for S3 conditional writes.

Contract
--------
``lease_backend(store)`` gives the backend for a run directory (local path or ``s3://``; any
other store raises ``ValueError``). A backend reads the lease with an opaque version (S3: the
ETag; local disk: the bytes themselves) and writes only on that version:

* ``read()`` returns ``(bytes, version)`` of one stored version, or ``(None, None)`` when
  there is no lease.
* ``create(data)`` writes the lease only if there is none; ``replace(data, version)`` and
  ``delete(version)`` only if the stored lease is still ``version`` (deleting a lease that is
  already gone is not an error). A failed condition raises ``LeaseConflict``; the lease is
  then left as the other writer made it.
* ``honours_conditions()`` says whether the store enforces these conditions (local disk:
  always; S3: a probe write, below).
* This module only moves bytes: what a record means (tokens, expiry, who may take over) is
  ``elastic.lease``'s.

Atomicity
---------
* S3: create is ``PutObject`` with ``If-None-Match: *``; replace and delete carry
  ``If-Match: <ETag of what we read>``. S3 evaluates these server-side, so the
  read-compare-write is atomic and two drivers can never both win. A conditional write whose
  answer was lost and retried can come back 412 although it landed: on any precondition
  failure we re-read and count the write as ours when the stored bytes are the bytes we sent.
* Local disk: create writes a temporary file and ``os.link``s it to ``lease.json`` (fails with
  EEXIST if the name exists; readers never see a partial file). Replace and delete re-read the
  lease, compare its bytes with what we read before, then ``os.replace`` / ``unlink``. That
  compare-then-act step is serialised by ``flock`` on ``RUN/.lease.lock``, which closes the
  race between processes of one host and between NFS clients (Linux emulates ``flock`` with
  NFS byte-range locks). The window that remains: on a filesystem whose locks are no-ops
  (some FUSE mounts), two takeovers of the same expired lease that interleave between the
  re-read and the rename can both succeed; the later rename wins the file and the earlier
  driver finds a foreign token at its first renew (within ``ttl / 3``), while the fencing
  check refuses its manifests from the moment the file changed.
* Stores without conditional writes (S3-compatible servers that ignore ``If-None-Match`` /
  ``If-Match``): detected once per lease by a probe write (a second ``If-None-Match: *`` PUT
  of a scratch object that must fail; ``elastic.lease`` logs a warning); the lease is then
  *advisory*. Every operation still re-reads the lease and compares tokens first, so a driver
  notices a takeover at its next renew, and ``lease_holds`` still fences manifests; but two
  drivers whose acquires (or takeovers) interleave within one request round trip can both
  believe they won until the first renew, and in that window both can commit.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterator
from typing import Any, Protocol

from elastic.store import SnapshotStore

LEASE_NAME = "lease.json"
_LOCK_NAME = ".lease.lock"


class LeaseConflict(Exception):
    """A conditional write found the lease changed since we read it."""


class LeaseBackend(Protocol):
    """The storage side of the lease (see the module docstring)."""

    def read(self) -> tuple[bytes | None, Any]: ...
    def create(self, data: bytes) -> None: ...
    def replace(self, data: bytes, version: Any) -> None: ...
    def delete(self, version: Any) -> None: ...
    def honours_conditions(self) -> bool: ...


class LocalLeaseBackend:
    def __init__(self, store: SnapshotStore) -> None:
        self.path = store.path(LEASE_NAME)
        self.lock_path = store.path(_LOCK_NAME)
        self.directory = store.root

    def read(self) -> tuple[bytes | None, Any]:
        try:
            with open(self.path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return None, None
        return data, data

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        import fcntl  # POSIX only; imported here so the module imports everywhere

        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor drops the lock

    def _write_tmp(self, data: bytes) -> str:
        tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        return tmp

    def create(self, data: bytes) -> None:
        os.makedirs(self.directory, exist_ok=True)
        tmp = self._write_tmp(data)
        try:
            os.link(tmp, self.path)  # atomic: fails if the name exists, never half-written
        except FileExistsError as err:
            raise LeaseConflict from err
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            self._create_exclusive(data)  # a filesystem without hard links
        finally:
            os.unlink(tmp)

    def _create_exclusive(self, data: bytes) -> None:
        # O_EXCL is atomic too, but a reader can see the file before its bytes: that reader
        # finds it unreadable and refuses (LeaseHeldError), it never takes it over.
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError as err:
            raise LeaseConflict from err
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, data: bytes, version: Any) -> None:
        with self._locked():
            current, _ = self.read()
            if current != version:
                raise LeaseConflict
            tmp = self._write_tmp(data)
            os.replace(tmp, self.path)

    def delete(self, version: Any) -> None:
        with self._locked():
            current, _ = self.read()
            if current is None:
                return
            if current != version:
                raise LeaseConflict
            os.unlink(self.path)

    def honours_conditions(self) -> bool:
        return True


class S3LeaseBackend:
    def __init__(self, store: SnapshotStore) -> None:
        self.fs = store.fs
        self.path = store.path(LEASE_NAME)
        self.bucket, self.key, _ = self.fs.split_path(self.path)

    def read(self) -> tuple[bytes | None, Any]:
        from fsspec.asyn import sync

        async def get() -> tuple[bytes, str]:
            # One GET gives the bytes and the ETag of the same version (a HEAD then a GET
            # could straddle a write).
            resp = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key)
            async with resp["Body"] as body:
                data = await body.read()
            return data, resp["ETag"]

        try:
            return sync(self.fs.loop, get)
        except FileNotFoundError:
            return None, None

    def _put(self, data: bytes, **condition: str) -> None:
        try:
            self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=data,
                            **condition)
        except FileNotFoundError as err:  # If-Match on a key that is gone: released/removed
            raise LeaseConflict from err
        except OSError as err:
            if not _precondition_failed(err):
                raise
            # A retried write whose first attempt landed also comes back 412: ours if the
            # stored bytes are the bytes we sent (they carry our fresh token).
            current, _ = self.read()
            if current != data:
                raise LeaseConflict from err
        finally:
            self.fs.invalidate_cache(self.path)

    def create(self, data: bytes) -> None:
        self._put(data, IfNoneMatch="*")

    def replace(self, data: bytes, version: Any) -> None:
        self._put(data, IfMatch=version)

    def delete(self, version: Any) -> None:
        try:
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self.key, IfMatch=version)
        except FileNotFoundError:
            return
        except OSError as err:
            if not _precondition_failed(err):
                raise
            current, _ = self.read()
            if current is not None:
                raise LeaseConflict from err
        finally:
            self.fs.invalidate_cache(self.path)

    def honours_conditions(self) -> bool:
        """Probe once: a second ``If-None-Match: *`` PUT of a scratch object must fail."""
        key = f"{self.key.rsplit('/', 1)[0]}/.baton-lease-probe-{uuid.uuid4().hex[:8]}"
        try:
            self.fs.call_s3("put_object", Bucket=self.bucket, Key=key, Body=b"1",
                            IfNoneMatch="*")
            try:
                self.fs.call_s3("put_object", Bucket=self.bucket, Key=key, Body=b"2",
                                IfNoneMatch="*")
                return False
            except OSError as err:
                if _precondition_failed(err):
                    return True
                raise
        finally:
            with contextlib.suppress(OSError):
                self.fs.call_s3("delete_object", Bucket=self.bucket, Key=key)


def _precondition_failed(err: BaseException) -> bool:
    """412 PreconditionFailed, or AWS's 409 ConditionalRequestConflict (a concurrent
    conditional write to the same key), as s3fs translates them (FileExistsError/OSError)."""
    if isinstance(err, FileExistsError):
        return True
    response = getattr(err.__cause__, "response", None) or {}
    code = (response.get("Error") or {}).get("Code")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


def lease_backend(store: SnapshotStore) -> LeaseBackend:
    if store.is_local:
        return LocalLeaseBackend(store)
    if hasattr(store.fs, "call_s3"):
        return S3LeaseBackend(store)
    raise ValueError(f"{store.run_uri}: the run lease supports local paths and s3:// only")
