"""The per-worker training loop, split the torchtitan way: build, train one step, record.

Contract: `run_worker(cfg, env)` trains from the newest committed snapshot of
`cfg.snapshots.run_uri` (or from scratch) up to `cfg.steps` (or `env.stop_after`, or a stop the
driver asks for), on `env.world_size` ranks that already share a process group (or a single
process), and returns a `WorkerResult`. `build` makes the model, optimizer, schedule and data;
`train_step` trains one step; `record` makes and hands out its metrics; `run_worker` is only
control flow on a `trainer.train.session.Session` — the same public API any Ray Train loop uses —
which restores, snapshots, answers preemption and planned resizes, and commits the end.
Under Ray (`trainer.on_ray.ray_fit`) the session finds the coordinator in the worker context that
`trainer.on_ray.elastic_trainer.ElasticTorchTrainer` installs; `env.coordinator` overrides it
(tests without Ray).

Why the trajectory does not depend on the world size (promise P1):
- every rank builds the same initial model from `cfg.seed`;
- a step is `data.global_batch / data.microbatch_size` fixed microbatches (the loader decides
  which samples, from `(seed, epoch)` only); ranks just share them out;
- each microbatch's sketch is seeded by `(seed, step, microbatch index, layer name)`;
- each microbatch's mean loss is weighted by `world_size / num_microbatches`, so the
  gradient averaging of DDP / FSDP2 yields the mean over all microbatches of the step.
Only float summation order changes with the world size.

A snapshot holds model, optimizer, LR schedule, data cursor, the step and, in fp16, the loss
scale (promise P2; `[precision]`: `trainer.train.precision`, state always fp32); it is
captured right after the optimizer update of a step, so the data cursor and the schedule
have been advanced for exactly the committed steps (promise P5).
"""

from __future__ import annotations

import functools
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from data_state import (
    CursorRangeError,
    DataCursor,
    DatasetError,
    Microbatch,
    ResumableLoader,
    TokenDataset,
)
from elastic.coord import CoordinatorClient
from elastic.errors import FatalRunError
from sketch_ops import sketch_seed
from trainer.config import ConfigError, FitConfig
from trainer.train.continuation import RunDirError, check_continuation, model_config_record
from trainer.train.late_records import LateRecords
from trainer.train.model_build import build_model, loss_function
from trainer.train.nonfinite import nonfinite_loss
from trainer.train.optim import LrSchedule, build_optimizer
from trainer.train.parallel import (
    accumulation_passes,
    all_reduce_sum,
    gather_samples,
    grad_sync,
    loss_weight,
    wrap_model,
)
from trainer.train.precision import autocast, ensure_optimizer_state, loss_scaler
from trainer.train.session import Session
from trainer.train.session_setup import current_context
from trainer.train.sharded_recovery import ShardedRecovery


@dataclass
class WorkerEnv:
    """Where this worker runs. `on_metrics` receives rank 0's per-step records."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # The run's coordinator; None: the worker context's under Ray, else in-process.
    coordinator: CoordinatorClient | None = None
    on_metrics: Callable[[dict[str, Any]], None] | None = None
    # Called by the first rank of a group that starts (restored step, world size); not by a
    # replacement that joins a running group.
    on_start: Callable[[int, int], Any] | None = None
    report: Callable[[dict[str, Any]], None] | None = None  # all ranks (ray.train.report)
    stop_after: int | None = None  # stop gracefully (with a committed snapshot) after this step
    pace_s: float = 0.0  # sleep per step (fault-injection tests: let events land mid-run)
    record_samples: bool = False  # add every step's global sample indices to its metrics
    # Called with each in-process recovery (`elastic.recovery`), by the member that is rank 0
    # after it: what it cost and how the group changed.
    on_recovery: Callable[[dict[str, Any]], None] | None = None


@contextmanager
def dataset_errors_are_fatal(uri: str) -> Iterator[None]:
    """A dataset that cannot be opened or read (missing, corrupt, inconsistent: `DatasetError`,
    a missing file), or a data cursor at the end of the last epoch it can hold
    (`CursorRangeError`), fails the same way after any restart: raise `FatalRunError` so the
    run fails once. Storage that did not answer (`StorageUnavailableError`, other `OSError`s)
    passes through unchanged: a restart may well fix that."""
    try:
        yield
    except (DatasetError, FileNotFoundError, CursorRangeError) as err:
        raise FatalRunError(f"dataset {uri!r} cannot be used: {err}") from err


def refuse_other_run(cfg: FitConfig, fingerprint: str) -> None:
    """A recipe that disagrees with the run it continues (seed, shapes, dataset) is refused
    the same way on every restart: `FatalRunError` with the driver's pre-flight message."""
    try:
        check_continuation(cfg, fingerprint=fingerprint)
    except RunDirError as err:
        raise FatalRunError(str(err)) from err


@dataclass
class WorkerResult:
    start_step: int  # step restored from the snapshot (0 = fresh start)
    step: int  # last completed step
    loss: float  # training loss of the last step
    val_loss: float | None
    rejoin: bool = False  # the session ended for joiners (a sharded run re-forms with them)


def evaluate(cfg: FitConfig, model: nn.Module, val_set: TokenDataset, env: WorkerEnv) -> float:
    """Mean loss over the first `eval.batches` microbatches of the val split (fixed, so every
    evaluation of a run, at any world size, scores the same samples)."""
    loss_fn = loss_function(cfg)
    size = cfg.data.microbatch_size
    count = min(cfg.eval.batches, len(val_set) // size)
    mine = list(range(env.rank, count, env.world_size))
    passes = accumulation_passes(len(mine), count, env.world_size, cfg.parallelism)
    total = 0.0
    model.eval()
    with torch.no_grad():
        for i in range(passes):
            index = mine[i] if i < len(mine) else mine[-1] if mine else 0
            tokens = val_set.batch(range(index * size, (index + 1) * size)).to(env.device)
            with autocast(model, cfg.precision.dtype, env.device):
                loss = loss_fn(model, tokens).item()
            total += loss if i < len(mine) else 0.0  # padding passes only keep FSDP in step
    model.train()
    (summed,) = all_reduce_sum([total], env.device)
    return summed / max(count, 1)


def forward_backward(
    cfg: FitConfig,
    env: WorkerEnv,
    model: nn.Module,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    microbatches: list[Microbatch],
    step: int,
    scaler: torch.amp.GradScaler,
) -> float:
    """Accumulate this rank's share of the step's gradient; returns the sum of its
    microbatches' (unscaled) losses. Gradients are reduced across ranks in the last pass
    only. Each forward runs in the run's precision; `scaler` scales the loss (fp16 only)."""
    num_microbatches = cfg.data.num_microbatches
    weight = loss_weight(env.world_size, num_microbatches)
    passes = accumulation_passes(len(microbatches), num_microbatches, env.world_size,
                                 cfg.parallelism)
    step_loss = 0.0
    for i in range(passes):
        real = i < len(microbatches)  # padding passes (FSDP2) only keep collectives in step
        mb = microbatches[i] if real else microbatches[-1]
        # Backward inside the sketch seed too: with `model.checkpoint_blocks` it recomputes
        # each block, and the recompute must draw the sketch derived from (seed, step,
        # microbatch, layer), not one from the global generator (which checkpointing resets
        # to the same state at every block, step and microbatch).
        with grad_sync(model, last=i == passes - 1), \
                sketch_seed(cfg.seed, step, mb.index):
            with autocast(model, cfg.precision.dtype, env.device):
                loss = loss_fn(model, mb.tokens.to(env.device))
            scaler.scale(loss * (weight if real else 0.0)).backward()
        step_loss += loss.item() if real else 0.0
    return step_loss


@dataclass
class Built:
    """What `build` makes for one worker: the training state and the data it reads."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: LrSchedule
    loader: ResumableLoader
    train_set: TokenDataset
    val_set: TokenDataset
    scaler: torch.amp.GradScaler  # fp16's loss scaler; disabled (pass-through) otherwise

    def close(self) -> None:
        self.loader.close()
        self.train_set.close()
        self.val_set.close()


def build(cfg: FitConfig, env: WorkerEnv) -> Built:
    """Model (wrapped for DDP / FSDP2), optimizer, LR schedule and data of this rank."""
    model = wrap_model(build_model(cfg, env.device), cfg.parallelism, env.device,
                       precision=cfg.precision.dtype)
    try:
        optimizer = build_optimizer(model, cfg.optim, factory=cfg.optimizer_factory)
    except ConfigError as err:  # a factory that returns no optimizer: the same on any restart
        raise FatalRunError(str(err)) from err
    schedule = LrSchedule(optimizer, cfg.optim, cfg.steps)
    with dataset_errors_are_fatal(cfg.data.uri):
        train_set = TokenDataset(cfg.data.uri, split="train")
        val_set = TokenDataset(cfg.data.uri, split="val")
    try:
        loader = ResumableLoader(
            train_set,
            global_batch=cfg.data.global_batch,
            microbatch_size=cfg.data.microbatch_size,
            seed=cfg.seed,
            rank=env.rank,
            world_size=env.world_size,
        )
    except ValueError as err:  # e.g. a global batch larger than the dataset: no retry helps
        train_set.close()
        val_set.close()
        raise FatalRunError(f"dataset {cfg.data.uri!r}: {err}") from err
    return Built(model, optimizer, schedule, loader, train_set, val_set,
                 loss_scaler(cfg.precision.dtype, env.device))


def train_step(cfg: FitConfig, env: WorkerEnv, built: Built, step: int) -> tuple[float, list[int]]:
    """Train step `step` (0-based): forward/backward of this rank's microbatches, the
    optimizer update, then schedule and data cursor move on. Returns the step's mean loss
    over all ranks and this rank's sample indices. A NaN or Inf loss stops the run before the
    update, or skips the update (`trainer.train.nonfinite`)."""
    with dataset_errors_are_fatal(cfg.data.uri):  # a corrupt page found mid-run
        microbatches = built.loader.next_step()
    step_loss = forward_backward(cfg, env, built.model, loss_function(cfg),
                                 microbatches, step, built.scaler)
    # Summed before the update: a NaN or Inf loss stops (or skips) the step on every rank.
    (loss_sum,) = all_reduce_sum([step_loss], env.device)
    if nonfinite_loss(loss_sum, step, skip=cfg.optim.skip_nonfinite_loss):
        built.optimizer.zero_grad(set_to_none=True)  # skipped: no update from its gradients
    else:
        built.scaler.unscale_(built.optimizer)  # fp16: clip and step the true gradients
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(built.model.parameters(), cfg.optim.grad_clip)
        # The session's hook first finishes an in-flight capture. fp16: skipped (on every
        # rank) when a gradient overflowed, and the scale backs off; else optimizer.step().
        scale = built.scaler.get_scale()
        built.scaler.step(built.optimizer)
        built.scaler.update()
        built.optimizer.zero_grad(set_to_none=True)
        if built.scaler.get_scale() < scale:  # skipped: maybe no update yet, so no state
            ensure_optimizer_state(built.model, built.optimizer)
    built.schedule.step()
    with dataset_errors_are_fatal(cfg.data.uri):  # never past the cursor's last epoch
        built.loader.advance()
    return loss_sum / cfg.data.num_microbatches, [i for mb in microbatches
                                                  for i in mb.sample_indices]


def record(cfg: FitConfig, env: WorkerEnv, built: Built, step: int, loss: float,
           samples: list[int], *, started: float, stall_s: float,
           all_samples: bool = False, cursor: DataCursor | None = None) -> dict[str, Any]:
    """The metrics of completed step `step` (1-based), evaluated when due, handed to rank 0's
    `on_metrics` and, on snapshot steps, to every rank's `report`. `all_samples`: `samples`
    are already the whole step's (not this rank's share). `cursor`: the data position at the
    step's start, whose planned samples stand in when a member was lost during the gather
    (the step itself counted: its all-reduces went through)."""
    if env.record_samples and not all_samples:  # every rank's samples, for the audit
        per_rank = -(-cfg.data.num_microbatches // env.world_size) * cfg.data.microbatch_size
        gathered = gather_samples(samples, per_rank, env.device)
        if gathered is None and cursor is not None:
            gathered = built.loader.global_samples(cursor)
        samples = gathered if gathered is not None else samples
    evaluated = bool(cfg.eval.every) and step % cfg.eval.every == 0
    val_loss = None
    if evaluated:
        with dataset_errors_are_fatal(cfg.data.uri):
            val_loss = evaluate(cfg, built.model, built.val_set, env)
    tokens_per_step = cfg.data.global_batch * (cfg.data.seq_len - 1)
    metrics = {
        "step": step,
        "loss": loss,
        "val_loss": val_loss,
        "lr": built.schedule.lr_at(step - 1),
        "tokens_per_s": tokens_per_step / (time.perf_counter() - started),
        "world_size": env.world_size,
        "snapshot_stall_s": stall_s,  # training time spent on snapshots
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "time": time.time(),
        **({"samples": samples} if env.record_samples else {}),
    }
    if env.on_metrics is not None and env.rank == 0:
        env.on_metrics(metrics)
    if env.report is not None and (step % cfg.snapshots.snapshot_every == 0 or step == cfg.steps):
        # Every rank, the same steps: Ray Train's report is a barrier. Not every step: each
        # report waits for the controller's next poll.
        env.report({k: v for k, v in metrics.items() if k != "samples"})
    return metrics


def _record_late(cfg: FitConfig, env: WorkerEnv, built: Built, step: int, loss: float,
                 samples: list[int], started: float) -> None:
    """A step recorded once it counted after a recovery (`LateRecords`)."""
    record(cfg, env, built, step, loss, samples, started=started, stall_s=0.0,
           all_samples=True)


def run_worker(cfg: FitConfig, env: WorkerEnv) -> WorkerResult:
    """Build, restore through a `Session`, then train step by step up to `cfg.steps` (or a
    stop): the session snapshots, answers preemption and resizes, and commits the end. A
    sharded (FSDP2) run under in-process recovery does that again, in this process, each time
    its group re-forms (`trainer.train.sharded_recovery`)."""
    sharded = ShardedRecovery.start(cfg, current_context())
    if sharded is None:
        return _run_session(cfg, env, announce=True)
    if sharded.finished:  # a replacement that came after the run's last commit: no training
        last = sharded.last_commit()
        return WorkerResult(start_step=last, step=last, loss=float("nan"), val_loss=None)
    sessions = 0

    def one_session() -> WorkerResult:
        nonlocal sessions
        sessions += 1
        env.rank, env.world_size = dist.get_rank(), dist.get_world_size()
        return _run_session(cfg, env, announce=sessions == 1, progress=sharded)

    return sharded.run(one_session, env.on_recovery)


def _run_session(cfg: FitConfig, env: WorkerEnv, *, announce: bool,
                 progress: ShardedRecovery | None = None) -> WorkerResult:
    """One session of the loop (`announce`: it is the worker's first: `on_start`)."""
    built = build(cfg, env)
    try:
        if env.rank == 0:  # one rank reads run.json and the manifest; its error fails the group
            refuse_other_run(cfg, built.train_set.fingerprint)
        session = Session(
            built.model, built.optimizer, built.schedule, built.loader, scaler=built.scaler,
            snapshots=cfg.snapshots, until=env.stop_after, coordinator=env.coordinator,
            layout=cfg.parallelism,
            run_info={"config": cfg.to_dict(), **model_config_record(cfg)},
        )
        with session:
            env.rank, env.world_size = session.rank, session.world_size
            if (announce and env.on_start is not None and env.rank == 0
                    and not session.joined_late):
                env.on_start(session.start_step, env.world_size)
            loss, val_loss = float("nan"), None
            stalled = session.stall_s
            late = LateRecords(built.loader, session, functools.partial(
                _record_late, cfg, env, built), env.on_recovery)
            for step in session.steps(cfg.steps):
                late.catch_up()
                # In-process recovery may have re-formed the group at the last boundary.
                env.rank, env.world_size = session.rank, session.world_size
                started, cursor = time.perf_counter(), built.loader.cursor
                loss, samples = train_step(cfg, env, built, step)
                if session.step_failed:  # redone, or counted from a peer: see LateRecords
                    late.failed(step, cursor, loss, started)
                    continue
                metrics = record(cfg, env, built, step + 1, loss, samples, started=started,
                                 stall_s=session.stall_s - stalled, cursor=cursor)
                if progress is not None:
                    progress.reached = step + 1
                stalled = session.stall_s
                val_loss = metrics["val_loss"] if metrics["val_loss"] is not None else val_loss
                if env.pace_s:
                    time.sleep(env.pace_s)
            late.catch_up()
    finally:
        built.close()
    return WorkerResult(start_step=session.start_step, step=session.step, loss=loss,
                        val_loss=val_loss, rejoin=session.rejoin_requested)
