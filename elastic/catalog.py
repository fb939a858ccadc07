"""Tools over a run's snapshots: list, describe, verify, export, copy into another run.

Contract: these functions never modify the run they read. ``verify`` re-reads every chunk of a
snapshot through the same checks as restore — the manifest validated as it is parsed, each
file's safetensors header compared with the manifest, symlinked shard files refused, every
checksum block verified — and raises ``SnapshotIntegrityError`` (``ManifestError`` for a
malformed or unsafe manifest; both are ``ValueError``) with one line naming the snapshot and
the first bad field, file, chunk or block. ``export_model`` writes the logical model weights
(keys without the ``model.`` prefix) as one plain safetensors file for inference, only after
every tensor it exports was read and verified: on any failure nothing is written.
``copy_shard`` copies one shard file of a committed snapshot into the same step of another
run (a fork), create-only, only after reading it whole and checking it as ``verify`` would
(the file itself, its header against the manifest, every checksum block): a missing file is
``FileNotFoundError``; nothing is written unless every check passed; one file is held in
memory. What ``verify`` cannot check without a live trainer is whether the JSON state fits the
components that will load it (restore does that, ``StateRegistry.check_state``). Nothing is
unpickled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import save_file

from elastic.errors import SnapshotIntegrityError
from elastic.format import (
    MANIFEST_NAME,
    Manifest,
    SafetensorsHeader,
    check_headers,
    check_shard_file,
    itemsize,
    snapshot_label,
    str_to_dtype,
    verify_blocks,
)
from elastic.read import ByteSource, read_tensors
from elastic.state import Piece, Target
from elastic.store import SnapshotStore


def snapshot_rows(store: SnapshotStore) -> list[dict[str, Any]]:
    """One row per step directory: committed ones with size and world, others flagged (a
    step entry that is a link, refused and left alone, too)."""
    rows: list[dict[str, Any]] = [
        {"step": step, "committed": False, "refused": True, "note": why}
        for step, why in store.refused_steps().items()]
    committed = set(store.committed_steps())
    for step in store.all_steps():
        if step not in committed:
            rows.append({"step": step, "committed": False, "note": f"no {MANIFEST_NAME}"})
            continue
        try:
            m = store.load_manifest(step)
        except ValueError as err:
            rows.append({"step": step, "committed": True, "note": f"unreadable: {err}"})
            continue
        rows.append({"step": step, "committed": True, "world_size": m.world_size,
                     "layout": m.layout, "tensors": len(m.tensors), "bytes": m.nbytes(),
                     "files": len(m.files)})
    return sorted(rows, key=lambda r: r["step"])


def resolve_step(store: SnapshotStore, step: int | None) -> int:
    committed = store.committed_steps()
    if step is None:
        if not committed:
            raise ValueError(f"{store.run_uri}: no committed snapshot")
        return committed[-1]
    if step not in committed:
        raise ValueError(f"{store.run_uri}: step {step} is not a committed snapshot; "
                         f"committed: {committed}")
    return step


def describe(manifest: Manifest) -> dict[str, Any]:
    return {
        "step": manifest.step,
        "world_size": manifest.world_size,
        "layout": manifest.layout,
        "bytes": manifest.nbytes(),
        "files": manifest.files,
        "versions": manifest.versions,
        "tensors": {k: {"dtype": r.dtype, "shape": list(r.shape), "chunks": len(r.chunks)}
                    for k, r in sorted(manifest.tensors.items())},
        "state": {k: v for k, v in manifest.state.items()
                  if k not in ("model",)},  # the model skeleton only repeats tensor names
    }


def _whole(manifest: Manifest, keys: list[str], source: ByteSource
           ) -> dict[str, torch.Tensor]:
    targets = {}
    for key in keys:
        rec = manifest.tensors[key]
        piece = Piece(key, str_to_dtype(rec.dtype), rec.shape, (0,) * len(rec.shape), rec.shape)
        targets[key] = Target(piece, torch.device("cpu"), lambda t: t)
    return read_tensors(manifest, targets, source)


def verify(store: SnapshotStore, step: int, batch_bytes: int = 256 << 20) -> dict[str, int]:
    """Re-read every chunk of snapshot ``step`` and check headers and all checksums."""
    manifest = store.load_manifest(step)
    source = ByteSource(store, manifest.step)  # one source: each file's header read once
    checked = 0
    batch: list[str] = []
    size = 0
    for key in sorted(manifest.tensors):
        rec = manifest.tensors[key]
        batch.append(key)
        size += math.prod(rec.shape) * itemsize(rec.dtype)
        if size >= batch_bytes:
            checked += len(_whole(manifest, batch, source))
            batch, size = [], 0
    if batch:
        checked += len(_whole(manifest, batch, source))
    return {"step": step, "tensors": checked, "bytes": manifest.nbytes()}


def export_model(store: SnapshotStore, step: int, out: str, component: str = "model") -> int:
    manifest = store.load_manifest(step)
    prefix = component + "."
    keys = [k for k in manifest.tensors if k.startswith(prefix)]
    if not keys:
        raise ValueError(f"snapshot {step} has no tensors under {component!r}; components: "
                         f"{sorted({k.split('.', 1)[0] for k in manifest.tensors})}")
    tensors = _whole(manifest, keys, ByteSource(store, manifest.step))
    save_file({k[len(prefix):]: v.contiguous() for k, v in tensors.items()}, out,
              metadata={"baton_step": str(step)})
    return len(keys)


_READ_PIECE = 64 << 20  # copy_shard reads a file in ranges of this many bytes


@dataclass
class _FileBytes:
    """One shard file read whole, as the header source ``check_headers`` reads from."""

    data: bytes
    headers: dict[str, SafetensorsHeader] = field(default_factory=dict)

    def read_many(self, requests: list[tuple[str, int, int]]) -> list[bytes]:
        return [self.data[start:end] for _, start, end in requests]


def copy_shard(source: SnapshotStore, manifest: Manifest, name: str,
               target: SnapshotStore) -> int:
    """Copy shard file ``name`` of committed snapshot ``manifest`` from ``source`` into the
    same step of ``target``, create-only, once it checks out (module contract); its size."""
    step = manifest.step
    if name not in manifest.files:
        raise ValueError(f"{source.run_uri}: {name} is not a file of snapshot {step}")
    check_shard_file(source, step, name)  # a link or a FIFO is refused before any read
    path = source.step_path(step, name)
    size = source.size(path)
    data = b"".join(source.read_range(path, start, min(size, start + _READ_PIECE))
                    for start in range(0, size, _READ_PIECE))
    used = [(key, chunk) for key, record in manifest.tensors.items()
            for chunk in record.chunks if chunk.file == name]
    check_headers(manifest, used, _FileBytes(data))
    view = memoryview(data)
    for _, chunk in used:
        start, end = chunk.byte_range
        if end > len(data):
            raise SnapshotIntegrityError(f"{snapshot_label(step)}: {name} ends within chunk "
                                         f"{chunk.name}; truncated")
        verify_blocks(chunk, start, [view[start:end]], manifest.block_bytes, step)
    target.write_file(target.step_path(step, name), data, exclusive=True)
    return size
