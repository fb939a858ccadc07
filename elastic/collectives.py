"""The collectives Baton itself runs (agreements, restores, metrics), and on which group.

Contract: every collective of Baton's own goes through this module, on *the group*: the
membership's group of in-process recovery when one is installed (``use_group``:
``elastic.recovery.group.ElasticGroup``, whose members can change between steps while the
processes live on), else torch.distributed's default process group. ``rank()`` and
``world_size()`` are that group's (0 and 1 with none). All are no-ops without a group of
more than one rank (then ``all_gather_ints`` returns ``[values]``). The tensors live where
the backend can reduce them (``group_device``): on this rank's CUDA device for NCCL (it
refuses CPU tensors), on the CPU otherwise (gloo).

An installed group may fail mid-collective (a member lost): it then records the failure,
leaves the tensors as they were and returns, so a collective never raises into a step;
the step is redone once the group is formed again (``elastic.recovery``), so what a failed
collective left behind is never used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist


class Group(Protocol):
    """What Baton's collectives need of a group of ranks."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> object: ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> object: ...

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> object: ...

    def exchange(self, sends: list[tuple[torch.Tensor, int, int]],
                 recvs: list[tuple[torch.Tensor, int, int]]) -> object: ...


_installed: Group | None = None


@contextlib.contextmanager
def use_group(group: Group) -> Iterator[Group]:
    """Run Baton's collectives on ``group`` inside the block (a Session's lifetime)."""
    global _installed
    previous, _installed = _installed, group
    try:
        yield group
    finally:
        _installed = previous


def installed() -> Group | None:
    return _installed


def _default() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    if _installed is not None:
        return _installed.rank
    return dist.get_rank() if _default() else 0


def world_size() -> int:
    if _installed is not None:
        return _installed.world_size
    return dist.get_world_size() if _default() else 1


def grouped() -> bool:
    """Whether a group of more than one rank is there."""
    return world_size() > 1


def group_device() -> torch.device:
    """Where tensors sent over the group must live for its backend."""
    if _installed is not None:
        return _installed.device
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """In place, over the group (every rank calls)."""
    if not grouped():
        return
    if _installed is not None:
        _installed.all_reduce(tensor, op)
    else:
        dist.all_reduce(tensor, op=op)


def broadcast(tensor: torch.Tensor, src: int) -> None:
    """Rank ``src``'s ``tensor`` into every rank's (in place; every rank calls)."""
    if not grouped():
        return
    if _installed is not None:
        _installed.broadcast(tensor, src)
    else:
        dist.broadcast(tensor, src=src)


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor) -> bool:
    """Every rank's ``tensor`` (all of one shape) into ``outputs``, by rank. False when an
    installed group's collective failed (a member lost): ``outputs`` are then not to be
    trusted; torch.distributed's default group raises instead."""
    if not grouped():
        outputs[0].copy_(tensor)
        return True
    if _installed is not None:
        return _installed.all_gather(outputs, tensor) is not False
    dist.all_gather(outputs, tensor)
    return True


def exchange(sends: list[tuple[torch.Tensor, int, int]],
             recvs: list[tuple[torch.Tensor, int, int]]) -> None:
    """Point to point, all at once: each ``(tensor, peer, tag)`` of ``sends`` goes to its
    peer, each of ``recvs`` is filled from its peer; returns when all are done."""
    if not sends and not recvs:
        return
    if _installed is not None:
        _installed.exchange(sends, recvs)
        return
    ops = [dist.P2POp(dist.isend, t, peer, tag=tag) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, tag=tag) for t, peer, tag in recvs]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def agree_max(value: int) -> int:
    """The maximum of ``value`` over all ranks (every rank must call this)."""
    if not grouped():
        return value
    flag = torch.tensor([value], dtype=torch.int64, device=group_device())
    all_reduce(flag, dist.ReduceOp.MAX)
    return int(flag.item())


def broadcast_int(value: int, src: int = 0) -> int:
    """Rank ``src``'s ``value`` on every rank (every rank must call this)."""
    if not grouped():
        return value
    box = torch.tensor([value], dtype=torch.int64, device=group_device())
    broadcast(box, src)
    return int(box.item())


def all_gather_ints(values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` (lists of any length), indexed by rank (all ranks call)."""
    if not grouped():
        return [list(values)]
    device, world = group_device(), world_size()
    size = torch.tensor([len(values)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    all_gather(sizes, size)
    counts = [int(s.item()) for s in sizes]
    longest = max(1, *counts)  # all_gather needs equal sizes: pad to the longest
    mine = torch.zeros(longest, dtype=torch.int64, device=device)
    mine[: len(values)] = torch.tensor(values, dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    all_gather(everyone, mine)
    return [t[:n].tolist() for t, n in zip(everyone, counts, strict=True)]
