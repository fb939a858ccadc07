"""The run lease: one live driver per run directory (P7 "one writer").

* ``run_lease``: ``RunLease`` (acquire, renew, release; ``LeaseHeldError`` when another live
  driver holds it, ``LeaseLostError`` when it was taken over), ``lease_holds`` (the fencing
  check a coordinator makes before each commit) and what a person is told about a holder.
* ``held``: ``held_lease``, the lease's life as one ``with`` block (take, renew for the block,
  release on leaving it, even by an exception); every driver and command that holds the
  lease holds it through this.
* ``lease_io``: the storage primitives underneath (atomic create, conditional replace and
  delete of ``RUN/lease.json``, locally and on S3).

Imports ``elastic.store`` and the storage layer only.
"""

from __future__ import annotations

from elastic.lease.held import held_lease
from elastic.lease.run_lease import (
    LeaseHeldError,
    LeaseLostError,
    RunLease,
    holder_is_dead,
    lease_holds,
)

__all__ = ["LeaseHeldError", "LeaseLostError", "RunLease", "held_lease", "holder_is_dead",
           "lease_holds"]
