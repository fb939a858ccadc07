"""What the terminal shows during and after a fit: number formats, restart events, progress.

Contract (no Ray, no I/O besides the console; everything here tests without a cluster):
- Number formats: `fmt_loss` (4 decimals), `fmt_duration` (`1h02m03s`, `4m05s`, `3.2s`),
  `fmt_eta` (whole seconds, `<1s`),
  `fmt_count` (thousands separators), `fmt_rate` (`12,345 tok/s`), `fmt_ratio` (`3.2x`),
  `fmt_mib`. None shows as `-`.
- `describe_restart(RestartFacts)` is a pure function of recorded facts: the previous and the
  new worker group (world size, newest step reached, committed step restored), the nodes
  seen lost or added in between, and whether the optimizer state was restored. It returns
  one line, e.g. `node 127.0.0.1 lost at step 100 → resumed on 1 worker from committed step
  100, optimizer warm, 1 step redone`.
- `RestartTracker` turns the monitor's records (oldest first) and the driver's node
  observations into those lines: each `start` record after the first is one restart.
- `progress_line(record, total, eta_s)` is the plain one-line form of a step record.
- `EtaEstimator` estimates the time left from the step rate over the last minute of driver
  clock (injected, so tests use a fake one); a restart (step going back) resets it.
- `ProgressDisplay` shows a rich progress bar on a terminal and, elsewhere (logs, CI, tests),
  one plain line per update (the driver polls about once a second), never wrapped. Events
  and warnings print as their own lines above the bar.
- `summary_rows(summary)` turns a `RunSummary.to_dict()` (plus extra keys) into
  (label, formatted value) rows; `print_summary(summary, console)` prints them as a table.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape

# ----------------------------------------------------------------------------- numbers


def fmt_loss(value: float | None) -> str:
    """A loss with 4 decimals (`2.5741`); `-` when unknown, `nan` as is."""
    if value is None:
        return "-"
    return "nan" if math.isnan(value) else f"{value:.4f}"


def fmt_duration(seconds: float | None) -> str:
    """`1h02m03s`, `4m05s`, `12.3s`, `0.25s`; `-` for unknown or negative."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    if seconds < 10:
        return f"{seconds:.2f}s" if seconds < 1 else f"{seconds:.1f}s"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def fmt_eta(seconds: float | None) -> str:
    """Time left in whole seconds (`1m05s`, `7s`, `<1s`): finer digits would only flicker."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    if seconds < 1:
        return "<1s"
    return f"{round(seconds)}s" if seconds < 10 else fmt_duration(seconds)


def fmt_count(value: float | None) -> str:
    """An integer count with thousands separators (`1,234,567`)."""
    return "-" if value is None else f"{round(value):,}"


def fmt_rate(value: float | None, unit: str = "tok/s") -> str:
    return "-" if value is None else f"{fmt_count(value)} {unit}"


def fmt_ratio(value: float | None) -> str:
    """`3.2x` (one decimal below 100, none above)."""
    if value is None:
        return "-"
    return f"{value:.1f}x" if value < 100 else f"{value:,.0f}x"


def fmt_mib(num_bytes: float | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**20:,.1f} MiB"


def fmt_ms(value_ms: float | None) -> str:
    return "-" if value_ms is None else f"{value_ms:,.1f} ms"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


# ----------------------------------------------------------------------------- restarts


@dataclass(frozen=True)
class RestartFacts:
    """What was recorded about one worker-group restart (all from records, none guessed)."""

    world_size: int  # workers of the new group
    restored_step: int  # committed step it resumed from (0: no snapshot, a fresh start)
    reached_step: int  # newest step the previous group completed
    previous_world_size: int | None = None  # workers of the previous group (None: unknown)
    lost_nodes: tuple[str, ...] = ()  # nodes seen dead since the previous group started
    added_nodes: tuple[str, ...] = ()  # nodes seen joining since then
    optimizer_warm: bool | None = None  # optimizer state restored (None: not known)

    @property
    def steps_redone(self) -> int:
        return max(0, self.reached_step - self.restored_step)


def _nodes(addresses: tuple[str, ...]) -> str:
    """`node 10.0.0.2`, `nodes 10.0.0.2, 10.0.0.3`, or `2 nodes on 127.0.0.1` (a local
    cluster runs several raylets on one address)."""
    unique = list(dict.fromkeys(addresses))
    if len(addresses) == 1:
        return f"node {addresses[0]}"
    if len(unique) == 1:
        return f"{len(addresses)} nodes on {unique[0]}"
    return f"nodes {', '.join(unique)}"


def _optimizer(warm: bool | None) -> str:
    return "" if warm is None else (", optimizer warm" if warm else ", optimizer cold")


def describe_restart(facts: RestartFacts) -> str:
    """One line: what happened (cause) → how the run resumed."""
    at = f"at step {facts.reached_step}"
    before = facts.previous_world_size
    if facts.lost_nodes:
        cause = f"{_nodes(facts.lost_nodes)} lost {at}"
    elif before is not None and facts.world_size > before:
        joined = f" ({_nodes(facts.added_nodes)} joined)" if facts.added_nodes else ""
        cause = f"scaled up from {before} to {_plural(facts.world_size, 'worker')}{joined} {at}"
    elif before is not None and facts.world_size < before:
        cause = f"scaled down from {before} to {_plural(facts.world_size, 'worker')} {at}"
    else:
        cause = f"worker group restarted {at}"
    on = f"on {_plural(facts.world_size, 'worker')}"
    if facts.restored_step == 0:
        resumed = f"restarted {on} from step 0 (nothing committed yet)"
    else:
        resumed = (f"resumed {on} from committed step {facts.restored_step}"
                   f"{_optimizer(facts.optimizer_warm)}")
    redone = _plural(facts.steps_redone, "step")
    return f"{cause} → {resumed}, {redone} redone"


def describe_start(world_size: int, restored_step: int, optimizer_warm: bool | None) -> str:
    """The first worker group of a fit."""
    on = f"on {_plural(world_size, 'worker')}"
    if restored_step == 0:
        return f"training {on} from step 0"
    return f"training {on} from committed step {restored_step}{_optimizer(optimizer_warm)}"


def snapshot_has_optimizer_state(state: dict[str, Any]) -> bool:
    """Whether a manifest's JSON state (component key -> skeleton) holds optimizer moments:
    a component shaped like torch's optimizer state dict with a non-empty `state`."""
    return any(
        isinstance(value, dict) and isinstance(value.get("param_groups"), list)
        and isinstance(value.get("state"), dict) and bool(value["state"])
        for value in state.values()
    )


@dataclass
class RestartTracker:
    """Turns records (oldest first) and node observations into event lines.

    `optimizer_warm(step)` answers whether the snapshot of committed `step` holds optimizer
    state (None: unknown); used when a start record does not say (`optimizer_state`).
    """

    optimizer_warm: Callable[[int], bool | None] = lambda step: None
    _starts: int = 0
    _world_size: int | None = None
    _reached: int = 0
    _lost: list[str] = field(default_factory=list)
    _added: list[str] = field(default_factory=list)

    def nodes_changed(self, lost: Iterable[str] = (), added: Iterable[str] = ()) -> None:
        self._lost.extend(lost)
        self._added.extend(added)

    def feed(self, records: Iterable[dict[str, Any]]) -> list[str]:
        events = []
        for record in records:
            if record.get("kind") == "start":
                events.append(self._start(record))
            elif record.get("kind") == "recovery":
                events.append(self._recovered(record))
            elif record.get("kind", "step") == "step" and isinstance(record.get("step"), int):
                self._reached = max(self._reached, record["step"])
        return events

    def _recovered(self, record: dict[str, Any]) -> str:
        """An in-process recovery (`elastic.recovery`): the survivors never stopped."""
        world_size, before = int(record["world_size"]), int(record["before"])
        at, took = f"at step {int(record['step'])}", f"{float(record['seconds']):.2f} s"
        self._world_size = world_size
        if record.get("reason") == "join":
            joined = f" ({_nodes(tuple(self._added))} joined)" if self._added else ""
            self._added.clear()
            # A replacement of a lost worker, or a worker the group grew by: both join alike.
            return (f"worker joined {at}{joined} → {_plural(world_size, 'worker')}, state "
                    f"from a live peer in {took}, the others continued in-process")
        lost = f"{_nodes(tuple(self._lost))} lost" if self._lost else "worker lost"
        self._lost.clear()
        redone = _plural(int(record.get("redone", record.get("counted") is False)), "step")
        how = ("restored the newest commit in-process" if record.get("sharded")
               else "continued in-process")
        return (f"{lost} {at} → {_plural(world_size, 'survivor')} {how} "
                f"(from {before}, re-formed in {took}), {redone} redone")

    def _start(self, record: dict[str, Any]) -> str:
        restored, world_size = int(record["step"]), int(record["world_size"])
        warm = record.get("optimizer_state")
        if warm is None and restored > 0:
            warm = self.optimizer_warm(restored)
        elif restored == 0:
            warm = False
        if self._starts == 0:
            text = describe_start(world_size, restored, warm)
        else:
            text = describe_restart(RestartFacts(
                world_size=world_size, restored_step=restored,
                reached_step=max(self._reached, restored),
                previous_world_size=self._world_size, lost_nodes=tuple(self._lost),
                added_nodes=tuple(self._added), optimizer_warm=warm,
            ))
        self._starts += 1
        self._world_size, self._reached = world_size, restored
        self._lost.clear()
        self._added.clear()
        return text


# ----------------------------------------------------------------------------- progress


class EtaEstimator:
    """Seconds left, from the step rate over the last `window_s` of driver clock."""

    def __init__(self, total: int, *, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.window_s = window_s
        self.clock = clock
        self._points: deque[tuple[float, int]] = deque()

    def update(self, step: int) -> float | None:
        now = self.clock()
        if self._points and step < self._points[-1][1]:
            self._points.clear()  # a restart went back to a committed step: new rate
        self._points.append((now, step))
        while len(self._points) > 2 and now - self._points[0][0] > self.window_s:
            self._points.popleft()
        (t0, s0), (t1, s1) = self._points[0], self._points[-1]
        if s1 <= s0 or t1 <= t0:
            return None
        return (self.total - step) / ((s1 - s0) / (t1 - t0))


def progress_line(record: dict[str, Any], total: int, eta_s: float | None) -> str:
    """The plain form: `step 120/300  loss 2.5741  val 2.6012  12,345 tok/s  workers 2
    lr 2.10e-03  last commit 120  ETA 1m05s`."""
    val = f"  val {fmt_loss(record['val_loss'])}" if record.get("val_loss") is not None else ""
    commit = record.get("last_commit")
    return (
        f"step {record['step']}/{total}  loss {fmt_loss(record['loss'])}{val}  "
        f"{fmt_rate(record.get('tokens_per_s'))}  workers {record.get('world_size', '-')}  "
        f"lr {record.get('lr', float('nan')):.2e}  "
        f"last commit {'-' if commit is None else commit}  ETA {fmt_eta(eta_s)}"
    )


class ProgressDisplay:
    """The fit's progress on `console`: a bar when it is a terminal, else plain lines.

    `update(record)` takes the driver's progress record (a step record plus `last_commit`
    and `warning`), `event(text)` prints a restart or a notice, `close()` ends the bar.
    """

    def __init__(self, total: int, console: Console, *, live: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.console = console
        self.eta = EtaEstimator(total, clock=clock)
        self.live = console.is_terminal if live is None else live
        self._bar: Any = None
        self._task: Any = None

    def _start_bar(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._bar = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console, transient=False, refresh_per_second=4,
        )
        self._task = self._bar.add_task("fit", total=self.total, info="")
        self._bar.start()

    def update(self, record: dict[str, Any]) -> None:
        eta = self.eta.update(int(record["step"]))
        if self.live:
            if self._bar is None:
                self._start_bar()
            val = (f" val {fmt_loss(record['val_loss'])}"
                   if record.get("val_loss") is not None else "")
            commit = record.get("last_commit")
            info = (f"loss {fmt_loss(record['loss'])}{val}  "
                    f"{fmt_rate(record.get('tokens_per_s'))}  "
                    f"workers {record.get('world_size', '-')}  "
                    f"commit {'-' if commit is None else commit}  ETA {fmt_eta(eta)}")
            self._bar.update(self._task, completed=record["step"], info=info)
        else:
            self._print(escape(progress_line(record, self.total, eta)))
        if record.get("warning"):
            self.warning(record["warning"])

    def event(self, text: str) -> None:
        self._print(f"[yellow]>>>[/yellow] {escape(text)}")

    def warning(self, text: str) -> None:
        self._print(f"[yellow]warning:[/yellow] {escape(text)}")

    def _print(self, markup: str) -> None:
        self.console.print(markup, highlight=False, soft_wrap=True)  # never wrap: logs are parsed

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


# ----------------------------------------------------------------------------- summary

_SUMMARY_FORMATS: dict[str, Callable[[Any], str]] = {
    "final_loss": fmt_loss,
    "final_val_loss": fmt_loss,
    "mean_tokens_per_s": fmt_rate,
    "snapshot_stall_ms_max": fmt_ms,
    "snapshot_stall_ms_mean": fmt_ms,
    "wall_time_s": fmt_duration,
    "steps": fmt_count,
    "steps_redone": fmt_count,
    "restarts": fmt_count,
    "world_sizes": lambda sizes: " → ".join(map(str, sizes)) if sizes else "-",
    "recovered_in_process": fmt_count,
    "replacements_joined": fmt_count,
    "recovery_s_max": lambda s: f"{s:.2f} s",
    "recovery_fallbacks": lambda reasons: "; ".join(reasons) if reasons else "none",
}
_SUMMARY_LABELS = {
    "mean_tokens_per_s": "mean throughput",
    "snapshot_stall_ms_max": "snapshot stall (max)",
    "snapshot_stall_ms_mean": "snapshot stall (mean)",
    "wall_time_s": "wall time",
    "world_sizes": "workers over the run",
    "recovered_in_process": "lost workers survived in-process",
    "replacements_joined": "workers joined a running group",
    "recovery_s_max": "in-process recovery (max)",
    "recovery_fallbacks": "group restarts instead, why",
}


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, formatted value) for each entry; unknown keys keep their text form."""
    rows = []
    for key, value in summary.items():
        label = _SUMMARY_LABELS.get(key, key.replace("_", " "))
        if value is None:
            text = "-"
        elif key in _SUMMARY_FORMATS:
            text = _SUMMARY_FORMATS[key](value)
        elif isinstance(value, float):
            text = f"{value:,.4g}"
        else:
            text = str(value)
        rows.append((label, text))
    return rows


def print_summary(summary: dict[str, Any], console: Console, title: str = "run summary") -> None:
    from rich.table import Table

    table = Table(title=title)
    table.add_column("what")
    table.add_column("value")
    for label, text in summary_rows(summary):
        table.add_row(escape(label), escape(text))
    console.print(table)
