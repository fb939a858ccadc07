"""`fuse_swiglu_mlps`: find the gated MLPs of any model by their structure and route their
forward through `swiglu.swiglu_mlp`.

Contract:
- `fuse_swiglu_mlps(model, *, recompute=None, keep_gate=KEEP_GATE) -> list[str]` patches, in
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
"""

from __future__ import annotations

import itertools
import types

import torch
from torch import nn

from .seeds import sketch_seed
from .swiglu import KEEP_GATE, LAYER_TYPES, swiglu_mlp

PROBE_ROWS = 8  # rows of the random input that verifies a structural match
PROBE_TOLERANCE = 1e-6

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
    model: nn.Module, *, recompute: bool | None = None, keep_gate: bool = KEEP_GATE
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
