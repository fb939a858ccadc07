"""In-process recovery of one worker: a lost member costs one step, not a restart.

``InProcessRecovery(coordinator, member_id=, order=, device=, settings=)`` is what a
``trainer.train.session.Session`` runs when the run's coordinator keeps a membership
(``elastic.coord.membership``; on Ray, ``trainer.on_ray.replica_groups`` sets it up):

- ``join()`` makes this worker a member (``elastic.recovery.member``), forms its process group
  (``elastic.recovery.group.ElasticGroup``) and installs it as the group of Baton's collectives
  (``elastic.collectives``); False when the coordinator runs no membership or the run has
  finished (``run_finished``). ``started_fresh``: a member of a group that starts whole (it
  restores the newest snapshot with the others); otherwise a joiner, which
  ``receive_joined_state()`` brings up to the members' state from a live member.
- ``attach(model, registry)``: a DDP model's gradient all-reduce moves onto the group
  (``elastic.recovery.grad_sync``); ``registry`` is what is saved, restored and sent.
- Per step: ``begin_step()`` keeps what a step changes besides the model's and optimizers'
  tensors (``StepState``); ``before_optimizer_step(optimizer)``, from the optimizer's pre-hook,
  drops the gradients of a step whose group failed (``optimizer.step()`` changes nothing) and
  otherwise notes the update applied; ``must_recover()``: the group failed or the membership
  moved on.
- ``recover(step, open_step, reason)`` at a step boundary puts back the open step's state if
  its update was not applied, asks for the next membership, forms its group and agrees on who
  holds the furthest state (``done``: completed steps, the open one counted where applied);
  members behind (a joiner, a member whose all-reduce failed where another's succeeded) receive
  it from the first that holds it (``elastic.recovery.transfer``). It returns a ``Recovered``:
  whether the open step counts (``counted``; else it is redone on the new membership with the
  same samples: P1, P5), the new rank, world size and generation, and the cost. A group failure
  while recovering, a membership that cannot form, a coordinator gone or a state that does not
  load raise ``RecoveryFailedError`` after telling every member to fall back: the worker group
  restarts whole from the newest snapshot.
- ``close(finished)``: stop beating; ``finished`` (rank 0, last step committed): joiners restore.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic import collectives
from elastic.coord import CoordinatorClient
from elastic.faults import FaultInjector
from elastic.recovery.grad_sync import GradientSync
from elastic.recovery.group import ElasticGroup
from elastic.recovery.member import (
    FencedError,
    Member,
    MemberSettings,
    RecoveryFailedError,
)
from elastic.recovery.transfer import receive_state, send_state
from elastic.state import ModelState, OptimizerState, StateRegistry

log = logging.getLogger("baton.recovery")


@dataclass(frozen=True)
class Recovered:
    counted: bool  # the open step's update stands (else the step is redone)
    redone: int  # steps trained again: 1 when the open step is redone, else 0
    step: int  # completed steps, as every member now holds them
    rank: int
    world_size: int
    generation: int
    reason: str  # "failure" or "join"
    seconds: float  # from the failure (or the boundary) to training again
    before: int  # members before
    received: bool  # this worker received the state from a peer


class StepState:
    """What a step changes besides the model's and optimizers' tensors — every other
    component's state and each optimizer's hyper-parameters (the LR a schedule sets) — kept
    at the step's start, to put back when the step's update is not applied."""

    def __init__(self, registry: StateRegistry) -> None:
        self.saved: dict[str, Any] = {}
        for key, comp in registry.components().items():
            if isinstance(comp, ModelState):
                continue
            if isinstance(comp, OptimizerState):
                self.saved[key] = [copy.deepcopy({k: v for k, v in group.items()
                                                  if k != "params"})
                                   for group in comp.optimizer.param_groups]
            else:
                self.saved[key] = copy.deepcopy(comp.state_dict())

    def restore(self, registry: StateRegistry) -> None:
        for key, comp in registry.components().items():
            if key not in self.saved:
                continue  # registered after the step began (a loader made late)
            if isinstance(comp, OptimizerState):
                for group, saved in zip(comp.optimizer.param_groups, self.saved[key],
                                        strict=True):
                    group.update(copy.deepcopy(saved))
            else:
                comp.load_state_dict(copy.deepcopy(self.saved[key]))


class InProcessRecovery:
    """See the module docstring."""

    def __init__(self, coordinator: CoordinatorClient, *, member_id: str, order: int,
                 device: torch.device, collective_timeout_s: float,
                 settings: MemberSettings | None = None,
                 faults: FaultInjector | None = None) -> None:
        self.faults = faults or FaultInjector()
        self.group = ElasticGroup(device, collective_timeout_s)
        self.member = Member(coordinator, member_id, order, settings)
        self.group.superseded = self.member.superseded
        self.registry: StateRegistry | None = None
        self.sync: GradientSync | None = None
        self._step_state: StepState | None = None
        self._applied = False
        self._installed: Any = None
        self.recoveries: list[Recovered] = []
        self._best_done = -1  # the furthest state of the last agreement

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def generation(self) -> int:
        return self.group.generation

    @property
    def started_fresh(self) -> bool:
        return self.member.started_fresh

    @property
    def run_finished(self) -> bool:
        """`join()` found the run finished: a late replacement, nothing to train."""
        return self.member.run_finished

    # ------------------------------------------------------------------ starting

    def join(self) -> bool:
        view = self.member.join()
        if view is None:
            return False
        self._configure(view, "joining")
        self._installed = collectives.use_group(self.group)
        self._installed.__enter__()
        self.member.start_beating()
        return True

    def attach(self, model: nn.Module, registry: StateRegistry) -> None:
        self.registry = registry
        if isinstance(model, DistributedDataParallel):
            self.sync = GradientSync.attach(model, self.group)

    def receive_joined_state(self) -> dict[str, Any]:
        """A joiner: the members' state, from a live member (the skeletons it sent)."""
        skeletons = self._agree_and_transfer(done=-1)
        if skeletons is None:  # a joiner alone has nothing to receive: cannot happen
            raise self.fall_back("a joiner found no member that holds the state")
        return skeletons

    # ------------------------------------------------------------------ steps

    def begin_step(self) -> None:
        assert self.registry is not None
        self._step_state = StepState(self.registry)
        self._applied = False

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.must_recover():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None  # torch.optim skips a parameter without a gradient
            self._applied = False
        else:
            self._applied = True

    def must_recover(self) -> bool:
        return self.group.broken or self.member.superseded()

    def joiners_waiting(self) -> bool:
        return self.member.joiners_waiting()

    def recover(self, step: int, *, open_step: bool, reason: str) -> Recovered:
        """See the module docstring; ``step``: completed steps before the open one."""
        started = self.group.failed_at if self.group.broken else time.monotonic()
        before = self.group.world_size
        applied = open_step and self._applied
        if open_step and not applied and self._step_state is not None:
            assert self.registry is not None
            self._step_state.restore(self.registry)
        done = step + (1 if applied else 0)
        self.group.close()  # this generation's connections: peers still in it fail at once
        try:
            view = self.member.reform(reason)
        except FencedError as err:
            # Left out (it did not answer in time): join again; the members let it in at
            # their next step boundary and it takes their state, as a replacement does.
            log.warning("%s; joining the training group again", err)
            view = self.member.rejoin()
            done = -1
        except RecoveryFailedError as err:
            raise self.fall_back(str(err)) from err
        self.faults.hit(self.group.rank, step, "recover_formed")
        self._configure(view, "recovering")
        received = self._agree_and_transfer(done) is not None
        best_counted = self._best_done > step
        result = Recovered(counted=open_step and best_counted,
                           redone=int(open_step and not best_counted),
                           step=max(self._best_done, step),
                           rank=self.group.rank,
                           world_size=self.group.world_size,
                           generation=self.group.generation, reason=reason,
                           seconds=time.monotonic() - started, before=before,
                           received=received)
        self.recoveries.append(result)
        what = (f"step {step + 1} kept" if result.counted
                else f"step {step + 1} redone" if open_step else f"at step {step}")
        log.warning("in-process recovery (%s): generation %d, %d -> %d members, %s, %.2f s",
                    reason, result.generation, before, result.world_size, what, result.seconds)
        return result

    def close(self, finished: bool) -> None:
        if finished and self.group.rank == 0:
            try:
                self.member.finish()
            except RecoveryFailedError as err:
                log.warning("could not mark the run finished: %s", err)
        self.member.stop()
        if self._installed is not None:
            self._installed.__exit__(None, None, None)
            self._installed = None
        self.group.close()

    # ------------------------------------------------------------------ internals

    def _configure(self, view: dict[str, Any], what: str) -> None:
        try:
            self.group.configure(view["rendezvous"], int(view["rank"]), len(view["members"]),
                                 int(view["generation"]))
        except Exception as err:  # a member gone again while the group forms
            raise self.fall_back(f"the process group of generation {view['generation']} "
                                  f"did not form while {what}: {err}") from err

    def _agree_and_transfer(self, done: int) -> dict[str, Any] | None:
        """Agree who holds the furthest state; the members behind receive it. Returns the
        skeletons this member received, None if it received nothing."""
        assert self.registry is not None
        dones = [d[0] if d else -1 for d in collectives.all_gather_ints([done])]
        if self.group.broken:
            raise self.fall_back(f"a second failure while recovering: {self.group.failure}")
        best = max(dones)
        self._best_done = best
        source = dones.index(best)
        behind = [r for r, d in enumerate(dones) if d < best]
        received: dict[str, Any] | None = None
        if behind and best >= 0:
            self.faults.hit(self.group.rank, best, "recover_transfer")
            try:
                if self.group.rank == source:
                    send_state(self.group, self.registry, behind)
                elif self.group.rank in behind:
                    received = receive_state(self.group, self.registry, source)
            except Exception as err:
                raise self.fall_back(f"the state of member {source} did not load: "
                                      f"{err}") from err
        if self.group.broken:
            raise self.fall_back(f"a second failure while recovering: {self.group.failure}")
        return received

    def fall_back(self, reason: str) -> RecoveryFailedError:
        """Tell every member to end its worker; the error to raise."""
        self.member.fall_back(reason)
        return RecoveryFailedError(f"in-process recovery fell back to a group restart: "
                                   f"{reason}")
