"""How a failed worker group restarts: after a node loss straight at the size the live
nodes can hold; after an error no restart can fix, not at all.

Why: Ray Train's elastic policy sizes a restarting worker group from the cluster view of
Ray's `AutoscalingCoordinator`, which refreshes its node list only every 20 s. Right after
a node dies that view still holds the dead node, so Ray Train first retries at the old size,
its placement group cannot be placed, and the restart waits out the worker-group start
timeout (15-60 s), sometimes twice, before it tries the size that fits.

Contract:
- `LiveNodesElasticPolicy(scaling_config)` is Ray Train's `ElasticScalingPolicy` with one
  change, in the decision for a group that is not running (a restart):
  1. it remembers the nodes the running group's workers were on; when that group fails, it
     asks each of those nodes' raylet whether it still answers (a TCP connect, `probe_s`);
  2. for a node that no longer answers but that Ray (GCS) still lists alive, it waits — no
     decision yet, at most `confirm_s` — until GCS marks it dead, so the new placement group
     is never offered to a node that is gone (Ray Train's teardown of the old group waits for
     that verdict anyway: its calls to the dead workers fail only then, so little is added);
  3. it sizes the new group from a *fresh* reservation (`get_reserved_resources(...,
     recompute=True)`: the coordinator re-reads the node table first), minus any node that
     did not answer and any node being drained (a preemption notice: Ray places nothing new
     there, so a group sized to include it waits out the start timeout, again and again).
     Then Ray Train's own counting and `min_workers` rule decide as usual.
  A failure on healthy nodes (every raylet answers) is not delayed. For a running group
  (scale-up) Ray Train decides, on a fresh reservation too, read once per its resize check
  (`scaling.resize_interval_s`), less draining nodes the group does not run on: with the
  coordinator's cached view a node that joined was used only up to 20 s later (a run at 1
  worker often ended before it grew), and a draining node would be grown onto and wait out
  the start timeout. (Draining nodes the group runs on are the preemption path's: counted.)
- `FatalAwareFailurePolicy(failure_config)` is Ray Train's `DefaultFailurePolicy` with two
  changes: a worker-group error in which any worker raised `elastic.errors.FatalRunError` (an
  error no restart can fix: a corrupt dataset, a recipe that disagrees with the run it
  continues, a worker on other code) is RAISEd at once, without a retry; and a group that
  stopped on a preemption notice after committing its snapshot (`trainer.session.PreemptedError`)
  is charged to `max_preemption_failures`, as Ray Train charges its own preemptions, not to
  `max_failures` (it lost no work). Everything else is Ray Train's decision. When it RAISEs,
  it writes its verdict (restarts so far, fatal or not, the worker's message) into the
  error Ray Train hands the driver.
- `BatonTorchTrainer` is `TorchTrainer` with those policies in place of Ray Train's default
  ones (a fixed size keeps Ray Train's fixed scaling policy). Its `fit()` raises
  `RunFailedError` (a `TrainingFailedError`) whose message is one line: the worker's
  message and the number of restarts.

It uses Ray Train V2 internals (`ElasticScalingPolicy`, `DefaultFailurePolicy`, the
`_initialize_and_run_controller` hook, the coordinator's `recompute` flag), hence the pinned
Ray range (>=2.60,<2.61); `tests/test_trainer_scaling.py` pins the parts it relies on and tests
the decisions on fake cluster states; `tests/test_trainer_elastic.py` checks the restart time
on a real node loss; `tests/test_trainer_failures.py` tests the failure decisions.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray.train.v2._internal.execution.failure_handling import (
    DefaultFailurePolicy,
    FailureDecision,
    FailurePolicy,
)
from ray.train.v2._internal.execution.scaling_policy import (
    ElasticScalingPolicy,
    NoopDecision,
    ResizeDecision,
    ScalingDecision,
)
from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
    AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
)
from ray.train.v2.api.config import FailureConfig, ScalingConfig
from ray.train.v2.api.exceptions import TrainingFailedError, WorkerGroupError
from ray.train.v2.torch.torch_trainer import TorchTrainer  # Train V2 (what ray.train.torch gives)

from elastic.errors import FatalRunError

# Under "ray.train" so the lines land in Ray Train's controller log, next to its decisions.
logger = logging.getLogger("ray.train.baton_scaling")

NodeTable = Callable[[], list[dict[str, Any]]]  # like `ray.nodes()`
Probe = Callable[[str, int, float], bool]  # (address, port, timeout_s) -> answers
Reservation = dict[str, dict[str, float]]  # node id -> resources reserved to this run


def raylet_answers(address: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts TCP connections at the node's raylet port. A live raylet
    always does, however busy (the kernel answers); a killed one refuses, a vanished machine
    times out."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class LiveNodesElasticPolicy(ElasticScalingPolicy):
    # How often to re-read GCS while waiting for it to confirm a node death.
    CONFIRM_POLL_S = 0.2

    def __init__(
        self,
        scaling_config: ScalingConfig,
        *,
        probe_s: float = 1.0,
        confirm_s: float = 60.0,
        node_table: NodeTable | None = None,
        probe: Probe = raylet_answers,
        fresh_reservation: Callable[[], Reservation | None] | None = None,
        draining_nodes: Callable[[], Iterable[str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(scaling_config)
        self.probe_s = probe_s
        self.confirm_s = confirm_s
        self._node_table = node_table or ray.nodes
        self._probe = probe
        self._fresh_reservation = fresh_reservation or self._recomputed_reservation
        self._draining_nodes = draining_nodes or _draining_in_gcs
        self._clock = clock
        self._sleep = sleep
        self._group_nodes: set[str] = set()  # nodes of the group that ran last
        self._lost: set[str] | None = None  # of those, nodes that no longer answer
        self._confirm_deadline = 0.0
        self._restarting = False  # inside a decision for a group that is not running
        self._last_fresh = float("-inf")  # when the last fresh reservation was read

    # ------------------------------------------------------------------ Ray Train's hooks

    def make_decision_for_running_worker_group(
        self, worker_group_state: Any, worker_group_status: Any
    ) -> ScalingDecision:
        self._group_nodes = {w.metadata.node_id for w in worker_group_state.workers}
        self._lost = None
        return super().make_decision_for_running_worker_group(
            worker_group_state, worker_group_status
        )

    def make_decision_for_non_running_worker_group(self) -> ScalingDecision:
        if self._group_nodes and self._lost is None:
            # The group that ran has just failed: find out once whether it lost nodes.
            self._lost = self._unanswering(self._group_nodes)
            self._confirm_deadline = self._clock() + self.confirm_s
            self._last_fresh = float("-inf")  # Ray Train's cached view predates the failure
            if self._lost:
                logger.info("Baton: node(s) %s of the failed group no longer answer; "
                            "restarting without them", sorted(self._lost))
        lost = self._lost or set()
        unconfirmed = lost & self._alive_in_gcs() if lost else set()
        if unconfirmed and self._clock() < self._confirm_deadline:
            self._sleep(self.CONFIRM_POLL_S)
            return NoopDecision()
        self._restarting = True
        try:
            decision = super().make_decision_for_non_running_worker_group()
        finally:
            self._restarting = False
        if isinstance(decision, ResizeDecision):
            self._group_nodes, self._lost = set(), None
        return decision

    def _get_reserved_resources(self) -> Reservation | None:
        """A fresh view (at most once per Ray Train's query interval). For a restart, less the
        nodes that stopped answering (GCS may not know yet if `confirm_s` ran out) and the
        nodes being drained; for a running group (reached once per resize check), less the
        draining nodes it does not run on."""
        now = self._clock()
        if now - self._last_fresh < self.GET_RESERVED_RESOURCES_INTERVAL_S:
            return self._latest_reserved_resources
        self._last_fresh = now
        reserved = self._fresh_reservation()
        if reserved is not None:
            draining = set(self._draining_nodes())
            if self._restarting:
                left_out = (self._lost or set()) | draining
            else:
                left_out = draining - self._group_nodes
            reserved = {node: res for node, res in reserved.items() if node not in left_out}
        self._latest_reserved_resources = reserved
        return reserved

    # ------------------------------------------------------------------ the cluster

    def _recomputed_reservation(self) -> Reservation | None:
        try:
            return ray.get(
                self._autoscaling_coordinator.get_reserved_resources.remote(
                    self._requester_id, recompute=True
                ),
                timeout=AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
            )
        except Exception:  # noqa: BLE001 - as Ray Train's own query: no decision this round
            logger.warning("Baton: could not get a fresh reservation", exc_info=True)
            return None

    def _alive_in_gcs(self) -> set[str]:
        return {n["NodeID"] for n in self._node_table() if n.get("Alive")}

    def _unanswering(self, node_ids: Iterable[str]) -> set[str]:
        """Nodes among `node_ids` that GCS lists dead or whose raylet does not answer."""
        table = {n["NodeID"]: n for n in self._node_table()}
        alive = [table[i] for i in node_ids if i in table and table[i].get("Alive")]
        lost = {i for i in node_ids if i not in table or not table[i].get("Alive")}
        if alive:
            with ThreadPoolExecutor(max_workers=min(32, len(alive))) as pool:
                answers = pool.map(
                    lambda n: self._probe(n["NodeManagerAddress"], int(n["NodeManagerPort"]),
                                          self.probe_s),
                    alive,
                )
                lost |= {n["NodeID"] for n, ok in zip(alive, answers, strict=True) if not ok}
        return lost


def _draining_in_gcs() -> set[str]:
    """Nodes GCS lists as being drained (what Ray Train's own preemption watcher reads)."""
    try:
        return set(ray._private.state.state.get_draining_nodes() or {})
    except Exception:  # noqa: BLE001 - no answer: leave nothing out, as before
        logger.warning("Baton: could not read the draining nodes", exc_info=True)
        return set()


# -------------------------------------------------------------------------- failures

# How the worker's own error looks in the traceback text Ray Train keeps of it: the fallback
# when the exception object itself did not survive (a class the controller could not load).
_FATAL_IN_TRACEBACK = re.compile(r"^(?:elastic\.errors\.)?FatalRunError: (.+)$", re.MULTILINE)
# The line the policy writes into the error it RAISEs (read back by `run_failed_error`).
_VERDICT_MARK = "[baton-verdict] "
_MESSAGE_CHARS = 500  # the driver prints one line: long worker messages are cut


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _MESSAGE_CHARS else line[: _MESSAGE_CHARS - 3] + "..."


def _is_a(error: BaseException, module: str, name: str) -> bool:
    """Whether `error` is an instance of the class `module.name`, by name: the controller may
    hold the class under another identity (or not import its module at all)."""
    return any(c.__module__ == module and c.__qualname__ == name for c in type(error).__mro__)


def _worker_errors(error: TrainingFailedError) -> list[BaseException]:
    """The per-rank worker exceptions (Ray Train has already unwrapped its traceback holder),
    rank order, each followed by its cause/context chain where that survived."""
    if not isinstance(error, WorkerGroupError):
        return []
    found: list[BaseException] = []
    for _, exc in sorted(error.worker_failures.items()):
        seen: BaseException | None = exc
        while seen is not None and seen not in found:
            found.append(seen)
            seen = seen.__cause__ or seen.__context__
    return found


def fatal_message(error: TrainingFailedError) -> str | None:
    """The message of the first `FatalRunError` a worker raised, or None if none did."""
    for exc in _worker_errors(error):
        if isinstance(exc, FatalRunError) or _is_a(exc, "elastic.errors", "FatalRunError"):
            return _one_line(str(exc))
    if isinstance(error, WorkerGroupError):
        found = _FATAL_IN_TRACEBACK.search(str(error))
        if found:
            return _one_line(found.group(1))
    return None


def stopped_on_preemption_notice(error: TrainingFailedError) -> bool:
    """Whether a worker stopped on a preemption notice after committing its snapshot."""
    return any(_is_a(e, "trainer.session", "PreemptedError") for e in _worker_errors(error))


def last_error_message(error: TrainingFailedError) -> str:
    """One line naming the first worker's error (rank order), else Ray Train's own message."""
    errors = _worker_errors(error)
    if errors:
        exc = errors[0]
        return _one_line(f"{type(exc).__name__}: {exc}")
    if hasattr(error, "controller_failure"):
        exc = error.controller_failure
        return _one_line(f"Ray Train controller: {type(exc).__name__}: {exc}")
    return _one_line(str(error))


class RunFailedError(TrainingFailedError):
    """A fit gave up. `str()` is one line for the driver: the worker's message and the
    number of worker-group restarts before giving up (`restarts`; None if unknown)."""

    def __init__(self, message: str, *, restarts: int | None, fatal: bool,
                 max_failures: int | None = None) -> None:
        self.message, self.restarts, self.fatal = message, restarts, fatal
        self.max_failures = max_failures
        count = "an unknown number of" if restarts is None else str(restarts)
        if fatal:
            line = f"{message} (after {count} restarts)"
        else:
            limit = "" if max_failures is None else f" (scaling.max_failures = {max_failures})"
            line = f"gave up after {count} restarts{limit}; last error: {message}"
        super().__init__(line)

    def __reduce__(self) -> tuple[Any, ...]:  # keep the keyword-only fields through Ray
        return (_rebuild_run_failed, (self.message, self.restarts, self.fatal, self.max_failures))


def _rebuild_run_failed(message: str, restarts: int | None, fatal: bool,
                        max_failures: int | None) -> RunFailedError:
    return RunFailedError(message, restarts=restarts, fatal=fatal, max_failures=max_failures)


def run_failed_error(error: TrainingFailedError) -> RunFailedError:
    """The one-line `RunFailedError` for what `TorchTrainer.fit` raised: from the verdict
    `FatalAwareFailurePolicy` wrote into it, else from the error itself."""
    for line in str(error).splitlines():
        if line.startswith(_VERDICT_MARK):
            try:
                verdict = json.loads(line[len(_VERDICT_MARK):])
                return RunFailedError(
                    str(verdict["message"]), restarts=int(verdict["restarts"]),
                    fatal=bool(verdict["fatal"]), max_failures=verdict.get("max_failures"),
                )
            except (ValueError, KeyError, TypeError):
                break  # not ours after all: describe the error itself
    fatal = fatal_message(error)
    return RunFailedError(fatal or last_error_message(error), restarts=None,
                          fatal=fatal is not None)


class FatalAwareFailurePolicy(FailurePolicy):
    """Ray Train's failure policy, except that a `FatalRunError` on any worker RAISEs at once
    and a stop on a preemption notice is charged to the preemption budget (module doc)."""

    def __init__(self, failure_config: FailureConfig,
                 inner: FailurePolicy | None = None) -> None:
        super().__init__(failure_config)
        self._inner = inner or DefaultFailurePolicy(failure_config)
        self.restarts = 0  # RETRY decisions so far: the worker-group restarts of this fit
        self._preemptions = 0

    def make_decision(self, training_failed_error: TrainingFailedError) -> FailureDecision:
        error = training_failed_error
        fatal = fatal_message(error)
        if fatal is not None:
            # Deterministic: the next attempt would fail the same way, forever under
            # max_failures = -1. Fail once, with the worker's words.
            logger.error("Baton: a worker hit an error no restart can fix; failing the run: %s",
                         fatal)
            decision = FailureDecision.RAISE
        elif stopped_on_preemption_notice(error):
            self._preemptions += 1
            limit = self.failure_config.max_preemption_failures
            decision = (FailureDecision.RETRY if limit == -1 or self._preemptions <= limit
                        else FailureDecision.RAISE)
            logger.info("Baton: worker group stopped on a preemption notice (%d of %s): %s",
                        self._preemptions, "unlimited" if limit == -1 else limit,
                        decision.value)
        else:
            decision = self._inner.make_decision(error)
        if decision == FailureDecision.RETRY:
            self.restarts += 1
        elif decision == FailureDecision.RAISE:
            self._write_verdict(error, fatal)
        return decision

    def _write_verdict(self, error: TrainingFailedError, fatal: str | None) -> None:
        """Put the verdict in the error Ray Train hands the driver. Only a WorkerGroupError
        carries it: its message travels (its `__reduce__` keeps `_error_message`)."""
        if not isinstance(error, WorkerGroupError):
            return
        verdict = {
            "restarts": self.restarts,
            "fatal": fatal is not None,
            "message": fatal if fatal is not None else last_error_message(error),
            "max_failures": None if fatal is not None else self.failure_config.max_failures,
        }
        error._error_message = (
            f"{_VERDICT_MARK}{json.dumps(verdict)}\n{error._error_message}"
        )
        error.args = (f"Training failed due to worker errors:\n{error._error_message}",)


class BatonTorchTrainer(TorchTrainer):
    """`TorchTrainer` whose elastic restarts size the group from the nodes still alive, whose
    fatal worker errors fail the run once, and whose `fit()` raises a one-line
    `RunFailedError`."""

    def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
        policy = controller_init_kwargs.get("scaling_policy")
        if type(policy) is ElasticScalingPolicy:
            controller_init_kwargs["scaling_policy"] = LiveNodesElasticPolicy(policy.scaling_config)
        failures = controller_init_kwargs.get("failure_policy")
        if type(failures) is DefaultFailurePolicy:
            controller_init_kwargs["failure_policy"] = FatalAwareFailurePolicy(
                failures.failure_config
            )
        return super()._initialize_and_run_controller(**controller_init_kwargs)

    def fit(self) -> Any:
        try:
            return super().fit()
        except RunFailedError:
            raise
        except TrainingFailedError as err:
            raise run_failed_error(err) from err
