"""`fit(config)`: run the worker loop on a Ray Train V2 `TorchTrainer`, elastically.

Contract:
- Validates everything that can be checked before Ray starts (config, run directory
  reachable and holding the same model if it already has snapshots), prepares the embedded
  corpus when `data.uri` is empty, connects to Ray (`RAY_ADDRESS`, else a local one), starts
  the run's progress monitor, and runs the worker loop (`trainer.train.loop`) on
  `trainer.on_ray.elastic_trainer.ElasticTorchTrainer` — the same drop-in for `TorchTrainer` any Ray
  Train loop can use (lease, coordinator, restart and failure policies, snapshot before a
  planned resize) — with `ScalingConfig(num_workers=(min, max))`. Ray Train places the
  workers, restarts the group after a failure and resizes it when nodes come or go; every
  (re)started worker resumes from the newest committed snapshot. Baton adds no scheduling
  of its own.
- `until` / `stop`: the workers commit the step they stop at and end normally.
- Returns a `FitResult` with the run summary (steps, losses, restarts, steps redone) and
  `stopped_at`.
- Shows what happens to snapshots: every progress record carries the newest committed step,
  and a `warning` when none has committed for 3 snapshot intervals, with the workers' reason
  (`trainer.run.commit_watch`). A run that trains to its last step but cannot commit it raises
  `FinalCommitError` (the CLI exits 1 and says why); the committed snapshots stay usable.
- Right after connecting, before the trainer starts, refuses (`ConfigError`) a worker that no
  alive node can hold (`trainer.run.preflight.check_worker_fits`: `scaling.cpus_per_worker`, a GPU),
  unless the cluster has an autoscaler that can add nodes (`_cluster_can_grow`).
- Raises `trainer.on_ray.failures.RunFailedError` (one line: the worker's message and the restarts)
  when the run gives up: at once on an error no restart can fix (`FatalRunError`: a bad
  dataset, a recipe the run cannot continue with, a worker whose `code_version()` differs from
  the driver's), or after `scaling.max_failures` restarts.
The modules of `trainer.on_ray` (this one, `elastic_trainer`, `scaling`, `resize`) are the
ones of `trainer` that talk to Ray Train.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
import ray.train
from ray.train.torch import TorchConfig
from ray.train.v2.api.config import FailureConfig, RunConfig, ScalingConfig

from elastic.coord import HEAD_NODE_RESOURCES, NAMESPACE
from elastic.lease import RunLease, held_lease
from trainer.config import FitConfig
from trainer.on_ray.elastic_trainer import ElasticTorchTrainer
from trainer.on_ray.monitor import RunMonitor, get_monitor, monitor_name
from trainer.run import (
    CommitWatch,
    FinalCommitError,
    RunSummary,
    check_run_dir,
    check_worker_fits,
    ensure_dataset,
    final_commit_error,
    read_records,
    summarize,
)
from trainer.train import WorkerEnv, run_worker

log = logging.getLogger("baton.fit")


@dataclasses.dataclass
class FitResult:
    run_uri: str
    summary: RunSummary
    resumed_from: int  # committed step the fit started from (0 = fresh run)
    stopped_at: int | None = None  # the step a stop (`until`, `stop`) ended at; None: finished
    # In-process recovery's membership (`elastic.coord.membership`): each formation (who
    # trained together, why it formed) and each fallback to a group restart.
    membership: dict[str, Any] = dataclasses.field(default_factory=dict)


def _train_fn(loop_config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker; a restart runs it again from the newest snapshot.
    (The coordinator, lease and stop settings come from the worker context that
    `ElasticTorchTrainer` installs around it.)"""
    import torch

    cfg: FitConfig = loop_config["cfg"]
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device() if cfg.scaling.use_gpu else torch.device("cpu")
    monitor = get_monitor(cfg)
    # Every worker gets the callbacks: the loop calls them on whichever is rank 0 of the group
    # (under in-process recovery rank 0 may be lost and another take its place).
    env = WorkerEnv(
        rank=rank,
        world_size=world_size,
        device=device,
        on_metrics=lambda record: monitor.add.remote(record),
        on_recovery=lambda record: monitor.recovered.remote(record),
        report=ray.train.report,
        pace_s=loop_config["pace_s"],
        record_samples=loop_config["record_samples"],
        on_start=lambda step, size: ray.get(
            monitor.start_attempt.remote(step, size, time.time())),
    )
    run_worker(cfg, env)


def _cluster_can_grow() -> bool:
    """Whether an autoscaler may add nodes to the connected cluster (then a worker that fits
    no node today may fit one tomorrow, and is not refused). Ray 2.60 keeps two signals:
    - the cluster config an autoscaler reports to GCS (autoscaler v2, KubeRay): a node group
      that may grow (`max_count` -1 or above `min_count`) - the test Ray Data uses;
    - the status the v1 autoscaler monitor writes on every update (internal KV
      `DEBUG_AUTOSCALING_STATUS`): without an autoscaling config (`ray start`, `ray.init`)
      its read-only provider names each node's type `node_<node id>`, while a config's node
      types have their own names (cluster.yaml's `head`, `gpu_spot_worker`) and launchable
      types are listed under `node_availabilities`.
    When neither can be read (no monitor yet, an older Ray), it answers True: doubt never
    refuses a run."""
    try:
        from ray._private import ray_constants
        from ray._private.state import state
        from ray.experimental.internal_kv import _internal_kv_get

        config = state.get_cluster_config()
        if config is not None and config.node_group_configs:
            return any(g.max_count == -1 or g.max_count > g.min_count
                       for g in config.node_group_configs if g.max_count != 0)
        raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        if not raw:
            return True
        report = json.loads(raw).get("autoscaler_report") or {}
        mapping = report.get("node_type_mapping") or {}
        availability = (report.get("node_availability_summary") or {}).get(
            "node_availabilities") or {}
        if not mapping:
            return True
        named = any(kind != f"node_{node_id}" for node_id, kind in mapping.items())
        return named or bool(availability)
    except Exception:  # noqa: BLE001 - private Ray APIs: if they change, do not refuse
        return True


_started_here = False  # whether this process started the local Ray it is connected to


def connect_ray() -> bool:
    """Connect to Ray (``RAY_ADDRESS``, else a local Ray of this process's own); return
    whether the Ray is this process's own. Idempotent.

    Call it from a thread that outlives every use of Ray, the main thread: Ray starts its
    local processes (GCS, raylet) with ``PR_SET_PDEATHSIG``, which kills them when the
    *thread* that started them ends, not the process. (`baton fit` trains in a thread of its
    own: had that thread started Ray, a fit that failed would leave the main thread talking
    to a dead GCS, waiting 60 s and exiting without the worker's message.)"""
    global _started_here
    if ray.is_initialized():
        return _started_here
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        from trainer.on_ray.local_cluster import use_loopback

        use_loopback()  # a Ray of our own on this machine: keep it on 127.0.0.1
    # "local": without it Ray joins any cluster a `ray start` left on this machine.
    ray.init(address=address or "local", namespace=NAMESPACE, log_to_driver=False)
    _started_here = not address
    return _started_here


def fit(
    config: FitConfig,
    *,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    storage_path: str | None = None,
    pace_s: float = 0.0,
    record_samples: bool = False,
    force_takeover: bool = False,
    lease: RunLease | None = None,
    until: int | None = None,
    stop: threading.Event | None = None,
    resumed_from: int | None = None,
) -> FitResult:
    """Train `config` to `config.steps`, continuing the run if it has committed snapshots.

    `on_progress` is called about once a second with rank 0's newest step record, plus
    `last_commit` (the newest committed snapshot step).
    `storage_path` is where Ray Train keeps its own run state (default: Ray's).
    `pace_s` slows every step down by that many seconds: fault-injection tests and the demo
    use it so that node losses and additions land mid-run on a fast machine.
    `record_samples` adds each step's global sample indices to the metrics (a data audit:
    tests check that every sample of an epoch was trained exactly once over committed steps).
    `lease`: the run lease this driver holds (`elastic.lease.run_lease`); when None, fit acquires
    one (`force_takeover` takes it even from a live driver) and releases it at the end, so the
    Python API is one-driver-per-run too. A lease passed in is renewed during the fit and left to
    its owner to release. Raises `LeaseHeldError` when another driver holds the run,
    `LeaseLostError` when the lease was taken over during the fit (its commits were refused).
    `until`: stop after that step; `stop`: once set (Ctrl-C, a time limit), stop at the next step
    boundary. Either way the workers commit a snapshot of the step they stopped at and end normally;
    `FitResult.stopped_at` is that step (None when the run reached `config.steps`). With `stop`, the
    caller owns SIGINT (Ray Train's abort handler is not installed).
    `resumed_from`: the committed step the run continues from, given by a caller that already
    ran `check_run_dir` on this run and held the lease since (`baton fit`); None: fit runs it.
    """
    if resumed_from is None:
        # Once per fit: `baton fit` checks before it takes the lease and passes the step on;
        # under the lease only that driver changed the directory since (its fork, its session
        # log), and every worker's rank 0 applies the continuation rule again.
        resumed_from = check_run_dir(config)
    # A lease passed in is renewed by its owner (preparing the corpus may outlast the ttl)
    # and released there; one taken here is renewed and released here.
    with held_lease(config.snapshots.run_uri, lease=lease, force=force_takeover) as lease:
        return _fit_leased(config, lease, resumed_from, on_progress=on_progress,
                           storage_path=storage_path, pace_s=pace_s,
                           record_samples=record_samples, until=until, stop=stop)


def _fit_leased(
    config: FitConfig,
    lease: RunLease,
    resumed_from: int,
    *,
    on_progress: Callable[[dict[str, Any]], None] | None,
    storage_path: str | None,
    pace_s: float,
    record_samples: bool,
    until: int | None,
    stop: threading.Event | None,
) -> FitResult:
    config = ensure_dataset(config)
    embedded = connect_ray()
    # Before the trainer starts: a worker no node can hold would wait forever.
    if embedded or not _cluster_can_grow():
        check_worker_fits(config, [n["Resources"] for n in ray.nodes() if n.get("Alive")],
                          "this machine" if embedded else "the Ray cluster")

    monitor = RunMonitor.options(
        name=monitor_name(config),
        namespace=NAMESPACE,
        get_if_exists=True,
        resources=HEAD_NODE_RESOURCES,  # on the head: it must outlive any worker node
    ).remote(config.snapshots.run_uri, logging=config.logging)

    scaling = config.scaling
    # Always a range: a plain int would be taken for a user's fixed size and made (1, N).
    num_workers = (scaling.min_workers, scaling.max_workers)
    trainer = ElasticTorchTrainer(
        _train_fn,
        snapshots=config.snapshots,
        lease=lease,
        until=until,
        stop=stop,
        train_loop_config={"cfg": config, "pace_s": pace_s, "record_samples": record_samples},
        torch_config=TorchConfig(backend="nccl" if scaling.use_gpu else "gloo"),
        # DDP survivors keep their state; FSDP2 ones restart it in-process from the newest
        # commit (trainer.train.sharded_recovery).
        recovery=config.recovery,
        scaling_config=ScalingConfig(
            num_workers=num_workers,
            use_gpu=scaling.use_gpu,
            resources_per_worker={"CPU": scaling.cpus_per_worker},
            elastic_resize_monitor_interval_s=scaling.resize_interval_s,
        ),
        run_config=RunConfig(
            name=f"{config.run_name}-{int(time.time())}",
            storage_path=storage_path,
            failure_config=FailureConfig(max_failures=scaling.max_failures),
        ),
    )
    polling = threading.Event()
    watch = CommitWatch(config.snapshots.snapshot_every, start_step=resumed_from)
    poller = threading.Thread(
        target=_poll_progress, args=(monitor, trainer, watch, on_progress, polling),
        daemon=True,
    )
    poller.start()
    try:
        trainer.fit()
    finally:
        polling.set()
        try:
            ray.get(monitor.flush.remote())
        finally:
            # No progress line after the fit has ended (its summary prints next): the
            # poller's calls are bounded by their 5 s timeouts.
            poller.join(timeout=15)
            # One monitor per fit: a later fit of the same run in this driver starts from a
            # fresh one (the records are on disk), not from this fit's last record.
            ray.kill(monitor)
    stopped_at = trainer.stopped_at if (trainer.stopped_at or 0) < config.steps else None
    failed = final_commit_error(trainer.health, stopped_at or config.steps)
    if failed is not None:
        raise FinalCommitError(failed)
    summary = summarize(read_records(config.snapshots.run_uri))
    membership = dict(trainer.health.get("membership") or {})
    summary.recovery_fallbacks = list(membership.get("fallbacks") or [])
    return FitResult(run_uri=config.snapshots.run_uri, summary=summary,
                     resumed_from=resumed_from, stopped_at=stopped_at,
                     membership=membership)


def _poll_progress(monitor: Any, trainer: ElasticTorchTrainer, watch: CommitWatch,
                   on_progress: Callable[[dict[str, Any]], None] | None,
                   done: threading.Event) -> None:
    """About once a second: hand rank 0's newest step record (with the newest commit) to
    `on_progress`, and warn when snapshots stopped committing (`trainer.run.commit_watch`):
    as the record's `warning` when there is a progress display, else in the log."""
    last_step = None
    while not done.wait(1.0):
        coordinator = trainer.coordinator
        if coordinator is None:  # not created yet (or the fit is over)
            continue
        try:
            record = ray.get(monitor.latest.remote(), timeout=5)
            health = ray.get(coordinator.health.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - progress display must never break a fit
            continue
        if not record:
            continue
        # Every poll, not only on a new step: a stalled run's warning gains its cause when
        # the failing write reports it (`CommitWatch.check` says each thing once).
        warning = watch.check(int(record["step"]), health)
        if done.is_set() or (record.get("step") == last_step and warning is None):
            continue
        last_step = record.get("step")
        if on_progress is not None:
            on_progress({**record, "last_commit": health.get("latest"), "warning": warning})
        elif warning is not None:
            log.warning("%s", warning)
