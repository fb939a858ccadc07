"""`rms_norm`: Llama's RMSNorm keeping only its input and one number per row, and
`fuse_rms_norms`, which finds such norms in any model by their structure.

Contract:
- `rms_norm(x, weight, eps)` returns bitwise what Hugging Face's `LlamaRMSNorm` returns (the
  same ops: normalise in fp32, cast back to x's dtype, then `weight *`; so under autocast or
  with fp32 weights and bf16 inputs the result dtype is the promoted one, as there). When a
  backward will run it is one autograd function that saves x and the n per-row 1/rms values
  (fp32) — not the fp32 copy of x (for low-precision x) nor the n × d normalised rows the
  `weight *` product keeps for the weight gradient; backward recomputes them from x. Its
  gradients equal autograd's of the composition up to fp32 summation order.
- `fuse_rms_norms(model) -> list[str]` patches, in place, the `forward` of every module of
  `model` that has this structure: no children, exactly one parameter, a 1-D `weight` of size
  d, and a float `variance_epsilon` or `eps` attribute, whose own forward agrees (1e-6) with
  `rms_norm` on small random inputs in the weight's dtype and, for fp32 weights, in bf16 (this
  checks the cast-then-scale order too). Others (a `1 + weight` scale, another cast order, an
  `nn.RMSNorm` without eps) are left alone. Only the instance's `forward` changes; it returns
  the qualified names of the fused norms (already fused ones included), in `named_modules`
  order. Parameters must be materialised (meta modules are left alone).

What is kept where, in a Llama decoder layer with both fusions (`swiglu.py`): each norm keeps
its input (the residual stream, n × d) and n row statistics; the layer it feeds keeps the
norm's output — the MLP as its x, attention's q/k/v projections as their shared input. The norm
and the MLP stay separate functions: fusing the norm into the MLP would drop one n × d tensor
per layer, for a recompute of the norm in backward.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

PROBE_ROWS = 8  # rows of the random inputs that verify a structural match
PROBE_TOLERANCE = 1e-6
EPS_ATTRS = ("variance_epsilon", "eps")  # Hugging Face's name, then torch's


def _normalise(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(normalised rows in fp32, 1/rms per row (n × 1, fp32))`, with LlamaRMSNorm's ops."""
    x32 = x.to(torch.float32)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32 * rstd, rstd


class _RmsNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        normed, rstd = _normalise(x, eps)
        out = weight * normed.to(x.dtype)
        ctx.save_for_backward(x, rstd, weight)  # not normed: backward recomputes it from x
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, rstd, weight = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dx = dweight = None
        with torch.autocast(dout.device.type, enabled=False):  # the dtypes below are explicit
            normed = x.to(torch.float32) * rstd
            if need_dw:
                # The product's weight gradient, summed over every leading dimension.
                dweight = (dout * normed.to(x.dtype)).reshape(-1, weight.shape[0]).sum(0)
                dweight = dweight.to(weight.dtype)
            if need_dx:
                grad = (dout * weight).to(torch.float32)  # a fresh tensor: updated in place
                # d/dx of x·r, r = (mean(x²) + eps)^-½:  r (g − x̂ · mean(g x̂)), x̂ = x r,
                # as r g − x̂ (r mean(g x̂)), in place on g: fewer passes and temporaries.
                mean_dot = torch.linalg.vecdot(grad, normed).unsqueeze(-1) / x.shape[-1]
                dx = grad.mul_(rstd).addcmul_(normed, rstd * mean_dot, value=-1).to(x.dtype)
        return dx, dweight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's `weight * (x / rms(x))`, keeping only x and the row statistics."""
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"rms_norm: weight must be 1-D of the input's last dimension, got weight "
            f"{tuple(weight.shape)} for input {tuple(x.shape)}"
        )
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        out: torch.Tensor = _RmsNormFn.apply(x, weight, eps)
        return out
    return weight * _normalise(x, eps)[0].to(x.dtype)


# -- finding RMSNorms by structure -------------------------------------------------------------

_EPS_NAME_ATTR = "_rms_norm_eps_attr"  # which attribute holds a fused norm's eps


def _fused_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    assert isinstance(weight, torch.Tensor)  # matched: a 1-D weight
    return rms_norm(x, weight, getattr(self, getattr(self, _EPS_NAME_ATTR)))


def _eps_attr(module: nn.Module) -> str | None:
    """The name of the module's eps attribute when it has the RMSNorm structure, else None."""
    if any(True for _ in module.children()):
        return None
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    if len(params) != 1 or weight is None or weight.dim() != 1:
        return None
    if not weight.is_floating_point() or weight.device.type == "meta":
        return None
    for name in EPS_ATTRS:
        eps = getattr(module, name, None)
        if isinstance(eps, float) and not isinstance(eps, bool):
            return name
    return None


def _probe_agrees(module: nn.Module, eps: float) -> bool:
    """Whether the module's own forward equals `rms_norm` on random inputs (module docstring)."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    dtypes = [weight.dtype] + ([torch.bfloat16] if weight.dtype == torch.float32 else [])
    generator = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        x = torch.randn(PROBE_ROWS, weight.shape[0], generator=generator)
        x = x.to(device=weight.device, dtype=dtype)
        try:
            with torch.no_grad():
                want = module.forward(x)
            with torch.enable_grad():  # the autograd function itself
                got = rms_norm(x.detach().requires_grad_(), weight, eps).detach()
        except (RuntimeError, TypeError, ValueError):  # its forward is not this norm
            return False
        if not isinstance(want, torch.Tensor) or want.shape != got.shape:
            return False
        if want.dtype != got.dtype or not torch.allclose(
            got, want, rtol=PROBE_TOLERANCE, atol=PROBE_TOLERANCE
        ):
            return False
    return True


def fuse_rms_norms(model: nn.Module) -> list[str]:
    """Patch the forward of every RMSNorm of `model` (found by structure, verified by a probe)
    to `rms_norm`; return their qualified names (module docstring)."""
    fused = []
    for name, module in model.named_modules():
        if _EPS_NAME_ATTR in vars(module):  # fused before
            fused.append(name)
            continue
        eps_name = _eps_attr(module)
        if eps_name is not None and _probe_agrees(module, getattr(module, eps_name)):
            setattr(module, _EPS_NAME_ATTR, eps_name)
            module.forward = types.MethodType(_fused_forward, module)
            fused.append(name)
    return fused
