"""Where snapshots live: a run directory on storage, and the RAM tier on peer nodes.

* ``snapshot_store``: ``SnapshotStore``, one run directory (local or ``s3://``) as a
  ``Storage``: its snapshots, manifests, receipts, quarantine and spare files.
* ``ram_store``: the RAM tier, copies of shard files held by stores on peer nodes (ring
  placement, a cap per node), never on the head (``RamTier``, ``RamStore``).

Imports ``elastic.format`` and the storage layer only.
"""

from __future__ import annotations

from elastic.store.ram_store import (
    PutWaiter,
    RamStore,
    RamStoreClient,
    RamTier,
    Requests,
    StoreLost,
    in_process_tier,
)
from elastic.store.snapshot_store import SnapshotStore

__all__ = ["PutWaiter", "RamStore", "RamStoreClient", "RamTier", "Requests", "SnapshotStore",
           "StoreLost", "in_process_tier"]
