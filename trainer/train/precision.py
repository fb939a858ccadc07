"""Mixed precision: the recipe's `[precision] dtype` ("fp32", "bf16" or "fp16") on a worker.

Contract:
- Master weights and optimizer state stay fp32 in every dtype: nothing here casts a
  parameter. Under DDP (and in a single process) `autocast` runs each forward in
  `torch.autocast` on the worker's device type, which casts per op (matmuls in the low
  dtype, reductions such as softmax, norms and cross-entropy in fp32). Under FSDP2,
  `fsdp_policy` is the `MixedPrecisionPolicy` that `trainer.train.parallel.wrap_model` gives every
  `fully_shard`: the all-gathered (unsharded) copies are in the low dtype, the sharded fp32
  parameters are what the optimizer updates, gradients are reduced (and accumulated) in fp32,
  and the root's outputs come back in fp32 so a loss computed outside the model (the built-in
  GPT's cross-entropy) is fp32. `autocast` is then a no-op: the policy casts instead.
- fp16: its small range makes small gradients underflow, so `loss_scaler` is an enabled
  `torch.amp.GradScaler` (on CPU too): the loss is multiplied by its scale before backward,
  gradients are unscaled before clipping, a step whose gradients overflowed is skipped and
  the scale halved (it grows back after `growth_interval` clean steps). Under FSDP2 torch
  max-reduces the overflow flag across ranks (DTensor), under DDP the gradients are already
  all-reduced, so every rank skips the same steps. For fp32 and bf16 (bf16 has fp32's range)
  the scaler is disabled, and its methods pass through (`scale` returns the loss, `step`
  calls `optimizer.step()`), so the loop has one shape for every dtype.
- Snapshots therefore hold fp32 model and optimizer state whatever the dtype, and `dtype` is
  not a fixed field of a run: a bf16 run may be continued in fp32 and back. The enabled
  scaler's state (scale, growth tracker: plain numbers) is registered as the session's
  `scaler` component, optional, so a run that switches into fp16 starts from a fresh scale
  and a run leaving fp16 ignores the saved one.
- Precision changes the trajectory only up to the dtype's rounding: P1 (world-size
  invariance) holds to float order in fp32, and in bf16/fp16 up to the rounding of the low-
  precision copies (a ~1e-7 fp32 difference can flip a bf16 rounding). DDP's autocast and
  FSDP2's policy round at different places, so in bf16 the two layouts agree only loosely.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

# The values of `precision.dtype` (trainer.config.PRECISIONS) and the dtype each computes in.
COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def compute_dtype(name: str) -> torch.dtype:
    return COMPUTE_DTYPES[name]


def fsdp_policy(name: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for the non-root `fully_shard` units (fp32: torch's default, no casts)."""
    if name == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype(name), reduce_dtype=torch.float32)


def fsdp_root_policy(name: str) -> MixedPrecisionPolicy:
    """The root's policy: as `fsdp_policy`, and the model's outputs cast back to fp32."""
    if name == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype(name), reduce_dtype=torch.float32,
                                output_dtype=torch.float32)


def autocast(model: nn.Module, name: str,
             device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The context a forward runs in: `torch.autocast` in bf16/fp16, unless the model is
    FSDP2-sharded (its `MixedPrecisionPolicy` casts) or the dtype is fp32."""
    if name == "fp32" or isinstance(model, FSDPModule):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute_dtype(name))


def ensure_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has never updated (fp16: every step so far overflowed and was
    skipped) its state now, in the training thread, as `torch.distributed.checkpoint` does
    for a state dict: one step at learning rate 0 on zero gradients (parameters unchanged;
    AdamW's step count becomes 1 with zero moments). Otherwise the first snapshot would do
    it inside the capture thread, whose `optimizer.step()` waits on that very capture (a
    deadlock) and races the next step's gradients. Call it after `zero_grad`. Which steps
    overflow depends only on the recipe and seed, so this keeps P1; a no-op once the
    optimizer has state."""
    if not optimizer.state:
        get_optimizer_state_dict(model, optimizer)  # initialises the state; result unused


def loss_scaler(name: str, device: torch.device) -> torch.amp.GradScaler:
    """fp16's dynamic loss scaler; disabled (pass-through) for fp32 and bf16."""
    return torch.amp.GradScaler(device.type, enabled=name == "fp16")
