"""The commit protocol, as plain Python (the Ray actor in ray_actors.py is this, made remote).

``CommitCore`` owns the snapshot store's namespace for one run:

* **Generations.** Every worker-group attempt calls ``new_generation()`` once (rank 0); the
  number is monotonic and persisted (``generation.py``), a restarted coordinator or new driver
  continuing it. Shard names carry it (``shard-R-of-W-gG.safetensors``): no name is reused.
  Receipts, failure reports and RAM puts of another generation are refused; a new generation
  aborts what the previous one left in flight. A commit and ``new_generation`` exclude each
  other: a step of G commits before G+1 starts or not at all (never fenced by its own advance).
* ``report(receipt)`` records one rank's durable shard of step ``s``. With all ``world_size``
  receipts in it checks them (``receipts.py``; a refusal aborts the step and is kept among the
  failures the driver shows) and, unless fenced, writes ``manifest.json`` create-only
  (``generation.commit_manifest``: the commit), then collects: older in-flight steps aborted,
  the newest ``keep_last`` commits kept (older ones retired), uncommitted leftovers older than
  the newest commit deleted. Bookkeeping is done before ``report`` returns; the deletions run
  in order on one housekeeping thread (``settle()`` waits for them; one lost to a crash is
  redone later). A step whose manifest write raised (a lost answer may have landed) is
  deleted only once its manifest is known absent (``collect.remove_failed_manifest``).
* ``fail(step, rank, reason, generation)`` / ``worker_lost(rank)`` abort the affected in-flight
  snapshots, deleting their generation's files; so are those older than ``pending_timeout_s``
  or beyond the ``max_pending`` newest (a stuck rank cannot grow memory without bound).
* ``reject(step, reason)``: a *definite* integrity failure moves a committed snapshot to
  ``RUN/quarantine/`` (committed until moved, never deleted); ``rewind(step)`` quarantines
  newer committed snapshots the same way: doubt never destroys.
* On construction it rebuilds its view from the store and removes uncommitted leftovers,
  remembered as aborted so late receipts cannot resurrect a partial snapshot. ``health()``:
  the newest commit, in-flight steps, recent failure reasons, fenced or not. Storage I/O runs
  outside ``_lock`` (a slow store never blocks a poll); a commit's fencing read and manifest
  write hold the generation lock. ``LocalCoordinator`` wraps the core.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from elastic.coord.collect import collect, delete_generation_files, remove_failed_manifest
from elastic.coord.generation import commit_manifest, read_generation, write_generation
from elastic.coord.receipts import Receipt, manifest_from_receipts
from elastic.errors import FencedError
from elastic.faults import FaultInjector
from elastic.format import Manifest
from elastic.store import SnapshotStore

log = logging.getLogger("baton.elastic")

# Reasons kept for the driver's display (newest last).
_FAILURES_KEPT = 20
_EVENTS_KEPT = 500


@dataclass
class _Pending:
    world_size: int
    generation: int
    started: float
    receipts: dict[int, Receipt] = field(default_factory=dict)


# A storage action decided under the lock and carried out after it is released.
_Action = Callable[[], None]


class CommitCore:
    def __init__(self, store: SnapshotStore, *, keep_last: int = 2, block_bytes: int,
                 faults: FaultInjector | None = None, versions: dict[str, str] | None = None,
                 lease_token: str | None = None, pending_timeout_s: float = 600.0,
                 max_pending: int = 3, clock: Callable[[], float] = time.monotonic) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (got {keep_last}); at least the newest "
                             "committed snapshot must be kept")
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1 (got {max_pending})")
        self.store = store
        self.keep_last = keep_last
        self.block_bytes = block_bytes
        self.faults = faults or FaultInjector()
        self.versions = dict(versions or {})
        self.lease_token = lease_token
        self.pending_timeout_s = pending_timeout_s
        self.max_pending = max_pending
        self.clock = clock
        self._lock = threading.RLock()
        self._generation_lock = threading.Lock()
        self.pending: dict[int, _Pending] = {}
        self.committing: set[int] = set()
        self.aborted: set[tuple[int, int]] = set()  # (generation, step)
        # Human-readable log of aborts, refusals and commits: the newest only (a coordinator
        # lives as long as the run, thousands of snapshots).
        self.events: deque[str] = deque(maxlen=_EVENTS_KEPT)
        self.failures: deque[dict[str, Any]] = deque(maxlen=_FAILURES_KEPT)
        self.manifests: dict[int, bytes] = {}  # committed in this process's lifetime
        self.fenced: str | None = None
        self.last_commit_time: float | None = None
        # Deletions (garbage collection) run here, one at a time in order: never on a reply's
        # path. Its thread exits with the interpreter after finishing what it was handed.
        self._housekeeping = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-gc")
        self.generation = read_generation(store)
        self.committed: list[int] = store.committed_steps()
        for step in store.all_steps():
            if step not in self.committed:
                self.aborted.add((self.generation, step))
                self.events.append(f"aborted step {step}: uncommitted leftover found at "
                                   "coordinator start")
                store.delete_step(step)

    # ------------------------------------------------------------------ generations

    def new_generation(self) -> int:
        """Start a worker-group attempt: the next generation number, persisted before it is
        returned. Everything the previous generation left in flight is aborted."""
        with self._generation_lock:
            persisted = read_generation(self.store)
            with self._lock:
                if self.fenced:
                    raise FencedError("this coordinator may no longer start worker groups: "
                                      f"{self.fenced}")
                generation = max(persisted, self.generation) + 1
            write_generation(self.store, generation)
            with self._lock:
                self.generation = generation
                actions = [self._abort_locked(step, f"generation {generation} started")
                           for step in sorted(self.pending)]
                self.events.append(f"generation {generation} started")
        _run(actions)
        return generation

    def current_generation(self) -> int:
        with self._lock:
            return self.generation

    # ------------------------------------------------------------------ protocol

    def report(self, receipt: Receipt) -> int | None:
        """Record one shard receipt; return the step if this receipt committed it."""
        step, rank, world = receipt.step, receipt.rank, receipt.world_size
        generation = receipt.generation
        commit: tuple[Manifest, bytes] | None = None
        actions: list[_Action] = []
        with self._lock:
            refusal = self._refusal_locked(step, generation)
            if refusal is not None:
                self.events.append(f"refused receipt of rank {rank} for step {step}: {refusal}")
                return None
            actions += self._expire_locked()
            pending = self.pending.get(step)
            if pending is None:
                pending = self.pending[step] = _Pending(world, generation, self.clock())
                actions += self._bound_pending_locked()
            if step not in self.pending:  # aborted just now to bound the in-flight steps
                _run(actions)
                return None
            if pending.world_size != world:
                actions.append(self._abort_locked(
                    step, f"rank {rank} reported world_size {world}, expected "
                          f"{pending.world_size}"))
            else:
                pending.receipts[rank] = receipt
                if len(pending.receipts) == world:
                    try:
                        commit = manifest_from_receipts(
                            step, pending.world_size, pending.generation, pending.receipts,
                            block_bytes=self.block_bytes, versions=self.versions)
                    except ValueError as err:  # a step its receipts refuse: a failure
                        self.failures.append({"step": step, "rank": -1, "where": "coordinator",
                                              "reason": str(err), "generation": generation,
                                              "time": time.time()})
                        actions.append(self._abort_locked(step, str(err)))
                    else:
                        self.pending.pop(step)
                        self.committing.add(step)
        _run(actions)
        if commit is None:
            return None
        return self._commit(*commit, generation)

    def fail(self, step: int, rank: int, reason: str, generation: int | None = None,
             where: str = "") -> None:
        """A rank could not make its shard of ``step`` durable: abort that snapshot."""
        with self._lock:
            gen = self.generation if generation is None else generation
            if gen != self.generation:
                self.events.append(f"ignored failure report of rank {rank} for step {step} "
                                   f"from generation {gen} (current {self.generation})")
                return
            self.failures.append({"step": step, "rank": rank, "reason": reason, "where": where,
                                  "generation": gen, "time": time.time()})
            if step in self.committed or step in self.committing:
                return
            action = self._abort_locked(step, f"rank {rank} failed: {reason}")
        action()

    def worker_lost(self, rank: int) -> None:
        with self._lock:
            actions = [self._abort_locked(step, f"worker {rank} lost before its shard was "
                                                "durable")
                       for step in sorted(self.pending)
                       if rank not in self.pending[step].receipts]
        _run(actions)

    def reject(self, step: int, reason: str, rewound_to: int | None = None) -> None:
        """A definite integrity failure of committed snapshot ``step``: quarantine it, with
        this generation (``elastic.set_aside``). It stays committed until the move is done:
        if storage fails it, the error propagates (doubt never destroys)."""
        with self._lock:
            if step not in self.committed:
                return
            generation = self.generation
        log.warning("snapshot %d quarantined: %s", step, reason)
        self.store.quarantine_step(step, reason, generation=generation, rewound_to=rewound_to)
        with self._lock:
            if step in self.committed:
                self.committed.remove(step)
            self.manifests.pop(step, None)
            self.events.append(f"quarantined snapshot {step}: {reason}")

    def rewind(self, step: int) -> None:
        """Training restarted from ``step``: newer in-flight steps are aborted; a newer
        committed one (never left by a restore, which refuses a misfit) is quarantined."""
        with self._lock:
            actions = [self._abort_locked(s, f"training restarted from step {step}")
                       for s in sorted(self.pending) if s > step]
            newer = [s for s in self.committed if s > step]
        _run(actions)
        for s in newer:
            self.reject(s, f"training restarted from the older step {step}", step)

    def latest_committed(self) -> int | None:
        with self._lock:
            return self.committed[-1] if self.committed else None

    def expire(self) -> None:
        """Abort in-flight snapshots older than ``pending_timeout_s`` (called on every poll)."""
        with self._lock:
            actions = self._expire_locked()
        _run(actions)

    def health(self) -> dict[str, Any]:
        """What the driver shows: newest commit, in-flight steps, recent failure reasons."""
        with self._lock:
            return {
                "generation": self.generation,
                "committed": list(self.committed),
                "latest": self.committed[-1] if self.committed else None,
                "pending": sorted(self.pending),
                "failures": list(self.failures),
                "fenced": self.fenced,
            }

    # ------------------------------------------------------------------ internals

    def _refusal_locked(self, step: int, generation: int) -> str | None:
        if self.fenced:
            return f"this coordinator is fenced ({self.fenced})"
        if generation != self.generation:
            return f"it is from generation {generation}, the current one is {self.generation}"
        if (generation, step) in self.aborted:
            return "the step was aborted"
        if step in self.committed or step in self.committing:
            return "the step is already committed"
        if self.committed and step < self.committed[-1]:
            return f"the step is older than the newest commit {self.committed[-1]}"
        return None

    def _commit(self, manifest: Manifest, data: bytes, generation: int) -> int | None:
        step = manifest.step
        self.faults.hit(-1, step, "commit_begin")
        with self._generation_lock:  # exclusive with new_generation (module docstring)
            superseded = generation != self.generation  # set only under the generation lock
            fenced, failure = (None, None) if superseded else commit_manifest(
                self.store, manifest, data, generation, self.lease_token,
                mid_write=lambda: self.faults.hit(-1, step, "commit_manifest"))
            with self._lock:
                self.committing.discard(step)
                if superseded:
                    reason = f"generation {self.generation} started"
                elif fenced is not None:
                    self.fenced, reason = fenced, f"fenced: {fenced}"
                elif failure is not None:
                    self.failures.append({"step": step, "rank": -1, "where": "coordinator",
                                          "reason": failure, "generation": generation,
                                          "time": time.time()})
                    reason = failure
                else:
                    self.manifests[step] = data
                    self.committed.append(step)
                    self.committed.sort()
                    self.last_commit_time = time.time()
                    self.events.append(f"committed step {step}")
                    reason = None
                if reason is not None:
                    action = self._abort_locked(step, reason, generation=generation,
                                                world=manifest.world_size)
        if reason is not None:
            if fenced is not None:
                log.error("snapshot %d not committed: %s", step, fenced)
            # A write that raised may have landed all the same (a lost answer): the step's
            # files go only once its manifest is known to be absent.
            if failure is None or remove_failed_manifest(self.store, step, data):
                action()
            return None
        self.faults.hit(-1, step, "commit_end")
        self.gc()
        return step

    def _abort_locked(self, step: int, reason: str, *, generation: int | None = None,
                      world: int | None = None) -> _Action:
        """Mark ``step`` aborted for its generation; return the deletion to run unlocked."""
        pending = self.pending.pop(step, None)
        gen = pending.generation if pending else (
            self.generation if generation is None else generation)
        world = pending.world_size if pending else world
        self.aborted.add((gen, step))
        self.events.append(f"aborted step {step}: {reason}")
        log.warning("snapshot %d aborted: %s", step, reason)
        return lambda: delete_generation_files(self.store, step, gen, world,
                                               step_committed=step in self.committed)

    def _expire_locked(self) -> list[_Action]:
        now = self.clock()
        return [self._abort_locked(step, f"not complete after {self.pending_timeout_s:.0f} s "
                                         "(snapshots.pending_timeout_s)")
                for step, p in sorted(self.pending.items())
                if now - p.started > self.pending_timeout_s]

    def _bound_pending_locked(self) -> list[_Action]:
        excess = sorted(self.pending)[: max(0, len(self.pending) - self.max_pending)]
        return [self._abort_locked(step, f"more than {self.max_pending} snapshots in flight; "
                                         "a rank is not finishing its shards")
                for step in excess]

    def settle(self) -> None:
        """Wait until every deletion handed to the housekeeping thread so far is done."""
        self._housekeeping.submit(lambda: None).result()

    def gc(self) -> None:
        """The collection after a commit: bookkeeping now, the deletions on the housekeeping
        thread (module docstring)."""
        with self._lock:
            newest = self.committed[-1] if self.committed else None
            if newest is None:
                return
            actions = [self._abort_locked(step, f"superseded by committed step {newest}")
                       for step in sorted(self.pending) if step < newest]
            old = self.committed[: -self.keep_last]
            self.committed = self.committed[-self.keep_last:]
            # A receipt of an older generation or of a step before the newest commit is
            # refused as such: their abort records need not be kept (they would grow forever).
            self.aborted = {(g, s) for g, s in self.aborted
                            if g == self.generation and s >= newest}
            self.manifests = {s: m for s, m in self.manifests.items() if s in self.committed}
            for step in old:
                self.events.append(f"removed old snapshot {step} (keep_last={self.keep_last})")
        self._housekeeping.submit(self._collect, actions, old, newest)

    def _collect(self, actions: list[_Action], old: list[int], newest: int) -> None:
        """The deletions of ``gc``, on the housekeeping thread (``collect.collect``)."""
        collect(self.store, actions, old, self._leftover, label=f"after step {newest}")

    def _leftover(self, step: int) -> bool:
        """Whether ``step`` is an uncommitted leftover, older than the newest commit *now*."""
        with self._lock:
            newest = self.committed[-1] if self.committed else -1
            return (step < newest and step not in self.committed and step not in self.pending
                    and step not in self.committing)


def _run(actions: list[_Action]) -> None:
    for action in actions:
        action()
