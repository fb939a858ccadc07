"""Elastic snapshots: asynchronous, consistent, resharding snapshots of training state.

Public API (see each module's docstring for its contract):

- ``StateRegistry`` (registry.py): one place for every stateful component, fixed keys.
- ``Snapshotter`` (snapshotter.py): capture at step boundaries, persist in the background,
  restore the newest committed snapshot resharded to this rank's layout.
- ``PreemptionWatcher`` (preemption.py): SIGTERM / Ray preemption notice -> forced snapshot.
- ``elastic.coordinator`` (the only Ray module): the run's coordinator actor and its client.
- ``FaultInjector`` (faults.py): fault injection keyed by (rank, step, phase) for tests.

The on-disk format is described in format.py and the project README.
"""

from elastic.faults import FaultInjector
from elastic.preemption import PreemptionWatcher
from elastic.registry import StateRegistry
from elastic.snapshotter import Snapshotter

__all__ = ["FaultInjector", "PreemptionWatcher", "Snapshotter", "StateRegistry"]
