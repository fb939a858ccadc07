"""`ElasticTorchTrainer`: Ray Train's `TorchTrainer`, plus what a `Session` needs, nothing else.

`ElasticTorchTrainer(train_func, run_uri=..., train_loop_config=..., scaling_config=...,
run_config=...).fit()` (docs/ray-train-loop.md) is `trainer.on_ray.scaling.BatonTorchTrainer`
(restarts sized to the live nodes, a `FatalRunError` fails the run once, `fit()` raises a
one-line `RunFailedError`) with, around `fit()`:
- the run lease (`elastic.lease.RunLease`): acquired (`force_takeover` takes it from a live
  driver) and released when not passed in, renewed either way; one taken over meanwhile
  raises `LeaseLostError` (its commits were refused);
- the run's coordinator actor (`get_or_create_coordinator`), alive until `fit()` returns:
  `trainer.coordinator` its handle, `trainer.health` its final `health()`;
- `datasets={"train": ds}` (Ray Data pipelines), not split by Ray Train: a feeder actor each
  on the head node (`data_state.create_feeder`), read in the loop with
  `session.data_loader("train", ...)` (`trainer.train.stream_data`); a pipeline Baton cannot
  resume mid-epoch is refused by `fit()` in one line;
- `trainer.on_ray.resize.SnapshotBeforeResize` in the callbacks (a resize redoes nothing);
- on every worker, around `train_func`: the code-version check (other Baton code is a
  `FatalRunError`; `BATON_SKIP_CODE_CHECK=1` turns it off) and the worker context of a
  `Session` (run directory, snapshot settings, coordinator, preemption notice, `until`). When
  the function returns, the open session is closed, committing its last step (code after the
  loop runs first; if it fails the group restarts from an earlier snapshot).
Ray Train's conventions: `fit()` returns a `Result` whose `checkpoint` is a `ray.train.Checkpoint`
of the newest committed snapshot's directory (None when nothing was committed), which `Session`,
`baton fit --from` and `baton snapshots` accept; `run_uri` may be such a checkpoint. A fixed
`ScalingConfig(num_workers=N)`, N > 1, becomes `(1, N)` with a warning (after a node loss a fixed
size waits for a group the cluster can no longer hold); `(N, N)` keeps it fixed: a start then
waits without bound for room, the controller log saying so every minute.
Stops: `until` ends the workers (committing) after that step; `request_stop()` or the `stop`
event asks the coordinator, the workers commit the step they are at: `trainer.stopped_at`
(else None). With a `stop` event the caller owns SIGINT (Ray Train's handler is not installed).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import ray
import ray.train
from ray.train.v2.api.config import RunConfig, ScalingConfig

from elastic.errors import FatalRunError
from elastic.lease import LeaseLostError, RunLease, held_lease
from elastic.version import code_version
from trainer.config import RecoveryConfig, SnapshotConfig
from trainer.on_ray.replica_groups import MembershipStart, replica_torch_config
from trainer.on_ray.resize import SnapshotBeforeResize
from trainer.on_ray.scaling import BatonTorchTrainer
from trainer.on_ray.train_fn import install as install_train_fn
from trainer.on_ray.train_fn import snapshot_checkpoint
from trainer.train import WorkerContext, open_session, run_directory, worker_context

# Set to 1 to let workers run other code than the driver: only for a checkout that is edited
# while a local cluster trains from it (a worker started after the edit would be refused).
SKIP_CODE_CHECK_ENV = "BATON_SKIP_CODE_CHECK"
REFORM_MARGIN_S = 5.0


def check_code_version(driver_version: str | None) -> None:
    """A worker whose Baton code differs from the driver's (a node set up from another
    commit) would fail the same way on every restart, or worse, train differently: fatal.
    `None`: the driver turned the check off (`SKIP_CODE_CHECK_ENV`)."""
    if driver_version is None:
        return
    mine = code_version()
    if mine != driver_version:
        node = ray.util.get_node_ip_address()
        raise FatalRunError(
            f"worker on node {node} runs Baton {mine}, the driver {driver_version}; install "
            "the same version on every node (cluster.yaml pins it)"
        )


def member_of_worker() -> tuple[str, int]:
    """This worker's member id in the run's membership (its node, process and a nonce: a
    replacement on the same node is another member) and its order (Ray Train's world rank)."""
    node = ray.get_runtime_context().get_node_id()[:8]
    return f"{node}-{os.getpid()}-{uuid.uuid4().hex[:6]}", ray.train.get_context().get_world_rank()


def ray_preemption_notice() -> Any:
    """Ray Train's preemption notice for this worker group, or None (a barrier: every rank
    asks on the same steps)."""
    return ray.train.get_preemption_info()


def elastic_scaling(scaling: ScalingConfig) -> ScalingConfig:
    """A fixed `num_workers=N` (N > 1) as `(1, N)`, with a warning that says so."""
    workers = scaling.num_workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers <= 1:
        return scaling
    warnings.warn(
        f"ElasticTorchTrainer: ScalingConfig(num_workers={workers}) is a fixed size, which "
        f"after a node loss waits for {workers} workers the cluster may no longer hold; "
        f"training elastically with num_workers=(1, {workers}) instead (pass "
        f"num_workers=({workers}, {workers}) to keep the size fixed: a start then waits "
        f"without bound for room for {workers} workers, and says so in the controller log)",
        UserWarning, stacklevel=3)
    return dataclasses.replace(scaling, num_workers=(1, workers))


class ElasticTorchTrainer(BatonTorchTrainer):
    """See the module docstring."""

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        run_uri: str | None = None,
        snapshots: SnapshotConfig | None = None,
        lease: RunLease | None = None,
        force_takeover: bool = False,
        until: int | None = None,
        stop: threading.Event | None = None,
        run_config: RunConfig | None = None,
        recovery: RecoveryConfig | None = None,
        **torch_trainer_kwargs: Any,
    ) -> None:
        settings = snapshots or SnapshotConfig()
        if run_uri is not None:
            settings = dataclasses.replace(settings, run_uri=run_directory(run_uri))
        if not settings.run_uri:
            raise ValueError("ElasticTorchTrainer: pass run_uri=... (where the run's "
                             "snapshots live: a local path or s3://bucket/prefix/NAME)")
        self.snapshots = settings
        self.lease = lease
        self.force_takeover = force_takeover
        self.until = until
        self._caller_owns_sigint = stop is not None
        self.stop = stop or threading.Event()
        self.recovery = recovery or RecoveryConfig()
        self._resize = SnapshotBeforeResize(settings.run_uri)
        self._membership = MembershipStart(settings.run_uri)
        run_config = run_config or RunConfig()
        # Controller callbacks: Ray Train runs any callback it is given, though RunConfig's
        # annotation names only the user-facing kinds.
        controller_callbacks: list[Any] = [self._resize]
        if self.recovery.in_process:
            controller_callbacks.append(self._membership)
            torch_trainer_kwargs["torch_config"] = replica_torch_config(
                torch_trainer_kwargs.get("torch_config"))
        run_config = dataclasses.replace(
            run_config, callbacks=[*(run_config.callbacks or []), *controller_callbacks])
        self.coordinator: Any = None  # the coordinator's handle while fit() runs
        self.health: dict[str, Any] = {}  # the coordinator's health() when fit() returned
        self.metrics: dict[str, Any] | None = None  # what the loop reported last
        self.stopped_at: int | None = None
        self._lease_token: str | None = None
        # Not Ray Train's `datasets` (it would split them): Baton's feeders read them.
        self._data_pipelines = dict(torch_trainer_kwargs.pop("datasets", None) or {})
        self._feeders: dict[str, str] = {}  # dataset name -> its feeder actor's name
        scaling = torch_trainer_kwargs.get("scaling_config")
        if scaling is not None:
            torch_trainer_kwargs["scaling_config"] = elastic_scaling(scaling)
        super().__init__(train_loop_per_worker, run_config=run_config, **torch_trainer_kwargs)

    def request_stop(self) -> None:
        """Ask the workers to commit the step they are at and end (thread-safe)."""
        self.stop.set()

    # ------------------------------------------------------------------ driver

    def fit(self) -> Any:
        # A lease passed in stays its owner's (taken, renewed and released there); one taken
        # here is released here. An error after a takeover is raised as LeaseLostError.
        with held_lease(self.snapshots.run_uri, lease=self.lease,
                        force=self.force_takeover) as lease:
            result = self._fit_leased(lease)
            result.checkpoint = snapshot_checkpoint(self.snapshots.run_uri)
            if self.metrics is not None:
                result.metrics = self.metrics
        if lease.lost:
            raise LeaseLostError(lease.lost)
        return result

    def _fit_leased(self, lease: RunLease) -> Any:
        from elastic.coord import get_or_create_coordinator, release_ram_stores

        if not ray.is_initialized():
            ray.init()
        snaps = self.snapshots
        # Keep this handle until the fit ends: a (non-detached) actor lives as long as its
        # creator holds a reference, and the workers must all talk to this one instance.
        self.coordinator = get_or_create_coordinator(
            snaps.run_uri, keep_last=snaps.keep_last, membership=self._membership_settings(),
            lease_token=lease.token,  # fencing: no manifest once another driver took the run
            pending_timeout_s=snaps.pending_timeout_s, storage_timeout_s=snaps.storage_timeout_s,
            storage_retry_s=snaps.storage_retry_s,
        )
        self._lease_token = self._resize.lease_token = lease.token
        self._membership.lease_token = lease.token
        feeders = self._start_feeders(lease.token)
        done = threading.Event()
        forward = threading.Thread(target=self._forward_stop, args=(self.coordinator, done),
                                   name="baton-stop-forward", daemon=True)
        forward.start()
        try:
            result = super().fit()
            self.health = dict(ray.get(self.coordinator.health.remote()))
            self.metrics = ray.get(self.coordinator.last_metrics.remote())
        finally:
            done.set()
            forward.join(timeout=10)
            self.coordinator = None
            for feeder in feeders:
                ray.kill(feeder)
            release_ram_stores(snaps.run_uri, lease_token=lease.token)
        self.stopped_at = self.health.get("stopped_at")
        return result

    def _membership_settings(self) -> Any:
        """A re-forming group waits for a survivor still beating until its collective with
        the lost worker times out (gloo's ends only by its timeout), and a little more."""
        from elastic.coord import MembershipSettings

        return MembershipSettings(
            reform_wait_s=self.recovery.collective_timeout_s + REFORM_MARGIN_S)

    def _start_feeders(self, lease_token: str | None) -> list[Any]:
        """One feeder actor per dataset, on the head node (it outlives worker nodes)."""
        from data_state import create_feeder
        from elastic.coord import HEAD_NODE_RESOURCES, NAMESPACE, coordinator_name

        handles = []
        run = coordinator_name(self.snapshots.run_uri, lease_token).replace("coordinator",
                                                                             "data", 1)
        for key, ds in self._data_pipelines.items():
            name = f"{run}-{key}"
            try:
                handles.append(create_feeder(ds, name, options={
                    "namespace": NAMESPACE, "resources": dict(HEAD_NODE_RESOURCES)}))
            except ValueError as err:
                for handle in handles:
                    ray.kill(handle)
                raise ValueError(f"ElasticTorchTrainer datasets[{key!r}]: {err}") from None
            self._feeders[key] = name
        return handles

    def _forward_stop(self, coordinator: Any, done: threading.Event) -> None:
        """Hand a stop (the event set by `request_stop`, Ctrl-C or a time limit) to the
        coordinator, which the workers ask at every step boundary."""
        while not done.is_set():
            if self.stop.wait(0.2):
                ray.get(coordinator.request_stop.remote())
                return

    def _register_sigint_handler(self, controller: Any) -> None:
        if not self._caller_owns_sigint:
            super()._register_sigint_handler(controller)

    # ------------------------------------------------------------------ workers

    def _get_train_func(self) -> Callable[[], Any]:
        inner = super()._get_train_func()
        recovery = self.recovery if self.recovery.in_process else None
        context = WorkerContext(snapshots=self.snapshots, until=self.until, close_at_return=True,
                                recovery=recovery)
        driver_version = None if os.environ.get(SKIP_CODE_CHECK_ENV) == "1" else code_version()
        lease_token = self._lease_token
        datasets = dict(self._feeders)

        def train_func_in_session_context() -> Any:
            from elastic.coord import (
                RayCoordinatorClient,
                get_or_create_coordinator,
                ray_ram_tier,
            )

            check_code_version(driver_version)
            snaps = context.snapshots
            coordinator = RayCoordinatorClient(
                get_or_create_coordinator(snaps.run_uri, lease_token=lease_token))
            # Each shard's RAM copy goes to the stores of the next nodes on the ring.
            ram_tier = ray_ram_tier(snaps.run_uri, cap_bytes=int(snaps.ram_copy_mib * 2**20),
                                    replicas=snaps.ram_replicas, lease_token=lease_token) \
                if snaps.ram_copy_mib and snaps.ram_replicas else None
            install_train_fn(snaps.run_uri, coordinator, replica_groups=recovery is not None)
            with worker_context(dataclasses.replace(
                    context, coordinator=coordinator, ram_tier=ram_tier,
                    preemption_notice=ray_preemption_notice, datasets=datasets,
                    member=member_of_worker() if recovery is not None else None)):
                result = inner()
                session = open_session()
                if session is not None:
                    session.close()  # the last step, committed once the function returned
                return result

        return train_func_in_session_context
