"""Commit a snapshot written from numpy arrays: what a Baton driver commits, without torch.

``write_snapshot(run_uri, step, tensors, state, *, versions=None, run_info=None,
lease_ttl_s=60.0)`` commits snapshot ``step`` of the run at ``run_uri`` holding ``tensors``
(logical key ``<component>.<name>`` -> numpy array) and ``state`` (component -> JSON skeleton
whose ``{"__tensor__": key}`` leaves reference every tensor exactly once, as
``elastic.state.registry`` writes it), and returns its ``Manifest``, following the run's rules
for writers (P3, P7):

* **One writer.** It holds the run lease (``elastic.lease.run_lease.RunLease``) for the write. A
  live driver holding it makes it refuse (``LeaseHeldError``, one line naming the holder); a
  lease left by a dead holder on this host is taken over as a driver would.
* **A generation of its own** (``generation.json`` + 1), so its shard file
  ``shard-00000-of-00001-gNNNNNN.safetensors`` is a name no other writer uses, written
  create-only.
* **The manifest last, create-only**, built by ``elastic.coord.receipts.manifest_from_receipts``
  (the coordinator's checks, every restore check included) and written with an exclusive
  create after the fencing check (``elastic.coord.generation.fencing_reason``). A step already
  committed, or not newer than the newest committed step, is refused (``ValueError``): a
  committed snapshot is never overwritten, and restore would never pick an older one.
* On any failure before the commit its generation's files are removed
  (``elastic.coord.collect.delete_generation_files``); nothing else is touched.

One shard, one chunk per tensor, layout ``ddp``, world size 1: any world size and layout
restores it (restore reshards). The shard is built in memory (its size in bytes); any byte
order is stored little-endian. ``run_info`` is written as ``run.json`` when the run has none.
Retention (``keep_last``) is left to the run's next driver.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from elastic.coord import (
    Receipt,
    TensorSpec,
    delete_generation_files,
    fencing_reason,
    manifest_from_receipts,
    read_generation,
    remove_failed_manifest,
    write_generation,
)
from elastic.errors import FencedError
from elastic.format import (
    DEFAULT_BLOCK_BYTES,
    FORMAT_VERSION,
    ChunkRecord,
    HeaderEntry,
    Manifest,
    build_header,
    chunk_name,
    crc32_blocks,
    shard_filename,
)
from elastic.lease import held_lease
from elastic.portable.arrays import dtype_name
from elastic.store import SnapshotStore
from elastic.version import code_version


def portable_versions() -> dict[str, str]:
    """What the manifest records about the code that wrote it."""
    return {"baton_format": str(FORMAT_VERSION), "baton": code_version(),
            "numpy": np.__version__, "writer": "elastic.portable"}


def write_snapshot(run_uri: str, step: int, tensors: Mapping[str, np.ndarray],
                   state: dict[str, Any], *, versions: dict[str, str] | None = None,
                   run_info: dict[str, Any] | None = None, lease_ttl_s: float = 60.0,
                   storage_options: dict[str, Any] | None = None) -> Manifest:
    """Commit ``tensors`` and ``state`` as snapshot ``step`` (module contract)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    store = SnapshotStore(run_uri, storage_options)
    # Not renewed: a write that outlasts ``lease_ttl_s`` may lose the lease to another
    # driver, and then the fencing check below refuses its commit.
    with held_lease(store, ttl_s=lease_ttl_s, renew=False) as lease:
        newest = store.committed_steps()
        if newest and step <= newest[-1]:
            raise ValueError(f"{store.run_uri}: step {step} is not newer than the newest "
                             f"committed snapshot ({newest[-1]}); a committed snapshot is never "
                             "overwritten and restore takes the newest: write a later step")
        if run_info is not None:
            store.ensure_run_json(run_info)
        generation = read_generation(store) + 1
        write_generation(store, generation)
        try:
            manifest, data = _write_shard(store, step, generation, tensors, state,
                                          {**portable_versions(), **(versions or {})})
            reason = fencing_reason(store, generation, lease.token)
            if reason is not None:
                raise FencedError(f"{store.run_uri}: snapshot {step} not committed: {reason}")
        except BaseException:
            delete_generation_files(store, step, generation, 1, step_committed=False)
            raise
        try:
            store.write_manifest(manifest, data=data, exclusive=True)
        except BaseException:
            # A write that raised may have landed (a lost answer): the files go only once the
            # manifest is known to be absent, never those of a committed snapshot.
            if remove_failed_manifest(store, step, data):
                delete_generation_files(store, step, generation, 1, step_committed=False)
            raise
        return manifest


def _write_shard(store: SnapshotStore, step: int, generation: int,
                 tensors: Mapping[str, np.ndarray], state: dict[str, Any],
                 versions: dict[str, str]) -> tuple[Manifest, bytes]:
    """Write the one shard file (create-only) and return the checked manifest and its
    bytes, not yet committed."""
    file = shard_filename(0, 1, generation)
    arrays = {k: _little_endian(v) for k, v in sorted(tensors.items())}
    entries, offset = [], 0
    for key, arr in arrays.items():
        entries.append(HeaderEntry(chunk_name(key, (0,) * arr.ndim), dtype_name(arr.dtype, key),
                                   tuple(arr.shape), (offset, offset + arr.nbytes)))
        offset += arr.nbytes
    header = build_header(entries)
    image = bytearray(len(header) + offset)
    image[:len(header)] = header
    chunks: dict[str, tuple[ChunkRecord, ...]] = {}
    for (key, arr), entry in zip(arrays.items(), entries, strict=True):
        start = len(header) + entry.data_offsets[0]
        raw = arr.reshape(-1).view(np.uint8)
        memoryview(image)[start: start + arr.nbytes] = raw.data
        chunks[key] = (ChunkRecord(
            file=file, name=entry.name, offsets=(0,) * arr.ndim, shape=entry.shape,
            byte_range=(start, start + arr.nbytes),
            crc32=tuple(crc32_blocks(memoryview(image)[start: start + arr.nbytes],
                                     DEFAULT_BLOCK_BYTES))),)
    receipt = Receipt(step=step, rank=0, world_size=1, generation=generation, layout="ddp",
                      file=file, chunks=chunks, versions=versions, skeletons=state,
                      catalog={k: TensorSpec(dtype=e.dtype, shape=e.shape)
                               for k, e in zip(arrays, entries, strict=True)})
    # The coordinator's checks: a manifest a restore would refuse is never committed.
    manifest, data = manifest_from_receipts(step, 1, generation, {0: receipt},
                                            block_bytes=DEFAULT_BLOCK_BYTES, versions={})
    store.write_shard(step, file, memoryview(image))
    return manifest, data


def _little_endian(value: np.ndarray) -> np.ndarray:
    """``value`` as a C-contiguous little-endian array of its own shape (0-d stays 0-d:
    ``np.ascontiguousarray`` would make it 1-d)."""
    arr = np.asarray(value)
    arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    return arr if arr.flags.c_contiguous else arr.copy(order="C")
