"""Restore: read exactly the byte ranges this rank needs and materialise its state.

Contract
--------
``restore_into(registry, manifest, source)`` makes the registry hold snapshot
``manifest.step`` for the *current* layout of its model and optimizer (any world size, DDP
replica or FSDP2 shards, any device), or raises ``ValueError`` leaving the registry
untouched (everything is read and verified before anything is loaded).

* Targets come from the registry's current tensors (``layout.target_piece``). Optimizer
  moments that do not exist yet (fresh optimizer) take the layout of their parameter —
  the tensor named ``<param fqn>`` inside their key with the same global shape — and
  everything else is a plain CPU tensor (the optimizer's load_state_dict places it).
* For each target rectangle and each overlapping chunk the reader asks for one byte range:
  when the chunk and the target both span all of dims 1.. the needed rows are contiguous,
  otherwise the whole chunk is read. The range is widened to whole checksum blocks and
  every block read is verified against the manifest's crc32 (a mismatch names the file,
  chunk and block). Values are copied bitwise; nothing is ever unpickled.
* A snapshot whose tensors do not match the registered model raises
  ``SnapshotMismatchError`` listing missing, unexpected and shape-mismatched tensors.
* ``ByteSource`` is where bytes come from: the coordinator's RAM copy or the store.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from elastic.format import ChunkRecord, Manifest, step_dirname, str_to_dtype
from elastic.layout import Target, target_piece
from elastic.registry import ModelState, StateRegistry
from elastic.store import SnapshotStore

# (file, start, end) requests -> bytes per request, or None when the source cannot serve.
ReadMany = Callable[[list[tuple[str, int, int]]], list[bytes] | None]


class SnapshotMismatchError(ValueError):
    """The snapshot holds a different model than the one registered."""


@dataclass
class ByteSource:
    """Reads of one snapshot: from RAM when ``ram`` serves them, else from ``store``."""

    store: SnapshotStore
    step: int
    ram: ReadMany | None = None
    used_ram: bool = False
    used_storage: bool = False

    def read_many(self, requests: list[tuple[str, int, int]]) -> list[bytes]:
        if self.ram is not None and requests:
            got = self.ram(requests)
            if got is not None:
                self.used_ram = True
                return got
        self.used_storage = self.used_storage or bool(requests)
        out: list[bytes] = [b""] * len(requests)
        for file, start, end, members in coalesce(requests, MERGE_GAP_BYTES):
            path = self.store.step_path(self.step, file)
            try:
                data = self.store.read_range(path, start, end)
            except FileNotFoundError as err:
                raise ValueError(f"snapshot {step_dirname(self.step)}: shard file {file} is "
                                 "missing") from err
            view = memoryview(data)
            for i in members:
                out[i] = bytes(view[requests[i][1] - start: requests[i][2] - start])
        return out


# Requests closer than this are fetched as one range: one GET instead of many on S3, at the
# price of reading the gap.
MERGE_GAP_BYTES = 1 << 20


def coalesce(requests: list[tuple[str, int, int]], gap: int
             ) -> list[tuple[str, int, int, list[int]]]:
    """Group byte-range requests per file into merged ranges: (file, start, end, indices)."""
    order = sorted(range(len(requests)), key=lambda i: requests[i])
    merged: list[tuple[str, int, int, list[int]]] = []
    for i in order:
        file, start, end = requests[i]
        if merged and merged[-1][0] == file and start <= merged[-1][2] + gap:
            f, s0, e0, members = merged[-1]
            members.append(i)
            merged[-1] = (f, s0, max(e0, end), members)
        else:
            merged.append((file, start, end, [i]))
    return merged


@dataclass(frozen=True)
class _ReadOp:
    key: str
    chunk: ChunkRecord
    start: int  # block-aligned absolute byte range to fetch
    end: int
    # The rectangle, in global coordinates, that this op supplies to the target.
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    rows_only: bool  # bytes are the contiguous rows [data_start, ...) of the chunk


def check_compatible(registry: StateRegistry, manifest: Manifest,
                     templates: dict[str, torch.Tensor]) -> None:
    model_keys = [k for k, c in registry._components.items() if isinstance(c, ModelState)]
    missing = sorted(k for k in templates if k not in manifest.tensors)
    unexpected = sorted(k for k in manifest.tensors if k not in templates
                        and any(k.startswith(m + ".") for m in model_keys))
    mismatched = {k: (list(manifest.tensors[k].shape), list(t.shape))
                  for k, t in templates.items()
                  if k in manifest.tensors and tuple(t.shape) != manifest.tensors[k].shape}
    if missing or unexpected or mismatched:
        raise SnapshotMismatchError(
            f"snapshot {manifest.step} does not match the registered state: "
            f"missing {missing}, unexpected {unexpected}, "
            f"shape-mismatched (saved, expected) {mismatched}"
        )


def plan_targets(manifest: Manifest, templates: dict[str, torch.Tensor]) -> dict[str, Target]:
    # State the registry does not hold yet (a fresh optimizer's moments and step counters)
    # is built on CPU; the optimizer's own load_state_dict moves moments next to their
    # parameters and keeps non-capturable step counters on CPU, as torch expects.
    default_device = torch.device("cpu")
    targets: dict[str, Target] = {}
    for key, rec in manifest.tensors.items():
        dtype = str_to_dtype(rec.dtype)
        template = templates.get(key)
        if template is None:
            template = _parameter_like(key, rec.shape, templates)
        if template is None:
            template = torch.empty(rec.shape, dtype=dtype, device=default_device)
        targets[key] = target_piece(key, template, dtype=dtype, global_shape=rec.shape)
    return targets


def _parameter_like(key: str, shape: tuple[int, ...],
                    templates: dict[str, torch.Tensor]) -> torch.Tensor | None:
    # "optim.state.<fqn>.exp_avg" takes the layout of "model.<fqn>" when shapes agree.
    best: torch.Tensor | None = None
    best_len = -1
    for name, t in templates.items():
        fqn = name.split(".", 1)[-1]
        if f".{fqn}." in f".{key}." and name != key and tuple(t.shape) == shape \
                and len(fqn) > best_len:
            best, best_len = t, len(fqn)
    return best


def _plan_reads(manifest: Manifest, targets: dict[str, Target]) -> list[_ReadOp]:
    ops: list[_ReadOp] = []
    block = manifest.block_bytes
    for key, target in targets.items():
        rec = manifest.tensors[key]
        esize = torch.empty((), dtype=target.piece.dtype).element_size()
        t_lo = target.piece.offsets
        t_hi = tuple(o + s for o, s in zip(t_lo, target.piece.shape, strict=True))
        for chunk in rec.chunks:
            c_lo = chunk.offsets
            c_hi = tuple(o + s for o, s in zip(c_lo, chunk.shape, strict=True))
            lo = tuple(max(a, b) for a, b in zip(t_lo, c_lo, strict=True))
            hi = tuple(min(a, b) for a, b in zip(t_hi, c_hi, strict=True))
            if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)) and len(lo) > 0:
                continue
            c0, c1 = chunk.byte_range
            full_tail = len(lo) > 0 and all(
                lo[d] == c_lo[d] and hi[d] == c_hi[d] for d in range(1, len(lo)))
            if full_tail:
                row_bytes = math.prod(chunk.shape[1:]) * esize
                need0 = c0 + (lo[0] - c_lo[0]) * row_bytes
                need1 = c0 + (hi[0] - c_lo[0]) * row_bytes
            else:
                need0, need1 = c0, c1
            start = c0 + (need0 - c0) // block * block
            end = min(c1, c0 + -(-(need1 - c0) // block) * block)
            ops.append(_ReadOp(key, chunk, start, end, lo, hi, full_tail))
    return ops


def _verify(op: _ReadOp, data: bytes, block: int, step: int) -> None:
    c0 = op.chunk.byte_range[0]
    first = (op.start - c0) // block
    for i, pos in enumerate(range(0, len(data), block)):
        idx = first + i
        if idx >= len(op.chunk.crc32) or zlib.crc32(data[pos:pos + block]) != op.chunk.crc32[idx]:
            raise ValueError(
                f"snapshot {step_dirname(step)}: checksum mismatch in {op.chunk.file}, chunk "
                f"{op.chunk.name}, block {idx}; the snapshot is corrupt"
            )


def read_tensors(manifest: Manifest, targets: dict[str, Target],
                 source: ByteSource) -> dict[str, torch.Tensor]:
    """Read, verify and assemble every target's local tensor (wrapped as DTensor if needed)."""
    ops = _plan_reads(manifest, targets)
    blobs = source.read_many([(op.chunk.file, op.start, op.end) for op in ops])
    local = {k: torch.empty(t.piece.shape, dtype=t.piece.dtype) for k, t in targets.items()}
    filled = dict.fromkeys(targets, 0)
    for op, data in zip(ops, blobs, strict=True):
        if len(data) != op.end - op.start:
            raise ValueError(f"snapshot {step_dirname(manifest.step)}: {op.chunk.file} is "
                             f"truncated (chunk {op.chunk.name})")
        _verify(op, data, manifest.block_bytes, manifest.step)
        target = targets[op.key]
        dtype = target.piece.dtype
        c_lo = op.chunk.offsets
        if op.rows_only:
            esize = torch.empty((), dtype=dtype).element_size()
            row_bytes = math.prod(op.chunk.shape[1:]) * esize
            skip = (op.lo[0] - c_lo[0]) * row_bytes - (op.start - op.chunk.byte_range[0])
            raw = bytearray(data[skip: skip + (op.hi[0] - op.lo[0]) * row_bytes])
            src = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(
                (op.hi[0] - op.lo[0], *op.chunk.shape[1:]))
        else:
            raw = bytearray(data)
            whole = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(op.chunk.shape) \
                if raw else torch.empty(op.chunk.shape, dtype=dtype)
            src = whole[tuple(slice(a - o, b - o) for a, b, o in zip(op.lo, op.hi, c_lo,
                                                                       strict=True))]
        t_lo = target.piece.offsets
        dst = local[op.key][tuple(slice(a - o, b - o) for a, b, o in zip(op.lo, op.hi, t_lo,
                                                                           strict=True))]
        dst.copy_(src)
        filled[op.key] += src.numel()
    for key, target in targets.items():
        if filled[key] != target.piece.numel:
            raise ValueError(f"snapshot {step_dirname(manifest.step)}: chunks cover "
                             f"{filled[key]} of {target.piece.numel} elements of {key!r}")
    return {k: t.wrap(local[k].to(t.device)) for k, t in targets.items()}


def restore_into(registry: StateRegistry, manifest: Manifest, source: ByteSource) -> None:
    templates = registry.flatten().tensors
    check_compatible(registry, manifest, templates)
    targets = plan_targets(manifest, templates)
    tensors = read_tensors(manifest, targets, source)
    registry.load(tensors, manifest.state)
