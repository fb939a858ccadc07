"""Replicas that differ in one element are never committed (issue 36, point 9).

A DDP group of 2 gloo processes (no Ray) snapshots every 2 steps. Rank 1 changes one element
of one weight for the capture of step 4 (in the rows rank 1 writes: the snapshot would hold
rank 1's value) and of step 6 (in the rows rank 0 writes: rank 1's replica would differ from
what is committed), each time one the sampled fingerprints do not look at, and puts it back
after the capture. Neither step commits, the coordinator's failure names the tensor and the
ranks, and step 8, whose replicas agree, commits rank 0's state bitwise. The unit tests below
check the checksums themselves and the receipts' check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from elastic.coord.receipts import Receipt, TensorSpec, manifest_from_receipts
from elastic.format.records import ChunkRecord, shard_filename
from elastic.replicas import fingerprints
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import build, full_state, restore_fresh, run_group, train_step
from elastic.write.replica_sums import replica_checksums

# step -> rows of model.mid.weight (10 x 24, split in two row blocks: rank 0 writes rows 0-4,
# rank 1 rows 5-9) where rank 1 changes one element for that step's capture.
BUMPED = {4: range(5, 10), 6: range(0, 5)}


def _unsampled(key: str, weight: torch.Tensor, rows: range, step: int) -> tuple[int, int]:
    """An element of ``rows`` whose change the sampled fingerprints of ``step`` miss."""
    before = fingerprints({key: weight}, step)[1]
    for row in rows:
        for col in range(weight.shape[1]):
            changed = weight.detach().clone()
            changed[row, col] += 1e-3
            if torch.equal(fingerprints({key: changed}, step)[1], before):
                return row, col
    raise AssertionError("every element is sampled")


def _diverging_rank(rank: int, world_size: int, run: str, out: str) -> None:
    torch.set_num_threads(1)
    ts = build(seed=7, layout="ddp", world_size=world_size)
    snap = Snapshotter(run, ts.registry, rank, world_size,
                       settings=SnapshotSettings(layout="ddp", snapshot_every=2, keep_last=5,
                                                 durable=False, split_min_bytes=64,
                                                 block_bytes=256))
    key = next(k for k in ts.registry.flatten(ts.registry.model_keys()).tensors
               if k.startswith("model.") and k.endswith("mid.weight"))
    weight = dict(ts.model.named_parameters())["module.mid.weight"]  # DDP's own name
    for step in range(1, 9):
        train_step(ts, step)
        where = _unsampled(key, weight, BUMPED[step], step) if (
            rank == 1 and step in BUMPED) else None
        with torch.no_grad():
            if where is not None:
                weight[where] += 1e-3
            snap.after_step(step)
            snap.persister.wait()
            if where is not None:
                weight[where] -= 1e-3  # bitwise back: the next step agrees again
        if rank == 0 and step == 8:
            save_file(full_state(ts), str(Path(out, "state-8.safetensors")))
    snap.close()
    if rank == 0:
        failures = snap.coordinator.health()["failures"]
        Path(out, "failures.json").write_text(json.dumps({"key": key, "failures": failures}))


def test_replicas_that_differ_in_one_element_are_never_committed(tmp_path: Path) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    run_group(_diverging_rank, 2, str(run), str(out), tmp_dir=str(tmp_path))
    store = SnapshotStore(str(run))
    assert store.committed_steps() == [2, 8]
    report = json.loads((out / "failures.json").read_text())
    reasons = {f["step"]: f["reason"] for f in report["failures"]}
    for step in (4, 6):
        assert reasons[step] == (
            f"snapshot {step} not committed: {report['key']} differs between ranks 0 and 1 "
            "(replicated state diverged: a model not wrapped in DDP/FSDP, or a rank-dependent "
            "update); the previous committed snapshot is intact")
    step, state = restore_fresh(str(run))
    assert step == 8
    for name, value in load_file(out / "state-8.safetensors").items():
        assert torch.equal(state[name], value), name


def test_a_checksum_covers_every_element_of_every_dtype() -> None:
    tensors = {"w": torch.randn(7, 5), "h": torch.randn(4, 6).to(torch.bfloat16),
               "t": torch.randn(6, 4).t(), "step": torch.tensor(3.0), "empty": torch.zeros(0),
               "mask": torch.ones(3, dtype=torch.bool)}
    sums = replica_checksums(tensors)
    assert sorted(sums) == sorted(tensors)
    assert replica_checksums({k: v.clone() for k, v in tensors.items()}) == sums
    for key, tensor in tensors.items():
        for index in range(tensor.numel()):
            changed = tensor.clone()  # as strided as the original ("t" is a transposed view)
            where = tuple(int(i) for i in torch.unravel_index(torch.tensor(index),
                                                                tensor.shape))
            changed[where] = ~changed[where] if tensor.dtype == torch.bool else changed[where] + 1
            assert replica_checksums({key: changed})[key] != sums[key], (key, index)


def test_the_receipts_check_names_the_tensor_and_the_ranks() -> None:
    def receipt(rank: int, replicas: dict[str, int]) -> Receipt:
        file = shard_filename(rank, 3, 1)
        chunk = ChunkRecord(file=file, name=f"w@{rank}", offsets=(rank,), shape=(1,),
                            byte_range=(8, 12), crc32=(0,))
        head: dict[str, Any] = {} if rank else {
            "skeletons": {"model": {"w": {"__tensor__": "model.w"}}},
            "catalog": {"model.w": TensorSpec("F32", (3,))}}
        return Receipt(step=2, rank=rank, world_size=3, generation=1, layout="ddp", file=file,
                       chunks={"model.w": (chunk,)}, versions={}, replicas=replicas, **head)

    agree = {"model.w": 7, "optim.w": 9}
    receipts = {r: receipt(r, agree) for r in range(3)}
    receipts[2] = Receipt.from_json(receipts[2].to_json())  # as it crosses Ray or the disk
    assert receipts[2].replicas == agree
    with pytest.raises(ValueError, match="crc32"):
        Receipt.from_json({**receipts[1].to_json(), "replicas": {"model.w": -1}})
    receipts[2] = receipt(2, {"model.w": 7, "optim.w": 10})
    with pytest.raises(ValueError) as info:
        manifest_from_receipts(2, 3, 1, receipts, block_bytes=256, versions={})
    assert str(info.value).startswith("snapshot 2 not committed: optim.w differs between "
                                      "ranks 0 and 2 (replicated state diverged")
