"""The two small collectives elastic snapshots need: agree on a maximum, share one integer.

Contract: both are no-ops without an initialised process group of more than one rank.
The tensor lives where the backend can reduce it: on this rank's CUDA device for NCCL (it
refuses CPU tensors), on the CPU otherwise (gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_max(value: int) -> int:
    """The maximum of ``value`` over all ranks (every rank must call this)."""
    if not _grouped():
        return value
    flag = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def broadcast_int(value: int, src: int = 0) -> int:
    """Rank ``src``'s ``value`` on every rank (every rank must call this)."""
    if not _grouped():
        return value
    box = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.broadcast(box, src=src)
    return int(box.item())
