"""The data pipeline against a real S3 API over HTTP on 127.0.0.1 (moto's server): prepare,
read and resume on S3 give the same bytes, fingerprints and batches as on local disk."""

from __future__ import annotations

import threading
from pathlib import Path

import boto3
import numpy as np
import pytest
import torch

from data_state.corpus import prepare_corpus
from data_state.dataset import TokenDataset
from data_state.loader import ResumableLoader
from data_state.manifest import DatasetError

_PREP = {
    "seq_len": 64,
    "max_bytes": 60_000,
    "rows_per_group": 8,
    "sequences_per_shard": 200,
    "progress": False,
}


def _steps(ds: TokenDataset, world_size: int, num_steps: int, state: dict | None = None):
    """`num_steps` steps of every worker's microbatches (by microbatch index), and the cursor."""
    loaders = [
        ResumableLoader(
            ds, global_batch=16, microbatch_size=2, seed=11, rank=r, world_size=world_size
        )
        for r in range(world_size)
    ]
    steps = []
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    for _ in range(num_steps):
        mbs = sorted((mb for ld in loaders for mb in ld.next_step()), key=lambda mb: mb.index)
        steps.append([(mb.sample_indices, mb.tokens) for mb in mbs])
        for ld in loaders:
            ld.advance()
    state = loaders[0].state_dict()
    for ld in loaders:
        ld.close()
    return steps, state


def _same(a: list, b: list) -> bool:
    return all(
        ia == ib and torch.equal(ta, tb)
        for sa, sb in zip(a, b, strict=True)
        for (ia, ta), (ib, tb) in zip(sa, sb, strict=True)
    )


def test_prepare_read_and_resume_on_s3_match_local(s3_bucket: str, tmp_path: Path) -> None:
    uri = f"s3://{s3_bucket}/corpus"
    prepare_corpus(None, uri, **_PREP)
    prepare_corpus(None, str(tmp_path), **_PREP)
    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert "corpus/dataset.json" in keys and "corpus/train/part-00000.parquet" in keys
    assert (tmp_path / "dataset.json").read_bytes() == boto3.client("s3").get_object(
        Bucket=s3_bucket, Key="corpus/dataset.json"
    )["Body"].read()

    with TokenDataset(uri) as remote, TokenDataset(str(tmp_path)) as local:
        assert remote.fingerprint == local.fingerprint and len(remote) == len(local)
        order = np.random.default_rng(1).permutation(len(local))
        assert np.array_equal(remote.read(order), local.read(order))
        remote.verify()

        uninterrupted, _ = _steps(local, 1, 6)
        s3_steps, s3_state = _steps(remote, 2, 3)  # 3 steps on S3 with 2 workers
        assert _same(s3_steps, uninterrupted[:3])
        # Resume the S3 run from its cursor on the local copy with 3 workers, and vice versa.
        rest_local, _ = _steps(local, 3, 3, s3_state)
        rest_s3, _ = _steps(remote, 1, 3, s3_state)
        assert _same(rest_local, uninterrupted[3:]) and _same(rest_s3, uninterrupted[3:])


def test_s3_errors_name_the_object(s3_bucket: str) -> None:
    uri = f"s3://{s3_bucket}/corpus"
    with pytest.raises(DatasetError, match=f"{s3_bucket}/corpus/dataset.json not found"):
        TokenDataset(uri)
    prepare_corpus(None, uri, **_PREP)
    boto3.client("s3").delete_object(Bucket=s3_bucket, Key="corpus/train/part-00001.parquet")
    with pytest.raises(DatasetError, match="part-00001.parquet listed in the manifest is missing"):
        TokenDataset(uri)
    # The failed open ended its I/O threads.
    assert not [t for t in threading.enumerate() if t.name.startswith("baton-data-io")]


def test_endpoint_and_credentials_come_from_the_aws_environment(
    s3_endpoint: object, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    from data_state.storage import resolve

    # botocore itself honours AWS_ENDPOINT_URL: a bare s3fs client reaches the moto server.
    s3fs.S3FileSystem(skip_instance_cache=True).pipe(f"{s3_bucket}/probe", b"ok")
    io, path = resolve(f"s3://{s3_bucket}/data/")
    assert path == f"{s3_bucket}/data" and io.read_file(f"{s3_bucket}/probe") == b"ok"
    # The endpoint is passed explicitly: a changed one is never served from fsspec's cache.
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    assert resolve(f"s3://{s3_bucket}")[0].fs.client_kwargs["endpoint_url"] == "http://127.0.0.1:9"
    explicit = resolve(f"s3://{s3_bucket}", {"endpoint_url": "http://127.0.0.1:8"})[0]
    assert explicit.fs.endpoint_url == "http://127.0.0.1:8"  # storage_options win
    assert "endpoint_url" not in explicit.fs.client_kwargs
    with pytest.raises(ValueError, match="unsupported dataset URI scheme 'gs'"):
        resolve("gs://bucket/x")


def test_storage_outage_fails_the_step_and_a_retry_resumes(s3_endpoint, s3_bucket: str) -> None:
    """Storage cut mid-run: `next_step()` raises the storage error (after the storage layer's
    retries, under a short deadline here), the committed cursor does not move, and once the
    endpoint is back the same step is served."""
    uri = f"s3://{s3_bucket}/corpus"
    prepare_corpus(None, uri, **_PREP)
    # A short retry deadline, so the outage surfaces in seconds.
    with (
        TokenDataset(uri, cache_bytes=0, storage_retry_s=2.0) as ds,
        TokenDataset(uri) as reference,
    ):
        loader = ResumableLoader(ds, global_batch=8, microbatch_size=2, seed=0, prefetch_steps=1)
        loader.next_step()
        loader.advance()
        s3_endpoint.stop()
        try:
            with pytest.raises(Exception, match="Could not connect to the endpoint"):
                for _ in range(3):  # the first step may already sit in the prefetch queue
                    loader.next_step()
                    loader.advance()
        finally:
            s3_endpoint.start()
        committed = loader.state_dict()["samples_consumed"]
        assert committed in (8, 16)
        again = loader.next_step()
        expected = ResumableLoader(reference, global_batch=8, microbatch_size=2, seed=0)
        expected.load_state_dict(loader.state_dict())
        assert [mb.sample_indices for mb in again] == [
            mb.sample_indices for mb in expected.next_step()
        ]
        expected.close()
        loader.close()
