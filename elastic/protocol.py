"""The coordinator protocol: everything a worker asks of its run's coordinator.

Contract
--------
Three implementations speak it: ``elastic.local_coordinator.LocalCoordinator`` (in-process),
``elastic.store_coordinator.StoreCoordinator`` (multi-process groups without Ray: receipts
through the store, rank 0 commits) and ``elastic.coordinator.RayCoordinatorClient`` (the
Ray actor). Every method is safe to repeat: a retried call after a coordinator restart is
either refused (stale generation, aborted step) or has the same effect.
"""

from __future__ import annotations

from typing import Any, Protocol


class CoordinatorClient(Protocol):
    """What a worker needs from the run's coordinator."""

    def new_generation(self) -> int:
        """Start a worker-group attempt (rank 0 only); returns its generation number."""
        ...

    def current_generation(self) -> int: ...

    def put_ram(self, step: int, rank: int, file: str, data: bytes, generation: int) -> bool:
        """Hold an off-node copy of a shard file; False when refused (storage-only)."""
        ...

    def report_shard(self, receipt: dict[str, Any]) -> int | None:
        """One rank's shard is durable; returns the step if this receipt committed it."""
        ...

    def report_failure(self, step: int, rank: int, reason: str,
                       generation: int | None = None, where: str = "") -> None: ...

    def committed_steps(self) -> list[int]: ...

    def read_ram(self, step: int, requests: list[tuple[str, int, int]]) -> list[bytes] | None:
        ...

    def read_manifest(self, step: int) -> bytes | None: ...

    def reject(self, step: int, reason: str) -> None:
        """A definite integrity failure of committed ``step``: quarantine it."""
        ...

    def rewind(self, step: int) -> None: ...

    def poll(self) -> None: ...

    def health(self) -> dict[str, Any]: ...

    def flush(self, timeout_s: float) -> None:
        """At close: give in-flight snapshots up to ``timeout_s`` to commit (store groups)."""
        ...

    def snapshot_requested(self) -> bool: ...

    def answer_request(self, step: int) -> None: ...
