"""The run's coordinator as a Ray actor (the only Ray-specific module of ``elastic``).

Contract
--------
``get_or_create_coordinator(run_uri)`` returns a handle to the named actor
``baton-coordinator-<run>`` in namespace ``baton`` (``get_if_exists``), placed on the head
node (the ``node:__internal_head__`` resource, as Ray's own state actor does) with
``max_restarts=-1``. The actor is ``LocalCoordinator`` itself made remote (threaded, so a
slow store never blocks a poll): all protocol logic (generations, receipts, commit,
fencing, GC, abort, quarantine, rebuild-from-store) lives in ``elastic.commit`` and is
tested without Ray. When the actor restarts it rebuilds its view from the store (no
committed snapshot is lost; the in-memory copy is, so restores fall back to storage).

The in-memory copy of the newest snapshot lives in the actor's process on the head node:
workers send their shard-file bytes with ``put_ram``, so losing a worker node does not lose
them, and ``read_ram`` returns only the byte ranges a restoring worker asks for. (At scale
the copies would go to peers on other nodes; the client interface stays the same.)

``RayCoordinatorClient(handle)`` is what a worker passes to ``Snapshotter(coordinator=...)``:
a proxy that forwards the protocol's methods (``elastic.protocol.PROTOCOL_METHODS``) to the
actor; type checkers see it as a ``CoordinatorClient`` through its ``__getattr__``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Any

import ray

from elastic.format import DEFAULT_BLOCK_BYTES
from elastic.local_coordinator import LocalCoordinator
from elastic.protocol import PROTOCOL_METHODS
from elastic.store import SnapshotStore

NAMESPACE = "baton"
_HEAD_RESOURCE = "node:__internal_head__"
# Ask for this to place an actor on the head node (which outlives any worker node).
HEAD_NODE_RESOURCES = {_HEAD_RESOURCE: 0.001}


class _StoreBackedCoordinator(LocalCoordinator):
    """The local coordinator, built from a run URI (what a Ray actor's constructor gets)."""

    def __init__(self, run_uri: str, *, storage_options: dict[str, Any] | None = None,
                 storage_timeout_s: float | None = None, storage_retry_s: float | None = None,
                 **kwargs: Any) -> None:
        deadlines: dict[str, float] = {}
        if storage_timeout_s is not None:
            deadlines["timeout_s"] = storage_timeout_s
        if storage_retry_s is not None:
            deadlines["retry_deadline_s"] = storage_retry_s
        super().__init__(SnapshotStore(run_uri, storage_options, **deadlines), **kwargs)


# The actor *is* the local coordinator, made remote (its options: get_or_create_coordinator).
CoordinatorActor = ray.remote(_StoreBackedCoordinator)


def coordinator_name(run_uri: str, lease_token: str | None = None) -> str:
    """One actor per (run, lease): a driver that took a run over (``--force-takeover``) on
    the same Ray cluster gets a coordinator of its own instead of the fenced one."""
    tail = re.sub(r"[^A-Za-z0-9_.-]", "-", run_uri.rstrip("/").rsplit("/", 1)[-1])[:40]
    key = run_uri if lease_token is None else f"{run_uri}\n{lease_token}"
    digest = hashlib.blake2b(key.encode(), digest_size=4).hexdigest()
    return f"baton-coordinator-{tail}-{digest}"


def get_or_create_coordinator(run_uri: str, *, keep_last: int = 2,
                              block_bytes: int = DEFAULT_BLOCK_BYTES,
                              storage_options: dict[str, Any] | None = None, ram: bool = True,
                              ram_cap_bytes: int | None = None, lease_token: str | None = None,
                              pending_timeout_s: float = 600.0,
                              storage_timeout_s: float | None = None,
                              storage_retry_s: float | None = None,
                              on_head: bool = True, detached: bool = False
                              ) -> ray.actor.ActorHandle:
    """The run's coordinator; created on first call, found by name afterwards (then the
    settings of the first call hold)."""
    options: dict[str, Any] = {
        "num_cpus": 0,
        # Threaded: a commit writing its manifest to a slow store must not hold up a
        # worker's poll or another report; LocalCoordinator and CommitCore are thread-safe
        # and do storage I/O outside their locks.
        "max_concurrency": 8,
        "name": coordinator_name(run_uri, lease_token),
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
    handle = CoordinatorActor.options(**options).remote(
        run_uri, storage_options=storage_options, storage_timeout_s=storage_timeout_s,
        storage_retry_s=storage_retry_s, keep_last=keep_last, block_bytes=block_bytes,
        ram=ram, ram_cap_bytes=ram_cap_bytes, lease_token=lease_token,
        pending_timeout_s=pending_timeout_s)
    assert isinstance(handle, ray.actor.ActorHandle)  # Ray types it as handle-or-class
    return handle


def find_coordinator(name: str, namespace: str = NAMESPACE) -> ray.actor.ActorHandle:
    """The running coordinator actor called ``name`` (a worker that was given only its name)."""
    return ray.get_actor(name, namespace=namespace)


class RayCoordinatorClient:
    """The worker side of the coordinator protocol (``elastic.protocol``) over the actor.

    A generic proxy: each protocol method is ``ray.get(handle.<method>.remote(...))`` on the
    actor, which is ``LocalCoordinator`` itself, so there is no second copy of the
    signatures to keep in step. ``poll`` and ``flush`` are local no-ops: receipts go
    straight to the actor, so there is nothing to collect or wait for. Any other name is an
    ``AttributeError`` (driver-only controls such as ``request_snapshot`` go to the handle).
    """

    _LOCAL_NO_OPS = frozenset({"poll", "flush"})
    _FORWARDED = PROTOCOL_METHODS - _LOCAL_NO_OPS

    def __init__(self, handle: ray.actor.ActorHandle) -> None:
        self.handle = handle

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # Only reached for names not found normally (so never for handle, poll, flush).
        if name not in RayCoordinatorClient._FORWARDED:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r} "
                                 "(not a method of elastic.protocol.CoordinatorClient)")
        remote_method = getattr(self.handle, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return ray.get(remote_method.remote(*args, **kwargs))

        call.__name__ = name
        return call

    def poll(self) -> None:
        """Receipts go straight to the actor; nothing to poll."""

    def flush(self, timeout_s: float) -> None:
        """Receipts go straight to the actor; nothing to flush."""

