"""`gelu_mlp`: a transformer MLP `proj(gelu(fc(x)))` whose sketched layers keep only x.

Contract: `gelu_mlp(fc, proj, x)` returns `proj(F.gelu(fc(x)))`. When both layers are
`SketchedLinear` and a backward will run, it goes through one fused autograd function whose
gradients equal those of the unfused composition — the same sketches from the same per-layer
seeds, so dX and the biases exact and both dW the same BASIS estimates — up to fp32 summation
order. Otherwise it is the plain composition.

Why: once both linears are sketched, the MLP's largest activations are its 4d-wide hidden
tensors: GELU saves its input, and the hidden output exists in full between the layers, in
forward and again (as its gradient) in backward. The fused function walks the rows in blocks of
`BLOCK_ROWS` instead. Forward, per block: fc, GELU, proj, and the block's part of proj's input
sketch (S is linear in the rows, so block sketches add up). Saved: x (n × d), proj's R × 4d
sketch and the two seeds. Backward, per block: recompute fc's output, the hidden gradient
`dY W2`, GELU's derivative, the block's slice of dX and its part of `S dH`. No n × 4d tensor is
ever allocated. The price is one extra fc matmul in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import dispatch, reference
from .function import autocast_inputs, needs_sketch, validate
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
    ) -> torch.Tensor:
        n = x2d.shape[0]
        out = torch.empty(n, w2.shape[0], dtype=x2d.dtype, device=x2d.device)
        plan2 = make_plan(n, ranks[1], seeds[1])
        acc = reference.acc_dtype(x2d.dtype)
        sketch = torch.zeros(plan2.rank, w2.shape[1], dtype=acc, device=x2d.device)
        sq_norm = torch.zeros((), dtype=sketch.dtype, device=x2d.device)
        for start, end in _blocks(n):
            hidden = torch.ops.aten.gelu_(F.linear(x2d[start:end], w1, b1))  # no graph here
            out[start:end] = F.linear(hidden, w2, b2)
            part, part_sq = dispatch.bucket_sum(hidden, plan2.row_block(start, end).to(x2d.device))
            sketch += part
            sq_norm += part_sq
        hidden_hat = sketch.mul_(reference.invariant_scale(sq_norm, sketch)).to(x2d.dtype)
        # Seeds as a saved tensor: under activation checkpointing they then come from the
        # recompute together with the sketch (see function.py).
        ctx.save_for_backward(x2d, w1, b1, w2, hidden_hat, torch.tensor(seeds, dtype=torch.int64))
        ctx.ranks = ranks
        return out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x2d, w1, b1, w2, hidden_hat, seeds_t = ctx.saved_tensors
        need_dx, need_dw1, need_db1, need_dw2, need_db2 = ctx.needs_input_grad[:5]
        n, acc = x2d.shape[0], reference.acc_dtype(dy.dtype)
        seed1, seed2 = (int(s) for s in seeds_t)
        dw2 = db2 = None
        if need_dw2:
            plan2 = make_plan(n, ctx.ranks[1], seed2).to(dy.device)
            dy_sketch, dy_sq = dispatch.bucket_sum(dy, plan2)
            scale = reference.invariant_scale(dy_sq, dy_sketch)
            dw2 = dispatch.weight_grad(dy_sketch, hidden_hat, scale, w2.dtype)
        if need_db2:
            db2 = dy.sum(0, dtype=acc).to(dy.dtype)
        dx = torch.empty(x2d.shape, dtype=dy.dtype, device=dy.device) if need_dx else None
        db1 = torch.zeros(w1.shape[0], dtype=acc, device=dy.device) if need_db1 else None
        plan1 = make_plan(n, ctx.ranks[0], seed1) if need_dw1 else None
        dh_sketch = torch.zeros(ctx.ranks[0], w1.shape[0], dtype=acc, device=dy.device)
        dh_sq = torch.zeros((), dtype=acc, device=dy.device)
        for start, end in _blocks(n):
            pre = F.linear(x2d[start:end], w1, b1)
            dh = torch.ops.aten.gelu_backward(dy[start:end] @ w2, pre)
            del pre
            if dx is not None:
                torch.mm(dh, w1, out=dx[start:end])
            if db1 is not None:
                db1 += dh.sum(0, dtype=acc)
            if plan1 is not None:
                part, part_sq = dispatch.bucket_sum(dh, plan1.row_block(start, end).to(dy.device))
                dh_sketch += part
                dh_sq += part_sq
        dw1 = None
        if plan1 is not None:
            x_sketch, x_sq = dispatch.bucket_sum(x2d, plan1.to(dy.device))
            scale = reference.invariant_scale(x_sq, x_sketch)
            scale = scale * reference.invariant_scale(dh_sq, dh_sketch)
            dw1 = dispatch.weight_grad(dh_sketch, x_sketch, scale, w1.dtype)
        if db1 is not None:
            db1 = db1.to(dy.dtype)
        return dx, dw1, db1, dw2, db2, None, None


def gelu_mlp(fc: nn.Module, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`proj(F.gelu(fc(x)))`, fused and row-blocked when both layers are SketchedLinear."""
    if not (isinstance(fc, SketchedLinear) and isinstance(proj, SketchedLinear)):
        return proj(F.gelu(fc(x)))
    params = (fc.weight, fc.bias, proj.weight, proj.bias)
    if not needs_sketch(x, *params[:2]) and not needs_sketch(x, *params[2:]):
        return proj(F.gelu(fc(x)))
    validate(x, fc.weight, fc.bias, fc.rank)
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
    ranks = (effective_rank(fc.rank, n), effective_rank(proj.rank, n))
    seeds = (layer_seed(fc.sketch_name), layer_seed(proj.sketch_name))
    with torch.autocast(x.device.type, enabled=False):
        out = _GeluMlpFn.apply(x2d, w1, b1, w2, b2, ranks, seeds)
    return out.reshape(*lead, w2.shape[0])
