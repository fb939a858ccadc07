"""Shared test fixtures.

`s3_endpoint`: a real S3 API over HTTP on 127.0.0.1 (moto's server, in this process, on a free
port), with credentials and endpoint exported the standard AWS way so s3fs/boto3 find it.
Each test that asks for `s3_bucket` gets a fresh, empty bucket on that server.
`s3_faults`: a fault-injecting proxy in front of that server, for one test (see its docstring).
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
from ray_harness import free_port

if TYPE_CHECKING:
    from pathlib import Path

    from inprocess_fit import InProcessFit
    from s3_fault_proxy import S3FaultProxy

# Every Ray process the tests start listens on 127.0.0.1 only (see trainer/on_ray/local_cluster.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")



@dataclass
class S3Endpoint:
    """A running moto server; `stop()`/`start()` simulate the endpoint going away and back."""

    url: str
    port: int
    server: object

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server.start()


@contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Set environment variables for the block; restore (or remove) them afterwards. (Not
    monkeypatch: the S3 server is session-scoped.)"""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        with _environ(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=url,
                      AWS_ENDPOINT_URL_S3=url):
            yield S3Endpoint(url=url, port=port, server=server)
    finally:
        server.stop()




@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small slice of the embedded corpus (seq_len 32, as in recipes/tiny.toml)."""
    from data_state import prepare_corpus

    out = str(tmp_path_factory.mktemp("tiny-data") / "corpus")
    prepare_corpus(None, out, seq_len=32, max_bytes=1_000_000, progress=False)
    return out


@pytest.fixture
def s3_bucket(s3_endpoint: S3Endpoint) -> str:
    """A new empty bucket; returns its name. Created with boto3 (s3fs mkdir fails on moto)."""
    import boto3

    name = f"baton-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint.url).create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_faults(s3_endpoint: S3Endpoint) -> Iterator[S3FaultProxy]:
    """A fault-injecting proxy (tests/s3_fault_proxy.py) in front of the moto server; for this
    test AWS_ENDPOINT_URL(_S3) point at it, so new stores and clients go through it."""
    from s3_fault_proxy import S3FaultProxy

    proxy = S3FaultProxy(s3_endpoint.url)
    try:
        with _environ(AWS_ENDPOINT_URL=proxy.url, AWS_ENDPOINT_URL_S3=proxy.url):
            yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def fake_fit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> InProcessFit:
    """`baton fit` without Ray: `tests/inprocess_fit.InProcessFit` in place of Ray's fit."""
    from inprocess_fit import InProcessFit

    import trainer.on_ray.ray_fit

    fake = InProcessFit(tmp_dir=str(tmp_path))
    monkeypatch.setattr(trainer.on_ray.ray_fit, "fit", fake)
    # `baton fit` connects to Ray before its fit thread starts; the stand-in needs no Ray,
    # and a Ray left running in this test process would outlive the test.
    monkeypatch.setattr(trainer.on_ray.ray_fit, "connect_ray", lambda: False)
    return fake


def _starts_ray_clusters(item: pytest.Item) -> bool:
    """A slow test of `tests/ray/`: the tests that start Ray clusters."""
    return item.get_closest_marker("slow") is not None and item.path.parent.name == "ray"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under `--dist loadgroup` every slow Ray test must carry xdist's group suffix: without it
    two Ray clusters run at once on the two xdist workers, and node-loss tests time out."""
    # xdist's workers set option.loadgroup; a plain (one-process) run has no such option.
    if not getattr(session.config.option, "loadgroup", False):
        return
    ungrouped = [i.nodeid for i in session.items
                 if _starts_ray_clusters(i) and not i.nodeid.endswith("@slow")]
    if ungrouped:
        message = (f"{len(ungrouped)} slow tests are not in the xdist group 'slow' (e.g. "
                   f"{ungrouped[0]}); this pytest/pytest-xdist pair does not apply "
                   "xdist_group: see the pytest pin in pyproject.toml")
        sys.stderr.write(message + "\n")  # a worker's UsageError reaches the log as an assert
        raise pytest.UsageError(message)


# tryfirst: xdist's worker reads the xdist_group marks in its own modifyitems hook (it suffixes
# each node id with the group); a mark added after it would not group anything.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests where CUDA is absent and `multigpu` tests where there are fewer than two
    GPUs, with the reason shown in the summary; put every `slow` test of `tests/ray/` in one
    xdist group.

    Why the group: `make test` runs pytest-xdist with two workers (`--dist loadgroup`). The
    slow Ray tests (Ray clusters, node kills, failure detection on 1 s health checks) then run
    one at a time on one worker, while the other worker runs everything else, the slow tests
    without Ray included (process groups of their own, no cluster); most of a Ray test's time
    is spent waiting, so the two overlap well on 2 cores, and the suite takes about as long
    as the Ray tests in a row."""
    slow_group = pytest.mark.xdist_group("slow")
    for item in items:
        if _starts_ray_clusters(item):
            item.add_marker(slow_group)
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        gpus = 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multigpu = pytest.mark.skip(reason=f"needs two CUDA GPUs or more ({gpus} here)")
    for item in items:
        if gpus == 0 and item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
        elif gpus < 2 and item.get_closest_marker("multigpu") is not None:
            item.add_marker(skip_multigpu)
