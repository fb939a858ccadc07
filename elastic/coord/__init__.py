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
  client in ``ray_actors`` (the only Ray module of ``elastic``: import it by path, so that
  importing this room loads no Ray).

Imports ``elastic.lease``, ``elastic.store``, ``elastic.format`` and below; never the rooms
that write or read tensors (the coordinator never touches tensor bytes).
"""

from __future__ import annotations

from elastic.coord.commit import CommitCore
from elastic.coord.generation import GENERATION_NAME, read_generation
from elastic.coord.local_coordinator import LocalCoordinator
from elastic.coord.protocol import CoordinatorClient
from elastic.coord.store_coordinator import StoreCoordinator

__all__ = ["GENERATION_NAME", "CommitCore", "CoordinatorClient", "LocalCoordinator",
           "StoreCoordinator", "read_generation"]
