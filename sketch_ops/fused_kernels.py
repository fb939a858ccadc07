"""Triton kernels of the fused sketch path: a whole sketch in one or two launches, no host sync.

Contract (n rows, R buckets, the balanced plan of `seeds.make_plan`, bitwise):
- `plan_order(n, seed, device)` / `plan_orders(n, seeds, device)` (`kernels.py`'s): the
  plan's scrambled row order — `order[p]` is the row at position p, bucket r holds positions
  r, r + R, r + 2R, ... — a keys launch and one sort, for one seed or a microbatch's
  (`plan_cache`). A row's sign is recomputed from its index inside the kernels, so the order
  is the whole plan.
- `sketch(mat, order, rank, seed, *, center, ...) -> Sketch`: the signed bucket sums `S mat`,
  centred (`S (mat - 1 μᵀ)`, μ the row mean) when `center`, in mat's dtype and *unscaled*, the
  row mean (fp32, centred only) and the partial sums the invariant scalar needs (`Sketch`).
  One launch when the column blocks alone fill the device (the program that owns a column
  block owns every bucket of it: no atomics, and it centres its own sums once it has the
  column sums), else two: bucket groups in parallel, then a finishing launch per column block.
  Options: `order_out` receives the order as int32 (to save for backward), `sum_out` the column
  sums in its dtype (a bias gradient), `act`/`other`/`hidden` fuse the producer: the sketched
  matrix is `gelu(mat)` or `silu(mat) * other`, computed as torch rounds it and written to
  `hidden` in the same pass.
- `BlockSketch`: the same sketch of a matrix that arrives in row blocks (one launch per block,
  accumulating fp32 bucket sums, and one finishing launch).
- `weight_grad(dy, x, n, *, scale, dtype)`: `γdy γx (S̃dY)ᵀ(S̃X) + n μdy μxᵀ` (the second term
  when centred, γ when `scale`) in one launch: the GEMM runs on the R-row sketches in their
  dtype with fp32 accumulation (IEEE fp32 for fp32 data, not TF32), the scalars come from the
  sketches' partial sums in its epilogue.
The results equal `reference.py`'s (via `function.input_sketch` / `weight_grad_estimate`) up to
fp32 summation order and one rounding of the sketch to the data's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .kernels import SALT, _mix32
from .kernels import plan_order as plan_order  # re-exported: the fused path's plans
from .kernels import plan_orders as plan_orders
from .plan_hash import seed_words
from .reference import EPS

_BLOCK_N = 32  # columns per program: 64 bytes of a bf16 row per gathered load
_TILE = 64  # gathered rows per loop iteration (BLOCK_B buckets × BLOCK_K slots)
EPS_ = tl.constexpr(EPS)
ACT_NONE, ACT_GELU, ACT_SILU_MUL = 0, 1, 2
# Fewer column-block programs than this share of the device's SMs: split the buckets into
# groups too (more parallelism, one more launch). A guess for an H100/H200: measure to tune.
SPLIT_BELOW_SM_SHARE = 0.5


@dataclass
class Sketch:
    values: torch.Tensor  # R × N: S mat, centred when `mean` is set, unscaled, mat's dtype
    mean: torch.Tensor | None  # N fp32: the row mean (centred sketches only)
    stats: torch.Tensor  # 3 × column blocks fp32: ||mat||², ||sketch||², n ||μ||² partials


@triton.jit
def _row_sign(rows, word0, word1, word2):
    """`plan_hash.hash_rows`'s sign of each row index (the same bits)."""
    keys = _mix32(rows.to(tl.uint32) ^ word0.to(tl.uint32))
    keys = _mix32(keys ^ word1.to(tl.uint32))
    keys = _mix32(keys ^ word2.to(tl.uint32))
    return 1.0 - 2.0 * (_mix32(keys ^ SALT) >> 31).to(tl.float32)


@triton.jit
def _finish(raw_ptr, order_ptr, out_ptr, mean_ptr, sum_ptr, stats_ptr, colsum, sq, pid_c,
            cols, col_ok, n, num_cols, rank, word0, word1, word2,
            CENTER: tl.constexpr, HAS_SUM: tl.constexpr, BLOCK_B: tl.constexpr,
            BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Centre one column block's raw bucket sums, write them in the output dtype, and the
    column block's partial sums of ||mat||², ||sketch||² and n ||μ||²."""
    mean = colsum / n
    if CENTER:
        tl.store(mean_ptr + cols, mean, mask=col_ok)
    if HAS_SUM:
        tl.store(sum_ptr + cols, colsum.to(sum_ptr.dtype.element_ty), mask=col_ok)
    slots = (n + rank - 1) // rank
    sq_sketch = tl.zeros([BLOCK_N], dtype=tl.float32)
    for b0 in range(0, rank, BLOCK_B):
        buckets = b0 + tl.arange(0, BLOCK_B)
        mask = (buckets < rank)[:, None] & col_ok[None, :]
        offsets = buckets[:, None].to(tl.int64) * num_cols + cols[None, :]
        values = tl.load(raw_ptr + offsets, mask=mask, other=0.0)
        if CENTER:  # the signed count of each bucket, S 1, from the plan itself
            counts = tl.zeros([BLOCK_B], dtype=tl.float32)
            for k0 in range(0, slots, BLOCK_K):
                pos = buckets[:, None] + (k0 + tl.arange(0, BLOCK_K))[None, :] * rank
                ok = (buckets < rank)[:, None] & (pos < n)
                rows = tl.load(order_ptr + pos, mask=ok, other=0)
                counts += tl.sum(tl.where(ok, _row_sign(rows, word0, word1, word2), 0.0), 1)
            values = tl.where(mask, values - counts[:, None] * mean[None, :], 0.0)
        tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=mask)
        sq_sketch += tl.sum(values * values, axis=0)
    num_blocks = tl.num_programs(0)
    tl.store(stats_ptr + pid_c, tl.sum(sq, axis=0))
    tl.store(stats_ptr + num_blocks + pid_c, tl.sum(sq_sketch, axis=0))
    if CENTER:
        tl.store(stats_ptr + 2 * num_blocks + pid_c,
                 tl.sum(tl.where(col_ok, mean * mean, 0.0), axis=0) * n)
    else:
        tl.store(stats_ptr + 2 * num_blocks + pid_c, 0.0)


@triton.jit(do_not_specialize=["word0", "word1", "word2", "row_start", "row_end"])
def _sketch_kernel(src_ptr, other_ptr, hidden_ptr, order_ptr, order_out_ptr, raw_ptr,
                   colsum_ptr, sq_ptr, out_ptr, mean_ptr, sum_ptr, stats_ptr,
                   n, num_cols, rank, per_group, row_start, row_end, stride_r, stride_c,
                   stride_or, stride_oc, stride_hr, word0, word1, word2,
                   ACT: tl.constexpr, LIBDEVICE: tl.constexpr, ACCUMULATE: tl.constexpr,
                   FINISH: tl.constexpr, WRITE_ORDER: tl.constexpr, CENTER: tl.constexpr,
                   HAS_SUM: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    pid_c = tl.program_id(0)
    group = tl.program_id(1)
    cols = pid_c * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < num_cols
    first = group * per_group
    last = tl.minimum(first + per_group, rank)
    slots = (n + rank - 1) // rank
    colsum = tl.zeros([BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_N], dtype=tl.float32)
    for b0 in range(first, last, BLOCK_B):
        buckets = b0 + tl.arange(0, BLOCK_B)
        bucket_ok = buckets < last
        acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, slots, BLOCK_K):
            pos = buckets[:, None] + (k0 + tl.arange(0, BLOCK_K))[None, :] * rank
            ok = bucket_ok[:, None] & (pos < n)
            rows = tl.load(order_ptr + pos, mask=ok, other=0)
            if WRITE_ORDER:
                tl.store(order_out_ptr + pos, rows.to(tl.int32), mask=ok & ((pos * 0 + pid_c) == 0))
            ok = ok & (rows >= row_start) & (rows < row_end)  # this launch's row block
            sign = _row_sign(rows, word0, word1, word2)
            local = (rows - row_start).to(tl.int64)[:, :, None]  # no int32 overflow
            mask = ok[:, :, None] & col_ok[None, None, :]
            col3 = cols[None, None, :]
            x = tl.load(src_ptr + local * stride_r + col3 * stride_c, mask=mask, other=0.0)
            if ACT == 1:  # GELU (erf form, as F.gelu), rounded to the data's dtype
                x32 = x.to(tl.float32)
                scaled = x32 * 0.7071067811865476
                erf = libdevice.erf(scaled) if LIBDEVICE else tl.math.erf(scaled)
                x = (0.5 * x32 * (1.0 + erf)).to(x.dtype)
            if ACT == 2:  # silu(gate) rounded, times up, rounded: F.silu(g).mul_(u)
                up = tl.load(other_ptr + local * stride_or + col3 * stride_oc, mask=mask,
                             other=0.0)
                g32 = x.to(tl.float32)
                exp = libdevice.exp(-g32) if LIBDEVICE else tl.exp(-g32)
                act = (g32 / (1.0 + exp)).to(x.dtype)
                x = (act.to(tl.float32) * up.to(tl.float32)).to(x.dtype)
            if ACT != 0:
                tl.store(hidden_ptr + local * stride_hr + col3, x, mask=mask)
            x = x.to(tl.float32)
            acc += tl.sum(x * sign[:, :, None], axis=1)
            colsum += tl.sum(tl.sum(x, axis=1), axis=0)
            sq += tl.sum(tl.sum(x * x, axis=1), axis=0)
        offsets = buckets[:, None].to(tl.int64) * num_cols + cols[None, :]
        mask2 = bucket_ok[:, None] & col_ok[None, :]
        if ACCUMULATE:
            acc += tl.load(raw_ptr + offsets, mask=mask2, other=0.0)
        tl.store(raw_ptr + offsets, acc, mask=mask2)
    if FINISH:  # one group, one launch: centre what this program just wrote
        tl.debug_barrier()
        _finish(raw_ptr, order_ptr, out_ptr, mean_ptr, sum_ptr, stats_ptr, colsum, sq, pid_c,
                cols, col_ok, n, num_cols, rank, word0, word1, word2, CENTER, HAS_SUM,
                BLOCK_B, BLOCK_K, BLOCK_N)
    else:
        part = group * num_cols + cols
        if ACCUMULATE:
            colsum += tl.load(colsum_ptr + part, mask=col_ok, other=0.0)
            sq += tl.load(sq_ptr + part, mask=col_ok, other=0.0)
        tl.store(colsum_ptr + part, colsum, mask=col_ok)
        tl.store(sq_ptr + part, sq, mask=col_ok)


@triton.jit(do_not_specialize=["word0", "word1", "word2"])
def _finish_kernel(raw_ptr, order_ptr, colsum_ptr, sq_ptr, out_ptr, mean_ptr, sum_ptr,
                   stats_ptr, groups, n, num_cols, rank, word0, word1, word2,
                   CENTER: tl.constexpr, HAS_SUM: tl.constexpr, BLOCK_B: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_c = tl.program_id(0)
    cols = pid_c * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < num_cols
    colsum = tl.zeros([BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in range(0, groups):  # in group order: deterministic
        colsum += tl.load(colsum_ptr + g * num_cols + cols, mask=col_ok, other=0.0)
        sq += tl.load(sq_ptr + g * num_cols + cols, mask=col_ok, other=0.0)
    _finish(raw_ptr, order_ptr, out_ptr, mean_ptr, sum_ptr, stats_ptr, colsum, sq, pid_c,
            cols, col_ok, n, num_cols, rank, word0, word1, word2, CENTER, HAS_SUM,
            BLOCK_B, BLOCK_K, BLOCK_N)


@triton.jit
def _gamma(stats_ptr, num_blocks, BLOCK_S: tl.constexpr):
    """The invariant scalar ||mat - 1μᵀ|| / (||sketch|| + eps) from a sketch's partial sums."""
    sq = tl.zeros([BLOCK_S], dtype=tl.float32)
    sk = tl.zeros([BLOCK_S], dtype=tl.float32)
    mm = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, num_blocks, BLOCK_S):
        idx = s0 + tl.arange(0, BLOCK_S)
        ok = idx < num_blocks
        sq += tl.load(stats_ptr + idx, mask=ok, other=0.0)
        sk += tl.load(stats_ptr + num_blocks + idx, mask=ok, other=0.0)
        mm += tl.load(stats_ptr + 2 * num_blocks + idx, mask=ok, other=0.0)
    norm = tl.sqrt(tl.maximum(tl.sum(sq, axis=0) - tl.sum(mm, axis=0), 0.0))
    return norm / (tl.sqrt(tl.sum(sk, axis=0)) + EPS_)


@triton.jit
def _grad_kernel(a_ptr, b_ptr, out_ptr, a_stats, b_stats, a_mean, b_mean, rank, num_out,
                 num_in, a_blocks, b_blocks, n, SCALE: tl.constexpr, CENTER: tl.constexpr,
                 PRECISION: tl.constexpr, WIDEN: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        a = tl.load(a_ptr + rr[:, None] * num_out + rm[None, :],
                    mask=(rr < rank)[:, None] & (rm < num_out)[None, :], other=0.0)
        b = tl.load(b_ptr + rr[:, None] * num_in + rn[None, :],
                    mask=(rr < rank)[:, None] & (rn < num_in)[None, :], other=0.0)
        if WIDEN:  # bf16 x bf16 is exact in fp32: the same products, another summation order
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(tl.trans(a), b, input_precision=PRECISION)
    if SCALE:
        acc = acc * (_gamma(a_stats, a_blocks, BLOCK_S) * _gamma(b_stats, b_blocks, BLOCK_S))
    if CENTER:
        mean_a = tl.load(a_mean + rm, mask=rm < num_out, other=0.0)
        mean_b = tl.load(b_mean + rn, mask=rn < num_in, other=0.0)
        acc += n * mean_a[:, None] * mean_b[None, :]
    mask = (rm < num_out)[:, None] & (rn < num_in)[None, :]
    tl.store(out_ptr + rm[:, None] * num_in + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


# -- launching them ----------------------------------------------------------------------------

# Triton's CPU interpreter (3.9) returns garbage from a bf16 `tl.dot`; under it the GEMM widens
# its operands to fp32 first.
_INTERPRETED = type(_grad_kernel).__name__ == "InterpretedFunction"

_SEED_MASK = (1 << 63) - 1  # as seeds.make_plan masks a seed before hashing it


@cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: one column-block program per block is plenty
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _tiles(n: int, rank: int) -> tuple[int, int]:
    """(buckets, slots) per gathered tile: the slots cover a bucket's rows up to _TILE."""
    slots = triton.next_power_of_2(max(1, triton.cdiv(n, rank)))
    block_k = min(slots, _TILE)
    return max(1, _TILE // block_k), block_k


def groups_for(num_cols: int, rank: int, device: torch.device) -> int:
    """How many bucket groups a sketch of `num_cols` columns splits into (1: one launch)."""
    col_blocks = triton.cdiv(num_cols, _BLOCK_N)
    wanted = int(SPLIT_BELOW_SM_SHARE * _sm_count(device) + 0.5)
    if col_blocks >= wanted:
        return 1
    return max(1, min(triton.cdiv(wanted, col_blocks), triton.cdiv(rank, _tiles(1, rank)[0])))


class BlockSketch:
    """The sketch of an n × width matrix arriving in row blocks: `add(start, end, rows)` per
    block (any order, each row once), then `finish()`. A single block covering all n rows is
    one launch when `groups` is 1 (the finishing pass runs in the same programs)."""

    def __init__(self, n: int, rank: int, seed: int, width: int, order: torch.Tensor, *,
                 center: bool, dtype: torch.dtype, sum_out: torch.Tensor | None = None,
                 order_out: torch.Tensor | None = None, groups: int | None = None) -> None:
        device = order.device
        self.n, self.rank, self.width, self.order = n, rank, width, order
        self.words = seed_words(seed & _SEED_MASK)
        self.center, self.sum_out, self.order_out = center, sum_out, order_out
        self.block_b, self.block_k = _tiles(n, rank)
        self.groups = groups if groups is not None else groups_for(width, rank, device)
        self.col_blocks = triton.cdiv(width, _BLOCK_N)
        self.raw = torch.empty(rank, width, dtype=torch.float32, device=device)
        self.out = Sketch(torch.empty(rank, width, dtype=dtype, device=device),
                          torch.empty(width, dtype=torch.float32, device=device) if center
                          else None,
                          torch.empty(3, self.col_blocks, dtype=torch.float32, device=device))
        self.partials: tuple[torch.Tensor, torch.Tensor] | None = None
        self.finished = False

    def _sinks(self) -> tuple[torch.Tensor, ...]:
        """The pointers `_finish` writes through (unused ones point at the output)."""
        out = self.out
        mean = out.mean if out.mean is not None else out.stats
        total = self.sum_out if self.sum_out is not None else out.stats
        return out.values, mean, total, out.stats

    def add(self, start: int, end: int, rows: torch.Tensor, *, act: int = ACT_NONE,
            other: torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> None:
        """Sketch rows [start, end) (`rows`, (end - start) × width, any strides); with `act`,
        sketch `gelu(rows)` or `silu(rows) * other` and write it into `hidden` (module
        docstring)."""
        assert not self.finished and rows.shape == (end - start, self.width)
        assert hidden is None or (hidden.shape == rows.shape and hidden.stride(1) == 1)
        whole = start == 0 and end == self.n and self.partials is None
        finish = whole and self.groups == 1
        accumulate = self.partials is not None
        if not finish and self.partials is None:
            self.partials = tuple(  # type: ignore[assignment]
                torch.empty(self.groups, self.width, dtype=torch.float32,
                            device=rows.device) for _ in range(2))
        colsum, sq = self.partials if self.partials is not None else (self.raw, self.raw)
        other_t = other if other is not None else rows
        hidden_t = hidden if hidden is not None else rows
        write_order = self.order_out is not None and not accumulate  # every position, once
        order_out = self.order_out if self.order_out is not None else self.order
        per_group = triton.cdiv(self.rank, self.groups)
        _sketch_kernel[(self.col_blocks, self.groups)](
            rows, other_t, hidden_t, self.order, order_out, self.raw, colsum, sq,
            *self._sinks(), self.n, self.width, self.rank, per_group, start, end,
            rows.stride(0), rows.stride(1), other_t.stride(0), other_t.stride(1),
            hidden_t.stride(0), *self.words,
            ACT=act, LIBDEVICE=not _INTERPRETED, ACCUMULATE=accumulate, FINISH=finish,
            WRITE_ORDER=write_order, CENTER=self.center,
            HAS_SUM=self.sum_out is not None, BLOCK_B=self.block_b, BLOCK_K=self.block_k,
            BLOCK_N=_BLOCK_N)
        self.finished = finish

    def finish(self) -> Sketch:
        """The whole matrix's `Sketch` (the column sums went to `sum_out`, if given)."""
        if not self.finished:
            assert self.partials is not None, "BlockSketch.finish before any add"
            colsum, sq = self.partials
            _finish_kernel[(self.col_blocks,)](
                self.raw, self.order, colsum, sq, *self._sinks(), self.groups, self.n,
                self.width, self.rank, *self.words, CENTER=self.center,
                HAS_SUM=self.sum_out is not None, BLOCK_B=self.block_b, BLOCK_K=self.block_k,
                BLOCK_N=_BLOCK_N)
            self.finished = True
        return self.out


def weight_grad(dy: Sketch, x: Sketch, n: int, *, scale: bool,
                dtype: torch.dtype) -> torch.Tensor:
    """`γdy γx (S̃dY)ᵀ(S̃X) + n μdy μxᵀ` (M × N) in `dtype` (module docstring)."""
    a, b = dy.values, x.values
    if a.dtype != b.dtype:  # never under autocast (one dtype); the GEMM wants one
        a, b = a.float(), b.float()
    rank, num_out = a.shape
    num_in = b.shape[1]
    center = x.mean is not None and dy.mean is not None
    out = torch.empty(num_out, num_in, dtype=dtype, device=a.device)
    a_mean = dy.mean if center else dy.stats
    b_mean = x.mean if center else x.stats
    block = 64
    _grad_kernel[(triton.cdiv(num_out, block), triton.cdiv(num_in, block))](
        a, b, out, dy.stats, x.stats, a_mean, b_mean, rank, num_out, num_in,
        dy.stats.shape[1], x.stats.shape[1], n, SCALE=scale, CENTER=center,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", WIDEN=_INTERPRETED,
        BLOCK_R=32, BLOCK_M=block, BLOCK_N=block, BLOCK_S=64)
    return out
