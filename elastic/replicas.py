"""Replica fingerprints: a cheap check, at each snapshot, that state every rank must hold the
same (a DDP model, its optimizer moments) is the same on every rank.

Why: a snapshot of replicated state is written in pieces, each by one rank
(`elastic.state.layout.owned_pieces`); diverged replicas (a model nobody wrapped in DDP, a
rank-dependent update) would be committed mixed tensor by tensor, every checksum passing.

- `fingerprints(tensors, step, samples=SAMPLES)` -> `(names, values)`: for every replicated
  tensor (any but a sharded DTensor; a replicated DTensor's local tensor), sorted by name,
  `samples` elements at positions derived from `(name, step)` only (the same on every rank;
  others next snapshot, so a long run samples much of each tensor), as the int64 bit patterns
  of their float64 values (every dtype compares exactly). `values` is an int64 CPU tensor of
  `len(names) * samples` entries; cost: one small gather per tensor, no copy.
- `agree(busy, names, values)` (every rank, same names): one all-reduce (MAX) of
  `[busy, values, ~values]`; returns `(busy on any rank, the first name whose fingerprint
  differs, or None)`; `(busy, None)` without a process group of more than one rank.
- `divergence_message(name, step)`: the snapshot's one-line failure
  (`elastic.errors.divergence_message`).

Two checks, kept both on purpose:
- these fingerprints, at `begin_capture`, before a byte is written: a divergence that is
  everywhere fails the snapshot on every rank at once with `ReplicasDivergedError` (a
  `FatalRunError`: such a run cannot snapshot again). ~2 ms for 300 tensors, riding on the
  all-reduce the ranks make anyway, but 4 elements per tensor almost never catch one element;
- full checksums (`elastic.write.replica_sums`): the capture thread's crc32 of every
  replicated tensor a rank holds, whole, overlapping forward/backward; the commit refuses a
  step whose ranks disagree anywhere (`elastic.coord.receipts`), naming tensor and ranks, and
  training goes on to the next step whose replicas agree. Exact and off the training thread,
  but known only at the commit.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from elastic.collectives import all_reduce, group_device, grouped
from elastic.errors import divergence_message as divergence_line

SAMPLES = 4  # elements per tensor and snapshot: a diverged replica differs almost everywhere
# Odd 64-bit constants (splitmix64's): consecutive steps and samples land far apart.
_STEP_MIX, _SAMPLE_MIX = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9


def _replicated(tensor: torch.Tensor) -> torch.Tensor | None:
    if isinstance(tensor, DTensor):
        if any(isinstance(p, Shard) for p in tensor.placements):
            return None  # each rank holds its own shard: nothing to compare
        tensor = tensor.to_local()
    return tensor if tensor.numel() > 0 and not tensor.is_complex() else None


@functools.lru_cache(maxsize=65536)
def _name_seed(name: str) -> int:
    return zlib.crc32(name.encode())


def _numpy_view(tensor: torch.Tensor) -> np.ndarray | None:
    """A CPU tensor as a numpy array without a copy (None: on a device, or no numpy dtype)."""
    if tensor.device.type != "cpu" or tensor.dtype in (torch.bfloat16, torch.float8_e4m3fn,
                                                       torch.float8_e5m2):
        return None
    return tensor.detach().numpy()


def fingerprints(tensors: dict[str, torch.Tensor], step: int,
                 samples: int = SAMPLES) -> tuple[list[str], torch.Tensor]:
    chosen = [(name, t) for name in sorted(tensors)
              if (t := _replicated(tensors[name])) is not None]
    names = [name for name, _ in chosen]
    if not chosen:
        return names, torch.zeros(0, dtype=torch.int64)
    # Every tensor's positions at once (uint64 arithmetic wraps, as intended).
    seeds = np.array([_name_seed(name) for name in names], dtype=np.uint64)
    numels = np.array([t.numel() for _, t in chosen], dtype=np.uint64)
    mixed = (seeds[:, None] + np.uint64(step * _STEP_MIX % 2**64)
             + np.arange(samples, dtype=np.uint64)[None, :] * np.uint64(_SAMPLE_MIX))
    positions = (mixed % numels[:, None]).astype(np.int64)
    out = np.empty((len(chosen), samples), dtype=np.float64)
    on_devices: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    with torch.no_grad():
        for i, (_, tensor) in enumerate(chosen):
            where = np.unravel_index(positions[i], tuple(tensor.shape)) if tensor.dim() else ()
            array = _numpy_view(tensor)
            if array is not None:
                out[i] = array[where] if array.ndim else array
                continue
            index = tuple(torch.from_numpy(w).to(tensor.device) for w in where)
            values = tensor[index] if index else tensor.reshape(1).expand(samples)
            on_devices.setdefault(tensor.device, []).append((i, values.to(torch.float64)))
    for rows in on_devices.values():  # one copy to the CPU per device
        gathered = torch.stack([values for _, values in rows]).cpu().numpy()
        out[[i for i, _ in rows]] = gathered
    return names, torch.from_numpy(out.reshape(-1).view(np.int64).copy())


def agree(busy: int, names: list[str], values: torch.Tensor) -> tuple[int, str | None]:
    if not grouped():
        return busy, None
    mine = torch.cat([torch.tensor([busy], dtype=torch.int64), values, ~values])
    box = mine.to(group_device())
    all_reduce(box, dist.ReduceOp.MAX)
    reduced = box.cpu()
    count = values.numel()
    highest, lowest = reduced[1:1 + count], ~reduced[1 + count:]
    differs = (highest != lowest).reshape(len(names), -1).any(dim=1) if names else None
    first = None
    if differs is not None and bool(differs.any()):
        first = names[int(torch.nonzero(differs)[0, 0])]
    return int(reduced[0]), first


def divergence_message(name: str, step: int) -> str:
    return divergence_line(name, step)
