"""`RunMonitor`: the Ray actor through which rank 0 publishes progress during a fit, and
`RunFeed`, the driver side that turns it into what the user sees.

Contract:
- One named actor per run (`baton-monitor-<run name>` in namespace `baton`), created by the
  driver on the head node. Rank 0 sends it records fire-and-forget (`add.remote`), so a step
  never waits on it; it keeps the newest record for the driver's progress line and for
  fault schedules (the demo removes a node once a step is reached), numbers every record
  it gets (`since` hands the driver those after a cursor; the newest `keep` only), writes
  everything to the run directory through `MetricsWriter`, and passes every record to the
  `[logging]` sinks it was created with (`trainer.run.sinks`: TensorBoard, MLflow; opened at
  the first record, flushed about once a second). So sinks see each record once, in order,
  whatever entry point started the fit, and training workers need no sink packages. It
  holds no training state: losing it loses only unflushed metrics. `flush()` (the end of a
  fit) writes out the metrics and closes the sinks.
- `recovered(record)`: the group re-formed in-process after a lost worker or to let a
  replacement in (`elastic.recovery`; kind "recovery": the reason, the world sizes before and
  after, whether the interrupted step was redone, the seconds it cost).
- `start_attempt(step, world_size, time, optimizer_state=None)`: a worker group began;
  `optimizer_state` says whether its restore loaded optimizer moments (None: not told; the
  driver then reads the snapshot's manifest).
- `MonitorState` is the actor's logic as a plain class (tests use it without Ray).
- `RunFeed(cfg, display)` is an `on_progress` callable for `trainer.fit`: on each call (the
  driver's poller, about once a second) it fetches the monitor's new records, notes which
  Ray nodes died or joined (`NodeWatch`), announces each worker-group start and restart as
  one line (`trainer.run.terminal.RestartTracker`) and shows the progress record. Without a
  display, events go to the `baton.fit` log. It never raises from a poll: a progress
  display must not break a fit. `close()` polls once more and ends the display.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from typing import Any

import ray

from elastic.coord import NAMESPACE
from trainer.config import FitConfig, LoggingConfig
from trainer.run import (
    MetricsWriter,
    ProgressDisplay,
    RestartTracker,
    SinkSet,
    open_sinks,
    snapshot_has_optimizer_state,
)

log = logging.getLogger("baton.fit")


class MonitorState:
    """What the `RunMonitor` actor holds and does (plain Python, so it tests without Ray)."""

    def __init__(self, run_uri: str, logging: LoggingConfig | None = None,
                 keep: int = 10_000, *, flush_sinks_every_s: float = 1.0) -> None:
        self._writer = MetricsWriter(run_uri)
        self._run_uri = run_uri
        self._logging = logging or LoggingConfig()
        self._sinks: SinkSet | None = None  # opened at the first record, closed by flush()
        self._sinks_flushed = 0.0
        self._flush_sinks_every_s = flush_sinks_every_s
        self._latest: dict[str, Any] = {}
        self._starts: list[dict[str, Any]] = []
        self._numbered: deque[tuple[int, dict[str, Any]]] = deque(maxlen=keep)
        self._count = 0

    def _keep(self, record: dict[str, Any]) -> None:
        self._count += 1
        # The data audit's sample lists stay in the metrics files, out of the driver's feed.
        self._numbered.append((self._count, {k: v for k, v in record.items() if k != "samples"}))
        self._writer.add(record)
        if self._logging.any_sink:
            self._log_to_sinks(record)

    def _log_to_sinks(self, record: dict[str, Any]) -> None:
        if self._sinks is None:
            name = self._run_uri.rstrip("/").rsplit("/", 1)[-1] or "baton-run"
            self._sinks = open_sinks(self._logging, self._run_uri, name)
        self._sinks.log([record])
        now = time.monotonic()
        if now - self._sinks_flushed >= self._flush_sinks_every_s:
            self._sinks.flush()
            self._sinks_flushed = now

    def start_attempt(self, step: int, world_size: int, time: float,
                      optimizer_state: bool | None = None) -> int:
        """A worker group began at `step` with `world_size` workers; returns its attempt id."""
        record: dict[str, Any] = {"kind": "start", "attempt": len(self._starts), "step": step,
                                  "world_size": world_size, "time": time}
        if optimizer_state is not None:
            record["optimizer_state"] = optimizer_state
        self._starts.append(record)
        self._keep(record)
        self._writer.flush()
        return record["attempt"]

    def add(self, record: dict[str, Any]) -> None:
        record = {"kind": "step", "attempt": len(self._starts) - 1, **record}
        self._latest = record
        self._keep(record)

    def recovered(self, record: dict[str, Any]) -> None:
        """The group re-formed in-process (`elastic.recovery`): the survivors trained on."""
        self._keep({"kind": "recovery", "attempt": len(self._starts) - 1,
                    "time": time.time(), **record})
        self._writer.flush()

    def latest(self) -> dict[str, Any]:
        return dict(self._latest)

    def since(self, cursor: int) -> tuple[list[dict[str, Any]], int]:
        """The records numbered above `cursor`, oldest first, and the cursor to pass next."""
        return [r for n, r in self._numbered if n > cursor], self._count

    def flush(self) -> None:
        """Everything on disk: metrics, and the sinks closed (a later record reopens them)."""
        self._writer.flush()
        if self._sinks is not None:
            self._sinks.close()
            self._sinks = None


# On the head node in a live fit (`trainer.on_ray.ray_fit` places it); tests use `MonitorState`.
RunMonitor: Any = ray.remote(num_cpus=0)(MonitorState)  # Any: Ray's actor stubs are partial


def monitor_name(cfg: FitConfig) -> str:
    """The run's monitor actor: its name and a hash of its run URI, so two runs whose
    directories share a name (two fits in one driver, two jobs on one cluster) never share a
    monitor, which would write one run's metrics into the other's directory."""
    digest = hashlib.sha256(cfg.snapshots.run_uri.encode()).hexdigest()[:12]
    return f"baton-monitor-{cfg.run_name}-{digest}"


def get_monitor(cfg: FitConfig) -> ray.actor.ActorHandle:
    """The monitor of `cfg`'s live fit; ValueError when there is none (not started yet, or
    over: `trainer.on_ray.ray_fit` ends it with its fit)."""
    return ray.get_actor(monitor_name(cfg), namespace=NAMESPACE)


class NodeWatch:
    """Which Ray nodes died or joined between two `poll()`s (their addresses)."""

    def __init__(self) -> None:
        self._alive: dict[str, str] | None = None

    def poll(self) -> tuple[list[str], list[str]]:
        alive = {n["NodeID"]: n.get("NodeManagerAddress", "?")
                 for n in ray.nodes() if n.get("Alive")}
        before, self._alive = self._alive, alive
        if before is None:
            return [], []
        lost = [address for node, address in before.items() if node not in alive]
        added = [address for node, address in alive.items() if node not in before]
        return lost, added


class RunFeed:
    """`on_progress` for `trainer.fit`: restart events and the display (module docstring)."""

    def __init__(self, cfg: FitConfig, display: ProgressDisplay | None = None) -> None:
        self.cfg = cfg
        self.display = display
        self.tracker = RestartTracker(optimizer_warm=self._optimizer_warm)
        self.nodes = NodeWatch()
        self.events: list[str] = []  # every event line shown, in order
        self._cursor = 0
        self._monitor: Any = None

    def __call__(self, record: dict[str, Any]) -> None:
        self.poll()
        if self.display is not None:
            self.display.update(record)
        elif record.get("warning"):
            log.warning("%s", record["warning"])

    def event(self, text: str) -> None:
        """Show one event line (a restart, or the demo's own node changes)."""
        self.events.append(text)
        if self.display is not None:
            self.display.event(text)
        else:
            log.info("%s", text)

    def poll(self) -> None:
        """Fetch the monitor's new records and pass them on; never raises."""
        if not ray.is_initialized():  # before the fit connected, or after it ended
            return
        try:
            if self._monitor is None:
                self._monitor = get_monitor(self.cfg)
            records, self._cursor = ray.get(self._monitor.since.remote(self._cursor),
                                            timeout=5)
            lost, added = self.nodes.poll()
        except Exception:  # noqa: BLE001 - no monitor yet, or a slow GCS: try next time
            return
        self.tracker.nodes_changed(lost, added)
        for text in self.tracker.feed(records):
            self.event(text)

    def close(self) -> None:
        """The last events shown (while the monitor still answers), display ended."""
        self.poll()
        if self.display is not None:
            self.display.close()

    def _optimizer_warm(self, step: int) -> bool | None:
        """Whether committed snapshot `step` holds optimizer moments (None: unreadable)."""
        from elastic.store import SnapshotStore

        try:
            manifest = SnapshotStore(self.cfg.snapshots.run_uri).load_manifest(step)
        except Exception:  # noqa: BLE001 - only a detail of an event line
            return None
        return snapshot_has_optimizer_state(manifest.state)
