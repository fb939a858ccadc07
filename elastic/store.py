"""The snapshot store: one run directory on a local path or ``s3://``.

Contract
--------
``SnapshotStore(run_uri, storage_options=None, *, timeout_s=30.0, retry_deadline_s=60.0)``
reads and writes ``RUN/run.json``, ``RUN/snapshots/<step>/...``, ``RUN/quarantine/...`` and
``RUN/spare/``.
It is an ``elastic.storage_io.Storage`` rooted at the run directory, so every byte moves under
that layer's contract: deadlines and retries on S3 (``timeout_s`` per attempt,
``retry_deadline_s`` per call: the ``[snapshots] storage_timeout_s / storage_retry_s``
settings), exact range reads (a truncated file is a definite ``SnapshotIntegrityError``, a
response cut short is retried), atomic writes (local: temp + fsync + rename + directory fsync;
S3: one PUT) and create-only writes (``write_file(..., exclusive=True)``). It never lies and
never hangs. What it adds:

* A snapshot is *committed* iff its ``manifest.json`` exists. Other step directories are
  uncommitted leftovers that readers ignore.
* **Quarantine, never delete.** ``quarantine_step`` moves a rejected snapshot to
  ``RUN/quarantine/<step>[-k]/`` with ``reason.json``. Local: one directory rename (the
  reason is written into the directory first, so it moves with it). S3: claim the target
  by an exclusive create of ``reason.json``, copy every object, check the copies' sizes,
  then delete the originals manifest first; nothing is deleted before its copy exists. A
  crash mid-way leaves the snapshot committed where it was (and a partial copy).
* ``stats`` counts storage reads, so tests can show that a restore touched no storage.
* **Spares** (local stores): ``retire_step`` — retention's removal of an old snapshot —
  keeps its shard files in ``RUN/spare/`` and ``write_shard`` overwrites one of them instead
  of allocating a new file (``elastic.spares``: why, and what a reader of a retired
  snapshot may see). On S3 both are the plain delete and create-only write.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

from elastic.errors import ManifestError, StorageUnavailableError
from elastic.format import MANIFEST_NAME, SHARD_NAME_RE, Manifest, step_dirname
from elastic.manifest_check import parse_manifest
from elastic.spares import SPARE_DIR, retire
from elastic.storage_io import Storage, fsync_dir

log = logging.getLogger("baton.elastic")

QUARANTINE_DIR = "quarantine"
REASON_NAME = "reason.json"


# ---------------------------------------------------------------------- the store


class SnapshotStore(Storage):
    def __init__(self, run_uri: str, storage_options: dict[str, Any] | None = None, *,
                 timeout_s: float = 30.0, retry_deadline_s: float = 60.0) -> None:
        if not run_uri:
            raise ValueError("run_uri is empty; pass a directory path or s3://bucket/prefix")
        super().__init__(run_uri, storage_options, timeout_s=timeout_s,
                         retry_deadline_s=retry_deadline_s)
        self.run_uri = self.uri

    # ------------------------------------------------------------------ paths

    def step_path(self, step: int, name: str = "") -> str:
        base = self.path("snapshots", step_dirname(step))
        return f"{base}/{name}" if name else base

    # ------------------------------------------------------------------ files

    def write_json(self, path: str, obj: Any, *, durable: bool = True,
                   exclusive: bool = False) -> None:
        self.write_file(path, json.dumps(obj, indent=1).encode(), durable=durable,
                        exclusive=exclusive)

    def step_files(self, step: int) -> list[str]:
        """The file names in snapshot ``step``'s directory (none when it is absent)."""
        return self.listdir(self.step_path(step))

    # ------------------------------------------------------------------ snapshots

    def all_steps(self) -> list[int]:
        """Every step directory, committed or not, ascending (listings are never cached)."""
        return sorted(int(n) for n in self.listdir(self.path("snapshots")) if n.isdigit())

    def committed_steps(self) -> list[int]:
        return [s for s in self.all_steps() if self.exists(self.step_path(s, MANIFEST_NAME))]

    def load_manifest(self, step: int) -> Manifest:
        path = self.step_path(step, MANIFEST_NAME)
        try:
            data = self.read_file(path)
        except FileNotFoundError as err:
            raise ValueError(f"{path}: no manifest; snapshot {step} is not committed") from err
        if self.is_local and os.path.islink(path):
            raise ManifestError(f"{path}: is a symbolic link; a snapshot's files must be "
                                "plain files inside it")
        return parse_manifest(data, where=path, step=step)

    def write_manifest(self, manifest: Manifest, *, data: bytes | None = None,
                       mid_write: Callable[[], None] | None = None,
                       exclusive: bool = False) -> None:
        """Commit ``manifest``: ``data`` is its ``to_bytes()`` when the caller has it."""
        self.write_file(self.step_path(manifest.step, MANIFEST_NAME),
                        manifest.to_bytes() if data is None else data,
                        mid_write=mid_write, exclusive=exclusive)

    def delete_step(self, step: int) -> None:
        """Remove a snapshot. The manifest goes first so a reader never sees a committed
        snapshot with missing shards."""
        self.remove(self.step_path(step, MANIFEST_NAME))
        self.remove_tree(self.step_path(step))

    def retire_step(self, step: int) -> None:
        """Remove a snapshot that retention no longer keeps, as ``delete_step``, except that
        on a local store its shard files become spares for the next snapshots' writes
        (``elastic.spares``; at most one snapshot's shards are kept)."""
        if self.is_local:
            self.remove(self.step_path(step, MANIFEST_NAME))  # uncommitted before shards move
            shards = [self.step_path(step, n) for n in self.step_files(step)
                      if SHARD_NAME_RE.fullmatch(n)]
            retire(shards, self.path(SPARE_DIR), keep=len(shards))
        self.delete_step(step)  # what was not taken as a spare

    def write_shard(self, step: int, name: str, data: memoryview, *, durable: bool = True,
                    mid_write: Callable[[], None] | None = None) -> None:
        """Write one shard file of snapshot ``step``, create-only (a shard name is written
        once), into a spare file when there is one (local stores, ``elastic.spares``)."""
        spare_dir = self.path(SPARE_DIR) if self.is_local else None
        self.write_file(self.step_path(step, name), data, durable=durable, exclusive=True,
                        mid_write=mid_write, spare_dir=spare_dir)

    def delete_files(self, step: int, names: list[str]) -> None:
        """Remove only the named files of snapshot ``step`` (missing ones are ignored), e.g.
        one generation's files, leaving another generation's beside them untouched."""
        for name in names:
            if not name or "/" in name or "\\" in name or name in (".", ".."):
                raise ValueError(f"delete_files: {name!r} is not a plain file name")
        self.remove_many([self.step_path(step, n) for n in names])

    def ensure_run_json(self, info: dict[str, Any]) -> None:
        """Write ``run.json``: the first writer of a run that has committed a snapshot wins
        (later sessions keep it). One left by sessions that never committed (a crash before
        the first commit, a fork cut short) describes nothing on storage and is replaced,
        so it cannot later refuse the recipe the run was really made with."""
        try:
            self.write_json(self.path("run.json"), info, exclusive=True)
        except FileExistsError:
            if not self.committed_steps():
                self.write_json(self.path("run.json"), info)

    def read_run_json(self) -> dict[str, Any] | None:
        """``run.json`` (untrusted: what a run describes of itself), or None when there is
        none, it is not a JSON object or it is a symbolic link (logged): every reader treats
        it as absent."""
        path = self.path("run.json")
        if not self.exists(path):
            return None
        try:
            value = json.loads(self.read_file(path, own=True))
        except (ValueError, RecursionError, OSError) as err:  # OSError: a link (ELOOP), gone
            log.warning("%s is not readable JSON (%s); ignored", path, err)
            return None
        if not isinstance(value, dict):
            log.warning("%s is not a JSON object; ignored", path)
            return None
        return value

    # ------------------------------------------------------------------ quarantine

    def quarantine_step(self, step: int, reason: str) -> str:
        """Move snapshot ``step`` to ``RUN/quarantine/<step>[-k]/`` with ``reason.json``;
        returns the new location. Never deletes anything that has not been copied."""
        source = self.step_path(step)
        record = {"step": step, "reason": str(reason), "time": time.time()}
        body = json.dumps(record, indent=1).encode()
        if self.is_local:
            return self._quarantine_local(step, source, body)
        return self._quarantine_s3(step, source, body)

    def _quarantine_targets(self, step: int) -> list[str]:
        """Free quarantine names for ``step`` in order (``<step>``, ``<step>-2``, ...)."""
        taken = set(self.listdir(self.path(QUARANTINE_DIR)))
        base = step_dirname(step)
        names = [base] + [f"{base}-{k}" for k in range(2, len(taken) + 3)]
        return [self.path(QUARANTINE_DIR, n) for n in names if n not in taken]

    def _quarantine_local(self, step: int, source: str, body: bytes) -> str:
        if not os.path.isdir(source):
            raise FileNotFoundError(errno.ENOENT, f"snapshot {step} has no directory", source)
        # Written inside the snapshot first, so the one rename moves snapshot and reason.
        self.write_file(os.path.join(source, REASON_NAME), body)
        os.makedirs(self.path(QUARANTINE_DIR), exist_ok=True)
        for target in self._quarantine_targets(step):
            try:
                os.rename(source, target)  # fails if a non-empty target appeared meanwhile
            except OSError as err:
                if err.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    continue
                raise
            fsync_dir(os.path.dirname(source))
            fsync_dir(self.path(QUARANTINE_DIR))
            return target
        raise FileExistsError(errno.EEXIST, "no free quarantine name", source)

    def _quarantine_s3(self, step: int, source: str, body: bytes) -> str:
        objects = {n: s for n, s in self.find(source).items() if n != REASON_NAME}
        if not objects:
            raise FileNotFoundError(errno.ENOENT, f"snapshot {step} has no objects", source)
        target = self._claim_quarantine(step, body)
        for name in objects:  # copy everything first
            self.copy(f"{source}/{name}", f"{target}/{name}", nbytes=objects[name])
        copied = self.find(target)
        missing = [n for n, size in objects.items() if copied.get(n) != size]
        if missing:
            raise StorageUnavailableError(
                f"{target}: copies of {missing} are missing or differ in size; the snapshot "
                "stays where it is")
        # The manifest goes first: from then on readers no longer see step as committed.
        names = sorted(objects, key=lambda n: n != MANIFEST_NAME)
        self.remove(f"{source}/{names[0]}")
        self.remove_many([f"{source}/{n}" for n in names[1:]])
        return target

    def _claim_quarantine(self, step: int, body: bytes) -> str:
        # The exclusive create of reason.json is the claim: two quarantines of one step never
        # share a target (where the store has conditional writes).
        for target in self._quarantine_targets(step):
            try:
                self.write_file(f"{target}/{REASON_NAME}", body, exclusive=True)
                return target
            except FileExistsError:
                continue
        raise FileExistsError(errno.EEXIST, "no free quarantine name", self.step_path(step))

    def quarantined(self) -> list[dict[str, Any]]:
        """Rows ``{"step", "where", "reason", "time"}`` for every quarantined snapshot, by
        step. ``reason.json`` is untrusted input: an unreadable one gives reason None."""
        rows = []
        for name in self.listdir(self.path(QUARANTINE_DIR)):
            match = re.fullmatch(r"(\d+)(?:-\d+)?", name)
            if match is None:
                continue
            where = self.path(QUARANTINE_DIR, name)
            reason, when = _read_reason(self, f"{where}/{REASON_NAME}")
            rows.append({"step": int(match.group(1)), "where": where, "reason": reason,
                         "time": when})
        return sorted(rows, key=lambda r: (r["step"], r["where"]))


def _read_reason(store: SnapshotStore, path: str) -> tuple[str | None, float | None]:
    try:
        record = json.loads(store.read_file(path))
    except (FileNotFoundError, ValueError):
        return None, None
    if not isinstance(record, dict):
        return None, None
    reason, when = record.get("reason"), record.get("time")
    return (reason if isinstance(reason, str) else None,
            float(when) if isinstance(when, int | float) and not isinstance(when, bool)
            else None)
