"""The S3 part of `benchmarks/snapshot_scale/run.py`: a Baton snapshot persisted to and restored
from S3 (a moto server in its own process on this machine) against torch.save into memory +
boto3's managed upload (multipart, 10 threads) and its download + torch.load, the two sides
of each pair alternating which goes first.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import alternating, moto_s3, timed
from benchmarks.snapshot_scale.sides import baton_restore, build, torch_restore, train_step
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.store.snapshot_store import SnapshotStore


def measure_s3(size: float, rounds: int) -> dict[str, Any]:
    """Persist and restore through S3 (moto in its own process) against torch.save into
    memory + boto3's managed upload and its download + torch.load, alternating; round 0
    warms up."""
    import boto3

    model, optim, registry = build(size)
    train_step(model, optim, 1)
    with moto_s3(own_process=True) as url:
        client = boto3.client("s3", endpoint_url=url)
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        client.create_bucket(Bucket=bucket)
        run = f"s3://{bucket}/run"
        snap = Snapshotter(run, registry, settings=SnapshotSettings(keep_last=2, ram=False))
        store = SnapshotStore(run)
        rows: dict[str, list[float]] = {k: [] for k in (
            "s3_persist", "s3_save", "s3_restore", "s3_load")}
        for r in range(rounds + 1):
            step = r + 2
            train_step(model, optim, step)
            key = f"torch/state-{step}.pt"

            def baton_save(step: int = step) -> None:
                snap.after_step(step, force=True)
                snap.persister.wait()

            def baseline_save(key: str = key) -> None:
                buffer = io.BytesIO()
                torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, buffer)
                buffer.seek(0)
                client.upload_fileobj(buffer, bucket, key)

            def baton_load(step: int = step) -> None:
                baton_restore(registry, store, step)

            def baseline_load(key: str = key) -> None:
                buffer = io.BytesIO()
                client.download_fileobj(bucket, key, buffer)
                buffer.seek(0)
                torch_restore(model, optim, buffer)

            pairs: list[list[tuple[str, Callable[[], None]]]] = [
                [("s3_persist", baton_save), ("s3_save", baseline_save)],
                [("s3_restore", baton_load), ("s3_load", baseline_load)]]
            for pair in pairs:
                for name, fn in alternating(pair, r):
                    took = timed(fn)
                    if r:
                        rows[name].append(took)
                assert snap.persister.last_error is None, snap.persister.last_error
            client.delete_object(Bucket=bucket, Key=key)
        snap.close()
    return rows
