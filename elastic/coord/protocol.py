"""The coordinator protocol: everything a worker asks of its run's coordinator.

Contract
--------
``CoordinatorClient`` is the one interface a worker (``Snapshotter``, ``Persister``, the
training loop) uses; callers never probe for optional methods. Three implementations speak
all of it:

* ``elastic.coord.local_coordinator.LocalCoordinator``: in-process, and also the Ray actor itself;
* ``elastic.coord.store_coordinator.StoreCoordinator``: multi-process groups without Ray
  (receipts through the store, rank 0 commits; no RAM copy, no on-demand requests);
* ``elastic.coord.ray_actors.RayCoordinatorClient``: the worker side of the Ray actor, a generic
  proxy that forwards exactly ``PROTOCOL_METHODS`` (minus the local no-ops ``poll`` and
  ``flush``) to the actor, so adding a method here and to ``LocalCoordinator`` is all it
  takes to reach it over Ray.

The coordinator handles metadata only: receipts (``elastic.coord.receipts.Receipt``, which
name the nodes whose RAM stores took a copy of the shard, ``receipt.ram``), generations,
commits, requests. Shard bytes go
from a worker to its peers' RAM stores and to storage, never through it.

Every method is safe to repeat: a retried call after a coordinator restart is either
refused (stale generation, aborted step) or has the same effect. The driver-side controls
(``request_snapshot``, ``request_met``, ``cancel_request``, ``request_stop``,
``membership_reset``) are not part of it: only the driver calls them, on the actor handle.
The ``membership_*`` methods are in-process recovery's (``elastic.coord.membership``); a
coordinator that runs no membership answers them with its ``off_view()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from elastic.coord.receipts import Receipt


@runtime_checkable
class CoordinatorClient(Protocol):
    """What a worker needs from the run's coordinator."""

    # ------------------------------------------------------------------ generations

    def new_generation(self) -> int:
        """Start a worker-group attempt (rank 0 only); returns its generation number."""
        ...

    def current_generation(self) -> int:
        """The newest generation started (rank 0 only in store groups)."""
        ...

    # ------------------------------------------------------------------ writing a snapshot

    def report_shard(self, receipt: Receipt) -> int | None:
        """One rank's shard is durable; returns the step if this receipt committed it."""
        ...

    def report_failure(self, step: int, rank: int, reason: str,
                       generation: int | None = None, where: str = "") -> None:
        """Rank ``rank`` could not persist ``step`` (rank -1: the coordinator itself):
        the step is aborted, ``reason`` kept for the driver's report."""
        ...

    def worker_lost(self, rank: int) -> None:
        """Rank ``rank`` is gone: abort every in-flight step still waiting for it."""
        ...

    def poll(self) -> None:
        """Called at every step boundary: collect receipts that arrive out of band (store
        groups) and expire stuck in-flight steps. A no-op where receipts arrive by call."""
        ...

    def flush(self, timeout_s: float) -> None:
        """At close: give in-flight snapshots up to ``timeout_s`` to commit (store groups);
        an in-process coordinator also finishes its pending deletions."""
        ...

    # ------------------------------------------------------------------ reading / restore

    def committed_steps(self) -> list[int]:
        """Committed steps, oldest first."""
        ...

    def ram_locations(self, step: int) -> dict[str, list[str]]:
        """Which nodes' RAM stores hold a copy of each shard file of ``step`` (metadata
        from the receipts; empty when none). The bytes are read from those stores
        (``elastic.store.ram_store.RamTier``), never through the coordinator."""
        ...

    def read_manifest(self, step: int) -> bytes | None:
        """The manifest bytes of committed ``step`` if held in memory, else None."""
        ...

    def reject(self, step: int, reason: str) -> None:
        """A definite integrity failure of committed ``step``: quarantine it."""
        ...

    def rewind(self, step: int) -> None:
        """Training restarted from ``step``: newer in-flight steps are aborted, newer
        committed ones quarantined (never deleted)."""
        ...

    # ------------------------------------------------------------------ observing

    def health(self) -> dict[str, Any]:
        """Plain-data state for the driver: committed, in flight, failures, RAM held."""
        ...

    def events(self) -> list[str]:
        """What the coordinator did, one line each (aborts, quarantines, refusals)."""
        ...

    # ------------------------------------------------------------------ on-demand snapshots

    def snapshot_requested(self) -> bool:
        """The driver asked for a snapshot at the next step boundary (before a resize)."""
        ...

    def answer_request(self, step: int) -> None:
        """The workers took the requested snapshot at ``step`` (and train no further)."""
        ...

    # ------------------------------------------------------------------ stop requests

    def stop_requested(self) -> bool:
        """The driver asked the run to stop: commit the current step, then end normally."""
        ...

    def answer_stop(self, step: int) -> None:
        """Rank 0: the workers stopped after ``step`` (its snapshot persisted)."""
        ...

    # ------------------------------------------------------------------ membership

    def membership_join(self, member: str, order: int) -> dict[str, Any]:
        """Join the forming worker group, or wait as a joiner to a running one
        (``elastic.coord.membership``: every membership method returns its view)."""
        ...

    def membership_beat(self, member: str, generation: int) -> dict[str, Any]:
        """Alive; the current view (joiners waiting, a reform, a fallback, fencing)."""
        ...

    def membership_reform(self, member: str, generation: int, reason: str) -> dict[str, Any]:
        """Ask for the next membership (``reason``: "failure" or "join")."""
        ...

    def membership_fallback(self, member: str, reason: str) -> dict[str, Any]:
        """In-process recovery cannot go on: every member ends its worker."""
        ...

    def membership_finish(self, generation: int) -> dict[str, Any]:
        """The run's last step is committed: later joiners restore it instead."""
        ...

    def membership_leave(self, member: str) -> None:
        """A waiting joiner gives up."""
        ...

    # ------------------------------------------------------------------ metrics

    def record_metrics(self, metrics: dict[str, Any]) -> None:
        """The metrics the training loop reported last (rank 0's ``ray.train.report``),
        for the driver's result; held in memory only."""
        ...


# The protocol's method names, derived from the class so they cannot drift from it.
PROTOCOL_METHODS: frozenset[str] = frozenset(
    name for name, value in vars(CoordinatorClient).items()
    if callable(value) and not name.startswith("_"))
