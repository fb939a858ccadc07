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
* ``commit_manifest(store, manifest, data, generation, lease_token, *, mid_write)`` is the
  commit point: unless fenced, ``manifest.json`` (``data``) is created exclusively. It
  returns ``(fenced, failure)``: why the coordinator may not commit (``fencing_reason``, or a
  manifest for the step already there: another driver's), or why the write failed (an
  ``OSError``, described; the write may have landed all the same); both None: committed.
  The caller holds what excludes a new generation meanwhile (``CommitCore``'s generation
  lock).

Why a separate module: the commit protocol (``commit.py``) and ``baton fork`` (which copies a
run and must carry its generation on) both read the file; neither owns its format. What a
generation leaves behind is removed by ``collect.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from elastic.errors import describe
from elastic.format import (
    MAX_GENERATION,
    Manifest,
    short_repr,
)
from elastic.lease import lease_holds
from elastic.storage import is_int64
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


def commit_manifest(store: SnapshotStore, manifest: Manifest, data: bytes, generation: int,
                    lease_token: str | None, *, mid_write: Callable[[], None]
                    ) -> tuple[str | None, str | None]:
    """Write ``manifest.json`` unless fenced: ``(fenced, failure)`` (module docstring)."""
    fenced = fencing_reason(store, generation, lease_token)
    if fenced is not None:
        return fenced, None
    try:
        store.write_manifest(manifest, data=data, exclusive=True, mid_write=mid_write)
    except FileExistsError:
        return (f"a manifest for step {manifest.step} already exists (written by another "
                "driver)"), None
    except OSError as err:
        return None, f"manifest write failed: {describe(err)}"
    return None, None
