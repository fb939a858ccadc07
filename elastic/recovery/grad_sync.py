"""The gradient all-reduce of a DDP model, on the membership's group.

Contract
--------
``GradientSync.attach(model, group)`` registers a DDP communication hook on ``model`` (a
``DistributedDataParallel`` over a process group of its own worker alone, as Ray Train's
replica groups give each worker) that averages the gradients over ``group``
(``elastic.recovery.group.ElasticGroup``) instead: the members of the current generation,
whatever they were when the model was wrapped. After ``backward()`` every member holds the
mean gradient of the group, as with plain DDP — clipping, loss scaling and the optimizer
see the same values.

Why one all-reduce per backward, in parameter order, once the last bucket is ready: DDP
sorts parameters into buckets and, after the first iteration, re-sorts them by the order
their gradients became ready, on each worker by itself. A worker that joins later holds
the first-iteration layout while the others hold the re-sorted one, so a bucket-by-bucket
all-reduce would add unrelated gradients. The hook therefore waits for the last bucket and
reduces all gradients flattened in the model's parameter order (one flat buffer per dtype),
which every member agrees on whatever its buckets. The cost is the overlap of communication
with the backward pass that bucket-wise DDP has.

A failed all-reduce (a member lost) does not raise inside ``backward()``: the group
records the failure and the gradients stay this worker's own; the step is then not applied
(``elastic.recovery.inprocess``) and is redone on the next membership. Registering fails
with ``ValueError`` when the model already has a communication hook.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as objects.
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic.recovery.group import ElasticGroup


class GradientSync:
    """See the module docstring."""

    def __init__(self, model: DistributedDataParallel, group: ElasticGroup) -> None:
        self.group = group
        self._order = {id(p): i for i, p in enumerate(model.parameters())}
        self._pending: list[tuple[Any, torch.futures.Future[torch.Tensor]]] = []
        self.syncs = 0  # all-reduces that succeeded (per backward)

    @classmethod
    def attach(cls, model: DistributedDataParallel, group: ElasticGroup) -> "GradientSync":
        sync = cls(model, group)
        try:
            model.register_comm_hook(sync, cls._hook)
        except RuntimeError as err:  # "can only be called once"
            raise ValueError(f"the model already has a DDP communication hook: {err}") from err
        return sync

    @staticmethod
    def _hook(state: "GradientSync", bucket: dist.GradBucket
              ) -> torch.futures.Future[torch.Tensor]:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        state._pending.append((bucket, future))
        if bucket.is_last():
            pending, state._pending = state._pending, []
            state._reduce([b for b, _ in pending])
            for b, f in pending:
                f.set_result(b.buffer())
        return future

    def _reduce(self, buckets: list[Any]) -> None:
        """Average every bucket's gradients over the group, in parameter order."""
        group = self.group
        if group.world_size <= 1 or group.broken:
            return
        by_dtype: dict[tuple[torch.dtype, torch.device], list[tuple[int, torch.Tensor]]] = {}
        for bucket in buckets:
            for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
                by_dtype.setdefault((grad.dtype, grad.device), []).append(
                    (self._order[id(param)], grad))
        for key in sorted(by_dtype, key=str):  # the same order on every member
            grads = [g for _, g in sorted(by_dtype[key], key=lambda item: item[0])]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if not group.all_reduce(flat, dist.ReduceOp.SUM):
                return  # the step will be redone: leave this worker's own gradients
            flat.div_(group.world_size)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self.syncs += 1
