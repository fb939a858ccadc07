"""The per-worker training loop: one function that reads top to bottom.

Contract: `run_worker(cfg, env)` trains from the newest committed snapshot of
`cfg.snapshots.run_uri` (or from scratch) up to `cfg.steps`, on `env.world_size` ranks that
already share a process group (or a single process), and returns a `WorkerResult`.

Why the trajectory does not depend on the world size (promise P1):
- every rank builds the same initial model from `cfg.seed`;
- a step is `data.global_batch / data.microbatch_size` fixed microbatches (the loader decides
  which samples, from `(seed, epoch)` only); ranks just share them out;
- each microbatch's sketch is seeded by `(seed, step, microbatch index, layer name)`;
- each microbatch's mean loss is weighted by `world_size / num_microbatches`, so the
  gradient averaging of DDP / FSDP2 yields the mean over all microbatches of the step.
Only float summation order changes with the world size.

A snapshot holds model, optimizer, LR schedule, data cursor and the step (promise P2); it is
captured right after the optimizer update of a step, so the data cursor and the schedule
have been advanced for exactly the committed steps (promise P5).
"""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from data_state import Microbatch, ResumableLoader, TokenDataset
from data_state.manifest import DatasetError
from elastic.errors import FatalRunError, SnapshotIntegrityError
from elastic.preemption import PreemptionNotice, PreemptionWatcher
from elastic.registry import StateRegistry
from elastic.restore import SnapshotMismatchError
from elastic.snapshotter import Snapshotter
from sketch_ops import sketch_model, sketch_seed
from trainer.config import FitConfig
from trainer.model import GPT, SKETCH_LAYERS
from trainer.optim import WarmupCosine, build_optimizer
from trainer.parallel import (
    accumulation_passes,
    all_reduce_sum,
    gather_samples,
    grad_sync,
    loss_weight,
    wrap_model,
)
from trainer.run_dir import RunDirError, check_continuation

# Asking Ray Train for a preemption notice is a barrier across workers: not every step.
_RAY_PREEMPTION_CHECK_EVERY = 5
# After the snapshot for a planned resize, how long to wait for the teardown before training
# on (the resize was called off).
_RESIZE_GRACE_S = 30.0


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting `tokens[:, 1:]` from `tokens[:, :-1]`."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def build_model(cfg: FitConfig) -> nn.Module:
    """The same initial model on every rank (seeded), with BASIS layers when sketching is on."""
    torch.manual_seed(cfg.seed)
    if cfg.model_factory is not None:
        model = cfg.model_factory()
    else:
        model = GPT(cfg.model, seq_len=cfg.data.seq_len)
    sketch = cfg.sketch
    if sketch.enabled:
        include = sketch.include or (SKETCH_LAYERS if cfg.model_factory is None else None)
        if sketch.rank:
            sketch_model(model, rank=sketch.rank, include=include, estimator=sketch.estimator)
        else:
            sketch_model(
                model,
                memory_budget=int(sketch.memory_budget_mib * 2**20),
                rows=cfg.data.microbatch_size * (cfg.data.seq_len - 1),  # inputs per microbatch
                include=include,
                estimator=sketch.estimator,
            )
    return model


@dataclass
class WorkerEnv:
    """Where this worker runs. `on_metrics` receives rank 0's per-step records."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    coordinator: Any = None  # elastic coordinator handle (Ray actor) or None in-process
    on_metrics: Callable[[dict[str, Any]], None] | None = None
    on_start: Callable[[int], Any] | None = None  # called with the restored step
    report: Callable[[dict[str, Any]], None] | None = None  # all ranks (ray.train.report)
    stop_after: int | None = None  # stop gracefully (with a committed snapshot) after this step
    pace_s: float = 0.0  # sleep per step (fault-injection tests: let events land mid-run)
    record_samples: bool = False  # add every step's global sample indices to its metrics


class PreemptedError(RuntimeError):
    """This worker group stopped on a preemption notice after committing a snapshot."""


@contextmanager
def dataset_errors_are_fatal(uri: str) -> Iterator[None]:
    """A dataset that cannot be opened or read (missing, corrupt, inconsistent: `DatasetError`,
    a missing file) fails the same way after any restart: raise `FatalRunError` so the run
    fails once. Storage that did not answer (`StorageUnavailableError`, other `OSError`s)
    passes through unchanged: a restart may well fix that."""
    try:
        yield
    except (DatasetError, FileNotFoundError) as err:
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


class TrainerProgress:
    """The loop's own state in the snapshot: the number of completed steps."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def evaluate(cfg: FitConfig, model: nn.Module, val_set: TokenDataset, env: WorkerEnv) -> float:
    """Mean loss over the first `eval.batches` microbatches of the val split (fixed, so every
    evaluation of a run, at any world size, scores the same samples)."""
    loss_fn = cfg.loss_fn or next_token_loss
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
) -> float:
    """Accumulate this rank's share of the step's gradient; returns the sum of its
    microbatches' losses. Gradients are reduced across ranks in the last pass only."""
    num_microbatches = cfg.data.num_microbatches
    weight = loss_weight(env.world_size, num_microbatches)
    passes = accumulation_passes(len(microbatches), num_microbatches, env.world_size,
                                 cfg.parallelism)
    step_loss = 0.0
    for i in range(passes):
        real = i < len(microbatches)  # padding passes (FSDP2) only keep collectives in step
        mb = microbatches[i] if real else microbatches[-1]
        with grad_sync(model, cfg.parallelism, last=i == passes - 1):
            with sketch_seed(cfg.seed, step, mb.index):
                loss = loss_fn(model, mb.tokens.to(env.device))
            (loss * (weight if real else 0.0)).backward()
        step_loss += loss.item() if real else 0.0
    return step_loss


def run_worker(cfg: FitConfig, env: WorkerEnv) -> WorkerResult:
    loss_fn = cfg.loss_fn or next_token_loss
    model = wrap_model(build_model(cfg).to(env.device), cfg.parallelism, env.device)
    optimizer = build_optimizer(model, cfg.optim)
    schedule = WarmupCosine(optimizer, cfg.optim, cfg.steps)
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
        raise FatalRunError(f"dataset {cfg.data.uri!r}: {err}") from err
    if env.rank == 0:  # one rank reads run.json and the manifest; its error fails the group
        refuse_other_run(cfg, train_set.fingerprint)
    progress = TrainerProgress()
    registry = StateRegistry()
    registry.register("model", model)
    registry.register("optim", optimizer, model=model)
    registry.register("sched", schedule)
    registry.register("data", loader)
    registry.register("trainer", progress)
    snapshotter = Snapshotter(
        cfg.snapshots.run_uri,
        registry,
        rank=env.rank,
        world_size=env.world_size,
        layout=cfg.parallelism,
        coordinator=env.coordinator,
        snapshot_every=cfg.snapshots.snapshot_every,
        keep_last=cfg.snapshots.keep_last,
        ram=cfg.snapshots.ram_copy_mib != 0,
        storage_timeout_s=cfg.snapshots.storage_timeout_s,
        storage_retry_s=cfg.snapshots.storage_retry_s,
        run_info={"config": cfg.to_dict()},
    )
    try:
        start_step = snapshotter.restore()
    except SnapshotMismatchError as err:  # the recipe's model is not the snapshot's: always
        raise FatalRunError(f"the recipe disagrees with the snapshot it continues: {err}") from err
    except SnapshotIntegrityError as err:  # every committed snapshot is definitely unusable:
        # a restart would silently train from step 0, so stop and let a person look.
        raise FatalRunError(str(err)) from err
    watcher = PreemptionWatcher(
        ray_check_every=_RAY_PREEMPTION_CHECK_EVERY,
        requested=getattr(env.coordinator, "snapshot_requested", None),
    )
    if threading.current_thread() is threading.main_thread():
        watcher.install()  # SIGTERM -> snapshot at the next step boundary, then exit
    if env.on_start is not None:
        env.on_start(start_step)
    num_microbatches = cfg.data.num_microbatches
    tokens_per_step = cfg.data.global_batch * (cfg.data.seq_len - 1)
    loss_value, val_loss = float("nan"), None
    preempted: PreemptionNotice | None = None
    try:
        while progress.step < cfg.steps:
            started = time.perf_counter()
            step = progress.step
            with dataset_errors_are_fatal(cfg.data.uri):  # a corrupt page found mid-run
                microbatches = loader.next_step()
            step_loss = forward_backward(cfg, env, model, loss_fn, microbatches, step)
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            stall_started = time.perf_counter()
            snapshotter.wait_capture()  # an in-flight capture must finish before tensors change
            stall = time.perf_counter() - stall_started
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            loader.advance()
            progress.step = step + 1
            notice = watcher.poll(progress.step)
            stopping = (notice is not None and notice.must_exit) or progress.step == env.stop_after
            stall_started = time.perf_counter()
            if notice is not None or stopping or progress.step == cfg.steps:
                # Preemption, a planned stop or the end: commit this step now (P6), so the
                # run can continue (or be exported) from exactly here.
                snapshotter.after_step(progress.step, force=True)
            else:
                # Copies of a due snapshot overlap the next step's forward/backward.
                snapshotter.begin_capture_if_due(progress.step)
            stall += time.perf_counter() - stall_started
            samples = (
                gather_samples(
                    [i for mb in microbatches for i in mb.sample_indices],
                    -(-num_microbatches // env.world_size) * cfg.data.microbatch_size,
                    env.device,
                )
                if env.record_samples
                else None
            )
            (loss_sum,) = all_reduce_sum([step_loss], env.device)
            loss_value = loss_sum / num_microbatches
            evaluated = bool(cfg.eval.every) and progress.step % cfg.eval.every == 0
            if evaluated:
                with dataset_errors_are_fatal(cfg.data.uri):
                    val_loss = evaluate(cfg, model, val_set, env)
            record = {
                "step": progress.step,
                "loss": loss_value,
                "val_loss": val_loss if evaluated else None,
                "lr": schedule.lr_at(step),
                "tokens_per_s": tokens_per_step / (time.perf_counter() - started),
                "world_size": env.world_size,
                "snapshot_stall_s": stall,  # training time spent on snapshots
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "time": time.time(),
                **({"samples": samples} if samples is not None else {}),
            }
            if env.on_metrics is not None and env.rank == 0:
                env.on_metrics(record)
            if env.report is not None and (
                progress.step % cfg.snapshots.snapshot_every == 0 or progress.step == cfg.steps
            ):
                # Every rank, the same steps: Ray Train's report is a barrier. Not every
                # step: each report waits for the controller's next poll.
                env.report({k: v for k, v in record.items() if k != "samples"})
            if notice is not None and notice.source == "request":
                # A planned resize: Ray Train tears this group down once the snapshot just
                # taken is committed; train no further, so the new group redoes nothing.
                snapshotter.persister.wait()
                if env.rank == 0:
                    env.coordinator.answer_request(progress.step)
                time.sleep(_RESIZE_GRACE_S)
            elif notice is not None:
                preempted = notice
                break
            if stopping:
                break
            if env.pace_s:
                time.sleep(env.pace_s)
    finally:
        watcher.uninstall()
        snapshotter.close()
        loader.close()
        train_set.close()
        val_set.close()
    if preempted is not None:
        # The snapshot of this step is committed (close() flushed it). Failing the worker
        # group makes Ray Train restart it without the preempted node, from exactly here.
        raise PreemptedError(
            f"preempted at step {preempted.step} ({preempted.source}); "
            "its snapshot is committed and training resumes from it"
        )
    return WorkerResult(
        start_step=start_step, step=progress.step, loss=loss_value, val_loss=val_loss
    )
