"""The snapshot store: one run directory on a local path or ``s3://``.

``SnapshotStore(run_uri, storage_options=None, *, timeout_s=30.0, retry_deadline_s=60.0)`` reads
and writes ``RUN/run.json``, ``RUN/snapshots/<step>/...``, ``RUN/quarantine/...`` and
``RUN/spare/``. It is an ``elastic.storage.storage_io.Storage`` rooted at the run directory, so
every byte moves under that layer's contract (deadlines and retries on S3, from ``[snapshots]
storage_timeout_s / storage_retry_s``; exact range reads; atomic and create-only writes): it
never lies and never hangs. What it adds:

* A snapshot is *committed* iff its ``manifest.json`` exists; other step directories are
  uncommitted leftovers that readers ignore. A local entry of ``snapshots/`` that is not a real
  directory (a link to another run's step) is no step of this run: ``all_steps`` leaves it out,
  so nothing lists, reads, retires, quarantines or removes it (``refused_steps`` says why, one
  line, logged once).
* ``load_manifest`` reads at most ``MAX_MANIFEST_BYTES``; a manifest that is a link, a FIFO or
  another non-regular file is a ``ManifestError`` (the snapshot is unusable, nothing blocks).
* **Quarantine, never delete.** ``quarantine_step`` moves a rejected snapshot to
  ``RUN/quarantine/<step>[-k]/`` with ``reason.json`` (the reason, the time, and when known the
  run's generation and the step rewound to). Local: one directory rename, the reason written
  inside first. S3: claim the target by an exclusive create of ``reason.json``, copy every
  object, check the copies' sizes, then delete the originals manifest first; a crash mid-way
  leaves the snapshot committed where it was. Neither directory may be a link.
  ``unquarantine`` moves one back (the manifest last), for ``elastic.set_aside``.
* **Spares** (local): ``retire_step`` (retention) keeps its shard files in ``RUN/spare/`` and
  ``write_shard`` overwrites one instead of allocating a new file (``elastic.storage.spares``).
  On S3 both are the plain delete and create-only write.
* ``stats`` counts storage reads, so tests can show that a restore touched no storage.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

from elastic.errors import ManifestError, StorageUnavailableError
from elastic.format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    is_shard_name,
    parse_manifest,
    step_dirname,
)
from elastic.storage import (
    SPARE_DIR,
    RefusedEntryError,
    Storage,
    finite_number,
    fsync_dir,
    is_int64,
    retire,
)

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
        self._logged: set[str] = set()  # refusals already logged (all_steps runs often)
        self._relocated: dict[int, str] = {}  # step -> directory it is read from (viewing)

    # ------------------------------------------------------------------ paths

    def step_path(self, step: int, name: str = "") -> str:
        base = self._relocated.get(step) or self.path("snapshots", step_dirname(step))
        return f"{base}/{name}" if name else base

    def viewing(self, step: int, where: str) -> SnapshotStore:
        """A copy of this store that reads snapshot ``step`` from the directory ``where`` (a
        quarantined snapshot, verified before it comes back); nothing else differs."""
        view = copy.copy(self)
        view._relocated = {**self._relocated, step: where}
        return view

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
        """Every step directory, committed or not, ascending (listings are never cached).
        A local entry of ``snapshots/`` that is not a real directory (a symbolic link to
        another run's snapshot) is no step of this run: logged once, never read, retired,
        quarantined or removed (``refused_steps``)."""
        return [step for step, refusal in self._step_entries() if refusal is None]

    def refused_steps(self) -> dict[int, str]:
        """Step entries that are not real directories: step -> why (one line)."""
        return {step: refusal for step, refusal in self._step_entries() if refusal is not None}

    def _step_entries(self) -> list[tuple[int, str | None]]:
        entries = []
        for name in self.listdir(self.path("snapshots")):
            if not name.isdigit():
                continue
            refusal = None
            if self.is_local:
                kind = self._files.kind(self.path("snapshots", name))
                if kind not in ("directory", None):
                    refusal = (f"{self.path('snapshots', name)} is "
                               f"{'a symbolic link' if kind == 'link' else 'not a directory'}"
                               "; refused and left alone (a snapshot's directory must be a "
                               "directory inside its run)")
                    if refusal not in self._logged:
                        self._logged.add(refusal)
                        log.warning("%s", refusal)
            entries.append((int(name), refusal))
        return sorted(entries)

    def committed_steps(self) -> list[int]:
        return [s for s in self.all_steps() if self.exists(self.step_path(s, MANIFEST_NAME))]

    def load_manifest(self, step: int) -> Manifest:
        """Snapshot ``step``'s validated manifest; a manifest that is a link, a FIFO or not a
        regular file, or beyond the bounds, is a ``ManifestError`` (the snapshot is unusable)."""
        path = self.step_path(step, MANIFEST_NAME)
        try:
            data = self.read_file(path, max_bytes=MAX_MANIFEST_BYTES)
        except FileNotFoundError as err:
            raise ValueError(f"{path}: no manifest; snapshot {step} is not committed") from err
        except RefusedEntryError as err:
            raise ManifestError(f"snapshot {step}: {err.strerror}") from err
        except ValueError as err:  # longer than any manifest may be
            raise ManifestError(f"snapshot {step}: {err}") from err
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
        (``elastic.storage.spares``; at most one snapshot's shards are kept)."""
        if self.is_local:
            self.remove(self.step_path(step, MANIFEST_NAME))  # uncommitted before shards move
            shards = [self.step_path(step, n) for n in self.step_files(step)
                      if is_shard_name(n)]
            retire(shards, self.path(SPARE_DIR), keep=len(shards))
        self.delete_step(step)  # what was not taken as a spare

    def write_shard(self, step: int, name: str, data: memoryview, *, durable: bool = True,
                    mid_write: Callable[[], None] | None = None) -> None:
        """Write one shard file of snapshot ``step``, create-only (a shard name is written
        once), into a spare file when there is one (local stores, ``elastic.storage.spares``)."""
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
        none, it is not a JSON object within bounds, or it is a link or not a regular file
        (logged): every reader treats it as absent."""
        path = self.path("run.json")
        if not self.exists(path):
            return None
        try:
            value = self.read_json(path)
        except (ValueError, OSError) as err:  # bounds, a link, a FIFO, gone
            log.warning("%s is not readable JSON (%s); ignored", path, err)
            return None
        if not isinstance(value, dict):
            log.warning("%s is not a JSON object; ignored", path)
            return None
        return value

    # ------------------------------------------------------------------ quarantine

    def quarantine_step(self, step: int, reason: str, *, generation: int | None = None,
                        rewound_to: int | None = None) -> str:
        """Move snapshot ``step`` to ``RUN/quarantine/<step>[-k]/`` with ``reason.json``;
        returns the new location. Never deletes anything that has not been copied.
        ``generation`` (the run's worker-group generation when it was set aside: whatever a
        later one commits is another history) and ``rewound_to`` (the step training went
        back to) are recorded for ``elastic.set_aside.restore_quarantined``."""
        source = self.step_path(step)
        record: dict[str, Any] = {"step": step, "reason": str(reason), "time": time.time()}
        if generation is not None:
            record["generation"] = generation
        if rewound_to is not None:
            record["rewound_to"] = rewound_to
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
        self._plain_directory(source, f"snapshot {step} has no directory")
        # Written inside the snapshot first, so the one rename moves snapshot and reason.
        self.write_file(os.path.join(source, REASON_NAME), body)
        self.makedirs(self.path(QUARANTINE_DIR))
        self._plain_directory(self.path(QUARANTINE_DIR), "no quarantine directory")
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

    def _plain_directory(self, path: str, missing: str) -> None:
        """Refuse to move into or out of ``path`` unless it is a real directory: a link
        would move a snapshot across the run's boundary."""
        kind = self._files.kind(path)
        if kind is None:
            raise FileNotFoundError(errno.ENOENT, missing, path)
        if kind != "directory":
            raise RefusedEntryError(errno.ELOOP, f"{path} is not a real directory (a link or "
                                    "a file); refused and left alone", path)

    def unquarantine(self, where: str, step: int) -> None:
        """Move the quarantined snapshot at ``where`` back to ``snapshots/<step>/``, which
        must not exist; its manifest arrives last (local: one rename; S3: copies, the
        manifest's last, then the quarantined objects are removed). The caller checked
        that it verifies and may come back (``elastic.set_aside``)."""
        target = self.step_path(step)
        if self.exists(target) or self.exists(f"{target}/{MANIFEST_NAME}"):
            raise FileExistsError(errno.EEXIST, f"snapshot {step} exists again", target)
        if self.is_local:
            self._plain_directory(where, f"{where} is gone")
            self.makedirs(self.path("snapshots"))
            os.rename(where, target)
            fsync_dir(self.path("snapshots"))
            fsync_dir(self.path(QUARANTINE_DIR))
            self.remove(f"{target}/{REASON_NAME}")
            return
        objects = {n: size for n, size in self.find(where).items() if n != REASON_NAME}
        names = sorted(objects, key=lambda n: n == MANIFEST_NAME)  # the manifest last
        for name in names:
            self.copy(f"{where}/{name}", f"{target}/{name}", nbytes=objects[name])
        self.remove_many([f"{where}/{n}" for n in names] + [f"{where}/{REASON_NAME}"])

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
        """Rows ``{"step", "where", "reason", "time", "generation", "rewound_to"}`` for every
        quarantined snapshot, by step. ``reason.json`` is untrusted input: what cannot be
        read of it is None."""
        rows = []
        for name in self.listdir(self.path(QUARANTINE_DIR)):
            match = re.fullmatch(r"(\d+)(?:-\d+)?", name)
            if match is None:
                continue
            where = self.path(QUARANTINE_DIR, name)
            rows.append({"step": int(match.group(1)), "where": where,
                         **_read_reason(self, f"{where}/{REASON_NAME}")})
        return sorted(rows, key=lambda r: (r["step"], r["where"]))


def _read_reason(store: SnapshotStore, path: str) -> dict[str, Any]:
    """What ``reason.json`` says: reason, time, generation and rewound_to (None if not)."""
    try:
        record = store.read_json(path)
    except (OSError, ValueError):  # absent, a link, a FIFO, malformed: nothing known
        record = None
    record = record if isinstance(record, dict) else {}
    reason, when = record.get("reason"), record.get("time")
    generation, rewound = record.get("generation"), record.get("rewound_to")
    return {"reason": reason if isinstance(reason, str) else None,
            "time": float(when) if finite_number(when) else None,
            "generation": generation if is_int64(generation) and generation >= 0 else None,
            "rewound_to": rewound if is_int64(rewound) and rewound >= 0 else None}
