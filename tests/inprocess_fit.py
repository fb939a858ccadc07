"""`baton fit` without Ray, for the session and fork tests.

`InProcessFit(world_size)` stands in for `trainer.on_ray.ray_fit.fit` (monkeypatched): it runs the
real worker loop (`trainer.train.loop.run_worker`) on `world_size` gloo processes (or in this
process for 1), with the real pre-flight (`check_run_dir`, where the real fit runs it), the
real metrics files and the real snapshots; only Ray's placement and restarts are left out.
`until` is passed to the loop as its planned stop; `stop` (the Ctrl-C / time-limit event) is
honoured before training starts: when `wait_for_stop` is set, the fake waits for the event
and then trains to `stop_step` only, as the workers would stop at their next step boundary.

The `fake_fit` fixture (conftest.py) puts one in place of Ray's fit; `baton(capsys, argv)`
runs the CLI and returns its exit code and its output as one line (rich may wrap).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import run_group
from trainer.cli import main
from trainer.config import FitConfig
from trainer.run.metrics import MetricsWriter, read_records, summarize
from trainer.run.preflight import ensure_dataset
from trainer.run.run_dir import check_run_dir
from trainer.train.loop import WorkerEnv, run_worker


def train_worker(rank: int, world_size: int, cfg: FitConfig, stop_after: int | None) -> None:
    """One worker of the group: the real loop, rank 0 writing the metrics files."""
    torch.set_num_threads(1)
    writer = MetricsWriter(cfg.snapshots.run_uri) if rank == 0 else None
    attempt = {"n": 0}

    def on_start(step: int, size: int) -> None:
        if writer is not None:
            writer.add({"kind": "start", "attempt": attempt["n"], "step": step,
                        "world_size": size, "time": time.time()})

    def on_metrics(record: dict[str, Any]) -> None:
        assert writer is not None
        writer.add({"kind": "step", "attempt": attempt["n"], **record})

    env = WorkerEnv(rank=rank, world_size=world_size, stop_after=stop_after,
                    on_metrics=on_metrics if rank == 0 else None,
                    on_start=on_start if rank == 0 else None)
    try:
        run_worker(cfg, env)
    finally:
        if writer is not None:
            writer.flush()


@dataclass
class InProcessFit:
    world_size: int = 1
    wait_for_stop: bool = False
    stop_step: int | None = None
    tmp_dir: str = "/tmp"
    calls: list[dict[str, Any]] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)

    def __call__(self, cfg: FitConfig, *, on_progress: Any = None, pace_s: float = 0.0,
                 lease: Any = None, until: int | None = None,
                 stop: threading.Event | None = None, resumed_from: int | None = None,
                 **_: Any) -> Any:
        self.calls.append({"until": until, "steps": cfg.steps})
        # The real fit's pre-flight, run as it does: only when the caller did not (`baton fit`
        # checks before it takes the lease and passes the step on).
        resumed = check_run_dir(cfg) if resumed_from is None else resumed_from
        cfg = ensure_dataset(cfg)
        self.started.set()
        stop_after = until
        if self.wait_for_stop:
            assert stop is not None
            stop.wait(60)
            if not stop.is_set():
                raise TimeoutError("the stop event never came")
            stop_after = self.stop_step
        if self.world_size == 1:
            train_worker(0, 1, cfg, stop_after)
        else:
            run_group(train_worker, self.world_size, cfg, stop_after, tmp_dir=self.tmp_dir)
        step = max(SnapshotStore(cfg.snapshots.run_uri).committed_steps())
        return SimpleNamespace(
            run_uri=cfg.snapshots.run_uri, resumed_from=resumed,
            summary=summarize(read_records(cfg.snapshots.run_uri)),
            stopped_at=step if step < cfg.steps else None,
        )


def baton(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())  # rich may wrap lines
