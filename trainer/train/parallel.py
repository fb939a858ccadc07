"""Data-parallel wrapping and world-size-invariant gradient accumulation.

Contract:
- `wrap_model(model, parallelism, device, precision=)` returns the model as DDP (replicated)
  or FSDP2 (`fully_shard` per transformer block, `shard_units`, then the root, each with
  `precision`'s `MixedPrecisionPolicy`, `trainer.train.precision`); with no process group (a single
  process) the model is returned as is. DDP takes no precision: the loop autocasts.
- `accumulation_passes(num_mine, num_microbatches, world_size, parallelism)` is how many
  forward/backward passes this rank runs in a step. FSDP2 issues collectives in every pass,
  so every rank must run the same number: ranks with fewer microbatches pad with passes
  whose loss weight is zero. DDP only communicates in the last (synchronised) backward, so
  no padding is needed.
- `grad_sync(model, last)` is the context for one backward (its forward included): gradients
  are reduced across ranks only on the last pass of a step (DDP: `no_sync()` around the
  others; FSDP2: `set_requires_gradient_sync`; anything else, or a single process: nothing).
- `parallelism_of(model)`: "fsdp" for an FSDP2 model, "ddp" for a DDP one, None otherwise;
  `unwrapped(model)` is a DDP model's `module`, any other model itself.
- `loss_weight(world_size, num_microbatches)`: DDP and FSDP2 average gradients over ranks;
  scaling each microbatch's mean loss by `world_size / num_microbatches` turns that average
  into the mean over all microbatches of the step, whatever the world size (promise P1).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from elastic import collectives
from elastic.recovery import shard_mesh
from trainer.train.precision import fsdp_policy, fsdp_root_policy


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def wrap_model(model: nn.Module, parallelism: str, device: torch.device, *,
               precision: str = "fp32") -> nn.Module:
    if not distributed():
        return model
    if parallelism == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    if parallelism == "fsdp":
        # Shard block by block so only one block's parameters are gathered at a time.
        mesh = shard_mesh(device.type)
        for block in shard_units(model):
            fully_shard(block, mesh=mesh, mp_policy=fsdp_policy(precision))
        fully_shard(model, mesh=mesh, mp_policy=fsdp_root_policy(precision))
        return model
    raise ValueError(f"parallelism must be 'ddp' or 'fsdp', got {parallelism!r}")


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one (then the root takes the rest): the built-in
    GPT's `blocks`, else every module of a class the model names in `_no_split_modules` —
    Hugging Face's decoder layers (`LlamaDecoderLayer`, `Qwen2DecoderLayer`, ...), found
    without knowing where a model family keeps them."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def accumulation_passes(
    num_mine: int, num_microbatches: int, world_size: int, parallelism: str
) -> int:
    if parallelism == "fsdp" and world_size > 1:
        return math.ceil(num_microbatches / world_size)
    return num_mine


def loss_weight(world_size: int, num_microbatches: int) -> float:
    return world_size / num_microbatches


def parallelism_of(model: nn.Module) -> str | None:
    if isinstance(model, FSDPModule):
        return "fsdp"
    return "ddp" if isinstance(model, DistributedDataParallel) else None


def unwrapped(model: nn.Module) -> nn.Module:
    """The module a DDP wrapper trains (FSDP2 shards the module in place: itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def grad_sync(model: nn.Module, last: bool) -> Iterator[None]:
    if not distributed():
        yield
    elif isinstance(model, DistributedDataParallel):
        with contextlib.nullcontext() if last else model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last)
        yield
    else:
        yield


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few scalars over Baton's group (`elastic.collectives`; identity alone)."""
    if not collectives.grouped():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    collectives.all_reduce(tensor)
    return tensor.tolist()


def gather_samples(mine: list[int], max_per_rank: int, device: torch.device) -> list[int] | None:
    """Every rank's sample indices of a step, on every rank, sorted (for the data audit);
    None when in-process recovery's group lost a member during the gather (what arrived is
    partial)."""
    if not collectives.grouped():
        return sorted(mine)
    padded = torch.full((max_per_rank,), -1, dtype=torch.int64, device=device)
    padded[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    gathered = [torch.full_like(padded, -1) for _ in range(collectives.world_size())]
    if not collectives.all_gather(gathered, padded):
        return None
    return sorted(int(i) for i in torch.cat(gathered).tolist() if i >= 0)
