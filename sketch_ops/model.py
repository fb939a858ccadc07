"""`sketch_model`: swap a model's selected `nn.Linear`s for `SketchedLinear`s; `auto_plan`.

- `sketch_model(model, *, rank, include=None, estimator="centered")` replaces `nn.Linear`
  modules in place by `SketchedLinear`s that reuse the same `Parameter` objects (an optimizer
  built before still points at them) and returns the replaced qualified names, in
  `named_modules` order. `rank` is one R for every selected layer, or a mapping from qualified
  name to R (`policy.ranks_for_budget`), which selects exactly its keys (each an `nn.Linear` the
  selection admits). `estimator`: `"centered"` (the default; about halves the gradient error on
  real activations: benchmarks/sketch_quality/run.py) or `"basis"` (docs/design.md §4 as
  written). Instead of `rank`, `memory_budget=B, rows=n` gives per-layer ranks whose sketches
  of an n-row microbatch fit in B bytes (`policy.py`).
  `include` (`policy.selector`, the one definition): None = every `nn.Linear`; `fnmatch` globs
  of qualified names; a callable `(name, module) -> bool`; or `"auto"`, which needs
  `probe_batch=` (one microbatch; `loss_fn=(model, batch) -> loss`, default the output's sum):
  `auto_plan` applies the structural fusions and probes one step, and only the layers whose
  sketch frees at least `min_saving` (`probe.MIN_SAVING`, 0.10) of the step's activation bytes
  per class of layers (e.g. every block's q/k/v) are swapped. Only exact `nn.Linear`s are
  candidates (not subclasses, which may not call `forward`: `MultiheadAttention.out_proj`).
- `auto_plan(model, probe_batch, *, rank, loss_fn=None, estimator="centered",
  min_saving=MIN_SAVING, keep_gate=KEEP_GATE)` patches the model's structures in place, matched
  by structure, values and gradients unchanged (`fuse_swiglu_mlps`: a gated MLP becomes one
  recomputing function keeping gate's output, or with `keep_gate=False` only its input, one
  matmul more: `swiglu.py`; `fuse_rms_norms`: an RMSNorm keeping only its input and 1/rms per
  row), then returns `probe.plan_sketch`'s `AutoPlan`, the patched names in `plan.fused`. With
  `max_quality_cost > 0` (default `MAX_QUALITY_COST`, 0) it also sketches the classes of layers
  the cost model predicts make the step faster on `rates`' device with a measured gradient
  error of at most `max_quality_cost` (`speed_plan.extend_for_speed`; `plan.speed` says why).

Call `sketch_model` before wrapping in DDP/FSDP (names without a wrapper prefix). Not in
`layer.py`: the fusions build on `SketchedLinear` and "auto" on them (no import cycle).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from .cost import Rates, device_rates
from .function import check_estimator, check_rank
from .layer import SketchedLinear
from .policy import AUTO, Include, ranks_for_budget, selector
from .probe import MIN_SAVING, AutoPlan, LossFn, plan_sketch
from .rms_norm import fuse_rms_norms
from .speed_plan import extend_for_speed
from .swiglu import KEEP_GATE
from .swiglu_find import fuse_swiglu_mlps

MAX_QUALITY_COST = 0.0  # "auto" sketches for memory only unless the user accepts a cost


def fuse_structures(model: nn.Module, *, keep_gate: bool = KEEP_GATE) -> list[str]:
    """Apply the structural fusions "auto" relies on; returns the patched module names."""
    return [*fuse_swiglu_mlps(model, keep_gate=keep_gate), *fuse_rms_norms(model)]


def auto_plan(
    model: nn.Module,
    probe_batch: Any,
    *,
    rank: int | Mapping[str, int],
    loss_fn: LossFn | None = None,
    estimator: str = "centered",
    min_saving: float = MIN_SAVING,
    keep_gate: bool = KEEP_GATE,
    max_quality_cost: float = MAX_QUALITY_COST,
    rates: Rates | None = None,
    quality_batch: Any = None,
) -> AutoPlan:
    """Fuse the model's structures in place, probe which layers to sketch for memory, then,
    with `max_quality_cost > 0`, which more for speed (`speed_plan`; `rates` default: the
    model's device's, `cost.device_rates`; the errors are measured on `quality_batch`,
    default `probe_batch`)."""
    check_max_quality_cost(max_quality_cost)
    fused = fuse_structures(model, keep_gate=keep_gate)
    plan = plan_sketch(model, probe_batch, rank=rank, loss_fn=loss_fn, estimator=estimator,
                       min_saving=min_saving)
    plan.fused = fused
    if max_quality_cost > 0:
        if rates is None:
            weight = next(model.parameters())
            rates = device_rates(weight.device, weight.dtype)
        batch = probe_batch if quality_batch is None else quality_batch
        plan.speed = extend_for_speed(model, batch, plan, rank=rank, loss_fn=loss_fn,
                                      estimator=estimator, rates=rates,
                                      max_quality_cost=max_quality_cost)
    return plan


def check_max_quality_cost(value: float) -> None:
    """Raise ValueError unless `value` is a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 <= value < float("inf")):
        raise ValueError(
            f"sketch: max_quality_cost must be a finite number >= 0 (the largest relative RMS "
            f"gradient error a layer sketched for speed may have; 0 sketches for memory only), "
            f"got {value!r}")


def sketch_model(
    model: nn.Module,
    *,
    rank: int | Mapping[str, int] | None = None,
    include: Include = None,
    estimator: str = "centered",
    memory_budget: int | None = None,
    rows: int | None = None,
    probe_batch: Any = None,
    loss_fn: LossFn | None = None,
    min_saving: float = MIN_SAVING,
    keep_gate: bool = KEEP_GATE,
    max_quality_cost: float = MAX_QUALITY_COST,
    rates: Rates | None = None,
    quality_batch: Any = None,
) -> list[str]:
    """Swap the selected `nn.Linear`s of `model` for `SketchedLinear`s; return their names.

    Give either `rank` or `memory_budget` (bytes of sketches per microbatch of `rows` rows,
    shared out by `policy.ranks_for_budget`). `include="auto"` needs `probe_batch`;
    `min_saving` is its threshold, `keep_gate` its SwiGLU mode, `max_quality_cost`, `rates`
    and `quality_batch` its speed rule (read only by "auto")."""
    check_estimator(estimator)
    if (rank is None) == (memory_budget is None):
        raise ValueError("sketch_model: give exactly one of rank= and memory_budget=")
    if isinstance(include, str) and include == AUTO:
        if probe_batch is None:
            raise ValueError(
                "sketch_model: include='auto' needs probe_batch= (one microbatch of the "
                "model's input, e.g. token ids (batch, seq)) for its probe step"
            )
        # Under a memory budget the ranks come after the choice: price each sketch at R = 1.
        include = auto_plan(model, probe_batch, rank=1 if rank is None else rank,
                            loss_fn=loss_fn, estimator=estimator,
                            min_saving=min_saving, keep_gate=keep_gate,
                            max_quality_cost=max_quality_cost, rates=rates,
                            quality_batch=quality_batch).include
    if memory_budget is not None:
        if rows is None:
            raise ValueError(
                "sketch_model: memory_budget= needs rows= (tokens per microbatch, the n of the "
                "sketch) to turn bytes into ranks"
            )
        rank = ranks_for_budget(model, memory_budget=memory_budget, rows=rows, include=include)
    assert rank is not None
    ranks = dict(rank) if isinstance(rank, Mapping) else None  # per layer, or
    uniform = 0 if isinstance(rank, Mapping) else rank  # one R for every layer
    for value in ranks.values() if ranks is not None else (uniform,):
        check_rank(value)
    select = selector(include)
    chosen = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and name
        and select(name, module)
        and (ranks is None or name in ranks)
    ]
    if ranks is not None:
        missing = sorted(set(ranks) - {name for name, _ in chosen})
        if missing:
            raise ValueError(
                f"sketch_model: rank names layers that are not selectable nn.Linear modules of "
                f"this model: {missing}; use qualified names from model.named_modules()"
            )
    for name, module in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer_rank = ranks[name] if ranks is not None else uniform
        sketched = SketchedLinear.from_linear(
            module, rank=layer_rank, name=name, estimator=estimator
        )
        setattr(parent, child, sketched)
    return [name for name, _ in chosen]
