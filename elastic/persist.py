"""Persist: one background thread per worker writes a captured shard and reports it.

Contract
--------
``Persister.submit(captured)`` hands a finished capture to the background thread and returns
at once. The thread (1) sends the shard file's bytes to the coordinator's in-memory copy
(RAM path, off this worker's node when the coordinator is a Ray actor; the coordinator may
refuse it, e.g. over its cap, and the snapshot is then storage-only), (2) computes the
crc32 of every checksum block, (3) writes the image as the shard file through the store
(temp name + rename locally, one PUT on S3), (4) reports the receipt to the coordinator.
The shard's file name and receipt carry the worker group's generation, so the coordinator
refuses them once another generation has started. Any failure — storage down, disk full,
injected fault — is reported with ``report_failure`` (a reason a person can act on, e.g.
``ENOSPC``, and the host) and fails only that snapshot; training never sees it
(``last_error`` keeps it for logs and tests; the driver shows the coordinator's reasons).

The thread runs at a lower CPU priority (``PERSIST_NICE``) so it takes idle cycles first.
At most one snapshot is in flight per worker: ``busy()`` tells the snapshotter whether the
image is still being written, and ``wait()`` blocks until it is free. The image is shared
with the capturer, so a new capture must not start while ``busy()`` (bounded memory: one
image per worker, plus the RAM copy).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from elastic.capture import Captured
from elastic.errors import describe
from elastic.faults import FaultInjector
from elastic.format import shard_filename
from elastic.protocol import CoordinatorClient
from elastic.store import SnapshotStore

log = logging.getLogger("baton.elastic")


class Persister:
    def __init__(self, store: SnapshotStore, coordinator: CoordinatorClient, *, layout: str,
                 block_bytes: int, ram: bool = True, durable: bool = True,
                 faults: FaultInjector | None = None,
                 versions: dict[str, str] | None = None) -> None:
        self.store = store
        self.coordinator = coordinator
        self.layout = layout
        self.block_bytes = block_bytes
        self.ram = ram
        self.durable = durable
        self.faults = faults or FaultInjector()
        self.versions = dict(versions or {})
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-persist",
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

    def _persist(self, cap: Captured, generation: int) -> None:
        file = shard_filename(cap.rank, cap.world_size, generation)
        try:
            self.faults.hit(cap.rank, cap.step, "persist_begin")
            view = cap.image.memoryview()
            if self.ram:
                # One copy of the image: the image itself is reused by the next capture.
                self.coordinator.put_ram(cap.step, cap.rank, file, bytes(view), generation)
            chunks = cap.image.chunk_records(file, self.block_bytes)
            # Create-only: a shard name (rank, world, generation, step) is written once; if
            # it exists, something else wrote it and this snapshot must not claim it.
            self.store.write_file(
                self.store.step_path(cap.step, file), view, durable=self.durable,
                exclusive=True,
                mid_write=lambda: self.faults.hit(cap.rank, cap.step, "persist_mid"))
            self.faults.hit(cap.rank, cap.step, "persist_end")
            receipt: dict[str, Any] = {
                "step": cap.step, "rank": cap.rank, "world_size": cap.world_size,
                "generation": generation, "layout": self.layout, "file": file,
                "chunks": {k: [c.to_json() for c in v] for k, v in chunks.items()},
                # Every receipt names the code that wrote it: the coordinator refuses to mix.
                "versions": self.versions,
            }
            if cap.rank == 0:
                receipt.update(skeletons=cap.skeletons, catalog=cap.catalog)
            self.coordinator.report_shard(receipt)
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
