"""What a ``Snapshotter`` is tuned with: one frozen ``SnapshotSettings``.

Contract
--------
``SnapshotSettings`` holds every tunable of a worker's snapshots; the collaborators (the
coordinator, the RAM tier, a fault injector) and the worker's identity (run, rank, world
size, generation) are the ``Snapshotter``'s own parameters. Construction validates the
values a snapshot depends on and raises ``ValueError`` with one line naming the field. It
imports nothing of the project but the constants its defaults come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic.format import DEFAULT_BLOCK_BYTES, LAYOUTS
from elastic.state import DEFAULT_SPLIT_MIN_BYTES


@dataclass(frozen=True)
class SnapshotSettings:
    """A worker's snapshot tunables (``elastic.snapshotter`` says what each one does)."""

    layout: str = "ddp"  # "ddp" (replicated) or "fsdp" (sharded), as the manifest records
    snapshot_every: int = 100  # steps between periodic snapshots
    keep_last: int = 2  # committed snapshots kept (and the one the newest were trained from)
    ram: bool = True  # use a RAM tier (the one given, or the in-process one at world size 1)
    ram_cap_bytes: int | None = None  # cap of the in-process RAM store (None: no cap)
    on_busy: str = "skip"  # the previous snapshot still persisting: "skip" or "wait"
    durable: bool = True  # fsync each shard and its directories before the receipt
    storage_options: dict[str, Any] | None = None  # passed to the storage layer (S3 keys...)
    block_bytes: int = DEFAULT_BLOCK_BYTES  # one crc32 per block of a chunk
    split_min_bytes: int = DEFAULT_SPLIT_MIN_BYTES  # replicated tensors this large are split
    flush_timeout_s: float = 120.0  # close(): how long in-flight snapshots may take to commit
    storage_timeout_s: float | None = None  # one storage call's deadline (None: the store's)
    storage_retry_s: float | None = None  # transient errors retried this long (None: same)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {self.snapshot_every}")
        if self.on_busy not in ("skip", "wait"):
            raise ValueError(f"on_busy must be 'skip' or 'wait', got {self.on_busy!r}")

    def storage_deadlines(self) -> dict[str, float]:
        """The storage deadlines set here, as ``SnapshotStore``'s keyword arguments."""
        deadlines: dict[str, float] = {}
        if self.storage_timeout_s is not None:
            deadlines["timeout_s"] = self.storage_timeout_s
        if self.storage_retry_s is not None:
            deadlines["retry_deadline_s"] = self.storage_retry_s
        return deadlines
