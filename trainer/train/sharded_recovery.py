"""In-process recovery of a sharded (FSDP2) run of Baton's own loop: the training state starts
again from the newest commit, the processes do not.

Contract:
- `ShardedRecovery.start(cfg, context)`: when the run is FSDP2 and the worker context asks for
  in-process recovery (`recovery.in_process` and a member id, as `ElasticTorchTrainer` hands
  every worker on Ray), this worker joins the run's membership (`elastic.recovery.member`) and
  the membership's group becomes torch.distributed's default process group
  (`elastic.recovery.default_group`), over which the loop shards its model; None otherwise.
  `ShardedRecovery.finished` is true when this worker arrived after the run's last commit (a
  replacement too late): it has nothing to train.
- `run(train)` calls `train()` (one session of the loop: build, restore, train) under a worker
  context with the session's own in-process recovery off and the membership's joiners as a
  step-boundary notice, and repeats it when
  * a collective failed because a member is gone or silent (`peer_lost`): the lost shards
    exist only in the newest commit, so every survivor closes its session without committing,
    the members re-form (a new generation: a straggler of the old one is fenced, P7) and a new
    session restores that commit resharded to the new world size — the lost worker's shards
    from their RAM copies on peers, storage for any copy lost with it — and redoes the steps
    since it (P6);
  * joiners wait (the members agreed at a step boundary, committed that step and ended their
    session: `WorkerResult.rejoin`): the members re-form with them and all restore that commit,
    nothing redone. A member the others left out (silent too long: fenced) joins again so.
  Each re-forming is handed to `on_recovery` (reason, world sizes, seconds, steps redone). A
  failure while re-forming, or a membership that cannot form, raises `RecoveryFailedError`
  after telling every member to fall back (Ray Train then restarts the whole group).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from elastic.recovery import (
    FencedError,
    Member,
    MemberSettings,
    RecoveryFailedError,
    form_default_group,
    peer_lost,
)
from trainer.config import FitConfig
from trainer.train.session_setup import WorkerContext, worker_context

log = logging.getLogger("baton.recovery")


class SessionResult(Protocol):
    """What `run` needs of one session's result (`trainer.train.loop.WorkerResult`)."""

    start_step: int
    step: int
    rejoin: bool


Result = TypeVar("Result", bound=SessionResult)


class ShardedRecovery:
    """See the module docstring."""

    def __init__(self, member: Member, context: WorkerContext, backend: str,
                 timeout_s: float) -> None:
        self.member = member
        self.context = context
        self.backend = backend
        self.timeout_s = timeout_s
        self.recoveries: list[dict[str, Any]] = []
        self.reached = 0  # steps completed by the current session (the loop keeps it)
        self.finished = False  # this worker arrived after the run's last commit

    @staticmethod
    def wanted(cfg: FitConfig, context: WorkerContext | None) -> bool:
        """A sharded run whose worker context asks for in-process recovery."""
        return (cfg.parallelism == "fsdp" and context is not None
                and context.recovery is not None and context.recovery.in_process
                and context.member is not None and context.coordinator is not None)

    @classmethod
    def start(cls, cfg: FitConfig, context: WorkerContext | None) -> ShardedRecovery | None:
        if not cls.wanted(cfg, context):
            return None
        assert context is not None and context.member is not None
        assert context.recovery is not None and context.coordinator is not None
        member_id, order = context.member
        settings = MemberSettings(coordinator_s=context.recovery.coordinator_timeout_s)
        member = Member(context.coordinator, member_id, order, settings)
        recovery = cls(member, context, "nccl" if cfg.scaling.use_gpu else "gloo",
                       context.recovery.collective_timeout_s)
        view = member.join()
        if view is None:  # the run finished before this worker could join
            recovery.finished = True
            return recovery
        recovery._form(view, "joining")
        member.start_beating()
        return recovery

    def run(self, train: Callable[[], Result],
            on_recovery: Callable[[dict[str, Any]], None] | None = None) -> Result:
        try:
            while True:
                inner = dataclasses.replace(self.context, recovery=None, member=None,
                                            joiners=self.member.joiners_waiting)
                try:
                    with worker_context(inner):
                        result = train()
                except Exception as err:
                    if not (peer_lost(err) or self.member.superseded()):
                        raise
                    reason, started = "failure", time.monotonic()
                    log.warning("a member of the training group is gone (%s); restarting the "
                                "training state in-process from the newest commit",
                                " ".join(str(err).split())[:200])
                else:
                    if not result.rejoin:
                        self._finish(result.step)
                        return result
                    reason, started = "join", time.monotonic()
                self._reform(reason, started, on_recovery)
        except BaseException:
            self.member.stop()
            raise

    def _reform(self, reason: str, started: float,
                on_recovery: Callable[[dict[str, Any]], None] | None) -> None:
        before = dist.get_world_size() if dist.is_initialized() else 1
        if dist.is_initialized():
            dist.destroy_process_group()  # close its connections: peers still in it fail now
        try:
            view = self.member.reform(reason)
        except FencedError as err:
            # Left out (it did not answer in time): the others train on without it. Join
            # again, as a replacement does: let in at their next step boundary (after they
            # commit it), everyone restores that commit.
            log.warning("%s; joining the training group again", err)
            view = self.member.rejoin()
        except RecoveryFailedError as err:
            self.member.fall_back(str(err))
            raise
        if self.context.faults is not None:  # tests: a member lost while the group re-forms
            self.context.faults.hit(int(view["rank"]), self.reached, "recover_formed")
        self._form(view, "recovering")
        # The next session restores the newest commit: the steps past it are redone.
        restored = self.last_commit()
        record = {"reason": reason, "before": before, "world_size": len(view["members"]),
                  "rank": int(view["rank"]), "generation": int(view["generation"]),
                  "seconds": time.monotonic() - started, "step": restored,
                  "redone": max(0, self.reached - restored), "sharded": True}
        self.recoveries.append(record)
        if on_recovery is not None and record["rank"] == 0:
            on_recovery(dict(record))

    def _form(self, view: dict[str, Any], what: str) -> None:
        try:
            form_default_group(view, self.backend, self.timeout_s)
        except Exception as err:  # a member gone again while the group forms
            reason = (f"the process group of generation {view['generation']} did not form "
                      f"while {what}: {err}")
            self.member.fall_back(reason)
            raise RecoveryFailedError(f"in-process recovery fell back to a group restart: "
                                      f"{reason}") from err

    def last_commit(self) -> int:
        """The run's newest committed step (0 before the first)."""
        coordinator = self.context.coordinator
        assert coordinator is not None
        return max(coordinator.committed_steps(), default=0)

    def _finish(self, step: int) -> None:
        """The last step is committed (rank 0 waits for it): later joiners restore it."""
        if dist.get_rank() == 0:
            deadline = time.monotonic() + 60.0
            coordinator = self.context.coordinator
            assert coordinator is not None
            while time.monotonic() < deadline:
                if step in coordinator.committed_steps():
                    self.member.finish()
                    break
                time.sleep(0.05)
        self.member.stop()

