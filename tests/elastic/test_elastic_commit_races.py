"""The commit core under races and half-failed storage calls (a review's findings).

Each test drives `CommitCore` (or the `LocalCoordinator` around it) directly with hand-made
receipts of a 2-rank group and forces one interleaving: a commit against its own
coordinator's next generation, a manifest write whose answer is lost after it landed, a
quarantine that fails, a collection that runs after the snapshot it was queued for was
rejected, receipts whose chunks overlap, a RAM-tier index entry made while the index was
trimmed. Each ends by checking what is on storage (or indexed): nothing committed lost,
nothing half-committed left behind.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from elastic.coord.commit import CommitCore
from elastic.coord.local_coordinator import LocalCoordinator
from elastic.coord.receipts import Receipt, manifest_from_receipts
from elastic.errors import StorageUnavailableError
from elastic.faults import FaultInjector
from elastic.format.records import DEFAULT_BLOCK_BYTES, MANIFEST_NAME, chunk_name, shard_filename
from elastic.store.ram_store import RamStore
from elastic.store.snapshot_store import SnapshotStore

WORLD = 2


def _receipts(step: int, generation: int) -> list[Receipt]:
    """Receipts of a 2-rank snapshot of one [2, 4] float32 tensor, a row per rank."""
    out = []
    for rank in range(WORLD):
        file = shard_filename(rank, WORLD, generation)
        chunk = {"file": file, "name": chunk_name("model.w", (rank, 0)), "offsets": [rank, 0],
                 "shape": [1, 4], "byte_range": [8, 24], "crc32": [rank + 1]}
        receipt: dict[str, Any] = {
            "step": step, "rank": rank, "world_size": WORLD, "generation": generation,
            "file": file, "chunks": {"model.w": [chunk]}, "versions": {"baton": "test"},
            "layout": "ddp", "ram": []}
        if rank == 0:
            receipt["catalog"] = {"model.w": {"dtype": "F32", "shape": [WORLD, 4]}}
            receipt["skeletons"] = {"model": {"w": {"__tensor__": "model.w"}}}
        out.append(Receipt.from_json(receipt))
    return out


def _write_shards(store: SnapshotStore, step: int, generation: int) -> None:
    for rank in range(WORLD):
        store.write_shard(step, shard_filename(rank, WORLD, generation), memoryview(b"x" * 24))


def _snapshot(core: CommitCore, step: int, generation: int) -> int | None:
    """Shards durable, then every receipt reported: the step if the last one committed it."""
    _write_shards(core.store, step, generation)
    return [core.report(r) for r in _receipts(step, generation)][-1]


class _Hook(FaultInjector):
    """Runs ``fn`` once when the commit reaches ``phase``."""

    def __init__(self, phase: str) -> None:
        super().__init__()
        self.phase = phase
        self.fn: Any = None

    def hit(self, rank: int, step: int, phase: str) -> None:
        if phase == self.phase and self.fn is not None:
            fn, self.fn = self.fn, None
            fn()


def test_a_commit_overtaken_by_its_own_next_generation_is_aborted_not_fenced(
        tmp_path: Path) -> None:
    hook = _Hook("commit_begin")
    core = CommitCore(SnapshotStore(str(tmp_path / "run")), block_bytes=DEFAULT_BLOCK_BYTES,
                      faults=hook)
    first = core.new_generation()
    assert _snapshot(core, 2, first) == 2
    # The driver starts the next group while generation 1's last receipt commits step 4.
    hook.fn = core.new_generation
    assert _snapshot(core, 4, first) is None
    assert core.fenced is None, core.fenced
    assert core.committed == [2] and core.store.all_steps() == [2]  # 4 aborted and removed
    second = core.current_generation()
    assert second == first + 1 and core.new_generation() == second + 1  # not fenced
    assert _snapshot(core, 6, second + 1) == 6


def test_a_new_generation_waits_for_the_manifest_write_in_flight(tmp_path: Path) -> None:
    hook = _Hook("commit_manifest")
    core = CommitCore(SnapshotStore(str(tmp_path / "run")), block_bytes=DEFAULT_BLOCK_BYTES,
                      faults=hook)
    first = core.new_generation()
    started: list[int] = []
    thread = threading.Thread(target=lambda: started.append(core.new_generation()))

    def mid_write() -> None:  # the manifest is being written: a new group starts now
        thread.start()
        thread.join(0.5)
        assert thread.is_alive(), "a generation started in the middle of a commit"

    hook.fn = mid_write
    assert _snapshot(core, 2, first) == 2  # committed whole, then the generation moved on
    thread.join(30)
    assert started == [first + 1] and core.fenced is None
    assert SnapshotStore(core.store.run_uri).committed_steps() == [2]


class _LostAnswer(SnapshotStore):
    """Its manifest writes land, then raise (an S3 PUT whose answer was lost)."""

    lose = False

    def write_manifest(self, manifest: Any, **kwargs: Any) -> None:
        super().write_manifest(manifest, **kwargs)
        if self.lose:
            raise StorageUnavailableError("PUT manifest.json: no answer within the deadline")


def test_a_manifest_that_landed_despite_its_error_is_removed_with_its_step(
        tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    store = _LostAnswer(run)
    core = CommitCore(store, block_bytes=DEFAULT_BLOCK_BYTES)
    generation = core.new_generation()
    assert _snapshot(core, 2, generation) == 2
    store.lose = True
    assert _snapshot(core, 4, generation) is None
    core.settle()
    # Not committed here, so not committed on storage either: no manifest without shards.
    assert core.committed == [2] and store.all_steps() == [2]
    assert CommitCore(SnapshotStore(run), block_bytes=DEFAULT_BLOCK_BYTES).committed == [2]


def test_a_manifest_that_is_not_this_commits_is_never_removed(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    store = _LostAnswer(run)
    core = CommitCore(store, block_bytes=DEFAULT_BLOCK_BYTES)
    generation = core.new_generation()
    store.lose = True
    _write_shards(store, 4, generation)
    other, _ = manifest_from_receipts(4, WORLD, generation,
                                      dict(enumerate(_receipts(4, generation))),
                                      block_bytes=DEFAULT_BLOCK_BYTES, versions={"other": "x"})
    real_write = SnapshotStore.write_manifest

    def someone_else_wrote(self: SnapshotStore, manifest: Any, **kwargs: Any) -> None:
        kwargs.pop("data")  # our manifest's bytes
        real_write(self, other, **kwargs)  # what landed is another writer's manifest
        raise StorageUnavailableError("PUT manifest.json: no answer within the deadline")

    store.write_manifest = someone_else_wrote.__get__(store)  # type: ignore[method-assign]
    assert [core.report(r) for r in _receipts(4, generation)][-1] is None
    core.settle()
    assert store.read_file(store.step_path(4, MANIFEST_NAME)) == other.to_bytes()


class _FlakyQuarantine(SnapshotStore):
    down = False

    def quarantine_step(self, step: int, reason: str, **record: Any) -> str:
        if self.down:
            raise StorageUnavailableError("moving the snapshot to quarantine/: unreachable")
        return super().quarantine_step(step, reason, **record)


def test_a_snapshot_whose_quarantine_failed_stays_committed_and_in_place(
        tmp_path: Path) -> None:
    store = _FlakyQuarantine(str(tmp_path / "run"))
    core = CommitCore(store, block_bytes=DEFAULT_BLOCK_BYTES, keep_last=3)
    generation = core.new_generation()
    for step in (2, 4):
        assert _snapshot(core, step, generation) == step
    store.down = True
    with pytest.raises(StorageUnavailableError):
        core.rewind(2)  # the restore fell back to 2; 4 must be quarantined, never deleted
    store.down = False
    assert core.committed == [2, 4]
    second = core.new_generation()
    assert _snapshot(core, 6, second) == 6
    core.settle()  # the collection after 6 ran: 4 is still there, whole
    assert store.all_steps() == [2, 4, 6] and store.committed_steps() == [2, 4, 6]
    core.reject(4, "checksum mismatch")  # storage answers again: now it moves
    assert store.all_steps() == [2, 6] and [q["step"] for q in store.quarantined()] == [4]


def test_a_late_collection_spares_a_new_groups_older_step(tmp_path: Path) -> None:
    core = CommitCore(SnapshotStore(str(tmp_path / "run")), block_bytes=DEFAULT_BLOCK_BYTES)
    first = core.new_generation()
    assert _snapshot(core, 4, first) == 4
    core.settle()
    gate = threading.Event()
    core._housekeeping.submit(gate.wait)  # an earlier, slow deletion still running
    assert _snapshot(core, 8, first) == 8  # its collection is queued behind it
    # The group fails; the restore finds 8 corrupt and training restarts from 4.
    second = core.new_generation()
    core.reject(8, "checksum mismatch")
    core.rewind(4)
    _write_shards(core.store, 6, second)  # the new group's step-6 shards are durable
    gate.set()
    core.settle()  # the late collection has run: 6 is newer than the newest commit, 4
    assert len(core.store.step_files(6)) == WORLD
    assert [core.report(r) for r in _receipts(6, second)][-1] == 6
    assert core.store.committed_steps() == [4, 6]
    assert len(core.store.step_files(6)) == WORLD + 1  # the manifest and both shards


def test_receipts_whose_chunks_overlap_are_not_committed() -> None:
    # Equal element counts, but rank 1 reports rank 0's row and none reports row 1: a
    # restore would refuse the manifest, so the commit must.
    receipts = dict(enumerate(_receipts(4, 1)))
    chunk = replace(receipts[1].chunks["model.w"][0], offsets=(0, 0),
                    name=chunk_name("model.w", (0, 0)))
    receipts[1] = replace(receipts[1], chunks={"model.w": (chunk,)})
    with pytest.raises(ValueError, match="overlap each other"):
        manifest_from_receipts(4, WORLD, 1, receipts, block_bytes=DEFAULT_BLOCK_BYTES,
                               versions={})


def test_a_ram_location_indexed_after_a_trim_read_the_state_is_kept(tmp_path: Path) -> None:
    # The coordinator's trim reads the core's state (newest commit 6, nothing in flight),
    # then drops index entries outside it; a receipt of step 8 indexed on another thread in
    # between is newer than all it knew of, so not its to drop (the copy would go unused).
    stores = {"n1": RamStore(), "n2": RamStore()}
    coord = LocalCoordinator(SnapshotStore(str(tmp_path / "run")),
                             block_bytes=DEFAULT_BLOCK_BYTES, ram_stores=stores.__getitem__)
    generation = coord.new_generation()
    _write_shards(coord.core.store, 6, generation)
    for receipt in _receipts(6, generation):
        stores["n1"].put(6, generation, receipt.file, b"x" * 24)
        coord.report_shard(replace(receipt, ram=("n1",)))
    assert coord.core.committed == [6]
    late = shard_filename(0, WORLD, generation)
    coord.ram_index[8] = {late: ["n2"]}  # indexed after the trim below read the state
    coord._trim_ram()
    assert coord.ram_locations(8) == {late: ["n2"]}
    assert set(coord.ram_locations(6)) == {shard_filename(r, WORLD, generation)
                                           for r in range(WORLD)}


def test_a_quarantined_only_commit_does_not_block_the_next_generation_s_ram_copies(
    tmp_path: Path,
) -> None:
    """The only committed snapshot is quarantined (keep_last=1, or no older one): the RAM
    store must not go on treating it as committed. Before, its copy outlived the new
    generation and, once that committed, sat as a step "in flight" newer than every put,
    so the RAM tier refused every copy until training passed the old step."""
    import numpy as np

    ram = RamStore(cap_bytes=None)
    coord = LocalCoordinator(SnapshotStore(str(tmp_path / "run")), keep_last=2,
                             block_bytes=DEFAULT_BLOCK_BYTES, ram_stores=lambda node: ram)

    def snapshot(step: int, generation: int) -> list[bool]:
        took = [ram.put(step, generation, r.file, np.full(24, step, np.uint8))
                for r in _receipts(step, generation)]
        _write_shards(coord.core.store, step, generation)
        for r in _receipts(step, generation):
            coord.report_shard(replace(r, ram=("local",) if took[r.rank] else ()))
        return took

    assert snapshot(10, coord.new_generation()) == [True, True]
    coord.reject(10, "crc mismatch")
    assert coord.committed_steps() == [] and ram.committed is None
    generation = coord.new_generation()  # the group starts again from step 0
    for step in (2, 4, 6):
        assert snapshot(step, generation) == [True, True], step
        assert coord.committed_steps()[-1] == step and sorted(ram.files) == [step]
        assert coord.ram_locations(step)


def test_a_long_run_s_coordinator_keeps_bounded_records(tmp_path: Path) -> None:
    """Thousands of snapshots, some aborted: the event log and the abort records stay
    bounded (a coordinator lives as long as the run)."""
    core = CommitCore(SnapshotStore(str(tmp_path / "run")), block_bytes=DEFAULT_BLOCK_BYTES)
    generation = core.new_generation()
    for step in range(1, 1201):
        receipts = _receipts(step, generation)
        _write_shards(core.store, step, generation)
        if step % 3 == 0:
            core.report(receipts[0])
            core.fail(step, 1, "disk full")
        else:
            for r in receipts:
                core.report(r)
    core.settle()
    assert core.committed == [1198, 1199]  # 1200 was aborted (a multiple of 3)
    assert len(core.events) <= 500 and len(core.aborted) <= 2
    assert any("committed step 1199" in e for e in core.events)
