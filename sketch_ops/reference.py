"""The plain-torch reference of the BASIS sketch maths: the specification and the CPU path.

Contract (n rows, R buckets; accumulation in fp32, or fp64 for fp64 inputs — `acc_dtype`):
- `bucket_sum(mat, plan)` returns `(S @ mat, ||mat||_F^2)` where `S[hash[i], i] = signs[i]`
  (`plan`, a `seeds.SketchPlan`): the signed sum of the n rows into R buckets (R × N) and the
  squared Frobenius norm of the input (0-dim tensor), both in `acc_dtype`. S is applied as a
  sparse CSR matrix: one pass over `mat`, no n × N temporary (except a dtype conversion for
  fp16/bf16 inputs).
- `invariant_scale(sq_norm, sketch)` is BASIS's norm-matching scalar
  `||mat||_F / (||S mat||_F + eps)` (eps = 1e-8, as in the paper).
- `weight_grad(dy_sketch, x_sketch, scale, dtype)` is `scale * dy_sketchᵀ @ x_sketch` (M × N),
  computed in `acc_dtype` and returned in `dtype`.

The mean-centred estimator (`estimator="centered"`, docs/design.md §4):
- `signed_counts(plan)` is `S @ 1` (R,), the signed number of rows in each bucket.
- `center(sketch, sq_norm, mean, counts, n)` turns `(S @ mat, ||mat||_F^2)` into the same pair
  for the centred matrix `mat - 1 meanᵀ` (S is linear, so `S(mat - 1 meanᵀ) = S mat - (S 1) meanᵀ`,
  and `||mat - 1 meanᵀ||² = ||mat||² - n ||mean||²` when `mean` is the row mean).
- `mean_outer(dy_mean, x_mean, n)` is the exact rank-1 part `n · dy_mean x_meanᵀ` of `dYᵀX`.

The Triton kernels in `kernels.py` and `fused_kernels.py` must match these functions up to fp32
summation order (and, in `fused_kernels.py`, one rounding of the sketches to the data's dtype).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: seeds draws plans through dispatch, which imports this
    from .plan import SketchPlan


EPS = 1e-8


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: fp32 for fp32/bf16/fp16, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def sketch_matrix(plan: SketchPlan, dtype: torch.dtype) -> torch.Tensor:
    """S as an R × n sparse CSR tensor with entries ±1 in `dtype`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        return torch.sparse_csr_tensor(
            plan.offsets,
            plan.rows,
            plan.signs[plan.rows].to(dtype),
            size=(plan.rank, plan.num_rows),
            check_invariants=False,  # make_plan builds valid CSR; checking costs a pass
        )


def bucket_sum(mat: torch.Tensor, plan: SketchPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed bucket sums `S @ mat` (rank × N) and `||mat||_F^2`, in `acc_dtype`."""
    dtype = acc_dtype(mat.dtype)
    sq_norm = torch.linalg.vector_norm(mat, dtype=dtype).square()
    if plan.num_rows == 0:
        return torch.zeros(plan.rank, mat.shape[1], dtype=dtype, device=mat.device), sq_norm
    return sketch_matrix(plan, dtype) @ mat.to(dtype), sq_norm


def invariant_scale(sq_norm: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """gamma = ||mat||_F / (||S mat||_F + eps), a 0-dim tensor."""
    return sq_norm.sqrt() / (torch.linalg.vector_norm(sketch) + EPS)


def weight_grad(
    dy_sketch: torch.Tensor, x_sketch: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """dW ≈ scale · (S dY)ᵀ (S X): (R × M)ᵀ @ (R × N) -> M × N, in `dtype`."""
    acc = acc_dtype(x_sketch.dtype)
    return (dy_sketch.to(acc).t() @ x_sketch.to(acc)).mul_(scale).to(dtype)


def signed_counts(plan: SketchPlan) -> torch.Tensor:
    """`S @ 1`: for each bucket, the sum of its rows' signs (fp32, on the plan's device)."""
    counts = torch.zeros(plan.rank, dtype=torch.float32, device=plan.signs.device)
    return counts.index_add_(0, plan.hash, plan.signs)


def center(
    sketch: torch.Tensor, sq_norm: torch.Tensor, mean: torch.Tensor, counts: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(S (mat - 1 meanᵀ), ||mat - 1 meanᵀ||_F^2)` from `(S mat, ||mat||_F^2)`; `mean` is the
    row mean of mat. The norm is clamped at 0 against cancellation in fp32."""
    mean = mean.to(sketch.dtype)
    centred = sketch.addr(counts.to(sketch.dtype), mean, alpha=-1)
    return centred, (sq_norm - n * mean.square().sum()).clamp_min(0)


def mean_outer(dy_mean: torch.Tensor, x_mean: torch.Tensor, n: int) -> torch.Tensor:
    """`n · dy_mean x_meanᵀ` (M × N) in the accumulation dtype: the part of `dYᵀX` carried by
    the row means, which the centred estimator adds exactly."""
    acc = acc_dtype(x_mean.dtype)
    return torch.outer(dy_mean.to(acc), x_mean.to(acc)).mul_(n)
