"""The coordinator a worker talks to: the commit protocol plus the in-memory copy.

``LocalCoordinator`` speaks ``elastic.coord.protocol.CoordinatorClient`` for one run, in-process
or as the Ray actor (``elastic.coord.ray_actors`` makes this very class remote). It adds to
``elastic.coord.commit.CommitCore`` (generations, receipts, commit, fencing, GC, quarantine):

* The RAM tier's index, metadata only: which node's store (``elastic.store.ram_store``) holds
  which shard file of which step, as the receipts say (``receipt.ram``). ``ram_locations(step)``
  answers restores; when a snapshot commits or is aborted the stores concerned are told what
  to keep (``RamStore.keep``: the newest commit and the steps in flight, numbered). It never
  receives shard bytes: what it handles per snapshot (``health()["handled_bytes"]``: receipts
  in, manifests out) is O(number of chunks), whatever the state's size. A restarted coordinator
  has lost the receipts: ``recover_ram_index(holdings)`` rebuilds its newest commit's index
  from what the live stores hold (``RamStore.holdings()``; a store that is gone is absent, its
  files are read from storage) and tells those stores what to keep.
* On-demand snapshots before a planned resize: ``request_snapshot`` / ``snapshot_requested`` /
  ``answer_request`` / ``request_met`` / ``cancel_request``.
* Stop requests (Ctrl-C or a time limit on the driver): ``request_stop`` (driver) /
  ``stop_requested`` (workers, every step boundary) / ``answer_stop(step)`` (rank 0, once the
  snapshot of that step is persisted); ``health()["stopped_at"]`` tells the driver. A request
  stays until the fit ends, so a worker group restarted in between stops too.
* In-process recovery's membership (``elastic.coord.membership``): ``membership_reset``
  (driver) and the protocol's ``membership_*`` calls; each formation starts a new generation
  of the commit protocol. The process groups meet at a ``RendezvousStore`` started on first
  use (``rendezvous_host``: this node's address).
* The loop's last reported metrics (``record_metrics``; the driver's ``last_metrics`` gives
  them to Ray Train's ``Result.metrics``).

Thread-safe: its own lock guards only the RAM index and the request flags; the core has its
own and does storage I/O outside it, so a threaded actor never serialises behind a slow store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from elastic.coord.commit import CommitCore
from elastic.coord.membership import Membership, MembershipSettings
from elastic.coord.receipts import Receipt, json_size
from elastic.faults import FaultInjector
from elastic.rendezvous import RendezvousStore
from elastic.store import RamStoreClient, SnapshotStore, StoreLost

log = logging.getLogger("baton.elastic")


class LocalCoordinator:
    """Thread-safe coordinator for one run; used in-process or as the Ray actor."""

    def __init__(self, store: SnapshotStore, *, keep_last: int = 2, block_bytes: int,
                 faults: FaultInjector | None = None,
                 ram_stores: Callable[[str], RamStoreClient] | None = None,
                 lease_token: str | None = None,
                 pending_timeout_s: float = 600.0, max_pending: int = 3,
                 membership: MembershipSettings | None = None,
                 rendezvous_host: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lock = threading.RLock()  # guards the RAM index and the request flags only
        self.core = CommitCore(store, keep_last=keep_last, block_bytes=block_bytes,
                               faults=faults, lease_token=lease_token,
                               pending_timeout_s=pending_timeout_s, max_pending=max_pending,
                               clock=clock)
        # The RAM tier: step -> shard file -> nodes whose store holds a copy; the stores
        # are reached through ``ram_stores(node)`` only to tell them what to keep.
        self.ram_stores = ram_stores
        self.ram_index: dict[int, dict[str, list[str]]] = {}
        self._ram_told: tuple[int | None, tuple[int, ...]] | None = None
        # Each notice's place in the order they were decided: this coordinator's start (a
        # restarted one's notices come after its predecessor's), then a count.
        self._started_ns = time.time_ns()
        self._notices = 0
        self.handled_bytes = 0  # receipts received and manifests served (O(chunks))
        # On-demand snapshots (before a planned resize): whether one is asked for, and the
        # step the workers took it at (they answer once they have persisted it).
        self.requested = False
        self.answered_step: int | None = None
        # Stop requests: whether the driver asked, and the step the workers stopped at.
        self.stop_asked = False
        self.stopped_at: int | None = None
        self.metrics: dict[str, Any] | None = None  # the loop's last report (rank 0's)
        self.rendezvous = RendezvousStore(rendezvous_host)
        self.membership = Membership(self.core.new_generation, self.rendezvous.address,
                                     membership, clock=clock)

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

    # ---------------------------------------------------------------- membership

    def membership_reset(self, expected: int) -> dict[str, Any]:
        """The driver: a whole worker group of ``expected`` workers is starting."""
        return self.membership.reset(expected)

    def membership_join(self, member: str, order: int) -> dict[str, Any]:
        return self.membership.join(member, order)

    def membership_beat(self, member: str, generation: int) -> dict[str, Any]:
        return self.membership.beat(member, generation)

    def membership_reform(self, member: str, generation: int, reason: str) -> dict[str, Any]:
        return self.membership.reform(member, generation, reason)

    def membership_fallback(self, member: str, reason: str) -> dict[str, Any]:
        return self.membership.fallback(member, reason)

    def membership_finish(self, generation: int) -> dict[str, Any]:
        return self.membership.finish(generation)

    def membership_leave(self, member: str) -> None:
        self.membership.leave(member)

    # ---------------------------------------------------------------- metrics

    def record_metrics(self, metrics: dict[str, Any]) -> None:
        with self.lock:
            self.metrics = dict(metrics)

    def last_metrics(self) -> dict[str, Any] | None:
        """The driver: what the loop reported last (None: nothing)."""
        with self.lock:
            return None if self.metrics is None else dict(self.metrics)

    # ---------------------------------------------------------------- shards

    def report_shard(self, receipt: Receipt) -> int | None:
        return self.report_received(receipt, json_size(receipt.to_json()))

    def report_received(self, receipt: Receipt, nbytes: int) -> int | None:
        """``report_shard`` of a receipt that arrived as ``nbytes`` bytes of JSON."""
        with self.lock:
            self.handled_bytes += nbytes
            if receipt.ram:
                self.ram_index.setdefault(receipt.step, {})[receipt.file] = list(receipt.ram)
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

    def ram_locations(self, step: int) -> dict[str, list[str]]:
        with self.lock:
            return {f: list(nodes) for f, nodes in self.ram_index.get(step, {}).items()}

    def recover_ram_index(self, holdings: Mapping[str, Mapping[str, Any]]) -> int:
        """Index the copies of the newest committed snapshot that the stores hold
        (``holdings``: node -> ``RamStore.holdings()``), as their receipts would have; the
        number of (file, node) copies added. Only the newest commit: the index keeps
        nothing else once no step is in flight, and a restore checks every block it reads
        (a copy that fails is read again from storage)."""
        with self.core._lock:
            newest = self.core.committed[-1] if self.core.committed else None
        if newest is None:
            return 0
        added = 0
        with self.lock:
            for node in sorted(holdings):
                held = (holdings[node].get("steps") or {}).get(newest) or {}
                for file in sorted(held.get("files") or {}):
                    nodes = self.ram_index.setdefault(newest, {}).setdefault(str(file), [])
                    if node not in nodes:
                        nodes.append(node)
                        added += 1
        if added:
            log.info("RAM index recovered: %d copies of step %d's files on %d store(s)",
                     added, newest, len(holdings))
        # Whatever notice the predecessor died before sending: tell the stores now.
        with self.lock:
            self._ram_told = None
        self._trim_ram()
        return added

    def read_manifest(self, step: int) -> bytes | None:
        with self.core._lock:
            manifest = self.core.manifests.get(step)
        if manifest is not None:
            with self.lock:
                self.handled_bytes += len(manifest)
        return manifest

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
        """Receipts arrive by call, so whatever can commit has committed; wait for the
        deletions the commits handed to the housekeeping thread (``CommitCore.settle``)."""
        self.core.settle()

    def health(self) -> dict[str, Any]:
        self.core.expire()
        info = self.core.health()
        with self.lock:
            info["ram_files"] = {s: len(files) for s, files in self.ram_index.items()}
            info["handled_bytes"] = self.handled_bytes
            info["stopped_at"] = self.stopped_at
        info["membership"] = self.membership.health()
        return info

    def events(self) -> list[str]:
        with self.core._lock:
            return list(self.core.events)

    def _trim_ram(self) -> None:
        """Forget copies of steps that are neither the newest commit nor in flight, and
        tell the stores concerned when that changed (a commit, an abort)."""
        with self.core._lock:
            newest = self.core.committed[-1] if self.core.committed else None
            in_flight = tuple(sorted(set(self.core.pending) | self.core.committing))
        keep = set(in_flight) | ({newest} if newest is not None else set())
        # A step newer than all of those was indexed after they were read (a receipt on
        # another thread): not this call's to drop (a later one is).
        horizon = max(keep, default=-1)
        with self.lock:
            dropped = [s for s in self.ram_index if s not in keep and s <= horizon]
            nodes = {n for s in self.ram_index for files in [self.ram_index[s]]
                     for holders in files.values() for n in holders}
            for s in dropped:
                del self.ram_index[s]
            told = (newest, in_flight)
            if self.ram_stores is None or not nodes or (not dropped and told == self._ram_told):
                return
            self._ram_told = told
            self._notices += 1
            order = (self._started_ns, self._notices)
        for node in sorted(nodes):
            try:
                self.ram_stores(node).keep(newest, list(in_flight), order)
            except StoreLost:
                continue  # its node is gone, and its copies with it
