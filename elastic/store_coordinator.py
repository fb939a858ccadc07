"""A coordinator without Ray, for multi-process groups (tests, torchrun): receipts in the store.

Contract
--------
Every rank constructs a ``StoreCoordinator``. Ranks other than 0 write each receipt as a
small JSON file next to their shard (``shard-RRRRR-of-WWWWW.safetensors.receipt.json``; a
failed persist writes ``{"failed": reason}`` there instead). Rank 0 owns the commit logic (a
``LocalCoordinator``): ``poll()`` — called by the snapshotter at every step boundary and by
``flush()`` — collects the receipts of its in-flight steps and commits each step once all are
in. No collective is needed, so it works from background threads and never blocks training.
There is no off-node RAM copy in this mode (``read_ram`` serves only rank 0's own process).
"""

from __future__ import annotations

import json
import time
from typing import Any

from elastic.commit import LocalCoordinator
from elastic.faults import FaultInjector
from elastic.format import RECEIPT_SUFFIX, shard_filename
from elastic.store import SnapshotStore


class StoreCoordinator:
    def __init__(self, store: SnapshotStore, rank: int, world_size: int, *, keep_last: int,
                 block_bytes: int, faults: FaultInjector | None = None) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.local = (LocalCoordinator(store, keep_last=keep_last, block_bytes=block_bytes,
                                       faults=faults, ram=False) if rank == 0 else None)

    def _receipt_path(self, step: int, rank: int, world_size: int) -> str:
        return self.store.step_path(step, shard_filename(rank, world_size) + RECEIPT_SUFFIX)

    def put_ram(self, step: int, rank: int, file: str, data: bytes) -> None:
        """No RAM copy off the node without Ray."""

    def report_shard(self, receipt: dict[str, Any]) -> int | None:
        if self.local is not None:
            committed = self.local.report_shard(receipt)
            self.poll()
            return committed
        step, world = int(receipt["step"]), int(receipt["world_size"])
        self.store.write_json(self._receipt_path(step, self.rank, world), receipt)
        return None

    def report_failure(self, step: int, rank: int, reason: str) -> None:
        if self.local is not None:
            self.local.report_failure(step, rank, reason)
            return
        self.store.write_json(self._receipt_path(step, rank, self.world_size),
                              {"failed": reason, "step": step, "rank": rank})

    def committed_steps(self) -> list[int]:
        if self.local is not None:
            return self.local.committed_steps()
        return self.store.committed_steps()

    def read_ram(self, step: int, requests: list[tuple[str, int, int]]) -> list[bytes] | None:
        return None

    def read_manifest(self, step: int) -> bytes | None:
        return None

    def rewind(self, step: int) -> None:
        if self.local is not None:
            self.local.rewind(step)

    def poll(self) -> None:
        if self.local is None:
            return
        with self.local.lock:
            self._collect()

    def _collect(self) -> None:
        assert self.local is not None
        core = self.local.core
        for step in sorted(core.pending):
            pending = core.pending.get(step)
            if pending is None:
                continue
            for r in range(pending.world_size):
                if r in pending.receipts:
                    continue
                path = self._receipt_path(step, r, pending.world_size)
                if not self.store.exists(path):
                    continue
                receipt = json.loads(self.store.read_file(path))
                if "failed" in receipt:
                    self.local.report_failure(step, r, str(receipt["failed"]))
                    break
                if self.local.report_shard(receipt) is not None or step not in core.pending:
                    break

    def flush(self, timeout_s: float) -> None:
        """Rank 0: wait up to ``timeout_s`` for in-flight steps to commit; abort the rest."""
        if self.local is None:
            return
        deadline = time.monotonic() + timeout_s
        while self.local.core.pending and time.monotonic() < deadline:
            self.poll()
            if self.local.core.pending:
                time.sleep(0.05)
        for step in sorted(self.local.core.pending):
            self.local.report_failure(step, -1, f"receipts missing after {timeout_s} s")

    def events(self) -> list[str]:
        return self.local.events() if self.local is not None else []
