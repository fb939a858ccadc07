"""Full checksums of replicated state, taken while a capture reads it: the exact replica check.

Why: a snapshot of replicated (DDP) state is written in pieces, each by one rank
(``elastic.state.layout.owned_pieces``: a large tensor in row blocks, a small one whole by
one rank), and every chunk's crc32 covers only what its writer held. Replicas that differ in
one element of one tensor would be committed mixed, and every checksum would pass. The
sampled fingerprints of ``elastic.replicas`` (a few elements per tensor, compared in the
all-reduce the ranks make anyway at ``begin_capture``) refuse a divergence that is
everywhere, before a byte is written, but miss one element. So, at world size > 1, every rank
also checksums every replicated tensor it holds, whole (not only the part it writes), and
the coordinator refuses to commit a step whose ranks disagree (``elastic.coord.receipts``).

Contract
--------
* ``replica_checksums(tensors)`` -> ``{key: crc32}`` for every replicated tensor of
  ``tensors`` (any tensor but a DTensor with a ``Shard`` placement, whose ranks hold different
  shards; a replicated DTensor's local tensor): the crc32 of its bytes in row-major order (a
  non-contiguous tensor is made contiguous first). A CPU tensor is read in place (zlib
  releases the GIL: the training thread runs on meanwhile); a tensor on a device is copied to
  the CPU in slabs of at most ``SLAB_BYTES`` (bounded memory), on the caller's current stream.
  Equal bytes give equal sums on every rank; one element that differs (up to 4 bytes) always
  changes the sum (crc32 detects every error burst of up to 32 bits); wider differences are
  missed with probability 2^-32.
* Where it runs: on the capture thread (``elastic.write.capture``), after the chunk copies
  and before ``CaptureHandle.wait()`` returns, because the bytes are only the snapshot's
  until the next optimizer step. It overlaps the next forward/backward, as the copies do; a
  capture longer than forward/backward shows as stall. Cost: one pass over the replicated
  state per snapshot and rank at crc32's speed (1.4-2.1 GB/s on one core of the 2-core test
  machine); pipelined, the stall per snapshot was unchanged within noise there:
  ``benchmarks/reports/2026-12-07-replica-checksums.md``.
"""

from __future__ import annotations

import zlib

import torch
from torch.distributed.tensor import DTensor, Shard

SLAB_BYTES = 64 << 20  # a device tensor's bytes cross to the CPU in pieces of at most this


def _replicated(tensor: torch.Tensor) -> torch.Tensor | None:
    if isinstance(tensor, DTensor):
        if any(isinstance(p, Shard) for p in tensor.placements):
            return None  # each rank holds its own shard: nothing to compare
        tensor = tensor.to_local()
    return tensor


def _crc32(tensor: torch.Tensor) -> int:
    """crc32 of ``tensor``'s bytes, row-major (contract)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        return zlib.crc32(flat.numpy().data)
    crc = 0
    for start in range(0, flat.numel(), SLAB_BYTES):
        crc = zlib.crc32(flat[start:start + SLAB_BYTES].cpu().numpy().data, crc)
    return crc


def replica_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """The crc32 of every replicated tensor of ``tensors`` (contract)."""
    with torch.no_grad():
        return {key: _crc32(local) for key in sorted(tensors)
                if (local := _replicated(tensors[key])) is not None}
