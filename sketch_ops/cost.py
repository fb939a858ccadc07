"""What a sketch plan costs in time and in gradient quality: a roofline model and the BASIS error
formula, for `include="auto"` (`speed_plan.py`) and `baton sketch-plan`.

- `Rates(gemm_flops, bandwidth, launch_s, device, source, fused_path, itemsize)`: a device's
  sustained GEMM rate (FLOP/s in the training dtype), memory bandwidth (bytes/s), the cost of
  one more kernel launch (s), and their `source` ("modelled" from a datasheet table, "measured"
  here by a micro-benchmark, or "given"); `fused_path`: whether sketched layers take the fused
  kernels (CUDA) or the torch reference (more passes and ops).
- `device_rates(device, dtype)`: a known GPU (`KNOWN_GPUS`: peak dense rates ×
  `GEMM_EFFICIENCY`, bandwidth × `BANDWIDTH_EFFICIENCY`) is modelled; any other device measured
  once (a 1024² matmul and a 32 MiB copy, ~0.1 s) or, `measure=False` (a run's choice), modelled
  with nominal rates so that every rank and restart decides alike. `target_rates(name, dtype)`:
  a known GPU's rates by name, to plan for it from a CPU (`baton sketch-plan --target h100`).
- `layer_delta_s(rows, in_features, out_features, rank, itemsize, rates)`: the change of a
  step's time when one linear layer's dW is sketched: its dW GEMM (2·n·N·M FLOPs, or its bytes
  if memory-bound) replaced by the R-row GEMM (2·R·N·M), one pass over its input and one over
  its output gradient, and the launches the sketch adds (2 on the fused path, plans included;
  the reference path's ~45 small ops and 3 passes per direction). Negative: faster.
  `sketch_overhead_s(...)`: that delta's part besides the GEMMs.
- `count_flops(run)`: `(run(), FLOPs)`, the dense GEMM and attention FLOPs of what `run` ran
  (torch's `flop_registry`, CPU SDPA's added, causal attention halved, sparse operands skipped).
- `step_time_s(flops, traffic_bytes, rates, extra_s=0)`: a step's modelled time: FLOPs at the
  GEMM rate, other traffic at the bandwidth (`activation_traffic(exact_bytes, kept_bytes)`:
  `TRAFFIC_PASSES` over exact backprop's activation bytes, `RECOMPUTE_PASSES` over those
  recomputed), `extra_s` (the sketches' overheads), and a start-and-tail time per kernel of its
  `launches` (`launch_count.LaunchCounter`; on a GPU at least the host's launch time). A model,
  not a measurement: it leaves out the optimizer, the loss and communication.
- `relative_error(...)`: `E||dŴ - dW||² / ||dW||²` (docs/design.md §4) for one layer at rank R
  from the moments of X and dY (centred first for the centred estimator), without the invariant
  scalars; its square root is the relative RMS error `sketch.max_quality_cost` bounds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

GEMM_EFFICIENCY = 0.7  # sustained share of a datasheet's dense GEMM peak
BANDWIDTH_EFFICIENCY = 0.85  # sustained share of its memory bandwidth
GPU_LAUNCH_S = 6e-6  # the host's time to launch one kernel (eager PyTorch), a GPU
GPU_TAIL_S = 2e-6  # the device's time lost per kernel (start and tail), a GPU
CPU_OP_S = 10e-6  # one more op on the CPU (dispatch and a small kernel)
TRAFFIC_PASSES = 3  # passes over exact's activation bytes per step (module docstring)
RECOMPUTE_PASSES = 2  # an activation not kept is written and read again in backward
# A sketched layer's launches per step: 5, and its share of the 2 that draw the plans of the
# microbatch's k sketched layers together (`plan_cache`): 5 + 2/k against nn.Linear's 4.
FUSED_EXTRA_LAUNCHES = 2  # 1 + 2/k, for k >= 2
FUSED_SKETCH_LAUNCHES = 3  # of which the sketch's own per layer: sketch X, sketch dY, GEMM
FUSED_PLAN_LAUNCHES = 2  # per microbatch: one keys launch (up to 32 layers) and one sort
REFERENCE_EXTRA_OPS = 45  # the torch reference path's ~49 ops against nn.Linear's 4
REFERENCE_PASSES = 3  # passes over each sketched matrix on the reference path
T = TypeVar("T")
PLAN_BYTES_PER_ROW = 24  # keys, sort and order of the plan (int32 keys, int64 order, int32)
NOMINAL_CPU = (100e9, 10e9)  # FLOP/s and bytes/s of a CPU when it may not be measured
# Dense GEMM peak (FLOP/s) by dtype and memory bandwidth (bytes/s): SXM datasheets, no sparsity.
KNOWN_GPUS: dict[str, tuple[dict[torch.dtype, float], float]] = {
    "H200": ({torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12}, 4.8e12),
    "H100": ({torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12}, 3.35e12),
    "A100": ({torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12}, 2.04e12),
}


@dataclass(frozen=True)
class Rates:
    gemm_flops: float  # FLOP/s, sustained, in the training dtype
    bandwidth: float  # bytes/s, sustained
    launch_s: float  # seconds per extra kernel launch (or op, on the CPU)
    device: str
    source: str  # "modelled", "measured" or "given"
    fused_path: bool  # sketched layers take the fused kernels there
    itemsize: int = 4  # bytes per value of the training dtype the rates are for

    @property
    def asynchronous(self) -> bool:
        """A GPU runs kernels while the host launches the next: a step takes the longer of
        the two. A CPU runs each op as it is called."""
        return self.fused_path

    @property
    def tail_s(self) -> float:
        """The device's time lost per kernel."""
        return GPU_TAIL_S if self.asynchronous else self.launch_s

    def describe(self) -> str:
        return (f"{self.source}: {self.device}, GEMM {self.gemm_flops / 1e12:.3g} TFLOP/s, "
                f"memory {self.bandwidth / 1e9:.3g} GB/s, {self.launch_s * 1e6:.3g} µs per "
                f"launch ({self.tail_s * 1e6:.3g} µs on the device), sketches on the "
                f"{'fused' if self.fused_path else 'torch'} path")


def target_rates(name: str, dtype: torch.dtype) -> Rates:
    """A known GPU's modelled rates (`KNOWN_GPUS`, by a name containing its key)."""
    for key, (peaks, bandwidth) in KNOWN_GPUS.items():
        if key.lower() in name.lower():
            peak = peaks.get(dtype, peaks[torch.float32])
            return Rates(peak * GEMM_EFFICIENCY, bandwidth * BANDWIDTH_EFFICIENCY, GPU_LAUNCH_S,
                         key, "modelled", True, dtype.itemsize)
    raise ValueError(f"no rates for a GPU named {name!r}; known: "
                     f"{', '.join(k.lower() for k in KNOWN_GPUS)}")


def device_rates(device: torch.device, dtype: torch.dtype, *, measure: bool = True) -> Rates:
    """The rates of `device` for `dtype` (module docstring): modelled or measured; with
    `measure=False` never measured (a run's choice must not depend on timings, P1): an unknown
    GPU is modelled as an A100, a CPU by `NOMINAL_CPU`."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    if device.type == "cuda":
        with contextlib.suppress(ValueError):
            return target_rates(name, dtype)
    if measure:
        return _measured(device, dtype, name)
    if device.type == "cuda":
        return dataclasses.replace(target_rates("A100", dtype), device=f"{name} (as an A100)")
    flops, bandwidth = NOMINAL_CPU
    return Rates(flops, bandwidth, CPU_OP_S, "cpu (nominal)", "modelled", False, dtype.itemsize)


@cache
def _measured(device: torch.device, dtype: torch.dtype, name: str) -> Rates:
    """A 1024² matmul and a 32 MiB copy on `device`, best of 3 (once per process)."""
    size = 1024
    a = torch.randn(size, size, device=device).to(dtype)
    block = torch.empty(32 << 20, dtype=torch.uint8, device=device)

    def best(run: object) -> float:
        times = []
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run()  # type: ignore[operator]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return max(min(times), 1e-9)

    flops = 2 * size**3 / best(lambda: a @ a)
    bandwidth = 2 * block.numel() / best(block.clone)  # read and write
    on_gpu = device.type == "cuda"
    return Rates(flops, bandwidth, GPU_LAUNCH_S if on_gpu else CPU_OP_S, name, "measured",
                 on_gpu, dtype.itemsize)


def gemm_s(flops: float, nbytes: float, rates: Rates) -> float:
    """One GEMM's roofline time: compute-bound or memory-bound, whichever is slower."""
    return max(flops / rates.gemm_flops, nbytes / rates.bandwidth)


def layer_delta_s(rows: int, in_features: int, out_features: int, rank: int, itemsize: int,
                  rates: Rates) -> float:
    """The change of a step's time when this layer's dW is sketched (module docstring)."""
    n, width_in, width_out = rows, in_features, out_features
    r = max(1, min(rank, n))
    exact_dw = gemm_s(2 * n * width_in * width_out,
                      (n * (width_in + width_out) + width_in * width_out) * itemsize, rates)
    sketch_dw = gemm_s(2 * r * width_in * width_out,
                       (r * (width_in + width_out) + width_in * width_out) * itemsize, rates)
    return sketch_dw - exact_dw + sketch_overhead_s(n, width_in, width_out, itemsize, rates)


def sketch_overhead_s(rows: int, in_features: int, out_features: int, itemsize: int,
                      rates: Rates, *, launches: bool = True) -> float:
    """What a sketch adds besides its GEMM: its passes over X and dY, the plan, and (unless
    counted elsewhere) its extra launches."""
    passes = 1 if rates.fused_path else REFERENCE_PASSES
    traffic = passes * rows * (in_features + out_features) * itemsize + PLAN_BYTES_PER_ROW * rows
    return traffic / rates.bandwidth + (extra_launches(rates) * rates.launch_s if launches
                                        else 0.0)


def extra_launches(rates: Rates) -> int:
    """Launches (ops) a sketched layer adds to nn.Linear's on `rates`' path."""
    return FUSED_EXTRA_LAUNCHES if rates.fused_path else REFERENCE_EXTRA_OPS


class _FlopCount(TorchDispatchMode):
    """Dense GEMM and attention FLOPs of the ops run inside (torch's own formulas, plus CPU
    SDPA's; sparse operands, the reference sketch's bucket sums, are not GEMMs)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in args):
            return out
        if packet is torch.ops.aten.addmm_:  # in place: the same GEMM as addmm
            packet = torch.ops.aten.addmm
        if packet in flop_registry:
            self.total += flop_registry[packet](*args, **kwargs, out_val=out)
        elif packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
            flops = sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape)
            self.total += flops / 2 if _causal(args, kwargs, 4) else flops
        elif packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
            flops = sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape,
                                             args[3].shape)
            self.total += flops / 2 if _causal(args, kwargs, 7) else flops
        return out


def _causal(args: Any, kwargs: Any, index: int) -> bool:
    """A causal kernel skips the masked half of the scores."""
    return bool(kwargs.get("is_causal", args[index] if len(args) > index else False))


def count_flops(run: Callable[[], T]) -> tuple[T, float]:
    """`(run(), the dense GEMM and attention FLOPs it ran)`."""
    with _FlopCount() as counter:
        result = run()
    return result, counter.total


def activation_traffic(exact_bytes: float, kept_bytes: float) -> float:
    """Bytes a step moves besides its GEMMs: `TRAFFIC_PASSES` over exact backprop's activation
    bytes (what the step's elementwise ops write and read whatever is kept), plus
    `RECOMPUTE_PASSES` over what the configuration does not keep (recomputed in backward)."""
    return TRAFFIC_PASSES * exact_bytes + RECOMPUTE_PASSES * max(0.0, exact_bytes - kept_bytes)


def step_time_s(flops: float, traffic_bytes: float, rates: Rates, extra_s: float = 0.0,
                launches: int = 0) -> float:
    """A step's modelled time (module docstring)."""
    device = (flops / rates.gemm_flops + traffic_bytes / rates.bandwidth + extra_s
              + launches * rates.tail_s)
    return max(device, launches * rates.launch_s) if rates.asynchronous else device


def balanced_collision(n: int, rank: int) -> float:
    """p = P(two given rows share a bucket) for the balanced hash: (n/R - 1)/(n - 1)."""
    if rank >= n or n < 2:
        return 0.0
    return (n / rank - 1) / (n - 1)


def relative_error(n: int, rank: int, x_sq: float, dy_sq: float, grad_sq: float,
                   cross: float, exact_sq: float) -> float:
    """`E||dŴ - dW||² / ||dW||²` for one layer (module docstring): `x_sq`, `dy_sq` are the
    squared Frobenius norms of the (centred) X and dY, `grad_sq` that of their product
    `(centred X)ᵀ(centred dY)`, `cross` = Σ_i ||x_i||² ||dy_i||² over rows, and `exact_sq` the
    squared norm of the whole exact weight gradient (the estimate's target)."""
    variance = balanced_collision(n, rank) * max(0.0, x_sq * dy_sq + grad_sq - 2 * cross)
    if exact_sq <= 0:
        return 0.0 if variance == 0 else math.inf
    return variance / exact_sq
