"""Sketching for speed: the layers `include="auto"` adds when their sketch makes the step faster
at a gradient error the user accepts (`max_quality_cost`).

Contract: `extend_for_speed(model, batch, plan, *, rank, loss_fn, estimator, rates,
max_quality_cost)` takes the memory plan of `probe.plan_sketch` and, for every class of layers
it leaves exact (the same names up to block indices, e.g. every block's q_proj), decides from
- time: the modelled change of the step's time when each of its layers' weight gradients is
  sketched at its rank (`cost.layer_delta_s` with the device's `rates`, from the shapes the
  layers ran with), summed over the class; and
- quality: each layer's relative RMS gradient error sqrt(E||dŴ - dW||²)/||dW|| at its rank,
  from the formula of docs/design.md §4 evaluated on the probe batch's own X and dY
  (`cost.relative_error`; centred moments for the centred estimator), the largest in the
  class;
to sketch the class when the sketch is faster and its error is at most `max_quality_cost`.
Chosen layers become "sketch" in the plan ("for speed: ..."), their freed bytes negative (the
sketch's cost: their inputs are kept anyway); every class left exact adds why to its reason.
It returns the `SpeedChoice` of every class it judged, chosen or not. A class with a layer that
did not run as exactly one linear call in the step is never chosen (its error was not
measured).

How the error is measured: one more training step on `batch` with every candidate swapped for a
`nn.Linear` subclass that computes exactly what `nn.Linear` does and records the moments in its
backward. The fused functions take only plain `nn.Linear`s, so during that step they run as
their plain compositions and every candidate runs as a module. The model is left as it was
(`probe._state_restored`: grads, buffers, RNG). `max_quality_cost = 0` (the default) never
calls this: the memory plan is unchanged.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .cost import Rates, layer_delta_s, relative_error
from .function import autocast_inputs
from .probe import MEAN_BYTES, SEED_BYTES, AutoPlan, LossFn, _state_restored, default_loss
from .seeds import effective_rank


@dataclass
class LayerStats:
    rows: int = 0
    in_features: int = 0
    out_features: int = 0
    itemsize: int = 4
    calls: int = 0
    error_sq: float = math.nan  # E||dŴ - dW||² / ||dW||² at the layer's rank


@dataclass
class SpeedChoice:
    key: str  # the class: names with block indices as "#"
    names: list[str]
    delta_s: float  # modelled change of the step's time when sketched (negative: faster)
    error: float  # the largest relative RMS gradient error in the class (nan: not measured)
    chosen: bool
    reason: str = ""
    stats: dict[str, LayerStats] = field(default_factory=dict)


def class_key(name: str) -> str:
    return re.sub(r"\.\d+\.", ".#.", name)


class _CaptureFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                record: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
                ) -> torch.Tensor:
        ctx.save_for_backward(x2d, weight)
        ctx.record = record
        return F.linear(x2d, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2d, weight = ctx.saved_tensors
        dw = dy.t() @ x2d
        ctx.record(x2d, dy, dw)
        db = dy.sum(0) if ctx.needs_input_grad[2] else None
        return dy @ weight, dw, db, None


class _Measured(nn.Linear):
    """`nn.Linear` (same parameters) whose backward records its moments: a subclass, so the
    fused functions run it as a module."""

    record: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, weight, bias = autocast_inputs(x, self.weight, self.bias)
        with torch.autocast(x.device.type, enabled=False):
            out = _CaptureFn.apply(x.reshape(-1, x.shape[-1]), weight, bias, self.record)
        return out.reshape(*x.shape[:-1], weight.shape[0])


def _recorder(stats: LayerStats, rank: int, centred: bool
              ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    def record(x2d: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor) -> None:
        stats.calls += 1
        n = x2d.shape[0]
        stats.rows, stats.in_features, stats.out_features = n, x2d.shape[1], dy.shape[1]
        stats.itemsize = x2d.element_size()
        x, g = x2d.double(), dy.double()
        if centred:
            x, g = x - x.mean(0), g - g.mean(0)
        stats.error_sq = relative_error(
            n, effective_rank(rank, n), x.square().sum().item(), g.square().sum().item(),
            (g.t() @ x).square().sum().item(),
            (x.square().sum(1) * g.square().sum(1)).sum().item(),
            dw.double().square().sum().item())
    return record


def measure(model: nn.Module, batch: Any, names: list[str], rank_of: Callable[[str], int],
            loss_fn: LossFn | None, centred: bool) -> dict[str, LayerStats]:
    """One step with `names` swapped for `_Measured` (module docstring)."""
    stats = {name: LayerStats() for name in names}
    originals: dict[str, nn.Module] = {name: model.get_submodule(name) for name in names}
    with _state_restored(model):
        try:
            for name, linear in originals.items():
                assert isinstance(linear, nn.Linear)  # the candidates are plain nn.Linears
                measured = _Measured(linear.in_features, linear.out_features,
                                     linear.bias is not None, device="meta")
                measured.weight, measured.bias = linear.weight, linear.bias  # shared, no copy
                measured.record = _recorder(stats[name], rank_of(name), centred)
                _set(model, name, measured)
            (loss_fn or default_loss)(model, batch).backward()
        finally:
            for name, linear in originals.items():
                _set(model, name, linear)
    return stats


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def extend_for_speed(model: nn.Module, batch: Any, plan: AutoPlan, *,
                     rank: int | Mapping[str, int], loss_fn: LossFn | None, estimator: str,
                     rates: Rates, max_quality_cost: float) -> list[SpeedChoice]:
    """Add to `plan` the classes whose sketch is faster within `max_quality_cost` (module
    docstring); return every judged class."""
    def rank_of(name: str) -> int:
        return rank if isinstance(rank, int) else rank.get(name, 1)

    candidates = [layer.name for layer in plan.layers if layer.decision != "sketch"
                  and type(model.get_submodule(layer.name)) is nn.Linear]
    stats = measure(model, batch, candidates, rank_of, loss_fn, estimator == "centered")
    classes: dict[str, list[str]] = {}
    for name in candidates:
        classes.setdefault(class_key(name), []).append(name)
    choices = [judge(key, names, stats, rank_of, rates, max_quality_cost)
               for key, names in classes.items()]
    by_name = {layer.name: layer for layer in plan.layers}
    for choice in choices:
        for name in choice.names:
            layer, layer_stats = by_name[name], stats[name]
            layer.reason = (f"for speed: {choice.reason}" if choice.chosen
                            else f"{layer.reason}; {choice.reason}")
            if choice.chosen:
                layer.decision = "sketch"
                mean = layer_stats.in_features * MEAN_BYTES if estimator == "centered" else 0
                layer.freed_bytes = -(effective_rank(rank_of(name), layer_stats.rows)
                                      * layer_stats.in_features * layer_stats.itemsize
                                      + mean + SEED_BYTES)
    return choices


def judge(key: str, names: list[str], stats: Mapping[str, LayerStats],
          rank_of: Callable[[str], int], rates: Rates, max_quality_cost: float) -> SpeedChoice:
    """The decision for one class from its layers' measured shapes and errors (pure: the tests
    inject `stats` and `rates`)."""
    members = [stats[name] for name in names]
    if any(s.calls != 1 for s in members):
        return SpeedChoice(key, names, 0.0, math.nan, False,
                           "not one linear call per step: its error is not measured",
                           dict(stats))
    # The training dtype's size: a CPU probe may run in fp32 for a bf16 run on a GPU.
    delta = sum(layer_delta_s(s.rows, s.in_features, s.out_features, rank_of(name),
                              rates.itemsize, rates)
                for name, s in zip(names, members, strict=True))
    error = max(math.sqrt(s.error_sq) for s in members)
    chosen = delta < 0 and error <= max_quality_cost
    timing = (f"{'faster' if delta < 0 else 'slower'} by {abs(delta) * 1e6:.3g} µs per step "
              f"sketched ({rates.source} rates)")
    quality = (f"gradient error {error:.2f} {'<=' if error <= max_quality_cost else '>'} "
               f"max_quality_cost {max_quality_cost:g}")
    return SpeedChoice(key, names, delta, error, chosen, f"{timing}, {quality}",
                       {n: stats[n] for n in names})
