"""The run's generation number and the fencing check: may this coordinator still commit?

Contract
--------
* ``RUN/generation.json`` (``GENERATION_NAME``) holds ``{"generation": G, "time": unix s}``:
  the newest worker-group attempt started on the run, by any coordinator or driver. It only
  grows (``commit.CommitCore.new_generation`` writes ``max(persisted, own) + 1``).
* ``read_generation(store)`` returns G, 0 when the file does not exist; a file that is not a
  Baton generation file (bad JSON, missing key, not an int in [0, ``MAX_GENERATION``], a link
  or a FIFO) raises ``ValueError`` / ``OSError`` with one line naming the file and the fix. It
  is untrusted input: read through ``Storage.read_json`` (bounded) only.
* ``write_generation(store, generation)`` writes it (the store's atomic small-file write); a
  generation past ``MAX_GENERATION`` (the most a shard file name carries) is one
  ``ValueError`` line saying to continue in a new run directory.
* ``fencing_reason(store, generation, lease_token)`` is why a coordinator at ``generation``
  may no longer commit — a newer generation was started elsewhere, or (when it holds a run
  lease, ``lease_token`` not None) the lease no longer names it, or either could not be read
  — or None. Reading fails closed: a coordinator that cannot tell does not commit.
* ``delete_generation_files(store, step, generation, world, *, step_committed)`` removes what
  ``generation`` wrote for ``step`` (its shards, receipts and temporary files, found by the
  ``generation_tag`` in their names, plus the receipts of a ``world``-rank group), and the
  whole step directory when nothing else is in it and the step is not committed. Another
  generation's files stay. Storage errors are logged, never raised: deletion is housekeeping.
* ``collect(store, actions, old, leftover, label)``: a commit's collection, on the
  coordinator's housekeeping thread: run the abort ``actions``, retire the ``old`` committed
  steps (``SnapshotStore.retire_step``), delete every step on storage that ``leftover(step)``
  says is an uncommitted leftover. Storage errors are logged (a later commit retries), and so
  is any other error (the thread must never lose a bug's report); a step whose directory is
  refused (a symbolic link: ``RefusedEntryError``) is logged and left alone, the others go.
* ``remove_failed_manifest(store, step, data)``: after a write of manifest bytes ``data``
  that raised (it may have landed all the same: an S3 PUT whose answer was lost), remove the
  step's manifest if it is on storage and is these bytes; True when the step's manifest is
  then known to be absent (its files may go), False when storage cannot tell or another
  writer's manifest is there (leave them: a manifest with all its shards is a whole
  snapshot; a step without one is a leftover that a later collection or coordinator start
  removes).

Why a separate module: the commit protocol (``commit.py``) and ``baton fork`` (which copies a
run and must carry its generation on) both read the file; neither owns its format.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from elastic.errors import describe
from elastic.format import (
    MANIFEST_NAME,
    MAX_GENERATION,
    RECEIPT_SUFFIX,
    generation_tag,
    shard_filename,
    short_repr,
)
from elastic.lease import lease_holds
from elastic.storage import RefusedEntryError, is_int64
from elastic.store import SnapshotStore

GENERATION_NAME = "generation.json"

log = logging.getLogger("baton.elastic")


def read_generation(store: SnapshotStore) -> int:
    """The newest generation persisted in the run directory (0 when none was ever started)."""
    path = store.path(GENERATION_NAME)
    fix = "restore it or remove it if no driver is running"
    try:
        record = store.read_json(path)
    except FileNotFoundError:
        return 0
    except ValueError as err:  # elastic.storage.json_bounds: malformed, too deep, too large
        raise ValueError(f"not a Baton generation file ({err}); {fix}") from err
    value = record.get("generation") if isinstance(record, dict) else None
    if not is_int64(value) or not 0 <= value <= MAX_GENERATION:
        raise ValueError(f"{path}: generation must be an integer in [0, {MAX_GENERATION}], "
                         f"got {short_repr(value)}; {fix}")
    return value


def write_generation(store: SnapshotStore, generation: int) -> None:
    if not 0 <= generation <= MAX_GENERATION:
        raise ValueError(
            f"{store.path(GENERATION_NAME)}: generation {generation} would pass "
            f"{MAX_GENERATION}, the most worker-group attempts a run directory can name; "
            f"continue in a new run directory (baton fit RECIPE --from {store.run_uri} "
            "--run-dir NEW_DIR)")
    store.write_json(store.path(GENERATION_NAME), {"generation": generation, "time": time.time()})


def fencing_reason(store: SnapshotStore, generation: int, lease_token: str | None) -> str | None:
    """Why a coordinator at ``generation`` may no longer commit, or None (module docstring)."""
    try:
        persisted = read_generation(store)
    except (OSError, ValueError) as err:
        return f"could not read {GENERATION_NAME}: {describe(err)}"
    if persisted > generation:
        return (
            f"generation {persisted} was started by another coordinator or driver "
            f"(this one is at {generation})"
        )
    if lease_token is not None:
        try:
            holds = lease_holds(store, lease_token)
        except OSError as err:
            return f"could not check the run lease: {describe(err)}"
        if not holds:
            return "the run lease was taken over by another driver"
    return None


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
        removals = [(store.retire_step, step) for step in old]
        removals += [(store.delete_step, step) for step in store.all_steps() if leftover(step)]
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
