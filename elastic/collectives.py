"""The small collectives elastic snapshots need: agree on a maximum, share one integer,
gather every rank's list of integers, and the device a group's tensors must live on.

Contract: all are no-ops without an initialised process group of more than one rank (then
``all_gather_ints`` returns ``[values]``). The tensors live where the backend can reduce
them (``group_device``): on this rank's CUDA device for NCCL (it refuses CPU tensors), on
the CPU otherwise (gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def grouped() -> bool:
    """Whether a process group of more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def group_device() -> torch.device:
    """Where tensors sent over the default group must live for its backend."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_max(value: int) -> int:
    """The maximum of ``value`` over all ranks (every rank must call this)."""
    if not grouped():
        return value
    flag = torch.tensor([value], dtype=torch.int64, device=group_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def broadcast_int(value: int, src: int = 0) -> int:
    """Rank ``src``'s ``value`` on every rank (every rank must call this)."""
    if not grouped():
        return value
    box = torch.tensor([value], dtype=torch.int64, device=group_device())
    dist.broadcast(box, src=src)
    return int(box.item())


def all_gather_ints(values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` (lists of any length), indexed by rank (all ranks call)."""
    if not grouped():
        return [list(values)]
    device, world = group_device(), dist.get_world_size()
    size = torch.tensor([len(values)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    counts = [int(s.item()) for s in sizes]
    longest = max(1, *counts)  # all_gather needs equal sizes: pad to the longest
    mine = torch.zeros(longest, dtype=torch.int64, device=device)
    mine[: len(values)] = torch.tensor(values, dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return [t[:n].tolist() for t, n in zip(everyone, counts, strict=True)]
