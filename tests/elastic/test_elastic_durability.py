"""What a durable write promises, under failing calls (a review's findings).

A shard or manifest written with ``durable=True`` is reported written only once its bytes and
its directory entries are: a directory fsync that fails with a real error (not a filesystem
that does not fsync directories) fails the write, and every directory the write created is
made durable in its parent. A RAM-tier failure never fails a shard that is durable: it is
then storage-only.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.coord.receipts import Receipt
from elastic.state.layout import Piece
from elastic.storage import local_files
from elastic.store.ram_store import RamTier
from elastic.store.snapshot_store import SnapshotStore
from elastic.write.capture import Captured, ShardImage
from elastic.write.persist import Persister


def _fsync_failing_on_directories(code: int) -> Any:
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(code, os.strerror(code))
        real(fd)

    return fsync


def test_a_directory_fsync_that_fails_fails_the_durable_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SnapshotStore(str(tmp_path / "run"))
    monkeypatch.setattr(os, "fsync", _fsync_failing_on_directories(errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        store.write_shard(1, "shard-00000-of-00001-g000001.safetensors", memoryview(b"x" * 64))


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOTSUP])
def test_a_filesystem_that_does_not_fsync_directories_is_no_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    store = SnapshotStore(str(tmp_path / "run"))
    monkeypatch.setattr(os, "fsync", _fsync_failing_on_directories(code))
    name = "shard-00000-of-00001-g000001.safetensors"
    store.write_shard(1, name, memoryview(b"x" * 64))
    assert store.step_files(1) == [name]


def test_every_directory_a_durable_write_creates_is_made_durable_in_its_parent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = local_files.fsync_dir

    def fsync_dir(directory: str) -> None:
        synced.append(directory)
        real(directory)

    monkeypatch.setattr(local_files, "fsync_dir", fsync_dir)
    run = tmp_path / "run"
    store = SnapshotStore(str(run))
    store.write_shard(7, "shard-00000-of-00001-g000001.safetensors", memoryview(b"x" * 64))
    step_dir = run / "snapshots" / "000000007"
    # The new step directory's entry (in snapshots/), snapshots/ in the run, and the file's.
    for directory in (run / "snapshots", run, step_dir):
        assert str(directory) in synced, (directory, synced)


class _Coordinator:
    def __init__(self) -> None:
        self.receipts: list[Receipt] = []
        self.failures: list[str] = []

    def report_shard(self, receipt: Receipt) -> None:
        self.receipts.append(receipt)

    def report_failure(self, step: int, rank: int, reason: str, generation: int,
                       host: str) -> None:
        self.failures.append(reason)


def test_a_ram_tier_failure_leaves_the_durable_shard_reported(tmp_path: Path) -> None:
    def live_nodes() -> list[str]:
        raise RuntimeError("ray: GCS unreachable")  # or the object store full, a store's error

    def no_store(node: str) -> Any:
        raise AssertionError("no store is reached: listing the nodes failed")

    coordinator: Any = _Coordinator()
    persister = Persister(SnapshotStore(str(tmp_path / "run")), coordinator, layout="ddp",
                          block_bytes=1 << 20, ram_tier=RamTier("n0", live_nodes, no_store))
    image = ShardImage([Piece("model.w", torch.float32, (4,), (0,), (4,))])
    persister.submit(Captured(1, 0, 1, image, {}, {}), 0)
    persister.wait()
    persister.close()
    assert persister.last_error is None and coordinator.failures == []
    assert [(r.step, r.ram) for r in coordinator.receipts] == [(1, ())]  # storage-only
