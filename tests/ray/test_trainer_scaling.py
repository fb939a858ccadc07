"""`trainer.on_ray.scaling`: restart decisions after a node loss, on fake cluster states (no Ray).

A fake node table (what `ray.nodes()` returns), raylet probe, fresh reservation and clock
stand in for the cluster; the policy sees the group through Ray Train's own hooks. The last
tests pin the Ray Train internals the module relies on, so a Ray upgrade that moves them
fails here rather than silently restoring the slow restart.
"""

from __future__ import annotations

import inspect
import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest
from ray.train import ScalingConfig
from ray.train.v2._internal.execution.scaling_policy import (
    ElasticScalingPolicy,
    FixedScalingPolicy,
    NoopDecision,
    ResizeDecision,
)
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from trainer.on_ray.scaling import BatonTorchTrainer, LiveNodesElasticPolicy

CPU = {"CPU": 1.0}


class FakeCluster:
    def __init__(self, nodes: list[str]) -> None:
        self.alive = {n: True for n in nodes}  # what GCS says
        self.answers = {n: True for n in nodes}  # whether the raylet answers
        self.now = 0.0
        self.reservations = 0
        self.draining: set[str] = set()  # nodes with a drain request (a preemption notice)

    def table(self) -> list[dict[str, Any]]:
        return [{"NodeID": n, "Alive": a, "NodeManagerAddress": n, "NodeManagerPort": 1}
                for n, a in self.alive.items()]

    def probe(self, address: str, port: int, timeout_s: float) -> bool:
        return self.answers[address]

    def fresh(self) -> dict[str, dict[str, float]]:
        """The coordinator re-reads the node table: only nodes GCS lists alive."""
        self.reservations += 1
        return {n: dict(CPU) for n, a in self.alive.items() if a}

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def lose(self, node: str) -> None:
        self.answers[node] = False  # killed: GCS notices only a few heartbeats later


def _policy(cluster: FakeCluster, workers: tuple[int, int] = (1, 2),
            **kwargs: Any) -> LiveNodesElasticPolicy:
    policy = LiveNodesElasticPolicy(
        ScalingConfig(num_workers=workers, resources_per_worker=CPU),
        node_table=cluster.table, probe=cluster.probe, fresh_reservation=cluster.fresh,
        draining_nodes=lambda: cluster.draining,
        clock=lambda: cluster.now, sleep=cluster.sleep, **kwargs,
    )
    policy._coordinator_client = SimpleNamespace(maybe_send_resource_request=lambda *a: None)
    # Ray Train's cached view, as stale as the coordinator's 20 s tick leaves it.
    policy._latest_reserved_resources = {"a": dict(CPU), "b": dict(CPU)}
    policy._latest_reserved_resources_query_time = float("inf")
    return policy


def _group_state(nodes: list[str], start_time: float) -> SimpleNamespace:
    """Ray Train's state of a group running a worker on each of `nodes`."""
    return SimpleNamespace(
        workers=[SimpleNamespace(metadata=SimpleNamespace(node_id=n)) for n in nodes],
        start_time=start_time, num_workers=len(nodes),
    )


def _run_group(policy: LiveNodesElasticPolicy, nodes: list[str]) -> None:
    """One healthy poll of a group just started on `nodes` (too soon for a resize check)."""
    state = _group_state(nodes, time.monotonic())
    assert isinstance(policy.make_decision_for_running_worker_group(state, None), NoopDecision)


def test_first_start_uses_a_fresh_reservation() -> None:
    cluster = FakeCluster(["a", "b"])
    decision = _policy(cluster).make_decision_for_non_running_worker_group()
    assert decision == ResizeDecision(num_workers=2, resources_per_worker=CPU)
    assert cluster.reservations == 1


def test_node_loss_waits_for_gcs_then_restarts_at_the_size_that_fits() -> None:
    cluster = FakeCluster(["a", "b"])
    policy = _policy(cluster)
    _run_group(policy, ["a", "b"])
    cluster.lose("b")
    # GCS still lists b alive: no decision yet (Ray Train's stale view would say 2).
    for _ in range(3):
        assert isinstance(policy.make_decision_for_non_running_worker_group(), NoopDecision)
    assert cluster.reservations == 0
    cluster.alive["b"] = False  # GCS marks it dead
    decision = policy.make_decision_for_non_running_worker_group()
    assert decision == ResizeDecision(num_workers=1, resources_per_worker=CPU)
    assert cluster.now == pytest.approx(3 * LiveNodesElasticPolicy.CONFIRM_POLL_S)


def test_a_node_gcs_never_confirms_is_left_out_after_the_wait() -> None:
    cluster = FakeCluster(["a", "b"])
    policy = _policy(cluster, confirm_s=1.0)
    _run_group(policy, ["a", "b"])
    cluster.lose("b")
    decisions = [policy.make_decision_for_non_running_worker_group() for _ in range(10)]
    resize = [d for d in decisions if isinstance(d, ResizeDecision)]
    assert resize and resize[0].num_workers == 1, decisions
    assert cluster.now == pytest.approx(1.0)


def test_a_failure_on_healthy_nodes_is_not_delayed() -> None:
    cluster = FakeCluster(["a", "b"])
    policy = _policy(cluster)
    _run_group(policy, ["a", "b"])
    decision = policy.make_decision_for_non_running_worker_group()  # e.g. a user exception
    assert decision == ResizeDecision(num_workers=2, resources_per_worker=CPU)
    assert cluster.now == 0.0


def test_after_a_preemption_notice_the_restart_leaves_the_drained_node_out() -> None:
    """The group stopped on a spot notice for b: b still answers and GCS lists it alive (and
    in the reservation), but Ray places nothing new on a draining node, so the restart must
    be sized without it (else each try at 2 waits out the start timeout, forever)."""
    cluster = FakeCluster(["a", "b"])
    policy = _policy(cluster)
    _run_group(policy, ["a", "b"])
    cluster.draining = {"b"}
    decision = policy.make_decision_for_non_running_worker_group()
    assert decision == ResizeDecision(num_workers=1, resources_per_worker=CPU)
    assert cluster.now == 0.0  # nothing to confirm: b is alive and answers


def _check_running_group(policy: LiveNodesElasticPolicy, nodes: list[str]) -> Any:
    """Ray Train's resize check of a group running on `nodes`, due now."""
    policy._latest_monitor_time = float("-inf")
    return policy.make_decision_for_running_worker_group(
        _group_state(nodes, time.monotonic() - 3600.0), None)


def test_a_running_group_grows_on_a_fresh_view_at_its_resize_check() -> None:
    """A node that joins is seen at the next resize check, not when the coordinator's 20 s
    tick refreshes Ray Train's cached view (which here still says only a)."""
    cluster = FakeCluster(["a"])
    policy = _policy(cluster)
    policy._latest_reserved_resources = {"a": dict(CPU)}
    assert isinstance(_check_running_group(policy, ["a"]), NoopDecision)
    cluster.alive["b"], cluster.answers["b"] = True, True  # a node joins
    cluster.now += 1.0
    decision = _check_running_group(policy, ["a"])
    assert decision == ResizeDecision(num_workers=2, resources_per_worker=CPU)
    assert cluster.reservations == 2


def test_a_running_group_does_not_grow_onto_a_draining_node() -> None:
    cluster = FakeCluster(["a", "b"])
    policy = _policy(cluster)
    cluster.draining = {"b"}  # b is being preempted: Ray would place nothing there
    assert isinstance(_check_running_group(policy, ["a"]), NoopDecision)
    # A draining node the group runs on is the preemption path's: not a resize here.
    cluster.now += 1.0
    assert isinstance(_check_running_group(policy, ["a", "b"]), NoopDecision)


def test_below_min_workers_waits_and_rereads_at_most_once_a_second() -> None:
    cluster = FakeCluster(["a"])
    policy = _policy(cluster)
    _run_group(policy, ["a"])
    cluster.lose("a")
    cluster.alive["a"] = False
    for _ in range(5):  # no node left: min_workers=1 cannot be met
        assert isinstance(policy.make_decision_for_non_running_worker_group(), NoopDecision)
    assert cluster.reservations == 1
    cluster.alive["c"], cluster.answers["c"] = True, True  # a replacement node joins
    cluster.now += 1.0
    decision = policy.make_decision_for_non_running_worker_group()
    assert decision == ResizeDecision(num_workers=1, resources_per_worker=CPU)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_start_below_min_workers_says_that_it_waits_without_bound() -> None:
    cluster = FakeCluster(["a"])  # num_workers=(2, 2) on a cluster that holds one
    policy = _policy(cluster, workers=(2, 2))
    lines = _Lines()  # Ray Train's logger does not propagate to the root's
    logging.getLogger("ray.train.baton_scaling").addHandler(lines)
    try:
        assert isinstance(policy.make_decision_for_non_running_worker_group(), NoopDecision)
        cluster.now += 30.0
        assert isinstance(policy.make_decision_for_non_running_worker_group(), NoopDecision)
        cluster.now += 31.0
        assert isinstance(policy.make_decision_for_non_running_worker_group(), NoopDecision)
    finally:
        logging.getLogger("ray.train.baton_scaling").removeHandler(lines)
    waits = lines.lines
    assert len(waits) == 2, waits  # once a minute
    assert waits[0].startswith("Baton: waiting 0 s so far to start 2 worker(s) (min_workers), "
                               "the cluster has room for 1: a start waits without bound")
    assert waits[1].startswith("Baton: waiting 61 s so far") and "num_workers=(1, 2)" in waits[1]
    cluster.alive["b"], cluster.answers["b"] = True, True  # the second node joins
    cluster.now += 1.0
    decision = policy.make_decision_for_non_running_worker_group()
    assert decision == ResizeDecision(num_workers=2, resources_per_worker=CPU)


def test_trainer_swaps_in_the_policy_for_elastic_runs_only(monkeypatch: Any) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(DataParallelTrainer, "_initialize_and_run_controller",
                        lambda self, **kwargs: seen.append(kwargs["scaling_policy"]))
    trainer = BatonTorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=(1, 2)))
    elastic = ElasticScalingPolicy(ScalingConfig(num_workers=(1, 2)))
    fixed = FixedScalingPolicy(ScalingConfig(num_workers=2))
    trainer._initialize_and_run_controller(scaling_policy=elastic)
    trainer._initialize_and_run_controller(scaling_policy=fixed)
    assert type(seen[0]) is LiveNodesElasticPolicy
    assert seen[0].scaling_config is elastic.scaling_config
    assert seen[1] is fixed


def test_ray_train_internals_it_relies_on_are_there() -> None:
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        _AutoscalingCoordinatorActor,
    )
    from ray.train.v2.api import data_parallel_trainer

    # The controller gets its scaling policy through this hook, built by this factory.
    assert "create_scaling_policy(self.scaling_config)" in inspect.getsource(
        data_parallel_trainer.DataParallelTrainer.fit
    )
    assert "**controller_init_kwargs" in str(
        inspect.signature(DataParallelTrainer._initialize_and_run_controller)
    )
    # The elastic policy reads its view through `_get_reserved_resources` and caches it here.
    source = inspect.getsource(ElasticScalingPolicy)
    for name in ("self._get_reserved_resources()", "_latest_reserved_resources",
                 "GET_RESERVED_RESOURCES_INTERVAL_S"):
        assert name in source, name
    params = inspect.signature(_AutoscalingCoordinatorActor.get_reserved_resources).parameters
    assert "recompute" in params
    # The draining nodes, as Ray Train's preemption watcher reads them.
    from ray._private.state import GlobalState
    assert callable(GlobalState.get_draining_nodes)
