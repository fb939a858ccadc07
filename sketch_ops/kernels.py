"""Triton kernels for the BASIS sketch (CUDA path); same contract as `reference.py`.

- `bucket_sum(mat, plan)`: signed bucket sums `S @ mat` (R × N, fp32) and `||mat||_F^2`. Each
  program owns one bucket, one column block and one slice of the bucket's rows (the plan's
  bucket-major `rows`/`offsets`), so it sums a gather of rows with no atomics: the result is
  deterministic, run to run. Per-slice partial sums are added by torch afterwards (the slices
  keep a GPU busy when R is small). The input norm is accumulated from the same loads.
- `weight_grad(dy_sketch, x_sketch, scale, dtype)`: `scale · dy_sketchᵀ @ x_sketch`, fp32
  accumulation (IEEE fp32 dot, not TF32), written in the weight's dtype.
- `row_keys(n, seed, device)`: the keys and signs of `plan_hash.hash_rows`, bitwise the same,
  in one launch (uint32 products wrap mod 2**32, as numpy's do there).
- `plan_orders(n, seeds, device)`: the fused path's plans (`fused_kernels.py`): row j
  (int64, n) is `argsort` of seeds[j]'s keys, the balanced plan's scrambled row order,
  bitwise `seeds.make_plan`'s; one keys launch per `KEYS_PER_LAUNCH` seeds and one
  `torch.sort` for them all (`plan_cache` draws a microbatch's plans together).
  `plan_order(n, seed, device)` is one seed's.

This module imports triton at import time; import it lazily (`dispatch.py` does), so the CPU
path never needs triton. Under `TRITON_INTERPRET=1` (read when `@triton.jit` runs, i.e. when
this module is first imported) the kernels run on CPU tensors; the tests use that to check
them against the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .plan_hash import MULTIPLIERS, SIGN_SALT, seed_words

if TYPE_CHECKING:  # annotations only: seeds draws plans through dispatch, which imports this
    from .plan import SketchPlan

_BLOCK_J = 16  # rows gathered per loop iteration
_BLOCK_N = 64  # columns per program
_TARGET_PROGRAMS = 1024  # enough programs to fill a large GPU when R·N is small
_KEYS_BLOCK = 1024  # rows per program of the key kernel
KEYS_PER_LAUNCH = 32  # seeds per launch of the plan keys kernel (it unrolls its seeds)
_FIRST_BIT = -(2**31)  # xor with it maps uint32 keys to int32 in the same order
_SEED_MASK = (1 << 63) - 1  # as seeds.make_plan masks a seed before hashing it
MULTIPLIER_0 = tl.constexpr(MULTIPLIERS[0])
MULTIPLIER_1 = tl.constexpr(MULTIPLIERS[1])
SALT = tl.constexpr(SIGN_SALT)


@triton.jit
def _bucket_sum_kernel(
    mat_ptr,
    rows_ptr,
    offsets_ptr,
    signs_ptr,
    out_ptr,
    sq_ptr,
    num_cols,
    stride_row,
    rank,
    BLOCK_J: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    bucket = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    num_col_blocks = tl.num_programs(1)
    splits = tl.num_programs(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < num_cols
    start = tl.load(offsets_ptr + bucket)
    end = tl.load(offsets_ptr + bucket + 1)
    # This program's slice of the bucket's rows, from the bucket's own size: no host read of
    # the largest bucket, so a plan drawn on the GPU needs no synchronisation.
    per_split = (end - start + splits - 1) // splits
    first = start + split * per_split
    last = tl.minimum(first + per_split, end)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j0 in range(first, last, BLOCK_J):
        idx = j0 + tl.arange(0, BLOCK_J)
        ok = idx < last
        row = tl.load(rows_ptr + idx, mask=ok, other=0)
        sign = tl.load(signs_ptr + row, mask=ok, other=0.0)
        ptrs = mat_ptr + row[:, None] * stride_row + cols[None, :]
        x = tl.load(ptrs, mask=ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x * sign[:, None], axis=0)
        sq += tl.sum(x * x, axis=0)
    tl.store(out_ptr + (split * rank + bucket) * num_cols + cols, acc, mask=col_ok)
    part = (split * rank + bucket) * num_col_blocks + pid_n
    tl.store(sq_ptr + part, tl.sum(sq, axis=0))


@triton.jit
def _mix32(x):
    """One round of `plan_hash.mix32` on uint32 (products wrap mod 2**32)."""
    x ^= x >> 16
    x = (x * MULTIPLIER_0).to(tl.uint32)
    x ^= x >> 15
    x = (x * MULTIPLIER_1).to(tl.uint32)
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["word0", "word1", "word2"])  # any seed: one compilation
def _row_keys_kernel(keys_ptr, signs_ptr, n, word0, word1, word2, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    keys = _mix32(i.to(tl.uint32) ^ word0.to(tl.uint32))
    keys = _mix32(keys ^ word1.to(tl.uint32))
    keys = _mix32(keys ^ word2.to(tl.uint32))
    bits = _mix32(keys ^ SALT) >> 31
    tl.store(keys_ptr + i, keys.to(tl.int64), mask=ok)
    tl.store(signs_ptr + i, 1.0 - 2.0 * bits.to(tl.float32), mask=ok)


@triton.jit
def _plan_keys_kernel(keys_ptr, n, words, BATCH: tl.constexpr, BLOCK: tl.constexpr):
    """Row j of keys: `plan_hash`'s keys of rows 0..n-1 under seed j (`_packed_words`), as
    int32 in the same order."""
    j = tl.program_id(1)
    w0, w1, w2 = words[0], words[1], words[2]
    for t in tl.static_range(1, BATCH):  # this program's seed: the tuple, unrolled
        w0 = tl.where(j == t, words[3 * t], w0)
        w1 = tl.where(j == t, words[3 * t + 1], w1)
        w2 = tl.where(j == t, words[3 * t + 2], w2)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keys = _mix32(i.to(tl.uint32) ^ ((w0 >> 1) & 0xFFFFFFFF).to(tl.uint32))
    keys = _mix32(keys ^ ((w1 >> 1) & 0xFFFFFFFF).to(tl.uint32))
    keys = _mix32(keys ^ ((w2 >> 1) & 0xFFFFFFFF).to(tl.uint32))
    tl.store(keys_ptr + j.to(tl.int64) * n + i, keys.to(tl.int32, bitcast=True) ^ _FIRST_BIT,
             mask=i < n)


@triton.jit
def _weight_grad_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    scale_ptr,
    rank,
    num_out,
    num_in,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        r_ok = rr < rank
        a_mask = r_ok[:, None] & (rm[None, :] < num_out)
        a = tl.load(a_ptr + rr[:, None] * num_out + rm[None, :], mask=a_mask, other=0.0)
        b_mask = r_ok[:, None] & (rn[None, :] < num_in)
        b = tl.load(b_ptr + rr[:, None] * num_in + rn[None, :], mask=b_mask, other=0.0)
        acc += tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), input_precision="ieee")
    acc = acc * tl.load(scale_ptr)
    out_mask = (rm[:, None] < num_out) & (rn[None, :] < num_in)
    out_ptrs = out_ptr + rm[:, None] * num_in + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def bucket_sum(mat: torch.Tensor, plan: SketchPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """`S @ mat` (R × N, fp32) and `||mat||_F^2` (see the module docstring)."""
    if mat.stride(1) != 1:
        mat = mat.contiguous()
    num_cols = mat.shape[1]
    rank = plan.rank
    mean_bucket = max(triton.cdiv(plan.num_rows, rank), 1)  # a balanced plan's bucket size
    col_blocks = triton.cdiv(num_cols, _BLOCK_N)
    wanted = triton.cdiv(_TARGET_PROGRAMS, rank * col_blocks)
    splits = max(1, min(wanted, triton.cdiv(mean_bucket, _BLOCK_J)))
    partial = torch.empty(splits, rank, num_cols, dtype=torch.float32, device=mat.device)
    sq_partial = torch.empty(splits, rank, col_blocks, dtype=torch.float32, device=mat.device)
    _bucket_sum_kernel[(rank, col_blocks, splits)](
        mat,
        plan.rows,
        plan.offsets,
        plan.signs,
        partial,
        sq_partial,
        num_cols,
        mat.stride(0),
        rank,
        BLOCK_J=_BLOCK_J,
        BLOCK_N=_BLOCK_N,
    )
    # Summing the split partials in a fixed order keeps the result deterministic.
    return partial.sum(0), sq_partial.sum()


def weight_grad(
    dy_sketch: torch.Tensor, x_sketch: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`scale · dy_sketchᵀ @ x_sketch` (M × N) in `dtype`, fp32 accumulation."""
    dy_sketch, x_sketch = dy_sketch.contiguous(), x_sketch.contiguous()
    rank, num_out = dy_sketch.shape
    num_in = x_sketch.shape[1]
    out = torch.empty(num_out, num_in, dtype=dtype, device=dy_sketch.device)
    scale = scale.to(device=dy_sketch.device, dtype=torch.float32).reshape(1)
    block_m, block_n = 32, 32
    grid = (triton.cdiv(num_out, block_m), triton.cdiv(num_in, block_n))
    _weight_grad_kernel[grid](
        dy_sketch,
        x_sketch,
        out,
        scale,
        rank,
        num_out,
        num_in,
        BLOCK_R=16,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    return out


def row_keys(n: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`plan_hash.hash_rows(n, seed, device)`, bitwise, in one launch."""
    keys = torch.empty(n, dtype=torch.int64, device=device)
    signs = torch.empty(n, dtype=torch.float32, device=device)
    if n:
        _row_keys_kernel[(triton.cdiv(n, _KEYS_BLOCK),)](
            keys, signs, n, *seed_words(seed), BLOCK=_KEYS_BLOCK
        )
    return keys, signs


def _packed_words(seeds: Sequence[int]) -> tuple[int, ...]:
    """The seeds' `seed_words`, each as an odd int in [2**40, 2**41): Triton specialises the
    ints of a tuple argument whatever `do_not_specialize` says (i32 below 2**31, 1, multiples
    of 16), so packed thus every seed shares one compilation per tuple length."""
    return tuple((1 << 40) | (w << 1) | 1 for s in seeds for w in seed_words(s & _SEED_MASK))


def plan_orders(n: int, seeds: Sequence[int], device: torch.device) -> torch.Tensor:
    """The plans' row orders (int64, len(seeds) × n; module docstring)."""
    keys = torch.empty(len(seeds), n, dtype=torch.int32, device=device)
    for j in range(0, len(seeds) if n else 0, KEYS_PER_LAUNCH):
        chunk = list(seeds[j : j + KEYS_PER_LAUNCH])
        batch = triton.next_power_of_2(len(chunk))  # padded: a few compilations, not 32
        _plan_keys_kernel[(triton.cdiv(n, _KEYS_BLOCK), len(chunk))](
            keys[j:], n, _packed_words(chunk + chunk[-1:] * (batch - len(chunk))),
            BATCH=batch, BLOCK=_KEYS_BLOCK)
    return torch.sort(keys, dim=1).indices  # distinct keys per row: any sort gives this order


def plan_order(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """One seed's plan order (int64, n): `plan_orders` of it."""
    return plan_orders(n, (seed,), device)[0]
