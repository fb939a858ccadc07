"""Read a Baton run's snapshots with numpy: no torch, the same checks as the PyTorch restore.

``PortableRun(run_uri, storage_options=None)`` opens a run directory (local path or
``s3://bucket/prefix/run``) through Baton's storage layer (``SnapshotStore``):

* ``committed_steps()``: the committed snapshots (with a ``manifest.json``), ascending;
  ``newest()`` the last one (``ValueError`` naming the run when there is none).
* ``manifest(step)``: the parsed manifest, validated by ``elastic.format.manifest_check`` (the
  checks every reader applies; P8).
* ``read(step=None, keys=None)`` -> ``Snapshot``: the logical (unsharded) tensors named by
  ``keys`` (default: all), each assembled from its chunks into one C-contiguous numpy array,
  and the JSON ``state``. Before a tensor byte is read every used shard file passes the
  shard-file rule and every used chunk is compared with its file's safetensors header
  (``elastic.format.chunk_checks``); every byte read is verified against the manifest's crc32
  blocks, every floating value must be finite (``elastic.format.finite``). A failure is
  ``SnapshotIntegrityError`` (``ManifestError``, ``NonFiniteError``), one line naming the
  snapshot and the field, file, chunk or block; nothing is returned, unpickled or executed.
* ``run_info()``: ``run.json`` (recipe, versions) or None, read as the run's own (no link).

``Snapshot.component(name)`` decodes one component's JSON state with its tensors in place
(``elastic.portable.arrays.decode_state``; ``"data"`` is the data cursor).
``Snapshot.check_optimizer_shapes(component, optimizer, model="model")`` applies the PyTorch
restore's shape rule (``elastic.format.state_shapes``; for ``"AdamW"``: ``step`` a scalar, each
moment its parameter ``<model>.<fqn>``'s shape) from the manifest alone, raising a one-line
``SnapshotMisfitError`` naming the tensor; a reader that knows the optimizer calls it
(``trainer.on_jax.load_train_state`` does), ``read`` cannot know it.

Each chunk is read once, whole (a row block straight into its place, any other through one
buffer of its size): about 1x the bytes read in memory. It reads alone (no process group): a
multi-host JAX job reads the whole state on each host.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from elastic.errors import SnapshotIntegrityError
from elastic.format import (
    ChunkRecord,
    Manifest,
    SafetensorsHeader,
    check_headers,
    check_shard_file,
    check_state_shapes,
    finite_check,
    snapshot_label,
    verify_blocks,
)
from elastic.portable.arrays import decode_state, numpy_dtype
from elastic.store import SnapshotStore


@dataclass
class Snapshot:
    """One committed snapshot as numpy arrays and JSON (see the module contract)."""

    step: int
    tensors: dict[str, np.ndarray]
    state: dict[str, Any]  # component -> JSON skeleton, {"__tensor__": key} leaves
    manifest: Manifest

    def component(self, name: str) -> Any:
        """Component ``name``'s state with its tensors, tuples and non-string keys decoded."""
        if name not in self.state:
            raise KeyError(f"snapshot {self.step} has no component {name!r}; it has "
                           f"{sorted(self.state)}")
        return decode_state(self.state[name], self.tensors)

    def check_optimizer_shapes(self, component: str, optimizer: str, model: str = "model"
                               ) -> None:
        """The restore's shape rule on ``component``'s per-parameter state (contract)."""
        prefix = f"{model}."
        shapes = {key: tuple(rec.shape) for key, rec in self.manifest.tensors.items()}
        params = {key[len(prefix):]: shape for key, shape in shapes.items()
                  if key.startswith(prefix)}
        check_state_shapes(snapshot_label(self.step), self.state.get(component), params,
                           shapes, component, optimizer)


@dataclass
class _Source:
    """Range reads of one snapshot's shard files, each file checked once before its first
    read (the shard-file rule); caches the parsed headers for ``check_headers``."""

    store: SnapshotStore
    step: int
    headers: dict[str, SafetensorsHeader] = field(default_factory=dict)
    _checked: set[str] = field(default_factory=set)

    def _path(self, file: str) -> str:
        if file not in self._checked:
            check_shard_file(self.store, self.step, file)
            self._checked.add(file)
        return self.store.step_path(self.step, file)

    def read_many(self, requests: list[tuple[str, int, int]]) -> list[bytes]:
        return [self.read(file, start, end) for file, start, end in requests]

    def read(self, file: str, start: int, end: int) -> bytes:
        try:
            return self.store.read_range(self._path(file), start, end)
        except FileNotFoundError as err:
            raise SnapshotIntegrityError(f"{snapshot_label(self.step)}: shard file {file} is "
                                         "missing") from err

    def read_into(self, file: str, start: int, buffer: memoryview) -> None:
        try:
            self.store.read_into(self._path(file), [(start, [buffer])])
        except FileNotFoundError as err:
            raise SnapshotIntegrityError(f"{snapshot_label(self.step)}: shard file {file} is "
                                         "missing") from err


class PortableRun:
    """A Baton run directory, read with numpy (module contract)."""

    def __init__(self, run_uri: str, storage_options: dict[str, Any] | None = None) -> None:
        self.store = SnapshotStore(run_uri, storage_options)
        self.run_uri = self.store.run_uri

    def committed_steps(self) -> list[int]:
        return self.store.committed_steps()

    def newest(self) -> int:
        steps = self.committed_steps()
        if not steps:
            raise ValueError(f"{self.run_uri}: no committed snapshot")
        return steps[-1]

    def manifest(self, step: int) -> Manifest:
        return self.store.load_manifest(step)

    def run_info(self) -> dict[str, Any] | None:
        return self.store.read_run_json()

    def read(self, step: int | None = None, keys: Iterable[str] | None = None) -> Snapshot:
        """The tensors ``keys`` (default: all) and the JSON state of ``step`` (default: the
        newest committed snapshot), every byte verified."""
        step = self.newest() if step is None else step
        if step not in self.committed_steps():
            raise ValueError(f"{self.run_uri}: step {step} is not a committed snapshot; "
                             f"committed: {self.committed_steps()}")
        manifest = self.manifest(step)
        wanted = sorted(manifest.tensors) if keys is None else list(keys)
        unknown = [k for k in wanted if k not in manifest.tensors]
        if unknown:
            raise ValueError(f"{snapshot_label(step)} has no tensors {unknown}")
        source = _Source(self.store, step)
        check_headers(manifest, [(k, c) for k in wanted for c in manifest.tensors[k].chunks],
                      source)
        tensors = {key: _assemble(manifest, key, source) for key in wanted}
        return Snapshot(step=step, tensors=tensors, state=manifest.state, manifest=manifest)


def _assemble(manifest: Manifest, key: str, source: _Source) -> np.ndarray:
    """Tensor ``key`` from its chunks (exact cover: checked with the manifest)."""
    rec = manifest.tensors[key]
    dtype = numpy_dtype(rec.dtype, key)
    try:
        out = np.empty(rec.shape, dtype=dtype)
    except (MemoryError, ValueError) as err:
        raise SnapshotIntegrityError(f"{snapshot_label(manifest.step)}: cannot allocate "
                                     f"{rec.shape} {rec.dtype} for {key!r} ({err})") from err
    for chunk in rec.chunks:
        _place(manifest, key, chunk, out, source)
    return out


def _place(manifest: Manifest, key: str, chunk: ChunkRecord, out: np.ndarray,
           source: _Source) -> None:
    start, end = chunk.byte_range
    if end == start:
        return  # an empty chunk holds no element
    rows_only = bool(out.ndim) and all(o == 0 for o in chunk.offsets[1:]) \
        and chunk.shape[1:] == out.shape[1:]
    if rows_only or out.ndim == 0:
        # A row block (or a scalar) is contiguous in the output: read straight into it.
        row = math.prod(out.shape[1:]) * out.itemsize if out.ndim else out.itemsize
        first = chunk.offsets[0] * row if out.ndim else 0
        view = out.reshape(-1).view(np.uint8).data[first: first + (end - start)]
        source.read_into(chunk.file, start, view)
        verify_blocks(chunk, start, [view], manifest.block_bytes, manifest.step,
                      finite_check(chunk, key, start, manifest.step))
        return
    data = source.read(chunk.file, start, end)
    verify_blocks(chunk, start, [data], manifest.block_bytes, manifest.step,
                  finite_check(chunk, key, start, manifest.step))
    piece = np.frombuffer(data, dtype=out.dtype).reshape(chunk.shape)
    out[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.shape, strict=True))] = piece
