"""Who writes which chunk at save time, and which rectangle each rank needs at load time.

Contract
--------
A *piece* is a hyper-rectangle of a logical tensor: ``(key, offsets, shape)``.

Save (``owned_pieces``): every element of every logical tensor is written by exactly one
rank, and the decision depends only on names, shapes, dtypes, placements, ``rank`` and
``world_size`` (never on timing), so all ranks agree without talking.

* FSDP2 / DTensor sharded tensors: each rank writes its own local shard (offsets from the
  DTensor's placements); on mesh dimensions where the tensor is replicated only mesh
  coordinate 0 writes, so nothing is written twice. Empty shards are skipped.
* Replicated tensors (DDP, or plain tensors such as the AdamW step counter): large tensors
  (``>= split_min_bytes``) are split along dim 0 into ``world_size`` near-equal row blocks,
  block ``r`` written by rank ``r``; small tensors are assigned whole by a balanced greedy
  over bytes (largest first, to the least-loaded rank). Writes are parallel, no duplicates.

Load (``target_piece``): a plain tensor needs its whole logical tensor; a DTensor needs the
rectangle of its local shard at the *new* mesh, and ``wrap`` rebuilds the DTensor from it.
A target's ``fill``, when set, is the live tensor (a DTensor's local shard) the restore reads
into instead of allocating one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeGuard

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

DEFAULT_SPLIT_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Piece:
    key: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class OwnedPiece:
    piece: Piece
    source: torch.Tensor  # a view of live state holding exactly this piece's elements


def _row_block(n_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(n_rows, world_size)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


def _dtensor_local(t: DTensor) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """(local shape, global offsets, whether this rank is the designated writer)."""
    for p in t.placements:
        if not isinstance(p, (Shard, Replicate)):
            raise ValueError(
                f"DTensor placement {p} is not supported in snapshots; use Shard or Replicate"
            )
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    coords = t.device_mesh.get_coordinate() or ()
    writer = all(c == 0 for c, p in zip(coords, t.placements, strict=False)
                 if isinstance(p, Replicate))
    return tuple(shape), tuple(offsets), writer


def _is_sharded(t: torch.Tensor) -> TypeGuard[DTensor]:
    return isinstance(t, DTensor) and any(isinstance(p, Shard) for p in t.placements)


def owned_pieces(tensors: dict[str, torch.Tensor], rank: int, world_size: int,
                 split_min_bytes: int = DEFAULT_SPLIT_MIN_BYTES) -> list[OwnedPiece]:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    owned: list[OwnedPiece] = []
    small: list[tuple[str, torch.Tensor]] = []
    load = [0] * world_size
    for key in sorted(tensors):
        t = tensors[key]
        if _is_sharded(t):
            shape, offsets, writer = _dtensor_local(t)
            local = t.to_local()
            if writer and local.numel() > 0:
                owned.append(OwnedPiece(Piece(key, t.dtype, tuple(t.shape), offsets, shape),
                                        local))
            continue
        full = t.to_local() if isinstance(t, DTensor) else t
        gshape = tuple(full.shape)
        nbytes = full.numel() * full.element_size()
        if nbytes >= split_min_bytes and full.dim() >= 1 and gshape[0] >= world_size:
            for r in range(world_size):
                start, rows = _row_block(gshape[0], world_size, r)
                load[r] += rows * (nbytes // gshape[0])
                if r == rank:
                    offsets = (start,) + (0,) * (full.dim() - 1)
                    piece = Piece(key, full.dtype, gshape, offsets, (rows, *gshape[1:]))
                    owned.append(OwnedPiece(piece, full.narrow(0, start, rows)))
        else:
            small.append((key, full))
    # Balanced greedy over bytes: largest first, each to the least-loaded rank.
    small.sort(key=lambda kv: (-kv[1].numel() * kv[1].element_size(), kv[0]))
    for key, full in small:
        r = min(range(world_size), key=lambda i: (load[i], i))
        load[r] += full.numel() * full.element_size()
        if r == rank:
            gshape = tuple(full.shape)
            owned.append(OwnedPiece(Piece(key, full.dtype, gshape, (0,) * len(gshape), gshape),
                                    full))
    return owned


@dataclass(frozen=True)
class Target:
    piece: Piece
    device: torch.device
    wrap: Callable[[torch.Tensor], torch.Tensor]
    # The live local tensor a restore writes into (``elastic.read.restore.plan_targets`` with
    # ``in_place``): contiguous, of the piece's shape and dtype, sole owner of its storage.
    # None: the restore allocates the piece's tensor.
    fill: torch.Tensor | None = field(default=None, compare=False)


def target_piece(key: str, template: torch.Tensor, dtype: torch.dtype | None = None,
                 global_shape: tuple[int, ...] | None = None) -> Target:
    """What this rank must materialise for ``key`` so it matches ``template``'s layout."""
    dtype = dtype or template.dtype
    if isinstance(template, DTensor):
        gshape = tuple(global_shape or template.shape)
        shape, offsets = compute_local_shape_and_global_offset(
            gshape, template.device_mesh, template.placements)
        mesh, placements = template.device_mesh, template.placements
        stride = torch.empty(gshape, device="meta").stride()

        def wrap(local: torch.Tensor) -> torch.Tensor:
            return DTensor.from_local(local, mesh, placements, run_check=False,
                                      shape=torch.Size(gshape), stride=stride)

        device = template.to_local().device
        return Target(Piece(key, dtype, gshape, tuple(offsets), tuple(shape)), device, wrap)
    gshape = tuple(global_shape or template.shape)
    return Target(Piece(key, dtype, gshape, (0,) * len(gshape), gshape), template.device,
                  lambda t: t)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def storage_owners(tensors: dict[str, torch.Tensor]) -> dict[tuple[str, int], int]:
    """How many of ``tensors`` (DTensors: their local shards) share each storage."""
    owners: dict[tuple[str, int], int] = {}
    for t in tensors.values():
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.device.type != "meta":
            owners[_storage_key(local)] = owners.get(_storage_key(local), 0) + 1
    return owners


def with_fill(target: Target, template: torch.Tensor,
              owners: dict[tuple[str, int], int]) -> Target:
    """``target`` filled in place into ``template`` (its local shard) when that can take the
    bytes as they are: contiguous, of the piece's shape, not empty, and the only one of the
    registry's tensors on its storage (``owners``: tied weights and a buffer that views a
    parameter are loaded by copy, in the registry's order, as before); else ``target``."""
    local = template.to_local() if isinstance(template, DTensor) else template
    if (local.is_contiguous() and tuple(local.shape) == target.piece.shape
            and local.dtype == target.piece.dtype and local.device.type != "meta"
            and local.numel() > 0 and owners.get(_storage_key(local)) == 1):
        return replace(target, fill=local)
    return target
