"""Elastic snapshots: asynchronous, consistent, resharding snapshots of training state.

Public API (see each module's docstring for its contract):

- ``StateRegistry`` (registry.py): one place for every stateful component, fixed keys.
- ``Snapshotter`` (snapshotter.py): capture at step boundaries, persist in the background,
  restore the newest committed snapshot resharded to this rank's layout.
- ``PreemptionWatcher`` (preemption.py): SIGTERM / Ray preemption notice -> forced snapshot.
- ``elastic.coordinator`` (the only Ray module): the run's coordinator actor and its client,
  and the RAM tier's per-node store actors.
- ``elastic.ram_store``: the RAM tier (peers' stores of shard copies, ring placement).
- ``FaultInjector`` (faults.py): fault injection keyed by (rank, step, phase) for tests.
- ``elastic.storage.storage_io``: Baton's one storage layer (local and ``s3://``), a leaf module.

The on-disk format is described in format.py and docs/snapshot-format.md.

The names above are loaded on first use (PEP 562 ``__getattr__``), never at ``import
elastic``: so ``import elastic.storage`` (what ``data_state`` does) loads no torch and no
Ray, and ``data_state`` depends on that leaf alone, not on the rest of ``elastic``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic.faults import FaultInjector
    from elastic.preemption import PreemptionWatcher
    from elastic.registry import StateRegistry
    from elastic.snapshotter import Snapshotter

_LAZY = {
    "FaultInjector": "elastic.faults",
    "PreemptionWatcher": "elastic.preemption",
    "Snapshotter": "elastic.snapshotter",
    "StateRegistry": "elastic.registry",
}

__all__ = ["FaultInjector", "PreemptionWatcher", "Snapshotter", "StateRegistry"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
