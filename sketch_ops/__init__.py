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

What `trainer` uses besides: `auto_plan`, `selector`, `ESTIMATORS`, `LaunchCounter`,
`saved_bytes`, `gpu_blocks` and the cost model (`cost.py`: `device_rates`, `step_time_s`, ...).

The maths is in docs/design.md §4; `reference.py` is its executable specification, and
`fused_kernels.py` (a sketched layer's step in 5 launches and its share of the microbatch's
plans, `plan_cache.py`; no host sync) and `kernels.py` the CUDA (Triton) implementation, chosen
by `dispatch.py`. `cost.py` and `speed_plan.py` are what
`include="auto"` decides with beyond memory (`max_quality_cost`).
"""

from __future__ import annotations

from sketch_ops.blocked import gpu_blocks
from sketch_ops.cost import (
    FUSED_PLAN_LAUNCHES,
    FUSED_SKETCH_LAUNCHES,
    activation_traffic,
    count_flops,
    device_rates,
    sketch_overhead_s,
    step_time_s,
    target_rates,
)
from sketch_ops.function import ESTIMATORS, sketched_linear
from sketch_ops.fused import gelu_mlp
from sketch_ops.launch_count import SKETCH_SCOPES, LaunchCounter
from sketch_ops.layer import SketchedLinear
from sketch_ops.memory import saved_bytes
from sketch_ops.model import auto_plan, sketch_model
from sketch_ops.norm_linear import norm_linear
from sketch_ops.policy import selector
from sketch_ops.rms_norm import fuse_rms_norms, rms_norm
from sketch_ops.seeds import sketch_seed
from sketch_ops.swiglu import swiglu_mlp
from sketch_ops.swiglu_find import fuse_swiglu_mlps

__all__ = ["ESTIMATORS", "FUSED_PLAN_LAUNCHES", "FUSED_SKETCH_LAUNCHES", "LaunchCounter",
           "SKETCH_SCOPES", "SketchedLinear", "activation_traffic", "auto_plan", "count_flops",
           "device_rates", "fuse_rms_norms", "fuse_swiglu_mlps", "gelu_mlp", "gpu_blocks",
           "norm_linear", "rms_norm", "saved_bytes", "selector", "sketch_model",
           "sketch_overhead_s", "sketch_seed", "sketched_linear", "step_time_s", "swiglu_mlp",
           "target_rates"]
