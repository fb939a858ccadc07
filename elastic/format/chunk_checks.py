"""What a reader checks of a snapshot's files against its manifest, torch-free.

Contract
--------
Both readers of the format use these, so a crafted snapshot is refused the same way by the
PyTorch restore (``elastic.read.restore``, ``elastic.read.read_batches``) and by the
framework-neutral reader (``elastic.portable``); the manifest itself was checked when it was parsed
(``elastic.format.manifest_check``).

* ``check_shard_file(store, step, file)``: on a local store a shard file must be a regular
  file inside the snapshot's own directory; a symbolic link, or a path resolving elsewhere,
  or a directory/FIFO/device is ``ManifestError`` (a missing file is left for the read to
  report as ``SnapshotIntegrityError``). S3 has no links: nothing to check there.
* ``check_headers(manifest, used, source)``: each used ``(key, chunk)`` must be in its file's
  safetensors header with the manifest's dtype, shape and absolute byte range (else
  ``ManifestError``). ``source`` is any ``HeaderSource``: its ``headers`` cache (file ->
  parsed header) is filled by one small range read per file, from byte 0 up to the file's
  first chunk (the data section starts right after the header), in batches of at most
  ``HEADER_BATCH_BYTES`` so that a manifest alone cannot make every file's header buffer be
  allocated before a read fails.
* ``verify_blocks(chunk, start, parts, block, step)``: the crc32 of every checksum block of
  the bytes ``[start, ...)`` of ``chunk`` (``start`` on a block boundary of the chunk), which
  arrived as the consecutive buffers ``parts`` (a block may span two). A mismatch is
  ``SnapshotIntegrityError`` naming the snapshot, file, chunk and block. ``values`` (e.g.
  ``elastic.format.finite.finite_check``) is fed the same bytes, piece by piece right after
  each piece's crc32, so checking values costs no second pass over memory.

Nothing here allocates per element or executes anything read from a snapshot.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from typing import Protocol

from elastic.errors import ManifestError, SnapshotIntegrityError
from elastic.format.records import (
    MAX_HEADER_BYTES,
    ChunkRecord,
    Manifest,
    SafetensorsHeader,
    crc32,
    parse_header,
    step_dirname,
)

HEADER_BATCH_BYTES = 64 << 20  # header bytes per read batch (real ones: KiB-MiB per file)
# verify_blocks hands values to check in pieces of this many bytes, each right after its
# crc32: small enough to be still in the core's cache (elastic.format.finite measures it).
VALUE_PIECE_BYTES = 256 << 10


def snapshot_label(step: int) -> str:
    return f"snapshot {step_dirname(step)}"


class HeaderSource(Protocol):
    """Where ``check_headers`` reads file headers from (``elastic.read.byte_source.ByteSource``,
    ``elastic.portable.reader``'s source)."""

    headers: dict[str, SafetensorsHeader]

    def read_many(self, requests: list[tuple[str, int, int]]) -> list[bytes]: ...


class StepFiles(Protocol):
    """Where a snapshot's files are (``elastic.store.SnapshotStore``): whether the store is
    local, and the path of a step's directory or of a file in it."""

    @property
    def is_local(self) -> bool: ...

    def step_path(self, step: int, name: str = "") -> str: ...


def check_shard_file(store: StepFiles, step: int, file: str) -> None:
    """A local shard must be a regular file inside the snapshot's own directory: a symlink
    could make a reader read any file the process can read into a weight, a FIFO would block
    its open forever, and a directory would read as unreachable storage."""
    if not store.is_local:
        return
    path, directory = store.step_path(step, file), store.step_path(step)
    if (os.path.islink(path) or os.path.islink(directory)
            or os.path.dirname(os.path.realpath(path)) != os.path.realpath(directory)):
        raise ManifestError(f"{snapshot_label(step)}: shard file {file} is a symbolic link or "
                            "resolves outside the snapshot directory; refused")
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return  # the read says it is missing
    if not regular:
        raise ManifestError(f"{snapshot_label(step)}: shard file {file} is not a regular file "
                            "(a directory, FIFO or device); refused")


def check_headers(manifest: Manifest, used: list[tuple[str, ChunkRecord]],
                  source: HeaderSource) -> None:
    """Each used chunk must be in its file's safetensors header with the manifest's dtype,
    shape and absolute byte range. Reads each file's header once per ``source``."""
    snap = snapshot_label(manifest.step)
    wanted = sorted({chunk.file for _, chunk in used} - set(source.headers))
    if wanted:
        _read_headers(manifest, wanted, source)
    for key, chunk in used:
        header = source.headers[chunk.file]
        entry = header.entries.get(chunk.name)
        dtype = manifest.tensors[key].dtype
        where = f"{snap}: chunk {chunk.name} of {chunk.file}"
        if entry is None:
            raise ManifestError(f"{where} is not in the file's safetensors header")
        if entry.dtype != dtype:
            raise ManifestError(f"{where} is {entry.dtype} in the file but {dtype} in the "
                                "manifest")
        if entry.shape != chunk.shape:
            raise ManifestError(f"{where} has shape {list(entry.shape)} in the file but "
                                f"{list(chunk.shape)} in the manifest")
        span = (header.data_start + entry.data_offsets[0],
                header.data_start + entry.data_offsets[1])
        if span != chunk.byte_range:
            raise ManifestError(f"{where} is at bytes {list(span)} of the file but "
                                f"{list(chunk.byte_range)} in the manifest")


def _read_headers(manifest: Manifest, wanted: list[str], source: HeaderSource) -> None:
    snap = snapshot_label(manifest.step)
    # The header ends where the file's first chunk starts (capture writes the data section
    # right after it), so one range read per file fetches exactly the header.
    first: dict[str, int] = {}
    todo = set(wanted)
    for rec in manifest.tensors.values():
        for c in rec.chunks:
            if c.file in todo:
                first[c.file] = min(first.get(c.file, c.byte_range[0]), c.byte_range[0])
    for file in wanted:
        if not 8 <= first[file] <= 8 + MAX_HEADER_BYTES:
            raise ManifestError(f"{snap}: the first chunk of {file} starts at byte "
                                f"{first[file]}, where no safetensors data section can")
    batches: list[list[str]] = [[]]
    for file in wanted:
        size = sum(map(first.__getitem__, batches[-1])) + first[file]
        if batches[-1] and size > HEADER_BATCH_BYTES:
            batches.append([])
        batches[-1].append(file)
    for batch in batches:
        blobs = source.read_many([(f, 0, first[f]) for f in batch])
        for file, blob in zip(batch, blobs, strict=True):
            if len(blob) != first[file]:
                raise SnapshotIntegrityError(f"{snap}: {file} ends within its header; "
                                             "truncated")
            source.headers[file] = parse_header(blob, f"{snap}: {file}")


def verify_blocks(chunk: ChunkRecord, start: int, parts: Sequence[memoryview | bytes],
                  block: int, step: int,
                  values: Callable[[memoryview | bytes], None] | None = None) -> None:
    """Check the crc32 of every checksum block of ``chunk``'s bytes from absolute offset
    ``start`` on, which arrived in ``parts`` (module contract); ``values`` is fed each
    piece of at most ``VALUE_PIECE_BYTES`` right after its crc32 took it, while it is still
    in the core's cache (``elastic.format.finite.finite_check``)."""
    c0 = chunk.byte_range[0]
    idx, crc, filled = (start - c0) // block, 0, 0

    def check() -> None:
        if idx >= len(chunk.crc32) or crc != chunk.crc32[idx]:
            raise SnapshotIntegrityError(
                f"{snapshot_label(step)}: checksum mismatch in {chunk.file}, chunk "
                f"{chunk.name}, block {idx}; the snapshot is corrupt")

    piece = VALUE_PIECE_BYTES if values is not None else block
    for part in parts:
        pos = 0
        while pos < len(part):
            take = min(block - filled, len(part) - pos, piece)
            crc = crc32(part[pos: pos + take], crc)
            if values is not None:
                values(part[pos: pos + take])
            pos, filled = pos + take, filled + take
            if filled == block:
                check()
                idx, crc, filled = idx + 1, 0, 0
    if filled:
        check()
