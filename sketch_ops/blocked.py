"""Row-blocked pieces shared by the fused MLP functions (`fused.py`, `swiglu.py`).

- `block_size(n, width, dtype, device)`: the rows per block of a fused function on n rows (at
  most BLOCK_ROWS on the CPU, more on a GPU; spread evenly), `row_blocks(n, size)` the
  `[start, end)` ranges it walks, so that no n × hidden tensor outlives a block. Inside
  `gpu_blocks(dtype)` it gives a GPU's blocks on any device (to plan a GPU step on the CPU).
- `layer_sketches(layers, n)`: per layer `(rank, seed, estimator)`: a `SketchedLinear`'s
  effective rank, its seed for this call (`layer_seed`, drawn in the order given) and
  estimator; `(0, 0, "basis")` for a plain layer (rank 0: an exact dW).
- `BlockInputSketch(n, rank, seed, width, estimator, device, acc, block_rows, dtype)`: `S M`
  and `||M||²` (and M's column sums, centred) of an n × width M arriving in blocks,
  `add(start, end, rows)` per block (S is linear in the rows: block sketches add up).
  `finish(dtype)` returns a `SavedSketch`: on the torch path what `function.input_sketch`
  returns, on the fused path (`dispatch.fused_on`) the fused kernels' unscaled centred sketch,
  mean, the invariant scalar's partial sums and the plan's order. There `add_activated(start,
  end, pre, "gelu" | "silu_mul", other)` computes the block's activation and sketches it in the
  same pass (`fuses_producer` says whether it can).
- `saved_sketch_weight_grad(dy, dy_sum, saved, n, rank, seed, dtype, need_db=False)`: `(dW,
  db)`, a sketched layer's dW estimate from its output gradient and its input's `SavedSketch`
  (as `sketched_linear`'s backward), and with `need_db` on the fused path its bias gradient
  from the same pass (else None). `output_layer_grads(dy, saved, n, rank, seed, dtype, need)`:
  a fused MLP's last layer's `(dW, db)`, each None unless `need` asks; dW only when sketched.
- `linear_into(dest, x, weight, bias)`: `dest[...] = F.linear(x, weight, bias)`, in place if it can.
- `BlockWeightGrad(shape, rank, seed, estimator, n, device, acc, block_rows, dtype)`: dW = dYᵀX
  of a layer whose X and dY are both at hand in blocks (a layer recomputed in backward): exact
  at rank 0, else the BASIS estimate from the two block sketches; `add(start, end, dy_rows,
  x_rows)` per block, then `finish(dy_sum, dtype=None)` (dY's column sums, in `acc`).

Every result is the unfused `sketched_linear` / `nn.Linear`'s from the same seed, up to fp32
summation order (sums in `acc`; an exact dW's block products rounded to the data's dtype first).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import dispatch, reference
from .function import fused_weight_grad, input_sketch, weight_grad_estimate
from .layer import SketchedLinear
from .plan import SketchPlan
from .seeds import effective_rank, layer_seed, make_plan, plan_order

BLOCK_ROWS = 2048  # the most rows per block on the CPU; a GPU's cap is never below it
# On a GPU a block's widest temporary may take this much. Each block costs the host a fixed
# few dozen launches; 2 048-row blocks left an H200 waiting on the host (the fused MLP of a
# d-256 GPT at 16 384 rows ran 1.67x exact's step in 2 048-row blocks, 1.05x in one block).
GPU_BLOCK_BYTES = 64 << 20


def block_size(n: int, width: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows per block for a fused function on n rows whose widest per-row temporary is `width`
    elements of `dtype`. The cap is BLOCK_ROWS on the CPU; on a GPU as many rows as fit
    GPU_BLOCK_BYTES, but not below BLOCK_ROWS. The k blocks of at most the cap that n needs
    are made equal (the last up to k - 1 rows shorter): a ragged tail block runs its matmuls at a
    fraction of the rate (4 112 rows on one CPU thread: 17.1 ms per n·256·688 matmul in
    blocks of 2 048, 2 048 and 16 rows, 16.3 ms in blocks of 1 371, 1 371 and 1 370)."""
    if _blocks_as_on:  # planning for a GPU on the CPU: the GPU's blocks
        device, dtype = torch.device("cuda"), _blocks_as_on[-1]
    if device.type == "cpu":
        most = BLOCK_ROWS
    else:
        itemsize = torch.empty((), dtype=dtype).element_size()
        most = max(BLOCK_ROWS, GPU_BLOCK_BYTES // max(width * itemsize, 1))
    if n <= most:
        return max(n, 1)
    return -(-n // -(-n // most))  # ceil(n / number of blocks)


_blocks_as_on: list[torch.dtype] = []


@contextmanager
def gpu_blocks(dtype: torch.dtype) -> Iterator[None]:
    """Inside, `block_size` gives the blocks a GPU would use for data of `dtype` (so a step on
    the CPU launches the ops a GPU step would: `baton sketch-plan --target`)."""
    _blocks_as_on.append(dtype)
    try:
        yield
    finally:
        _blocks_as_on.pop()


def row_blocks(n: int, size: int) -> list[tuple[int, int]]:
    """The row ranges `[start, end)` of at most `size` rows covering n rows."""
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def layer_sketches(
    layers: Sequence[nn.Module], n: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...]]:
    """`(ranks, seeds, estimators)` of `layers` for a call on n rows; 0, 0, "basis" for a plain
    layer. Seeds are drawn in the order given: pass the layers in the composition's call order."""
    settings = [
        (effective_rank(layer.rank, n), layer_seed(layer.sketch_name), layer.estimator)
        if isinstance(layer, SketchedLinear)
        else (0, 0, "basis")
        for layer in layers
    ]
    ranks, seeds, estimators = zip(*settings, strict=True)
    return ranks, seeds, estimators


# What a fused function saves of a sketched layer's input: `(M̂, μ or None, None, None)` from
# the torch reference (M̂ scaled by γ), `(S̃M unscaled, μ or None, γ's partial sums, the plan's
# order as int32)` from the fused kernels (`fused_kernels.py`; γ is applied in the GEMM).
SavedSketch = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None,
                    torch.Tensor | None]
NO_SKETCH: SavedSketch = (None, None, None, None)


class BlockInputSketch:
    """The sketch of an n × width matrix accumulated a row block at a time."""

    def __init__(
        self,
        n: int,
        rank: int,
        seed: int,
        width: int,
        estimator: str,
        device: torch.device,
        acc: torch.dtype,
        block_rows: int,
        dtype: torch.dtype,
        *,
        order: torch.Tensor | None = None,
    ) -> None:
        self.n, self.block_rows = n, block_rows
        kernels = dispatch.fused_on(device, dtype) if n else None
        self.fused: Any = None  # a fused_kernels.BlockSketch on the fused path
        self.order32: torch.Tensor | None = None  # the plan, saved for backward (fused path)
        if kernels is not None:
            self._acts = {"gelu": kernels.ACT_GELU, "silu_mul": kernels.ACT_SILU_MUL}
            if order is None:  # a plan of our own, saved for backward as int32
                order = plan_order(kernels, n, seed, device)
                self.order32 = torch.empty(n, dtype=torch.int32, device=device)
            self.fused = kernels.BlockSketch(
                n, effective_rank(rank, n), seed, width, order,
                center=estimator == "centered", dtype=dtype, order_out=self.order32)
            return
        self.plan = make_plan(n, rank, seed, device=device)
        self._blocks: list[SketchPlan] | None = None  # the plan's row blocks, split once
        self.sketch = torch.zeros(self.plan.rank, width, dtype=acc, device=device)
        self.sq_norm = torch.zeros((), dtype=acc, device=device)
        self.row_sum = (
            torch.zeros(width, dtype=acc, device=device) if estimator == "centered" else None
        )

    @property
    def fuses_producer(self) -> bool:
        """Whether `add_activated` is available (the fused kernels run this sketch)."""
        return self.fused is not None

    def block_plan(self, start: int, end: int) -> SketchPlan:
        """The sketch of rows [start, end), one of `row_blocks(n, block_rows)` (share it between
        matrices sketched with the same seed). Torch reference path only."""
        size = self.block_rows
        if start % size or end != min(start + size, self.n):
            raise ValueError(f"rows [{start}, {end}) are not one of row_blocks({self.n}, {size})")
        if self._blocks is None:
            self._blocks = self.plan.row_blocks(size)
        return self._blocks[start // size]

    def add(self, start: int, end: int, rows: torch.Tensor,
            block_plan: SketchPlan | None = None) -> None:
        """Sketch rows [start, end) (`block_plan`: that block's plan, if already at hand)."""
        if self.fused is not None:
            self.fused.add(start, end, rows)
            return
        part, part_sq = dispatch.bucket_sum(rows, block_plan or self.block_plan(start, end))
        self.sketch += part
        self.sq_norm += part_sq
        if self.row_sum is not None:
            self.row_sum += rows.sum(0, dtype=self.row_sum.dtype)

    def add_activated(self, start: int, end: int, pre: torch.Tensor, act: str,
                      other: torch.Tensor | None = None) -> torch.Tensor:
        """The producer fused into the sketch (`fuses_producer` only): rows [start, end) of
        `gelu(pre)` (written into `pre`) or of `silu(pre) * other` (a new tensor), sketched in
        the same pass; returns them."""
        hidden = pre if other is None else torch.empty_like(other)
        self.fused.add(start, end, pre, act=self._acts[act], other=other, hidden=hidden)
        return hidden

    def finish(self, dtype: torch.dtype) -> SavedSketch:
        """What backward needs (`SavedSketch`); on the reference path as `function.input_sketch`
        returns it, M̂ in `dtype`."""
        if self.fused is not None:
            done = self.fused.finish()
            return done.values, done.mean, done.stats, self.order32
        hat, mean = input_sketch(self.sketch, self.sq_norm, self.row_sum, self.plan, self.n)
        return hat.to(dtype), mean, None, None


def saved_sketch_weight_grad(
    dy: torch.Tensor,
    dy_sum: torch.Tensor | None,
    saved: SavedSketch,
    n: int,
    rank: int,
    seed: int,
    dtype: torch.dtype,
    need_db: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A sketched layer's `(dW estimate in dtype, db or None)` from its n-row output gradient
    and what `BlockInputSketch.finish` gave in forward (`dy_sum`, dY's column sums, is read by
    the reference path's centred estimator only; db comes from the fused path only)."""
    x_hat, x_mean, _, order = saved
    if order is not None:
        return fused_weight_grad(dispatch.fused_module(), dy, saved, rank, seed, scalars=True,
                                 dtype=dtype, need_db=need_db)
    assert x_hat is not None
    plan = make_plan(n, rank, seed, device=dy.device)
    dy_sketch, dy_sq = dispatch.bucket_sum(dy, plan)
    grad = weight_grad_estimate(dy_sketch, dy_sq, dy_sum, x_hat, x_mean, plan, n)
    return grad.to(dtype), None


def output_layer_grads(
    dy: torch.Tensor,
    saved: SavedSketch,
    n: int,
    rank: int,
    seed: int,
    dtype: torch.dtype,
    need: tuple[bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A fused MLP's last layer's `(dW in dtype, db in dY's dtype)` (module docstring)."""
    need_dw, need_db = need
    sketched = need_dw and rank > 0
    fused = sketched and saved[3] is not None
    dy_sum = None  # dY's column sums: db, and μdy for the reference path's centred estimate
    if (need_db and not fused) or (sketched and not fused and saved[1] is not None):
        dy_sum = dy.sum(0, dtype=reference.acc_dtype(dy.dtype))
    dw = db = None
    if sketched:
        dw, db = saved_sketch_weight_grad(dy, dy_sum, saved, n, rank, seed, dtype, need_db)
    if need_db and db is None:
        assert dy_sum is not None  # summed above whenever db needs it
        db = dy_sum.to(dy.dtype)
    return dw, db


class BlockWeightGrad:
    """dW = dYᵀX from row blocks of X and dY: exact for rank 0, else the BASIS estimate."""

    def __init__(
        self,
        shape: torch.Size,
        rank: int,
        seed: int,
        estimator: str,
        n: int,
        device: torch.device,
        acc: torch.dtype,
        block_rows: int,
        dtype: torch.dtype,
    ) -> None:
        self.n = n
        self.exact = (
            torch.zeros(shape, dtype=acc, device=device) if rank == 0 else None
        )
        self.dy_sketch = self.x_sketch = None
        if rank > 0:
            out_features, in_features = shape
            kernels = dispatch.fused_on(device, dtype) if n else None
            # One plan for both (the fused kernels take its order; the reference path shares
            # block plans in `add`). The reference centres dY with the column sums the caller
            # passes to finish (it needs them for the bias anyway); the kernels centre it in
            # their own pass.
            order = plan_order(kernels, n, seed, device) if kernels is not None else None
            dy_estimator = estimator if kernels is not None else "basis"
            self.dy_sketch = BlockInputSketch(
                n, rank, seed, out_features, dy_estimator, device, acc, block_rows, dtype,
                order=order)
            self.x_sketch = BlockInputSketch(
                n, rank, seed, in_features, estimator, device, acc, block_rows, dtype,
                order=order)

    def add(self, start: int, end: int, dy_rows: torch.Tensor, x_rows: torch.Tensor) -> None:
        if self.exact is not None:
            # The block's product in the data's dtype (bf16 runs at the tensor cores' rate, with
            # fp32 accumulation inside the GEMM, as nn.Linear's own backward does), summed over
            # blocks in `acc`. Upcasting first made it an fp32 GEMM: 2x a bf16 step on an H200.
            if dy_rows.dtype == self.exact.dtype:  # fp32: accumulate in place, no temporary
                self.exact.addmm_(dy_rows.t(), x_rows)
            else:
                self.exact += (dy_rows.t() @ x_rows).to(self.exact.dtype)
            return
        assert self.dy_sketch is not None and self.x_sketch is not None  # rank > 0
        block_plan = None if self.x_sketch.fused is not None else self.x_sketch.block_plan(
            start, end)
        self.dy_sketch.add(start, end, dy_rows, block_plan)
        self.x_sketch.add(start, end, x_rows, block_plan)

    def finish(self, dy_sum: torch.Tensor | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """dW in `dtype` (default the accumulation dtype); `dy_sum` are dY's column sums over
        all n rows (only read by the reference path's centred estimator)."""
        if self.exact is not None:
            return self.exact if dtype is None else self.exact.to(dtype)
        assert self.dy_sketch is not None and self.x_sketch is not None  # rank > 0
        if self.x_sketch.fused is not None:
            x_done, dy_done = self.x_sketch.fused.finish(), self.dy_sketch.fused.finish()
            out = dispatch.fused_module().weight_grad(
                dy_done, x_done, self.n, scale=True, dtype=dtype or x_done.stats.dtype)
            return out
        x_hat, x_mean, _, _ = self.x_sketch.finish(self.x_sketch.sketch.dtype)
        assert x_hat is not None
        grad = weight_grad_estimate(
            self.dy_sketch.sketch,
            self.dy_sketch.sq_norm,
            dy_sum,
            x_hat,
            x_mean,
            self.x_sketch.plan,
            self.n,
        )
        return grad if dtype is None else grad.to(dtype)


def linear_into(dest: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
    """`dest[...] = F.linear(x, weight, bias)`, the GEMM writing into `dest` when it can (the
    same kernel as `F.linear`, no temporary and no copy)."""
    if dest.is_contiguous() and dest.dtype == x.dtype == weight.dtype:
        if bias is None:
            torch.mm(x, weight.t(), out=dest)
        elif bias.dtype == dest.dtype:
            torch.addmm(bias, x, weight.t(), out=dest)
        else:
            dest.copy_(F.linear(x, weight, bias))
    else:
        dest.copy_(F.linear(x, weight, bias))
