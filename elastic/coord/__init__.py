"""The commit: from the workers' receipts to a committed snapshot, and what a run directory's
coordinator owns besides (generations, fencing, garbage collection).

* ``protocol``: ``CoordinatorClient``, everything a worker asks of its run's coordinator.
* ``commit``: ``CommitCore``, the commit protocol as plain Python: receipts in, a manifest
  written last and create-only out; retention, quarantine, planned snapshots.
* ``receipts``: the checks that make one step's receipts a whole manifest.
* ``generation``: ``RUN/generation.json`` and the fencing check (may this coordinator still
  commit?); ``collect``: what aborted generations, failed commits and retention leave behind.
* The coordinators, one protocol: ``LocalCoordinator`` (in process, with the RAM tier),
  ``StoreCoordinator`` (a group without Ray: receipts in the store) and the Ray actor and its
  client in ``ray_actors`` (the only Ray module of ``elastic``: its names below load on first
  use, so importing this room loads no Ray).
* ``membership``: the workers that train together under in-process recovery (its phases,
  ``OFF``, ``REFORMING``, ``FALLBACK``, ``FINISHED``, are what a member reads).

Imports ``elastic.lease``, ``elastic.store``, ``elastic.format`` and below; never the rooms
that write or read tensors (the coordinator never touches tensor bytes).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from elastic.coord.collect import delete_generation_files, remove_failed_manifest
from elastic.coord.generation import (
    GENERATION_NAME,
    fencing_reason,
    read_generation,
    write_generation,
)
from elastic.coord.local_coordinator import LocalCoordinator
from elastic.coord.membership import FALLBACK, FINISHED, OFF, REFORMING, MembershipSettings
from elastic.coord.protocol import CoordinatorClient
from elastic.coord.receipts import Receipt, TensorSpec, manifest_from_receipts
from elastic.coord.store_coordinator import StoreCoordinator

if TYPE_CHECKING:
    from elastic.coord.ray_actors import (
        HEAD_NODE_RESOURCES,
        NAMESPACE,
        RayCoordinatorClient,
        coordinator_name,
        find_coordinator,
        get_or_create_coordinator,
        ray_ram_tier,
        release_ram_stores,
    )

# Loaded on first use (PEP 562): the module that defines each name.
_LAZY = {
    "HEAD_NODE_RESOURCES": "elastic.coord.ray_actors",
    "NAMESPACE": "elastic.coord.ray_actors",
    "RayCoordinatorClient": "elastic.coord.ray_actors",
    "coordinator_name": "elastic.coord.ray_actors",
    "find_coordinator": "elastic.coord.ray_actors",
    "get_or_create_coordinator": "elastic.coord.ray_actors",
    "ray_ram_tier": "elastic.coord.ray_actors",
    "release_ram_stores": "elastic.coord.ray_actors",
}

__all__ = ["CoordinatorClient", "FALLBACK", "FINISHED", "GENERATION_NAME", "HEAD_NODE_RESOURCES",
           "LocalCoordinator", "MembershipSettings", "NAMESPACE", "OFF", "REFORMING",
           "RayCoordinatorClient", "Receipt",
           "StoreCoordinator", "TensorSpec", "coordinator_name", "delete_generation_files",
           "fencing_reason", "find_coordinator", "get_or_create_coordinator",
           "manifest_from_receipts", "ray_ram_tier", "read_generation", "release_ram_stores",
           "remove_failed_manifest", "write_generation"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic.coord' has no attribute {name!r}")
    # Looked up each time, not cached here: the name stays its module's (a patch is seen).
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
