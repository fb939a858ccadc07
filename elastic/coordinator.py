"""The run's coordinator as a Ray actor (the only Ray-specific module of ``elastic``).

Contract
--------
``get_or_create_coordinator(run_uri)`` returns a handle to the named actor
``baton-coordinator-<run>`` in namespace ``baton`` (``get_if_exists``), placed on the head
node (the ``node:__internal_head__`` resource, as Ray's own state actor does) with
``max_restarts=-1``. The actor is a thin wrapper around ``LocalCoordinator``: all protocol
logic (receipts, commit, GC, abort, rebuild-from-store) lives in ``elastic.commit`` and
is tested without Ray. When the actor restarts it rebuilds its view from the store (no
committed snapshot is lost; the in-memory copy is, so restores fall back to storage).

The in-memory copy of the newest snapshot lives in the actor's process on the head node:
workers send their shard-file bytes with ``put_ram``, so losing a worker node does not lose
them, and ``read_ram`` returns only the byte ranges a restoring worker asks for. (At scale
the copies would go to peers on other nodes; the client interface stays the same.)

``RayCoordinatorClient(handle)`` is what a worker passes to ``Snapshotter(coordinator=...)``.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import ray

from elastic.commit import LocalCoordinator
from elastic.format import DEFAULT_BLOCK_BYTES
from elastic.store import SnapshotStore

NAMESPACE = "baton"
_HEAD_RESOURCE = "node:__internal_head__"
# Ask for this to place an actor on the head node (which outlives any worker node).
HEAD_NODE_RESOURCES = {_HEAD_RESOURCE: 0.001}


@ray.remote(num_cpus=0)
class CoordinatorActor:
    def __init__(self, run_uri: str, keep_last: int, block_bytes: int,
                 storage_options: dict[str, Any] | None, ram: bool) -> None:
        self.local = LocalCoordinator(SnapshotStore(run_uri, storage_options),
                                      keep_last=keep_last, block_bytes=block_bytes, ram=ram)

    def put_ram(self, step: int, rank: int, file: str, data: bytes) -> None:
        self.local.put_ram(step, rank, file, data)

    def report_shard(self, receipt: dict[str, Any]) -> int | None:
        return self.local.report_shard(receipt)

    def report_failure(self, step: int, rank: int, reason: str) -> None:
        self.local.report_failure(step, rank, reason)

    def worker_lost(self, rank: int) -> None:
        self.local.worker_lost(rank)

    def committed_steps(self) -> list[int]:
        return self.local.committed_steps()

    def read_ram(self, step: int, requests: list[tuple[str, int, int]]) -> list[bytes] | None:
        return self.local.read_ram(step, requests)

    def read_manifest(self, step: int) -> bytes | None:
        return self.local.read_manifest(step)

    def rewind(self, step: int) -> None:
        self.local.rewind(step)

    def events(self) -> list[str]:
        return self.local.events()

    def request_snapshot(self) -> None:
        self.local.request_snapshot()

    def snapshot_requested(self) -> bool:
        return self.local.snapshot_requested()

    def answer_request(self, step: int) -> None:
        self.local.answer_request(step)

    def request_met(self) -> bool:
        return self.local.request_met()

    def cancel_request(self) -> None:
        self.local.cancel_request()


def coordinator_name(run_uri: str) -> str:
    tail = re.sub(r"[^A-Za-z0-9_.-]", "-", run_uri.rstrip("/").rsplit("/", 1)[-1])[:40]
    digest = hashlib.blake2b(run_uri.encode(), digest_size=4).hexdigest()
    return f"baton-coordinator-{tail}-{digest}"


def get_or_create_coordinator(run_uri: str, *, keep_last: int = 2,
                              block_bytes: int = DEFAULT_BLOCK_BYTES,
                              storage_options: dict[str, Any] | None = None, ram: bool = True,
                              on_head: bool = True, detached: bool = False
                              ) -> ray.actor.ActorHandle:
    """The run's coordinator; created on first call, found by name afterwards."""
    options: dict[str, Any] = {
        "name": coordinator_name(run_uri),
        "namespace": NAMESPACE,
        "get_if_exists": True,
        "max_restarts": -1,
        # Calls in flight when the actor dies are retried on its successor; every method is
        # safe to repeat (receipts for a step the successor aborted are refused).
        "max_task_retries": -1,
    }
    if on_head:
        options["resources"] = dict(HEAD_NODE_RESOURCES)
    if detached:
        options["lifetime"] = "detached"
    return CoordinatorActor.options(**options).remote(run_uri, keep_last, block_bytes,
                                                      storage_options, ram)


class RayCoordinatorClient:
    """The worker side of the coordinator protocol, over a Ray actor handle."""

    def __init__(self, handle: ray.actor.ActorHandle) -> None:
        self.handle = handle

    def put_ram(self, step: int, rank: int, file: str, data: bytes) -> None:
        ray.get(self.handle.put_ram.remote(step, rank, file, data))

    def report_shard(self, receipt: dict[str, Any]) -> int | None:
        return ray.get(self.handle.report_shard.remote(receipt))

    def report_failure(self, step: int, rank: int, reason: str) -> None:
        ray.get(self.handle.report_failure.remote(step, rank, reason))

    def worker_lost(self, rank: int) -> None:
        ray.get(self.handle.worker_lost.remote(rank))

    def committed_steps(self) -> list[int]:
        return list(ray.get(self.handle.committed_steps.remote()))

    def read_ram(self, step: int, requests: list[tuple[str, int, int]]) -> list[bytes] | None:
        return ray.get(self.handle.read_ram.remote(step, requests))

    def read_manifest(self, step: int) -> bytes | None:
        return ray.get(self.handle.read_manifest.remote(step))

    def rewind(self, step: int) -> None:
        ray.get(self.handle.rewind.remote(step))

    def poll(self) -> None:
        """Receipts go straight to the actor; nothing to poll."""

    def events(self) -> list[str]:
        return list(ray.get(self.handle.events.remote()))

    def snapshot_requested(self) -> bool:
        return bool(ray.get(self.handle.snapshot_requested.remote()))

    def answer_request(self, step: int) -> None:
        ray.get(self.handle.answer_request.remote(step))
