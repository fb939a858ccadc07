"""Corruption, model mismatch, no-pickle loading, the CLI and third-party readability."""

from __future__ import annotations

import json
import os
import pickle
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from elastic.format.records import MANIFEST_NAME, shard_filename, step_dirname
from elastic.read.restore import SnapshotMismatchError
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.testing import TrainState, build, full_state, json_state, train_step
from trainer.cli import main as baton_main


def _train_run(run: str, steps: int = 4, every: int = 2) -> dict[int, dict[str, torch.Tensor]]:
    """Train with snapshots every `every` steps; return the full state at each snapshot."""
    ts = build(seed=3)
    snap = Snapshotter(run, ts.registry,
                       settings=SnapshotSettings(snapshot_every=every, keep_last=5, durable=False,
                                                 block_bytes=256, split_min_bytes=64))
    refs = {}
    for step in range(1, steps + 1):
        train_step(ts, step)
        snap.after_step(step)
        snap.persister.wait()
        if step % every == 0:
            refs[step] = full_state(ts)
    snap.close()
    return refs


def _restore(run: str) -> tuple[Snapshotter, TrainState, int]:
    ts = build(seed=11)
    snap = Snapshotter(run, ts.registry)
    return snap, ts, snap.restore()


def _shard(run: str, step: int) -> str:
    # One Snapshotter wrote the whole run: worker-group generation 1.
    return os.path.join(run, "snapshots", step_dirname(step), shard_filename(0, 1, 1))


def _assert_state(ts: TrainState, ref: dict[str, torch.Tensor]) -> None:
    got = full_state(ts)
    assert sorted(got) == sorted(ref)
    for key, value in ref.items():
        assert torch.equal(got[key], value), key


def test_flipped_bytes_fall_back_to_previous(tmp_path) -> None:
    run = str(tmp_path / "run")
    refs = _train_run(run)
    path = _shard(run, 4)
    manifest = json.load(open(os.path.join(os.path.dirname(path), MANIFEST_NAME)))
    chunk = manifest["tensors"]["optim.state.inp.weight.exp_avg"]["chunks"][0]
    with open(path, "r+b") as fh:
        fh.seek(chunk["byte_range"][0] + 5)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    snap, ts, step = _restore(run)
    assert step == 2
    assert any(
        "snapshot 4" in e and "checksum mismatch" in e and chunk["name"] in e
        for e in snap.restore_errors
    ), snap.restore_errors
    _assert_state(ts, refs[2])
    # The unreadable snapshot 4 was quarantined (kept, out of the way), so training can
    # commit step 4 again.
    assert snap.coordinator.committed_steps() == [2]
    assert os.path.exists(os.path.join(run, "quarantine", step_dirname(4), "reason.json"))
    assert baton_main(["snapshots", "verify", run]) == 0  # newest is now 2, which is fine


def test_truncated_file_falls_back(tmp_path) -> None:
    run = str(tmp_path / "run")
    refs = _train_run(run)
    path = _shard(run, 4)
    size = os.path.getsize(path)
    assert baton_main(["snapshots", "verify", run, "4"]) == 0
    with open(path, "r+b") as fh:
        fh.truncate(size // 2)
    assert baton_main(["snapshots", "verify", run, "4"]) == 1
    snap, ts, step = _restore(run)
    assert step == 2 and any("truncated" in e for e in snap.restore_errors), snap.restore_errors
    _assert_state(ts, refs[2])


def test_missing_manifest_means_not_committed(tmp_path, capsys) -> None:
    run = str(tmp_path / "run")
    refs = _train_run(run)
    os.remove(os.path.join(run, "snapshots", step_dirname(4), MANIFEST_NAME))
    assert baton_main(["snapshots", "ls", run, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["committed"]) for r in rows] == [(2, True), (4, False)]
    snap, ts, step = _restore(run)
    assert step == 2
    assert any("step 4" in e and "leftover" in e for e in snap.coordinator.events())
    _assert_state(ts, refs[2])


def test_different_model_is_a_clear_error(tmp_path) -> None:
    run = str(tmp_path / "run")
    _train_run(run)
    ts = build(seed=1)
    ts.model.extra = torch.nn.Linear(3, 3)  # unexpected-by-snapshot -> missing in snapshot
    ts.model.out = torch.nn.Linear(10, 5)  # shape mismatch
    del ts.model.mid  # present in snapshot -> unexpected
    from elastic.state.registry import StateRegistry

    reg = StateRegistry()
    reg.register("model", ts.model)
    with pytest.raises(SnapshotMismatchError) as info:
        Snapshotter(run, reg).restore()
    text = str(info.value)
    assert "missing ['model.extra.bias', 'model.extra.weight']" in text
    assert "unexpected ['model.mid.bias', 'model.mid.weight']" in text
    assert "'model.out.weight': ([2, 10], [5, 10])" in text


def test_restore_never_unpickles(tmp_path, monkeypatch) -> None:
    run = str(tmp_path / "run")
    refs = _train_run(run)

    def refuse(*args, **kwargs):
        raise AssertionError("a snapshot load tried to unpickle")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    snap, ts, step = _restore(run)
    assert step == 4 and snap.restore_errors == []
    _assert_state(ts, refs[4])


def test_cli_show_export_and_plain_safetensors_reader(tmp_path, capsys) -> None:
    run = str(tmp_path / "run")
    _train_run(run)
    assert baton_main(["snapshots", "show", run, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 4 and info["tensors"]["model.inp.weight"]["shape"] == [24, 8]
    assert info["state"]["data"] == {"samples": 24}
    out = str(tmp_path / "weights.safetensors")
    assert baton_main(["snapshots", "export", run, "--out", out]) == 0
    ts = build(seed=11)
    Snapshotter(run, ts.registry).restore()
    weights = load_file(out)
    assert sorted(weights) == sorted(ts.model.state_dict())
    for k, v in ts.model.state_dict().items():
        assert torch.equal(weights[k], v)

    # A third-party reader: only json + safetensors, following the documented format.
    snapdir = os.path.join(run, "snapshots", step_dirname(4))
    manifest = json.load(open(os.path.join(snapdir, MANIFEST_NAME)))
    rec = manifest["tensors"]["optim.state.inp.weight.exp_avg"]
    full = torch.empty(rec["shape"], dtype=torch.float32)
    for c in rec["chunks"]:
        with safe_open(os.path.join(snapdir, c["file"]), "pt") as fh:
            part = fh.get_tensor(c["name"])
        with open(os.path.join(snapdir, c["file"]), "rb") as fh:  # byte_range is exact
            (hlen,) = struct.unpack("<Q", fh.read(8))
            assert c["byte_range"][0] >= 8 + hlen
        sl = tuple(slice(o, o + s) for o, s in zip(c["offsets"], c["shape"], strict=True))
        full[sl] = part
    assert torch.equal(full, ts.optim.state_dict()["state"][0]["exp_avg"])
    assert json_state(ts)["data"] == {"samples": 24}
