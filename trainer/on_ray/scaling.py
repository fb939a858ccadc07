"""How a failed worker group restarts: after a node loss straight at the size the live nodes can
hold (after an error no restart can fix, not at all: `failures.py`). Why Ray Train's own policy
would first wait out a start timeout: docs/design.md, "Restarts sized to the live nodes".

- `LiveNodesElasticPolicy(scaling_config)` is Ray Train's `ElasticScalingPolicy` with one
  change, in the decision for a group that is not running (a restart):
  1. it remembers the nodes the running group's workers were on and, when that group fails,
     asks each one's raylet whether it still answers (a TCP connect, `probe_s`);
  2. for a node that no longer answers but that GCS still lists alive, it waits (no decision
     yet, at most `confirm_s`) until GCS marks it dead, so the new placement group is never
     offered to a node that is gone;
  3. it sizes the new group from a fresh reservation (`get_reserved_resources(...,
     recompute=True)`), minus nodes that did not answer and nodes being drained; then Ray
     Train's counting and `min_workers` rule decide. A start waiting for room for
     `min_workers` waits without bound, saying so at WARNING every `WAIT_REPORT_S`.
  A failure on healthy nodes (every raylet answers) is not delayed. For a running group
  (scale-up) Ray Train decides, on a fresh reservation read once per resize check
  (`scaling.resize_interval_s`), less draining nodes the group does not run on (those it runs
  on are the preemption path's).
- `BatonTorchTrainer` is `TorchTrainer` with that policy (a fixed size keeps Ray Train's fixed
  policy), `failures.FatalAwareFailurePolicy` (an error no restart can fix fails the run once;
  a group that cannot start counts against `max_failures`) and `failures.StartReport` among
  the controller callbacks; with replica groups
  (`trainer.on_ray.replica_groups.replica_torch_config`) its controller is
  `replica_groups.ReplicaGroupController`. `fit()` raises `failures.RunFailedError` (a
  `TrainingFailedError`) in one line: the worker's message and the number of restarts.

It uses Ray Train V2 internals (`ElasticScalingPolicy`, `DefaultFailurePolicy`, the
`_initialize_and_run_controller` hook, the coordinator's `recompute` flag), hence the pinned
range (>=2.60,<2.61); `tests/ray/test_trainer_scaling.py` pins them and tests the decisions.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
from ray.train.v2._internal.constants import (
    DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
    get_env_vars_to_propagate,
)
from ray.train.v2._internal.execution.failure_handling import (
    DefaultFailurePolicy,
)
from ray.train.v2._internal.execution.scaling_policy import (
    ElasticScalingPolicy,
    NoopDecision,
    ResizeDecision,
    ScalingDecision,
)
from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
    AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
)
from ray.train.v2.api.config import ScalingConfig
from ray.train.v2.api.exceptions import TrainingFailedError
from ray.train.v2.torch.torch_trainer import TorchTrainer  # Train V2 (what ray.train.torch gives)

from trainer.on_ray.failures import (
    FatalAwareFailurePolicy,
    RunFailedError,
    StartReport,
    run_failed_error,
)
from trainer.on_ray.replica_groups import ReplicaGroupController

# Under "ray.train" so the lines land in Ray Train's controller log, next to its decisions.
logger = logging.getLogger("ray.train.baton_scaling")

NodeTable = Callable[[], list[dict[str, Any]]]  # like `ray.nodes()`
Probe = Callable[[str, int, float], bool]  # (address, port, timeout_s) -> answers
Reservation = dict[str, dict[str, float]]  # node id -> resources reserved to this run


def raylet_answers(address: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts TCP connections at the node's raylet port. A live raylet
    always does, however busy (the kernel answers); a killed one refuses, a vanished machine
    times out."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class LiveNodesElasticPolicy(ElasticScalingPolicy):
    # How often to re-read GCS while waiting for it to confirm a node death.
    CONFIRM_POLL_S = 0.2
    # How often a start waiting for min_workers says so (Ray Train's own line is INFO).
    WAIT_REPORT_S = 60.0

    def __init__(
        self,
        scaling_config: ScalingConfig,
        *,
        probe_s: float = 1.0,
        confirm_s: float = 60.0,
        node_table: NodeTable | None = None,
        probe: Probe = raylet_answers,
        fresh_reservation: Callable[[], Reservation | None] | None = None,
        draining_nodes: Callable[[], Iterable[str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(scaling_config)
        self.probe_s = probe_s
        self.confirm_s = confirm_s
        self._node_table = node_table or ray.nodes
        self._probe = probe
        self._fresh_reservation = fresh_reservation or self._recomputed_reservation
        self._draining_nodes = draining_nodes or _draining_in_gcs
        self._clock = clock
        self._sleep = sleep
        self._group_nodes: set[str] = set()  # nodes of the group that ran last
        self._lost: set[str] | None = None  # of those, nodes that no longer answer
        self._confirm_deadline = 0.0
        self._restarting = False  # inside a decision for a group that is not running
        self._last_fresh = float("-inf")  # when the last fresh reservation was read
        self._waiting_since: float | None = None  # a start below min_workers waits since
        self._wait_reported = float("-inf")

    # ------------------------------------------------------------------ Ray Train's hooks

    def make_decision_for_running_worker_group(
        self, worker_group_state: Any, worker_group_status: Any
    ) -> ScalingDecision:
        self._group_nodes = {w.metadata.node_id for w in worker_group_state.workers}
        self._lost = None
        return super().make_decision_for_running_worker_group(
            worker_group_state, worker_group_status
        )

    def make_decision_for_non_running_worker_group(self) -> ScalingDecision:
        if self._group_nodes and self._lost is None:
            # The group that ran has just failed: find out once whether it lost nodes.
            self._lost = self._unanswering(self._group_nodes)
            self._confirm_deadline = self._clock() + self.confirm_s
            self._last_fresh = float("-inf")  # Ray Train's cached view predates the failure
            if self._lost:
                logger.info("Baton: node(s) %s of the failed group no longer answer; "
                            "restarting without them", sorted(self._lost))
        lost = self._lost or set()
        unconfirmed = lost & self._alive_in_gcs() if lost else set()
        if unconfirmed and self._clock() < self._confirm_deadline:
            self._sleep(self.CONFIRM_POLL_S)
            return NoopDecision()
        self._restarting = True
        try:
            decision = super().make_decision_for_non_running_worker_group()
        finally:
            self._restarting = False
        if isinstance(decision, ResizeDecision):
            self._group_nodes, self._lost = set(), None
            self._waiting_since = None
        else:
            self._report_wait()
        return decision

    def _report_wait(self) -> None:
        """A start below `min_workers` waits without bound: say so (module docstring)."""
        reserved = self._latest_reserved_resources
        need = self.scaling_config.min_workers
        room = self._count_possible_workers(reserved) if reserved is not None else None
        if room is None or room >= need:
            return
        now = self._clock()
        if self._waiting_since is None:
            self._waiting_since = now
        if now - self._wait_reported < self.WAIT_REPORT_S:
            return
        self._wait_reported = now
        logger.warning(
            "Baton: waiting %.0f s so far to start %d worker(s) (min_workers), the cluster has "
            "room for %d: a start waits without bound for min_workers; add nodes, or lower "
            "the minimum (ScalingConfig(num_workers=(1, %d))) to train on what there is",
            now - self._waiting_since, need, room, self.scaling_config.max_workers)

    def _get_reserved_resources(self) -> Reservation | None:
        """A fresh view (at most once per Ray Train's query interval). For a restart, less the
        nodes that stopped answering (GCS may not know yet if `confirm_s` ran out) and the
        nodes being drained; for a running group (reached once per resize check), less the
        draining nodes it does not run on."""
        now = self._clock()
        if now - self._last_fresh < self.GET_RESERVED_RESOURCES_INTERVAL_S:
            return self._latest_reserved_resources
        self._last_fresh = now
        reserved = self._fresh_reservation()
        if reserved is not None:
            draining = set(self._draining_nodes())
            if self._restarting:
                left_out = (self._lost or set()) | draining
            else:
                left_out = draining - self._group_nodes
            reserved = {node: res for node, res in reserved.items() if node not in left_out}
        self._latest_reserved_resources = reserved
        return reserved

    # ------------------------------------------------------------------ the cluster

    def _recomputed_reservation(self) -> Reservation | None:
        try:
            return ray.get(
                self._autoscaling_coordinator.get_reserved_resources.remote(
                    self._requester_id, recompute=True
                ),
                timeout=AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
            )
        except Exception:  # noqa: BLE001 - as Ray Train's own query: no decision this round
            logger.warning("Baton: could not get a fresh reservation", exc_info=True)
            return None

    def _alive_in_gcs(self) -> set[str]:
        return {n["NodeID"] for n in self._node_table() if n.get("Alive")}

    def _unanswering(self, node_ids: Iterable[str]) -> set[str]:
        """Nodes among `node_ids` that GCS lists dead or whose raylet does not answer."""
        table = {n["NodeID"]: n for n in self._node_table()}
        alive = [table[i] for i in node_ids if i in table and table[i].get("Alive")]
        lost = {i for i in node_ids if i not in table or not table[i].get("Alive")}
        if alive:
            with ThreadPoolExecutor(max_workers=min(32, len(alive))) as pool:
                answers = pool.map(
                    lambda n: self._probe(n["NodeManagerAddress"], int(n["NodeManagerPort"]),
                                          self.probe_s),
                    alive,
                )
                lost |= {n["NodeID"] for n, ok in zip(alive, answers, strict=True) if not ok}
        return lost


def _draining_in_gcs() -> set[str]:
    """Nodes GCS lists as being drained (what Ray Train's own preemption watcher reads)."""
    try:
        return set(ray._private.state.state.get_draining_nodes() or {})
    except Exception:  # noqa: BLE001 - no answer: leave nothing out, as before
        logger.warning("Baton: could not read the draining nodes", exc_info=True)
        return set()


class BatonTorchTrainer(TorchTrainer):
    """`TorchTrainer` whose elastic restarts size the group from the nodes still alive, whose
    fatal worker errors fail the run once, and whose `fit()` raises a one-line
    `RunFailedError`."""

    def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
        policy = controller_init_kwargs.get("scaling_policy")
        if type(policy) is ElasticScalingPolicy:
            controller_init_kwargs["scaling_policy"] = LiveNodesElasticPolicy(policy.scaling_config)
        failures = controller_init_kwargs.get("failure_policy")
        if type(failures) is DefaultFailurePolicy:
            controller_init_kwargs["failure_policy"] = FatalAwareFailurePolicy(
                failures.failure_config
            )
        callbacks = controller_init_kwargs.get("callbacks") or []
        controller_init_kwargs["callbacks"] = [*callbacks, StartReport()]
        backend = self.train_run_context.backend_config
        if backend is not None and getattr(backend.backend_cls, "has_replica_groups", False):
            return self._run_controller(ReplicaGroupController, controller_init_kwargs)
        return super()._initialize_and_run_controller(**controller_init_kwargs)

    def _run_controller(self, controller_cls: type, kwargs: dict[str, Any]) -> Any:
        """Ray Train's `_initialize_and_run_controller` with a controller class of ours."""
        env_vars = get_env_vars_to_propagate()
        env_vars.setdefault(RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
                            DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)
        node_key = ray._raylet.RAY_NODE_ID_KEY  # type: ignore[attr-defined]
        actor_cls: Any = ray.remote(
            num_cpus=0,
            label_selector={node_key: ray.get_runtime_context().get_node_id()},
            runtime_env={"env_vars": env_vars},
        )(controller_cls)
        controller = actor_cls.remote(**kwargs)
        if threading.current_thread() is threading.main_thread():
            self._register_sigint_handler(controller)
        ray.get(controller.run.remote())
        return ray.get(controller.get_result.remote())

    def fit(self) -> Any:
        try:
            return super().fit()
        except RunFailedError:
            raise
        except TrainingFailedError as err:
            raise run_failed_error(err) from err
