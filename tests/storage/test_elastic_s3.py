"""Snapshots through a real S3 API over HTTP on 127.0.0.1 (moto's server).

Save, list and restore on ``s3://``; then the endpoint is stopped while a shard is being
persisted: training keeps stepping, only that snapshot fails, and the next one commits once
the endpoint is back.
"""

from __future__ import annotations

import json
import threading

import torch

from elastic.faults import FaultInjector
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import build, full_state, train_step
from trainer.cli import main as baton_main


def test_s3_save_list_restore(s3_bucket, capsys) -> None:
    run = f"s3://{s3_bucket}/runs/demo"
    ts = build(seed=4)
    snap = Snapshotter(run, ts.registry,
                       settings=SnapshotSettings(snapshot_every=2, split_min_bytes=64, ram=False))
    for step in range(1, 5):
        train_step(ts, step)
        snap.after_step(step)
        snap.persister.wait()
    snap.close()
    assert snap.persister.last_error is None
    ref = full_state(ts)
    assert SnapshotStore(run).committed_steps() == [2, 4]
    assert baton_main(["snapshots", "ls", run, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows if r["committed"]] == [2, 4]
    assert baton_main(["snapshots", "verify", run]) == 0

    fresh = build(seed=40)
    restorer = Snapshotter(run, fresh.registry, settings=SnapshotSettings(ram=False))
    assert restorer.restore() == 4 and restorer.restored_from == ("storage", 4)
    for key, value in ref.items():
        assert torch.equal(full_state(fresh)[key], value), key


def test_s3_endpoint_down_fails_only_that_snapshot(s3_endpoint, s3_bucket) -> None:
    run = f"s3://{s3_bucket}/runs/outage"
    trained_on = threading.Event()
    waited: list[bool] = []

    def endpoint_dies_mid_persist() -> None:
        s3_endpoint.stop()
        # Hold this persist until training has gone 4 steps further: if training waited for
        # the persist, this would time out instead.
        waited.append(trained_on.wait(timeout=120))

    faults = FaultInjector().arm("persist_begin", step=4, action=endpoint_dies_mid_persist)
    ts = build(seed=4)
    # Short storage deadlines: the dead endpoint fails snapshot 4 in seconds, not minutes.
    snap = Snapshotter(run, ts.registry, faults=faults,
                       settings=SnapshotSettings(snapshot_every=2, split_min_bytes=64, ram=False,
                                                 storage_timeout_s=2.0, storage_retry_s=4.0))
    try:
        for step in range(1, 9):
            train_step(ts, step)
            snap.after_step(step)  # on_busy="skip": never waits for the stuck persist
            if step < 4:
                snap.persister.wait()  # so that snapshot 4 is taken, not skipped
        trained_on.set()
        snap.persister.wait()
        assert waited == [True]
        assert snap.skipped == [6, 8]
        assert isinstance(snap.persister.last_error, Exception)  # snapshot 4 failed
    finally:
        trained_on.set()
        s3_endpoint.start()
    assert any("aborted step 4" in e for e in snap.coordinator.events())
    for step in range(9, 11):
        train_step(ts, step)
        snap.after_step(step)
        snap.persister.wait()
    snap.close()
    assert snap.persister.last_error is None
    assert SnapshotStore(run).committed_steps() == [2, 10]
    fresh = build(seed=41)
    restorer = Snapshotter(run, fresh.registry, settings=SnapshotSettings(ram=False))
    assert restorer.restore() == 10
    for key, value in full_state(ts).items():
        assert torch.equal(full_state(fresh)[key], value), key
