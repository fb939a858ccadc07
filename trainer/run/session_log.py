"""Training in sessions: the session log, the schedule a run was trained with, time budgets.

Contract:
- A run is trained in one or more *sessions* (one `baton fit` each). The driver appends one
  entry per session to `RUN/sessions.json` (`begin_session`, under the run lease) and closes
  it with its outcome (`end_session`: `finished`, `stopped`, `aborted` or `failed`, and the
  newest committed step). The file is plain JSON, rewritten whole (atomic on local disk, one
  PUT on S3), and untrusted when read: an unreadable file, or an entry without a valid
  `from_step` and `schedule`, is ignored (logged), never a crash; doubt never refuses.
- The schedule a run was trained with (`saved_schedule`, `schedule_changes`, the reading of
  the log, `read_sessions`) is `trainer.train.continuation`'s, where the check that refuses
  a changed schedule lives; it is refused unless asked (`--reschedule`, or
  `accept_schedule(cfg)` from Python, which records the recipe's schedule as the run's from
  its newest committed step, under the run lease: `LeaseHeldError` while a driver trains the
  run).
- `parse_duration("2h30m")` reads `--time-limit`: one or more of `<number>h`, `<number>m`,
  `<number>s` in that order (e.g. `2h30m`, `45m`, `90s`, `1.5h`); anything else, or zero, is
  a `ValueError` with one line naming the flag and the accepted forms.
- `TimeBudget` decides when a time-limited session must ask its workers to stop so that the
  final snapshot commits inside the limit. Rule: stop once the time left is at most
  `2 * (step_s + commit_s) + margin_s`, where `step_s` is the longest time per step seen
  over the last 20 progress records (the step in flight must finish), `commit_s` the longest
  delay seen between a step's end and the driver seeing it committed (the final commit;
  `default_commit_s` until one was seen) and `margin_s` covers the workers' shut-down. The
  factor 2 absorbs a slower-than-usual step or commit. Time is injected (`clock`, `wall`).
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from elastic.store import SnapshotStore
from trainer.config import FitConfig
from trainer.train import SESSIONS_NAME, bounded_number, read_sessions, schedule_of

SESSIONS_VERSION = 1
OUTCOMES = ("finished", "stopped", "aborted", "failed")


# ---------------------------------------------------------------------- durations

_DURATION_RE = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")


def parse_duration(text: str, flag: str = "--time-limit") -> float:
    """Seconds in `text` (`2h30m`, `45m`, `90s`, `1.5h`); `ValueError` naming `flag` else."""
    match = _DURATION_RE.fullmatch(text.strip().lower())
    if not text.strip() or match is None or not any(match.groups()):
        raise ValueError(f"{flag} {text!r}: expected a duration such as 2h30m, 45m or 90s "
                         "(hours h, minutes m, seconds s, in that order)")
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise ValueError(f"{flag} {text!r}: must be longer than zero")
    return total


# ---------------------------------------------------------------------- the session log

def _write_sessions(store: SnapshotStore, entries: list[dict[str, Any]]) -> None:
    store.write_json(store.path(SESSIONS_NAME),
                     {"version": SESSIONS_VERSION, "sessions": entries})


def begin_session(store: SnapshotStore, cfg: FitConfig, from_step: int, *,
                  rescheduled: bool = False, forked_from: str | None = None,
                  clock: Callable[[], float] = time.time) -> None:
    """Append this session's entry (the driver holds the run lease)."""
    entry: dict[str, Any] = {"from_step": from_step, "started_at": clock(),
                             "schedule": schedule_of(cfg), "rescheduled": rescheduled,
                             "outcome": None}
    if forked_from is not None:
        entry["forked_from"] = forked_from
    _write_sessions(store, [*read_sessions(store), entry])


def end_session(store: SnapshotStore, outcome: str, step: int | None, *,
                clock: Callable[[], float] = time.time) -> None:
    """Close the newest entry with its outcome and the newest committed step."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
    entries = read_sessions(store)
    if not entries:
        return
    entries[-1].update(outcome=outcome, ended_at=clock(), step=step)
    _write_sessions(store, entries)


def accept_schedule(cfg: FitConfig) -> str:
    """Python API twin of `baton fit --reschedule`: record the recipe's schedule as the run's
    from its newest committed step, so `trainer.fit(cfg)` continues with it; returns what the
    schedule does from there (one line)."""
    from elastic.lease import held_lease
    from trainer.train import describe_schedule

    store = SnapshotStore(cfg.snapshots.run_uri)
    # Under the run lease, as a driver writes the log: while one trains this raises
    # LeaseHeldError (naming it), instead of closing that driver's entry as its own.
    # Not renewed: two small writes end well within the lease's ttl.
    with held_lease(store, renew=False):
        step = max(store.committed_steps(), default=0)
        begin_session(store, cfg, step, rescheduled=True)
        end_session(store, "stopped", step)  # recorded only; the fit that follows opens its own
    return describe_schedule(cfg.optim, cfg.steps, step)


# ---------------------------------------------------------------------- time budgets

class TimeBudget:
    """Whether a time-limited session must stop now (rule: module contract)."""

    def __init__(self, limit_s: float, *, margin_s: float = 10.0,
                 default_commit_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.clock, self.wall = clock, wall
        self.deadline = clock() + limit_s
        self.margin_s, self.default_commit_s = margin_s, default_commit_s
        self._per_step: deque[float] = deque(maxlen=20)
        self._last: tuple[int, float] | None = None  # (step, its end time)
        self._ended: dict[int, float] = {}  # step -> end time, until seen committed
        self._commit_s: float | None = None

    def observe(self, record: dict[str, Any]) -> None:
        """Feed one progress record (`step`, `time` of its end, `last_commit`)."""
        step, ended = record.get("step"), record.get("time")
        if (not isinstance(step, int) or not isinstance(ended, int | float)
                or not bounded_number(ended)):
            return
        ended = float(ended)
        if self._last is not None and step > self._last[0]:
            self._per_step.append((ended - self._last[1]) / (step - self._last[0]))
        self._last = (step, ended)
        self._ended[step] = ended
        committed = record.get("last_commit")
        if isinstance(committed, int):
            seen = [s for s in self._ended if s <= committed]
            if seen:
                # From the end of the newest step seen at or before the commit: at most one
                # poll interval more than the true delay (polls may skip steps).
                delay = max(0.0, self.wall() - self._ended[max(seen)])
                self._commit_s = max(self._commit_s or 0.0, delay)
                for s in seen:
                    del self._ended[s]

    def reserve_s(self) -> float:
        step_s = max(self._per_step, default=0.0)
        commit_s = self.default_commit_s if self._commit_s is None else self._commit_s
        return 2 * (step_s + commit_s) + self.margin_s

    def left_s(self) -> float:
        return self.deadline - self.clock()

    def due(self) -> bool:
        return self.left_s() <= self.reserve_s()
