"""Generations, fencing and bounded resources of the commit protocol (issue 13: P2-P7).

Every test drives real Snapshotters and a real store (a tmp directory), with the ranks of a
group in this process so each interleaving is deterministic, and ends by checking the
promises: the newest committed snapshot restores bitwise to the state it was taken from, its
files all come from one generation, and nothing committed was lost or overwritten.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading

import pytest
import torch

from elastic.coord.generation import GENERATION_NAME
from elastic.coord.local_coordinator import LocalCoordinator
from elastic.errors import StorageUnavailableError
from elastic.faults import FaultInjector
from elastic.format.records import DEFAULT_BLOCK_BYTES, MANIFEST_NAME, step_dirname
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.store.ram_store import RamTier, in_process_tier
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import build, full_state, restore_fresh, train_step


def _coordinator(run: str, **kwargs) -> LocalCoordinator:
    return LocalCoordinator(SnapshotStore(run), keep_last=3, block_bytes=DEFAULT_BLOCK_BYTES,
                            **kwargs)


def _group(run: str, coord: LocalCoordinator, seed: int, faults: FaultInjector | None = None,
           world: int = 2, ram_tier: RamTier | None = None):
    states = [build(seed=seed) for _ in range(world)]
    snaps = [Snapshotter(run, s.registry, r, world, coordinator=coord, faults=faults,
                         ram_tier=ram_tier,
                         settings=SnapshotSettings(snapshot_every=2, durable=False,
                                                   split_min_bytes=64))
             for r, s in enumerate(states)]
    return states, snaps


def _train(states, snaps, steps, *, offset: int = 0) -> dict[int, dict]:
    refs = {}
    for step in steps:
        for state, snap in zip(states, snaps, strict=True):
            train_step(state, step + offset)
            snap.after_step(step)
            snap.persister.wait()
        refs[step] = full_state(states[0])
    return refs


def _only_rank_0_snapshots_step_4(states, snaps) -> None:
    """Both ranks train steps 3 and 4; rank 0's shard of snapshot 4 is durable and
    reported, rank 1's is not taken yet (the caller decides what happens to it)."""
    for state, snap in zip(states, snaps, strict=True):
        train_step(state, 3)
        snap.after_step(3)
        train_step(state, 4)
    snaps[0].after_step(4)
    snaps[0].persister.wait()


def _files_of(run: str, step: int) -> dict[str, str]:
    """name -> sha256 of every file in a step directory."""
    d = os.path.join(run, "snapshots", step_dirname(step))
    return {n: hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest()
            for n in sorted(os.listdir(d))}


def _manifest_generations(run: str, step: int) -> set[str]:
    path = os.path.join(run, "snapshots", step_dirname(step), MANIFEST_NAME)
    manifest = json.load(open(path))
    files = set(manifest["files"])
    files |= {c["file"] for t in manifest["tensors"].values() for c in t["chunks"]}
    return {f.rsplit("-g", 1)[1].split(".")[0] for f in files}


def _restore_equals(run: str, ref: dict, expected_step: int) -> None:
    step, state = restore_fresh(run, seed=99)
    assert step == expected_step
    for key, value in ref.items():
        assert torch.equal(state[key], value), key


def test_straggler_of_an_old_generation_is_refused(tmp_path) -> None:
    """Generation 1's rank 1 writes and reports step 4 after generation 2 started at the same
    step and committed it: refused; the committed snapshot is bitwise generation 2's."""
    run = str(tmp_path / "run")
    coord = _coordinator(run)
    release = threading.Event()
    faults = FaultInjector().arm("persist_begin", rank=1, step=4,
                                 action=lambda: release.wait(30))
    old_states, old_snaps = _group(run, coord, seed=5, faults=faults)
    _train(old_states, old_snaps, range(1, 3))
    assert coord.committed_steps() == [2]
    _only_rank_0_snapshots_step_4(old_states, old_snaps)
    old_snaps[1].after_step(4)  # its persist now hangs at persist_begin: the straggler

    # The group is torn down and restarted: generation 2 restores step 2 and trains on
    # another trajectory (another data offset), committing step 4 again.
    new_states, new_snaps = _group(run, coord, seed=77)
    assert [s.restore() for s in new_snaps] == [2, 2]
    assert new_snaps[0].generation == new_snaps[1].generation == 2
    refs = _train(new_states, new_snaps, range(3, 5), offset=1000)
    assert coord.committed_steps() == [2, 4]
    committed_files = _files_of(run, 4)

    release.set()  # the straggler wakes up, writes its shard and reports
    old_snaps[1].persister.wait()
    assert any("generation 1, the current one is 2" in e for e in coord.events())
    assert coord.committed_steps() == [2, 4]
    after = _files_of(run, 4)
    assert {n: h for n, h in after.items() if n in committed_files} == committed_files
    assert _manifest_generations(run, 4) == {"000002"}
    _restore_equals(run, refs[4], 4)


def test_late_failure_report_of_an_old_generation_aborts_nothing(tmp_path) -> None:
    """Before generations, a rewind cleared `aborted` and a late report of the torn-down
    group could abort (and delete) the new group's in-flight snapshot of the same step."""
    run = str(tmp_path / "run")
    coord = _coordinator(run)
    states, snaps = _group(run, coord, seed=5)
    _train(states, snaps, range(1, 3))
    old_generation = snaps[0].generation
    new_states, new_snaps = _group(run, coord, seed=5)
    assert [s.restore() for s in new_snaps] == [2, 2]
    train_step(new_states[0], 3)
    train_step(new_states[0], 4)
    new_snaps[0].after_step(4, force=True)
    new_snaps[0].persister.wait()
    assert 4 in coord.core.pending
    coord.report_failure(4, 1, "late report from the torn-down group", old_generation)
    assert 4 in coord.core.pending  # untouched
    train_step(new_states[1], 3)
    train_step(new_states[1], 4)
    new_snaps[1].after_step(4, force=True)
    new_snaps[1].persister.wait()
    assert coord.committed_steps() == [2, 4]
    _restore_equals(run, full_state(new_states[0]), 4)


def test_generation_is_persisted_and_continued(tmp_path) -> None:
    run = str(tmp_path / "run")
    coord = _coordinator(run)
    assert [coord.new_generation() for _ in range(3)] == [1, 2, 3]
    restarted = _coordinator(run)  # a restarted coordinator, or a new driver
    assert restarted.current_generation() == 3
    assert restarted.new_generation() == 4
    assert json.load(open(os.path.join(run, GENERATION_NAME)))["generation"] == 4


def test_a_second_coordinator_fences_the_first(tmp_path) -> None:
    """Two coordinators on one run (two drivers without a lease): once the second starts a
    generation, the first can no longer commit, and nothing it wrote mixes in."""
    run = str(tmp_path / "run")
    first = _coordinator(run)
    states, snaps = _group(run, first, seed=5)
    _train(states, snaps, range(1, 3))
    second = _coordinator(run)
    new_states, new_snaps = _group(run, second, seed=5)
    assert [s.restore() for s in new_snaps] == [2, 2]
    _train(states, snaps, range(3, 5))  # the first driver's group keeps training
    assert first.committed_steps() == [2]
    assert "generation 2" in (first.health()["fenced"] or "")
    assert not os.path.exists(os.path.join(run, "snapshots", step_dirname(4), MANIFEST_NAME))
    refs = _train(new_states, new_snaps, range(3, 5), offset=500)
    assert second.committed_steps() == [2, 4]
    assert _manifest_generations(run, 4) == {"000002"}
    _restore_equals(run, refs[4], 4)


def test_lease_taken_over_fences_commits(tmp_path) -> None:
    from elastic.lease.run_lease import RunLease

    run = str(tmp_path / "run")
    store = SnapshotStore(run)
    clock = [1000.0]
    mine = RunLease(store, ttl_s=10, clock=lambda: clock[0])
    mine.acquire()
    coord = _coordinator(run, lease_token=mine.token)
    states, snaps = _group(run, coord, seed=5)
    _train(states, snaps, range(1, 3))
    assert coord.committed_steps() == [2]
    clock[0] += 60  # this driver stopped renewing; another one takes the run over
    RunLease(SnapshotStore(run), ttl_s=10, clock=lambda: clock[0]).acquire()
    _train(states, snaps, range(3, 5))
    assert coord.committed_steps() == [2]
    assert "lease" in (coord.health()["fenced"] or "")
    assert SnapshotStore(run).committed_steps() == [2]


def test_an_existing_manifest_is_never_overwritten(tmp_path) -> None:
    run = str(tmp_path / "run")
    coord = _coordinator(run)
    states, snaps = _group(run, coord, seed=5)
    _train(states, snaps, range(1, 3))
    _only_rank_0_snapshots_step_4(states, snaps)
    planted = os.path.join(run, "snapshots", step_dirname(4), MANIFEST_NAME)
    with open(planted, "wb") as fh:
        fh.write(b'{"written": "by someone else"}')
    snaps[1].after_step(4)
    snaps[1].persister.wait()
    assert open(planted, "rb").read() == b'{"written": "by someone else"}'
    assert 4 not in coord.committed_steps()


def test_corrupt_snapshot_is_quarantined_not_deleted(tmp_path, capsys) -> None:
    from trainer.cli import main as baton_main

    run = str(tmp_path / "run")
    coord = _coordinator(run)
    states, snaps = _group(run, coord, seed=5, world=1)
    refs = _train(states, snaps, range(1, 5))
    step_dir = os.path.join(run, "snapshots", step_dirname(4))
    shard = next(n for n in os.listdir(step_dir) if n.endswith(".safetensors"))
    with open(os.path.join(step_dir, shard), "r+b") as fh:
        fh.seek(-16, os.SEEK_END)
        fh.write(b"\xff" * 16)
    corrupt_bytes = open(os.path.join(step_dir, shard), "rb").read()
    _restore_equals(run, refs[2], 2)
    moved = os.path.join(run, "quarantine", step_dirname(4))
    assert open(os.path.join(moved, shard), "rb").read() == corrupt_bytes  # kept, bit for bit
    assert "checksum" in json.load(open(os.path.join(moved, "reason.json")))["reason"]
    assert SnapshotStore(run).committed_steps() == [2]
    assert baton_main(["snapshots", "ls", run]) == 0
    out = capsys.readouterr().out
    assert "quarantine" in out and "checksum" in out


def test_unreachable_storage_at_restore_changes_nothing(tmp_path, monkeypatch) -> None:
    """Doubt is not proof: a restore whose reads time out raises and leaves every snapshot
    where it was (the old code fell back to step 2 and then deleted step 4)."""
    run = str(tmp_path / "run")
    coord = _coordinator(run)
    states, snaps = _group(run, coord, seed=5, world=1)
    refs = _train(states, snaps, range(1, 5))
    before = {s: _files_of(run, s) for s in (2, 4)}

    def unreachable(self, path, start, end):
        raise StorageUnavailableError(f"{path}: no answer within 30 s")

    def unreachable_into(self, path, reads):
        raise StorageUnavailableError(f"{path}: no answer within 30 s")

    monkeypatch.setattr(SnapshotStore, "read_range", unreachable)
    monkeypatch.setattr(SnapshotStore, "read_into", unreachable_into)
    ts = build(seed=99)
    with pytest.raises(StorageUnavailableError, match="nothing was changed"):
        Snapshotter(run, ts.registry, settings=SnapshotSettings(ram=False)).restore()
    monkeypatch.undo()
    assert SnapshotStore(run).committed_steps() == [2, 4]
    assert {s: _files_of(run, s) for s in (2, 4)} == before
    assert not os.path.exists(os.path.join(run, "quarantine"))
    _restore_equals(run, refs[4], 4)


def test_disk_full_is_reported_with_its_reason(tmp_path, monkeypatch) -> None:
    run = str(tmp_path / "run")
    coord = _coordinator(run)
    states, snaps = _group(run, coord, seed=5, world=1)
    refs = _train(states, snaps, range(1, 3))
    real_write = SnapshotStore.write_file

    def full_disk(self, path, data, **kwargs):
        if path.endswith(".safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_write(self, path, data, **kwargs)

    monkeypatch.setattr(SnapshotStore, "write_file", full_disk)
    _train(states, snaps, range(3, 7))
    health = coord.health()
    assert health["latest"] == 2
    assert health["failures"] and "ENOSPC" in health["failures"][-1]["reason"]
    assert health["failures"][-1]["step"] == 6
    monkeypatch.undo()
    _restore_equals(run, refs[2], 2)


def test_ram_copy_is_capped_and_can_be_off(tmp_path) -> None:
    run = str(tmp_path / "run")
    tier = in_process_tier(cap_bytes=1)  # smaller than any shard: storage-only
    coord = _coordinator(run, ram_stores=tier.store_on)
    states, snaps = _group(run, coord, seed=5, world=1, ram_tier=tier)
    refs = _train(states, snaps, range(1, 3))
    assert tier.store_on("local").held_bytes() == 0 and coord.committed_steps() == [2]
    assert coord.ram_locations(2) == {}  # the receipt named no holder
    _restore_equals(run, refs[2], 2)

    run2 = str(tmp_path / "run2")
    off = _coordinator(run2)
    states, snaps = _group(run2, off, seed=5, world=1)  # no RAM tier: off
    _train(states, snaps, range(1, 3))
    assert snaps[0].ram_tier is None and off.ram_locations(2) == {}

    run3 = str(tmp_path / "run3")
    tier = in_process_tier(cap_bytes=1 << 30)
    roomy = _coordinator(run3, ram_stores=tier.store_on)
    states, snaps = _group(run3, roomy, seed=5, world=1, ram_tier=tier)
    _train(states, snaps, range(1, 5))
    store = tier.store_on("local")
    assert 0 < store.held_bytes() <= 1 << 30 and store.stats()["steps"] == [4]  # newest only
    assert list(roomy.ram_index) == [4]


def test_a_stuck_rank_cannot_grow_memory_or_step_directories(tmp_path) -> None:
    run = str(tmp_path / "run")
    now = [0.0]
    tier = in_process_tier()
    coord = _coordinator(run, pending_timeout_s=50, clock=lambda: now[0],
                         ram_stores=tier.store_on)
    states, snaps = _group(run, coord, seed=5, ram_tier=tier)
    _train(states, snaps, range(1, 3))
    for step in range(3, 41):  # rank 1 is stuck: only rank 0 snapshots
        train_step(states[0], step)
        snaps[0].after_step(step)
        snaps[0].persister.wait()
        now[0] += 1
        assert len(coord.core.pending) <= coord.core.max_pending
        # The store: the newest commit plus one step in flight; the index no more.
        assert len(tier.store_on("local").stats()["steps"]) <= 2
        assert len(coord.ram_index) <= coord.core.max_pending + 1
    dirs = SnapshotStore(run).all_steps()
    assert len(dirs) <= 1 + coord.core.max_pending, dirs
    now[0] += 100  # nothing completes: the timeout aborts what is left and removes its files
    coord.poll()
    assert coord.core.pending == {}
    assert SnapshotStore(run).all_steps() == [2]
    assert any("pending_timeout_s" in e for e in coord.events())


def test_slow_store_does_not_block_the_coordinator(tmp_path) -> None:
    """A manifest write stuck on storage must not hold the coordinator's lock: other calls
    (a worker's poll, the driver's health check) answer meanwhile."""
    run = str(tmp_path / "run")
    release = threading.Event()
    entered = threading.Event()

    def slow_manifest() -> None:
        entered.set()
        release.wait(30)

    faults = FaultInjector().arm("commit_manifest", step=2, action=slow_manifest)
    coord = _coordinator(run, faults=faults)
    states, snaps = _group(run, coord, seed=5, world=1)
    train_step(states[0], 1)
    snaps[0].after_step(1)
    train_step(states[0], 2)
    snaps[0].after_step(2)
    assert entered.wait(10)
    answered = []
    caller = threading.Thread(target=lambda: answered.append(
        (coord.health()["latest"], coord.snapshot_requested(), coord.committed_steps())))
    caller.start()
    caller.join(20)  # a blocked coordinator would not answer before `release` is set
    assert answered == [(None, False, [])], "the coordinator blocked behind a storage write"
    release.set()
    snaps[0].persister.wait()
    assert coord.committed_steps() == [2]
