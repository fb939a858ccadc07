"""Replica groups added to a running Ray Train worker group: it grows without a restart.

Contract: `InPlaceGrowth` is what `ReplicaGroupController` uses when Ray Train's scaling
policy decides a running group of replica groups (one worker each) can be bigger:
- `supported(worker_group_context)`: the worker group can grow this way — a soft placement
  strategy (PACK, SPREAD: a worker in a placement group of its own is not held to the
  others' nodes), no per-worker label selectors, no TPU slices. Otherwise Ray Train's own
  resize (snapshot on demand, restart at the new size) runs.
- `request(count, resources_per_worker)`: reserves `count` more workers, each in a
  placement group of one bundle; nothing waits.
- `add_placed(worker_group)`: each reservation placed since becomes a replica group appended
  to the worker group (the next world rank), with Ray Train's train context, backend
  set-up and train function, exactly as Ray starts a replacement; the survivors let it in at
  their next step boundary (Baton's membership: a joiner). A reservation still unplaced
  after `PLACEMENT_TIMEOUT_S` is given up (the next resize check may ask again).
- `owns(index)`, `placed(index)`, `replace(worker_group, index)`: an added replica group
  whose worker died is replaced at its own placement group, once that is placed again (Ray
  Train's `replace_replica_group` knows only the group's first placement group).
- `release()`: removes the placement groups, after the worker group was shut down.
It reaches into Ray Train V2's `WorkerGroup` (its worker list, replica groups and the
helpers its replacement uses), hence the pinned Ray range; `tests/ray/test_trainer_autoscale.py`
grows a run on Ray's fake autoscaler and `tests/train/test_replica_groups.py` checks the
decisions.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import ray
from ray.train.v2._internal.execution.worker_group import ReplicaGroup
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

logger = logging.getLogger("ray.train.baton_replicas")

PLACEMENT_TIMEOUT_S = 60.0
SOFT_STRATEGIES = ("PACK", "SPREAD")


class InPlaceGrowth:
    """See the module docstring."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._pending: list[tuple[PlacementGroup, float]] = []  # (reservation, asked at)
        self._added: dict[int, PlacementGroup] = {}  # replica group index -> its own

    @staticmethod
    def supported(worker_group_context: Any) -> bool:
        return (worker_group_context.placement_strategy in SOFT_STRATEGIES
                and not worker_group_context.label_selector
                and getattr(worker_group_context, "num_slices", 1) <= 1)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def request(self, count: int, resources_per_worker: dict[str, float]) -> None:
        for _ in range(count):
            self._pending.append((placement_group([dict(resources_per_worker)],
                                                  strategy="PACK"), self._clock()))

    def add_placed(self, worker_group: Any) -> None:
        """Append a replica group for each placed reservation."""
        waiting = []
        for reservation, asked_at in self._pending:
            if _is_placed(reservation):
                self._add(worker_group, reservation)
            elif self._clock() - asked_at > PLACEMENT_TIMEOUT_S:
                logger.info("Baton: a worker asked for to grow the group was not placed in "
                            "%.0f s; given up", PLACEMENT_TIMEOUT_S)
                remove_placement_group(reservation)
            else:
                waiting.append((reservation, asked_at))
        self._pending = waiting

    def owns(self, index: int) -> bool:
        return index in self._added

    def placed(self, index: int) -> bool:
        return _is_placed(self._added[index])

    def replace(self, worker_group: Any, index: int) -> None:
        """Start a new worker for added replica group `index` at its own placement group."""
        old = worker_group.get_replica_groups()[index]
        old.shutdown()
        workers = _start_workers(worker_group, self._added[index], index)
        state = worker_group._worker_group_state
        ray.get(state.sync_actor.reset.remote())  # as Ray's replacement: free a held barrier
        worker_group._worker_group_state = state.replace_workers(old.get_workers(), workers)
        _start_replica_group(worker_group, workers, index)

    def release(self) -> None:
        for reservation in [r for r, _ in self._pending] + list(self._added.values()):
            try:
                remove_placement_group(reservation)
            except Exception:  # noqa: BLE001 - already gone with its node or its creator
                logger.debug("Baton: removing a placement group failed", exc_info=True)
        self._pending, self._added = [], {}

    def _add(self, worker_group: Any, reservation: PlacementGroup) -> None:
        index = len(worker_group.get_replica_groups())
        try:
            workers = _start_workers(worker_group, reservation, index)
        except Exception:  # noqa: BLE001 - the group trains on at its size; a later check asks
            logger.warning("Baton: starting a worker to grow the group failed", exc_info=True)
            remove_placement_group(reservation)
            return
        state = worker_group._worker_group_state
        worker_group._worker_group_state = dataclasses.replace(
            state, workers=[*state.workers, *workers])
        worker_group._worker_rank_to_replica_group_rank[index] = index
        self._added[index] = reservation
        try:
            _start_replica_group(worker_group, workers, index)
        except Exception:  # noqa: BLE001 - the next poll sees the worker fail: replaced
            logger.warning("Baton: starting training on an added worker failed", exc_info=True)
        logger.info("Baton: the group grows to %d workers; the new one joins the others at "
                    "their next step boundary", index + 1)


def _is_placed(reservation: PlacementGroup) -> bool:
    """GCS placed every bundle (after its node was lost, once placed again). Read from the
    table, not `ready()`: that starts a task in the bundle, which would need time to answer."""
    return bool(ray.util.placement_group_table(reservation).get("state") == "CREATED")


def _start_workers(worker_group: Any, reservation: PlacementGroup, index: int) -> list[Any]:
    """One worker actor in `reservation`'s bundle, world rank `index`, its train context set
    (Ray Train's own steps for a replacement)."""
    workers = worker_group._create_workers(
        num_workers=1, placement_group=reservation,
        resources_per_worker=worker_group.get_resources_per_worker(),
        placement_group_bundle_indices=[0], starting_world_rank=index,
        world_size=max(index + 1, len(worker_group.get_replica_groups())),
        replica_group_size=1)
    try:
        worker_group._init_train_context(workers, worker_group._worker_group_state.sync_actor)
    except Exception:
        for worker in workers:
            ray.kill(worker.actor)
        raise
    return list(workers)


def _start_replica_group(worker_group: Any, workers: list[Any], index: int) -> None:
    """Replica group `index` (a new last one, or in place of a dead one) of `workers`, started
    as Ray Train starts a replacement."""
    replica = ReplicaGroup(workers, worker_group.get_resources_per_worker(),
                           worker_group._replica_group_callbacks)
    groups = worker_group._replica_groups
    if index == len(groups):
        groups.append(replica)
    else:
        groups[index] = replica
    replica.start_training(worker_group._worker_group_context)
