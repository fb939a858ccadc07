"""A flaky object store never costs a good snapshot (issue 13's first reproduction).

A run on S3 (moto behind the fault-injecting proxy) commits steps 2 and 4; a new session
restores while the store misbehaves. Before this issue, three HTTP 500s made restore fall
back to step 2 and the rewind then deleted step 4 from S3 for good. Each test ends by
checking the promises: the newest committed snapshot is intact (same bytes), restorable,
bitwise equal to the state it was taken from, and no snapshot was deleted or quarantined.
"""

from __future__ import annotations

import time

import pytest
import torch

from elastic.errors import StorageUnavailableError
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import build, full_state, train_step


def _train(run: str) -> dict[int, dict[str, torch.Tensor]]:
    ts = build(seed=4)
    snap = Snapshotter(run, ts.registry,
                       settings=SnapshotSettings(snapshot_every=2, split_min_bytes=64, ram=False,
                                                 on_busy="wait"))
    refs = {}
    for step in range(1, 5):
        train_step(ts, step)
        snap.after_step(step)
        snap.persister.wait()
        refs[step] = full_state(ts)
    snap.close()
    return refs


def _snapshot_bytes(store: SnapshotStore) -> dict[str, bytes]:
    out = {}
    for step in store.committed_steps():
        for name in store.step_files(step):
            out[f"{step}/{name}"] = store.read_file(store.step_path(step, name))
    return out


def _assert_restores(run: str, ref: dict[str, torch.Tensor], step: int) -> None:
    ts = build(seed=50)
    snap = Snapshotter(run, ts.registry, settings=SnapshotSettings(ram=False))
    assert snap.restore() == step and snap.restore_errors == []
    for key, value in ref.items():
        assert torch.equal(full_state(ts)[key], value), key


def test_transient_500s_at_restore_keep_the_newest_snapshot(s3_faults, s3_bucket) -> None:
    run = f"s3://{s3_bucket}/runs/flaky"
    refs = _train(run)
    store = SnapshotStore(run)
    assert store.committed_steps() == [2, 4]
    before = _snapshot_bytes(store)
    # Three 500s on the shard reads of step 4 while a new session restores.
    rule = s3_faults.add_rule("GET", r"/000000004/shard-.*\.safetensors", "status", status=500,
                              times=3)
    ts = build(seed=50)
    snap = Snapshotter(run, ts.registry, settings=SnapshotSettings(ram=False))
    assert snap.restore() == 4
    assert rule.hits == 3 and snap.restore_errors == []
    for key, value in refs[4].items():
        assert torch.equal(full_state(ts)[key], value), key
    s3_faults.clear()
    assert store.committed_steps() == [2, 4] and store.quarantined() == []
    assert _snapshot_bytes(store) == before


def test_unanswered_reads_at_restore_change_nothing(s3_faults, s3_bucket) -> None:
    run = f"s3://{s3_bucket}/runs/blackhole"
    refs = _train(run)
    store = SnapshotStore(run)
    before = _snapshot_bytes(store)
    s3_faults.add_rule("GET", r"/000000004/shard-.*\.safetensors", "blackhole", times=None)
    ts = build(seed=50)
    snap = Snapshotter(run, ts.registry,
                       settings=SnapshotSettings(ram=False, storage_timeout_s=2.0,
                                                 storage_retry_s=6.0))
    started = time.monotonic()
    with pytest.raises(StorageUnavailableError, match="nothing was changed"):
        snap.restore()
    assert time.monotonic() - started < 30  # bounded by the deadlines, not minutes
    s3_faults.clear()
    assert store.committed_steps() == [2, 4] and store.quarantined() == []
    assert _snapshot_bytes(store) == before
    _assert_restores(run, refs[4], 4)  # once the store answers, the newest snapshot is back
