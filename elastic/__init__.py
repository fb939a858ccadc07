"""Elastic snapshots: asynchronous, consistent, resharding snapshots of training state.

The face (this package's top-level modules)
-------------------------------------------
* ``Snapshotter`` (``snapshotter``): one per worker: capture at step boundaries, persist in
  the background, restore the newest committed snapshot resharded to this rank's layout.
* ``SnapshotSettings`` (``settings``): a ``Snapshotter``'s tunables, one frozen object.
* ``PreemptionWatcher`` (``preemption``): SIGTERM / a preemption notice -> a forced snapshot.
* ``errors``: what a failure means (definite, doubt, fatal) decides what Baton does.
* ``catalog`` (list, describe, verify, export, copy a shard checked) and ``set_aside``
  (``rewind``, ``restore_quarantined``): a person's tools over a run's snapshots.
* ``FaultInjector`` (``faults``), ``collectives``, ``replicas``, ``version``,
  ``snapshot_ref`` and ``testing``: the small pieces the rooms share, and test helpers.

The rooms, in the order a snapshot passes through them
------------------------------------------------------
``write/`` (capture, persist) → ``coord/`` (receipts, commit, generations, garbage
collection; the Ray actor) → ``read/`` (restore, batched verified reads, the group read),
over ``lease/`` (one driver per run), ``store/`` (the run directory, the RAM tier),
``state/`` (the registry, module state, layouts), ``format/`` (records and the checks every
reader applies) and ``storage/`` (the storage layer, the project's leaf). ``portable/`` is the
framework-neutral reader and writer of the format. Each room's ``__init__`` states its
contract and the names other rooms import from it; ``tests/project/test_imports.py`` keeps
the import order (face > write, read, portable > coord > lease > store, state > format >
errors and the shared pieces > storage).

The on-disk format is described in ``elastic/format/records.py`` and docs/snapshot-format.md.

The names below, for users, load on first use (PEP 562), never at ``import elastic``:
``import elastic.storage`` (``data_state``'s one dependency) loads no torch and no Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic.errors import (
        FatalRunError,
        FencedError,
        ManifestError,
        ReplicasDivergedError,
        RestoreMemoryError,
        SnapshotIntegrityError,
        SnapshotMisfitError,
        StorageUnavailableError,
    )
    from elastic.lease import LeaseHeldError, LeaseLostError, RunLease
    from elastic.preemption import PreemptionWatcher
    from elastic.set_aside import restore_quarantined, rewind
    from elastic.settings import SnapshotSettings
    from elastic.snapshotter import Snapshotter
    from elastic.state import SnapshotMismatchError, StateRegistry
    from elastic.store import SnapshotStore

# Public name -> the module that defines (or exposes) it.
_LAZY = {
    "FatalRunError": "elastic.errors",
    "FencedError": "elastic.errors",
    "LeaseHeldError": "elastic.lease",
    "LeaseLostError": "elastic.lease",
    "ManifestError": "elastic.errors",
    "PreemptionWatcher": "elastic.preemption",
    "ReplicasDivergedError": "elastic.errors",
    "RestoreMemoryError": "elastic.errors",
    "RunLease": "elastic.lease",
    "SnapshotIntegrityError": "elastic.errors",
    "SnapshotMismatchError": "elastic.state",
    "SnapshotMisfitError": "elastic.errors",
    "SnapshotSettings": "elastic.settings",
    "SnapshotStore": "elastic.store",
    "Snapshotter": "elastic.snapshotter",
    "StateRegistry": "elastic.state",
    "StorageUnavailableError": "elastic.errors",
    "restore_quarantined": "elastic.set_aside",
    "rewind": "elastic.set_aside",
}

# Spelled out (not sorted(_LAZY)) so linters and IDEs see the names the stubs above import.
__all__ = [
    "FatalRunError",
    "FencedError",
    "LeaseHeldError",
    "LeaseLostError",
    "ManifestError",
    "PreemptionWatcher",
    "ReplicasDivergedError",
    "RestoreMemoryError",
    "RunLease",
    "SnapshotIntegrityError",
    "SnapshotMisfitError",
    "SnapshotMismatchError",
    "SnapshotSettings",
    "SnapshotStore",
    "Snapshotter",
    "StateRegistry",
    "StorageUnavailableError",
    "restore_quarantined",
    "rewind",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
