"""The run lease: one live driver per run directory (P7 "one writer").

The lease is the object ``RUN/lease.json``: ``{"token": <uuid4 hex>, "holder": {"host", "pid",
"ray_job_id", "started_at"}, "acquired_at": <unix s>, "expires_at": <unix s>, "epoch": <int>}``.

* ``RunLease(store).acquire()`` creates it atomically, or takes over a lease whose holder
  stopped renewing (``expires_at < now``), or any lease with ``force=True``; every acquire or
  takeover writes a new token and ``epoch + 1``. A live lease held by someone else raises
  ``LeaseHeldError``: one line naming the holder, the expiry and the fix. A lease file this
  module did not write (bad JSON, a field of another type, a time that is not a finite number:
  untrusted input) is unreadable and fails closed the same way; ``force`` replaces it. A lease
  whose holder ran on this kernel and in this pid namespace and whose process is gone is taken
  over at once (``holder_is_dead``); a holder elsewhere only once its lease expires.
* ``renew()`` pushes ``expires_at`` to ``now + ttl``; its storage calls end before the lease
  would (on S3 within the time left minus ``RENEW_MARGIN_S``, at least ``MIN_RENEW_DEADLINE_S``,
  instead of the store's 60 s retry deadline). ``start_renewing()`` renews from a daemon thread
  every ``ttl / 3``, and every ``RENEW_RETRY_S`` after a renew that failed for storage reasons
  (doubt is not a loss, but a lease must not lapse while the store hiccups). A renew that finds
  another token raises (thread: records) ``LeaseLostError``; the driver must stop committing.
* ``release()`` deletes the lease only if it still carries this driver's token: a driver never
  deletes a lease that was taken over from it.
* ``lease_holds(store, token)`` is the fencing check: the coordinator calls it before writing a
  manifest, so a driver whose lease was taken over can no longer commit.
* Time is injected (``clock``); nothing here sleeps except the renew thread.

Every write is conditional on the version of the lease just read, so of two drivers racing for
the lease at most one wins. ``elastic.lease.lease_io`` holds the storage primitives and the
guarantees per store, and where they stop: on stores that ignore conditional writes the lease
is advisory, and a driver notices a takeover at its next renew while ``lease_holds`` still
fences its manifests.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from elastic.lease.lease_io import LEASE_NAME, LeaseConflict, lease_backend
from elastic.storage import finite_number, is_int64, loads_json
from elastic.store import SnapshotStore

_ATTEMPTS = 5  # read-then-conditional-write rounds before giving up on a contended lease
RENEW_MARGIN_S = 5.0  # a renew's storage calls end this long before the lease would expire
MIN_RENEW_DEADLINE_S = 5.0  # ... but get at least this long (a lease already lapsed)
RENEW_RETRY_S = 2.0  # the pause after a renew that failed for storage reasons
DEFAULT_TTL_S = 60.0  # how long a lease lives unrenewed

log = logging.getLogger(__name__)


class LeaseHeldError(RuntimeError):
    """Another driver holds a live lease on the run directory."""


class LeaseLostError(RuntimeError):
    """This driver's lease was taken over (or removed); its snapshots are refused."""


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
    lease is only taken over once it expires. A missing ``/proc/PID`` is not proof: with
    ``/proc`` mounted ``hidepid=2`` another user's live process has none, so the kernel is
    asked (``kill(pid, 0)``: ESRCH only when no such process exists)."""
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
        return not _pid_exists(pid)
    except OSError:
        return False
    if fields[0] in ("Z", "X"):
        return True
    start = holder.get("pid_start")
    return start is not None and fields[19] != str(start)  # the pid was reused


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only the existence and permission checks
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, another user's
        return True
    return True


def _when(t: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))
    except (OverflowError, ValueError, OSError):  # a crafted time far outside the calendar
        return "?"


def describe_holder(record: dict[str, Any]) -> str:
    holder = record.get("holder")
    holder = holder if isinstance(holder, dict) else {}
    started = holder.get("started_at")
    started_s = _when(started) if isinstance(started, (int, float)) else "?"
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
            f"Ray job {holder.get('ray_job_id') or '-'}, started {started_s}")


def _parse(data: bytes | None) -> dict[str, Any] | None:
    """The lease record; ``{}`` when the file is not a lease this module wrote (untrusted:
    bad JSON, a field of another type, a time that is not a finite number), which every
    caller treats as unreadable and fails closed on; None when there is no lease."""
    if data is None:
        return None
    try:
        record = loads_json(data, LEASE_NAME)  # bounded: size, depth, numbers
    except ValueError:
        return {}
    if not isinstance(record, dict):
        return {}
    expires, epoch = record.get("expires_at"), record.get("epoch")
    well_formed = (isinstance(record.get("token"), str) and isinstance(record.get("holder"), dict)
                   and finite_number(expires) and (type(expires) is float or is_int64(expires))
                   and is_int64(epoch) and epoch >= 0)
    return record if well_formed else {}


# ---------------------------------------------------------------------- the lease


class RunLease:
    """This driver's lease on one run directory (see the module docstring)."""

    def __init__(self, store: SnapshotStore, *, ttl_s: float = DEFAULT_TTL_S,
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
        self._backend = lease_backend(store)
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
            # An unreadable lease ({}) is nobody's, least of all ours: it fails closed.
            ours = bool(current) and self.token is not None \
                and current is not None and current.get("token") == self.token
            if current is not None and not ours and not force:
                expires = current.get("expires_at")
                if not isinstance(expires, (int, float)):
                    raise LeaseHeldError(self._unreadable_message())
                if expires >= now and not holder_is_dead(current.get("holder") or {}):
                    raise LeaseHeldError(self._held_message(current, now))
            epoch = int(current.get("epoch", 0)) if current else 0
            record: dict[str, Any] = {"token": uuid.uuid4().hex, "holder": self.holder,
                                      "acquired_at": now, "expires_at": now + self.ttl_s,
                                      "epoch": epoch + 1}
            try:
                if current is None:
                    self._backend.create(self._encode(record))
                else:
                    self._backend.replace(self._encode(record), version)
            except LeaseConflict:
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
        started = time.monotonic()
        budget = max(MIN_RENEW_DEADLINE_S,
                     self._record["expires_at"] - self.clock() - RENEW_MARGIN_S)
        data, version = self._backend.read(budget)
        current = _parse(data)
        if current is None or current.get("token") != self.token:
            raise LeaseLostError(self._lost_message(current))
        record = {**self._record, "expires_at": self.clock() + self.ttl_s}
        left = max(1.0, budget - (time.monotonic() - started))
        try:
            self._backend.replace(self._encode(record), version, left)
        except LeaseConflict as err:
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
            with contextlib.suppress(LeaseConflict):  # taken over in between: theirs now
                self._backend.delete(version)
        self.token, self._record = None, None

    # ------------------------------------------------------------------ renew thread

    @property
    def renewing(self) -> bool:
        """Whether ``start_renewing`` was called and ``stop_renewing`` not since (its thread
        may have ended on a loss: ``lost`` says so)."""
        return self._thread is not None

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
        pause = interval
        while not self._stop.wait(pause):
            try:
                self.renew()
                pause = interval
            except LeaseLostError as err:
                self.lost = str(err)
                log.error("%s", err)
                return
            except Exception as err:  # noqa: BLE001 - storage doubt: keep trying, never give up
                # A store that does not answer is not proof of a takeover: the next renew
                # either finds our token (and extends it) or someone else's (lost). Soon:
                # the lease runs out while we wait.
                pause = min(interval, RENEW_RETRY_S)
                log.warning("run lease renew failed (%s: %s); retrying in %.0f s",
                            type(err).__name__, err, pause)

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
    record = _parse(lease_backend(store).read()[0])
    return record is not None and record.get("token") == token
