"""The snapshot store: one run directory on a local path or ``s3://`` (fsspec).

Contract
--------
``SnapshotStore(run_uri)`` reads and writes ``RUN/run.json`` and ``RUN/snapshots/<step>/...``.

* Writes are atomic per file: on local disk the bytes go to a temporary name in the same
  directory, are fsync'ed (``durable=True``) and renamed; on S3 one ``PUT`` (or multipart
  upload, completed in one call) is atomic per object. A crashed writer therefore leaves at
  most a ``*.tmp-*`` file, never a half-written final name.
* A snapshot is *committed* iff its ``manifest.json`` exists. Everything else under
  ``snapshots/`` is an uncommitted leftover that readers ignore and the coordinator deletes.
* Reads are byte ranges (``read_range``), so a worker fetches only what it needs.
* ``stats`` counts storage reads, so tests can show that a restore touched no storage.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec

from elastic.format import MANIFEST_NAME, Manifest, step_dirname


@dataclass
class StoreStats:
    range_reads: int = 0
    bytes_read: int = 0
    files_written: int = 0


# Keep S3 failures short: a dead endpoint must fail the one snapshot quickly, not hang the
# background writer for minutes (s3fs/botocore default to long retry chains).
_S3_RETRIES = 2  # s3fs's own retry loop (class attribute, default 5)
_S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {"connect_timeout": 3, "read_timeout": 20,
                      "retries": {"max_attempts": 2, "mode": "standard"}},
}


class SnapshotStore:
    def __init__(self, run_uri: str, storage_options: dict[str, Any] | None = None) -> None:
        if not run_uri:
            raise ValueError("run_uri is empty; pass a directory path or s3://bucket/prefix")
        self.run_uri = run_uri.rstrip("/")
        options = dict(storage_options or {})
        if self.run_uri.startswith("s3://"):
            options = {**_S3_DEFAULTS, **options}
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint and "endpoint_url" not in options.get("client_kwargs", {}):
                options["client_kwargs"] = {**options.get("client_kwargs", {}),
                                            "endpoint_url": endpoint}
        self.fs, self.root = fsspec.core.url_to_fs(self.run_uri, **options)
        self.is_local = "file" in _protocols(self.fs)
        if "s3" in _protocols(self.fs):
            self.fs.retries = _S3_RETRIES
        self.stats = StoreStats()
        self._stats_lock = threading.Lock()

    # ------------------------------------------------------------------ paths

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def step_path(self, step: int, name: str = "") -> str:
        base = self.path("snapshots", step_dirname(step))
        return f"{base}/{name}" if name else base

    # ------------------------------------------------------------------ writes

    def write_file(self, path: str, data: bytes | memoryview, *, durable: bool = True,
                   mid_write: Callable[[], None] | None = None) -> None:
        """Atomically create ``path`` with ``data``. ``mid_write`` is a fault-injection hook
        called after half the bytes went to the temporary file (local) or before the PUT."""
        view = memoryview(data).cast("B")
        if self.is_local:
            directory = os.path.dirname(path)
            os.makedirs(directory, exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as fh:
                half = len(view) // 2
                fh.write(view[:half])
                if mid_write is not None:
                    fh.flush()
                    mid_write()
                fh.write(view[half:])
                if durable:
                    fh.flush()
                    os.fsync(fh.fileno())
            os.replace(tmp, path)
            if durable:
                _fsync_dir(directory)
        else:
            if mid_write is not None:
                mid_write()
            self.fs.pipe_file(path, bytes(view) if not isinstance(data, bytes) else data)
        with self._stats_lock:
            self.stats.files_written += 1

    def write_json(self, path: str, obj: Any, *, durable: bool = True) -> None:
        self.write_file(path, json.dumps(obj, indent=1).encode(), durable=durable)

    # ------------------------------------------------------------------ reads

    def read_range(self, path: str, start: int, end: int) -> bytes:
        data = self.fs.cat_file(path, start=start, end=end)
        if len(data) != end - start:
            raise ValueError(
                f"{path}: wanted bytes [{start}, {end}) but the file ends early; truncated"
            )
        with self._stats_lock:
            self.stats.range_reads += 1
            self.stats.bytes_read += len(data)
        return bytes(data)

    def read_file(self, path: str) -> bytes:
        data = bytes(self.fs.cat_file(path))
        with self._stats_lock:
            self.stats.range_reads += 1
            self.stats.bytes_read += len(data)
        return data

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    # ------------------------------------------------------------------ snapshots

    def all_steps(self) -> list[int]:
        """Every step directory, committed or not, ascending."""
        self.fs.invalidate_cache()
        base = self.path("snapshots")
        try:
            entries = self.fs.ls(base, detail=False)
        except FileNotFoundError:
            return []
        steps = []
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.isdigit():
                steps.append(int(name))
        return sorted(steps)

    def committed_steps(self) -> list[int]:
        return [s for s in self.all_steps() if self.exists(self.step_path(s, MANIFEST_NAME))]

    def load_manifest(self, step: int) -> Manifest:
        path = self.step_path(step, MANIFEST_NAME)
        try:
            data = self.read_file(path)
        except FileNotFoundError as err:
            raise ValueError(f"{path}: no manifest; snapshot {step} is not committed") from err
        manifest = Manifest.from_bytes(data, where=path)
        if manifest.step != step:
            raise ValueError(f"{path}: manifest says step {manifest.step}; corrupt or moved")
        return manifest

    def write_manifest(self, manifest: Manifest, *,
                       mid_write: Callable[[], None] | None = None) -> None:
        self.write_file(self.step_path(manifest.step, MANIFEST_NAME), manifest.to_bytes(),
                        mid_write=mid_write)

    def delete_step(self, step: int) -> None:
        """Remove a snapshot. The manifest goes first so a reader never sees a committed
        snapshot with missing shards."""
        manifest = self.step_path(step, MANIFEST_NAME)
        try:
            if self.exists(manifest):
                self.fs.rm(manifest)
            self.fs.rm(self.step_path(step), recursive=True)
        except FileNotFoundError:
            pass

    def ensure_run_json(self, info: dict[str, Any]) -> None:
        """Write ``run.json`` once (the first writer wins; later runs keep it)."""
        path = self.path("run.json")
        if not self.exists(path):
            self.write_json(path, info)

    def read_run_json(self) -> dict[str, Any] | None:
        path = self.path("run.json")
        if not self.exists(path):
            return None
        return json.loads(self.read_file(path))


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def _fsync_dir(directory: str) -> None:
    # The rename is durable only once the directory entry is; ignore filesystems that refuse.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
