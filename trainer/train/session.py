"""`Session`: elastic snapshots for any training loop (Baton's own loop is built on it).

In a Ray Train V2 `train_func` under `ElasticTorchTrainer` (or alone, or under torchrun, with
`run_uri=`): `Session(model, optimizer, scheduler, snapshot_every=10)`, then
`session.data_loader(...)` or `for step in session.steps(total)` over a loader of its own
(`data_state.ResumableLoader`, `MapStyleLoader`). Usage and contract: docs/ray-train-loop.md.

- Refused in one line (`UsageError`, `trainer.train.session_setup`): a second open Session in
  the process; above world size 1 a model that is neither DDP nor FSDP2; a second
  `optimizer.step()` without a step boundary (`trainer.train.step_checks`).
- Construction registers every component once under fixed keys (`model`, `optim`, `sched`,
  `data`, `scaler` when fp16's is enabled, each of `extras`, `trainer` for its step counter) and
  restores the newest committed snapshot, resharded, optimizer warm (another model's, or none
  usable: `FatalRunError`). `session.step`: completed steps. Rank, world size, run directory,
  coordinator, snapshot settings, preemption notice and `until` come from the worker context
  `ElasticTorchTrainer` installs (explicit arguments win; `run_uri` is needed without either).
- `step_done()` ends a step (`steps(total)` and the elastic loader call it): it counts the step,
  then acts at the boundary, agreed across ranks: a preemption commits this step and raises
  `PreemptedError`; a planned resize commits it and waits for the teardown; a stop (the
  driver's, or `until`) commits it and returns True; else a due snapshot begins, its copies
  overlapping the next step (an optimizer pre-hook finishes them first).
- In-process recovery (`trainer.train.session_recovery`, when the context asks for it): the
  session joins the run's membership; a step whose group failed applies nothing and is redone on
  the re-formed group (or counts, where a member applied it); joiners come in at an agreed
  boundary, a replacement taking its state from a live member.
- `close()` commits the current step unless a snapshot of it exists, then flushes (returning
  from the training function does it); `close(commit=False)` only flushes.
- Data: a world-size-free loader (`reshard(rank=, world_size=)`) is resharded to this rank, any
  other restored as rank 0 saved it (at another world size a warning; `FatalRunError` with
  `strict_data=True`). Nothing here imports Ray.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from data_state import ResumableLoader
from elastic.coord import CoordinatorClient
from elastic.errors import FatalRunError, SnapshotIntegrityError
from elastic.preemption import PreemptionNotice
from elastic.recovery import LeftBehindError
from elastic.snapshotter import Snapshotter
from elastic.state import SnapshotMismatchError
from trainer.config import SnapshotConfig
from trainer.train import session_recovery as recovering
from trainer.train import session_setup as setup
from trainer.train.parallel import unwrapped
from trainer.train.session_setup import (  # noqa: F401 - the public names of trainer.train.session
    UsageError,
    WorkerContext,
    current_context,
    open_session,
    run_directory,
    worker_context,
)
from trainer.train.step_checks import OptimizerSteps

if TYPE_CHECKING:
    from elastic.recovery import InProcessRecovery
    from trainer.train.data_loader import ElasticDataLoader

log = logging.getLogger("baton.session")

# Asking the platform for a preemption notice is a barrier across workers: not every step.
PREEMPTION_CHECK_EVERY = 5
# After the snapshot for a planned resize, how long to wait for the teardown before training
# on (the resize was called off).
RESIZE_GRACE_S = 30.0


class PreemptedError(RuntimeError):
    """This worker group stopped on a preemption notice after committing a snapshot."""


class Session(recovering.RecoveringSessionMixin):
    """See the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        data: Any = None,
        *,
        extras: Mapping[str, Any] | None = None,
        scaler: torch.amp.GradScaler | None = None,
        run_uri: Any = None,
        snapshot_every: int | None = None,
        snapshots: SnapshotConfig | None = None,
        until: int | None = None,
        coordinator: CoordinatorClient | None = None,
        layout: str | None = None,
        strict_data: bool = False,
        run_info: dict[str, Any] | None = None,
    ) -> None:
        context = current_context()
        settings = setup.settings(snapshots, context,
                             None if run_uri is None else setup.run_directory(run_uri),
                             snapshot_every)
        # In-process recovery first: it makes the membership's group the one Baton's
        # collectives run on (and so the rank and world size).
        recovery, self.arrived_after_finish = recovering.start_recovery(context, model)
        try:
            self._start(model, optimizer, scheduler, data, extras, scaler, settings, context,
                        coordinator, layout, strict_data, run_info, until, recovery)
        except BaseException:
            if recovery is not None:
                recovery.close(finished=False)
            raise

    def _start(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
               scheduler: Any, data: Any, extras: Mapping[str, Any] | None,
               scaler: torch.amp.GradScaler | None, settings: SnapshotConfig,
               context: WorkerContext | None, coordinator: CoordinatorClient | None,
               layout: str | None, strict_data: bool, run_info: dict[str, Any] | None,
               until: int | None, recovery: InProcessRecovery | None) -> None:
        self.rank, self.world_size = setup.rank_and_world_size()
        setup.refuse_misuse(model, self.world_size)
        self.model = model
        self.optimizer_steps = 0  # optimizer.step() calls (the pre-hook counts them)
        self._optimizer_steps = OptimizerSteps(optimizer)  # at most one per step
        self._loader: ElasticDataLoader | None = None
        self._close_at_return = bool(context and context.close_at_return)
        self._postponed = False  # a snapshot due at an epoch's end, taken one step later
        self._data = data
        self.until = until if until is not None else context.until if context else None
        self._progress = setup.Progress()
        self.registry = setup.state_registry(model, optimizer, scheduler, data, scaler, extras,
                                             self._progress, self.rank, self.world_size)
        self.snapshotter = Snapshotter(
            settings.run_uri, self.registry, rank=self.rank, world_size=self.world_size,
            settings=settings.snapshot_settings(layout or setup.layout_of(model)),
            coordinator=coordinator or (context.coordinator if context else None),
            ram_tier=context.ram_tier if context and coordinator is None else None,
            run_info=run_info,
            generation=recovery.generation if recovery is not None else None,
        )
        self.coordinator: CoordinatorClient = self.snapshotter.coordinator
        self._recovery = recovering.StepRecovery(recovery, self) if recovery is not None else None
        if recovery is not None:
            recovering.attach_recovery(recovery, model, self.registry)
        if recovery is not None and not recovery.started_fresh:
            self.start_step = self._receive(recovery)  # a replacement: from a live member
        else:
            self.start_step = self._restore()
            self._captured: int | None = self.start_step or None
        if self.rank == 0 or strict_data:
            setup.check_data(data, self.snapshotter.restored_world_size, self.world_size,
                             strict_data)
        self.stall_s = 0.0  # training time spent waiting on snapshots so far
        self.stopped_at: int | None = None  # the step a stop (driver or `until`) ended at
        self._closed = False
        optimizers = [o for o in [optimizer, *(extras or {}).values()]
                      if isinstance(o, torch.optim.Optimizer)]
        self._hooks = [o.register_step_pre_hook(self._before_optimizer_step) for o in optimizers]
        setup.note_open(self)
        self._pipelined = bool(optimizers)
        self.watcher = setup.step_watcher(context, self.coordinator, PREEMPTION_CHECK_EVERY,
                                          recovery.joiners_waiting if recovery else
                                          context.joiners if context else None)
        if threading.current_thread() is threading.main_thread():
            self.watcher.install()  # SIGTERM -> snapshot at the next step boundary, then exit
        if self._recovery is not None:
            self._recovery.begin_step()

    # ------------------------------------------------------------------ the loop

    @property
    def step(self) -> int:
        """Completed steps: the restored step right after construction, then counted up by
        every `step_done()` (the current step during the loop, the last one after it)."""
        return self._progress.step

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def unwrapped_model(self) -> nn.Module:
        """The model inside a DDP wrapper, else the model (`prepare_model` does not wrap at
        world size 1, so Ray's `model.module` fails there)."""
        return unwrapped(self.model)

    def data_loader(self, dataset: Any, *, batch_size: int, microbatch_size: int = 1,
                    shuffle: bool = True, seed: int = 0,
                    collate_fn: Callable[[list[Any]], Any] | None = None,
                    drop_last: bool = False, num_workers: int = 0,
                    fingerprint: str | None = None,
                    allow_batch_change: bool = False, dtypes: Any = None,
                    on_error: str = "raise") -> ElasticDataLoader:
        """The elastic `DataLoader` of this session (`trainer.train.data_loader`): `batch_size` is
        the global batch (the snapshot's, unless `allow_batch_change`); the data position is
        restored from the snapshot. `dataset`: a map-style dataset, a `ray.data.Dataset` or the
        name of one passed to the trainer (`datasets=`; `trainer.train.stream_data`, with
        `dtypes` and `on_error`)."""
        from trainer.train.data_loader import make_loader

        self._loader = make_loader(
            self, dataset, batch_size=batch_size, microbatch_size=microbatch_size,
            shuffle=shuffle, seed=seed, collate_fn=collate_fn, drop_last=drop_last,
            num_workers=num_workers, fingerprint=fingerprint,
            allow_batch_change=allow_batch_change, dtypes=dtypes, on_error=on_error)
        return self._loader

    def steps(self, total: int) -> Iterator[int]:
        """Yield the 0-based index of each step still to train, up to `total`; after each,
        `step_done()`. Ends early on a stop; on finishing, `close()` commits the last step."""
        if self.until is not None and self._progress.step >= self.until:
            self._stop(self._progress.step)  # restored at or past `until`: nothing to train
            return
        while self._progress.step < total:
            yield self._progress.step
            if self.step_done(boundary=self._progress.step + 1 >= total):
                return
        if not self._close_at_return:
            self.close()

    def step_done(self, *, boundary: bool = False) -> bool:
        """Count one completed step and act at its boundary (module docstring). Returns True
        when the loop must end (a stop was asked for or `until` was reached). `boundary`: the
        step ends an epoch or the loop; when the training function's return commits the last
        step (under ElasticTorchTrainer), a snapshot due there is taken one step later, so
        that no restart lands past the end of the loop with nothing left to train."""
        self._optimizer_steps.boundary()
        try:
            return self._step_done(boundary)
        except LeftBehindError as err:
            # Left out of the group (silent too long) and the run finished meanwhile: this
            # worker's state is stale; end its loop without committing anything of it.
            log.warning("%s: ending this worker", err)
            self._captured = self._progress.step
            self.close(commit=False)
            return True

    def _step_done(self, boundary: bool) -> bool:
        if isinstance(self._data, ResumableLoader) and self._data.pending:
            raise UsageError(
                f"step {self._progress.step + 1} ends but its data was never committed: call "
                "loader.advance() after optimizer.step() (or iterate session.data_loader(...), "
                "which advances itself)")
        if self._recovery is not None and self._recovery.recovery.must_recover():
            # The group failed in this step and is re-formed now: the step is redone unless
            # its update was applied (here, or on a member that sent its state).
            if not self._recovery.step_ends():
                return False  # redo: its start state is back (progress, data, schedule)
            return self._resume_after_recovery()
        self._progress.step += 1
        step = self._progress.step
        notice = self.watcher.poll(step)
        if self._recovery is not None and self._recovery.boundary_failed():
            return self._resume_after_recovery()  # the group failed in the agreement itself
        joining = notice is not None and notice.source == "join"
        notice = None if joining else notice
        stopping = (notice is not None and notice.source == "stop") or (
            self.until is not None and step >= self.until)
        started = time.perf_counter()
        # A capture still in flight here saw no optimizer.step() since it began (fp16 skipped
        # an overflowing update): nothing it copies changed; finish it before the next one.
        self.snapshotter.wait_capture()
        if notice is not None or stopping:
            # Commit exactly this step (P6): the run continues (or is exported) from here.
            self.snapshotter.after_step(step, force=True)
            self._captured = step
        elif self._close_at_return and boundary and self.snapshotter.due(step):
            self._postponed = True  # taken at the next step boundary (see the docstring)
        else:
            if self._postponed:
                self.coordinator.poll()
                begun = self.snapshotter.begin_capture(step)
            else:
                begun = self.snapshotter.begin_capture_if_due(step)
            self._postponed = False
            if begun:
                self._captured = step  # its copies overlap the next step's forward/backward
                if not self._pipelined:
                    self._wait_capture()
        self.stall_s += time.perf_counter() - started
        if stopping:
            self._stop(step)
            return True
        if notice is not None:
            self._answer(notice)
        return self._boundary_end(step, joining)

    def wait_capture(self) -> None:
        """Finish the in-flight capture now (before changing captured tensors by hand; the
        optimizer hook does it before every `optimizer.step()`)."""
        self._wait_capture()

    def close(self, commit: bool = True) -> None:
        """Commit the current step unless a snapshot of it was taken (`commit=False`: only
        flush what is in flight), then wait for the commit. Idempotent."""
        if self._closed:
            return
        if commit and self._loader is not None:
            self._loader.end_open_step()  # a `break` after optimizer.step() ended that step
        self._closed = True
        try:
            step = self._progress.step
            if commit and step > 0 and self._captured != step:
                self.snapshotter.after_step(step, force=True)
                self._captured = step
        finally:
            for hook in self._hooks:
                hook.remove()
            if self._loader is not None:
                self._loader.close()
            self.watcher.uninstall()
            self.snapshotter.close()
            if self._recovery is not None:
                self._recovery.close(self._progress.step if commit else None, self.coordinator)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        self.close(commit=kind is None)

    def _restore(self) -> int:
        try:
            step = self.snapshotter.restore()
            if self._recovery is not None and self._recovery.recovery.must_recover():
                raise self._recovery.recovery.fall_back("a member was lost while restoring")
            return step
        except SnapshotMismatchError as err:  # the loop's model is not the snapshot's: always
            raise FatalRunError(
                f"the training state disagrees with the snapshot it continues: {err}") from err
        except SnapshotIntegrityError as err:  # every committed snapshot definitely unusable:
            # a restart would silently train from step 0, so stop and let a person look.
            raise FatalRunError(str(err)) from err

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._optimizer_steps.stepped(optimizer, self._progress.step + 1)
        self.optimizer_steps += 1
        self._wait_capture()
        if self._recovery is not None:
            self._recovery.before_optimizer_step(optimizer)  # a failed step applies nothing

    def _wait_capture(self) -> None:
        started = time.perf_counter()
        self.snapshotter.wait_capture()
        self.stall_s += time.perf_counter() - started

    def _stop(self, step: int) -> None:
        """A stop: the snapshot of `step` is captured; persist it, tell the driver."""
        self.snapshotter.persister.wait()
        self.stopped_at = step
        if self.rank == 0:
            self.coordinator.answer_request(step)  # a pending resize request is met too
            self.coordinator.answer_stop(step)
        self.close()

    def _answer(self, notice: PreemptionNotice) -> None:
        if notice.source == "request":
            # A planned resize: Ray Train tears this group down once the snapshot just taken
            # is committed; train no further, so the new group redoes nothing.
            self.snapshotter.persister.wait()
            if self.rank == 0:
                self.coordinator.answer_request(notice.step)
            time.sleep(RESIZE_GRACE_S)
            return
        # Preemption: commit, then fail the group so Ray Train restarts it without the
        # doomed node, from exactly here.
        self.close()
        raise PreemptedError(
            f"preempted at step {notice.step} ({notice.source}); its snapshot is committed "
            "and training resumes from it")
