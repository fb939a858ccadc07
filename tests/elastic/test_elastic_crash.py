"""Crash at every phase of a snapshot, then restore: the newest *committed* snapshot loads,
nothing committed is lost, and no partial snapshot is ever visible.

Two ranks of a DDP-style (replicated) run live in this process and share one coordinator, so
every phase can be hit deterministically; hard crashes (``os._exit`` mid-write) run in a
spawned process.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from elastic.catalog import verify
from elastic.coord.local_coordinator import LocalCoordinator
from elastic.faults import PHASES, FaultInjector
from elastic.format.records import DEFAULT_BLOCK_BYTES
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import build, crash_in_child, full_state, restore_fresh, train_step

WORKER_PHASES = [p for p in PHASES if not p.startswith("commit")]
COORD_PHASES = [p for p in PHASES if p.startswith("commit")]
COORD_RANK = -1  # the coordinator's fault key


def _check_visible_snapshots_whole(store: SnapshotStore) -> list[int]:
    committed = store.committed_steps()
    for step in committed:
        verify(store, step)
    return committed


def _two_rank_run(
    run: str, coord: LocalCoordinator, faults: FaultInjector, steps: range, states=None
) -> tuple[list, list[Snapshotter], dict[int, dict]]:
    states = states or [build(seed=5), build(seed=5)]
    snaps = [
        Snapshotter(run, s.registry, r, 2, coordinator=coord, faults=faults,
                    settings=SnapshotSettings(snapshot_every=2, durable=False, split_min_bytes=64))
        for r, s in enumerate(states)
    ]
    refs = {}
    for step in steps:
        for r in (0, 1):
            train_step(states[r], step)
            snaps[r].after_step(step)
            snaps[r].persister.wait()
            _check_visible_snapshots_whole(coord.core.store)
        refs[step] = full_state(states[0])
    for s in snaps:
        s.persister.close()
    return states, snaps, refs


@pytest.mark.parametrize("phase", PHASES)
def test_crash_at_phase_keeps_last_commit(tmp_path, phase: str) -> None:
    run = str(tmp_path / "run")
    store = SnapshotStore(run)
    rank = COORD_RANK if phase in COORD_PHASES else 1
    faults = FaultInjector().arm(phase, rank=rank, step=6)
    coord = LocalCoordinator(store, keep_last=3, block_bytes=DEFAULT_BLOCK_BYTES, faults=faults)
    _, snaps, refs = _two_rank_run(run, coord, faults, range(1, 7))
    assert faults.fired, f"fault at {phase} never fired"
    expected = 6 if phase == "commit_end" else 4  # commit_end: the manifest was already written
    assert coord.committed_steps() == [2, 4, 6][: expected // 2]
    # The run dies here; a new incarnation (new coordinator, new world size) restores.
    step, state = restore_fresh(run)
    assert step == expected
    for key, value in refs[expected].items():
        assert torch.equal(state[key], value), key
    assert store.all_steps() == store.committed_steps() == [2, 4, 6][: expected // 2]


def test_restarted_coordinator_refuses_late_receipts(tmp_path) -> None:
    """Coordinator killed between two receipts of step 6: its successor must not commit 6
    from the late receipt alone, and later snapshots commit normally."""
    run = str(tmp_path / "run")
    store = SnapshotStore(run)
    faults = FaultInjector()
    coord_a = LocalCoordinator(store, keep_last=3, block_bytes=DEFAULT_BLOCK_BYTES)
    states, snaps, _ = _two_rank_run(run, coord_a, faults, range(1, 5))
    snaps = [
        Snapshotter(run, s.registry, r, 2, coordinator=coord_a,
                    settings=SnapshotSettings(snapshot_every=2, durable=False, split_min_bytes=64))
        for r, s in enumerate(states)
    ]
    for r in (0, 1):
        train_step(states[r], 5)
        snaps[r].after_step(5)
        train_step(states[r], 6)
    snaps[0].after_step(6)
    snaps[0].persister.wait()
    assert 6 in coord_a.core.pending  # rank 0's shard is in, rank 1's is not
    coord_b = LocalCoordinator(store, keep_last=3, block_bytes=DEFAULT_BLOCK_BYTES)  # restart
    assert coord_b.committed_steps() == [2, 4] and 6 not in store.all_steps()
    snaps[1].coordinator = snaps[1].persister.coordinator = coord_b
    snaps[1].after_step(6)
    snaps[1].persister.wait()
    assert coord_b.committed_steps() == [2, 4] and 6 not in store.committed_steps()
    snaps[0].coordinator = snaps[0].persister.coordinator = coord_b
    _, _, refs = _two_rank_run(run, coord_b, faults, range(7, 9), states=states)
    assert coord_b.committed_steps() == [2, 4, 8]
    step, state = restore_fresh(run)
    assert step == 8
    for key, value in refs[8].items():
        assert torch.equal(state[key], value), key


@pytest.mark.parametrize("phase", ["persist_mid", "commit_manifest", "commit_end"])
def test_hard_crash_mid_write(tmp_path, phase: str) -> None:
    run = str(tmp_path / "run")
    crash_in_child(run, phase, step=4)
    leftovers = [f for _, _, files in os.walk(run) for f in files if ".tmp-" in f]
    if phase != "commit_end":
        assert leftovers, "a mid-write crash should leave a temp file behind"
    expected = 4 if phase == "commit_end" else 2
    ref = build(seed=5)
    for step in range(1, expected + 1):
        train_step(ref, step)
    step, state = restore_fresh(run)
    assert step == expected
    for key, value in full_state(ref).items():
        assert torch.equal(state[key], value), key
    store = SnapshotStore(run)
    assert store.all_steps() == store.committed_steps()
    assert not [f for _, _, files in os.walk(run) for f in files if ".tmp-" in f]


def test_commit_replies_before_its_deletions_and_settle_waits_for_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Garbage collection runs on the housekeeping thread: a slow deletion of an old snapshot
    # does not hold up the report that committed the new one, and settle() waits for it.
    store = SnapshotStore(str(tmp_path / "run"))
    coord = LocalCoordinator(store, keep_last=1, block_bytes=DEFAULT_BLOCK_BYTES)
    release = threading.Event()
    deleted: list[int] = []
    real_retire = store.retire_step

    def slow_retire(step: int) -> None:
        assert release.wait(10), "the deletion was never released"
        real_retire(step)
        deleted.append(step)

    monkeypatch.setattr(store, "retire_step", slow_retire)
    state = build(seed=3)
    snap = Snapshotter(str(tmp_path / "run"), state.registry, coordinator=coord,
                       settings=SnapshotSettings(durable=False))
    for step in (1, 2):
        train_step(state, step)
        snap.after_step(step, force=True)
        snap.persister.wait()  # returns although step 1's deletion is blocked
    assert coord.committed_steps() == [2] and store.all_steps() == [1, 2] and deleted == []
    release.set()
    coord.flush(0)  # settles
    assert deleted == [1] and store.all_steps() == [2]
    snap.close()
