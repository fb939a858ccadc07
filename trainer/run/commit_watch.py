"""What the driver says about snapshots: stale-commit warnings and the final-commit check.

Contract (pure functions of the coordinator's `health()` and the training step; no Ray, no
clock, so they test on plain data):
- `CommitWatch(snapshot_every).check(step, health)` returns a warning line once per stale
  episode: when training is `STALE_INTERVALS` snapshot intervals past the newest committed
  snapshot (or past the step it started from), naming the newest commit and the workers'
  most recent failure reason since that commit (ENOSPC, permission, storage unreachable, a
  fenced driver; an older one was overcome and is only mentioned as coming before it).
  If no cause was known when it warned (the failing write had not reported yet: persists
  run behind training), it warns once more when one is. It returns None otherwise, and
  re-arms once a new snapshot commits.
- `final_commit_error(health, steps)` returns why a run that trained to `steps` has no
  committed snapshot of that step (the driver then exits non-zero), or None when it has.
"""

from __future__ import annotations

from typing import Any

# Warn when this many snapshot intervals have passed without a commit.
STALE_INTERVALS = 3


class FinalCommitError(RuntimeError):
    """The run trained to its last step but could not commit a snapshot of it."""


def cause_known(health: dict[str, Any], since: int | None) -> bool:
    """A fenced driver, or a worker failure after the newest commit `since`."""
    return bool(health.get("fenced")) or any(
        since is None or f.get("step", 0) > since for f in health.get("failures") or [])


def last_reason(health: dict[str, Any]) -> str:
    """The newest failure after the newest commit; one from before it was overcome (a
    snapshot committed after it), so it is only mentioned as such."""
    if health.get("fenced"):
        return f"this driver is fenced: {health['fenced']}"
    latest = health.get("latest")
    failures = health.get("failures") or []
    recent = [f for f in failures if latest is None or f.get("step", 0) > latest]
    if recent:
        return _failure(recent[-1])
    if failures:
        return (f"no worker reported an error since the newest commit (a rank may be stuck "
                f"or slow; the last one, before it: {_failure(failures[-1])})")
    return "no worker reported an error (a rank may be stuck or slow)"


def _failure(f: dict[str, Any]) -> str:
    where = f" on {f['where']}" if f.get("where") else ""
    who = "the coordinator" if f.get("rank", 0) < 0 else f"rank {f['rank']}"
    return f"{who}{where} at step {f['step']}: {f['reason']}"


class CommitWatch:
    def __init__(self, snapshot_every: int, start_step: int = 0) -> None:
        self.snapshot_every = snapshot_every
        self.start_step = start_step
        self._warned_since: int | None = None  # the newest commit when we last warned
        self._warned_cause = False  # whether that warning could name a cause

    def check(self, step: int, health: dict[str, Any]) -> str | None:
        latest = health.get("latest")
        since = latest if latest is not None else self.start_step
        if step - since < STALE_INTERVALS * self.snapshot_every:
            return None
        cause = cause_known(health, latest)
        if self._warned_since == since and (self._warned_cause or not cause):
            return None
        self._warned_since, self._warned_cause = since, cause
        newest = f"step {latest}" if latest is not None else "none yet"
        return (f"no snapshot has committed for {step - since} steps (newest commit: {newest}; "
                f"snapshots.snapshot_every = {self.snapshot_every}); {last_reason(health)}")


def final_commit_error(health: dict[str, Any], steps: int) -> str | None:
    if health.get("latest") == steps:
        return None
    latest = health.get("latest")
    newest = f"step {latest}" if latest is not None else "no snapshot"
    return (f"training reached step {steps} but its snapshot did not commit (newest commit: "
            f"{newest}); {last_reason(health)}. Fix the cause and run the same command again: "
            f"it continues from {newest}")
