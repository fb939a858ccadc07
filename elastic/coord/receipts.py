"""From the shard receipts of one step to its manifest: the checks that make a commit whole.

Contract
--------
``manifest_from_receipts(step, world_size, generation, receipts, *, block_bytes, versions)``
builds the ``Manifest`` of ``step`` from the receipts of all ``world_size`` ranks (rank ->
receipt, as ``commit.CommitCore.report`` collected them) and returns it with its
``manifest.json`` bytes (serialised once: the check below parses them, and the commit writes
and keeps the same bytes; at tens of thousands of chunks a manifest is tens of MB), or
raises ``ValueError`` with one line saying what is wrong, in which case the step must be
aborted, not committed:

* rank 0's receipt carries the catalog of every logical tensor (dtype, shape), the state
  skeletons and the layout;
* every rank runs the same library versions as rank 0 (a mixed install could write shards
  another rank cannot read);
* every rank wrote exactly its own shard of this generation (``shard_filename``), so no
  straggler of another generation is mixed in;
* every chunk names a tensor of the catalog, and for every tensor the chunks cover exactly
  its element count (no tensor missing, none written twice);
* the manifest passes the checks a restore makes of it (``manifest_check.check_manifest``:
  chunks inside their tensor and not overlapping, byte ranges, checksums, state
  references), so nothing is committed that a restore would refuse.

The manifest's ``versions`` are ``versions`` (the coordinator's) updated with rank 0's. The
receipts are JSON-able dicts (``commit.py`` lists their fields); nothing here reads storage.
"""

from __future__ import annotations

import json
import math
from typing import Any

from elastic.errors import ManifestError
from elastic.format.manifest_check import check_manifest
from elastic.format.records import ChunkRecord, Manifest, TensorRecord, shard_filename


def manifest_from_receipts(
    step: int,
    world_size: int,
    generation: int,
    receipts: dict[int, dict[str, Any]],
    *,
    block_bytes: int,
    versions: dict[str, str],
) -> tuple[Manifest, bytes]:
    """The manifest of ``step`` from its ranks' receipts, checked (module docstring)."""
    head = receipts.get(0)
    if head is None or "catalog" not in head:
        raise ValueError(f"step {step}: rank 0's receipt lacks the tensor catalog")
    tensors = {
        k: TensorRecord(dtype=v["dtype"], shape=tuple(v["shape"]))
        for k, v in head["catalog"].items()
    }
    files = []
    for rank in sorted(receipts):
        receipt = receipts[rank]
        if receipt.get("versions") != head.get("versions"):
            raise ValueError(
                f"step {step}: rank {rank} runs {receipt.get('versions')}, "
                f"rank 0 runs {head.get('versions')}; install the same Baton "
                "on every node"
            )
        if receipt["file"] != shard_filename(rank, world_size, generation):
            raise ValueError(
                f"step {step}: rank {rank} wrote {receipt['file']!r}, not its "
                f"generation-{generation} shard"
            )
        files.append(receipt["file"])
        for key, chunks in receipt["chunks"].items():
            if key not in tensors:
                raise ValueError(f"step {step}: rank {rank} wrote unknown tensor {key!r}")
            tensors[key].chunks.extend(ChunkRecord.from_json(c) for c in chunks)
    for key, rec in tensors.items():
        covered = sum(math.prod(c.shape) for c in rec.chunks)
        if covered != math.prod(rec.shape):
            raise ValueError(
                f"step {step}: chunks of {key!r} cover {covered} of {math.prod(rec.shape)} elements"
            )
    manifest = Manifest(
        step=step,
        world_size=world_size,
        layout=head["layout"],
        block_bytes=block_bytes,
        tensors=tensors,
        state=head["skeletons"],
        files=files,
        versions={**versions, **head.get("versions", {})},
    )
    data = manifest.to_bytes()
    try:
        check_manifest(json.loads(data), f"step {step}", step)
    except ManifestError as err:
        raise ValueError(str(err)) from None
    return manifest, data
