"""Driver-side checks and set-up of a run directory, done before Ray starts.

Contract:
- `check_run_dir(cfg)` fails fast with `RunDirError` when the run URI cannot be reached or
  written, or when it already holds a run that this recipe cannot continue
  (`check_continuation`); returns the newest committed step (0 if none), so the CLI can say
  "continuing from step N".
- The continuation rule itself (`check_continuation`, `RunDirError`) is
  `trainer.train.continuation`: every worker's rank 0 applies it again, so it lives below
  the driver; a schedule change the driver accepted is in the session log before the
  workers start.
- `held_run_parts(store)` lists what of a run a directory holds; `interrupted_fork(store)`
  says whether that is only what a fork killed before its commit left, which
  `clear_interrupted_fork` removes (`trainer.run.fork`).
- Before anything else, `check_run_dir` runs `trainer.run.preflight`'s `check_dataset` and
  `check_local_capacity` (the dataset and a place for the workers).
(`RUN/run.json`, with the recipe and library versions, is written once by the first
worker's `elastic.Snapshotter`.)
"""

from __future__ import annotations

import logging
import uuid

from elastic.coord import GENERATION_NAME
from elastic.store import SnapshotStore
from trainer.config import FitConfig
from trainer.run.preflight import (
    check_dataset,
    check_local_capacity,
    data_uri,
    dataset_fingerprint,
    with_dataset_vocab,
)
from trainer.train import SESSIONS_NAME, RunDirError, check_continuation


def held_run_parts(store: SnapshotStore) -> list[str]:
    """What of a run the directory holds (empty: none; a prepared `data/` or a released
    lease is not a run)."""
    found = [n for n in ("run.json", SESSIONS_NAME, GENERATION_NAME)
             if store.exists(store.path(n))]
    if store.all_steps():
        found.append("snapshots/")
    return found


def interrupted_fork(store: SnapshotStore) -> bool:
    """Whether the directory holds only what a fork killed before its commit left: a
    `run.json` recording a parent, no committed snapshot and no session log (a forked run
    that ever trained has both). Nothing there was committed, so nothing is lost by
    replacing it."""
    if store.exists(store.path(SESSIONS_NAME)) or store.committed_steps():
        return False
    info = store.read_run_json()
    return info is not None and isinstance(info.get("parent"), dict)


def clear_interrupted_fork(store: SnapshotStore) -> None:
    """Remove what `interrupted_fork` found, run.json last (the caller holds the lease)."""
    for step in store.all_steps():
        store.delete_step(step)
    for name in (GENERATION_NAME, "run.json"):
        store.remove(store.path(name))
    logging.getLogger("baton.fork").warning(
        "%s: removed what an interrupted fork left (no committed snapshot); forking again",
        store.run_uri)


def _probe_writable(run_uri: str) -> SnapshotStore:
    """Write and delete a small object, through the store the workers will use. Buckets are
    never created here: a mistyped bucket name must be an error, not a new bucket."""
    try:
        store = SnapshotStore(run_uri)
        if store.is_local:
            store.makedirs(store.root)
        elif not store.exists(store.root.split("/", 1)[0]):
            raise FileNotFoundError(f"bucket {store.root.split('/', 1)[0]!r} does not exist")
        probe = store.path(f".baton-probe-{uuid.uuid4().hex[:8]}")
        store.write_file(probe, b"ok", durable=False)
        store.remove(probe)
        return store
    except Exception as err:  # noqa: BLE001 - any failure here means "cannot use this URI"
        raise RunDirError(
            f"snapshots.run_uri {run_uri!r} is not reachable or not writable "
            f"({type(err).__name__}: {err}). For s3:// check the bucket exists and the AWS "
            "credentials/endpoint (AWS_ENDPOINT_URL) are set; for a path, check permissions."
        ) from err


def check_run_dir(cfg: FitConfig, *, reschedule: bool = False) -> int:
    """All of the pre-flight checks above; returns the newest committed step (0 if none).
    `reschedule` accepts a change of the learning-rate schedule (`baton fit --reschedule`)."""
    check_dataset(cfg)
    check_local_capacity(cfg)
    store = _probe_writable(cfg.snapshots.run_uri)
    committed = store.committed_steps()
    if not committed:
        _refuse_quarantined_only(cfg, store)
    uri = data_uri(cfg)  # an empty data.uri: the corpus `ensure_dataset` prepared
    # run.json holds the vocab the driver resolved: compare it with this recipe's, resolved.
    check_continuation(with_dataset_vocab(cfg, uri) if committed else cfg,
                       fingerprint=dataset_fingerprint(uri) if committed else None,
                       store=store, committed=committed, reschedule=reschedule)
    return max(committed, default=0)


def _refuse_quarantined_only(cfg: FitConfig, store: SnapshotStore) -> None:
    """A run whose every snapshot was rejected must not quietly start again from step 0:
    the quarantined snapshots are the run's only trained state, and a person decides."""
    rows = store.quarantined()
    if not rows:
        return
    newest = rows[-1]
    raise RunDirError(
        f"snapshots.run_uri {cfg.snapshots.run_uri!r} has no committed snapshot, but "
        f"{len(rows)} quarantined (newest: step {newest['step']}: {newest['reason']}). "
        f"Inspect {newest['where']}; to start this run over, move the quarantine/ directory "
        "away (or use another --run-dir)."
    )
