"""`swiglu_mlp`: a gated MLP `down(act(gate(x)) * up(x))` (Llama's SwiGLU) that keeps only x,
and `fuse_swiglu_mlps`, which finds such MLPs in any model by their structure.

Contract:
- `swiglu_mlp(gate, up, down, act, x, *, recompute=None, keep_gate=False)` returns
  `down(act(gate(x)) * up(x))`. When gate, up and down are each an `nn.Linear` or a
  `SketchedLinear` (biases optional), act is a parameter-free module acting on each row on its
  own (SiLU, any GELU; in practice elementwise), a backward will run, and `recompute` is True
  — or None (the default) and down is sketched — it is one row-blocked autograd function.
  Saved: x (n × d), down's R × I input sketch (plus the I-vector row mean for the centred
  estimator) when down is sketched, and the three seeds (one int64 tensor); no n × I tensor —
  with `keep_gate`, one: gate's output (its pre-activation), computed for all rows at once.
  Backward recomputes, per row block (`blocked.block_size`), up's output, gate's (unless
  kept) and the activation, and from them dX, the biases, each plain layer's exact dW (down's
  from the recomputed hidden rows) and each sketched layer's BASIS estimate (gate's and up's
  from block sketches of x and their output gradients). Its gradients equal the unfused
  composition's — the same sketches from the same per-layer seeds, dX and plain layers' dW
  exact — up to fp32 summation order; its output is the composition's up to the row blocking
  of the matmuls (bitwise for a single block). Otherwise it is the plain composition.
- `fuse_swiglu_mlps(model, *, recompute=None, keep_gate=False) -> list[str]` patches, in
  place, the `forward` of every module of `model` that has this structure: exactly four
  children, three linear layers (`nn.Linear` or `SketchedLinear`) of which two ("gate" and
  "up") map d → I and the third ("down") I → d, and one parameter-free module (the
  activation). The match is verified before patching: the module's own forward and
  `swiglu_mlp` must agree (1e-6) on a small random input; otherwise the module is left alone.
  Which of the two d → I layers is the gate is taken from their names ("gate" in the
  attribute name) when that agrees with the probe, else from the probe alone. Only the
  instance's `forward` changes (not its class, parameters or state_dict); the children are
  looked up at each call, so `sketch_model` may run before or after; fusing again sets the
  modes anew. Returns the qualified names of the fused modules (already fused ones included),
  in `named_modules` order. The probe runs under `no_grad` for the module's own forward and
  inside `sketch_seed`, so it draws nothing from torch's global generator; the model's
  parameters must be materialised (modules on the meta device are left alone).

Why: in a Llama MLP exact backprop keeps four n × I tensors (gate's output for the activation,
the activation's output and up's output for the product, the product for down's weight
gradient), I ≈ 2.7 d. Sketch down and only the activation's and product's inputs are still
needed, which backward recomputes from x: the MLP keeps x and an R × I sketch. When an RMSNorm
feeds the MLP (`rms_norm.py`), the norm keeps its own input and the MLP keeps the norm's output
(its x); the two stay separate functions, each keeping one n × d tensor.

The time it costs (per MLP, n·d·I multiply-adds per matmul): exact backprop runs 9 matmuls
(3 forward; backward: dHidden, down's dW, dX through gate and up, gate's and up's dW).
Recomputing around a sketched down runs 10 (the sketch replaces down's dW, backward adds gate
and up again) plus the sketches (O(n·I) each): ~10 % more MLP time on a CPU, where matmuls
are the step. `keep_gate` keeps gate's output (one n × I tensor more, 4 n·I bytes in fp32)
and recomputes only up: 9 matmuls, as exact — the saved dW pays for the recompute.

Under autocast x and the weights are cast to the autocast dtype (as the linear layers would),
the activation runs under the caller's autocast state and the product is cast to down's dtype
(as autocast casts down's input).
"""

from __future__ import annotations

import itertools
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import reference
from .blocked import (
    BlockInputSketch,
    BlockWeightGrad,
    block_size,
    layer_sketches,
    row_blocks,
    saved_sketch_weight_grad,
)
from .function import autocast_inputs, needs_sketch, validate
from .layer import SketchedLinear
from .seeds import sketch_seed

LAYER_TYPES = (nn.Linear, SketchedLinear)
PROBE_ROWS = 8  # rows of the random input that verifies a structural match
PROBE_TOLERANCE = 1e-6

AutocastState = tuple[str, torch.dtype, bool]  # (device type, dtype, enabled)


def _activate(act: nn.Module, pre: torch.Tensor, autocast: AutocastState) -> torch.Tensor:
    """`act(pre)` under the caller's autocast state (the fused function runs with it off)."""
    device_type, dtype, enabled = autocast
    with torch.autocast(device_type, dtype=dtype, enabled=enabled):
        return act(pre)


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
            BlockInputSketch(
                n, ranks[2], seeds[2], w_down.shape[1], estimators[2], x2d.device, acc, size
            )
            if ranks[2] > 0
            else None
        )
        # keep_gate: gate's pre-activation for all rows at once; it is saved for backward.
        gate_all = F.linear(x2d, w_gate, b_gate) if keep_gate else None
        for start, end in row_blocks(n, size):
            rows = x2d[start:end]
            gate_pre = gate_all[start:end] if gate_all is not None else F.linear(
                rows, w_gate, b_gate)
            gated = _activate(act, gate_pre, autocast)
            hidden = (gated * F.linear(rows, w_up, b_up)).to(w_down.dtype)
            del gated
            out[start:end] = F.linear(hidden, w_down, b_down)
            if down_sketch is not None:
                down_sketch.add(down_sketch.block_plan(start, end), hidden)
        hidden_hat = hidden_mean = None
        if down_sketch is not None:
            hidden_hat, hidden_mean = down_sketch.finish(x2d.dtype)
        # Seeds as a saved tensor: under activation checkpointing they then come from the
        # recompute together with the sketch (see function.py).
        seeds_t = torch.tensor(seeds, dtype=torch.int64)
        ctx.save_for_backward(
            x2d, w_gate, b_gate, w_up, b_up, w_down, hidden_hat, hidden_mean, seeds_t, gate_all
        )
        ctx.act, ctx.autocast, ctx.ranks, ctx.estimators = act, autocast, ranks, estimators
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2d, w_gate, b_gate, w_up, b_up, w_down, hidden_hat, hidden_mean, seeds_t, gate_all = (
            ctx.saved_tensors
        )
        need_dx, need_dwg, need_dbg, need_dwu, need_dbu, need_dwd, need_dbd = (
            ctx.needs_input_grad[:7]
        )
        n, acc, device = x2d.shape[0], reference.acc_dtype(dy.dtype), dy.device
        size = block_size(n, w_gate.shape[0], x2d.dtype, device)
        seeds = [int(s) for s in seeds_t]
        (rank_gate, rank_up, rank_down), estimators = ctx.ranks, ctx.estimators
        dy_sum = None  # column sums of dY: down's bias, and μdy when centred; one pass for both
        if need_dbd or (need_dwd and hidden_mean is not None):
            dy_sum = dy.sum(0, dtype=acc)
        dw_down = None
        if need_dwd and rank_down > 0:
            assert hidden_hat is not None  # saved in forward whenever down is sketched
            dw_down = saved_sketch_weight_grad(
                dy, dy_sum, hidden_hat, hidden_mean, n, rank_down, seeds[2]
            )
        # Down's exact dW from the recomputed hidden rows (recompute=True with a plain down).
        down_exact = (
            BlockWeightGrad(w_down.shape, 0, 0, "basis", n, device, acc, size)
            if need_dwd and rank_down == 0
            else None
        )
        gate_grad = (
            BlockWeightGrad(
                w_gate.shape, rank_gate, seeds[0], estimators[0], n, device, acc, size
            )
            if need_dwg
            else None
        )
        up_grad = (
            BlockWeightGrad(
                w_up.shape, rank_up, seeds[1], estimators[1], n, device, acc, size
            )
            if need_dwu
            else None
        )
        # Column sums of gate's and up's output gradients: their biases, and μdy for a centred
        # sketch; skipped when neither needs them (a Llama's plain, bias-free gate and up).
        dgate_sum = (
            torch.zeros(w_gate.shape[0], dtype=acc, device=device)
            if need_dbg or (need_dwg and rank_gate > 0 and estimators[0] == "centered")
            else None
        )
        dup_sum = (
            torch.zeros(w_up.shape[0], dtype=acc, device=device)
            if need_dbu or (need_dwu and rank_up > 0 and estimators[1] == "centered")
            else None
        )
        dx = torch.empty(x2d.shape, dtype=dy.dtype, device=device) if need_dx else None
        for start, end in row_blocks(n, size):
            rows, dy_rows = x2d[start:end], dy[start:end]
            up = F.linear(rows, w_up, b_up)
            gate_pre = (gate_all[start:end].detach() if gate_all is not None
                        else F.linear(rows, w_gate, b_gate)).requires_grad_()  # a leaf
            with torch.enable_grad():  # the activation's derivative, whatever the activation
                gated = _activate(ctx.act, gate_pre, ctx.autocast)
            if down_exact is not None:
                down_exact.add(start, end, dy_rows, (gated.detach() * up).to(w_down.dtype))
            dhidden = dy_rows @ w_down
            dup = (dhidden * gated.detach()).to(up.dtype)
            (dgate,) = torch.autograd.grad(gated, gate_pre, (dhidden * up).to(gated.dtype))
            del gated, gate_pre, dhidden, up
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
            None if gate_grad is None else gate_grad.finish(dgate_sum).to(w_gate.dtype),
            dgate_sum.to(dy.dtype) if dgate_sum is not None and need_dbg else None,
            None if up_grad is None else up_grad.finish(dup_sum).to(w_up.dtype),
            dup_sum.to(dy.dtype) if dup_sum is not None and need_dbu else None,
            None if dw_down is None else dw_down.to(w_down.dtype),
            None if dy_sum is None or not need_dbd else dy_sum.to(dy.dtype),
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
    keep_gate: bool = False,
) -> torch.Tensor:
    """`down(act(gate(x)) * up(x))`, fused and row-blocked (keeping only x, and gate's output
    when `keep_gate`) when `recompute` is True, or None and down is a SketchedLinear (module
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


# -- finding SwiGLU MLPs by structure ---------------------------------------------------------

_PARTS_ATTR = "_swiglu_parts"  # the (gate, up, down, act) child names of a fused module
_RECOMPUTE_ATTR = "_swiglu_recompute"
_KEEP_GATE_ATTR = "_swiglu_keep_gate"


def _fused_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up, down, act = (getattr(self, name) for name in getattr(self, _PARTS_ATTR))
    return swiglu_mlp(gate, up, down, act, x, recompute=getattr(self, _RECOMPUTE_ATTR),
                      keep_gate=getattr(self, _KEEP_GATE_ATTR))


def _candidate_parts(module: nn.Module) -> list[tuple[str, str, str, str]]:
    """The (gate, up, down, act) child-name assignments the shapes allow, name hints first."""
    children = dict(module.named_children())
    linears = {k: m for k, m in children.items() if type(m) in LAYER_TYPES}
    others = [k for k in children if k not in linears]
    if len(linears) != 3 or len(others) != 1:
        return []
    act = others[0]
    if any(True for _ in children[act].parameters()):
        return []
    found = []
    for gate, up, down in itertools.permutations(linears, 3):
        g, u, d = linears[gate], linears[up], linears[down]
        assert isinstance(g, nn.Linear) and isinstance(u, nn.Linear) and isinstance(d, nn.Linear)
        if (
            g.in_features == u.in_features == d.out_features
            and g.out_features == u.out_features == d.in_features
        ):
            found.append((gate, up, down, act))

    def hint_misses(parts: tuple[str, str, str, str]) -> int:
        gate, up, down, _ = (p.lower() for p in parts)
        return ("gate" not in gate) + ("up" not in up) + ("down" not in down)

    return sorted(found, key=hint_misses)  # stable: permutation order breaks ties


def _probe_agrees(module: nn.Module, parts: tuple[str, str, str, str]) -> bool:
    """Whether the module's own forward equals `swiglu_mlp` with these parts on a random input."""
    gate, up, down, act = (getattr(module, name) for name in parts)
    weight = gate.weight
    if weight.device.type == "meta" or not weight.is_floating_point():
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, gate.in_features, generator=generator)
    x = x.to(device=weight.device, dtype=weight.dtype)
    try:
        with torch.no_grad():
            want = module.forward(x)
        # The fused function itself (recompute=True), with grad on so it really runs; inside
        # sketch_seed so sketched layers draw no seed from the global generator.
        with torch.enable_grad(), sketch_seed(0, 0):
            got = swiglu_mlp(gate, up, down, act, x.detach().requires_grad_(), recompute=True)
    except (RuntimeError, TypeError, ValueError):  # its forward is not this composition
        return False
    if not isinstance(want, torch.Tensor) or want.shape != got.shape or want.dtype != got.dtype:
        return False
    return torch.allclose(got.detach(), want, rtol=PROBE_TOLERANCE, atol=PROBE_TOLERANCE)


def fuse_swiglu_mlps(
    model: nn.Module, *, recompute: bool | None = None, keep_gate: bool = False
) -> list[str]:
    """Patch the forward of every SwiGLU MLP of `model` (found by structure, verified by a
    probe) to `swiglu_mlp`; return their qualified names (module docstring)."""
    fused = []
    for name, module in model.named_modules():
        if _PARTS_ATTR in vars(module):  # fused before: only the recompute mode changes
            setattr(module, _RECOMPUTE_ATTR, recompute)
            setattr(module, _KEEP_GATE_ATTR, keep_gate)
            fused.append(name)
            continue
        for parts in _candidate_parts(module):
            if _probe_agrees(module, parts):
                setattr(module, _PARTS_ATTR, parts)
                setattr(module, _RECOMPUTE_ATTR, recompute)
                setattr(module, _KEEP_GATE_ATTR, keep_gate)
                module.forward = types.MethodType(_fused_forward, module)
                fused.append(name)
                break
    return fused
