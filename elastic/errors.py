"""The error vocabulary of elastic snapshots: what a failure means decides what Baton does.

* ``SnapshotIntegrityError`` (a ``ValueError``): a *definite* integrity failure of one snapshot
  (a checksum mismatch, a malformed or unsafe manifest, a file missing from a store that
  answered). Only this rejects a snapshot: restore falls back to the previous committed one,
  the rejected one is moved to ``RUN/quarantine/STEP/`` (never deleted). Its subclasses:
  ``ManifestError`` (the manifest is malformed or names what it must not: a path outside the
  snapshot, a dtype the file disagrees with) and ``NonFiniteError`` (a floating tensor holds
  NaN or Inf: what a buggy writer commits, checksums passing; no code trains on from it).
* ``SnapshotMisfitError``: a ``ManifestError`` that may be the live code's, not the snapshot's:
  its state does not fit a registered component (keys, types) or a tensor's dtype. A code or
  config change gives it for every newer snapshot, so restore neither quarantines nor restores
  past one for it: it raises ``SnapshotMismatchError``, every snapshot left in place, naming
  the newest one that fits (going back: ``baton snapshots rewind``, ``elastic.set_aside``).
* ``StorageUnavailableError`` (an ``OSError``): the store did not answer within its deadline
  after retries (HTTP 5xx, throttling, a black-holed endpoint): *doubt*, not proof; a restore
  that meets it fails without falling back and without touching any snapshot.
* ``RestoreMemoryError`` (a ``RuntimeError``): the worker could not allocate what a restore
  needs; the worker's shortage, so restore fails without falling back (an older snapshot is
  as big) and without touching any snapshot.
* ``FencedError``: a report from another worker-group generation or from a driver whose lease
  was taken over; refused, nothing it sent is committed.
* ``describe(err)``: the one line a person can act on (the driver shows it): errno names for
  OS errors (``ENOSPC``, ``EACCES``), "storage unreachable" for doubt.
* ``FatalRunError``: an error a restart cannot fix (a bad dataset, a recipe that disagrees with
  the run it continues, a worker on other code): the run fails once, with this message.
* ``ReplicasDivergedError``, a ``FatalRunError``: state every rank must hold the same (a DDP
  model, its optimizer) differs between ranks, so no snapshot of it is committed.
  ``divergence_message(name, step, ranks)`` is its one line, whether the sampled fingerprints
  (``elastic.replicas``) or the commit's full checksums (``elastic.coord.receipts``) refused it.
"""

from __future__ import annotations

import errno as errno_module
from collections.abc import Sequence

# The storage layer raises these itself; they are defined there (one class each) and are
# part of this vocabulary too.
from elastic.storage import SnapshotIntegrityError, StorageUnavailableError

__all__ = ["FatalRunError", "FencedError", "ManifestError", "NonFiniteError",
           "ReplicasDivergedError",
           "RestoreMemoryError", "SnapshotIntegrityError", "SnapshotMisfitError",
           "StorageUnavailableError", "describe", "divergence_message"]


class ManifestError(SnapshotIntegrityError):
    """A manifest is malformed or unsafe; it is untrusted input."""


class NonFiniteError(SnapshotIntegrityError):
    """A floating tensor of a snapshot holds NaN or Inf (module contract)."""


class SnapshotMisfitError(ManifestError):
    """A snapshot's state does not fit the registered components (module contract)."""


class RestoreMemoryError(RuntimeError):
    """A restore could not allocate its tensors: the worker is short of memory."""


class FencedError(RuntimeError):
    """A report from a stale generation or a driver that no longer holds the run lease."""


class FatalRunError(RuntimeError):
    """An error that restarting the worker group cannot fix; the run fails once."""


class ReplicasDivergedError(FatalRunError):
    """Replicated state differs between ranks: the snapshot is not committed."""


def divergence_message(name: str, step: int, ranks: Sequence[int] = ()) -> str:
    """The one line of a snapshot whose replicated tensor ``name`` differs between ranks
    (``ranks``: those found to differ, the reference rank first; empty: not known)."""
    shown = [str(r) for r in ranks]
    between = ("ranks " + ", ".join(shown[:-1]) + " and " + shown[-1] if len(shown) > 1
               else "ranks")
    return (f"snapshot {step} not committed: {name} differs between {between} (replicated "
            "state diverged: a model not wrapped in DDP/FSDP, or a rank-dependent update); "
            "the previous committed snapshot is intact")


def describe(err: BaseException) -> str:
    """A failure reason a person can act on: errno names for OS errors (ENOSPC, EACCES),
    the store's words for unreachable storage."""
    if isinstance(err, StorageUnavailableError):
        return f"storage unreachable: {err}"
    if (isinstance(err, OSError) and err.errno is not None
            and err.errno in errno_module.errorcode):
        name = errno_module.errorcode[err.errno]
        where = f" ({err.filename})" if err.filename else ""
        return f"{name}: {err.strerror or err}{where}"
    return f"{type(err).__name__}: {err}"
