"""The worker-side API of elastic snapshots.

One ``Snapshotter(run_uri, registry, rank, world_size, settings, coordinator=None)`` per
worker, over a ``StateRegistry`` and a frozen ``elastic.settings.SnapshotSettings``; its usage
and what each setting does are in docs/snapshots.md ("From your own code"). A training loop
rarely needs it directly: ``trainer.train.session.Session`` wraps it.

* ``restore()``: the newest committed snapshot, resharded to this rank; returns its step (0 if
  none). Ranks agree (all-reduce MAX of an ``elastic.read.verdict.Verdict``) that every rank
  verified the same snapshot before any loads it, and with a process group of this world size
  read it together (``elastic.read.group_read``). A definitely corrupt snapshot is reported
  (``restore_errors``), quarantined, and the previous one tried (a RAM copy failing its checks
  sends its files to storage first); storage that does not answer or a rank out of memory
  (``RestoreMemoryError``) fails the restore, touching no snapshot. A read that fails part-way
  leaves the live tensors unspecified; they are never trained from (``elastic.read.restore``).
  Rank 0 starts this attempt's generation at the coordinator, the others receive it: a
  straggler of an earlier attempt never mixes into this attempt's snapshots.
* ``begin_capture_if_due(step)`` after the optimizer step, ``wait_capture()`` before the next:
  the copy hides behind forward/backward, the only stall is what they did not cover;
  ``after_step(step)`` captures and waits at once. All ranks call them on the same steps (a
  step boundary is a consistent cut). ``close()`` flushes the last persist.
* Replicas: with a process group, a capture first compares fingerprints of the replicated
  tensors (``elastic.replicas``); a difference fails the snapshot with ``ReplicasDivergedError``.
* Busy (``settings.on_busy``) while the previous snapshot persists: ``"skip"`` (default; slow
  storage never blocks training) or ``"wait"``; ranks agree, so every rank skips or none does;
  ``force=True`` (preemption) always waits. A failed capture fails its snapshot, not training.
* ``coordinator=None``: in-process (``LocalCoordinator``) at world size 1, else a store-based
  exchange (``StoreCoordinator``, rank 0 commits); on Ray, ``RayCoordinatorClient``. RAM tier
  (``ram_tier``, ``elastic.store.ram_store``): on Ray ``ray_ram_tier(...)`` (peer nodes); world
  size 1 gets an in-process store (``settings.ram_cap_bytes``) unless ``settings.ram`` is off.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from elastic import collectives
from elastic.collectives import broadcast_int, grouped
from elastic.coord import CoordinatorClient, LocalCoordinator, StoreCoordinator
from elastic.errors import ReplicasDivergedError
from elastic.faults import FaultInjector
from elastic.format import FORMAT_VERSION
from elastic.read import collector_paused, restore_newest
from elastic.replicas import agree as agree_replicas
from elastic.replicas import divergence_message, fingerprints
from elastic.settings import SnapshotSettings
from elastic.state import StateRegistry
from elastic.store import RamTier, SnapshotStore, in_process_tier
from elastic.version import code_version
from elastic.write import CaptureHandle, Capturer, Persister

log = logging.getLogger("baton.elastic")


def library_versions() -> dict[str, str]:
    """What every receipt and manifest records about the code that wrote it; ``baton`` is
    the package version plus a digest of its sources, so mixed code never commits."""
    return {"torch": torch.__version__, "baton_format": str(FORMAT_VERSION),
            "baton": code_version()}


class Snapshotter:
    """One worker's snapshots of ``registry`` in the run at ``run_uri`` (module docstring)."""

    def __init__(self, run_uri: str, registry: StateRegistry, rank: int = 0,
                 world_size: int = 1,
                 settings: SnapshotSettings = SnapshotSettings(),  # noqa: B008 - frozen
                 *, coordinator: CoordinatorClient | None = None,
                 ram_tier: RamTier | None = None, faults: FaultInjector | None = None,
                 run_info: dict[str, Any] | None = None,
                 generation: int | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.registry = registry
        self.rank, self.world_size, self.settings = rank, world_size, settings
        self.faults = faults or FaultInjector()
        self.store = SnapshotStore(run_uri, settings.storage_options,
                                   **settings.storage_deadlines())
        # The worker-group generation this rank writes for (None until joined: restore() or
        # the first capture, both points every rank reaches together).
        self.generation = generation
        self.ram_tier = _ram_tier(settings, ram_tier, coordinator is None and world_size == 1)
        if coordinator is None:
            if world_size == 1:
                coordinator = LocalCoordinator(
                    self.store, keep_last=settings.keep_last, block_bytes=settings.block_bytes,
                    faults=self.faults,
                    ram_stores=self.ram_tier.store_on if self.ram_tier is not None else None)
            else:
                coordinator = StoreCoordinator(self.store, rank, world_size,
                                               keep_last=settings.keep_last,
                                               block_bytes=settings.block_bytes,
                                               faults=self.faults)
        self.coordinator = coordinator
        self.capturer = Capturer(registry, rank, world_size,
                                 split_min_bytes=settings.split_min_bytes, faults=self.faults)
        self.persister = Persister(self.store, coordinator, layout=settings.layout,
                                   block_bytes=settings.block_bytes, ram_tier=self.ram_tier,
                                   durable=settings.durable,
                                   faults=self.faults, versions=library_versions())
        self._handle: CaptureHandle | None = None
        self.skipped: list[int] = []
        self.restore_errors: list[str] = []
        self.restored_from: tuple[str, int] | None = None  # ("ram" | "storage", step)
        self.restored_world_size: int | None = None  # world size the restored step was saved at
        # The restored snapshot's JSON state per component (a component registered after
        # the restore, such as a loader made later, loads its part from here).
        self.restored_state: dict[str, Any] = {}
        if rank == 0:
            self.store.ensure_run_json({"format_version": FORMAT_VERSION,
                                        **library_versions(), **(run_info or {})})

    # ------------------------------------------------------------------ restore

    def restore(self) -> int:
        """Load the newest committed snapshot that every rank can read; return its step.

        Only a definite integrity failure (checksum, malformed manifest, missing file on a
        store that answered) moves on to the previous snapshot, the rejected one quarantined.
        A snapshot whose state does not fit the live components (``SnapshotMisfitError``) is
        never restored past nor moved: ``SnapshotMismatchError`` names it and the newest one
        that fits, for an explicit ``baton snapshots rewind`` (a code change must not cost
        the run its snapshots). Storage that does not answer within its deadline raises
        ``StorageUnavailableError`` and changes no snapshot: a later restart restores it; a
        rank that cannot allocate the restore's tensors or buffers raises
        ``RestoreMemoryError`` on every rank, the same way."""
        with collector_paused():
            self.join_generation()
            restored = restore_newest(self.store, self.coordinator, self.registry,
                                      ram_tier=self.ram_tier, group=self._grouped(),
                                      errors=self.restore_errors)
        if restored is None:
            return 0
        self.restored_from = (restored.tier, restored.step)
        self.restored_world_size = restored.world_size
        self.restored_state = restored.state
        self.coordinator.rewind(restored.step)
        return restored.step

    def join_generation(self) -> int:
        """This rank's worker-group generation: rank 0 starts one at the coordinator and
        the others receive it over the process group (collective: all ranks call this).
        Without a process group, ranks > 0 take the coordinator's current one (in-process
        tests that drive rank 0 first)."""
        if self.generation is not None:
            return self.generation
        grouped = self.world_size > 1 and collectives.world_size() > 1
        if self.rank == 0:
            generation = self.coordinator.new_generation()
        elif not grouped:
            generation = self.coordinator.current_generation()
        else:
            generation = -1
        if grouped:
            generation = broadcast_int(generation, src=0)
        self.generation = generation
        return generation

    def rebind(self, rank: int, world_size: int, generation: int) -> None:
        """In-process recovery re-formed the group (``elastic.recovery``): from the next
        capture on, write as ``rank`` of ``world_size`` in ``generation``. A capture still
        in flight is finished and handed on under the old generation, whose receipts the
        coordinator refuses from now on (that step never commits)."""
        self.wait_capture()
        self.rank, self.world_size, self.generation = rank, world_size, generation
        self.capturer.rank, self.capturer.world_size = rank, world_size

    # ------------------------------------------------------------------ capture

    def due(self, step: int) -> bool:
        return step > 0 and step % self.settings.snapshot_every == 0

    def after_step(self, step: int, *, force: bool = False) -> bool:
        """Capture when due (or forced) and wait for the copy; persist in background."""
        started = self.begin_capture_if_due(step, force=force)
        self.wait_capture()
        return started

    def begin_capture_if_due(self, step: int, *, force: bool = False) -> bool:
        self.coordinator.poll()
        if not (force or self.due(step)):
            return False
        return self.begin_capture(step, force=force)

    def begin_capture(self, step: int, *, force: bool = False) -> bool:
        """Start copying this rank's chunks of step ``step``; False if skipped."""
        if self._handle is not None:
            raise RuntimeError("begin_capture called twice; call wait_capture() in between")
        self.join_generation()
        busy = self.persister.busy()
        agreeing = self.settings.on_busy == "skip" and not force
        models = None
        if self._grouped():
            # One collective: every rank skips this step or none does (a step one rank
            # skipped could never commit), and replicated state that differs between ranks
            # is never committed as one (elastic.replicas).
            models = self.registry.flatten(self.registry.model_keys())
            any_busy, diverged = agree_replicas(int(busy and agreeing),
                                                *fingerprints(models.tensors, step))
            if diverged is not None:
                message = divergence_message(diverged, step)
                self._report_failure(step, message)
                log.error("%s", message)
                raise ReplicasDivergedError(message)
            busy = bool(any_busy) if agreeing else busy
        if busy:
            if self.settings.on_busy == "skip" and not force:
                self.skipped.append(step)
                log.info("snapshot %d skipped on rank %d: previous still persisting",
                         step, self.rank)
                return False
            self.persister.wait()
        try:
            self._handle = self.capturer.begin(step, models=models)
        except Exception as err:  # a failed capture fails this snapshot, not training
            self._report_failure(step, f"capture failed: {err!r}")
            log.warning("snapshot %d: capture failed on rank %d: %r", step, self.rank, err)
            return False
        return True

    def _grouped(self) -> bool:
        return grouped() and collectives.world_size() == self.world_size

    def _report_failure(self, step: int, reason: str) -> None:
        try:
            self.coordinator.report_failure(step, self.rank, reason, self.generation)
        except Exception as err:  # noqa: BLE001 - the report is bookkeeping (module doc)
            log.warning("snapshot %d: could not report its failure (%s: %s); it will not "
                        "commit all the same", step, type(err).__name__, err)

    def wait_capture(self) -> None:
        """Block until the pending capture's copies are done, then persist in background.
        Call before anything mutates the captured state (the next optimizer.step)."""
        handle, self._handle = self._handle, None
        if handle is None:
            return
        try:
            captured = handle.wait()
        except Exception as err:
            self._report_failure(handle.step, f"capture failed: {err!r}")
            return
        assert self.generation is not None  # joined in begin_capture
        self.persister.submit(captured, self.generation)

    def close(self) -> None:
        """Finish the pending capture and persist; rank 0 of a store group commits."""
        self.wait_capture()
        self.persister.close()
        self.capturer.close()
        self.coordinator.flush(self.settings.flush_timeout_s)


def _ram_tier(settings: SnapshotSettings, given: RamTier | None, in_process: bool
              ) -> RamTier | None:
    """The RAM tier a snapshotter uses: none when ``settings.ram`` is off, else the one
    given, else (``in_process``: the built-in coordinator of world size 1) an in-process
    store capped at ``settings.ram_cap_bytes``, this node the only one."""
    if not settings.ram:
        return None
    if given is None and in_process:
        return in_process_tier(settings.ram_cap_bytes)
    return given
