"""The coordinator a worker talks to: the commit protocol plus the in-memory copy.

Contract
--------
``LocalCoordinator`` speaks ``elastic.protocol.CoordinatorClient`` for one run, in-process
or as the Ray actor (``elastic.coordinator`` makes this very class remote). It adds to
``elastic.commit.CommitCore`` (generations, receipts, commit, fencing, GC, quarantine):

* ``RamCache``: the newest committed snapshot's shard files (plus those in flight), held in
  this process so a restore after a node loss reads no storage. At most ``ram_cap_bytes``
  in all (``snapshots.ram_copy_mib``; 0 turns it off): a shard that does not fit is refused
  and that snapshot is storage-only (logged once per snapshot). Puts from another
  generation or for a stale step are refused.
* On-demand snapshots before a planned resize: ``request_snapshot`` / ``snapshot_requested``
  / ``answer_request`` / ``request_met`` / ``cancel_request``.
* Stop requests (Ctrl-C or a time limit on the driver): ``request_stop`` (driver) /
  ``stop_requested`` (workers, at every step boundary) / ``answer_stop(step)`` (rank 0, once
  the snapshot of the step it stopped at is persisted); ``health()["stopped_at"]`` tells the
  driver. A request stays until the fit ends, so a worker group restarted in between stops
  too.

Thread-safe: its own lock guards only the RAM copy and the request flags; the core has its
own and does storage I/O outside it, so a threaded actor never serialises behind a slow
store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic.commit import CommitCore
from elastic.faults import FaultInjector
from elastic.store import SnapshotStore

log = logging.getLogger("baton.elastic")


class RamCache:
    """Shard-file bytes of the newest snapshots, keyed by (step, file), at most ``cap``
    bytes in all (None: no cap; 0: nothing is held)."""

    def __init__(self, cap: int | None = None) -> None:
        self.cap = cap
        self.files: dict[int, dict[str, bytes]] = {}

    def held(self) -> int:
        return sum(len(d) for files in self.files.values() for d in files.values())

    def put(self, step: int, file: str, data: bytes) -> bool:
        if self.cap is not None and self.held() + len(data) > self.cap:
            return False
        self.files.setdefault(step, {})[file] = data
        return True

    def keep_only(self, steps: set[int]) -> None:
        for step in list(self.files):
            if step not in steps:
                del self.files[step]

    def read(self, step: int, requests: list[tuple[str, int, int]]) -> list[bytes] | None:
        held = self.files.get(step, {})
        if not all(f in held for f, _, _ in requests):
            return None
        return [held[f][a:b] for f, a, b in requests]


class LocalCoordinator:
    """Thread-safe coordinator for one run; used in-process or as the Ray actor."""

    def __init__(self, store: SnapshotStore, *, keep_last: int = 2, block_bytes: int,
                 faults: FaultInjector | None = None, ram: bool = True,
                 ram_cap_bytes: int | None = None, lease_token: str | None = None,
                 pending_timeout_s: float = 600.0, max_pending: int = 3,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lock = threading.RLock()  # guards the RAM copy and the request flags only
        self.core = CommitCore(store, keep_last=keep_last, block_bytes=block_bytes,
                               faults=faults, lease_token=lease_token,
                               pending_timeout_s=pending_timeout_s, max_pending=max_pending,
                               clock=clock)
        self.ram = RamCache(ram_cap_bytes) if ram and ram_cap_bytes != 0 else None
        self._ram_refused: set[int] = set()
        # On-demand snapshots (before a planned resize): whether one is asked for, and the
        # step the workers took it at (they answer once they have persisted it).
        self.requested = False
        self.answered_step: int | None = None
        # Stop requests: whether the driver asked, and the step the workers stopped at.
        self.stop_asked = False
        self.stopped_at: int | None = None

    # ---------------------------------------------------------------- generations

    def new_generation(self) -> int:
        return self.core.new_generation()

    def current_generation(self) -> int:
        return self.core.current_generation()

    # ---------------------------------------------------------------- on-demand snapshots

    def request_snapshot(self) -> None:
        """Ask the workers for a snapshot at their next step boundary."""
        with self.lock:
            self.requested, self.answered_step = True, None

    def snapshot_requested(self) -> bool:
        with self.lock:
            return self.requested and self.answered_step is None

    def answer_request(self, step: int) -> None:
        """The workers took the requested snapshot at `step` (and train no further)."""
        with self.lock:
            if self.requested:
                self.answered_step = step

    def request_met(self) -> bool:
        """The answered snapshot is committed: a resize may tear the workers down now. (A
        periodic snapshot committing meanwhile does not count: it may be older.)"""
        with self.lock:
            answered = self.answered_step
        return answered is not None and answered in self.core.committed

    def cancel_request(self) -> None:
        with self.lock:
            self.requested, self.answered_step = False, None

    # ---------------------------------------------------------------- stop requests

    def request_stop(self) -> None:
        """Ask the workers to commit a snapshot at their next step boundary and end."""
        with self.lock:
            self.stop_asked = True

    def stop_requested(self) -> bool:
        with self.lock:
            return self.stop_asked

    def answer_stop(self, step: int) -> None:
        """The workers stopped after step ``step`` (asked to, or at their ``until`` step)."""
        with self.lock:
            self.stopped_at = step

    # ---------------------------------------------------------------- shards

    def put_ram(self, step: int, rank: int, file: str, data: bytes, generation: int) -> bool:
        """Hold a copy of a shard file; False when refused (other generation, stale step, or
        over the RAM cap: that snapshot is then storage-only)."""
        core = self.core
        with core._lock:
            if core._refusal_locked(step, generation) is not None:
                return False
        with self.lock:
            if self.ram is None:
                return False
            if not self.ram.put(step, file, data):
                if step not in self._ram_refused:
                    self._ram_refused.add(step)
                    log.warning("snapshot %d: RAM copy would exceed snapshots.ram_copy_mib "
                                "(%.0f MiB held); this snapshot is storage-only", step,
                                self.ram.held() / 2**20)
                return False
            return True

    def report_shard(self, receipt: dict[str, Any]) -> int | None:
        step = self.core.report(receipt)
        self._trim_ram()
        return step

    def report_failure(self, step: int, rank: int, reason: str,
                       generation: int | None = None, where: str = "") -> None:
        self.core.fail(step, rank, reason, generation, where)
        self._trim_ram()

    def worker_lost(self, rank: int) -> None:
        self.core.worker_lost(rank)
        self._trim_ram()

    def committed_steps(self) -> list[int]:
        with self.core._lock:
            return list(self.core.committed)

    def read_ram(self, step: int, requests: list[tuple[str, int, int]]) -> list[bytes] | None:
        with self.lock:
            return None if self.ram is None else self.ram.read(step, requests)

    def read_manifest(self, step: int) -> bytes | None:
        with self.core._lock:
            return self.core.manifests.get(step)

    def reject(self, step: int, reason: str) -> None:
        self.core.reject(step, reason)
        self._trim_ram()

    def rewind(self, step: int) -> None:
        self.core.rewind(step)
        self._trim_ram()

    def poll(self) -> None:
        """In-process receipts arrive by call; only expire stuck in-flight snapshots."""
        self.core.expire()

    def flush(self, timeout_s: float) -> None:
        """Receipts arrive by call, so whatever can commit has committed."""

    def health(self) -> dict[str, Any]:
        self.core.expire()
        info = self.core.health()
        with self.lock:
            info["ram_bytes"] = self.ram.held() if self.ram is not None else 0
            info["stopped_at"] = self.stopped_at
        return info

    def events(self) -> list[str]:
        with self.core._lock:
            return list(self.core.events)

    def _trim_ram(self) -> None:
        with self.core._lock:
            newest = self.core.committed[-1] if self.core.committed else None
            keep = set(self.core.pending) | set(self.core.committing) | (
                {newest} if newest is not None else set())
        with self.lock:
            if self.ram is not None:
                self.ram.keep_only(keep)
            self._ram_refused &= keep
