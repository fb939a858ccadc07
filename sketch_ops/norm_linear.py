"""`norm_linear`: `linear(norm(x))` for a LayerNorm feeding a linear layer, keeping only what the
LayerNorm keeps anyway.

Contract: `norm_linear(norm, linear, x)` returns `linear(norm(x))`. When `norm` is an
`nn.LayerNorm` over the last dimension, `linear` a plain `nn.Linear`, autocast is off and a
backward will run, it is one autograd function that saves x (the LayerNorm's input, which
`nn.LayerNorm` saves too) and not the n × N normalised rows the linear layer would keep for its
weight gradient: backward recomputes them from x (one elementwise pass over n × N). Values are
bitwise those of the composition; gradients equal its gradients up to fp32 summation order.
In every other case (a `SketchedLinear`, whose backward never reads its input; other norms;
autocast; no backward) it is the plain composition.

Why: in a pre-norm transformer every norm feeds a linear layer (attention's qkv, the MLP's fc,
the LM head), and unfused both keep an n × N tensor: the norm its input, the linear layer the
norm's output. Fused, one is kept. This saves memory for exact backprop, and it makes an exact
layer behind a norm cost no more memory than a sketched one, so BASIS need not sketch it (see
`trainer.train.model.SKETCH_LAYERS`).

`layer_norm_rows` and `layer_norm_rows_backward` are the LayerNorm forward and backward on
n × N rows; the fused MLP (`fused.py`) uses them to take a norm in front as well.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn


def fusable_norm(norm: nn.Module | None) -> TypeGuard[nn.LayerNorm]:
    """Whether `norm` is a LayerNorm over the last dimension (what the fused paths handle)."""
    return type(norm) is nn.LayerNorm and len(norm.normalized_shape) == 1


def layer_norm_rows(
    x2d: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(normalised rows, row means, row 1/std)`, exactly as `F.layer_norm` computes them."""
    return torch.native_layer_norm(x2d, (x2d.shape[1],), weight, bias, eps)


def layer_norm_rows_backward(
    grad: torch.Tensor,
    x2d: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """LayerNorm's `(dx, d weight, d bias)` from the gradient of its output; `needs` says which
    of the three to compute (a missing weight or bias gets None)."""
    mask = [needs[0], needs[1] and weight is not None, needs[2] and bias is not None]
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        grad, x2d, [x2d.shape[1]], mean, rstd, weight, bias, mask
    )
    return (dx if mask[0] else None, dw if mask[1] else None, db if mask[2] else None)


class _NormLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x2d: torch.Tensor,
        norm_weight: torch.Tensor | None,
        norm_bias: torch.Tensor | None,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        normed, mean, rstd = layer_norm_rows(x2d, norm_weight, norm_bias, eps)
        out = F.linear(normed, weight, bias)
        # Not `normed`: backward recomputes it from x, which is the point of the fusion.
        ctx.save_for_backward(x2d, mean, rstd, norm_weight, norm_bias, weight)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x2d, mean, rstd, norm_weight, norm_bias, weight = ctx.saved_tensors
        need_x, need_nw, need_nb, need_w, need_b = ctx.needs_input_grad[:5]
        dweight = dbias = dx = dnw = dnb = None
        if need_w:
            normed = layer_norm_rows(x2d, norm_weight, norm_bias, ctx.eps)[0]
            dweight = dout.t() @ normed
            del normed
        if need_b:
            dbias = dout.sum(0)
        if need_x or need_nw or need_nb:
            dnormed = dout @ weight
            dx, dnw, dnb = layer_norm_rows_backward(
                dnormed, x2d, mean, rstd, norm_weight, norm_bias, (need_x, need_nw, need_nb)
            )
        return dx, dnw, dnb, dweight, dbias, None


def norm_linear(norm: nn.Module, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`linear(norm(x))`; fused (keeping only x) for a LayerNorm and a plain `nn.Linear`."""
    fusable = (
        fusable_norm(norm)
        and type(linear) is nn.Linear
        and torch.is_grad_enabled()
        and not torch.is_autocast_enabled(x.device.type)
    )
    params = (norm.weight, norm.bias, linear.weight, linear.bias) if fusable else ()
    if not fusable or not any(t is not None and t.requires_grad for t in (x, *params)):
        return linear(norm(x))
    if x.shape[-1] != linear.in_features:
        raise ValueError(
            f"norm_linear: input's last dimension must equal in_features={linear.in_features}, "
            f"got input shape {tuple(x.shape)}"
        )
    lead = x.shape[:-1]
    out = _NormLinearFn.apply(x.reshape(-1, x.shape[-1]), *params, norm.eps)
    return out.reshape(*lead, linear.out_features)
