"""`elastic.catalog.copy_shard`: a shard file copied into another run only once it checks out.

The snapshot is written with `elastic.portable.write_snapshot` (one shard file); each case
spoils it one way and expects the copy refused with nothing written into the target.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from elastic.catalog import copy_shard, verify
from elastic.errors import ManifestError, SnapshotIntegrityError
from elastic.portable import write_snapshot
from elastic.store.snapshot_store import SnapshotStore

STEP = 3


@pytest.fixture
def parent(tmp_path: Path) -> SnapshotStore:
    tensors = {"model.w": np.arange(12, dtype=np.float32).reshape(3, 4),
               "model.b": np.ones(5, dtype=np.float32)}
    state = {"model": {"w": {"__tensor__": "model.w"}, "b": {"__tensor__": "model.b"}}}
    write_snapshot(str(tmp_path / "parent"), STEP, tensors, state)
    return SnapshotStore(str(tmp_path / "parent"))


def _shard(store: SnapshotStore) -> Path:
    return Path(store.step_path(STEP, store.load_manifest(STEP).files[0]))


def test_a_copied_shard_is_the_parent_s_bytes_and_verifies_in_the_new_run(
        parent: SnapshotStore, tmp_path: Path) -> None:
    manifest = parent.load_manifest(STEP)
    target = SnapshotStore(str(tmp_path / "fork"))
    (name,) = manifest.files
    assert copy_shard(parent, manifest, name, target) == _shard(parent).stat().st_size
    assert Path(target.step_path(STEP, name)).read_bytes() == _shard(parent).read_bytes()
    target.write_manifest(manifest, exclusive=True)
    assert verify(target, STEP)["tensors"] == 2
    with pytest.raises(FileExistsError):  # create-only: never over a file already there
        copy_shard(parent, manifest, name, target)


def _flip_a_data_byte(shard: Path, elsewhere: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # inside the last chunk
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))


def _truncate(shard: Path, elsewhere: Path) -> None:
    shard.chmod(0o644)
    shard.write_bytes(shard.read_bytes()[:-8])


def _link(shard: Path, elsewhere: Path) -> None:
    elsewhere.write_bytes(shard.read_bytes())  # the same bytes, outside the snapshot
    shard.unlink()
    shard.symlink_to(elsewhere)


SPOILED: dict[str, tuple[Callable[[Path, Path], None], type[Exception], str]] = {
    "a flipped byte": (_flip_a_data_byte, SnapshotIntegrityError, "checksum mismatch"),
    "a truncated file": (_truncate, SnapshotIntegrityError, "truncated"),
    "a symbolic link": (_link, ManifestError, "symbolic link"),
}


@pytest.mark.parametrize("case", sorted(SPOILED))
def test_a_spoiled_shard_is_refused_and_nothing_is_written(
        parent: SnapshotStore, tmp_path: Path, case: str) -> None:
    spoil, error, words = SPOILED[case]
    manifest = parent.load_manifest(STEP)
    spoil(_shard(parent), tmp_path / "elsewhere.safetensors")
    target = SnapshotStore(str(tmp_path / "fork"))
    with pytest.raises(error, match=words):
        copy_shard(parent, manifest, manifest.files[0], target)
    assert not os.path.exists(target.step_path(STEP))


def test_a_file_the_manifest_does_not_name_is_refused(
        parent: SnapshotStore, tmp_path: Path) -> None:
    manifest = parent.load_manifest(STEP)
    with pytest.raises(ValueError, match="not a file of snapshot"):
        copy_shard(parent, manifest, "manifest.json", SnapshotStore(str(tmp_path / "fork")))
