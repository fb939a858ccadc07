"""On-demand snapshots (asked by the coordinator before a planned resize)."""

from __future__ import annotations

from pathlib import Path

from elastic.preemption import PreemptionWatcher
from elastic.snapshotter import Snapshotter
from elastic.testing import build, train_step


def test_a_request_is_met_by_the_next_commit_and_only_then(tmp_path: Path) -> None:
    ts = build(seed=3)
    snap = Snapshotter(str(tmp_path), ts.registry, snapshot_every=100)
    coordinator = snap.coordinator
    watcher = PreemptionWatcher(use_ray_train=False, requested=coordinator.snapshot_requested)
    train_step(ts, 1)
    assert watcher.poll(1) is None  # nothing asked yet
    assert coordinator.request_snapshot() == -1  # nothing committed so far
    train_step(ts, 2)
    notice = watcher.poll(2)
    assert notice is not None and notice.source == "request" and not notice.must_exit
    snap.after_step(2, force=True)  # not due (every 100): taken because it was asked for
    snap.persister.wait()
    assert snap.store.committed_steps() == [2]
    assert not coordinator.snapshot_requested()  # met by the commit of step 2
    assert watcher.poll(3) is None
    assert coordinator.request_snapshot() == 2  # a second resize asks again
    assert watcher.poll(3).source == "request"
    coordinator.cancel_request()
    assert watcher.poll(4) is None
    snap.close()
