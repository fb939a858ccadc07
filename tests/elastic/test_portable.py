"""The framework-neutral reader and writer (elastic.portable, issue 33 points 1 and 3).

* Importing it — and data_state's dataset, order, cursor and numpy loader — loads no torch
  (checked in a fresh interpreter, which also reads a snapshot and a step of data there).
* It reads exactly what the PyTorch restore reads: a DDP snapshot and an FSDP2 snapshot of two
  ranks (chunks from two files) assembled bitwise equal to the saved state.
* A crafted snapshot is refused by it as by the PyTorch path: the same error class and the
  same one-line message, for every crafted case of tests/elastic/test_elastic_untrusted.py that the
  files or the manifest alone can show, plus a flipped byte and a truncated shard.
* What it writes, `baton snapshots verify` accepts and the PyTorch Snapshotter restores
  bitwise; it takes a generation of its own and the lease, refuses while a live driver holds
  the run, never overwrites a committed step, and leaves nothing behind when it refuses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

# The crafted snapshots of the PyTorch path's own tests, reused as they are.
from test_elastic_untrusted import _chunk, _edit, _shard, _snapdir, pristine, run  # noqa: F401

from elastic.catalog import verify
from elastic.coord.generation import read_generation
from elastic.errors import ManifestError, SnapshotIntegrityError
from elastic.format.records import MANIFEST_NAME, crc32_blocks
from elastic.lease.run_lease import LeaseHeldError, RunLease
from elastic.portable import PortableRun, write_snapshot
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.state import SnapshotMismatchError
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import build, full_state, json_state, run_group, train_step
from trainer.cli import main as baton_main

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ torch-free


def test_reader_and_numpy_data_path_import_no_torch(pristine, tiny_dataset) -> None:  # noqa: F811
    code = textwrap.dedent(f"""
        import sys
        from elastic.portable import PortableRun, write_snapshot
        from data_state.dataset import TokenDataset
        from data_state.numpy_source import numpy_loader
        import data_state.order, data_state.cursor
        snap = PortableRun({str(pristine[0])!r}).read()
        ds = TokenDataset({tiny_dataset!r}, "train")
        cursor = {{"version": 1, "dataset": ds.fingerprint, "seed": 3, "epoch": 0,
                   "samples_consumed": 8}}
        loader = numpy_loader(ds, cursor, global_batch=8, microbatch_size=2)
        mbs = loader.next_step()
        loader.close()
        assert type(mbs[0].tokens).__module__ == "numpy", type(mbs[0].tokens)
        ds.close()
        print(len(snap.tensors), sorted(m for m in sys.modules if m.split(".")[0] == "torch"),
              flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    count, loaded = out.stdout.split(" ", 1)
    assert int(count) > 0 and loaded.strip() == "[]", out.stdout


# ------------------------------------------------------------------ reads what restore reads


def test_reads_a_ddp_snapshot_bitwise(pristine) -> None:  # noqa: F811
    path, refs = pristine
    snap = PortableRun(str(path)).read(4)
    want = refs[4][0]
    assert sorted(snap.tensors) == sorted(want)
    # Several checksum blocks per chunk (block_bytes=256): every one is verified on the way.
    assert max(len(c.crc32) for r in snap.manifest.tensors.values() for c in r.chunks) > 1
    for key, value in want.items():
        assert np.array_equal(snap.tensors[key], value.numpy()), key
        assert snap.tensors[key].dtype == value.numpy().dtype, key
    assert snap.component("data") == refs[4][1]["data"]


def _fsdp_worker(rank: int, world_size: int, run_uri: str) -> None:
    ts = build(seed=7, layout="fsdp", world_size=world_size)
    snap = Snapshotter(run_uri, ts.registry, rank, world_size,
                       settings=SnapshotSettings(layout="fsdp", snapshot_every=2,
                                                 split_min_bytes=64, durable=False))
    for step in (1, 2):
        train_step(ts, step)
        snap.after_step(step)
    snap.close()
    ref = full_state(ts)
    dist.barrier()
    if rank == 0:
        torch.save({k: v.numpy() for k, v in ref.items()}, os.path.join(run_uri, "..",
                                                                        "ref.pt"))


def test_reads_an_fsdp_snapshot_of_two_ranks_bitwise(tmp_path: Path) -> None:
    run_uri = str(tmp_path / "run")
    run_group(_fsdp_worker, 2, run_uri, tmp_dir=str(tmp_path))
    snap = PortableRun(run_uri).read()
    assert len(snap.manifest.files) == 2
    assert max(len(r.chunks) for r in snap.manifest.tensors.values()) > 1  # from both files
    want = torch.load(tmp_path / "ref.pt", weights_only=False)  # written by this test
    for key, value in want.items():
        assert np.array_equal(snap.tensors[key], value), key


# ------------------------------------------------------------------ crafted snapshots


def _flip_a_data_byte(run_dir: Path) -> None:
    start = _chunk(json.loads((_snapdir(run_dir) / MANIFEST_NAME).read_text()))["byte_range"][0]
    data = bytearray(_shard(run_dir).read_bytes())
    data[start + 3] ^= 0x40
    _shard(run_dir).write_bytes(bytes(data))


def _truncate(run_dir: Path) -> None:
    shard = _shard(run_dir)
    shard.write_bytes(shard.read_bytes()[:-16])


def _link_shard(run_dir: Path) -> None:
    shard = _shard(run_dir)
    outside = run_dir.parent / "elsewhere.safetensors"
    shutil.copy(shard, outside)
    shard.unlink()
    shard.symlink_to(outside)


def _shard_is_fifo(run_dir: Path) -> None:
    shard = _shard(run_dir)
    shard.unlink()
    os.mkfifo(shard)


def _consistent_dtype_edit(obj: dict[str, Any], shard: bytes) -> None:
    rec = obj["tensors"]["model.inp.weight"]
    rec["dtype"] = "F16"
    for c in rec["chunks"]:
        start, end = c["byte_range"]
        c["byte_range"] = [start, start + (end - start) // 2]
        c["crc32"] = crc32_blocks(shard[start:start + (end - start) // 2],
                                  obj["checksum"]["block_bytes"])


MANIFEST_EDITS = {
    "parent path": lambda obj: (_chunk(obj).update(file="../../../x"),
                                obj["files"].append("../../../x")),
    "absolute path": lambda obj: (_chunk(obj).update(file="/etc/passwd"),
                                  obj.update(files=["/etc/passwd"])),
    "file not listed": lambda obj: _chunk(obj).update(
        file="shard-00007-of-00009-g000001.safetensors"),
    "dtype alone": lambda obj: obj["tensors"]["model.inp.weight"].update(dtype="F16"),
    "byte range vs shape": lambda obj: _chunk(obj)["byte_range"].__setitem__(
        1, _chunk(obj)["byte_range"][1] + 4),
    "range past the end": lambda obj: _chunk(obj).update(
        byte_range=[b + 10**6 for b in _chunk(obj)["byte_range"]]),
    "negative shape": lambda obj: obj["tensors"]["model.inp.weight"].update(shape=[-24, 8]),
    "huge shape": lambda obj: (obj["tensors"]["model.inp.weight"].update(shape=[1 << 30] * 2),
                               _chunk(obj).update(shape=[1 << 30] * 2)),
    "no tensors": lambda obj: obj.update(tensors={}),
    "step a string": lambda obj: obj.update(step="4"),
    "world size a bool": lambda obj: obj.update(world_size=True),
    "layout": lambda obj: obj.update(layout="zero3"),
    "offsets a string": lambda obj: _chunk(obj).update(offsets=["0", 0]),
    "a checksum short": lambda obj: _chunk(obj).update(crc32=_chunk(obj)["crc32"][:-1]),
    "chunk name": lambda obj: _chunk(obj).update(name="model.inp.weight@1,0"),
    "unknown dtype": lambda obj: obj["tensors"]["model.inp.weight"].update(dtype="F31"),
    "tensor of another component": lambda obj: obj["state"]["data"].update(
        samples={"__tensor__": "model.inp.weight"}),
    "tensor referenced by no state": lambda obj: obj["state"]["model"].pop("inp.weight"),
}
def _manifest_is_fifo(run_dir: Path) -> None:
    (_snapdir(run_dir) / MANIFEST_NAME).unlink()
    os.mkfifo(_snapdir(run_dir) / MANIFEST_NAME)


FILE_EDITS = {"flipped byte": _flip_a_data_byte, "truncated shard": _truncate,
              "symlinked shard": _link_shard, "shard is a FIFO": _shard_is_fifo,
              "manifest is a FIFO": _manifest_is_fifo}


def _both_refuse(run_dir: Path) -> str:
    """The PyTorch verify and the neutral reader raise the same class and message."""
    with pytest.raises(SnapshotIntegrityError) as torch_side:
        verify(SnapshotStore(str(run_dir)), 4)
    with pytest.raises(SnapshotIntegrityError) as neutral:
        PortableRun(str(run_dir)).read(4)
    assert type(neutral.value) is type(torch_side.value)
    assert str(neutral.value) == str(torch_side.value)
    assert "\n" not in str(neutral.value)
    return str(neutral.value)


@pytest.mark.parametrize("case", sorted(MANIFEST_EDITS))
def test_crafted_manifest_is_refused_as_by_pytorch(run, case: str) -> None:  # noqa: F811
    _edit(run, MANIFEST_EDITS[case])
    message = _both_refuse(run)
    assert "000000004" in message or "snapshot 4" in message, message


def test_consistent_dtype_edit_is_refused_as_by_pytorch(run) -> None:  # noqa: F811
    shard = _shard(run).read_bytes()
    _edit(run, lambda obj: _consistent_dtype_edit(obj, shard))
    assert "is F32 in the file but F16 in the manifest" in _both_refuse(run)


@pytest.mark.parametrize("case", sorted(FILE_EDITS))
def test_crafted_shard_is_refused_as_by_pytorch(run, case: str) -> None:  # noqa: F811
    FILE_EDITS[case](run)
    done = threading.Event()
    if case == "shard is a FIFO":  # were an open to block on it, a writer ends it: fail
        def unblock() -> None:
            while not done.wait(20):
                try:
                    os.close(os.open(_shard(run), os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass

        threading.Thread(target=unblock, daemon=True).start()
    try:
        message = _both_refuse(run)
    finally:
        done.set()
    expected = {"flipped byte": "checksum mismatch", "truncated shard": "truncated",
                "symlinked shard": "symbolic link", "shard is a FIFO": "not a regular file",
                "manifest is a FIFO": "FIFO"}
    assert expected[case] in message, message


def test_a_linked_step_directory_is_no_snapshot_for_either(run, tmp_path) -> None:  # noqa: F811
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(_snapdir(run)), elsewhere)
    _snapdir(run).symlink_to(elsewhere)
    store = SnapshotStore(str(run))
    assert PortableRun(str(run)).committed_steps() == store.committed_steps() == [2]
    with pytest.raises(ValueError, match="not a committed snapshot"):
        PortableRun(str(run)).read(4)
    assert baton_main(["snapshots", "verify", str(run), "4"]) == 1


def test_bad_manifest_json_is_one_line(run) -> None:  # noqa: F811
    (_snapdir(run) / MANIFEST_NAME).write_bytes(b"\xff{")
    with pytest.raises(ManifestError, match="not valid JSON") as info:
        PortableRun(str(run)).read(4)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------ writes


def _scaled(snap_tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Different values, same shapes and dtypes (so a restore can tell it read ours)."""
    return {k: (v * 2 if v.dtype.kind == "f" else v) for k, v in snap_tensors.items()}


def test_written_snapshot_verifies_and_pytorch_restores_it(run) -> None:  # noqa: F811
    source = PortableRun(str(run)).read(4)
    before = read_generation(SnapshotStore(str(run)))
    state = json.loads(json.dumps(source.state))
    manifest = write_snapshot(str(run), 6, _scaled(source.tensors), state)
    store = SnapshotStore(str(run))
    assert store.committed_steps() == [2, 4, 6]
    assert read_generation(store) == before + 1
    assert manifest.files == [f"shard-00000-of-00001-g{before + 1:06d}.safetensors"]
    assert not store.exists(store.path("lease.json"))  # released
    assert verify(store, 6)["tensors"] == len(source.tensors)
    assert baton_main(["snapshots", "verify", str(run), "6"]) == 0
    ts = build(seed=11)
    restorer = Snapshotter(str(run), ts.registry)
    assert restorer.restore() == 6 and restorer.restore_errors == []
    got = full_state(ts)
    for key, value in _scaled(source.tensors).items():
        assert np.array_equal(got[key].numpy(), value), key
    assert json_state(ts)["data"] == source.component("data")


def test_writer_refuses_a_live_driver_and_old_steps(run) -> None:  # noqa: F811
    source = PortableRun(str(run)).read(4)
    store = SnapshotStore(str(run))
    holder = RunLease(store, ttl_s=60, holder={"host": "elsewhere", "pid": 1})
    holder.acquire()
    try:
        with pytest.raises(LeaseHeldError, match="held by another driver"):
            write_snapshot(str(run), 6, source.tensors, source.state)
    finally:
        holder.release()
    with pytest.raises(ValueError, match="not newer than the newest committed"):
        write_snapshot(str(run), 4, source.tensors, source.state)
    assert store.committed_steps() == [2, 4] and store.all_steps() == [2, 4]


def test_a_refused_state_leaves_nothing(run) -> None:  # noqa: F811
    source = PortableRun(str(run)).read(4)
    state = json.loads(json.dumps(source.state))
    state["model"]["ghost"] = {"__tensor__": "model.ghost"}  # names a tensor never written
    with pytest.raises(ValueError, match="ghost") as info:
        write_snapshot(str(run), 6, source.tensors, state)
    assert "\n" not in str(info.value)
    store = SnapshotStore(str(run))
    assert store.all_steps() == [2, 4] and not store.exists(store.path("lease.json"))
    with pytest.raises(ValueError, match="cannot hold"):
        write_snapshot(str(run), 6, {**source.tensors, "model.inp.weight":
                                     source.tensors["model.inp.weight"].astype(np.complex64)},
                       source.state)
    assert store.all_steps() == [2, 4]


@pytest.mark.parametrize("edit", ["step", "moment", "row", "scalar"])
def test_optimizer_state_of_another_shape_is_refused_in_one_line(run, edit: str) -> None:  # noqa: F811
    """A fresh optimizer adopts saved state as it is: a `step` of shape [1] (a writer's
    vector where torch keeps a scalar) trained on and was saved so; a transposed moment
    loaded and failed at the first optimizer step, and so did an AdamW moment of shape
    [1, N] or [] for an [M, N] parameter (sizes of 1 are Adafactor's factored variances,
    not AdamW's). Each is refused before the restore reads a byte, naming the state's
    path, nothing is moved, and a rewind to the snapshot named trains on."""
    source = PortableRun(str(run)).read(4)
    tensors = dict(source.tensors)
    if edit == "step":
        edited = sorted(k for k in tensors if k.endswith(".step"))
        assert edited, sorted(tensors)
        for key in edited:
            tensors[key] = tensors[key].reshape(1)
    else:
        edited = [next(k for k, v in sorted(tensors.items()) if k.endswith(".exp_avg")
                       and v.ndim == 2 and v.shape[0] != v.shape[1])]
        moment = tensors[edited[0]]
        tensors[edited[0]] = {"moment": np.ascontiguousarray(moment.T),
                              "row": np.ascontiguousarray(moment[:1]),
                              "scalar": np.asarray(moment.flat[0])}[edit]
    write_snapshot(str(run), 6, tensors, json.loads(json.dumps(source.state)))
    with pytest.raises(SnapshotMismatchError) as refused:
        Snapshotter(str(run), build(seed=11).registry).restore()
    message = str(refused.value)
    assert "\n" not in message and "snapshot 6" in message, message
    assert ("step is a scalar" if edit == "step" else "for a parameter of shape") in message
    assert edit in ("step", "moment") or "AdamW keeps it in the parameter's shape" in message
    assert "snapshot 4" in message  # the newest that fits, for a rewind
    assert SnapshotStore(str(run)).committed_steps() == [2, 4, 6]  # nothing set aside
    _rewind_and_train_on(run, to=4)


def _rewind_and_train_on(run_dir: Path, to: int) -> None:
    """The person's way out of a refusal: rewind to the snapshot named, which restores and
    trains on (nothing set aside is lost: it lies in quarantine/)."""
    newer = [s for s in SnapshotStore(str(run_dir)).committed_steps() if s > to]
    assert baton_main(["snapshots", "rewind", str(run_dir), "--to", str(to)]) == 0
    assert sorted(int(p.name.split("-")[0]) for p in (run_dir / "quarantine").iterdir()) == newer
    ts = build(seed=11)
    snap = Snapshotter(str(run_dir), ts.registry, settings=SnapshotSettings(snapshot_every=2))
    assert snap.restore() == to and snap.restore_errors == []
    train_step(ts, to + 1)
    train_step(ts, to + 2)
    snap.after_step(to + 2)
    snap.close()
    assert max(SnapshotStore(str(run_dir)).committed_steps()) == to + 2
    assert all(torch.isfinite(t).all() for t in full_state(ts).values())
