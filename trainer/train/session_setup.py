"""What a `trainer.train.session.Session` starts from, and what it refuses.

Contract:
- `WorkerContext` is what the driver hands each worker (`ElasticTorchTrainer` installs it with
  `worker_context`; `current_context()` reads it): run directory and snapshot settings, the
  coordinator, the RAM tier, the platform's preemption notice, an `until` step, and whether
  the caller closes the session when the training function returns (`close_at_return`).
- `settings(...)`: the snapshot settings a Session uses (explicit arguments win over the
  context); no run directory at all is a `ValueError` naming what to pass.
- `run_directory(uri)`: a run directory as given, or the run of a snapshot's directory or
  `ray.train.Checkpoint` (`elastic.snapshot_ref`), which must be the run's newest committed
  snapshot (a run continues from its newest; starting from an older one is a fork).
- `refuse_misuse(model, world_size)`: one open Session per process (`note_open`,
  `open_session`), and a data-parallel model (DDP, FSDP2) above world size 1; each a
  one-line `UsageError` (a `FatalRunError`: no restart fixes a loop's code).
- `check_data(data, saved, world_size, strict)`: a loader with a per-rank position restored
  at another world size is warned about (`strict`: `FatalRunError`); a `WorldSizeFree` one
  (it is told its share: `ResumableLoader`, `MapStyleLoader`) restores anywhere.
- `rank_and_world_size()`: from `torch.distributed`, else (0, 1); `layout_of(model)`: "fsdp"
  when parameters are DTensors (FSDP2), else "ddp" (replicated, or one rank).
- `state_registry(...)`: everything a Session snapshots, under its fixed keys (`model`,
  `optim`, `sched`, `data`, `scaler`, the caller's extras, `PROGRESS_KEY`), with the
  trainer's rule that the step, optimizer, schedule and data tell one story and, for a
  world-size-free loader, the data origin it checks the cursor by (`trainer.train.story`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from elastic import collectives
from elastic.coord import CoordinatorClient
from elastic.errors import FatalRunError
from elastic.faults import FaultInjector
from elastic.preemption import PreemptionWatcher
from elastic.snapshot_ref import checkpoint_uri, split_snapshot_dir
from elastic.state import StateRegistry
from elastic.store import RamTier, SnapshotStore
from trainer.config import RecoveryConfig, SnapshotConfig
from trainer.train.parallel import parallelism_of
from trainer.train.story import register_story

log = logging.getLogger("baton.session")

# The session's own state in the snapshot (the key Baton's loop has always used).
PROGRESS_KEY = "trainer"

DEFAULT_SNAPSHOT_EVERY = 100


class UsageError(FatalRunError, ValueError):
    """A mistake in the training loop's code: the same on every restart (one line)."""


@dataclass(frozen=True)
class WorkerContext:
    """What the driver hands each worker (`ElasticTorchTrainer` installs it)."""

    snapshots: SnapshotConfig  # run directory and snapshot settings
    coordinator: CoordinatorClient | None = None  # the run's coordinator (Ray actor client)
    ram_tier: RamTier | None = None  # where shards' RAM copies go (stores on peer nodes)
    preemption_notice: Callable[[], Any] | None = None  # the platform's notice, or None
    until: int | None = None  # stop (committing) after this step
    # The caller closes the session when the training function returns (so the loop's end
    # does not commit: ElasticTorchTrainer's wrapper does).
    close_at_return: bool = False
    # In-process recovery (`elastic.recovery`): its settings, and this worker's member id and
    # order (Ray Train's world rank) in the run's membership; None: a lost worker restarts
    # the whole group.
    recovery: RecoveryConfig | None = None
    member: tuple[str, int] | None = None
    faults: FaultInjector | None = None  # tests: faults armed in the recovery's phases
    # Joiners wait for the members' next step boundary (a sharded run's in-process recovery,
    # which starts the training state again with them: `trainer.train.sharded_recovery`).
    joiners: Callable[[], bool] | None = None
    # Ray Data pipelines passed to the trainer: name -> its feeder actor's name
    # (`trainer.train.stream_data`).
    datasets: dict[str, str] = dataclasses.field(default_factory=dict)


class OpenSession(Protocol):
    """What this module needs of a process's open `trainer.train.session.Session`."""

    snapshotter: Any  # its `elastic.Snapshotter`

    @property
    def step(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def close(self, commit: bool = True) -> None: ...


_context: WorkerContext | None = None
_open: weakref.ref[OpenSession] | None = None  # the one open Session of this process


@contextlib.contextmanager
def worker_context(context: WorkerContext) -> Iterator[WorkerContext]:
    """Make `context` what every `Session` created inside the block starts from."""
    global _context
    previous, _context = _context, context
    try:
        yield context
    finally:
        _context = previous


def current_context() -> WorkerContext | None:
    return _context


def open_session() -> OpenSession | None:
    """The open (not closed) `Session` of this process, if any."""
    session = _open() if _open is not None else None
    return session if session is not None and not session.closed else None


def note_open(session: OpenSession) -> None:
    """`session` is now this process's open Session (`refuse_misuse` refuses another)."""
    global _open
    _open = weakref.ref(session)


def settings(snapshots: SnapshotConfig | None, context: WorkerContext | None,
              run_uri: str | None, snapshot_every: int | None) -> SnapshotConfig:
    base = snapshots or (context.snapshots if context else None)
    if base is None:
        base = SnapshotConfig(snapshot_every=DEFAULT_SNAPSHOT_EVERY)
    changes: dict[str, Any] = {}
    if run_uri is not None:
        changes["run_uri"] = run_uri
    if snapshot_every is not None:
        changes["snapshot_every"] = snapshot_every
    settings = dataclasses.replace(base, **changes)
    if not settings.run_uri:
        raise ValueError("Session: no run directory: pass run_uri=... (or run the loop under "
                         "trainer.ElasticTorchTrainer, which passes it)")
    return settings


def run_directory(uri: Any) -> str:
    """A run directory as given, or the run of a snapshot directory or `ray.train.Checkpoint`
    (`elastic.snapshot_ref`), which must be that run's newest committed snapshot: a run
    continues from its newest (starting anew from an older one is a fork)."""
    try:
        uri = checkpoint_uri(uri)
    except ValueError as err:
        raise UsageError(f"run_uri: {err}") from err
    named = split_snapshot_dir(uri)
    if named is None:
        return uri
    run, step = named
    newest = max(SnapshotStore(run).committed_steps(), default=None)
    if newest != step:
        raise UsageError(
            f"run_uri {uri} is snapshot {step} of {run}, whose newest committed snapshot is "
            f"{newest}: pass {run} to continue from the newest, or start a new run from "
            f"snapshot {step} with: baton fit RECIPE --from {run}@{step}")
    return run


def refuse_misuse(model: nn.Module, world_size: int) -> None:
    """One open Session per process; a data-parallel model above world size 1."""
    other = open_session()
    if other is not None:
        raise UsageError(
            f"Session: a Session of {other.snapshotter.store.run_uri} (step {other.step}) is "
            "still open in this process: close() it (or leave its with block) first; a "
            "process trains one run at a time")
    if world_size > 1 and parallelism_of(model) is None:
        raise UsageError(
            f"Session: the model is not wrapped for data parallelism at world size "
            f"{world_size}, so each rank would train its own replica: pass the model that "
            "ray.train.torch.prepare_model(model) returns (DDP), or shard it with fully_shard")


class Progress:
    """The session's own state: the number of completed steps."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def step_watcher(context: WorkerContext | None, coordinator: CoordinatorClient,
                 external_check_every: int, joiners: Callable[[], bool] | None
                 ) -> PreemptionWatcher:
    """What a Session asks at every step boundary: the platform's preemption notice (every
    `external_check_every` steps: it is a barrier on Ray), the coordinator's snapshot
    requests and stops, and in-process recovery's joiners."""
    return PreemptionWatcher(
        external=context.preemption_notice if context else None,
        external_check_every=external_check_every,
        requested=coordinator.snapshot_requested,
        stop_requested=coordinator.stop_requested,
        joiners=joiners,
    )


@runtime_checkable
class WorldSizeFree(Protocol):
    """A loader whose state holds no rank: it is told its share (`data_state.ResumableLoader`,
    `data_state.map_loader.MapStyleLoader`)."""

    def reshard(self, *, rank: int, world_size: int) -> None: ...


def check_data(data: Any, saved: int | None, world_size: int, strict: bool) -> None:
    """A loader with a per-rank position restored at another world size than it was saved
    at: warned about (`strict`: refused); world-size-free loaders restore anywhere."""
    if data is None or saved is None or saved == world_size:
        return
    if isinstance(data, WorldSizeFree):
        return  # world-size free: its cursor means the same samples at any world size
    message = (
        f"the data loader's position was saved at world size {saved} and restores at "
        f"{world_size}: {type(data).__name__} keeps a per-rank position, so samples "
        "may repeat or be skipped until its epoch ends. Use data_state.ResumableLoader or "
        "data_state.map_loader.MapStyleLoader for exactly-once data at any world size")
    if strict:
        raise FatalRunError(message)
    log.warning("%s", message)


def rank_and_world_size() -> tuple[int, int]:
    """Baton's group's (`elastic.collectives`: in-process recovery's membership, else
    torch.distributed's default group), else (0, 1)."""
    return collectives.rank(), collectives.world_size()


def layout_of(model: nn.Module) -> str:
    """FSDP2 shards parameters as DTensors; anything else is replicated (DDP or one rank)."""
    return "fsdp" if any(isinstance(p, DTensor) for p in model.parameters()) else "ddp"


def state_registry(model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any,
                   data: Any, scaler: torch.amp.GradScaler | None,
                   extras: Mapping[str, Any] | None, progress: Any, rank: int,
                   world_size: int) -> StateRegistry:
    """Everything a Session snapshots, under its fixed keys: the model, the optimizer, the
    schedule, the data position (a `WorldSizeFree` loader told its share first), fp16's loss
    scale, the caller's extras and the session's own progress."""
    registry = StateRegistry()
    registry.register("model", model)
    if optimizer is not None:
        registry.register("optim", optimizer, model=model)
    if scheduler is not None:
        registry.register("sched", scheduler)
    if data is not None:
        if isinstance(data, WorldSizeFree):
            data.reshard(rank=rank, world_size=world_size)
        registry.register("data", data)
    if scaler is not None and scaler.is_enabled():
        # fp16's loss scale; optional: a run switching into fp16 starts from a fresh one
        registry.register("scaler", scaler, optional=True)
    for key, extra in (extras or {}).items():
        registry.register(key, extra)
    registry.register(PROGRESS_KEY, progress)
    # The trainer's rule: step, optimizer, schedule and data cursor tell one story (checked
    # before a restore writes a live tensor), and the data origin it checks the cursor by.
    register_story(registry, {"optim": optimizer, "sched": scheduler, "data": data},
                   progress_key=PROGRESS_KEY, progress=progress)
    return registry
