"""One Ray Train replica group per worker: a lost worker is replaced alone, the others train on.

Contract:
- `replica_torch_config(torch_config)`: Ray Train's `TorchConfig` (its backend, timeout and
  init method kept) whose backend starts each worker as a replica group of its own
  (`has_replica_groups`, the mechanism of Ray's `TorchftConfig`, without torchft's
  Lighthouse): each worker's torch.distributed default group is the worker alone, so a DDP
  wrapper made there never waits on another worker; the group that trains together is
  Baton's membership (`elastic.recovery`), which a worker joins in its `Session`.
- `ReplicaGroupController` is Ray Train's controller with five changes for those groups:
  * a whole worker group that starts first tells the run's coordinator how many workers
    start (`MembershipStart.reset`), so that they form one membership;
  * when some, not all, of the live replica groups fail because their workers died (their
    process or node: not an error a worker raised), only those are shut down; each is
    replaced as soon as its placement-group bundle is placed (Ray re-places the bundles of a
    lost node on a node with room: at once, or when one joins). Meanwhile the others train on
    at W-1. Ray's own path replaces only when the size it decides equals the current one and
    otherwise restarts every worker ("relax this after integrating replica groups with
    elastic training");
  * its polls leave out the replica groups that are down, so a run whose live workers all
    finished is done (a replacement still pending is given up);
  * a worker that died (its process or node) while others train on is not charged to
    `max_failures` (an error a worker raised is);
  * when the scaling policy finds room for more workers, the running group grows in place
    (`trainer.on_ray.grow_in_place`): each new worker is a replica group added to it, which
    joins the others at their next step boundary; nobody restarts, nothing is redone.
  When every live replica group fails, or in-process recovery fell back (`replace_alone`),
  the whole group restarts as before, sized by `trainer.on_ray.scaling`.
It subclasses Ray Train V2 internals (`TrainController`, `_TorchBackend`), hence the pinned
Ray range; `tests/ray/test_trainer_elastic.py` runs it on a local multi-node cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, cast

import ray
from ray.exceptions import RayActorError
from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend
from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2._internal.execution.controller.controller import (
    TrainController,
    TrainControllerLoopIterationResult,
)
from ray.train.v2._internal.execution.controller.state import RunningState
from ray.train.v2._internal.execution.failure_handling import FailureDecision
from ray.train.v2._internal.execution.scaling_policy import (
    NoopDecision,
    ResizeDecision,
    ScalingDecision,
)
from ray.train.v2._internal.execution.worker_group import ReplicaGroup
from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus

from elastic.coord import FALLBACK, NAMESPACE, coordinator_name
from trainer.on_ray.grow_in_place import InPlaceGrowth

logger = logging.getLogger("ray.train.baton_replicas")


class _ReplicaBackend(_TorchBackend):
    """Torch's backend, started once per replica group (each of one worker)."""

    has_replica_groups: bool = True

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        start = super().on_start
        if isinstance(worker_group, ReplicaGroup):
            start(worker_group, backend_config)
            return
        groups = worker_group.get_replica_groups()
        with ThreadPoolExecutor(max_workers=min(32, len(groups))) as pool:
            for done in [pool.submit(start, group, backend_config) for group in groups]:
                done.result()


class _ReplicaTorchConfig(TorchConfig):
    @property
    def backend_cls(self) -> type[_TorchBackend]:
        return _ReplicaBackend


def replica_torch_config(torch_config: TorchConfig | None) -> TorchConfig:
    given = torch_config or TorchConfig()
    return _ReplicaTorchConfig(backend=given.backend, init_method=given.init_method,
                               timeout_s=given.timeout_s)


class MembershipStart(ControllerCallback):
    """Tells the run's coordinator that a whole worker group starts (a controller callback,
    so that it travels to the controller with the others)."""

    def __init__(self, run_uri: str, lease_token: str | None = None) -> None:
        self.run_uri = run_uri
        self.lease_token = lease_token  # names the run's coordinator (one per lease)

    def reset(self, num_workers: int) -> None:
        coordinator = ray.get_actor(coordinator_name(self.run_uri, self.lease_token),
                                    namespace=NAMESPACE)
        ray.get(coordinator.membership_reset.remote(num_workers))

    def fell_back(self) -> bool:
        """In-process recovery gave up (every member is ending its worker)."""
        coordinator = ray.get_actor(coordinator_name(self.run_uri, self.lease_token),
                                    namespace=NAMESPACE)
        health = cast(dict[str, Any], ray.get(coordinator.health.remote(), timeout=10))
        return bool(health.get("membership", {}).get("phase") == FALLBACK)


class ReplicaGroupController(TrainController):
    """See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        callbacks = kwargs.get("callbacks") or []
        self._membership = next((c for c in callbacks if isinstance(c, MembershipStart)), None)
        self._down: set[int] = set()  # replica groups shut down, waiting for their bundle
        self._growth = InPlaceGrowth()
        super().__init__(*args, **kwargs)
        # Wrappers that delegate all else (Ray Train calls the policies by duck typing).
        self._scaling_policy = _ResizeInPlace(self._scaling_policy,  # type: ignore[assignment]
                                              self)
        self._failure_policy = _LostWorkersAreFree(self._failure_policy,  # type: ignore[assignment]
                                                   self)

    # ------------------------------------------------------------------ starting

    def _start_worker_group(self, num_workers: int, resources_per_worker: dict) -> None:
        self._down.clear()  # (the same set the scaling policy's wrapper reads)
        if self._membership is not None:
            self._membership.reset(num_workers)
        super()._start_worker_group(num_workers, resources_per_worker)

    def _execute_resize_decision(self, decision: ResizeDecision
                                 ) -> TrainControllerLoopIterationResult:
        group = self._worker_group
        failing, live, errors = self._latest_failures()
        if group is not None and replace_alone(failing, live, errors, self._fell_back):
            for index in sorted(failing):
                self._shut_down(index)
            logger.info("Baton: replica group(s) %s lost; the others train on, each is "
                        "replaced once a node takes its place", sorted(failing))
            self._replace_placed()
        else:
            failure = self._run_controller_hook("before_controller_execute_resize_decision",
                                                decision)
            if failure:
                return failure
            if group is not None:
                self._shutdown_worker_group()
            self._start_worker_group(num_workers=decision.num_workers,
                                     resources_per_worker=decision.resources_per_worker)
        return TrainControllerLoopIterationResult(run_attempt_id=self._get_run_attempt_id(),
                                                  previous_state=self._state,
                                                  next_state=RunningState())

    def _shutdown_worker_group(self) -> None:
        super()._shutdown_worker_group()
        self._growth.release()

    async def abort(self) -> None:
        self._growth.release()
        await super().abort()

    # ------------------------------------------------------------------ growing

    def grow_in_place(self, num_workers: int, current: int) -> bool:
        """Ask for workers up to `num_workers` (from `current`, those asked for before
        counted) as added replica groups; False where the group cannot grow so (Ray Train's
        restart at the new size then runs)."""
        group = self._worker_group
        if group is None or not InPlaceGrowth.supported(group.get_worker_group_context()):
            return False
        more = num_workers - current - self._growth.pending
        if more > 0:
            logger.info("Baton: room for %d more worker(s); they join the running group "
                        "(no restart)", more)
            self._growth.request(more, group.get_resources_per_worker())
        return True

    def _fell_back(self) -> bool:
        try:
            return self._membership is not None and self._membership.fell_back()
        except Exception:  # noqa: BLE001 - no coordinator to ask: nothing to fall back from
            logger.warning("Baton: could not read the membership's phase", exc_info=True)
            return False

    # ------------------------------------------------------------------ down groups

    def _shut_down(self, index: int) -> None:
        group = self._worker_group
        assert group is not None
        replica = _replica_groups(group)[index]
        replica.shutdown()
        for worker in replica.get_workers():
            if worker.distributed_context is not None:
                group._world_rank_to_ongoing_poll.pop(worker.distributed_context.world_rank,
                                                      None)
        self._down.add(index)

    @property
    def has_down_groups(self) -> bool:
        return bool(self._down)

    def some_groups_live_on(self) -> bool:
        """The last poll saw failures in some, not all, live replica groups."""
        failing, live, _ = self._latest_failures()
        return bool(failing) and failing != live

    def _latest_failures(self) -> tuple[set[int], set[int], list[Exception]]:
        """The last poll's failing and live replica groups (those down left out) and the
        failing workers' errors."""
        group = self._worker_group
        status = group.get_latest_poll_status() if group is not None else None
        if status is None:
            return set(), set(), []
        failing = status.failing_replica_group_indices - self._down
        live = status.all_replica_group_indices - self._down
        ranks = status.worker_rank_to_replica_group_rank or {}
        errors = [error for rank, error in status.errors.items() if ranks.get(rank) in failing]
        return failing, live, errors

    def _replace_placed(self) -> None:
        """Replace each down replica group whose placement-group bundle is placed again."""
        group = self._worker_group
        if not self._down or group is None:
            return
        placed = _placed_bundles(group.get_worker_group_state().placement_group_handle
                                 .placement_group)
        for index in sorted(self._down):
            bundles = {w.placement_group_bundle_index
                       for w in _replica_groups(group)[index].get_workers()}
            if not (self._growth.placed(index) if self._growth.owns(index)
                    else bundles <= placed):
                continue
            try:
                if self._growth.owns(index):
                    self._growth.replace(group, index)
                else:
                    group.replace_replica_group(index)
            except Exception:  # noqa: BLE001 - it stays down; the next poll tries again
                logger.warning("Baton: replacing replica group %d failed", index, exc_info=True)
                continue
            self._down.discard(index)
            logger.info("Baton: replica group %d replaced; it joins the others at their next "
                        "step boundary", index)

    async def _poll_workers(self) -> WorkerGroupPollStatus:
        self._replace_placed()
        if self._worker_group is not None and self._growth.pending:
            self._growth.add_placed(self._worker_group)
        status = await super()._poll_workers()
        if not self._down or status.worker_rank_to_replica_group_rank is None:
            return status
        ranks = status.worker_rank_to_replica_group_rank
        statuses = {rank: s for rank, s in status.worker_statuses.items()
                    if ranks.get(rank) not in self._down}
        if statuses and 0 not in statuses:  # Ray Train reads the return value at rank 0
            statuses[0] = statuses[min(statuses)]
        return replace(status, worker_statuses=statuses)


def replace_alone(failing: set[int], live: set[int], errors: Sequence[BaseException],
                  fell_back: Callable[[], bool]) -> bool:
    """Whether the failing replica groups are replaced alone while the others train on: some,
    not all, of the live ones fail, their workers died (`errors`: the failing workers'; an
    error a worker raised — a preemption notice, every worker's way out of a planned restart,
    or a bug — restarts the whole group, whichever workers a poll saw end first), and
    in-process recovery has not fallen back. After a fallback every member ends its worker,
    but not within one poll: replacing the first ones alone would let them join a membership
    that refuses them, again and again, and the run would end at `max_failures`; the whole
    group restarts instead, with a fresh membership."""
    return (bool(failing) and failing != live and all(_died(e) for e in errors)
            and not fell_back())


class _ResizeInPlace:
    """The scaling policy, except for a running group of replica groups: a decision to grow
    adds workers to it in place (`ReplicaGroupController.grow_in_place`: no snapshot, no
    restart, the new ones join at a step boundary), and while replica groups are down a
    decision to the size it has or less is not taken (they are replaced in place instead).
    Any other decision is Ray Train's resize (snapshot on demand, restart)."""

    def __init__(self, inner: Any, controller: ReplicaGroupController) -> None:
        self._inner = inner
        self._controller = controller

    def make_decision_for_running_worker_group(self, worker_group_state: Any,
                                               worker_group_status: Any) -> ScalingDecision:
        decision = self._inner.make_decision_for_running_worker_group(worker_group_state,
                                                                      worker_group_status)
        if not isinstance(decision, ResizeDecision):
            return decision
        current = len(worker_group_state.workers)
        if decision.num_workers > current and self._controller.grow_in_place(
                decision.num_workers, current):
            return NoopDecision()
        if self._controller.has_down_groups and decision.num_workers <= current:
            return NoopDecision()
        return decision

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _LostWorkersAreFree:
    """The failure policy, except that workers whose process or node died while the others
    train on (some, not all, live replica groups) are retried without being charged to
    `max_failures`: on spot capacity that is the normal course of a run, and the survivors
    lose nothing. An error a worker raised is charged as before."""

    def __init__(self, inner: Any, controller: ReplicaGroupController) -> None:
        self._inner = inner
        self._controller = controller

    def make_decision(self, training_failed_error: Any) -> FailureDecision:
        failures = getattr(training_failed_error, "worker_failures", None)
        if failures and all(_died(e) for e in failures.values()) \
                and self._controller.some_groups_live_on():
            logger.info("Baton: worker(s) %s lost; replacing them while the others train on "
                        "(not charged to max_failures)", sorted(failures))
            return FailureDecision.RETRY
        decision: FailureDecision = self._inner.make_decision(training_failed_error)
        return decision

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _died(error: BaseException) -> bool:
    """A worker's process or node is gone (as opposed to an error it raised)."""
    if isinstance(error, WorkerHealthCheckFailedError):
        error = error.health_check_failure
    return isinstance(error, RayActorError)


def _replica_groups(group: Any) -> list[ReplicaGroup]:
    groups = group.get_replica_groups()
    assert groups is not None, "a worker group of replica groups"
    return list(groups)


def _placed_bundles(placement_group: Any) -> set[int]:
    """Bundle indices of `placement_group` placed on a live node."""
    table = ray.util.placement_group_table(placement_group)
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    return {int(i) for i, node in (table.get("bundles_to_node_id") or {}).items()
            if node in alive}
