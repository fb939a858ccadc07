"""`gelu_mlp`: a transformer MLP `proj(gelu(fc(x)))` whose sketched layers keep only x.

Contract: `gelu_mlp(fc, proj, x)` returns `proj(F.gelu(fc(x)))`. When proj is a
`SketchedLinear`, fc a `SketchedLinear` or a plain `nn.Linear`, and a backward will run, it goes
through one fused autograd function whose gradients equal those of the unfused composition —
the same sketches from the same per-layer seeds and estimators, so dX and the biases exact,
proj's dW (and fc's, if sketched) the same BASIS estimates — up to fp32 summation order.
Otherwise it is the plain composition.

Why: once proj is sketched, the MLP's largest activations are its 4d-wide hidden tensors: GELU
saves its input, and the hidden output exists in full between the layers, in forward and again
(as its gradient) in backward. The fused function walks the rows in blocks of `BLOCK_ROWS`
instead. Forward, per block: fc, GELU, proj, and the block's part of proj's input sketch (S is
linear in the rows, so block sketches add up). Saved: x (n × d), proj's R × 4d sketch (plus
the hidden row mean for the centred estimator) and the two seeds. Backward, per block:
recompute fc's output, the hidden gradient `dY W2`, GELU's derivative, the block's slice of dX
and its part of `S dH` (or, for a plain fc, of the exact `dHᵀ x`). No n × 4d tensor is ever
allocated. The price is one extra fc matmul in backward.

Because x is kept for the recompute anyway, sketching fc saves no memory here: a plain fc gets
its exact weight gradient for free (the built-in GPT's default, `trainer.model.SKETCH_LAYERS`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import dispatch, reference
from .function import (
    autocast_inputs,
    input_sketch,
    needs_sketch,
    validate,
    weight_grad_estimate,
)
from .layer import SketchedLinear
from .seeds import effective_rank, layer_seed, make_plan

BLOCK_ROWS = 2048  # rows per block: bounds the temporaries to BLOCK_ROWS × hidden width


def _blocks(n: int) -> list[tuple[int, int]]:
    return [(start, min(start + BLOCK_ROWS, n)) for start in range(0, n, BLOCK_ROWS)]


class _GeluMlpFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x2d: torch.Tensor,
        w1: torch.Tensor,
        b1: torch.Tensor | None,
        w2: torch.Tensor,
        b2: torch.Tensor | None,
        ranks: tuple[int, int],
        seeds: tuple[int, int],
        estimators: tuple[str, str],
    ) -> torch.Tensor:
        n = x2d.shape[0]
        out = torch.empty(n, w2.shape[0], dtype=x2d.dtype, device=x2d.device)
        plan2 = make_plan(n, ranks[1], seeds[1])
        acc = reference.acc_dtype(x2d.dtype)
        sketch = torch.zeros(plan2.rank, w2.shape[1], dtype=acc, device=x2d.device)
        sq_norm = torch.zeros((), dtype=sketch.dtype, device=x2d.device)
        hidden_sum = torch.zeros(w2.shape[1], dtype=acc, device=x2d.device)
        for start, end in _blocks(n):
            hidden = torch.ops.aten.gelu_(F.linear(x2d[start:end], w1, b1))  # no graph here
            out[start:end] = F.linear(hidden, w2, b2)
            part, part_sq = dispatch.bucket_sum(hidden, plan2.row_block(start, end).to(x2d.device))
            sketch += part
            sq_norm += part_sq
            hidden_sum += hidden.sum(0, dtype=acc)
        centred_sum = hidden_sum if estimators[1] == "centered" else None
        hidden_hat, hidden_mean = input_sketch(
            sketch, sq_norm, centred_sum, plan2.to(x2d.device), n
        )
        hidden_hat = hidden_hat.to(x2d.dtype)
        # Seeds as a saved tensor: under activation checkpointing they then come from the
        # recompute together with the sketch (see function.py).
        seeds_t = torch.tensor(seeds, dtype=torch.int64)
        ctx.save_for_backward(x2d, w1, b1, w2, hidden_hat, hidden_mean, seeds_t)
        ctx.ranks, ctx.estimators = ranks, estimators
        return out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x2d, w1, b1, w2, hidden_hat, hidden_mean, seeds_t = ctx.saved_tensors
        need_dx, need_dw1, need_db1, need_dw2, need_db2 = ctx.needs_input_grad[:5]
        n, acc = x2d.shape[0], reference.acc_dtype(dy.dtype)
        seed1, seed2 = (int(s) for s in seeds_t)
        dw2 = db2 = None
        dy_sum = None  # column sums of dY: db2, and μdy when centred; one pass for both
        if need_db2 or (need_dw2 and hidden_mean is not None):
            dy_sum = dy.sum(0, dtype=acc)
        if need_dw2:
            plan2 = make_plan(n, ctx.ranks[1], seed2).to(dy.device)
            dy_sketch, dy_sq = dispatch.bucket_sum(dy, plan2)
            dw2 = weight_grad_estimate(dy_sketch, dy_sq, dy_sum, hidden_hat, hidden_mean, plan2, n)
            dw2 = dw2.to(w2.dtype)
        if need_db2:
            db2 = dy_sum.to(dy.dtype)
        dx = torch.empty(x2d.shape, dtype=dy.dtype, device=dy.device) if need_dx else None
        # fc's dW: exact when fc is a plain nn.Linear (rank 0) — x is kept anyway, so an exact
        # dW costs no memory, only the n-row matmul; otherwise its BASIS sketch.
        fc_exact = ctx.ranks[0] == 0
        plan1 = make_plan(n, ctx.ranks[0], seed1) if need_dw1 and not fc_exact else None
        dw1 = torch.zeros(w1.shape, dtype=acc, device=dy.device) if need_dw1 and fc_exact else None
        dh_sum = torch.zeros(w1.shape[0], dtype=acc, device=dy.device)
        if plan1 is not None:
            dh_sketch = torch.zeros(plan1.rank, w1.shape[0], dtype=acc, device=dy.device)
            dh_sq = torch.zeros((), dtype=acc, device=dy.device)
        for start, end in _blocks(n):
            pre = F.linear(x2d[start:end], w1, b1)
            dh = torch.ops.aten.gelu_backward(dy[start:end] @ w2, pre)
            del pre
            if dx is not None:
                torch.mm(dh, w1, out=dx[start:end])
            dh_sum += dh.sum(0, dtype=acc)
            if dw1 is not None:
                dw1.addmm_(dh.t().to(acc), x2d[start:end].to(acc))
            if plan1 is not None:
                part, part_sq = dispatch.bucket_sum(dh, plan1.row_block(start, end).to(dy.device))
                dh_sketch += part
                dh_sq += part_sq
        if plan1 is not None:
            plan1 = plan1.to(dy.device)
            x_sketch, x_sq = dispatch.bucket_sum(x2d, plan1)
            x_sum = x2d.sum(0, dtype=acc) if ctx.estimators[0] == "centered" else None
            x_hat, x_mean = input_sketch(x_sketch, x_sq, x_sum, plan1, n)
            dw1 = weight_grad_estimate(dh_sketch, dh_sq, dh_sum, x_hat, x_mean, plan1, n)
        dw1 = None if dw1 is None else dw1.to(w1.dtype)
        db1 = dh_sum.to(dy.dtype) if need_db1 else None
        return dx, dw1, db1, dw2, db2, None, None, None


def gelu_mlp(fc: nn.Module, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`proj(F.gelu(fc(x)))`, fused and row-blocked when proj is a SketchedLinear and fc a
    SketchedLinear or a plain nn.Linear (whose dW is then exact)."""
    fusable = isinstance(proj, SketchedLinear) and type(fc) in (nn.Linear, SketchedLinear)
    if not fusable:
        return proj(F.gelu(fc(x)))
    params = (fc.weight, fc.bias, proj.weight, proj.bias)
    if not needs_sketch(x, *params[:2]) and not needs_sketch(x, *params[2:]):
        return proj(F.gelu(fc(x)))
    fc_sketched = isinstance(fc, SketchedLinear)
    validate(x, fc.weight, fc.bias, fc.rank if fc_sketched else 1)
    if fc.weight.shape[0] != proj.weight.shape[1]:
        raise ValueError(
            f"gelu_mlp: fc.out_features ({fc.weight.shape[0]}) must equal proj.in_features "
            f"({proj.weight.shape[1]})"
        )
    x, w1, b1 = autocast_inputs(x, fc.weight, fc.bias)
    _, w2, b2 = autocast_inputs(x, proj.weight, proj.bias)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    n = x2d.shape[0]
    ranks = (effective_rank(fc.rank, n) if fc_sketched else 0, effective_rank(proj.rank, n))
    seeds = (layer_seed(fc.sketch_name) if fc_sketched else 0, layer_seed(proj.sketch_name))
    estimators = (fc.estimator if fc_sketched else "basis", proj.estimator)
    with torch.autocast(x.device.type, enabled=False):
        out = _GeluMlpFn.apply(x2d, w1, b1, w2, b2, ranks, seeds, estimators)
    return out.reshape(*lead, w2.shape[0])
