"""The worker-side API of elastic snapshots.

Usage (one ``Snapshotter`` per worker)::

    registry = StateRegistry()
    registry.register("model", model); registry.register("optim", optimizer)
    registry.register("sched", scheduler); registry.register("data", cursor)
    snap = Snapshotter(run_uri, registry, rank, world_size, layout="ddp" | "fsdp",
                       coordinator=handle_or_None, snapshot_every=100, keep_last=2)
    step = snap.restore()          # newest committed snapshot, resharded; 0 if none
    while training:
        loss.backward(); snap.wait_capture(); optimizer.step(); step += 1
        snap.begin_capture_if_due(step)  # copies overlap the next forward/backward
    snap.close()                   # flush the last persist

A training loop rarely needs this class directly: ``trainer.session.Session`` wraps it with
the optimizer hook that calls ``wait_capture``, preemption, planned resizes and stops.

``after_step(step)`` is the simple form (capture when due, wait for the copy at once).
The pipelined form above (``begin_capture_if_due`` after the optimizer step, ``wait_capture``
just before the next one) hides the copy behind forward/backward: the only training stall is
the part of the copy that forward/backward did not cover.

Coordinator: ``None`` means in-process (``LocalCoordinator``) for ``world_size == 1`` and a
store-based receipt exchange (``StoreCoordinator``, rank 0 commits) otherwise; on a Ray
cluster pass ``elastic.coord.ray_actors.RayCoordinatorClient``. All ranks must call the capture
methods with the same steps (a step boundary is a consistent cut in synchronous training).

RAM tier (``ram_tier``, ``elastic.store.ram_store``): where each shard's RAM copy goes and restores
read from first. On a Ray cluster pass ``elastic.coord.ray_actors.ray_ram_tier(...)`` (stores on
peer nodes); the in-process coordinator of world size 1 gets an in-process store (capped at
``ram_cap_bytes``) unless ``ram=False``; store groups have none.

Replicas: with a process group of this world size, every capture first compares a
fingerprint of each replicated model and optimizer tensor across ranks (``elastic.replicas``,
in the same collective as the busy agreement below); a tensor that differs fails the
snapshot with ``ReplicasDivergedError`` naming it (reported to the coordinator, nothing
committed): a snapshot never mixes diverged replicas.

Busy policy (``on_busy``): when the previous snapshot is still being persisted, ``"skip"``
(default) skips this snapshot so a slow or dead storage never blocks training, ``"wait"``
waits for it; with a process group of this world size the ranks agree (all-reduce MAX), so
a step is skipped by every rank or by none (a step one rank skipped could never commit, and
ranks whose persists end at different times could commit almost none). ``force=True``
(preemption) always waits. A failure report that itself fails (the coordinator or its
storage gone at that moment) is logged: a failed capture fails its snapshot, not training.

Restore agreement: when torch.distributed is initialised, ranks agree (all-reduce MAX of a
verdict) that every rank read and verified the same snapshot before any rank loads it. With
a process group of this world size the ranks read together (``elastic.read.group_read``): each
byte the group needs is read and verified by one rank and sent to the others, so a DDP
restore reads the state once in all, not W times; a failure on any rank fails the read on
all. A definitely corrupt snapshot is reported by name (``restore_errors``), quarantined by
the coordinator, and the previous committed one is tried (a RAM copy that fails its checks
is no verdict on the snapshot: its files are read from storage first); storage that does
not answer, or a rank that cannot allocate what the restore needs (``RestoreMemoryError``),
fails the restore and touches no snapshot. The model's and optimizer's tensors
are read in place, so a read that fails part-way leaves them unspecified: the next
snapshot tried overwrites all of them, and a restore that raises is never trained from
(``elastic.read.restore``'s rule).

Generations: every worker-group attempt writes under its own generation number (rank 0
starts it at the coordinator in ``restore()``, the others receive it by broadcast), so a
straggler of an earlier attempt can never complete or mix into this attempt's snapshots.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from elastic.collectives import agree_max, broadcast_int, grouped
from elastic.coord.local_coordinator import LocalCoordinator
from elastic.coord.protocol import CoordinatorClient
from elastic.coord.store_coordinator import StoreCoordinator
from elastic.errors import (
    ReplicasDivergedError,
    RestoreMemoryError,
    SnapshotIntegrityError,
    SnapshotMisfitError,
    StorageUnavailableError,
)
from elastic.faults import FaultInjector
from elastic.format.manifest_check import parse_manifest
from elastic.format.records import DEFAULT_BLOCK_BYTES, FORMAT_VERSION, LAYOUTS, Manifest
from elastic.read.byte_source import ByteSource, ReadMany
from elastic.read.group_read import group_read_tensors
from elastic.read.restore import (
    SnapshotMismatchError,
    check_compatible,
    collector_paused,
    plan_targets,
    read_tensors,
)
from elastic.replicas import agree as agree_replicas
from elastic.replicas import divergence_message, fingerprints
from elastic.state.layout import DEFAULT_SPLIT_MIN_BYTES, Target
from elastic.state.registry import StateRegistry
from elastic.store.ram_store import RamTier, in_process_tier
from elastic.store.snapshot_store import SnapshotStore
from elastic.version import code_version
from elastic.write.capture import CaptureHandle, Capturer
from elastic.write.persist import Persister

log = logging.getLogger("baton.elastic")
T = TypeVar("T")


def library_versions() -> dict[str, str]:
    """What every receipt and manifest records about the code that wrote it; ``baton`` is
    the package version plus a digest of its sources, so mixed code never commits."""
    return {"torch": torch.__version__, "baton_format": str(FORMAT_VERSION),
            "baton": code_version()}


# A restore verdict per snapshot, agreed across ranks by taking the maximum: one rank short
# of memory (the worker's fault) outranks doubt (storage unreachable), which outranks
# another's integrity failure, which outranks a misfit (the state does not fit the live
# components: maybe the code's fault, never quarantined alone), which outranks success.
_OK, _MISFIT, _CORRUPT, _UNREACHABLE, _NO_MEMORY = 0, 1, 2, 3, 4


def _attempt(read: Callable[[], T]) -> tuple[T | None, int, str]:
    """``read()`` and the restore verdict on it: a definite integrity failure (checksum,
    malformed manifest, missing file on a store that answered) is corrupt, a state that does
    not fit the live components a misfit, storage that did not answer unreachable, a rank
    short of memory no-memory; a snapshot of another model is raised as is."""
    try:
        return read(), _OK, ""
    except SnapshotMismatchError:
        raise
    except RestoreMemoryError as err:
        return None, _NO_MEMORY, str(err)
    except SnapshotMisfitError as err:
        return None, _MISFIT, str(err)
    except FileNotFoundError as err:  # the store answered: the file is not there
        return None, _CORRUPT, f"missing file: {err}"
    except (SnapshotIntegrityError, ValueError) as err:
        return None, _CORRUPT, str(err)
    except (StorageUnavailableError, OSError) as err:
        return None, _UNREACHABLE, str(err)


class Snapshotter:
    def __init__(self, run_uri: str, registry: StateRegistry, rank: int = 0,
                 world_size: int = 1, *, layout: str = "ddp",
                 coordinator: CoordinatorClient | None = None, snapshot_every: int = 100,
                 keep_last: int = 2, ram: bool = True, ram_tier: RamTier | None = None,
                 ram_cap_bytes: int | None = None, on_busy: str = "skip",
                 durable: bool = True, storage_options: dict[str, Any] | None = None,
                 block_bytes: int = DEFAULT_BLOCK_BYTES,
                 split_min_bytes: int = DEFAULT_SPLIT_MIN_BYTES, flush_timeout_s: float = 120.0,
                 run_info: dict[str, Any] | None = None,
                 faults: FaultInjector | None = None, generation: int | None = None,
                 storage_timeout_s: float | None = None,
                 storage_retry_s: float | None = None) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        if on_busy not in ("skip", "wait"):
            raise ValueError(f"on_busy must be 'skip' or 'wait', got {on_busy!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.registry = registry
        self.rank, self.world_size, self.layout = rank, world_size, layout
        self.snapshot_every, self.on_busy = snapshot_every, on_busy
        self.flush_timeout_s = flush_timeout_s
        self.faults = faults or FaultInjector()
        deadlines: dict[str, float] = {}
        if storage_timeout_s is not None:
            deadlines["timeout_s"] = storage_timeout_s
        if storage_retry_s is not None:
            deadlines["retry_deadline_s"] = storage_retry_s
        self.store = SnapshotStore(run_uri, storage_options, **deadlines)
        # The worker-group generation this rank writes for (None until joined: restore() or
        # the first capture, both points every rank reaches together).
        self.generation = generation
        if coordinator is None and world_size == 1 and ram and ram_tier is None:
            ram_tier = in_process_tier(ram_cap_bytes)  # its store: the only node, this one
        self.ram_tier = ram_tier if ram else None
        if coordinator is None:
            if world_size == 1:
                coordinator = LocalCoordinator(
                    self.store, keep_last=keep_last, block_bytes=block_bytes,
                    faults=self.faults,
                    ram_stores=self.ram_tier.store_on if self.ram_tier is not None else None)
            else:
                coordinator = StoreCoordinator(self.store, rank, world_size,
                                               keep_last=keep_last, block_bytes=block_bytes,
                                               faults=self.faults)
        self.coordinator = coordinator
        self.capturer = Capturer(registry, rank, world_size, split_min_bytes=split_min_bytes,
                                 faults=self.faults)
        self.persister = Persister(self.store, coordinator, layout=layout,
                                   block_bytes=block_bytes, ram_tier=self.ram_tier,
                                   durable=durable,
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
            return self._restore_newest()

    def _restore_newest(self) -> int:
        self.join_generation()
        steps = sorted(self.coordinator.committed_steps(), reverse=True)
        # A group (torch.distributed of this world size) reads each byte once between its
        # ranks (elastic.read.group_read); the ranks first agree that every one of them can.
        group = self._grouped()
        misfit = ""
        for step in steps:
            prepared, tensors, verdict, reason = self._read(step, group, ram=True)
            ram_used = prepared is not None and prepared[2].used_ram
            if verdict == _CORRUPT and agree_max(int(ram_used)):
                # A RAM copy is not the snapshot: a bad one (a store's fault) is no verdict
                # on the files. Read them from storage before judging the snapshot.
                log.warning("snapshot %d: the RAM copy failed its checks (%s); reading "
                            "storage", step, reason or "on another rank")
                prepared, tensors, verdict, reason = self._read(step, group, ram=False)
            if verdict == _NO_MEMORY:
                raise RestoreMemoryError(
                    f"snapshot {step} of {self.store.run_uri} could not be restored: "
                    f"{reason or 'another rank is short of memory'}; nothing was changed or "
                    "removed")
            if verdict == _UNREACHABLE:
                raise StorageUnavailableError(
                    f"snapshot {step} of {self.store.run_uri} could not be read"
                    f"{': ' + reason if reason else ' (on another rank)'}; nothing was "
                    "changed or removed: the run restores it once storage answers again")
            if verdict == _MISFIT:
                misfit = (f"snapshot {step} of {self.store.run_uri} does not fit the "
                          f"registered state: {reason or 'on another rank'}")
                self.restore_errors.append(misfit)
                self._refuse_rewind(steps, step, misfit)  # returns when no older one fits
                break
            if verdict == _CORRUPT:
                msg = (f"snapshot {step} of {self.store.run_uri} is unusable: "
                       f"{reason or 'another rank found it corrupt'}")
                self.restore_errors.append(msg)
                log.warning("%s; quarantined, trying the previous committed snapshot", msg)
                self.coordinator.reject(step, msg)
                continue
            assert prepared is not None and tensors is not None
            manifest, _, source = prepared
            # "ram" when no rank of the group read storage and some rank read RAM.
            tier = agree_max(2 if source.used_storage else 1 if source.used_ram else 0)
            # _prepare checked the state against the registry, which nothing has changed.
            self.registry.load(tensors, manifest.state, checked=True)
            self.restored_from = ("ram" if tier == 1 else "storage", step)
            self.restored_world_size = manifest.world_size
            self.restored_state = dict(manifest.state)
            self.coordinator.rewind(step)
            return step
        if misfit:
            raise SnapshotMismatchError(
                f"no committed snapshot of {self.store.run_uri} fits the registered state "
                "(none was moved; was the code, the model's dtype or a component's state "
                f"changed?): {misfit}")
        if steps:
            raise SnapshotIntegrityError(
                f"no committed snapshot of {self.store.run_uri} could be restored (each was "
                "moved to quarantine/): " + "; ".join(self.restore_errors))
        return 0

    def _refuse_rewind(self, steps: list[int], newest: int, misfit: str) -> None:
        """Refuse (``newest`` does not fit; going back is a person's decision) naming the
        newest older one that fits, reading no tensor; return when none does."""
        for step in (s for s in steps if s < newest):
            _, verdict, reason = _attempt(functools.partial(self._prepare, step, False))
            if agree_max(verdict) != _OK:
                self.restore_errors.append(f"snapshot {step}: {reason or 'on another rank'}")
                continue
            run, newer = self.store.run_uri, sorted(s for s in steps if step < s <= newest)
            raise SnapshotMismatchError(
                f"{misfit}. Nothing was moved. Run the code that wrote snapshot {newest}, or "
                f"go back to snapshot {step}, the newest that fits this code: baton snapshots "
                f"rewind {run} --to {step} sets {newer} aside (baton snapshots "
                f"restore-quarantined {run} brings them back)")

    def _read(self, step: int, group: bool, *, ram: bool
              ) -> tuple[tuple[Manifest, dict[str, Target], ByteSource] | None,
                         dict[str, torch.Tensor] | None, int, str]:
        """Read and verify ``step`` (with the group when ``group``): what was prepared, the
        tensors, and the verdict agreed by every rank with this rank's reason."""
        prepared, verdict, reason = _attempt(functools.partial(self._prepare, step, ram))
        tensors: dict[str, torch.Tensor] | None = None
        if group:
            if agree_max(verdict) == _OK:
                assert prepared is not None
                tensors, verdict, reason = _attempt(
                    functools.partial(group_read_tensors, *prepared))
        elif prepared is not None:
            tensors, verdict, reason = _attempt(functools.partial(read_tensors, *prepared))
        return prepared, tensors, agree_max(verdict), reason

    def _prepare(self, step: int, ram: bool = True
                 ) -> tuple[Manifest, dict[str, Target], ByteSource]:
        """Snapshot ``step``'s manifest, checked against the registry, and what to read
        (from the RAM tier first when ``ram``)."""
        manifest = self._manifest(step)
        live = self.registry.flatten()
        check_compatible(self.registry, manifest, live.tensors, live.skeletons)
        source = ByteSource(self.store, step, ram=self._ram_reader(step) if ram else None)
        return manifest, plan_targets(manifest, live.tensors,  # in place (module doc)
                                      in_place=self.registry.model_keys()), source

    def _ram_reader(self, step: int) -> ReadMany | None:
        """Reads of ``step`` from the RAM stores the coordinator says hold its files."""
        if self.ram_tier is None:
            return None
        locations = self.coordinator.ram_locations(step)
        if not locations:
            return None
        return functools.partial(self.ram_tier.read, step, locations)

    def join_generation(self) -> int:
        """This rank's worker-group generation: rank 0 starts one at the coordinator and
        the others receive it over the process group (collective: all ranks call this).
        Without a process group, ranks > 0 take the coordinator's current one (in-process
        tests that drive rank 0 first)."""
        if self.generation is not None:
            return self.generation
        grouped = self.world_size > 1 and dist.is_available() and dist.is_initialized()
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

    def _manifest(self, step: int) -> Manifest:
        data = self.coordinator.read_manifest(step)
        if data is not None:
            return parse_manifest(data, where=f"snapshot {step} (coordinator RAM)", step=step)
        return self.store.load_manifest(step)

    # ------------------------------------------------------------------ capture

    def due(self, step: int) -> bool:
        return step > 0 and step % self.snapshot_every == 0

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
        agreeing = self.on_busy == "skip" and not force
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
            if self.on_busy == "skip" and not force:
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
        return grouped() and dist.get_world_size() == self.world_size

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
        self.coordinator.flush(self.flush_timeout_s)
