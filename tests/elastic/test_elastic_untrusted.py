"""Manifests are untrusted input (P8 of docs/design.md; issue 13 point 4).

A real two-snapshot run (steps 2 and 4, world size 1) is made once; each test copies it,
hand-edits snapshot 4 (its manifest.json, or a shard file) and checks that the edit is one
clear ``ManifestError`` line — from ``parse_manifest``, from the header checks of
restore/verify, or from the state check against the live components — that
``catalog.verify`` and ``export`` refuse it (export writing nothing), and that
``Snapshotter.restore()`` falls back to snapshot 2 instead of crashing or loading garbage.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.catalog import export_model, verify
from elastic.errors import ManifestError, SnapshotIntegrityError
from elastic.format.manifest_check import parse_manifest
from elastic.format.records import (
    MANIFEST_NAME,
    MAX_HEADER_BYTES,
    ChunkRecord,
    Manifest,
    TensorRecord,
    crc32_blocks,
    shard_filename,
    step_dirname,
)
from elastic.read.restore import (
    ByteSource,
    check_compatible,
    check_headers,
    plan_targets,
    read_tensors,
)
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.state.registry import SnapshotMismatchError
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import TrainState, build, full_state, json_state, train_step
from trainer.cli import main as baton_main

Edit = Callable[[dict[str, Any]], None]
# A value no trained weight holds: if it shows up in a restored tensor, a planted file was read.
SENTINEL = 12345.5


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    """A run with committed snapshots 2 and 4, and the full state at each."""
    run = tmp_path_factory.mktemp("pristine") / "run"
    ts = build(seed=3)
    snap = Snapshotter(str(run), ts.registry,
                       settings=SnapshotSettings(snapshot_every=2, keep_last=5, durable=False,
                                                 block_bytes=256, split_min_bytes=64))
    refs: dict[int, Any] = {}
    for step in range(1, 5):
        train_step(ts, step)
        snap.after_step(step)
        snap.persister.wait()
        if step % 2 == 0:
            refs[step] = (full_state(ts), json_state(ts))
    snap.close()
    return run, refs


@pytest.fixture
def run(pristine: tuple[Path, dict[int, Any]], tmp_path: Path) -> Path:
    dest = tmp_path / "run"
    shutil.copytree(pristine[0], dest, symlinks=True)
    return dest


def _snapdir(run: Path, step: int = 4) -> Path:
    return run / "snapshots" / step_dirname(step)


def _manifest(run: Path) -> dict[str, Any]:
    return json.loads((_snapdir(run) / MANIFEST_NAME).read_text())


def _edit(run: Path, edit: Edit) -> None:
    obj = _manifest(run)
    edit(obj)
    (_snapdir(run) / MANIFEST_NAME).write_text(json.dumps(obj))


def _chunk(obj: dict[str, Any], key: str = "model.inp.weight") -> dict[str, Any]:
    return obj["tensors"][key]["chunks"][0]


def _shard(run: Path) -> Path:
    files = _manifest(run)["files"]
    assert len(files) == 1
    return _snapdir(run) / files[0]


def _restore(run: Path) -> tuple[Snapshotter, TrainState, int]:
    ts = build(seed=11)
    snap = Snapshotter(str(run), ts.registry)
    return snap, ts, snap.restore()


def _assert_falls_back(run: Path, refs: dict[int, Any], match: str) -> list[str]:
    """Restore falls back to snapshot 2 (bitwise), reporting snapshot 4 in one line."""
    snap, ts, step = _restore(run)
    assert step == 2, snap.restore_errors
    assert len(snap.restore_errors) == 1, snap.restore_errors
    error = snap.restore_errors[0]
    assert "\n" not in error and "snapshot 4" in error and match in error, error
    full, js = refs[2]
    got = full_state(ts)
    assert sorted(got) == sorted(full)
    for key, value in full.items():
        assert torch.equal(got[key], value), key
    assert json_state(ts) == js
    return snap.restore_errors


def _assert_refuses_to_go_back(run: Path, match: str) -> None:
    """State that does not fit the live components: restore refuses in one line naming
    snapshot 4, what does not fit and snapshot 2 (the newest that fits, for an explicit
    rewind); nothing is restored past it and nothing moves (issue 29)."""
    ts = build(seed=11)
    snap = Snapshotter(str(run), ts.registry)
    with pytest.raises(SnapshotMismatchError) as info:
        snap.restore()
    text = str(info.value)
    assert "\n" not in text and match in text, text
    assert "snapshot 4" in text and f"rewind {run} --to 2" in text, text
    store = SnapshotStore(str(run))
    assert store.committed_steps() == [2, 4] and store.quarantined() == []


def _assert_refused(run: Path, match: str, tmp_path: Path) -> None:
    """verify and export raise one ManifestError line naming snapshot 4; export writes
    nothing; the CLI prints that one line and exits 1."""
    store = SnapshotStore(str(run))
    with pytest.raises(ManifestError, match=match) as info:
        verify(store, 4)
    text = str(info.value)
    assert "\n" not in text and step_dirname(4) in text, text
    out = tmp_path / "weights.safetensors"
    with pytest.raises(ManifestError):
        export_model(store, 4, str(out))
    assert not out.exists()
    assert baton_main(["snapshots", "export", str(run), "4", "--out", str(out)]) == 1
    assert not out.exists()
    assert baton_main(["snapshots", "verify", str(run), "4"]) == 1


def _plant_outside(run: Path, nbytes: int) -> Path:
    """A file outside the run directory whose bytes would decode as SENTINEL floats."""
    planted = run.parent / "x"
    planted.write_bytes(torch.full((nbytes // 4,), SENTINEL).numpy().tobytes())
    return planted


def _no_sentinel(ts: TrainState) -> None:
    for key, value in full_state(ts).items():
        assert not bool((value == SENTINEL).any()), key


# ------------------------------------------------------------------ file names


def test_clean_snapshot_verifies_and_restores_bitwise(run, pristine) -> None:
    assert verify(SnapshotStore(str(run)), 4)["tensors"] > 0
    snap, ts, step = _restore(run)
    assert step == 4 and snap.restore_errors == []
    for key, value in pristine[1][4][0].items():
        assert torch.equal(full_state(ts)[key], value), key
    assert json_state(ts) == pristine[1][4][1]


def test_parent_path_is_never_read(run, pristine, tmp_path, monkeypatch) -> None:
    size = _shard(run).stat().st_size
    planted = _plant_outside(run, size)
    rel = "../../../x"
    assert (_snapdir(run) / rel).resolve() == planted.resolve()  # a naive reader gets it

    def edit(obj: dict[str, Any]) -> None:
        _chunk(obj)["file"] = rel
        obj["files"].append(rel)

    _edit(run, edit)
    reads: list[str] = []
    for name in ("read_range", "read_file"):
        original = getattr(SnapshotStore, name)

        def spy(self: SnapshotStore, path: str, *args: Any, _orig: Any = original,
                **kwargs: Any) -> Any:
            reads.append(path)
            return _orig(self, path, *args, **kwargs)

        monkeypatch.setattr(SnapshotStore, name, spy)
    _assert_refused(run, "not a bare shard file name", tmp_path)
    _assert_falls_back(run, pristine[1], "not a bare shard file name")
    snap, ts, _ = _restore(run)
    _no_sentinel(ts)
    assert reads and not any(os.path.basename(p) == "x" for p in reads), reads


def test_absolute_path_is_refused(run, pristine, tmp_path) -> None:
    planted = _plant_outside(run, _shard(run).stat().st_size)

    def edit(obj: dict[str, Any]) -> None:
        _chunk(obj)["file"] = str(planted)
        obj["files"] = [str(planted)]

    _edit(run, edit)
    _assert_refused(run, r"files\[0\]: .* is not a bare shard file name", tmp_path)
    _assert_falls_back(run, pristine[1], "not a bare shard file name")


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_shard_that_is_not_a_regular_file_is_refused(run, pristine, tmp_path,
                                                       kind: str) -> None:
    # A FIFO blocked the restore's open forever; a directory read as unreachable storage, so
    # the restore never fell back to the previous snapshot.
    shard = _shard(run)
    shard.unlink()
    if kind == "directory":
        shard.mkdir()
        _assert_refused(run, "is not a regular file", tmp_path)
        _assert_falls_back(run, pristine[1], "is not a regular file")
        return
    os.mkfifo(shard)
    done = threading.Event()

    def unblock() -> None:  # were an open to block on it, a writer ends it: fail, not hang
        while not done.wait(20):
            try:
                os.close(os.open(shard, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass  # no reader blocked on it

    threading.Thread(target=unblock, daemon=True).start()
    try:
        _assert_refused(run, "is not a regular file", tmp_path)
        _assert_falls_back(run, pristine[1], "is not a regular file")
    finally:
        done.set()


def test_headers_are_read_in_bounded_batches() -> None:
    # A manifest alone names 30 files whose first chunks start past a 100 MiB header: the
    # restore must not allocate 30 x 100 MiB of header buffers before the first read fails.
    files = [shard_filename(r, 30, 1) for r in range(30)]
    start = 8 + MAX_HEADER_BYTES
    chunks = [ChunkRecord(file=f, name=f"model.w@{r}", offsets=(r,), shape=(1,),
                          byte_range=(start, start + 4), crc32=(0,))
              for r, f in enumerate(files)]
    manifest = Manifest(step=4, world_size=30, layout="ddp", block_bytes=1 << 20,
                        tensors={"model.w": TensorRecord("F32", (30,), chunks)}, state={},
                        files=files)
    asked: list[int] = []

    class Missing:
        headers: dict[str, Any] = {}

        def read_many(self, requests: list[tuple[str, int, int]]) -> list[bytes]:
            asked.append(sum(end - begin for _, begin, end in requests))
            raise SnapshotIntegrityError("shard file is missing")

    with pytest.raises(SnapshotIntegrityError):
        check_headers(manifest, [("model.w", c) for c in chunks], Missing())  # type: ignore[arg-type]
    assert asked == [start]  # one file's header, then the failure


def test_file_not_in_files_is_refused(run, pristine, tmp_path) -> None:
    other = "shard-00007-of-00009-g000001.safetensors"
    shutil.copy(_shard(run), _snapdir(run) / other)  # a real, readable file: still refused
    _edit(run, lambda obj: _chunk(obj).update(file=other))
    _assert_refused(run, "is not listed in 'files'", tmp_path)
    _assert_falls_back(run, pristine[1], "is not listed in 'files'")


def test_symlinked_shard_is_refused(run, pristine, tmp_path) -> None:
    shard = _shard(run)
    outside = run.parent / "elsewhere.safetensors"
    shutil.copy(shard, outside)  # identical bytes: only the link itself is wrong
    shard.unlink()
    shard.symlink_to(outside)
    _assert_refused(run, "symbolic link", tmp_path)
    _assert_falls_back(run, pristine[1], "symbolic link")


# ------------------------------------------------------------------ dtypes and byte ranges


def test_dtype_edit_alone_is_a_byte_count_mismatch(run, pristine, tmp_path) -> None:
    _edit(run, lambda obj: obj["tensors"]["model.inp.weight"].update(dtype="F16"))
    _assert_refused(run, "needs", tmp_path)
    _assert_falls_back(run, pristine[1], "byte_range")


def test_consistent_dtype_edit_disagrees_with_header_and_model(run, pristine,
                                                               tmp_path) -> None:
    """F32 -> F16 with byte range and checksums edited to fit: the file's header (verify)
    and the live model's dtype (restore) both still say F32."""
    shard = _shard(run).read_bytes()

    def edit(obj: dict[str, Any]) -> None:
        rec = obj["tensors"]["model.inp.weight"]
        rec["dtype"] = "F16"
        for c in rec["chunks"]:
            start, end = c["byte_range"]
            end = start + (end - start) // 2
            c["byte_range"] = [start, end]
            c["crc32"] = crc32_blocks(shard[start:end], obj["checksum"]["block_bytes"])

    _edit(run, edit)
    _assert_refused(run, "is F32 in the file but F16 in the manifest", tmp_path)
    _assert_refuses_to_go_back(run, "F16 in the manifest but the registered tensor")


def test_byte_range_not_matching_shape(run, pristine, tmp_path) -> None:
    _edit(run, lambda obj: _chunk(obj)["byte_range"].__setitem__(1, _chunk(obj)
                                                                 ["byte_range"][1] + 4))
    _assert_refused(run, r"byte_range: .* spans", tmp_path)
    _assert_falls_back(run, pristine[1], "byte_range")


def test_range_beyond_file_end(run, pristine, tmp_path) -> None:
    size = _shard(run).stat().st_size

    def edit(obj: dict[str, Any]) -> None:
        c = _chunk(obj)
        start, end = c["byte_range"]
        c["byte_range"] = [start + size, end + size]

    _edit(run, edit)
    _assert_refused(run, "of the file but", tmp_path)
    _assert_falls_back(run, pristine[1], "of the file but")


def test_negative_shape(run, pristine, tmp_path) -> None:
    _edit(run, lambda obj: obj["tensors"]["model.inp.weight"].update(shape=[-24, 8]))
    _assert_refused(run, r"shape\[0\]: -24 is outside", tmp_path)
    _assert_falls_back(run, pristine[1], "is outside")


def test_huge_shape(run, pristine, tmp_path) -> None:
    def edit(obj: dict[str, Any]) -> None:
        rec = obj["tensors"]["model.inp.weight"]
        rec["shape"] = [1 << 30, 1 << 30]
        rec["chunks"][0]["shape"] = [1 << 30, 1 << 30]

    _edit(run, edit)
    _assert_refused(run, "elements, more than", tmp_path)
    _assert_falls_back(run, pristine[1], "elements, more than")


def test_empty_tensors(run, pristine, tmp_path) -> None:
    _edit(run, lambda obj: obj.update(tensors={}))
    _assert_refused(run, "tensors: is empty", tmp_path)
    _assert_falls_back(run, pristine[1], "is empty")


# ------------------------------------------------------------------ field types


@pytest.mark.parametrize("edit, match", [
    (lambda obj: obj.update(step="4"), "field step: expected an int, got str"),
    (lambda obj: obj.update(world_size=1.0), "field world_size: expected an int, got float"),
    (lambda obj: obj.update(world_size=True), "field world_size: expected an int, got bool"),
    (lambda obj: obj["checksum"].update(block_bytes=False), "expected an int, got bool"),
    (lambda obj: obj.update(layout="zero3"), "is not one of"),
    (lambda obj: obj.update(files="shard"), "files: expected a list, got str"),
    (lambda obj: _chunk(obj).update(offsets=["0", 0]), r"offsets\[0\]: expected an int"),
    (lambda obj: _chunk(obj).update(crc32=_chunk(obj)["crc32"][:-1]), "checksums"),
    (lambda obj: _chunk(obj).update(name="model.inp.weight@1,0"), "key@offsets"),
    (lambda obj: obj["tensors"]["model.inp.weight"].update(dtype="F31"), "unknown dtype"),
    (lambda obj: obj["state"]["data"].update(samples={"__tensor__": "model.inp.weight"}),
     "belongs to another component"),
    (lambda obj: obj["state"]["model"].pop("inp.weight"), "referenced by no state"),
])
def test_malformed_fields(run, pristine, tmp_path, edit: Edit, match: str) -> None:
    _edit(run, edit)
    data = (_snapdir(run) / MANIFEST_NAME).read_bytes()
    with pytest.raises(ManifestError, match=match):
        parse_manifest(data, where="snap")
    _assert_refused(run, match, tmp_path)
    _assert_falls_back(run, pristine[1], match.split(":")[0].replace("\\", ""))


def test_not_json_and_deep_nesting(run, pristine) -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        parse_manifest(b"\xff{", where="snap")
    with pytest.raises(ManifestError):
        parse_manifest(b"[" * 100000 + b"]" * 100000, where="snap")
    deep: Any = 1
    for _ in range(200):
        deep = [deep]
    _edit(run, lambda obj: obj["state"]["data"].update(deep=deep))
    with pytest.raises(ManifestError, match="nested more than"):
        parse_manifest((_snapdir(run) / MANIFEST_NAME).read_bytes(), where="snap")


# ------------------------------------------------------------------ JSON state vs live state


@pytest.mark.parametrize("edit, match", [
    (lambda obj: obj["state"]["sched"].update(last_epoch="3"),
     "state sched.last_epoch: expected int, got str"),
    (lambda obj: obj["state"]["sched"].update(_step_count=True),
     "state sched._step_count: expected int, got bool"),
    (lambda obj: obj["state"]["sched"].update(gamma="0.5"), "expected float, got str"),
    (lambda obj: obj["state"]["data"].update(extra=1), "unexpected ['extra']"),
    (lambda obj: obj["state"]["data"].pop("samples"), "missing key(s) ['samples']"),
    (lambda obj: obj["state"]["optim"]["param_groups"][0].pop("weight_decay"),
     "state optim.param_groups[0]: missing key(s) ['weight_decay']"),
    (lambda obj: obj["state"]["optim"]["param_groups"].__setitem__(0, []),
     "optim.param_groups[0]: expected dict, got list"),
    (lambda obj: obj["state"]["optim"]["param_groups"][0]["params"].__setitem__(0, "nope"),
     "names parameter 'nope'"),
])
def test_state_must_fit_live_components(run, pristine, edit: Edit, match: str) -> None:
    _edit(run, edit)
    store = SnapshotStore(str(run))
    verify(store, 4)  # the bytes are intact; only a live trainer knows the expected state
    manifest = store.load_manifest(4)
    ts = build(seed=11)
    with pytest.raises(ManifestError) as info:
        check_compatible(ts.registry, manifest, ts.registry.flatten().tensors)
    assert match in str(info.value) and "\n" not in str(info.value), str(info.value)
    _assert_refuses_to_go_back(run, match)


def test_registry_load_checks_everything_before_loading(pristine) -> None:
    """A bad component after a good one (registry order: model, optim, sched, data):
    neither is loaded."""
    ts = build(seed=11)
    flat = ts.registry.flatten()
    skeletons = json.loads(json.dumps(flat.skeletons))
    skeletons["sched"]["last_epoch"] = 7
    skeletons["data"] = {"samples": "many"}
    before = json_state(ts)
    with pytest.raises(ManifestError, match="state data.samples: expected int, got str"):
        ts.registry.load(flat.tensors, skeletons)
    assert json_state(ts) == before
    skeletons["data"] = {"samples": 7}
    ts.registry.load(flat.tensors, skeletons)
    assert ts.cursor.samples == 7 and ts.sched.last_epoch == 7


def test_header_check_reads_through_the_ram_copy(run, pristine) -> None:
    """Bytes served by the coordinator's RAM copy get the same header checks; the store is
    not touched."""
    shard = _shard(run)
    image, name = shard.read_bytes(), shard.name
    empty = SnapshotStore(str(run.parent / "nothing-here"))

    def ram(requests: list[tuple[str, int, int]]) -> list[bytes] | None:
        return [image[a:b] if f == name else b"" for f, a, b in requests]

    manifest = parse_manifest((_snapdir(run) / MANIFEST_NAME).read_bytes())
    targets = plan_targets(manifest, {})
    source = ByteSource(empty, 4, ram=ram)
    got = read_tensors(manifest, targets, source)
    assert source.used_ram and not source.used_storage and empty.stats.range_reads == 0
    assert torch.equal(got["model.inp.weight"], pristine[1][4][0]["model.inp.weight"])
    assert set(source.headers) == {name}

    rec = manifest.tensors["model.inp.weight"]
    c = rec.chunks[0]
    half = (c.byte_range[0], c.byte_range[0] + (c.byte_range[1] - c.byte_range[0]) // 2)
    rec.dtype = "F16"
    rec.chunks[0] = replace(c, byte_range=half, crc32=tuple(
        crc32_blocks(image[half[0]:half[1]], manifest.block_bytes)))
    with pytest.raises(ManifestError, match="is F32 in the file but F16 in the manifest"):
        read_tensors(manifest, plan_targets(manifest, {}), ByteSource(empty, 4, ram=ram))
    assert empty.stats.range_reads == 0


def test_errors_are_integrity_errors() -> None:
    assert issubclass(ManifestError, SnapshotIntegrityError)
    assert issubclass(ManifestError, ValueError)
