"""The one place that chooses between the Triton kernels and the torch reference.

Contract: `bucket_sum(mat, plan)` and `weight_grad(...)` have the semantics of `reference.py`,
`row_keys(n, seed, device)` those of `plan_hash.hash_rows`. They use `kernels.py` when the data
is on CUDA (in fp32/bf16/fp16) and triton imports; otherwise the torch versions (which also
cover fp64). `fused_on(device, dtype)` is the fused sketch path (`fused_kernels.py`: a whole
sketch in one or two launches, no host sync) under the same rule, or None where the torch
reference runs; the sketched layer and the fused MLPs take it for balanced plans.
`BATON_SKETCH_BACKEND` overrides the choice:
- `auto` (default): as above;
- `torch`: always the reference (e.g. to rule the kernels out when debugging);
- `triton`: always the kernels, also on CPU tensors — only meaningful with `TRITON_INTERPRET=1`,
  which is how the tests run the whole layer through the kernels on a CPU-only machine.
"""

from __future__ import annotations

import importlib
import os
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from . import plan_hash, reference

if TYPE_CHECKING:
    from .plan import SketchPlan

BACKEND_ENV = "BATON_SKETCH_BACKEND"
_BACKENDS = ("auto", "torch", "triton")
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def backend() -> str:
    """The configured backend name, validated."""
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in _BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not one of {', '.join(_BACKENDS)}")
    return value


@cache
def _kernels(name: str = "kernels") -> ModuleType | None:
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:
        return None


def _kernels_on(
    device: torch.device, dtype: torch.dtype, name: str = "kernels"
) -> ModuleType | None:
    """The Triton kernels module `name` to run on data of `dtype` on `device`, or None for
    torch."""
    choice = backend()
    if choice == "torch" or dtype not in _KERNEL_DTYPES:
        return None
    kernels = _kernels(name)
    if choice == "triton":
        if kernels is None:
            raise ValueError(f"{BACKEND_ENV}=triton but triton cannot be imported; install it")
        return kernels
    return kernels if device.type == "cuda" else None


def _kernels_for(tensor: torch.Tensor) -> ModuleType | None:
    return _kernels_on(tensor.device, tensor.dtype)


def fused_module() -> ModuleType:
    """`fused_kernels` itself, for data the fused path sketched in forward (ValueError without
    triton)."""
    kernels = _kernels("fused_kernels")
    if kernels is None:
        raise ValueError("the fused sketch path needs triton; install it")
    return kernels


def fused_on(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """`fused_kernels` for data of `dtype` on `device`, or None (the torch reference)."""
    return _kernels_on(device, dtype, "fused_kernels")


def row_keys(n: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(keys, signs)` of rows 0..n-1 for `seed` on `device` (see `plan_hash`)."""
    kernels = _kernels_on(device, torch.float32)
    if kernels is not None:
        return kernels.row_keys(n, seed, device)
    return plan_hash.hash_rows(n, seed, device)


def bucket_sum(mat: torch.Tensor, plan: SketchPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed bucket sums `S @ mat` (R × N, fp32) and `||mat||_F^2` (fp32 scalar)."""
    kernels = _kernels_for(mat)
    if kernels is not None:
        return kernels.bucket_sum(mat, plan)
    return reference.bucket_sum(mat, plan)


def weight_grad(
    dy_sketch: torch.Tensor, x_sketch: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`scale · dy_sketchᵀ @ x_sketch` (M × N) in `dtype`."""
    kernels = _kernels_for(dy_sketch)
    if kernels is not None:
        return kernels.weight_grad(dy_sketch, x_sketch, scale, dtype)
    return reference.weight_grad(dy_sketch, x_sketch, scale, dtype)
