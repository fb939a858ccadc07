"""A coordinator without Ray, for multi-process groups (tests, torchrun): receipts in the store.

Contract
--------
Every rank constructs a ``StoreCoordinator``. Ranks other than 0 write each receipt as a
small JSON file next to their shard
(``shard-RRRRR-of-WWWWW-gGGGGGG.safetensors.receipt.json``: ``Receipt.to_json``; a failed
persist writes ``{"failed": reason}`` there instead), which rank 0 reads back with
``Receipt.from_json`` (a malformed one fails its step). Rank 0 owns the commit logic (a
``LocalCoordinator``): ``poll()`` — called by the snapshotter at every step boundary and by
``flush()`` — collects the receipts of its in-flight steps (for the generation that started
them: another generation's receipt files are never read) and commits each step once all are
in. No collective is needed, so it works from background threads and never blocks training.
Rank 0 starts each generation (``new_generation``); the snapshotter broadcasts it. There is
no RAM tier in this mode (``ram_locations`` names no store).
"""

from __future__ import annotations

import time
from typing import Any

from elastic.coord.local_coordinator import LocalCoordinator
from elastic.coord.membership import off_view
from elastic.coord.receipts import Receipt, json_size
from elastic.faults import FaultInjector
from elastic.format import MAX_MANIFEST_BYTES, RECEIPT_SUFFIX, shard_filename
from elastic.store import SnapshotStore


class StoreCoordinator:
    """``elastic.coord.protocol.CoordinatorClient`` for one rank of a group without Ray."""

    def __init__(self, store: SnapshotStore, rank: int, world_size: int, *, keep_last: int,
                 block_bytes: int, faults: FaultInjector | None = None) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.local = (LocalCoordinator(store, keep_last=keep_last, block_bytes=block_bytes,
                                       faults=faults) if rank == 0 else None)

    def _receipt_path(self, step: int, rank: int, world_size: int, generation: int) -> str:
        name = shard_filename(rank, world_size, generation) + RECEIPT_SUFFIX
        return self.store.step_path(step, name)

    def _owner(self) -> LocalCoordinator:
        if self.local is None:
            raise RuntimeError(f"rank {self.rank}: only rank 0 of a store group runs the "
                               "coordinator; other ranks receive the generation by broadcast")
        return self.local

    def new_generation(self) -> int:
        return self._owner().new_generation()

    def current_generation(self) -> int:
        return self._owner().current_generation()

    def report_shard(self, receipt: Receipt) -> int | None:
        if self.local is not None:
            committed = self.local.report_shard(receipt)
            self.poll()
            return committed
        path = self._receipt_path(receipt.step, self.rank, receipt.world_size,
                                  receipt.generation)
        self.store.write_json(path, receipt.to_json())
        return None

    def report_failure(self, step: int, rank: int, reason: str,
                       generation: int | None = None, where: str = "") -> None:
        if self.local is not None:
            self.local.report_failure(step, rank, reason, generation, where)
            return
        if generation is None:
            return  # never joined a generation: nothing of this rank can be in flight
        self.store.write_json(self._receipt_path(step, rank, self.world_size, generation),
                              {"failed": reason, "step": step, "rank": rank, "where": where})

    def worker_lost(self, rank: int) -> None:
        if self.local is not None:  # only rank 0 holds in-flight steps
            self.local.worker_lost(rank)

    def committed_steps(self) -> list[int]:
        if self.local is not None:
            return self.local.committed_steps()
        return self.store.committed_steps()

    def ram_locations(self, step: int) -> dict[str, list[str]]:
        return {}

    def read_manifest(self, step: int) -> bytes | None:
        return None

    def reject(self, step: int, reason: str) -> None:
        if self.local is not None:  # rank 0 quarantines; every rank reached the same verdict
            self.local.reject(step, reason)

    def rewind(self, step: int) -> None:
        if self.local is not None:
            self.local.rewind(step)

    def health(self) -> dict[str, Any]:
        return self._owner().health()

    def snapshot_requested(self) -> bool:
        return False

    def answer_request(self, step: int) -> None:
        """No on-demand requests without a Ray driver."""

    def stop_requested(self) -> bool:
        return False

    def answer_stop(self, step: int) -> None:
        """No driver to tell without Ray."""

    # No membership in store groups: in-process recovery runs on Ray only.

    def membership_join(self, member: str, order: int) -> dict[str, Any]:
        return off_view()

    def membership_beat(self, member: str, generation: int) -> dict[str, Any]:
        return off_view()

    def membership_reform(self, member: str, generation: int, reason: str) -> dict[str, Any]:
        return off_view()

    def membership_fallback(self, member: str, reason: str) -> dict[str, Any]:
        return off_view()

    def membership_finish(self, generation: int) -> dict[str, Any]:
        return off_view()

    def membership_leave(self, member: str) -> None:
        return None

    def record_metrics(self, metrics: dict[str, Any]) -> None:
        return None  # no driver reads them without Ray

    def poll(self) -> None:
        if self.local is None:
            return
        self.local.poll()
        self._collect()

    def _collect(self) -> None:
        assert self.local is not None
        core = self.local.core
        with core._lock:
            pending = {step: (p.world_size, p.generation, set(p.receipts))
                       for step, p in core.pending.items()}
        for step in sorted(pending):
            world, generation, have = pending[step]
            for r in range(world):
                if r in have:
                    continue
                path = self._receipt_path(step, r, world, generation)
                if not self.store.exists(path):
                    continue
                try:  # bounded: a receipt is a file of the run directory like any other
                    obj = self.store.read_json(path, max_bytes=MAX_MANIFEST_BYTES,
                                               nonfinite=True)
                    if not isinstance(obj, dict):
                        raise ValueError(f"{path}: not a JSON object")
                    receipt = None if "failed" in obj else Receipt.from_json(obj)
                except (ValueError, OSError) as err:  # half-seen, removed meanwhile, a link
                    self.local.report_failure(step, r, f"unreadable receipt: {err}", generation)
                    break
                if receipt is None:
                    self.local.report_failure(step, r, str(obj["failed"]), generation,
                                              str(obj.get("where", "")))
                    break
                if (self.local.report_received(receipt, json_size(obj)) is not None
                        or step not in core.pending):
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
