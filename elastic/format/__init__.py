"""The snapshot format, torch-free: what a manifest and a shard file are, and the checks a
reader applies to both (``docs/snapshot-format.md``).

* ``records``: the manifest records (``Manifest``, ``TensorRecord``, ``ChunkRecord``), file
  names, dtypes, safetensors headers and crc32 blocks.
* ``manifest_check``: an untrusted ``manifest.json`` validated into a ``Manifest``.
* ``chunk_checks``: a snapshot's files checked against its manifest (shard files, headers,
  checksum blocks); the PyTorch restore, the catalog and the neutral reader
  (``elastic.portable``) all use these, so a crafted snapshot is refused the same way.
* ``finite``: a chunk's floating values checked finite as its bytes are verified (a NaN or
  an Inf is ``NonFiniteError``), by the same readers in the same pass.
* ``state_shapes``: the shapes an optimizer's per-parameter state may have (a moment its
  parameter's), checked from the manifest by the PyTorch restore and the neutral reader.

Imports the storage layer's errors only (``elastic.errors``, ``elastic.storage``). Callers
outside the room import the names below from here, whichever module defines them.
"""

from __future__ import annotations

from elastic.format.chunk_checks import (
    check_headers,
    check_shard_file,
    snapshot_label,
    verify_blocks,
)
from elastic.format.finite import finite_check
from elastic.format.manifest_check import MAX_MANIFEST_BYTES, check_manifest, parse_manifest
from elastic.format.records import (
    DEFAULT_BLOCK_BYTES,
    FORMAT_VERSION,
    ITEMS_TAG,
    LAYOUTS,
    MANIFEST_NAME,
    MAX_GENERATION,
    RECEIPT_SUFFIX,
    TENSOR_TAG,
    TUPLE_TAG,
    ChunkRecord,
    HeaderEntry,
    Manifest,
    SafetensorsHeader,
    TensorRecord,
    build_header,
    chunk_name,
    crc32_blocks,
    dtype_to_str,
    generation_tag,
    is_shard_name,
    itemsize,
    json_kind,
    parse_shard_name,
    shard_filename,
    short_repr,
    step_dirname,
    str_to_dtype,
)
from elastic.format.state_shapes import check_state_shapes

__all__ = ["ChunkRecord", "DEFAULT_BLOCK_BYTES", "FORMAT_VERSION", "HeaderEntry", "ITEMS_TAG",
           "LAYOUTS", "MANIFEST_NAME", "MAX_GENERATION", "MAX_MANIFEST_BYTES", "Manifest",
           "RECEIPT_SUFFIX", "SafetensorsHeader", "TENSOR_TAG", "TUPLE_TAG", "TensorRecord",
           "build_header", "check_headers", "check_manifest", "check_shard_file",
           "check_state_shapes", "chunk_name", "crc32_blocks", "dtype_to_str", "finite_check",
           "generation_tag", "is_shard_name", "itemsize", "json_kind", "parse_manifest",
           "parse_shard_name", "shard_filename", "short_repr", "snapshot_label", "step_dirname",
           "str_to_dtype", "verify_blocks"]
