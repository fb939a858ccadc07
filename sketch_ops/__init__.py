"""BASIS sketched linear layers: exact outputs and input gradients, a rank-R sketch for dW.

Public API:
- `SketchedLinear(in_features, out_features, bias=True, *, rank, name="")`: drop-in `nn.Linear`.
- `sketched_linear(x, weight, bias, *, rank, seed)`: the functional form.
- `sketch_model(model, *, rank, include=None) -> list[str]`: swap a model's `nn.Linear`s in place
  (`include="auto", probe_batch=...`: only those whose sketch frees memory, `probe.py`).
- `sketch_seed(seed, step, microbatch=0)`: context manager making sketches a pure function of
  (seed, step, microbatch, layer name).
- `gelu_mlp(fc, proj, x, *, norm=None, recompute=False)`: `proj(gelu(fc(norm(x))))` that, when
  proj is sketched (or `recompute`), keeps only x instead of the 4d-wide hidden activations
  (`fused.py`; the built-in GPT's MLP uses it).
- `norm_linear(norm, linear, x)`: `linear(norm(x))` keeping only the LayerNorm's input when the
  linear layer is exact (`norm_linear.py`; the built-in GPT's qkv and LM head use it).
- `swiglu_mlp(gate, up, down, act, x, *, recompute=None, keep_gate=KEEP_GATE)`:
  `down(act(gate(x)) * up(x))` that, when down is sketched (or `recompute`), keeps x and
  gate's output (or, `keep_gate=False`, only x) instead of four n × I tensors (`swiglu.py`);
  `fuse_swiglu_mlps(model, *, recompute=None, keep_gate=KEEP_GATE) -> list[str]` patches the
  forward of every such MLP of any model (matched by structure, verified by a probe).
- `rms_norm(x, weight, eps)`: Llama's RMSNorm keeping only x and one number per row
  (`rms_norm.py`); `fuse_rms_norms(model) -> list[str]` patches every such norm of any model.

The maths is in docs/design.md §4; `reference.py` is its executable specification, and
`fused_kernels.py` (a sketched layer's step in 5 launches and its share of the microbatch's
plans, `plan_cache.py`; no host sync) and `kernels.py` the CUDA (Triton) implementation, chosen
by `dispatch.py`. `cost.py` and `speed_plan.py` are what
`include="auto"` decides with beyond memory (`max_quality_cost`).
"""

from .function import sketched_linear
from .fused import gelu_mlp
from .layer import SketchedLinear
from .model import sketch_model
from .norm_linear import norm_linear
from .rms_norm import fuse_rms_norms, rms_norm
from .seeds import sketch_seed
from .swiglu import swiglu_mlp
from .swiglu_find import fuse_swiglu_mlps

__all__ = [
    "SketchedLinear",
    "fuse_rms_norms",
    "fuse_swiglu_mlps",
    "gelu_mlp",
    "norm_linear",
    "rms_norm",
    "sketch_model",
    "sketch_seed",
    "sketched_linear",
    "swiglu_mlp",
]
