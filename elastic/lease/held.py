"""``held_lease``: the run lease's whole life (take, renew, release) as one ``with`` block.

Contract
--------
``with held_lease(run, *, force=False, ttl_s=60.0, renew=True, lease=None) as lease:``

* **Take.** ``run`` is the run directory (a ``SnapshotStore`` or its URI). Without ``lease``
  the block takes a new ``RunLease`` (``force`` takes it over even from a live driver; see
  ``elastic.lease.run_lease``). ``LeaseHeldError`` is raised before the block runs while
  another live driver holds it: then nothing was taken and nothing is released.
* **Renew.** With ``renew`` (the default) the lease is renewed from one daemon thread every
  ``ttl_s / 3`` for as long as the block lasts, so work of any length keeps it (a storage
  hiccup is retried, never taken for a loss). Without it the lease lives ``ttl_s`` from the
  take: for short blocks whose commits are fenced anyway.
* **Failure to renew.** A renew that finds the lease taken over records ``lease.lost`` (one
  line) and stops renewing; the block is not interrupted — from then on the coordinator's
  fencing (``lease_holds``) refuses its commits — so a block that must stop at once checks
  ``lease.lost``. An exception that leaves the block after the loss is raised as
  ``LeaseLostError`` (the loss, the likely cause, chained to it); ``KeyboardInterrupt`` and
  ``SystemExit`` pass as they are.
* **Release.** On leaving the block, normally or by any exception, renewing stops and the
  lease is released: deleted only while it still carries this block's token, never a lease
  another driver took over.
* **A lease passed in** (``lease=``) is its owner's: the block neither takes nor releases
  it. Its renewing is left to whoever started it; only a lease nobody renews is renewed
  for the block, and that renewing stops with it. So nested blocks over one lease (the CLI,
  then ``fit``, then the trainer) start one renew thread between them, the outermost's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from elastic.lease.run_lease import DEFAULT_TTL_S, LeaseLostError, RunLease
from elastic.store import SnapshotStore


@contextlib.contextmanager
def held_lease(run: SnapshotStore | str, *, force: bool = False, ttl_s: float = DEFAULT_TTL_S,
               renew: bool = True, lease: RunLease | None = None) -> Iterator[RunLease]:
    """Hold the run lease for the block (module contract)."""
    own = lease is None
    if lease is None:
        lease = RunLease(run if isinstance(run, SnapshotStore) else SnapshotStore(run),
                         ttl_s=ttl_s)
        lease.acquire(force=force)
    renews_here = renew and not lease.renewing
    if renews_here:
        lease.start_renewing()
    try:
        yield lease
    except Exception as err:
        if lease.lost and not isinstance(err, LeaseLostError):
            raise LeaseLostError(lease.lost) from err
        raise
    finally:
        if own:
            lease.release()  # stops renewing first; deletes the lease only while it is ours
        elif renews_here:
            lease.stop_renewing()
