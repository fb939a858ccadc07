"""Storage primitives of the run lease: the atomic create, conditional replace and conditional
delete of ``RUN/lease.json`` on local disk and on S3, and the probe for S3 conditional writes.

``lease_backend(store)`` gives the backend for a run directory (local path or ``s3://``, the
only kinds of store there are). A backend reads the lease with an opaque version (S3: the
ETag; local disk: the bytes themselves) and writes only on that version:

* ``read()`` returns ``(bytes, version)`` of one stored version, or ``(None, None)`` when there
  is no lease. ``read`` and ``replace`` take ``deadline_s``: on S3 the call (retries included)
  ends within it rather than the store's ``retry_deadline_s`` (a renew must end before the
  lease does); local calls have no deadline. A local ``lease.json`` that is a link, a FIFO or
  not a regular file, or a lease larger than ``MAX_LEASE_BYTES``, is never read: it reads as
  an unreadable lease (empty bytes).
* ``create(data)`` writes the lease only if there is none; ``replace(data, version)`` and
  ``delete(version)`` only if the stored lease is still ``version`` (deleting a lease already
  gone is not an error). A failed condition raises ``LeaseConflict``, the lease left as the
  other writer made it.
* ``honours_conditions()``: whether the store enforces these conditions (local disk: always;
  S3: a probe write, a second ``If-None-Match: *`` PUT of a scratch object that must fail).
* This module only moves bytes: what a record means (tokens, expiry, who may take over) is
  ``elastic.lease.run_lease``'s.

Atomicity: on S3 create is ``PutObject`` with ``If-None-Match: *`` and replace and delete carry
``If-Match: <ETag read>``, evaluated server-side, so two drivers never both win (a retried write
refused although it landed counts as ours when the stored bytes are ours); every request runs
under the store's deadlines (``store.s3_request``). Locally create is the storage layer's
create-only write (``os.link``), and replace and delete re-read and compare under ``flock`` on
``RUN/.lease.lock``. Where that stops (filesystems whose locks are no-ops, S3-compatible stores
without conditional writes: the lease is then advisory): docs/design.md, "The run lease's
atomicity".
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import Any, Protocol

from elastic.storage import RefusedEntryError
from elastic.store import SnapshotStore

LEASE_NAME = "lease.json"
_LOCK_NAME = ".lease.lock"
MAX_LEASE_BYTES = 1 << 20  # a lease record is ~300 bytes


class LeaseConflict(Exception):
    """A conditional write found the lease changed since we read it."""


class LeaseBackend(Protocol):
    """The storage side of the lease (see the module docstring)."""

    def read(self, deadline_s: float | None = None) -> tuple[bytes | None, Any]: ...
    def create(self, data: bytes) -> None: ...
    def replace(self, data: bytes, version: Any, deadline_s: float | None = None) -> None: ...
    def delete(self, version: Any) -> None: ...
    def honours_conditions(self) -> bool: ...


class LocalLeaseBackend:
    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self.path = store.path(LEASE_NAME)
        self.lock_path = store.path(_LOCK_NAME)
        self.directory = store.root

    def read(self, deadline_s: float | None = None) -> tuple[bytes | None, Any]:
        try:
            data = self.store.read_file(self.path, max_bytes=MAX_LEASE_BYTES)
        except FileNotFoundError:
            return None, None
        except (RefusedEntryError, ValueError):
            data = b""  # a link, a FIFO, a huge file: unreadable (fails closed; force replaces)
        return data, data

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        import fcntl  # POSIX only; imported here so the module imports everywhere

        os.makedirs(self.directory, exist_ok=True)
        # Never through a link (a dangling one would create a file outside the run), never
        # blocking (a FIFO in its place).
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor drops the lock

    def create(self, data: bytes) -> None:
        # The storage layer's create-only write: temp file, fsync, os.link (O_EXCL where the
        # filesystem has no hard links).
        try:
            self.store.write_file(self.path, data, exclusive=True)
        except FileExistsError as err:
            raise LeaseConflict from err

    def replace(self, data: bytes, version: Any, deadline_s: float | None = None) -> None:
        with self._locked():
            current, _ = self.read()
            if current != version:
                raise LeaseConflict
            self.store.write_file(self.path, data)  # temp, fsync, rename, directory fsync

    def delete(self, version: Any) -> None:
        with self._locked():
            current, _ = self.read()
            if current is None:
                return
            if current != version:
                raise LeaseConflict
            self.store.remove(self.path)

    def honours_conditions(self) -> bool:
        return True


class S3LeaseBackend:
    """Every request goes through ``store.s3_request``: the store's deadlines and retries. A
    retried conditional write whose first attempt landed comes back 412; see ``_put``."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self.path = store.path(LEASE_NAME)

    def read(self, deadline_s: float | None = None) -> tuple[bytes | None, Any]:
        # One GET gives the bytes and the ETag of the same version (a HEAD then a GET could
        # straddle a write).
        try:
            resp = self.store.s3_request("read", self.path, "get_object", deadline_s=deadline_s,
                                         max_bytes=MAX_LEASE_BYTES)
        except FileNotFoundError:
            return None, None
        except ValueError:  # larger than any lease: unreadable (fails closed; force replaces)
            head = self.store.s3_request("read", self.path, "head_object",
                                         deadline_s=deadline_s)
            return b"", head["ETag"]
        return resp["Body"], resp["ETag"]

    def _put(self, data: bytes, deadline_s: float | None = None, **condition: str) -> None:
        try:
            self.store.s3_request("write", self.path, "put_object", deadline_s=deadline_s,
                                  Body=data, **condition)
        except FileNotFoundError as err:  # If-Match on a key that is gone: released/removed
            raise LeaseConflict from err
        except OSError as err:
            if not _precondition_failed(err):
                raise
            # A retried write whose first attempt landed also comes back 412: ours if the
            # stored bytes are the bytes we sent (they carry our fresh token).
            current, _ = self.read(deadline_s)
            if current != data:
                raise LeaseConflict from err

    def create(self, data: bytes) -> None:
        self._put(data, IfNoneMatch="*")

    def replace(self, data: bytes, version: Any, deadline_s: float | None = None) -> None:
        self._put(data, deadline_s, IfMatch=version)

    def delete(self, version: Any) -> None:
        try:
            self.store.s3_request("delete", self.path, "delete_object", IfMatch=version)
        except FileNotFoundError:
            return
        except OSError as err:
            if not _precondition_failed(err):
                raise
            current, _ = self.read()
            if current is not None:
                raise LeaseConflict from err

    def honours_conditions(self) -> bool:
        """Probe once: a second ``If-None-Match: *`` PUT of a scratch object must fail."""
        probe = f"{self.path.rsplit('/', 1)[0]}/.baton-lease-probe-{uuid.uuid4().hex[:8]}"
        try:
            try:
                self.store.s3_request("probe", probe, "put_object", Body=b"1", IfNoneMatch="*")
            except OSError as err:
                # The name is fresh: a refusal can only be our own retried first PUT.
                if not _precondition_failed(err):
                    raise
            try:
                self.store.s3_request("probe", probe, "put_object", Body=b"2", IfNoneMatch="*")
                return False
            except OSError as err:
                if _precondition_failed(err):
                    return True
                raise
        finally:
            with contextlib.suppress(OSError):
                self.store.s3_request("probe", probe, "delete_object")


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
    return S3LeaseBackend(store)  # a Storage is local or s3:// (it refuses other schemes)
