"""What `sketch.include = "auto"` sketches in a recipe's model, measured on one CPU step
(`baton sketch-plan`, `trainer.cli.sketch_plan`, prints it).

Contract: `plan_and_measure(cfg, batch, rank, rates)` builds the recipe's model exactly as a
run builds it before sketching (`trainer.train.model_build.build_model`, seeded), measures one
training step of it through the run's loss on `batch` (exact backprop; and exact with the
MLPs recomputed, `mlp_recompute = "always"` or a Hugging Face model's SwiGLU MLPs fused with
`recompute=True`), applies "auto" (`sketch_ops.model.auto_plan`: the structural fusions, then
the probe; `rank` None: the recipe's `sketch.memory_budget_mib` sets per-layer ranks) and
measures the sketched step again: a `PlanReport` of activation bytes, FLOPs and kernel
launches (`measure_step`) per configuration. `rates` (`sketch_ops.cost.Rates`) are the ones
the step times are predicted with, and auto's speed rule's when the recipe sets
`sketch.max_quality_cost` (modelled rates stand in for a run's timings, as in a run).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from trainer.config import FitConfig

MIB = 2**20


def train_dtype(cfg: FitConfig) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision.dtype,
                                                               torch.float32)


@dataclasses.dataclass
class Measured:
    """One configuration's step, as probed: activation bytes and GEMM/attention FLOPs."""

    saved_bytes: int
    flops: float
    launches: int  # device kernels of the step (aten ops and Triton launches)
    sketch_launches: int = 0  # of which in the torch reference's sketch functions


@dataclasses.dataclass
class PlanReport:
    plan: Any  # sketch_ops.probe.AutoPlan
    rows: int
    ranks: dict[str, int]  # the sketched layers' R
    exact_bytes: int  # the model as built (no fusions, no sketches), measured
    measured_bytes: int  # the model with the plan applied, measured
    recipe_layers: list[str] | None  # what the recipe's own include selects, when not auto
    min_saving: float  # the recipe's sketch.min_saving and sketch.keep_gate
    keep_gate: bool
    max_quality_cost: float = 0.0
    rates: Any = None  # sketch_ops.cost.Rates the times are predicted with
    itemsize: int = 4  # bytes per value in the training dtype
    steps: dict[str, Measured | None] = dataclasses.field(default_factory=dict)


def plan_and_measure(cfg: FitConfig, batch: torch.Tensor, rank: int | None,
                     rates: Any = None) -> PlanReport:
    """Build the recipe's model, measure exact backprop (and exact recompute), apply "auto",
    measure again; `rates` (`sketch_ops.cost.Rates`) predict the step times and are auto's
    speed rule's when the recipe sets `sketch.max_quality_cost`."""
    from sketch_ops import SketchedLinear, auto_plan, selector, sketch_model, sketch_seed
    from trainer.train.model import SKETCH_LAYERS
    from trainer.train.model_build import build_model, loss_function, speed_args

    exact_cfg = dataclasses.replace(cfg, sketch=dataclasses.replace(
        cfg.sketch, rank=0, memory_budget_mib=0.0))
    model = build_model(exact_cfg)
    loss = loss_function(cfg)

    def step(model: nn.Module) -> torch.Tensor:
        return loss(model, batch)

    recipe_layers = None
    include = cfg.sketch.include or (SKETCH_LAYERS if not cfg.model.is_hf else "auto")
    if include != "auto":
        select = selector(include)
        recipe_layers = [n for n, m in model.named_modules()
                         if type(m) is nn.Linear and n and select(n, m)]
    gpu = _gpu_dtype(rates)
    exact = measure_step(model, step, gpu)
    recompute = _exact_recompute(exact_cfg, step, gpu)
    speed: dict[str, Any] = {}
    if cfg.sketch.max_quality_cost > 0:
        speed = speed_args(cfg, model, batch.shape)  # a run's rates on this machine ...
        if rates is not None and rates.source == "modelled":
            speed["rates"] = rates  # ... or --target's: never timings, as in a run
    plan = auto_plan(model, batch, rank=1 if rank is None else rank, loss_fn=loss,
                     estimator=cfg.sketch.estimator, min_saving=cfg.sketch.min_saving,
                     keep_gate=cfg.sketch.keep_gate, **speed)
    if rank is not None:
        sketch_model(model, rank=rank, include=plan.include, estimator=cfg.sketch.estimator)
    elif plan.sketched:
        sketch_model(model, memory_budget=int(cfg.sketch.memory_budget_mib * MIB),
                     rows=plan.rows, include=plan.include, estimator=cfg.sketch.estimator)
    ranks = {name: module.rank for name, module in model.named_modules()
             if isinstance(module, SketchedLinear)}
    with sketch_seed(cfg.seed, 0):
        planned = measure_step(model, step, gpu)
    return PlanReport(plan, int(batch.numel()), ranks, exact.saved_bytes, planned.saved_bytes,
                      recipe_layers, cfg.sketch.min_saving, cfg.sketch.keep_gate,
                      cfg.sketch.max_quality_cost, rates, train_dtype(cfg).itemsize,
                      {"exact": exact, "exact recompute": recompute, "plan": planned})


def _exact_recompute(exact_cfg: FitConfig, step: Any, gpu: torch.dtype | None
                     ) -> Measured | None:
    """Exact backprop with the MLPs recomputed in backward: the built-in GPT's
    `mlp_recompute = "always"`, a Hugging Face model's SwiGLU MLPs fused with `recompute=True`
    (and its RMSNorms fused, as "auto" does); None for a `model_factory` model."""
    from sketch_ops import fuse_rms_norms, fuse_swiglu_mlps
    from trainer.train.model_build import build_model

    if exact_cfg.model_factory is not None:
        return None
    if exact_cfg.model.is_hf:
        model = build_model(exact_cfg)
        fuse_swiglu_mlps(model, recompute=True, keep_gate=exact_cfg.sketch.keep_gate)
        fuse_rms_norms(model)
    else:
        model = build_model(dataclasses.replace(exact_cfg, model=dataclasses.replace(
            exact_cfg.model, mlp_recompute="always")))
    return measure_step(model, step, gpu)


def _gpu_dtype(rates: Any) -> torch.dtype | None:
    """For rates of a GPU (the fused path), a dtype of their size: the blocks to count with."""
    if rates is None or not rates.fused_path:
        return None
    return torch.bfloat16 if rates.itemsize == 2 else torch.float32


def measure_step(model: nn.Module, step: Any, gpu: torch.dtype | None = None) -> Measured:
    """One step of `model`: its activation bytes, FLOPs and kernel launches (with `gpu`, the
    fused MLPs walk a GPU's row blocks for data of that dtype, so the launches are a GPU's)."""
    import contextlib

    from sketch_ops import SKETCH_SCOPES, LaunchCounter, count_flops, gpu_blocks, saved_bytes

    for param in model.parameters():
        param.grad = None  # every step alike: no accumulation into an earlier step's grads
    blocks = gpu_blocks(gpu) if gpu is not None else contextlib.nullcontext()
    with blocks, LaunchCounter(SKETCH_SCOPES) as launches:
        saved, flops = count_flops(lambda: saved_bytes(lambda: step(model), model))
    return Measured(saved, flops, launches.total + launches.sketch_scoped,
                    launches.sketch_scoped)
