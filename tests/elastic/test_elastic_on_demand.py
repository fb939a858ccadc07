"""On-demand snapshots (asked by the coordinator before a planned resize)."""

from __future__ import annotations

from pathlib import Path

from elastic.preemption import PreemptionWatcher
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.testing import build, train_step


def test_a_request_is_met_by_the_next_commit_and_only_then(tmp_path: Path) -> None:
    ts = build(seed=3)
    snap = Snapshotter(str(tmp_path), ts.registry, settings=SnapshotSettings(snapshot_every=100))
    coordinator = snap.coordinator
    watcher = PreemptionWatcher(requested=coordinator.snapshot_requested)
    train_step(ts, 1)
    assert watcher.poll(1) is None  # nothing asked yet
    coordinator.request_snapshot()
    train_step(ts, 2)
    notice = watcher.poll(2)
    assert notice is not None and notice.source == "request" and not notice.must_exit
    snap.after_step(2, force=True)  # not due (every 100): taken because it was asked for
    snap.persister.wait()
    assert not coordinator.request_met()  # committed, but not yet answered
    coordinator.answer_request(2)
    assert coordinator.request_met() and snap.store.committed_steps() == [2]
    assert not coordinator.snapshot_requested() and watcher.poll(3) is None

    # A periodic snapshot committing after the request does not meet it: it may be older.
    coordinator.request_snapshot()
    train_step(ts, 3)
    snap.after_step(3, force=True)
    snap.persister.wait()
    assert not coordinator.request_met() and coordinator.snapshot_requested()
    assert watcher.poll(4).source == "request"
    coordinator.cancel_request()
    assert watcher.poll(5) is None
    snap.close()
