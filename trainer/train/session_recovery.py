"""How a `Session` keeps training when a worker is lost: in-process recovery at its steps.

Contract:
- `start_recovery(context, model)`: the `elastic.recovery.InProcessRecovery` of this worker,
  joined to the run's membership, when the worker context asks for it (`recovery.in_process`
  and a member id, as `ElasticTorchTrainer` hands every worker on Ray), else None; and
  whether the run had already finished (a late replacement: it restores the final snapshot
  as any worker does, and trains nothing). Under it, the model must
  be replicated (DDP; a model of one worker at world size 1): an FSDP2 model would shard over
  a group of its worker alone, so it is refused in one line (`UsageError`) naming
  `recovery.in_process = false`. torchft missing: a warning, and no in-process recovery.
- `attach_recovery(recovery, model, registry)`: the gradient hook on a DDP model (a model
  with a communication hook of its own: `UsageError`).
- `StepRecovery(recovery, session)` runs it at the session's steps:
  * `begin_step()` at every step's start; `before_optimizer_step(optimizer)` from the
    session's optimizer pre-hook (a step whose group failed applies nothing);
  * `step_ends()` when a step ends, before it is counted: False when it must be redone
    (the group failed before its update was applied): the state of the step's start is back
    and the members re-formed; True when it counts (it did not fail, or another member
    applied it and this one received the result);
  * `boundary_failed()` after the step boundary's own collectives: the group failed in
    them, the members re-formed (the step already counted): agree again;
  * `let_joiners_in()` when the members agreed at a boundary that joiners wait;
  * `close(final_step, coordinator)` when the session closes.
  After each recovery the session is told the new rank, world size, generation and the
  completed steps every member now holds (`RecoveringSession.rejoined`); the recoveries
  are kept in `recovery.recoveries`.
  A recovery that cannot go on raises `elastic.recovery.RecoveryFailedError` (every member
  does, so Ray Train restarts the whole group from the newest snapshot).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch
from torch import nn

from elastic.coord import CoordinatorClient
from elastic.recovery import GroupUnavailableError, InProcessRecovery, MemberSettings, Recovered
from trainer.train.session_setup import UsageError, WorkerContext, WorldSizeFree, layout_of

log = logging.getLogger("baton.session")

# How long the first member waits for the last commit before marking the run finished.
FINISH_WAIT_S = 60.0


def start_recovery(context: WorkerContext | None, model: nn.Module
                   ) -> tuple[InProcessRecovery | None, bool]:
    if (context is None or context.recovery is None or not context.recovery.in_process
            or context.member is None or context.coordinator is None):
        return None, False
    if layout_of(model) == "fsdp":
        raise UsageError(
            "Session: an FSDP2 model under in-process recovery would shard over its own "
            "worker alone; pass recovery=RecoveryConfig(in_process=False) to "
            "ElasticTorchTrainer (recipe: [recovery] in_process = false)")
    member_id, order = context.member
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        settings = MemberSettings(coordinator_s=context.recovery.coordinator_timeout_s)
        recovery = InProcessRecovery(context.coordinator, member_id=member_id, order=order,
                                     device=device,
                                     collective_timeout_s=context.recovery.collective_timeout_s,
                                     settings=settings, faults=context.faults)
    except GroupUnavailableError as err:
        log.warning("%s: a lost worker restarts the whole group", err)
        return None, False
    if not recovery.join():
        return None, recovery.run_finished
    return recovery, False


def attach_recovery(recovery: InProcessRecovery, model: nn.Module, registry: Any) -> None:
    """The DDP model's gradient all-reduce onto the membership's group; a model that already
    has a communication hook of its own is refused in one line."""
    try:
        recovery.attach(model, registry)
    except ValueError as err:
        raise UsageError(f"Session: {err}; in-process recovery reduces gradients with a hook "
                         "of its own: remove yours, or pass recovery=RecoveryConfig("
                         "in_process=False) to ElasticTorchTrainer") from err


class RecoveringSession(Protocol):
    """What `StepRecovery` needs of its `Session`."""

    @property
    def step(self) -> int: ...

    def rejoined(self, rank: int, world_size: int, generation: int, step: int) -> None: ...


class StepRecovery:
    """See the module docstring."""

    def __init__(self, recovery: InProcessRecovery, session: RecoveringSession) -> None:
        self.recovery = recovery
        self._session = session

    def begin_step(self) -> None:
        self.recovery.begin_step()

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.recovery.before_optimizer_step(optimizer)

    def step_ends(self) -> bool:
        if not self.recovery.must_recover():
            return True
        done = self._recover(open_step=True, reason="failure")
        return done.counted

    def boundary_failed(self) -> bool:
        if not self.recovery.must_recover():
            return False
        self._recover(open_step=False, reason="failure")
        return True

    def let_joiners_in(self) -> None:
        self._recover(open_step=False, reason="join")

    def _recover(self, *, open_step: bool, reason: str) -> Recovered:
        done = self.recovery.recover(self._session.step, open_step=open_step, reason=reason)
        self._session.rejoined(done.rank, done.world_size, done.generation, done.step)
        return done

    def close(self, final_step: int | None, coordinator: CoordinatorClient) -> None:
        """The session ends; `final_step`: the step it committed last. The first member
        marks the run finished once that step is committed (a replacement that starts later
        restores it instead of waiting to join); nothing is marked after a failure."""
        finished = False
        if final_step is not None and self.recovery.rank == 0:
            deadline = time.monotonic() + FINISH_WAIT_S
            while time.monotonic() < deadline:
                if final_step == 0 or final_step in coordinator.committed_steps():
                    finished = True
                    break
                time.sleep(0.05)
        self.recovery.close(finished=finished)

    def summary(self) -> list[dict[str, Any]]:
        return [vars(r) for r in self.recovery.recoveries]


class RecoveringSessionMixin:
    """The `Session`'s side of in-process recovery: what it shows of it, and what a re-formed
    group changes in it (its rank and world size, step, snapshotter and loaders)."""

    _recovery: StepRecovery | None
    arrived_after_finish: bool
    rank: int
    world_size: int
    until: int | None
    snapshotter: Any
    coordinator: CoordinatorClient
    registry: Any
    _progress: Any
    _captured: int | None
    rejoin_requested: bool = False  # the loop ended for joiners (a sharded run)

    def _stop(self, step: int) -> None: ...

    @property
    def step_failed(self) -> bool:
        """The training group failed during the open step (in-process recovery re-forms it
        when the step ends; the step is redone unless a member applied it)."""
        return self._recovery is not None and self._recovery.recovery.must_recover()

    @property
    def joined_late(self) -> bool:
        """This worker joined a group that was already training (it took a live member's
        state), or arrived after the run finished (it trains nothing)."""
        return self.arrived_after_finish or self.received_from_peer

    @property
    def received_from_peer(self) -> bool:
        """This worker joined a running group and took its state from a live member."""
        return self._recovery is not None and not self._recovery.recovery.started_fresh

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        """Every in-process recovery of this session, oldest first (`elastic.recovery`)."""
        return self._recovery.summary() if self._recovery is not None else []

    def _boundary_end(self, step: int, joining: bool) -> bool:
        """The end of a step boundary (after its snapshot and notices): the group failed in
        the boundary's own collectives, or joiners wait. True: end the loop (a sharded run's
        joiners: `trainer.train.sharded_recovery` starts the training state again with them
        once this step is committed)."""
        if self._recovery is None:
            if not joining:
                return False
            self.snapshotter.wait_capture()
            if self._captured != step:
                self.snapshotter.after_step(step, force=True)
                self._captured = step
            self.snapshotter.persister.wait()
            self.rejoin_requested = True
            return True
        if self._recovery.boundary_failed():  # in the snapshot's agreement
            return self._resume_after_recovery()
        if joining:  # last: a joiner's first collective is its first step's
            # A snapshot begun here commits first: the new generation would abort it.
            self.snapshotter.wait_capture()
            self.snapshotter.persister.wait()
            self._recovery.let_joiners_in()
        self._recovery.begin_step()
        return False

    def _resume_after_recovery(self) -> bool:
        """After the group re-formed at a step boundary every member resumes at the next
        step's start, where a joiner starts: this boundary's own work (a due snapshot, a
        notice) waits for the next boundary. A stop at `until` is not put off."""
        assert self._recovery is not None
        step = self._progress.step
        if self.until is not None and step >= self.until:
            self.snapshotter.after_step(step, force=True)
            self._captured = step
            self._stop(step)
            return True
        self._recovery.begin_step()
        return False

    def rejoined(self, rank: int, world_size: int, generation: int, step: int) -> None:
        """In-process recovery re-formed the group: this worker's new place in it, and the
        completed steps every member now holds."""
        self.rank, self.world_size = rank, world_size
        self._progress.step = step
        self.snapshotter.rebind(rank, world_size, generation)
        # Every member (a joiner too) agrees whether this step's snapshot exists: a capture
        # of the old generation still in flight is aborted, so only a commit counts.
        self._captured = step if step in self.coordinator.committed_steps() else None
        for component in self.registry.components().values():
            if isinstance(component, WorldSizeFree):
                component.reshard(rank=rank, world_size=world_size)

    def _receive(self, recovery: InProcessRecovery) -> int:
        """A replacement worker: the members' state, from a live member."""
        self.snapshotter.restored_state = recovery.receive_joined_state()
        self.snapshotter.restored_world_size = recovery.world_size
        step = int(self._progress.step)
        # Whether this step's snapshot exists, as the members see it.
        self._captured = step if step and step in self.coordinator.committed_steps() else None
        return step
