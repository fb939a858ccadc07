"""Large S3 objects go up as multipart uploads in parallel parts (elastic/storage/s3_multipart.py
via Storage.write_file): bitwise round trips, a failed part re-sent alone, and a failure mid-upload
leaves no object, no upload and no commit. Against moto, through the fault-injecting proxy
(tests/s3_fault_proxy.py) where requests are counted or failed."""

from __future__ import annotations

import os
import re

import boto3
import pytest
import torch
from torch import nn

import elastic.storage.storage_io as storage_io
from elastic.faults import FaultInjector
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.state.registry import StateRegistry
from elastic.storage import Storage
from elastic.storage.s3_multipart import multipart_etag, part_ranges
from elastic.store.snapshot_store import SnapshotStore

PART = 5 << 20  # S3's smallest part


def _storage(bucket: str) -> Storage:
    # Short deadlines: a part refused for good fails the write in seconds.
    return Storage(f"s3://{bucket}/objs", multipart_threshold=PART, part_bytes=PART,
                   part_concurrency=3, timeout_s=10.0, retry_deadline_s=10.0)


def _uploads(endpoint_url: str, bucket: str) -> list[str]:
    """Keys of the multipart uploads still open in ``bucket`` (straight to moto)."""
    client = boto3.client("s3", endpoint_url=endpoint_url)
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def _parts(requests: list[tuple[str, str]], key: str) -> list[int]:
    return [int(m.group(1)) for method, target in requests
            if method == "PUT" and key in target
            and (m := re.search(r"partNumber=(\d+)", target)) is not None]


def test_part_ranges_respect_s3_limits() -> None:
    assert part_ranges(12, PART) == [(0, 12)]
    assert part_ranges(2 * PART + 1, PART) == [(0, PART), (PART, 2 * PART),
                                                (2 * PART, 2 * PART + 1)]
    huge = part_ranges(10_001 * PART, PART)  # would be 10,001 parts: parts grow instead
    assert len(huge) <= 10_000 and huge[-1][1] == 10_001 * PART
    assert multipart_etag(['"00"', '"01"']).endswith('-2"')


def test_multipart_round_trip_is_bitwise_and_sends_no_whole_object(s3_faults, s3_endpoint,
                                                                    s3_bucket) -> None:
    storage = _storage(s3_bucket)
    data = os.urandom(3 * PART + 12345)
    path = storage.path("big.bin")
    storage.write_file(path, memoryview(data), exclusive=True)
    assert storage.read_file(path) == data
    assert sorted(_parts(s3_faults.requests, "big.bin")) == [1, 2, 3, 4]
    # No single PUT of the object, and nothing left open.
    assert not [t for m, t in s3_faults.requests if m == "PUT" and t.endswith("big.bin")]
    assert _uploads(s3_endpoint.url, s3_bucket) == []
    # The ETag S3 gives it is the one the parts make (what an ambiguous completion checks).
    head = storage.s3_request("head", path, "head_object")
    assert head["ETag"].endswith('-4"')
    # Create-only: a second write is refused before a part is sent; the object is unchanged.
    s3_faults.clear()
    with pytest.raises(FileExistsError):
        storage.write_file(path, os.urandom(2 * PART), exclusive=True)
    assert _parts(s3_faults.requests, "big.bin") == []
    assert storage.read_file(path) == data
    # Overwriting is allowed without exclusive.
    other = os.urandom(2 * PART)
    storage.write_file(path, other)
    assert storage.read_file(path) == other


def test_a_part_failing_transiently_is_resent_alone(s3_faults, s3_endpoint, s3_bucket) -> None:
    storage = _storage(s3_bucket)
    data = os.urandom(3 * PART)
    rule = s3_faults.add_rule("PUT", r"flaky\.bin\?(.*&)?partNumber=2(&|$)", "status",
                              status=503, times=2)
    storage.write_file(storage.path("flaky.bin"), data)
    assert rule.hits == 2
    sent = _parts(s3_faults.requests, "flaky.bin")
    assert sent.count(2) == 3 and sent.count(1) == 1 and sent.count(3) == 1
    assert storage.read_file(storage.path("flaky.bin")) == data
    assert _uploads(s3_endpoint.url, s3_bucket) == []


def test_a_part_refused_for_good_aborts_the_upload(s3_faults, s3_endpoint, s3_bucket) -> None:
    storage = _storage(s3_bucket)
    s3_faults.add_rule("PUT", r"refused\.bin\?(.*&)?partNumber=3(&|$)", "status", status=403,
                       times=None)
    path = storage.path("refused.bin")
    with pytest.raises(OSError):
        storage.write_file(path, os.urandom(4 * PART))
    assert not storage.exists(path)
    assert _uploads(s3_endpoint.url, s3_bucket) == []
    assert any("uploadId=" in t for m, t in s3_faults.requests if m == "DELETE")


def _model_state() -> tuple[nn.Module, torch.optim.Optimizer, StateRegistry]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 4))  # ~12.6 MB with AdamW
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    registry = StateRegistry()
    registry.register("model", model)
    registry.register("optim", optim)
    return model, optim, registry


def _train(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    optim.zero_grad()
    model(torch.randn(4, 1024, generator=torch.Generator().manual_seed(step))).square() \
        .mean().backward()
    optim.step()


def test_a_fault_mid_upload_leaves_no_object_and_no_commit(s3_faults, s3_endpoint, s3_bucket,
                                                           monkeypatch) -> None:
    monkeypatch.setattr(storage_io, "MULTIPART_THRESHOLD_BYTES", PART)
    monkeypatch.setattr(storage_io, "PART_BYTES", PART)
    run = f"s3://{s3_bucket}/runs/multipart"
    model, optim, registry = _model_state()
    faults = FaultInjector().arm("persist_mid", step=2)
    snap = Snapshotter(run, registry, faults=faults,
                       settings=SnapshotSettings(ram=False, storage_timeout_s=10.0,
                                                 storage_retry_s=10.0))
    saved: dict[str, torch.Tensor] = {}
    for step in (1, 2):
        _train(model, optim, step)
        snap.after_step(step, force=True)
        snap.persister.wait()
        if step == 1:
            saved = {k: v.detach().clone() for k, v in registry.flatten().tensors.items()}
    snap.close()
    store = SnapshotStore(run)
    assert faults.fired == [(0, 2, "persist_mid")]
    assert store.committed_steps() == [1]
    # Step 1 went up in parts; step 2's upload was aborted half way: no object, no upload.
    (shard,) = [n for n in store.step_files(1) if n.endswith(".safetensors")]
    assert len(set(_parts(s3_faults.requests, f"000000001/{shard}"))) >= 2
    assert len(set(_parts(s3_faults.requests, "000000002/"))) >= 1
    assert [n for n in store.step_files(2) if n.endswith(".safetensors")] == []
    assert _uploads(s3_endpoint.url, s3_bucket) == []
    _, _, fresh = _model_state()
    restorer = Snapshotter(run, fresh, settings=SnapshotSettings(ram=False))
    assert restorer.restore() == 1
    for key, value in saved.items():
        assert torch.equal(fresh.flatten().tensors[key], value), key
