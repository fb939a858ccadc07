"""The run's coordinator as a Ray actor (the only Ray-specific module of ``elastic``).

Contract
--------
``get_or_create_coordinator(run_uri)`` returns a handle to the named actor
``baton-coordinator-<run>`` in namespace ``baton`` (``get_if_exists``), placed on the head
node (the ``node:__internal_head__`` resource, as Ray's own state actor does) with
``max_restarts=-1``. The actor is ``LocalCoordinator`` itself made remote (threaded, so a
slow store never blocks a poll): all protocol logic (generations, receipts, commit,
fencing, GC, abort, quarantine, rebuild-from-store) lives in ``elastic.coord.commit`` and is
tested without Ray. When the actor restarts it rebuilds its view from the store (no
committed snapshot is lost) and its RAM index from the run's live stores (below).

The RAM copies of the newest snapshot live on peers, not on the head: one ``RamStore``
actor per node and run (``get_or_create_ram_store``: ``baton-ram-<run>-<node>``, the very
class of ``elastic.store.ram_store`` made remote, pinned to its node with a hard node affinity,
detached so that it outlives the worker that created it, gone with its node). A worker's
``ray_ram_tier`` puts its shard into the stores of the next nodes on the ring
(``snapshots.ram_replicas``) and reads ranges from whichever store the coordinator names.
The coordinator keeps only that metadata (and tells the stores what to keep); no shard byte
passes through it. ``release_ram_stores`` ends a run's stores (the driver, at the end of a
fit). A coordinator that starts (after a restart: Ray reruns its constructor) asks the
stores of its run on the live nodes what they hold (``ram_holdings``: metadata only, all at
once, at most ``RAM_RECOVERY_TIMEOUT_S``) and rebuilds its index of the newest commit from
the answers (``LocalCoordinator.recover_ram_index``), so restores after the restart still
read peer copies; a store that is gone or silent is left out (its files: storage).

``RayCoordinatorClient(handle)`` is what a worker passes to ``Snapshotter(coordinator=...)``:
a proxy that forwards the protocol's methods (``elastic.coord.protocol.PROTOCOL_METHODS``) to the
actor; type checkers see it as a ``CoordinatorClient`` through its ``__getattr__``.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic.coord.local_coordinator import LocalCoordinator
from elastic.coord.membership import MembershipSettings
from elastic.coord.protocol import PROTOCOL_METHODS
from elastic.coord.receipts import Receipt, json_size
from elastic.format import DEFAULT_BLOCK_BYTES
from elastic.store import (
    PutWaiter,
    RamStore,
    RamStoreClient,
    RamTier,
    Requests,
    SnapshotStore,
    StoreLost,
)

log = logging.getLogger("baton.elastic")

NAMESPACE = "baton"
# How long a starting coordinator waits for the stores' answers about what they hold.
RAM_RECOVERY_TIMEOUT_S = 10.0
_HEAD_RESOURCE = "node:__internal_head__"
# Ask for this to place an actor on the head node (which outlives any worker node).
HEAD_NODE_RESOURCES = {_HEAD_RESOURCE: 0.001}


class _StoreBackedCoordinator(LocalCoordinator):
    """The local coordinator, built from a run URI (what a Ray actor's constructor gets)."""

    def __init__(self, run_uri: str, *, storage_options: dict[str, Any] | None = None,
                 storage_timeout_s: float | None = None, storage_retry_s: float | None = None,
                 lease_token: str | None = None, **kwargs: Any) -> None:
        deadlines: dict[str, float] = {}
        if storage_timeout_s is not None:
            deadlines["timeout_s"] = storage_timeout_s
        if storage_retry_s is not None:
            deadlines["retry_deadline_s"] = storage_retry_s

        def ram_stores(node: str) -> RamStoreClient:
            return RayRamStoreClient(find_ram_store(run_uri, node, lease_token))

        # Process groups of in-process recovery meet at a store on this (the head) node.
        kwargs.setdefault("rendezvous_host", ray.util.get_node_ip_address())
        super().__init__(SnapshotStore(run_uri, storage_options, **deadlines),
                         lease_token=lease_token, ram_stores=ram_stores, **kwargs)
        try:
            self.recover_ram_index(ram_holdings(run_uri, lease_token))
        except Exception as err:  # noqa: BLE001 - only an optimisation: storage still serves
            log.warning("could not recover the RAM index from the run's stores: %r", err)

    def report_shard_json(self, receipt: dict[str, Any]) -> int | None:
        """``report_shard`` of a receipt that crossed from a worker as JSON
        (``RayCoordinatorClient.report_shard``), checked by ``Receipt.from_json``."""
        return self.report_received(Receipt.from_json(receipt), json_size(receipt))


# The actor *is* the local coordinator, made remote (its options: get_or_create_coordinator).
CoordinatorActor = ray.remote(_StoreBackedCoordinator)


def coordinator_name(run_uri: str, lease_token: str | None = None) -> str:
    """One actor per (run, lease): a driver that took a run over (``--force-takeover``) on
    the same Ray cluster gets a coordinator of its own instead of the fenced one."""
    return f"baton-coordinator-{_run_key(run_uri, lease_token)}"


def _run_key(run_uri: str, lease_token: str | None) -> str:
    tail = re.sub(r"[^A-Za-z0-9_.-]", "-", run_uri.rstrip("/").rsplit("/", 1)[-1])[:40]
    key = run_uri if lease_token is None else f"{run_uri}\n{lease_token}"
    digest = hashlib.blake2b(key.encode(), digest_size=4).hexdigest()
    return f"{tail}-{digest}"


def get_or_create_coordinator(run_uri: str, *, keep_last: int = 2,
                              block_bytes: int = DEFAULT_BLOCK_BYTES,
                              storage_options: dict[str, Any] | None = None,
                              lease_token: str | None = None,
                              pending_timeout_s: float = 600.0,
                              storage_timeout_s: float | None = None,
                              storage_retry_s: float | None = None,
                              membership: MembershipSettings | None = None,
                              on_head: bool = True, detached: bool = False
                              ) -> ray.actor.ActorHandle:
    """The run's coordinator; created on first call, found by name afterwards (then the
    settings of the first call hold). `membership`: how it tells gone from slow."""
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
        lease_token=lease_token, membership=membership,
        pending_timeout_s=pending_timeout_s)
    assert isinstance(handle, ray.actor.ActorHandle)  # Ray types it as handle-or-class
    return handle


def find_coordinator(name: str, namespace: str = NAMESPACE) -> ray.actor.ActorHandle:
    """The running coordinator actor called ``name`` (a worker that was given only its name)."""
    return ray.get_actor(name, namespace=namespace)


class RayCoordinatorClient:
    """The worker side of the coordinator protocol (``elastic.coord.protocol``) over the actor.

    A generic proxy: each protocol method is ``ray.get(handle.<method>.remote(...))`` on the
    actor, which is ``LocalCoordinator`` itself, so there is no second copy of the
    signatures to keep in step. ``report_shard`` sends the receipt as JSON (the actor's
    ``report_shard_json`` reads it back). ``poll`` and ``flush`` are local no-ops: receipts go
    straight to the actor, so there is nothing to collect or wait for. Any other name is an
    ``AttributeError`` (driver-only controls such as ``request_snapshot`` go to the handle).
    """

    _LOCAL_NO_OPS = frozenset({"poll", "flush"})
    _FORWARDED = PROTOCOL_METHODS - _LOCAL_NO_OPS - {"report_shard"}

    def __init__(self, handle: ray.actor.ActorHandle) -> None:
        self.handle = handle

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # Only reached for names not found normally (so never for handle, poll, flush).
        if name not in RayCoordinatorClient._FORWARDED:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r} "
                                 "(not a method of elastic.coord.protocol.CoordinatorClient)")
        remote_method = getattr(self.handle, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return ray.get(remote_method.remote(*args, **kwargs))

        call.__name__ = name
        return call

    def report_shard(self, receipt: Receipt) -> int | None:
        """The receipt crosses to the actor as JSON (``Receipt.to_json``), never pickled."""
        ref: Any = self.handle.report_shard_json.remote(receipt.to_json())
        step: int | None = ray.get(ref)
        return step

    def poll(self) -> None:
        """Receipts go straight to the actor; nothing to poll."""

    def flush(self, timeout_s: float) -> None:
        """Receipts go straight to the actor; nothing to flush."""



# ---------------------------------------------------------------------- the RAM tier's stores

RamStoreActor = ray.remote(RamStore)
_RAM_PREFIX = "baton-ram-"


def ram_store_name(run_uri: str, node_id: str, lease_token: str | None = None) -> str:
    """The store of this run (and lease, as for the coordinator) on node ``node_id``."""
    return f"{_RAM_PREFIX}{_run_key(run_uri, lease_token)}-{node_id[:16]}"


def get_or_create_ram_store(run_uri: str, node_id: str, *, cap_bytes: int | None,
                            lease_token: str | None = None) -> ray.actor.ActorHandle:
    """The run's store on ``node_id``; created there on first call (its cap then holds)."""
    handle = RamStoreActor.options(
        name=ram_store_name(run_uri, node_id, lease_token), namespace=NAMESPACE,
        get_if_exists=True, num_cpus=0,
        # Several workers read from it at once during a restore; it is thread-safe.
        max_concurrency=4,
        # Its copies are of other nodes' shards: it must outlive the worker that created it
        # (an owned actor dies with its owner) and live only on its own node.
        lifetime="detached", max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(cap_bytes)
    assert isinstance(handle, ray.actor.ActorHandle)
    return handle


def find_ram_store(run_uri: str, node_id: str,
                   lease_token: str | None = None) -> ray.actor.ActorHandle:
    """The run's store on ``node_id``; ``StoreLost`` when there is none (any more)."""
    try:
        return ray.get_actor(ram_store_name(run_uri, node_id, lease_token), namespace=NAMESPACE)
    except ValueError as err:
        raise StoreLost(f"no RAM store on node {node_id}") from err


def ram_holdings(run_uri: str, lease_token: str | None = None, *,
                 timeout_s: float = RAM_RECOVERY_TIMEOUT_S) -> dict[str, dict[str, Any]]:
    """What the run's stores on the live nodes hold (``RamStore.holdings()``: metadata,
    never bytes), by node id; asked all at once. A store that is gone, or has not answered
    within ``timeout_s``, is absent."""
    named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE}
    asked: dict[str, Any] = {}
    for node in (n["NodeID"] for n in ray.nodes() if n.get("Alive")):
        name = ram_store_name(run_uri, node, lease_token)
        if name in named:
            try:
                asked[node] = ray.get_actor(name, namespace=NAMESPACE).holdings.remote()
            except ValueError:  # gone since the listing
                continue
    if not asked:
        return {}
    ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=timeout_s)
    answered = set(ready)
    held: dict[str, dict[str, Any]] = {}
    for node, ref in asked.items():
        if ref in answered:
            try:
                held[node] = dict(RayRamStoreClient._get(ref))
            except StoreLost:
                continue
    return held


def release_ram_stores(run_uri: str, lease_token: str | None = None) -> int:
    """End this run's stores (their copies are of no use once the fit is over). Cleanup:
    it never raises (a cluster that is going away takes the stores with it)."""
    prefix = f"{_RAM_PREFIX}{_run_key(run_uri, lease_token)}-"
    ended = 0
    try:
        actors = ray.util.list_named_actors(all_namespaces=True)
    except Exception as err:  # noqa: BLE001 - housekeeping must not mask the fit's outcome
        log.warning("could not list the run's RAM stores to end them: %r", err)
        return 0
    for actor in actors:
        if actor["namespace"] == NAMESPACE and actor["name"].startswith(prefix):
            try:
                ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE))
                ended += 1
            except Exception:  # noqa: BLE001 - gone meanwhile, or the cluster is going
                continue
    return ended


class RayRamStoreClient:
    """``elastic.store.ram_store.RamStoreClient`` over a store actor: a dead actor (its node
    lost) or an unschedulable one is ``StoreLost``, so callers fall back to storage."""

    def __init__(self, handle: ray.actor.ActorHandle) -> None:
        self.handle = handle

    def start_put(self, step: int, generation: int, file: str, data: Any) -> PutWaiter:
        # ``data``: the reference the tier's ``ray.put`` made (one copy in the object store
        # for all the ring's stores; Ray hands the actor the array), or a numpy array, which
        # goes to the object store during .remote(). Either way the caller may reuse its
        # memory as soon as this returns.
        ref: Any = self.handle.put.remote(step, generation, file, data)

        def took(timeout_s: float | None) -> bool:
            try:
                return bool(self._get(ref, timeout_s))
            except ray.exceptions.GetTimeoutError:
                return False  # still on its way: not counted as held

        return took

    def read(self, step: int, requests: Requests) -> list[Any] | None:
        got = self._get(self.handle.read.remote(step, requests))
        return None if got is None else [np.asarray(x) for x in got]

    def keep(self, committed: int | None, in_flight: list[int],
             order: tuple[int, int] | None = None) -> None:
        self.handle.keep.remote(committed, in_flight, order)  # a notice: nothing to wait for

    def holdings(self) -> dict[str, Any]:
        return dict(self._get(self.handle.holdings.remote()))

    def stats(self) -> dict[str, Any]:
        return dict(self._get(self.handle.stats.remote()))

    @staticmethod
    def _get(ref: Any, timeout_s: float | None = None) -> Any:
        try:
            return ray.get(ref, timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError,
                ray.exceptions.ObjectLostError) as err:
            raise StoreLost(f"RAM store lost: {type(err).__name__}") from err


def ray_ram_tier(run_uri: str, *, cap_bytes: int | None, replicas: int = 1,
                 lease_token: str | None = None) -> RamTier:
    """This worker's RAM tier on a Ray cluster: its node's ring successors' stores."""
    handles: dict[str, RayRamStoreClient] = {}

    def live_nodes() -> list[str]:
        return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]

    def store_on(node: str) -> RamStoreClient:
        # Node ids are never reused: a lost store's handle just keeps answering StoreLost.
        if node not in handles:
            handles[node] = RayRamStoreClient(get_or_create_ram_store(
                run_uri, node, cap_bytes=cap_bytes, lease_token=lease_token))
        return handles[node]

    node = ray.get_runtime_context().get_node_id()
    # One copy into the object store per shard, whatever ``replicas``: every store of the
    # ring is sent its reference (elastic.store.ram_store: how the bytes travel).
    tier = RamTier(node, live_nodes, store_on, replicas=replicas, share=ray.put)
    tier.prepare()  # the stores start while this worker restores and trains its first steps
    return tier
