"""`RunMonitor`: the Ray actor through which rank 0 publishes progress during a fit.

Contract: one named actor per run (`baton-monitor-<run name>` in namespace `baton`), created
by the driver. Rank 0 sends it records fire-and-forget (`add.remote`), so a step never waits
on it; it keeps the newest records for the driver's progress line and for fault schedules
(the demo removes a node once a step is reached), and writes everything to the run
directory through `MetricsWriter`. It holds no training state: losing it loses only
unflushed metrics.
"""

from __future__ import annotations

from typing import Any

import ray

from trainer.metrics import MetricsWriter

NAMESPACE = "baton"


@ray.remote(num_cpus=0)
class RunMonitor:
    def __init__(self, run_uri: str) -> None:
        self._writer = MetricsWriter(run_uri)
        self._latest: dict[str, Any] = {}
        self._starts: list[dict[str, Any]] = []

    def start_attempt(self, step: int, world_size: int, time: float) -> int:
        """A worker group began at `step` with `world_size` workers; returns its attempt id."""
        record = {"kind": "start", "attempt": len(self._starts), "step": step,
                  "world_size": world_size, "time": time}
        self._starts.append(record)
        self._writer.add(record)
        self._writer.flush()
        return record["attempt"]

    def add(self, record: dict[str, Any]) -> None:
        record = {"kind": "step", "attempt": len(self._starts) - 1, **record}
        self._latest = record
        self._writer.add(record)

    def latest(self) -> dict[str, Any]:
        return dict(self._latest)

    def flush(self) -> None:
        self._writer.flush()


def monitor_name(run_name: str) -> str:
    return f"baton-monitor-{run_name}"


def get_monitor(run_name: str) -> ray.actor.ActorHandle:
    return ray.get_actor(monitor_name(run_name), namespace=NAMESPACE)
