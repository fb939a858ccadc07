"""Read-only tools over a run's snapshots: list, describe, verify, export.

Contract: these functions never modify the store. ``verify`` re-reads every chunk of a
snapshot and checks every checksum block (raises ``ValueError`` naming the first bad file,
chunk and block). ``export_model`` writes the logical model weights (keys without the
``model.`` prefix) as one plain safetensors file for inference. All reads go through the
same verified path as restore; nothing is unpickled.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from safetensors.torch import save_file

from elastic.format import MANIFEST_NAME, Manifest, str_to_dtype
from elastic.layout import Piece, Target
from elastic.restore import ByteSource, read_tensors
from elastic.store import SnapshotStore


def snapshot_rows(store: SnapshotStore) -> list[dict[str, Any]]:
    """One row per step directory: committed ones with size and world, others flagged."""
    rows = []
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
    return rows


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


def _whole(manifest: Manifest, keys: list[str], store: SnapshotStore
           ) -> dict[str, torch.Tensor]:
    targets = {}
    for key in keys:
        rec = manifest.tensors[key]
        piece = Piece(key, str_to_dtype(rec.dtype), rec.shape, (0,) * len(rec.shape), rec.shape)
        targets[key] = Target(piece, torch.device("cpu"), lambda t: t)
    return read_tensors(manifest, targets, ByteSource(store, manifest.step))


def verify(store: SnapshotStore, step: int, batch_bytes: int = 256 << 20) -> dict[str, int]:
    """Re-read every chunk of snapshot ``step`` and check all checksums."""
    manifest = store.load_manifest(step)
    keys = sorted(manifest.tensors)
    checked = 0
    batch: list[str] = []
    size = 0
    for key in keys + [None]:  # type: ignore[list-item]
        if key is not None:
            rec = manifest.tensors[key]
            batch.append(key)
            size += math.prod(rec.shape) * torch.empty((), dtype=str_to_dtype(rec.dtype)
                                                       ).element_size()
        if batch and (key is None or size >= batch_bytes):
            checked += len(_whole(manifest, batch, store))
            batch, size = [], 0
    return {"step": step, "tensors": checked, "bytes": manifest.nbytes()}


def export_model(store: SnapshotStore, step: int, out: str, component: str = "model") -> int:
    manifest = store.load_manifest(step)
    prefix = component + "."
    keys = [k for k in manifest.tensors if k.startswith(prefix)]
    if not keys:
        raise ValueError(f"snapshot {step} has no tensors under {component!r}; components: "
                         f"{sorted({k.split('.', 1)[0] for k in manifest.tensors})}")
    tensors = _whole(manifest, keys, store)
    save_file({k[len(prefix):]: v.contiguous() for k, v in tensors.items()}, out,
              metadata={"baton_step": str(step)})
    return len(keys)
