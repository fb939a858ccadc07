"""Restore the newest committed snapshot every rank can read, falling back past corrupt ones.

Contract
--------
``restore_newest(store, coordinator, registry, ...)`` tries the committed snapshots newest
first (the coordinator's list) and returns the first one every rank read and verified,
loaded into the registry, as ``Restored``; None when nothing is committed. For each one the
ranks agree on a ``Verdict`` (``elastic.read.verdict``; all-reduce MAX) before any rank
loads it:

* ``CORRUPT``: reported by name in ``errors``, quarantined by the coordinator
  (``reject``), and the previous one tried. A RAM copy that fails its checks is no verdict
  on the snapshot: its files are read from storage first.
* ``MISFIT`` (the state does not fit the live components, or breaks a rule the trainer
  added: ``StateRegistry.add_rule``): nothing is moved; ``SnapshotMismatchError`` names the
  newest older snapshot that fits and keeps the rules (for an explicit ``baton snapshots
  rewind``), or says none does.
* ``UNREACHABLE`` (``StorageUnavailableError``) and ``NO_MEMORY`` (``RestoreMemoryError``)
  fail the restore and touch no snapshot.
* A snapshot of another model (``SnapshotMismatchError`` from the checks) is raised as is.
* Every committed snapshot corrupt: ``SnapshotIntegrityError``, each one quarantined.

With ``group`` (a process group of this world size) the ranks read together
(``elastic.read.group_read``), else each rank reads what it needs (``read_tensors``). The
model's and optimizer's tensors are read in place (``elastic.read.restore``'s rule): the
next snapshot tried overwrites all of them. The caller joins its generation first and
rewinds the coordinator to the returned step after recording it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from elastic.collectives import agree_max
from elastic.coord import CoordinatorClient
from elastic.errors import (
    RestoreMemoryError,
    SnapshotIntegrityError,
    SnapshotMisfitError,
    StorageUnavailableError,
)
from elastic.format import Manifest, parse_manifest
from elastic.read.byte_source import ByteSource, ReadMany
from elastic.read.group_read import group_read_tensors
from elastic.read.restore import (
    SnapshotMismatchError,
    check_compatible,
    check_rules,
    plan_targets,
    read_tensors,
)
from elastic.read.verdict import Verdict
from elastic.state import StateRegistry, Target
from elastic.store import RamTier, SnapshotStore

log = logging.getLogger("baton.elastic")
T = TypeVar("T")


@dataclass(frozen=True)
class Prepared:
    """What a snapshot read needs: its manifest, this rank's targets, where the bytes come
    from."""

    manifest: Manifest
    targets: dict[str, Target]
    source: ByteSource

    def read_alone(self) -> dict[str, torch.Tensor]:
        """The targets' tensors, read by this rank for itself (``read_tensors``)."""
        return read_tensors(self.manifest, self.targets, self.source)

    def read_together(self) -> dict[str, torch.Tensor]:
        """The targets' tensors, read with the whole group: every rank calls it
        (``group_read_tensors``)."""
        return group_read_tensors(self.manifest, self.targets, self.source)


@dataclass(frozen=True)
class Attempt(Generic[T]):
    """One try at a read: what it gave (None unless ``OK``), this rank's verdict, and why."""

    value: T | None
    verdict: Verdict
    reason: str = ""


@dataclass(frozen=True)
class SnapshotRead:
    """One snapshot read and verified: what was prepared and the tensors (None where that
    step failed), the verdict every rank agreed on, and this rank's reason."""

    prepared: Prepared | None
    tensors: dict[str, torch.Tensor] | None
    verdict: Verdict
    reason: str


@dataclass(frozen=True)
class RamReads:
    """Reads of snapshot ``step`` from the RAM stores that hold its files (``locations``,
    the coordinator's), as a ``ReadMany``."""

    tier: RamTier
    step: int
    locations: dict[str, list[str]]

    def __call__(self, requests: list[tuple[str, int, int]]) -> list[Any] | None:
        return self.tier.read(self.step, self.locations, requests)


@dataclass(frozen=True)
class Restored:
    """The snapshot a restore loaded."""

    step: int
    tier: str  # "ram" when no rank of the group read storage and some rank read RAM
    world_size: int  # the world size it was saved at
    state: dict[str, Any]  # its JSON state per component


def attempt(read: Callable[[], T]) -> Attempt[T]:
    """``read()`` and this rank's verdict on it with its reason (module docstring); a
    snapshot of another model is raised as is."""
    try:
        return Attempt(read(), Verdict.OK)
    except SnapshotMismatchError:
        raise
    except RestoreMemoryError as err:
        return Attempt(None, Verdict.NO_MEMORY, str(err))
    except SnapshotMisfitError as err:
        return Attempt(None, Verdict.MISFIT, str(err))
    except FileNotFoundError as err:  # the store answered: the file is not there
        return Attempt(None, Verdict.CORRUPT, f"missing file: {err}")
    except (SnapshotIntegrityError, ValueError) as err:
        return Attempt(None, Verdict.CORRUPT, str(err))
    except (StorageUnavailableError, OSError) as err:
        return Attempt(None, Verdict.UNREACHABLE, str(err))


def agree(verdict: Verdict) -> Verdict:
    """The verdict of every rank: the most decisive one (all ranks must call this)."""
    return Verdict(agree_max(int(verdict)))


def restore_newest(store: SnapshotStore, coordinator: CoordinatorClient,
                   registry: StateRegistry, *, ram_tier: RamTier | None, group: bool,
                   errors: list[str]) -> Restored | None:
    """Load the newest committed snapshot every rank can read (module docstring); each
    snapshot given up on is described in ``errors``."""
    return _Fallback(store, coordinator, registry, ram_tier, group, errors).run()


@dataclass
class _Fallback:
    store: SnapshotStore
    coordinator: CoordinatorClient
    registry: StateRegistry
    ram_tier: RamTier | None
    group: bool
    errors: list[str]

    def run(self) -> Restored | None:
        steps = sorted(self.coordinator.committed_steps(), reverse=True)
        run = self.store.run_uri
        misfit = ""
        for step in steps:
            read = self._read(step, ram=True)
            ram_used = read.prepared is not None and read.prepared.source.used_ram
            if read.verdict == Verdict.CORRUPT and agree_max(int(ram_used)):
                # A RAM copy is not the snapshot: a bad one (a store's fault) is no verdict
                # on the files. Read them from storage before judging the snapshot.
                log.warning("snapshot %d: the RAM copy failed its checks (%s); reading "
                            "storage", step, read.reason or "on another rank")
                read = self._read(step, ram=False)
            verdict, reason = read.verdict, read.reason
            if verdict == Verdict.NO_MEMORY:
                raise RestoreMemoryError(
                    f"snapshot {step} of {run} could not be restored: "
                    f"{reason or 'another rank is short of memory'}; nothing was changed or "
                    "removed")
            if verdict == Verdict.UNREACHABLE:
                raise StorageUnavailableError(
                    f"snapshot {step} of {run} could not be read"
                    f"{': ' + reason if reason else ' (on another rank)'}; nothing was "
                    "changed or removed: the run restores it once storage answers again")
            if verdict == Verdict.MISFIT:
                misfit = (f"snapshot {step} of {run} does not fit the "
                          f"registered state: {reason or 'on another rank'}")
                self.errors.append(misfit)
                self._refuse_rewind(steps, step, misfit)  # returns when no older one fits
                break
            if verdict == Verdict.CORRUPT:
                msg = (f"snapshot {step} of {run} is unusable: "
                       f"{reason or 'another rank found it corrupt'}")
                self.errors.append(msg)
                log.warning("%s; quarantined, trying the previous committed snapshot", msg)
                self.coordinator.reject(step, msg)
                continue
            assert read.prepared is not None and read.tensors is not None
            manifest, source = read.prepared.manifest, read.prepared.source
            tier = agree_max(2 if source.used_storage else 1 if source.used_ram else 0)
            # _prepare checked the state against the registry, which nothing has changed.
            self.registry.load(read.tensors, manifest.state, checked=True)
            return Restored(step, "ram" if tier == 1 else "storage", manifest.world_size,
                            dict(manifest.state))
        if misfit:
            raise SnapshotMismatchError(
                f"no committed snapshot of {run} fits the registered state "
                "(none was moved; was the code, the model's dtype or a component's state "
                f"changed?): {misfit}")
        if steps:
            raise SnapshotIntegrityError(
                f"no committed snapshot of {run} could be restored (each was "
                "moved to quarantine/): " + "; ".join(self.errors))
        return None

    def _refuse_rewind(self, steps: list[int], newest: int, misfit: str) -> None:
        """Refuse (``newest`` does not fit; going back is a person's decision) naming the
        newest older one that fits (its state and the registry's rules: only the scalars the
        rules need are read); return when none does."""
        for step in (s for s in steps if s < newest):
            tried = self._try_prepare(step, ram=False)
            if agree(tried.verdict) != Verdict.OK:
                self.errors.append(f"snapshot {step}: {tried.reason or 'on another rank'}")
                continue
            run, newer = self.store.run_uri, sorted(s for s in steps if step < s <= newest)
            raise SnapshotMismatchError(
                f"{misfit}. Nothing was moved. Run the code that wrote snapshot {newest}, or "
                f"go back to snapshot {step}, the newest that fits this code: baton snapshots "
                f"rewind {run} --to {step} sets {newer} aside (baton snapshots "
                f"restore-quarantined {run} brings them back)")

    def _read(self, step: int, *, ram: bool) -> SnapshotRead:
        """Read and verify ``step`` (with the group when ``group``)."""
        prepare = self._try_prepare(step, ram=ram)
        prepared = prepare.value
        tensors: Attempt[dict[str, torch.Tensor]] = Attempt(None, prepare.verdict,
                                                            prepare.reason)
        if self.group:
            # The group read is a collective: every rank reads, or none does.
            if agree(prepare.verdict) == Verdict.OK:
                assert prepared is not None
                tensors = attempt(prepared.read_together)
        elif prepared is not None:
            tensors = attempt(prepared.read_alone)
        return SnapshotRead(prepared, tensors.value, agree(tensors.verdict), tensors.reason)

    def _try_prepare(self, step: int, *, ram: bool) -> Attempt[Prepared]:
        """``_prepare`` as a try: what it prepared, or this rank's verdict and why not."""
        return attempt(lambda: self._prepare(step, ram))

    def _prepare(self, step: int, ram: bool = True) -> Prepared:
        """Snapshot ``step``'s manifest, checked against the registry and its rules, and
        what to read (from the RAM tier first when ``ram``)."""
        manifest = self._manifest(step)
        live = self.registry.flatten()
        check_compatible(self.registry, manifest, live.tensors, live.skeletons)
        source = ByteSource(self.store, step, ram=self._ram_reader(step) if ram else None)
        try:
            check_rules(self.registry, manifest, source)  # reads the scalars rules need
        except SnapshotMisfitError:
            raise
        except SnapshotIntegrityError:
            if not source.used_ram:
                raise
            # A RAM copy is not the snapshot (as in run()): judge its scalars by storage.
            check_rules(self.registry, manifest, ByteSource(self.store, step))
        return Prepared(manifest, plan_targets(manifest, live.tensors,  # in place (module doc)
                                               in_place=self.registry.model_keys()), source)

    def _ram_reader(self, step: int) -> ReadMany | None:
        """Reads of ``step`` from the RAM stores the coordinator says hold its files."""
        if self.ram_tier is None:
            return None
        locations = self.coordinator.ram_locations(step)
        if not locations:
            return None
        return RamReads(self.ram_tier, step, locations)

    def _manifest(self, step: int) -> Manifest:
        data = self.coordinator.read_manifest(step)
        if data is not None:
            return parse_manifest(data, where=f"snapshot {step} (coordinator RAM)", step=step)
        return self.store.load_manifest(step)
