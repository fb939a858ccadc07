"""`swiglu_mlp`: a gated MLP `down(act(gate(x)) * up(x))` (Llama's SwiGLU) that keeps x and gate's
output, or only x (`swiglu_find.fuse_swiglu_mlps` finds such MLPs in any model).

`swiglu_mlp(gate, up, down, act, x, *, recompute=None, keep_gate=KEEP_GATE)` returns
`down(act(gate(x)) * up(x))`. When gate, up and down are each an `nn.Linear` or a
`SketchedLinear` (biases optional), act is a parameter-free module acting on each row alone
(SiLU, any GELU), a backward will run, and `recompute` is True (or None and down is sketched),
it is one row-blocked autograd function; otherwise the plain composition.
- Saved: x (n × d), down's R × I input sketch when down is sketched (plus the I-vector row mean,
  centred), the three seeds (one int64 tensor), and with `keep_gate` (the default) gate's output,
  one n × I tensor computed for all rows at once.
- Backward recomputes, per row block (`blocked.block_size`), up's output, gate's (unless kept)
  and the activation, and from them dX, the biases, each plain layer's exact dW (down's from the
  recomputed rows) and each sketched layer's BASIS estimate. Gradients equal the unfused
  composition's (the same sketches from the same seeds) up to fp32 summation order; the output
  is the composition's up to the row blocking of the matmuls (bitwise for a single block).
- An activation that computes SiLU (probed once per module, whatever its class) runs as
  `F.silu`, differentiated with `silu_backward` in place in the block's temporaries when all
  operands share one dtype (the same bits as differentiating through autograd). On the fused
  sketch path with a sketched down and SiLU, the activation, the product and down's input
  sketch are one kernel over the block (the product as torch rounds it, to an ulp).

Memory and time: with down sketched the MLP keeps x and an R × I sketch instead of four n × I
tensors; `keep_gate` keeps gate's output too and runs as many matmuls as exact backprop, while
`keep_gate=False` keeps less for one matmul more (~5 % of step time). The counts, and why
`keep_gate` is the default: docs/design.md, "The SwiGLU MLP's memory and time".
Under autocast x and the weights are cast to the autocast dtype (as the linear layers would),
the activation runs under the caller's autocast state and the product is cast to down's dtype.
"""

from __future__ import annotations

import weakref
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

LAYER_TYPES = (nn.Linear, SketchedLinear)
# The fused MLP's default mode: keep gate's output too (module docstring: why). The one
# definition; fuse_swiglu_mlps, sketch_model and the recipe's [sketch] keep_gate default to it.
KEEP_GATE = True

AutocastState = tuple[str, torch.dtype, bool]  # (device type, dtype, enabled)


def _activate(act: nn.Module, pre: torch.Tensor, autocast: AutocastState) -> torch.Tensor:
    """`act(pre)` under the caller's autocast state (the fused function runs with it off)."""
    device_type, dtype, enabled = autocast
    with torch.autocast(device_type, dtype=dtype, enabled=enabled):
        return act(pre)


# Activations found to compute SiLU (Llama's, whatever their class), by a probe, once each.
_SILU_PROBE = torch.linspace(-12.0, 12.0, 97)
_silu_found: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _acts_as_silu(act: nn.Module) -> bool:
    """Whether `act` returns exactly `F.silu` of its input on a probe (then the fused function
    calls SiLU and its derivative itself: the same values, without an autograd graph per
    block). Decided by behaviour, not class: `nn.SiLU`, transformers' `SiLUActivation`, ..."""
    found = _silu_found.get(act)
    if found is None:
        try:
            with torch.no_grad():
                got = act(_SILU_PROBE.clone())
            found = isinstance(got, torch.Tensor) and torch.equal(got, F.silu(_SILU_PROBE))
        except (RuntimeError, TypeError, ValueError):
            found = False
        _silu_found[act] = found
    return found


def _silu_block_grads(gate_pre: torch.Tensor, up: torch.Tensor, dhidden: torch.Tensor,
                      dy_rows: torch.Tensor, start: int, end: int,
                      down_exact: BlockWeightGrad | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dGate, dUp) of one row block when the activation is SiLU and every tensor has one
    dtype: the values `_block_grads` computes, in place in the block's own temporaries
    (`up` and `dhidden` are overwritten)."""
    gated = F.silu(gate_pre)
    if down_exact is not None:
        down_exact.add(start, end, dy_rows, gated * up)
    dup = gated.mul_(dhidden)
    dact = dhidden.mul_(up)
    dgate = torch.ops.aten.silu_backward.grad_input(dact, gate_pre, grad_input=up)
    return dgate, dup


def _block_grads(act: nn.Module, autocast: AutocastState, gate_pre: torch.Tensor,
                 up: torch.Tensor, dhidden: torch.Tensor, dy_rows: torch.Tensor, start: int,
                 end: int, down_exact: BlockWeightGrad | None, down_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dGate, dUp) of one row block for any activation (its derivative by autograd)."""
    gate_pre = gate_pre.detach().requires_grad_()  # a leaf
    with torch.enable_grad():
        gated = _activate(act, gate_pre, autocast)
    if down_exact is not None:
        down_exact.add(start, end, dy_rows, (gated.detach() * up).to(down_dtype))
    dup = (dhidden * gated.detach()).to(up.dtype)
    (dgate,) = torch.autograd.grad(gated, gate_pre, (dhidden * up).to(gated.dtype))
    return dgate, dup


def _weight_grad(need: bool, weight: torch.Tensor, rank: int, seed: int, estimator: str,
                 blocks: tuple[int, torch.device, torch.dtype, int, torch.dtype]
                 ) -> BlockWeightGrad | None:
    """A layer's block-accumulated dW (`blocks`: n, device, acc, block rows, data dtype)."""
    n, device, acc, size, dtype = blocks
    if not need:
        return None
    return BlockWeightGrad(weight.shape, rank, seed, estimator, n, device, acc, size, dtype)


def _column_sums(need_bias: bool, sketched: bool, estimator: str, weight: torch.Tensor,
                 acc: torch.dtype) -> torch.Tensor | None:
    """Zeros to sum an output gradient's columns into: for the bias, and for a centred sketch."""
    if need_bias or (sketched and estimator == "centered"):
        return torch.zeros(weight.shape[0], dtype=acc, device=weight.device)
    return None


class _SwigluMlpFn(torch.autograd.Function):
    """Rank 0 in `ranks` means that layer (gate, up, down) is plain: exact dW."""

    @staticmethod
    def forward(
        ctx: Any,
        x2d: torch.Tensor,
        w_gate: torch.Tensor,
        b_gate: torch.Tensor | None,
        w_up: torch.Tensor,
        b_up: torch.Tensor | None,
        w_down: torch.Tensor,
        b_down: torch.Tensor | None,
        act: nn.Module,
        autocast: AutocastState,
        ranks: tuple[int, int, int],
        seeds: tuple[int, int, int],
        estimators: tuple[str, str, str],
        keep_gate: bool,
    ) -> torch.Tensor:
        n = x2d.shape[0]
        out = torch.empty(n, w_down.shape[0], dtype=x2d.dtype, device=x2d.device)
        acc = reference.acc_dtype(x2d.dtype)
        size = block_size(n, w_gate.shape[0], x2d.dtype, x2d.device)
        down_sketch = (
            BlockInputSketch(n, ranks[2], seeds[2], w_down.shape[1], estimators[2], x2d.device,
                             acc, size, x2d.dtype)
            if ranks[2] > 0
            else None
        )
        # keep_gate: gate's pre-activation for all rows at once; it is saved for backward.
        gate_all = F.linear(x2d, w_gate, b_gate) if keep_gate else None
        silu = _acts_as_silu(act)
        for start, end in row_blocks(n, size):
            rows = x2d[start:end]
            gate_pre = gate_all[start:end] if gate_all is not None else F.linear(
                rows, w_gate, b_gate)
            up_out = F.linear(rows, w_up, b_up)
            one_dtype = gate_pre.dtype == up_out.dtype == w_down.dtype
            if silu and one_dtype and down_sketch is not None and down_sketch.fuses_producer:
                # SiLU, the product and down's input sketch in one pass over the block.
                hidden = down_sketch.add_activated(start, end, gate_pre, "silu_mul", up_out)
            else:
                if silu and one_dtype:
                    hidden = F.silu(gate_pre).mul_(up_out)  # in place: one temporary less
                else:
                    hidden = (_activate(act, gate_pre, autocast) * up_out).to(w_down.dtype)
                if down_sketch is not None:
                    down_sketch.add(start, end, hidden)
            del up_out
            linear_into(out[start:end], hidden, w_down, b_down)
        saved = down_sketch.finish(x2d.dtype) if down_sketch is not None else NO_SKETCH
        # Seeds as a saved tensor: under activation checkpointing they then come from the
        # recompute together with the sketch (see function.py).
        seeds_t = torch.tensor(seeds, dtype=torch.int64)
        ctx.save_for_backward(
            x2d, w_gate, b_gate, w_up, b_up, w_down, *saved, seeds_t, gate_all
        )
        ctx.act, ctx.autocast, ctx.ranks, ctx.estimators = act, autocast, ranks, estimators
        ctx.silu = silu
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2d, w_gate, b_gate, w_up, b_up, w_down, *sketch, seeds_t, gate_all = ctx.saved_tensors
        hidden_hat, hidden_mean, hidden_stats, hidden_order = sketch
        need_dx, need_dwg, need_dbg, need_dwu, need_dbu, need_dwd, need_dbd = (
            ctx.needs_input_grad[:7]
        )
        n, acc, device = x2d.shape[0], reference.acc_dtype(dy.dtype), dy.device
        size = block_size(n, w_gate.shape[0], x2d.dtype, device)
        seeds = [int(s) for s in seeds_t]
        (rank_gate, rank_up, rank_down), estimators = ctx.ranks, ctx.estimators
        # down's dW (sketched) and db; on the fused path db comes from dY's sketch pass.
        dw_down, db_down = output_layer_grads(
            dy, (hidden_hat, hidden_mean, hidden_stats, hidden_order), n, rank_down, seeds[2],
            w_down.dtype, (need_dwd, need_dbd))
        blocks = (n, device, acc, size, dy.dtype)
        # Down's exact dW from the recomputed hidden rows (recompute=True with a plain down).
        down_exact = _weight_grad(need_dwd and rank_down == 0, w_down, 0, 0, "basis", blocks)
        gate_grad = _weight_grad(need_dwg, w_gate, rank_gate, seeds[0], estimators[0], blocks)
        up_grad = _weight_grad(need_dwu, w_up, rank_up, seeds[1], estimators[1], blocks)
        # Column sums of gate's and up's output gradients: their biases, and μdy for a centred
        # sketch; skipped when neither needs them (a Llama's plain, bias-free gate and up).
        dgate_sum = _column_sums(need_dbg, need_dwg and rank_gate > 0, estimators[0], w_gate,
                                 acc)
        dup_sum = _column_sums(need_dbu, need_dwu and rank_up > 0, estimators[1], w_up, acc)
        dx = torch.empty(x2d.shape, dtype=dy.dtype, device=device) if need_dx else None
        for start, end in row_blocks(n, size):
            rows, dy_rows = x2d[start:end], dy[start:end]
            up = F.linear(rows, w_up, b_up)
            gate_pre = (gate_all[start:end].detach() if gate_all is not None
                        else F.linear(rows, w_gate, b_gate))
            dhidden = dy_rows @ w_down
            if ctx.silu and gate_pre.dtype == up.dtype == dhidden.dtype == w_down.dtype:
                dgate, dup = _silu_block_grads(gate_pre, up, dhidden, dy_rows, start, end,
                                               down_exact)
            else:
                dgate, dup = _block_grads(ctx.act, ctx.autocast, gate_pre, up, dhidden,
                                          dy_rows, start, end, down_exact, w_down.dtype)
            del gate_pre, dhidden, up
            if dx is not None:  # dgate Wg + dup Wu, written in place (no temporary, no copy)
                torch.mm(dgate, w_gate, out=dx[start:end])
                dx[start:end].addmm_(dup, w_up)
            if dgate_sum is not None:
                dgate_sum += dgate.sum(0, dtype=acc)
            if dup_sum is not None:
                dup_sum += dup.sum(0, dtype=acc)
            if gate_grad is not None:
                gate_grad.add(start, end, dgate, rows)
            if up_grad is not None:
                up_grad.add(start, end, dup, rows)
        if down_exact is not None:
            dw_down = down_exact.finish()
        return (
            dx,
            None if gate_grad is None else gate_grad.finish(dgate_sum, w_gate.dtype),
            dgate_sum.to(dy.dtype) if dgate_sum is not None and need_dbg else None,
            None if up_grad is None else up_grad.finish(dup_sum, w_up.dtype),
            dup_sum.to(dy.dtype) if dup_sum is not None and need_dbu else None,
            None if dw_down is None else dw_down.to(w_down.dtype),
            db_down,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def swiglu_mlp(
    gate: nn.Module,
    up: nn.Module,
    down: nn.Module,
    act: nn.Module,
    x: torch.Tensor,
    *,
    recompute: bool | None = None,
    keep_gate: bool = KEEP_GATE,
) -> torch.Tensor:
    """`down(act(gate(x)) * up(x))`, fused and row-blocked (keeping x, and gate's output when
    `keep_gate`) when `recompute` is True, or None and down is a SketchedLinear (module
    docstring)."""
    layers = (gate, up, down)
    fusable = all(type(layer) in LAYER_TYPES for layer in layers) and not any(
        p.requires_grad for p in act.parameters()
    )
    if recompute is None:
        recompute = isinstance(down, SketchedLinear)
    if not (fusable and recompute):
        return down(act(gate(x)) * up(x))
    assert isinstance(gate, nn.Linear) and isinstance(up, nn.Linear)  # fusable: those types
    assert isinstance(down, nn.Linear)
    params = [t for layer in (gate, up, down) for t in (layer.weight, layer.bias)]
    if not needs_sketch(x, *params):
        return down(act(gate(x)) * up(x))
    for layer in (gate, up):
        validate(x, layer.weight, layer.bias, 1)
    if gate.out_features != up.out_features or down.in_features != gate.out_features:
        raise ValueError(
            f"swiglu_mlp: gate and up must have the same out_features as down's in_features, got "
            f"gate {gate.out_features}, up {up.out_features}, down {down.in_features}"
        )
    device_type = x.device.type
    autocast: AutocastState = (
        device_type,
        torch.get_autocast_dtype(device_type),
        torch.is_autocast_enabled(device_type),
    )
    x, w_gate, b_gate = autocast_inputs(x, gate.weight, gate.bias)
    _, w_up, b_up = autocast_inputs(x, up.weight, up.bias)
    _, w_down, b_down = autocast_inputs(x, down.weight, down.bias)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    # The composition's call order (gate, up, down), so fresh seeds are drawn alike.
    ranks, seeds, estimators = layer_sketches(layers, x2d.shape[0])
    with torch.autocast(device_type, enabled=False):
        out = _SwigluMlpFn.apply(
            x2d, w_gate, b_gate, w_up, b_up, w_down, b_down, act, autocast,
            ranks, seeds, estimators, keep_gate,
        )
    return out.reshape(*lead, w_down.shape[0])
