"""The commit protocol, as plain Python (the Ray actor in coordinator.py is a thin wrapper).

Contract
--------
``CommitCore`` owns the snapshot store's namespace for one run:

* ``report(receipt)`` records that one rank's shard of step ``s`` is durable. When all
  ``world_size`` receipts of ``s`` are in, it checks that the chunks cover every logical
  tensor exactly (element counts), writes ``manifest.json`` last (the commit), then
  garbage-collects: older in-flight steps are aborted, only the newest ``keep_last``
  committed snapshots are kept, and uncommitted leftovers are deleted.
* ``fail(step, rank, reason)`` / ``worker_lost(rank)`` abort the affected in-flight
  snapshots and delete what they wrote. A receipt for an aborted or stale step is refused.
* On construction it rebuilds its view from the store (so a restarted coordinator loses no
  committed snapshot) and removes every uncommitted leftover, remembering those steps as
  aborted so that late receipts for them cannot resurrect a partial snapshot.

``LocalCoordinator`` adds a lock and the in-memory copy of the newest snapshot's shard
files (``RamCache``), and is what a worker talks to, in-process or through Ray.
A receipt is a JSON-able dict: ``step, rank, world_size, layout, file, chunks`` (tensor key
-> chunk records) and, from rank 0, ``skeletons`` and ``catalog`` (all logical tensors).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

from elastic.faults import FaultInjector
from elastic.format import ChunkRecord, Manifest, TensorRecord
from elastic.store import SnapshotStore

log = logging.getLogger("baton.elastic")


@dataclass
class _Pending:
    world_size: int
    receipts: dict[int, dict[str, Any]] = field(default_factory=dict)


class CommitCore:
    def __init__(self, store: SnapshotStore, *, keep_last: int = 2, block_bytes: int,
                 faults: FaultInjector | None = None, versions: dict[str, str] | None = None
                 ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (got {keep_last}); at least the newest "
                             "committed snapshot must be kept")
        self.store = store
        self.keep_last = keep_last
        self.block_bytes = block_bytes
        self.faults = faults or FaultInjector()
        self.versions = dict(versions or {})
        self.pending: dict[int, _Pending] = {}
        self.aborted: set[int] = set()
        self.events: list[str] = []  # human-readable log of aborts and commits
        self.manifests: dict[int, bytes] = {}  # committed in this process's lifetime
        self.committed: list[int] = store.committed_steps()
        for step in store.all_steps():
            if step not in self.committed:
                self._abort(step, "uncommitted leftover found at coordinator start")

    # ------------------------------------------------------------------ protocol

    def report(self, receipt: dict[str, Any]) -> int | None:
        """Record one shard receipt; return the step if this receipt committed it."""
        step, rank, world = int(receipt["step"]), int(receipt["rank"]), int(receipt["world_size"])
        if step in self.aborted or step in self.committed or (
                self.committed and step < self.committed[-1]):
            self.events.append(f"refused receipt of rank {rank} for stale/aborted step {step}")
            return None
        pending = self.pending.setdefault(step, _Pending(world))
        if pending.world_size != world:
            self._abort(step, f"rank {rank} reported world_size {world}, expected "
                              f"{pending.world_size}")
            return None
        pending.receipts[rank] = receipt
        if len(pending.receipts) < world:
            return None
        self._commit(step)
        return step

    def fail(self, step: int, rank: int, reason: str) -> None:
        if step in self.committed:
            return
        self._abort(step, f"rank {rank} failed: {reason}")

    def worker_lost(self, rank: int) -> None:
        for step in sorted(self.pending):
            if rank not in self.pending[step].receipts:
                self._abort(step, f"worker {rank} lost before its shard was durable")

    def rewind(self, step: int) -> None:
        """Training restarted from ``step``: newer snapshots (unreadable, or from a future
        that is being redone) are removed so the same steps can commit again."""
        for s in sorted(self.pending):
            if s > step:
                self._abort(s, f"training restarted from step {step}")
        for s in [s for s in self.committed if s > step]:
            self.committed.remove(s)
            self.manifests.pop(s, None)
            self.aborted.discard(s)
            self.store.delete_step(s)
            self.events.append(f"removed snapshot {s}: training restarted from step {step}")
        self.aborted = {s for s in self.aborted if s <= step}

    def latest_committed(self) -> int | None:
        return self.committed[-1] if self.committed else None

    # ------------------------------------------------------------------ internals

    def _commit(self, step: int) -> None:
        pending = self.pending[step]
        self.faults.hit(-1, step, "commit_begin")
        try:
            manifest = self._build_manifest(step, pending)
        except ValueError as err:
            self._abort(step, str(err))
            return
        self.store.write_manifest(
            manifest, mid_write=lambda: self.faults.hit(-1, step, "commit_manifest"))
        self.manifests[step] = manifest.to_bytes()
        self.pending.pop(step)
        self.committed.append(step)
        self.committed.sort()
        self.events.append(f"committed step {step}")
        self.faults.hit(-1, step, "commit_end")
        self.gc()

    def _build_manifest(self, step: int, pending: _Pending) -> Manifest:
        head = pending.receipts.get(0)
        if head is None or "catalog" not in head:
            raise ValueError(f"step {step}: rank 0's receipt lacks the tensor catalog")
        tensors = {k: TensorRecord(dtype=v["dtype"], shape=tuple(v["shape"]))
                   for k, v in head["catalog"].items()}
        files = []
        for rank in sorted(pending.receipts):
            receipt = pending.receipts[rank]
            files.append(receipt["file"])
            for key, chunks in receipt["chunks"].items():
                if key not in tensors:
                    raise ValueError(f"step {step}: rank {rank} wrote unknown tensor {key!r}")
                tensors[key].chunks.extend(ChunkRecord.from_json(c) for c in chunks)
        for key, rec in tensors.items():
            covered = sum(math.prod(c.shape) for c in rec.chunks)
            if covered != math.prod(rec.shape):
                raise ValueError(f"step {step}: chunks of {key!r} cover {covered} of "
                                 f"{math.prod(rec.shape)} elements")
        return Manifest(step=step, world_size=pending.world_size, layout=head["layout"],
                        block_bytes=self.block_bytes, tensors=tensors,
                        state=head["skeletons"], files=files,
                        versions={**self.versions, **head.get("versions", {})})

    def _abort(self, step: int, reason: str) -> None:
        self.pending.pop(step, None)
        self.aborted.add(step)
        self.events.append(f"aborted step {step}: {reason}")
        log.warning("snapshot %d aborted: %s", step, reason)
        self.store.delete_step(step)

    def gc(self) -> None:
        newest = self.latest_committed()
        if newest is None:
            return
        for step in sorted(self.pending):
            if step < newest:
                self._abort(step, f"superseded by committed step {newest}")
        for step in self.committed[: -self.keep_last]:
            self.store.delete_step(step)
            self.events.append(f"removed old snapshot {step} (keep_last={self.keep_last})")
        self.committed = self.committed[-self.keep_last:]
        self.manifests = {s: m for s, m in self.manifests.items() if s in self.committed}
        for step in self.store.all_steps():
            if step < newest and step not in self.committed and step not in self.pending:
                self.store.delete_step(step)


class RamCache:
    """Shard-file bytes of the newest snapshots, keyed by (step, file)."""

    def __init__(self) -> None:
        self.files: dict[int, dict[str, bytes]] = {}

    def put(self, step: int, file: str, data: bytes) -> None:
        self.files.setdefault(step, {})[file] = data

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
    """Thread-safe coordinator for one run; used in-process or inside the Ray actor."""

    def __init__(self, store: SnapshotStore, *, keep_last: int = 2, block_bytes: int,
                 faults: FaultInjector | None = None, ram: bool = True) -> None:
        self.lock = threading.RLock()
        self.core = CommitCore(store, keep_last=keep_last, block_bytes=block_bytes,
                               faults=faults)
        self.ram = RamCache() if ram else None
        # On-demand snapshots (before a planned resize): whether one is asked for, and the
        # step the workers took it at (they answer once they have persisted it).
        self.requested = False
        self.answered_step: int | None = None

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
            return self.answered_step is not None and self.answered_step in self.core.committed

    def cancel_request(self) -> None:
        with self.lock:
            self.requested, self.answered_step = False, None

    def put_ram(self, step: int, rank: int, file: str, data: bytes) -> None:
        with self.lock:
            if self.ram is None:
                return
            newest = self.core.latest_committed()
            if step in self.core.aborted or (newest is not None and step <= newest):
                return
            self.ram.put(step, file, data)

    def report_shard(self, receipt: dict[str, Any]) -> int | None:
        with self.lock:
            step = self.core.report(receipt)
            self._trim_ram()
            return step

    def report_failure(self, step: int, rank: int, reason: str) -> None:
        with self.lock:
            self.core.fail(step, rank, reason)
            self._trim_ram()

    def worker_lost(self, rank: int) -> None:
        with self.lock:
            self.core.worker_lost(rank)
            self._trim_ram()

    def committed_steps(self) -> list[int]:
        with self.lock:
            return list(self.core.committed)

    def read_ram(self, step: int, requests: list[tuple[str, int, int]]) -> list[bytes] | None:
        with self.lock:
            return None if self.ram is None else self.ram.read(step, requests)

    def read_manifest(self, step: int) -> bytes | None:
        with self.lock:
            return self.core.manifests.get(step)

    def rewind(self, step: int) -> None:
        with self.lock:
            self.core.rewind(step)
            self._trim_ram()

    def poll(self) -> None:
        """Nothing to do in-process; receipts arrive by call."""

    def events(self) -> list[str]:
        with self.lock:
            return list(self.core.events)

    def _trim_ram(self) -> None:
        if self.ram is None:
            return
        newest = self.core.latest_committed()
        keep = set(self.core.pending) | ({newest} if newest is not None else set())
        self.ram.keep_only(keep)
