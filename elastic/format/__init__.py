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

Imports the storage layer's errors only (``elastic.errors``, ``elastic.storage``).
"""

from __future__ import annotations

from elastic.format.chunk_checks import (
    check_headers,
    check_shard_file,
    snapshot_label,
    verify_blocks,
)
from elastic.format.manifest_check import parse_manifest
from elastic.format.records import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    ChunkRecord,
    Manifest,
    SafetensorsHeader,
    TensorRecord,
    step_dirname,
)

__all__ = ["FORMAT_VERSION", "MANIFEST_NAME", "ChunkRecord", "Manifest", "SafetensorsHeader",
           "TensorRecord", "check_headers", "check_shard_file", "parse_manifest",
           "snapshot_label", "step_dirname", "verify_blocks"]
