"""Why a worker group failed, and whether to restart it: an error no restart can fix fails
the run once, with the worker's words.

Contract:
- `FatalAwareFailurePolicy(failure_config)` is Ray Train's `DefaultFailurePolicy` with two
  changes: a worker-group error in which any worker raised `elastic.errors.FatalRunError` (an
  error no restart can fix: a corrupt dataset, a recipe that disagrees with the run it
  continues, a worker on other code) is RAISEd at once, without a retry; and a group that
  stopped on a preemption notice after committing its snapshot
  (`trainer.train.session.PreemptedError`) is charged to `max_preemption_failures`, as Ray
  Train charges its own preemptions, not to
  `max_failures` (it lost no work); and a worker group that could not start (Ray Train's
  `WorkerGroupStartupTimeoutError` / `WorkerGroupStartupFailedError`, which Ray Train
  retries forever by default) is charged to `max_failures` with the worker-group failures,
  and logged with the count. Everything else is Ray Train's decision. When it RAISEs,
  it writes its verdict (restarts so far, fatal or not, the worker's message) into the
  error Ray Train hands the driver.
- `StartReport` (a controller callback) logs, before each worker-group start, what the
  controller waits for and for how long: the workers, their resources, the start timeout.
- `fatal_message(error)`, `stopped_on_preemption_notice(error)`, `last_error_message(error)`
  read a `TrainingFailedError` (each worker's exception, its cause chain, else the traceback
  text Ray Train kept); messages are one line, at most `_MESSAGE_CHARS`.
- `RunFailedError` is what `BatonTorchTrainer.fit()` (`scaling.py`) raises, and
  `run_failed_error(error)` builds it from the verdict the policy wrote, else from the error.

It subclasses Ray Train V2 internals (`DefaultFailurePolicy`, `FailurePolicy`), hence the
pinned Ray range; `tests/ray/test_trainer_failures.py` tests the decisions.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

from ray.train.v2._internal.constants import (
    DEFAULT_WORKER_GROUP_START_TIMEOUT_S,
    WORKER_GROUP_START_TIMEOUT_S_ENV_VAR,
)
from ray.train.v2._internal.exceptions import (
    WorkerGroupStartupFailedError,
    WorkerGroupStartupTimeoutError,
)
from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2._internal.execution.failure_handling import (
    DefaultFailurePolicy,
    FailureDecision,
    FailurePolicy,
)
from ray.train.v2._internal.execution.scaling_policy import ResizeDecision
from ray.train.v2.api.config import FailureConfig
from ray.train.v2.api.exceptions import ControllerError, TrainingFailedError, WorkerGroupError

from elastic.errors import FatalRunError

# Under "ray.train" so the lines land in Ray Train's controller log, next to its decisions.
logger = logging.getLogger("ray.train.baton_scaling")

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


def start_failure(error: TrainingFailedError) -> bool:
    """Whether the worker group could not start (placement or start-up timed out/failed)."""
    return isinstance(error, ControllerError) and isinstance(
        error.controller_failure, (WorkerGroupStartupTimeoutError, WorkerGroupStartupFailedError))


def start_timeout_s() -> float:
    """How long Ray Train waits for a worker group to start (its environment variable)."""
    return float(os.environ.get(WORKER_GROUP_START_TIMEOUT_S_ENV_VAR,
                                DEFAULT_WORKER_GROUP_START_TIMEOUT_S))


def stopped_on_preemption_notice(error: TrainingFailedError) -> bool:
    """Whether a worker stopped on a preemption notice after committing its snapshot."""
    return any(_is_a(e, "trainer.train.session", "PreemptedError") for e in _worker_errors(error))


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
        self.start_failures = 0  # worker groups that could not start

    def make_decision(self, training_failed_error: TrainingFailedError) -> FailureDecision:
        error = training_failed_error
        fatal = fatal_message(error)
        if fatal is not None:
            # Deterministic: the next attempt would fail the same way, forever under
            # max_failures = -1. Fail once, with the worker's words.
            logger.error("Baton: a worker hit an error no restart can fix; failing the run: %s",
                         fatal)
            decision = FailureDecision.RAISE
        elif start_failure(error):
            decision = self._decide_start_failure(error)
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

    def _decide_start_failure(self, error: TrainingFailedError) -> FailureDecision:
        """Charged to `max_failures`, with the worker-group failures Ray Train counted: a
        group that cannot start (a fixed size after a node loss, resources the cluster
        lacks) must not be retried forever in silence."""
        self.start_failures += 1
        # Ray Train's own count of worker-group failures (a pinned internal: see the tests).
        failures = self.start_failures + int(getattr(self._inner, "_worker_group_failures", 0))
        limit = self.failure_config.max_failures
        decision = (FailureDecision.RETRY if limit == -1 or failures <= limit
                    else FailureDecision.RAISE)
        reason = _one_line(str(getattr(error, "controller_failure", error))).split(". ")[0]
        logger.warning("Baton: the worker group did not start (%s); failure %d of "
                       "max_failures=%s: %s", reason, failures,
                       "unlimited" if limit == -1 else limit,
                       "retrying" if decision == FailureDecision.RETRY else "giving up")
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


class StartReport(ControllerCallback):
    """Before each worker-group start, one line: what the controller now waits for, and for
    how long (a start that cannot be placed otherwise waits in silence)."""

    def before_controller_execute_resize_decision(self, decision: ResizeDecision) -> None:
        resources = ", ".join(f"{k}: {v:g}" for k, v in
                              sorted(decision.resources_per_worker.items()))
        logger.info("Baton: starting a worker group of %d worker(s) ({%s} each); waiting up "
                    "to %g s for Ray to place and start them (%s)", decision.num_workers,
                    resources, start_timeout_s(), WORKER_GROUP_START_TIMEOUT_S_ENV_VAR)
