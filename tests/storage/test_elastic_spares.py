"""Spare shard files (``elastic.storage.spares``): retention keeps a retired snapshot's shards and
the next snapshots overwrite them instead of allocating new files. Checked: they really are reused,
``spare/`` stays bounded, every committed snapshot stays whole and the run restores where it would
have; a crash mid-write into a spare loses nothing committed; a spare is never a way to write
outside the run or into another name of the same file; writers racing for spares never share one."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from elastic.catalog import verify
from elastic.coord.local_coordinator import LocalCoordinator
from elastic.faults import FaultInjector
from elastic.format.records import DEFAULT_BLOCK_BYTES
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.storage import spares
from elastic.storage.local_files import LocalFiles
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import build, crash_in_child, full_state, restore_fresh, train_step


def _inodes(store: SnapshotStore, step: int) -> dict[str, int]:
    return {name: os.stat(store.step_path(step, name)).st_ino
            for name in store.step_files(step) if name.endswith(".safetensors")}


def _spares(run: str) -> dict[str, int]:
    spare_dir = os.path.join(run, spares.SPARE_DIR)
    if not os.path.isdir(spare_dir):
        return {}
    return {n: os.stat(os.path.join(spare_dir, n)).st_ino for n in os.listdir(spare_dir)}


def _two_ranks(run: str, coord: LocalCoordinator, faults: FaultInjector | None = None):
    states = [build(seed=5), build(seed=5)]
    snaps = [Snapshotter(run, s.registry, r, 2, coordinator=coord, faults=faults,
                         settings=SnapshotSettings(snapshot_every=2, durable=True,
                                                   split_min_bytes=64))
             for r, s in enumerate(states)]
    return states, snaps


def _restores_to(run: str, expected_step: int, ref: dict[str, torch.Tensor]) -> None:
    """A new incarnation restores exactly ``expected_step``, bitwise ``ref``."""
    step, state = restore_fresh(run)
    assert step == expected_step
    for key, value in ref.items():
        assert torch.equal(state[key], value), key


def test_retired_shards_are_reused_and_every_snapshot_stays_whole(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    store = SnapshotStore(run)
    coord = LocalCoordinator(store, keep_last=2, block_bytes=DEFAULT_BLOCK_BYTES)
    states, snaps = _two_ranks(run, coord)
    refs, inodes, reused = {}, {}, []
    for step in range(1, 13):
        for rank in (0, 1):
            train_step(states[rank], step)
            before = _spares(run)
            snaps[rank].after_step(step)
            snaps[rank].persister.wait()
            coord.flush(0)  # the retirement runs on the housekeeping thread
            if step % 2 == 0:
                written = _inodes(store, step)
                reused += [n for n, ino in written.items() if ino in before.values()]
            assert len(_spares(run)) <= 2  # at most one snapshot's shards (two ranks)
        refs[step] = full_state(states[0])
        if step % 2 == 0:
            inodes[step] = _inodes(store, step)
            for kept in store.committed_steps():
                verify(store, kept)  # every crc32 block of every kept snapshot
    assert store.committed_steps() == [10, 12] and store.all_steps() == [10, 12]
    # Snapshot 2 was retired when 6 committed; from snapshot 8 on both ranks write into the
    # files of the snapshot retired just before.
    assert len(reused) == 2 * 3, reused  # snapshots 8, 10 and 12, both ranks
    assert set(inodes[8].values()) == set(inodes[2].values())
    for snap in snaps:
        snap.close()
    _restores_to(run, 12, refs[12])


def test_a_fault_mid_write_into_a_spare_loses_nothing_committed(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    store = SnapshotStore(run)
    faults = FaultInjector().arm("persist_mid", rank=1, step=8)
    coord = LocalCoordinator(store, keep_last=2, block_bytes=DEFAULT_BLOCK_BYTES, faults=faults)
    states, snaps = _two_ranks(run, coord, faults)
    refs = {}
    for step in range(1, 11):
        for rank in (0, 1):
            train_step(states[rank], step)
            snaps[rank].after_step(step)
            snaps[rank].persister.wait()
            coord.flush(0)
        refs[step] = full_state(states[0])
        if step == 8:
            assert faults.fired and snaps[1].persister.last_error is not None
            assert store.committed_steps() == [4, 6]  # 8 aborted, nothing committed lost
            assert not [f for _, _, fs in os.walk(run) for f in fs if ".tmp-" in f]
    assert store.committed_steps() == [6, 10]  # the run went on: 10 committed over spares
    for snap in snaps:
        snap.close()
    _restores_to(run, 10, refs[10])


def test_a_hard_crash_mid_write_into_a_spare_restores_the_newest_commit(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    crash_in_child(run, "persist_mid", step=8, durable=True)
    # The half-written spare is left as a temporary file in step 8's directory, no spare.
    assert [f for _, _, fs in os.walk(run) for f in fs if ".tmp-" in f]
    ref = build(seed=5)
    for step in range(1, 7):
        train_step(ref, step)
    _restores_to(run, 6, full_state(ref))
    store = SnapshotStore(run)
    assert store.all_steps() == store.committed_steps() == [4, 6]


def _write(tmp_path: Path, data: bytes) -> str:
    path = str(tmp_path / "snap" / "shard.safetensors")
    LocalFiles({}).write(path, data, durable=True, mid_write=None, exclusive=True,
                         spare_dir=str(tmp_path / "spare"))
    return path


@pytest.mark.parametrize("old_size", [10, 5000])
def test_a_spare_of_any_size_ends_exactly_the_new_bytes(tmp_path: Path, old_size: int) -> None:
    (tmp_path / "spare").mkdir()
    spare = tmp_path / "spare" / "a.spare"
    spare.write_bytes(b"\xff" * old_size)
    ino = spare.stat().st_ino
    data = bytes(range(256)) * 4
    path = _write(tmp_path, data)
    assert Path(path).read_bytes() == data and os.stat(path).st_ino == ino
    assert not list((tmp_path / "spare").iterdir())


def test_a_symlinked_spare_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"not yours")
    (tmp_path / "spare").mkdir()
    (tmp_path / "spare" / "a.spare").symlink_to(outside)
    path = _write(tmp_path, b"shard bytes")
    assert outside.read_bytes() == b"not yours"  # untouched
    assert Path(path).read_bytes() == b"shard bytes" and not os.path.islink(path)
    assert (tmp_path / "spare" / "a.spare").is_symlink()  # left where it was


def test_a_directory_among_the_spares_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "spare" / "a.spare").mkdir(parents=True)
    path = _write(tmp_path, b"shard bytes")
    assert Path(path).read_bytes() == b"shard bytes"
    assert (tmp_path / "spare" / "a.spare").is_dir()


def test_a_hard_linked_spare_is_not_overwritten(tmp_path: Path) -> None:
    backup = tmp_path / "backup.safetensors"  # e.g. a `cp -al` copy of the run
    backup.write_bytes(b"a committed shard")
    (tmp_path / "spare").mkdir()
    os.link(backup, tmp_path / "spare" / "a.spare")
    path = _write(tmp_path, b"new shard bytes")
    assert backup.read_bytes() == b"a committed shard"
    assert Path(path).read_bytes() == b"new shard bytes"
    assert os.stat(path).st_ino != backup.stat().st_ino


def test_retire_keeps_at_most_keep_spares(tmp_path: Path) -> None:
    files = []
    for i in range(5):
        f = tmp_path / f"s{i}"
        f.write_bytes(b"x")
        files.append(str(f))
    spare_dir = str(tmp_path / "spare")
    left = spares.retire(files[:3], spare_dir, keep=2)
    assert left == files[2:3] and len(os.listdir(spare_dir)) == 2
    assert spares.retire(files[3:], spare_dir, keep=2) == files[3:]  # full: nothing taken
    assert len(os.listdir(spare_dir)) == 2


def test_writers_racing_for_spares_never_share_one(tmp_path: Path) -> None:
    spare_dir = tmp_path / "spare"
    spare_dir.mkdir()
    for i in range(8):
        (spare_dir / f"{i}.spare").write_bytes(b"x" * 64)
    claimed: list[int] = []
    start = threading.Barrier(12)

    def writer(k: int) -> None:
        start.wait()
        fd = spares.claim(str(spare_dir), str(tmp_path / f"tmp-{k}"))
        if fd is not None:
            claimed.append(os.fstat(fd).st_ino)
            os.close(fd)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(claimed) == 8 and len(set(claimed)) == 8  # each spare to exactly one writer


def test_a_symlinked_spare_directory_is_neither_filled_nor_drained(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_bytes(b"keep me")
    (tmp_path / "spare").symlink_to(elsewhere, target_is_directory=True)
    path = _write(tmp_path, b"shard bytes")  # does not take precious.txt
    assert (elsewhere / "precious.txt").read_bytes() == b"keep me"
    assert Path(path).read_bytes() == b"shard bytes"
    shard = tmp_path / "old.safetensors"
    shard.write_bytes(b"old")
    assert spares.retire([str(shard)], str(tmp_path / "spare"), keep=4) == [str(shard)]
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious.txt"]
