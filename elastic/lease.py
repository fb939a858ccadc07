"""The run lease: one live driver per run directory (P7 "one writer").

Contract
--------
The lease is the object ``RUN/lease.json``::

    {"token": <uuid4 hex>, "holder": {"host", "pid", "ray_job_id", "started_at"},
     "acquired_at": <unix s>, "expires_at": <unix s>, "epoch": <int>}

* ``RunLease(store).acquire()`` creates it atomically, or takes over a lease whose holder
  stopped renewing (``expires_at < now``), or any lease with ``force=True``. Every acquire
  or takeover writes a new token and ``epoch + 1``. A live lease held by someone else raises
  ``LeaseHeldError``: one line naming the holder, the expiry and the fix.
  A lease whose holder ran on this kernel and in this pid namespace and whose process is
  gone (killed without releasing) is taken over at once, without waiting for the expiry
  (``holder_is_dead``); a holder elsewhere is only taken over once its lease expires.
* ``renew()`` pushes ``expires_at`` to ``now + ttl``; ``start_renewing()`` does it from a
  daemon thread every ``ttl / 3``. A renew that finds another token raises (thread: records)
  ``LeaseLostError``; the driver must stop committing.
* ``release()`` deletes the lease only if it still carries this driver's token: a driver never
  deletes a lease that was taken over from it.
* ``lease_holds(store, token)`` is the fencing check: the coordinator calls it before writing
  a manifest, so a driver whose lease was taken over can no longer commit.
* Time is injected (``clock``); nothing here sleeps except the renew thread.

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
  of a scratch object that must fail) and logged as a warning; the lease is then *advisory*.
  Every operation still re-reads the lease and compares tokens first, so a driver notices a
  takeover at its next renew, and ``lease_holds`` still fences manifests; but two drivers
  whose acquires (or takeovers) interleave within one request round trip can both believe
  they won until the first renew, and in that window both can commit.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from elastic.store import SnapshotStore

LEASE_NAME = "lease.json"
_LOCK_NAME = ".lease.lock"
_ATTEMPTS = 5  # read-then-conditional-write rounds before giving up on a contended lease

log = logging.getLogger(__name__)


class LeaseHeldError(RuntimeError):
    """Another driver holds a live lease on the run directory."""


class LeaseLostError(RuntimeError):
    """This driver's lease was taken over (or removed); its snapshots are refused."""


class _Conflict(Exception):
    """A conditional write found the lease changed since we read it."""


# ---------------------------------------------------------------------- holder


def ray_job_id_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The Ray job this driver runs as, if any.

    ``RAY_JOB_SUBMISSION_ID`` / ``RAY_JOB_ID`` when set. Ray 2.60's ``ray job submit`` sets
    neither in the driver (it strips ``RAY_JOB_ID`` as an internal flag); it passes the
    submission id in ``RAY_JOB_CONFIG_JSON_ENV_VAR``'s ``metadata.job_submission_id``.
    """
    env = os.environ if environ is None else environ
    for key in ("RAY_JOB_SUBMISSION_ID", "RAY_JOB_ID"):
        if env.get(key):
            return env[key]
    try:
        config = json.loads(env.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
        job = (config.get("metadata") or {}).get("job_submission_id")
    except (ValueError, AttributeError):
        return None
    return str(job) if job else None


def default_holder(clock: Callable[[], float] = time.time) -> dict[str, Any]:
    holder: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(),
                              "ray_job_id": ray_job_id_from_env(), "started_at": clock()}
    identity = _process_identity(os.getpid())
    if identity is not None:
        holder["boot_id"], holder["pid_ns"], holder["pid_start"] = identity
    return holder


def _process_identity(pid: int) -> tuple[str, str, int] | None:
    """(kernel boot id, pid namespace, start tick) of ``pid`` as seen from here (Linux), or
    None. Boot id + namespace say whether a pid in a lease means a process we can look at."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot_id = fh.read().strip()
        pid_ns = os.readlink("/proc/self/ns/pid")
        with open(f"/proc/{pid}/stat") as fh:
            start = int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None
    return boot_id, pid_ns, start


def holder_is_dead(holder: dict[str, Any]) -> bool:
    """True only when the holder's process provably ended: same kernel boot and pid namespace
    as ours (so its pid means the same process here) and that pid is gone, a zombie, or now a
    different process (another start tick). Anything uncertain counts as alive: then the
    lease is only taken over once it expires."""
    mine = _process_identity(os.getpid())
    pid = holder.get("pid")
    if mine is None or not isinstance(pid, int) or pid <= 0:
        return False
    if (holder.get("boot_id"), holder.get("pid_ns")) != mine[:2]:
        return False  # another machine or container: its pids are not ours to look at
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    if fields[0] in ("Z", "X"):
        return True
    start = holder.get("pid_start")
    return start is not None and fields[19] != str(start)  # the pid was reused


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def describe_holder(record: dict[str, Any]) -> str:
    holder = record.get("holder") or {}
    started = holder.get("started_at")
    started_s = _when(started) if isinstance(started, (int, float)) else "?"
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
            f"Ray job {holder.get('ray_job_id') or '-'}, started {started_s}")


# ---------------------------------------------------------------------- backends
# A backend reads the lease with an opaque version (S3: ETag; local: the bytes themselves)
# and writes conditionally on that version, raising _Conflict when it changed.


class _LocalBackend:
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
            raise _Conflict from err
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
            raise _Conflict from err
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, data: bytes, version: Any) -> None:
        with self._locked():
            current, _ = self.read()
            if current != version:
                raise _Conflict
            tmp = self._write_tmp(data)
            os.replace(tmp, self.path)

    def delete(self, version: Any) -> None:
        with self._locked():
            current, _ = self.read()
            if current is None:
                return
            if current != version:
                raise _Conflict
            os.unlink(self.path)

    def honours_conditions(self) -> bool:
        return True


class _S3Backend:
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
            raise _Conflict from err
        except OSError as err:
            if not _precondition_failed(err):
                raise
            # A retried write whose first attempt landed also comes back 412: ours if the
            # stored bytes are the bytes we sent (they carry our fresh token).
            current, _ = self.read()
            if current != data:
                raise _Conflict from err
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
                raise _Conflict from err
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


def _backend(store: SnapshotStore) -> _LocalBackend | _S3Backend:
    if store.is_local:
        return _LocalBackend(store)
    if hasattr(store.fs, "call_s3"):
        return _S3Backend(store)
    raise ValueError(f"{store.run_uri}: the run lease supports local paths and s3:// only")


def _parse(data: bytes | None) -> dict[str, Any] | None:
    if data is None:
        return None
    try:
        record = json.loads(data)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


# ---------------------------------------------------------------------- the lease


class RunLease:
    """This driver's lease on one run directory (see the module docstring)."""

    def __init__(self, store: SnapshotStore, *, ttl_s: float = 60.0,
                 holder: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.store = store
        self.ttl_s = float(ttl_s)
        self.clock = clock
        self.holder = dict(holder) if holder is not None else default_holder(clock)
        self.token: str | None = None
        self.epoch = 0
        self.lost: str | None = None  # set by the renew thread when the lease was taken over
        self.conditional = True  # False: the store ignores conditional writes (advisory lease)
        self._backend = _backend(store)
        self._record: dict[str, Any] | None = None
        self._probed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ reads

    def read(self) -> dict[str, Any] | None:
        """The lease as stored now (``{}`` if unreadable), or None when there is none."""
        return _parse(self._backend.read()[0])

    # ------------------------------------------------------------------ writes

    def _encode(self, record: dict[str, Any]) -> bytes:
        return json.dumps(record, indent=1).encode()

    def acquire(self, force: bool = False) -> dict[str, Any]:
        """Take the lease: create it, or take over an expired one (any one with ``force``).
        Returns the record written. Raises ``LeaseHeldError`` while another driver holds it."""
        if not self._probed:
            self._probed = True
            self.conditional = self._backend.honours_conditions()
            if not self.conditional:
                log.warning("%s ignores conditional writes (If-None-Match/If-Match): the run "
                            "lease is advisory; two drivers started at the same moment could "
                            "both run until the first renew", self.store.run_uri)
        for _ in range(_ATTEMPTS):
            data, version = self._backend.read()
            current = _parse(data)
            now = self.clock()
            if current is not None and current.get("token") != self.token and not force:
                expires = current.get("expires_at")
                if not isinstance(expires, (int, float)):
                    raise LeaseHeldError(self._unreadable_message())
                if expires >= now and not holder_is_dead(current.get("holder") or {}):
                    raise LeaseHeldError(self._held_message(current, now))
            epoch = int(current.get("epoch", 0)) if current else 0
            record = {"token": uuid.uuid4().hex, "holder": self.holder, "acquired_at": now,
                      "expires_at": now + self.ttl_s, "epoch": epoch + 1}
            try:
                if current is None:
                    self._backend.create(self._encode(record))
                else:
                    self._backend.replace(self._encode(record), version)
            except _Conflict:
                continue  # someone wrote in between: look again
            self.token, self.epoch, self._record = record["token"], record["epoch"], record
            self.lost = None
            return record
        current = self.read() or {}
        raise LeaseHeldError(self._held_message(current, self.clock()))

    def renew(self) -> None:
        """Extend the lease to ``now + ttl``; ``LeaseLostError`` if it is no longer ours."""
        if self.token is None or self._record is None:
            raise LeaseLostError(f"run {self.store.run_uri}: renew() before acquire()")
        data, version = self._backend.read()
        current = _parse(data)
        if current is None or current.get("token") != self.token:
            raise LeaseLostError(self._lost_message(current))
        record = {**self._record, "expires_at": self.clock() + self.ttl_s}
        try:
            self._backend.replace(self._encode(record), version)
        except _Conflict as err:
            raise LeaseLostError(self._lost_message(self.read())) from err
        self._record = record

    def release(self) -> None:
        """Delete the lease if it still carries our token; never someone else's."""
        self.stop_renewing()
        if self.token is None:
            return
        data, version = self._backend.read()
        current = _parse(data)
        if current is not None and current.get("token") == self.token:
            with contextlib.suppress(_Conflict):  # taken over in between: theirs now
                self._backend.delete(version)
        self.token, self._record = None, None

    # ------------------------------------------------------------------ renew thread

    def start_renewing(self, interval_s: float | None = None) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        interval = self.ttl_s / 3 if interval_s is None else interval_s
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, args=(interval,),
                                        name="baton-lease-renew", daemon=True)
        self._thread.start()

    def stop_renewing(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)

    def _renew_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.renew()
            except LeaseLostError as err:
                self.lost = str(err)
                log.error("%s", err)
                return
            except Exception as err:  # noqa: BLE001 - storage doubt: keep trying, never give up
                # A store that does not answer is not proof of a takeover: the next renew
                # either finds our token (and extends it) or someone else's (lost).
                log.warning("run lease renew failed (%s: %s); retrying", type(err).__name__, err)

    # ------------------------------------------------------------------ messages

    def _held_message(self, current: dict[str, Any], now: float) -> str:
        expires = current.get("expires_at")
        if isinstance(expires, (int, float)):
            left = max(0, math.ceil(expires - now))
            expiry = f"its lease expires at {_when(expires)} (in {left} s)"
        else:
            expiry = "its lease has no readable expiry"
        return (f"run {self.store.run_uri} is held by another driver ({describe_holder(current)}); "
                f"{expiry}. Wait for it to end or expire, stop that driver, or pass "
                "--force-takeover to take the run over (its snapshots are refused from then on).")

    def _unreadable_message(self) -> str:
        return (f"run {self.store.run_uri} has an unreadable {LEASE_NAME} (another driver may be "
                "writing it); if no driver is running, pass --force-takeover to replace it.")

    def _lost_message(self, current: dict[str, Any] | None) -> str:
        if not current:
            now_held = f"{LEASE_NAME} was removed or is unreadable"
        else:
            now_held = (f"it is now held by {describe_holder(current)} "
                        f"(epoch {current.get('epoch', '?')})")
        return (f"lost the lease on run {self.store.run_uri}: {now_held}; this driver's "
                "snapshots are refused from then on.")


def lease_holds(store: SnapshotStore, token: str) -> bool:
    """Whether ``RUN/lease.json`` still names ``token`` (the coordinator's fencing check)."""
    record = _parse(_backend(store).read()[0])
    return bool(record) and record.get("token") == token
