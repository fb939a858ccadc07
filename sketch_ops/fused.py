"""`gelu_mlp`: a transformer MLP `proj(gelu(fc(norm(x))))` that keeps only its input.

`gelu_mlp(fc, proj, x, *, norm=None, recompute=None)` returns `proj(F.gelu(fc(norm(x))))` (no
norm when `norm` is None); fc and proj are each an `nn.Linear` or a `SketchedLinear`. When a
backward will run and `recompute` is True, or None (the default) and proj is sketched, it goes
through one fused, row-blocked autograd function that recomputes the hidden activations; its
gradients equal the unfused composition's (the same sketches from the same per-layer seeds and
estimators: dX, the biases and every plain layer's dW exact, a sketched layer's dW the same
BASIS estimate) up to fp32 summation order. Otherwise it is the plain composition, the norm
fused into fc when fc is plain (`norm_linear`).

The fused function walks the rows in blocks (`blocked.block_size`). Forward, per block: norm,
fc, GELU, proj and the block's part of proj's input sketch. Saved: x (n × d, the norm's input,
which a LayerNorm keeps anyway), proj's R × 4d sketch (plus the hidden row mean, centred) and
the two seeds. On the fused sketch path the GELU and proj's input sketch are one kernel over the
block, in place on fc's output (GELU as F.gelu computes it, to an ulp). Backward, per block:
recompute the norm and fc's output, the hidden gradient `dY W2`, GELU's derivative, the block's
slice of dX and its part of `S dH` (or, for a plain fc, of the exact `dHᵀ x`). No n × 4d tensor
outlives a block; the price is one extra fc matmul in backward. Why, and what it saves:
docs/basis.md, "Where a sketch saves memory".

`recompute=True` with a plain proj is the same recompute with exact gradients (selective
activation recomputation): the sketched MLP's memory minus proj's sketch, for one more matmul
(proj's exact dW from the recomputed rows), the exact baseline BASIS must beat at equal memory.
`recompute=False` never fuses: GELU keeps its n × 4d input and sketched layers save time, not
memory (the fastest step, not the smallest).

x is kept for the recompute anyway, so sketching fc saves no memory: a plain fc gets its exact
dW for free (`trainer.train.model.SKETCH_LAYERS`). Under autocast the norm runs unfused in front
(in fp32, as `nn.LayerNorm`), and the fused function keeps its output instead of x.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import reference
from .blocked import (
    NO_SKETCH,
    BlockInputSketch,
    BlockWeightGrad,
    block_size,
    layer_sketches,
    linear_into,
    output_layer_grads,
    row_blocks,
)
from .function import autocast_inputs, needs_sketch, validate
from .layer import SketchedLinear
from .norm_linear import fusable_norm, layer_norm_rows, layer_norm_rows_backward, norm_linear


class _GeluMlpFn(torch.autograd.Function):
    """Rank 0 in `ranks` means that layer is plain (exact dW); `eps` None means no norm."""

    @staticmethod
    def forward(
        ctx: Any,
        x2d: torch.Tensor,
        norm_w: torch.Tensor | None,
        norm_b: torch.Tensor | None,
        w1: torch.Tensor,
        b1: torch.Tensor | None,
        w2: torch.Tensor,
        b2: torch.Tensor | None,
        eps: float | None,
        ranks: tuple[int, int],
        seeds: tuple[int, int],
        estimators: tuple[str, str],
    ) -> torch.Tensor:
        n = x2d.shape[0]
        out = torch.empty(n, w2.shape[0], dtype=x2d.dtype, device=x2d.device)
        acc = reference.acc_dtype(x2d.dtype)
        size = block_size(n, w1.shape[0], x2d.dtype, x2d.device)
        proj_sketch = (
            BlockInputSketch(n, ranks[1], seeds[1], w2.shape[1], estimators[1], x2d.device,
                             acc, size, x2d.dtype)
            if ranks[1] > 0
            else None
        )
        for start, end in row_blocks(n, size):
            rows = x2d[start:end]
            if eps is not None:
                rows = layer_norm_rows(rows, norm_w, norm_b, eps)[0]
            pre = F.linear(rows, w1, b1)
            del rows
            if proj_sketch is not None and proj_sketch.fuses_producer:
                # GELU and proj's input sketch in one pass over the block (in place on pre).
                hidden = proj_sketch.add_activated(start, end, pre, "gelu")
            else:
                hidden = torch.ops.aten.gelu_(pre)  # no graph here
                if proj_sketch is not None:
                    proj_sketch.add(start, end, hidden)
            linear_into(out[start:end], hidden, w2, b2)
        saved = proj_sketch.finish(x2d.dtype) if proj_sketch is not None else NO_SKETCH
        # Seeds as a saved tensor: under activation checkpointing they then come from the
        # recompute together with the sketch (see function.py).
        seeds_t = torch.tensor(seeds, dtype=torch.int64)
        ctx.save_for_backward(x2d, norm_w, norm_b, w1, b1, w2, *saved, seeds_t)
        ctx.ranks, ctx.estimators, ctx.eps = ranks, estimators, eps
        return out

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x2d, norm_w, norm_b, w1, b1, w2, *saved, seeds_t = ctx.saved_tensors
        hidden_hat, hidden_mean, hidden_stats, hidden_order = saved
        need_dx, need_dnw, need_dnb, need_dw1, need_db1, need_dw2, need_db2 = (
            ctx.needs_input_grad[:7]
        )
        n, acc, eps, device = x2d.shape[0], reference.acc_dtype(dy.dtype), ctx.eps, dy.device
        size = block_size(n, w1.shape[0], x2d.dtype, device)
        seed1, seed2 = (int(s) for s in seeds_t)
        (rank1, rank2), (estimator1, _) = ctx.ranks, ctx.estimators
        # proj's dW (sketched) and db; on the fused path db comes from dY's sketch pass.
        hidden = (hidden_hat, hidden_mean, hidden_stats, hidden_order)
        dw2, db2 = output_layer_grads(dy, hidden, n, rank2, seed2, w2.dtype, (need_dw2, need_db2))
        # proj's exact dW from the recomputed hidden rows (recompute with a plain proj).
        proj_exact = (
            BlockWeightGrad(w2.shape, 0, 0, "basis", n, device, acc, size, dy.dtype)
            if need_dw2 and rank2 == 0
            else None
        )
        need_rows_grad = need_dx or (eps is not None and (need_dnw or need_dnb))
        dx = torch.empty(x2d.shape, dtype=dy.dtype, device=dy.device) if need_dx else None
        dnw = torch.zeros_like(norm_w, dtype=acc) if need_dnw and norm_w is not None else None
        dnb = torch.zeros_like(norm_b, dtype=acc) if need_dnb and norm_b is not None else None
        # fc's dW: exact when fc is plain — its input is recomputed anyway, so an exact dW costs
        # no memory, only the n-row matmul; otherwise its BASIS sketch, built block by block.
        fc_grad = (
            BlockWeightGrad(w1.shape, rank1, seed1, estimator1, n, device, acc, size, dy.dtype)
            if need_dw1
            else None
        )
        dh_sum = torch.zeros(w1.shape[0], dtype=acc, device=dy.device)
        for start, end in row_blocks(n, size):
            raw = x2d[start:end]
            rows, mean, rstd = (
                (raw, raw, raw) if eps is None else layer_norm_rows(raw, norm_w, norm_b, eps)
            )
            pre = F.linear(rows, w1, b1)
            if proj_exact is not None:
                proj_exact.add(start, end, dy[start:end], F.gelu(pre))
            dh = torch.ops.aten.gelu_backward(dy[start:end] @ w2, pre)
            del pre
            if need_rows_grad:
                drows = dh @ w1
                if eps is None:
                    assert dx is not None  # without a norm, rows' gradient is only for dx
                    dx[start:end] = drows
                else:
                    part_dx, part_dnw, part_dnb = layer_norm_rows_backward(
                        drows, raw, mean, rstd, norm_w, norm_b, (need_dx, need_dnw, need_dnb)
                    )
                    if dx is not None and part_dx is not None:
                        dx[start:end] = part_dx
                    if dnw is not None and part_dnw is not None:
                        dnw += part_dnw
                    if dnb is not None and part_dnb is not None:
                        dnb += part_dnb
                del drows
            dh_sum += dh.sum(0, dtype=acc)
            if fc_grad is not None:
                fc_grad.add(start, end, dh, rows)
        if proj_exact is not None:
            dw2 = proj_exact.finish()
        dw1 = None if fc_grad is None else fc_grad.finish(dh_sum, w1.dtype)
        dw2 = None if dw2 is None else dw2.to(w2.dtype)
        db1 = dh_sum.to(dy.dtype) if need_db1 else None
        dnw = None if dnw is None else dnw.to(norm_w.dtype)
        dnb = None if dnb is None else dnb.to(norm_b.dtype)
        return dx, dnw, dnb, dw1, db1, dw2, db2, None, None, None, None


def gelu_mlp(
    fc: nn.Module,
    proj: nn.Module,
    x: torch.Tensor,
    *,
    norm: nn.Module | None = None,
    recompute: bool | None = None,
) -> torch.Tensor:
    """`proj(F.gelu(fc(norm(x))))`, fused and row-blocked (keeping only x) when `recompute` is
    True, or None and proj is a SketchedLinear, and fc and proj are `nn.Linear`s or
    SketchedLinears (a plain layer's dW is then exact)."""
    layer_types = (nn.Linear, SketchedLinear)
    fused = type(fc) in layer_types and type(proj) in layer_types
    if recompute is None:
        recompute = isinstance(proj, SketchedLinear)
    if not (fused and recompute):
        hidden = fc(x) if norm is None else norm_linear(norm, fc, x)
        return proj(F.gelu(hidden))
    assert isinstance(fc, nn.Linear) and isinstance(proj, nn.Linear)  # fused: those types
    # The norm taken into the fused op: a LayerNorm over the last dimension, autocast off.
    # Other norms, and nn.LayerNorm's fp32 rule under autocast, run in front instead.
    inner = norm if fusable_norm(norm) and not torch.is_autocast_enabled(x.device.type) else None
    if norm is not None and inner is None:
        x = norm(x)
    norm_params = (inner.weight, inner.bias) if inner is not None else (None, None)
    if not needs_sketch(x, *norm_params, fc.weight, fc.bias, proj.weight, proj.bias):
        return proj(F.gelu(fc(x if inner is None else inner(x))))
    validate(x, fc.weight, fc.bias, fc.rank if isinstance(fc, SketchedLinear) else 1)
    if fc.weight.shape[0] != proj.weight.shape[1]:
        raise ValueError(
            f"gelu_mlp: fc.out_features ({fc.weight.shape[0]}) must equal proj.in_features "
            f"({proj.weight.shape[1]})"
        )
    x, w1, b1 = autocast_inputs(x, fc.weight, fc.bias)
    _, w2, b2 = autocast_inputs(x, proj.weight, proj.bias)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    # Per layer (fc, proj): rank 0, seed 0 and "basis" for a plain layer (exact dW).
    ranks, seeds, estimators = layer_sketches((fc, proj), x2d.shape[0])
    eps = None if inner is None else inner.eps
    with torch.autocast(x.device.type, enabled=False):
        out = _GeluMlpFn.apply(
            x2d, *norm_params, w1, b1, w2, b2, eps, ranks, seeds, estimators
        )
    return out.reshape(*lead, w2.shape[0])
