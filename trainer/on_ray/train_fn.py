"""Ray Train's calls inside a Baton worker: `ray.train.report`, `get_checkpoint`,
`get_preemption_info`.

Contract: `install(run_uri, coordinator, replica_groups)` replaces, for this worker process,
the object Ray Train's user-facing functions call (`set_train_fn_utils`; Ray Train documents
it as the place to patch) with `BatonTrainFnUtils`, Ray Train's own
(`DistributedTrainFnUtils`) but for:
- `report(metrics, checkpoint=None, ...)`: the metrics of the member that is rank 0 of
  Baton's group (`elastic.collectives.rank()`) go to the run's coordinator
  (`record_metrics`), and `ElasticTorchTrainer.fit()` returns the last ones as
  `Result.metrics`. With replica groups (in-process recovery) Ray Train's report — a barrier
  across every worker — is not called: a lost worker would hold the others at it, and a
  replacement counts its reports from its own start. Without them, Ray Train's report runs
  too. A checkpoint passed along is not kept (Baton's snapshots are the run's checkpoints):
  one warning.
- `get_checkpoint()`: the run's newest committed snapshot as a `ray.train.Checkpoint`
  (`snapshot_checkpoint`; None before the first commit), so code that still reads it (Tune
  callbacks, a loop's own extras) sees the run it continues.
- `get_context()`: with replica groups, `get_world_rank()` and `get_world_size()` are those of
  Baton's training group once a `Session` joined it (they change as the group shrinks and
  grows; Ray Train's own stay those of its workers, the lost one included).
- `get_preemption_info()`: with replica groups, whether GCS is draining this worker's node
  (a spot notice), without a barrier: Ray Train's preemption watcher is off for replica
  groups, and Baton's watcher agrees across the group at the step boundary (every worker
  commits that step, then the group restarts without the node: nothing redone).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
import ray.train
from ray.train.v2._internal.execution.train_fn_utils import (
    DistributedTrainFnUtils,
    set_train_fn_utils,
)
from ray.train.v2.api.context import DistributedTrainContext

from elastic import collectives
from elastic.store import SnapshotStore

log = logging.getLogger("baton.session")


def snapshot_checkpoint(run_uri: str) -> ray.train.Checkpoint | None:
    """The newest committed snapshot of the run as a `ray.train.Checkpoint` (None: none)."""
    store = SnapshotStore(run_uri)
    steps = store.committed_steps()
    if not steps:
        return None
    where = store.step_path(steps[-1])
    if store.is_local:
        return ray.train.Checkpoint(os.path.abspath(where))
    import pyarrow.fs

    # The endpoint Baton's S3 access uses (elastic.storage.s3_files), for pyarrow's client too.
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    filesystem = pyarrow.fs.S3FileSystem(endpoint_override=endpoint) if endpoint \
        else pyarrow.fs.S3FileSystem()
    return ray.train.Checkpoint(where.removeprefix("s3://"), filesystem=filesystem)


class BatonTrainFnUtils(DistributedTrainFnUtils):
    """See the module docstring."""

    def __init__(self, run_uri: str, coordinator: Any, replica_groups: bool) -> None:
        self._run_uri = run_uri
        self._coordinator = coordinator
        self._replica_groups = replica_groups
        self._warned = False

    def report(self, metrics: dict[str, Any], checkpoint: Any = None, *args: Any,
               **kwargs: Any) -> None:
        if checkpoint is not None and not self._warned:
            self._warned = True
            log.warning("ray.train.report(checkpoint=...) is not kept: Baton's snapshots are "
                        "the run's checkpoints (ray.train.get_checkpoint() returns the newest)")
        if collectives.rank() == 0:
            self._coordinator.record_metrics(dict(metrics))
        if not self._replica_groups:
            super().report(metrics, None, *args, **kwargs)

    def get_checkpoint(self) -> ray.train.Checkpoint | None:
        return snapshot_checkpoint(self._run_uri)

    def get_context(self) -> DistributedTrainContext:
        return _GroupContext() if self._replica_groups else super().get_context()

    def get_preemption_info(self) -> Any:
        if self._replica_groups:
            # Ray Train's preemption watcher is off for replica groups: ask GCS whether this
            # worker's node is being drained (a spot notice), without a barrier (Baton's
            # watcher agrees across the group at the step boundary).
            node = ray.get_runtime_context().get_node_id()
            draining = _draining_nodes()
            return {"node": node, "deadline_ms": draining[node]} if node in draining else None
        return super().get_preemption_info()


class _GroupContext(DistributedTrainContext):
    """Ray Train's context, but rank and world size are the training group's once a Session
    joined it (in-process recovery changes them; Ray Train's stay those of its workers)."""

    def get_world_size(self) -> int:
        if collectives.installed() is not None:
            return collectives.world_size()
        return super().get_world_size()

    def get_world_rank(self) -> int:
        if collectives.installed() is not None:
            return collectives.rank()
        return super().get_world_rank()


def _draining_nodes() -> dict[str, Any]:
    try:
        return dict(ray._private.state.state.get_draining_nodes() or {})
    except Exception:  # noqa: BLE001 - no answer: no notice this time
        return {}


def install(run_uri: str, coordinator: Any, replica_groups: bool) -> None:
    set_train_fn_utils(BatonTrainFnUtils(run_uri, coordinator, replica_groups))
