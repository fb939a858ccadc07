"""Persist: one background thread per worker writes a captured shard and reports it.

Contract
--------
``Persister.submit(captured)`` hands a finished capture to the background thread and returns
at once. The thread (1) writes the image as the shard file through the store (temp name +
rename locally, one PUT on S3), while a second thread computes the crc32 of every checksum
block, once, from the image, and a third sends the shard file's bytes to the RAM tier
(``elastic.store.ram_store``: the stores of the next nodes on the ring, never the coordinator; a
store may refuse it, e.g. over its cap, and that shard is then storage-only), and (2) reports
a ``Receipt`` (``elastic.coord.receipts``) to the coordinator, with the capture's replica
checksums (``elastic.write.replica_sums``), naming the nodes that took a RAM copy (``ram``; a
copy not acknowledged within as long again as the write took, at least ``RAM_GRACE_MIN_S``,
is left out: the RAM tier never holds up a commit). Nothing state-sized
is allocated per snapshot: the file is written from the image's memory as is (local stores),
and the RAM tier is sent a view of the image (a Ray store actor's call copies it into the
object store; a store copies what it keeps into a buffer it recycles).
The shard's file name and receipt carry the worker group's generation, so the coordinator
refuses them once another generation has started. Any failure — storage down, disk full,
injected fault — is reported with ``report_failure`` (a reason a person can act on, e.g.
``ENOSPC``, and the host) and fails only that snapshot; training never sees it
(``last_error`` keeps it for logs and tests; the driver shows the coordinator's reasons).

The thread runs at a lower CPU priority (``PERSIST_NICE``) so it takes idle cycles first.
At most one snapshot is in flight per worker: ``busy()`` tells the snapshotter whether the
image is still being written, and ``wait()`` blocks until it is free. The image is shared
with the capturer, so a new capture must not start while ``busy()`` (bounded memory: one
image per worker; the RAM copies live in the stores).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from elastic.coord import CoordinatorClient, Receipt, TensorSpec
from elastic.errors import describe
from elastic.faults import FaultInjector
from elastic.format import ChunkRecord, shard_filename
from elastic.store import RamTier, SnapshotStore
from elastic.write.capture import Captured

log = logging.getLogger("baton.elastic")


class Persister:
    def __init__(self, store: SnapshotStore, coordinator: CoordinatorClient, *, layout: str,
                 block_bytes: int, ram_tier: RamTier | None = None, durable: bool = True,
                 faults: FaultInjector | None = None,
                 versions: dict[str, str] | None = None) -> None:
        self.store = store
        self.coordinator = coordinator
        self.layout = layout
        self.block_bytes = block_bytes
        self.ram_tier = ram_tier
        self.durable = durable
        self.faults = faults or FaultInjector()
        self.versions = dict(versions or {})
        self.ram_grace_min_s = RAM_GRACE_MIN_S  # the least wait for the RAM copies
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-persist",
                                        initializer=_lower_priority)
        self._crc_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-crc",
                                            initializer=_lower_priority)
        self._ram_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-ram",
                                            initializer=_lower_priority)
        self._future: Future[None] | None = None
        self._lock = threading.Lock()
        self.last_error: BaseException | None = None
        self.persisted: list[int] = []

    def busy(self) -> bool:
        with self._lock:
            return self._future is not None and not self._future.done()

    def wait(self) -> None:
        with self._lock:
            future = self._future
        if future is not None:
            future.result()

    def submit(self, captured: Captured, generation: int) -> None:
        with self._lock:
            if self._future is not None and not self._future.done():
                raise RuntimeError("a snapshot is still being persisted; wait() first")
            self._future = self._pool.submit(self._persist, captured, generation)

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)
        self._crc_pool.shutdown(wait=True)
        self._ram_pool.shutdown(wait=True)

    def _persist(self, cap: Captured, generation: int) -> None:
        file = shard_filename(cap.rank, cap.world_size, generation)
        checksums: Future[dict[str, list[ChunkRecord]]] | None = None
        ram_put: Future[Callable[[float | None], list[str]]] | None = None
        try:
            self.faults.hit(cap.rank, cap.step, "persist_begin")
            # The checksums are computed once, from the image, on a second thread while this
            # one sends and writes it (crc32 and file writes release the GIL): the crc work
            # hides behind the disk.
            checksums = self._crc_pool.submit(cap.image.chunk_records, file, self.block_bytes)
            # The RAM copies start on a third thread, beside the write: taking the image's
            # bytes (a memcpy into the in-process store, or the one ``ray.put``) then costs
            # the persist max(copy, write) instead of their sum (3.4 GB here: 0.7 s less).
            # The image's memory itself: a store keeps a copy of its own (module docstring).
            if self.ram_tier is not None:
                ram_put = self._ram_pool.submit(self.ram_tier.put, cap.step, generation, file,
                                                cap.image.buffer.numpy())
            started = time.monotonic()
            # Create-only: a shard name (rank, world, generation, step) is written once; if
            # it exists, something else wrote it and this snapshot must not claim it. The
            # image's memory goes to the file as is (no copy on a local store), into a
            # retired shard's file when there is one (elastic.storage.spares).
            self.store.write_shard(
                cap.step, file, cap.image.memoryview(), durable=self.durable,
                mid_write=lambda: self.faults.hit(cap.rank, cap.step, "persist_mid"))
            chunks = checksums.result()
            # The RAM copies may take as long again as the durable write, no longer: they
            # speed up a restore, they must not hold up the commit.
            ram_holders = [] if ram_put is None else _ram_holders(
                ram_put, max(self.ram_grace_min_s, time.monotonic() - started), cap.step)
            self.faults.hit(cap.rank, cap.step, "persist_end")
            self.coordinator.report_shard(Receipt(
                step=cap.step, rank=cap.rank, world_size=cap.world_size,
                generation=generation, layout=self.layout, file=file,
                chunks={k: tuple(v) for k, v in chunks.items()},
                # Every receipt names the code that wrote it: the coordinator refuses to mix.
                versions=self.versions, ram=tuple(ram_holders), replicas=cap.replicas,
                **(_rank0_part(cap) if cap.rank == 0 else {})))
            self.persisted.append(cap.step)
            self.last_error = None
        except BaseException as err:  # a failed persist fails only this snapshot
            self.last_error = err
            reason = describe(err)
            log.warning("snapshot %d: rank %d could not persist its shard: %s",
                        cap.step, cap.rank, reason)
            try:
                self.coordinator.report_failure(cap.step, cap.rank, reason, generation,
                                                socket.gethostname())
            except Exception as report_err:  # the coordinator may be down too
                log.warning("snapshot %d: failure report lost: %r", cap.step, report_err)
        finally:  # the image is free only once nothing reads it
            pending: list[Future[Any]] = [f for f in (checksums, ram_put) if f is not None]
            wait(pending)


def _rank0_part(cap: Captured) -> dict[str, Any]:
    """What only rank 0's receipt carries: the state skeletons and the tensor catalog."""
    return {"skeletons": cap.skeletons,
            "catalog": {k: TensorSpec(dtype=v["dtype"], shape=tuple(v["shape"]))
                        for k, v in cap.catalog.items()}}


# The least a worker waits for its shard's RAM copies once the shard is durable (seconds).
RAM_GRACE_MIN_S = 1.0


def _ram_holders(ram_put: Future[Callable[[float | None], list[str]]], wait_s: float,
                 step: int) -> list[str]:
    """The nodes that took the RAM copies; [] if the RAM tier failed in any way (the object
    store full, a store's error): the shard is durable, it is then storage-only."""
    try:
        return ram_put.result()(wait_s)
    except Exception as err:  # noqa: BLE001 - the RAM tier never fails a snapshot
        log.warning("snapshot %d: no RAM copy of this shard (%s: %s); it is read from "
                    "storage", step, type(err).__name__, err)
        return []

# Background persistence competes with training for cores; on a small machine the training's
# intra-op threads then wait for each other at every parallel region (measured on 2 cores: a
# background writer slowed concurrent training steps 1.53x).
# A nicer persist thread yields to them. Linux applies setpriority(PRIO_PROCESS, tid) to
# that one thread; elsewhere this is a no-op.
PERSIST_NICE = 10


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PERSIST_NICE)
    except (AttributeError, OSError):
        pass
