"""Garbage collection of a run directory: what an aborted generation, a failed commit or
retention leaves behind is removed, never anything committed by someone else. Storage errors
are logged, never raised: collection is housekeeping, and a later commit retries.

* ``delete_generation_files(store, step, generation, world, *, step_committed)`` removes what
  ``generation`` wrote for ``step`` (shards, receipts and temporary files, by the
  ``generation_tag`` in their names, plus a ``world``-rank group's receipts), and the step
  directory when nothing else is in it and the step is not committed. Other generations' files
  stay.
* ``collect(store, actions, old, leftover, label)``: a commit's collection, on the
  coordinator's housekeeping thread: run the abort ``actions``, retire the ``old`` committed
  steps (``SnapshotStore.retire_step``), delete every step that ``leftover(step)`` calls an
  uncommitted leftover, except the restore anchor. Any other error is logged too (the thread
  must never lose a bug's report); a refused step directory (a symbolic link:
  ``RefusedEntryError``) is logged and left alone, the others go.
* ``restore_anchor(store)``: the newest committed snapshot written by an older worker-group
  generation than the newest snapshot's: the one the newest snapshots' group restored from
  (a restore that falls back past newer ones sets them aside), so known to restore under the
  code that wrote them. Retention (``keep_last``) never retires it (at most one snapshot more):
  should the newer ones not restore, a rewind goes back to it. It is kept until a newer
  generation restores a newer one; an unreadable generation counts as older (doubt keeps a
  snapshot). The commit bookkeeping forgets it as any retired step; on storage it stays
  committed, and a coordinator started later lists it again.
* ``remove_failed_manifest(store, step, data)``: after a manifest write of ``data`` that raised
  (it may have landed: an S3 PUT whose answer was lost), remove the step's manifest if it is
  these bytes; True when the manifest is then known absent (its files may go), False when
  storage cannot tell or another writer's manifest is there (a manifest with all its shards is
  a whole snapshot; a step without one is a leftover a later collection removes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from elastic.errors import describe
from elastic.format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    RECEIPT_SUFFIX,
    generation_tag,
    parse_shard_name,
    shard_filename,
)
from elastic.storage import RefusedEntryError
from elastic.store import SnapshotStore

log = logging.getLogger("baton.elastic")


def delete_generation_files(store: SnapshotStore, step: int, generation: int, world: int | None,
                            *, step_committed: bool) -> None:
    """Remove what ``generation`` wrote for ``step`` (module docstring)."""
    tag = generation_tag(generation)
    try:
        names = store.step_files(step)
    except OSError as err:  # deletion is housekeeping: never let it fail a report
        log.warning("snapshot %d: could not list files to delete: %s", step, describe(err))
        return
    mine = [n for n in names if tag in n]
    if world is not None:
        receipts = [shard_filename(r, world, generation) + RECEIPT_SUFFIX for r in range(world)]
        mine += [name for name in receipts if name not in mine]
    try:
        if set(names) <= set(mine) and not step_committed:
            store.delete_step(step)
        else:
            store.delete_files(step, mine)
    except OSError as err:
        log.warning("snapshot %d: could not delete aborted files: %s", step, describe(err))


def remove_failed_manifest(store: SnapshotStore, step: int, data: bytes) -> bool:
    """After a write of manifest bytes ``data`` that raised (module docstring): True if the
    step's manifest is now known to be absent."""
    path = store.step_path(step, MANIFEST_NAME)
    try:
        try:
            landed = store.read_file(path)
        except FileNotFoundError:
            return True
        if landed != data:
            return False  # another writer's: never remove what someone else committed
        store.remove(path)
    except OSError as err:
        log.warning("snapshot %d: cannot tell whether its manifest landed (%s); its files are "
                    "left as they are", step, describe(err))
        return False
    return True


def collect(store: SnapshotStore, actions: list[Callable[[], None]], old: list[int],
            leftover: Callable[[int], bool], *, label: str) -> None:
    """A commit's collection (module docstring); never raises. Each step is its own try: a
    step refused (a linked directory, left alone) does not keep the others from going."""
    try:
        for action in actions:
            action()
        left = [step for step in store.all_steps() if leftover(step) and step not in old]
        anchor = restore_anchor(store) if old or left else None
        removals: list[tuple[Callable[[int], None], int]] = [
            (store.retire_step, step) for step in old if step != anchor]
        removals += [(_retire_or_delete(store), step) for step in left if step != anchor]
    except OSError as err:  # retention is housekeeping: a later commit retries it
        log.warning("garbage collection %s failed: %s", label, describe(err))
        return
    except Exception:  # never lose the thread's report of a bug
        log.exception("garbage collection %s failed", label)
        return
    for remove, step in removals:
        try:
            remove(step)
        except RefusedEntryError as err:
            log.warning("garbage collection %s: snapshot %d left alone: %s", label, step,
                        err.strerror)
        except OSError as err:
            log.warning("garbage collection %s failed: %s", label, describe(err))
            return
        except Exception:
            log.exception("garbage collection %s failed", label)
            return


def restore_anchor(store: SnapshotStore) -> int | None:
    """The newest committed snapshot of an older generation than the newest one's (module
    contract); None when there is none."""
    committed = store.committed_steps()
    if len(committed) < 2:
        return None
    newest = _generation(store, committed[-1])
    for step in reversed(committed[:-1]):
        generation = _generation(store, step)
        if newest is None or generation is None or generation < newest:
            return step
    return None


def _generation(store: SnapshotStore, step: int) -> int | None:
    """The worker-group generation that wrote committed snapshot ``step`` (its manifest's
    shard names); None when it cannot be read."""
    try:
        obj = store.read_json(store.step_path(step, MANIFEST_NAME), max_bytes=MAX_MANIFEST_BYTES)
    except (OSError, ValueError):
        return None
    files = obj.get("files") if isinstance(obj, dict) else None
    parsed = [parse_shard_name(f) for f in files] if isinstance(files, list) else []
    if not parsed or any(p is None for p in parsed):
        return None
    return max(p[2] or 0 for p in parsed if p is not None)


def _retire_or_delete(store: SnapshotStore) -> Callable[[int], None]:
    """A committed step the protocol forgot (a former restore anchor) is retired, manifest
    first; any other leftover deleted."""
    def remove(step: int) -> None:
        if store.exists(store.step_path(step, MANIFEST_NAME)):
            store.retire_step(step)
        else:
            store.delete_step(step)
    return remove
