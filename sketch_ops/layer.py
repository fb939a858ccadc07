"""`SketchedLinear`, a drop-in `nn.Linear` trained with BASIS, and `sketch_model`.

Contract:
- `SketchedLinear(in_features, out_features, bias=True, *, rank, name="", estimator=...)`
  subclasses `nn.Linear`: same parameters, same `state_dict` keys (`weight`, `bias`), same
  init, same output. Only its weight gradient differs (see `function.py`). Its sketch seed is
  `layer_seed(name)`: inside `sketch_seed(...)` a pure function of (seed, step, microbatch,
  name); outside, fresh randomness per call. Layers that share a name share their sketch, so
  give each layer its own (`sketch_model` uses the module's qualified name).
- `sketch_model(model, *, rank, include=None, estimator="centered")` replaces `nn.Linear`
  modules in place by `SketchedLinear`s that reuse the same `Parameter` objects (an optimizer built
  before still points at them) and returns the replaced qualified names, in `named_modules`
  order. `rank` is one R for every selected layer, or a mapping from qualified name to R (the
  per-layer ranks of `policy.ranks_for_budget`); a mapping selects exactly its keys, each of
  which must name an `nn.Linear` the selection admits. `estimator` is `"centered"` (the default:
  it halves the gradient error on real activations, benchmarks/sketch_quality.py) or
  `"basis"` (DESIGN.md §4 as written); see `function.py`. Instead of `rank`,
  `memory_budget=B, rows=n` gives per-layer ranks whose sketches of an n-row microbatch fit in
  B bytes (`policy.py`).
  `include` selects the layers: None = every `nn.Linear`; a sequence of `fnmatch` glob
  patterns matched against the qualified name (e.g. `["blocks.*.mlp.*", "lm_head"]`); or a
  callable `(name, module) -> bool`. Only modules whose type is exactly `nn.Linear` are
  candidates: already-sketched layers and subclasses (which may not call `forward`, e.g.
  `nn.MultiheadAttention.out_proj`) are left alone.

Call `sketch_model` before wrapping the model in DDP/FSDP, so names have no wrapper prefix.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .function import check_estimator, check_rank, needs_sketch, sketched_linear, validate
from .policy import Include, ranks_for_budget, selector
from .seeds import layer_seed


class SketchedLinear(nn.Linear):
    """`nn.Linear` whose weight gradient is a rank-`rank` BASIS sketch estimate."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        rank: int,
        name: str = "",
        estimator: str = "centered",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        check_rank(rank)
        check_estimator(estimator)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.rank = rank
        self.sketch_name = name
        self.estimator = estimator

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, rank: int, name: str = "", estimator: str = "centered"
    ) -> SketchedLinear:
        """A `SketchedLinear` sharing `linear`'s parameter objects (no copy, no re-init)."""
        new = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            rank=rank,
            name=name,
            estimator=estimator,
            device="meta",  # parameters are replaced right below; skip allocating and init
        )
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not needs_sketch(x, self.weight, self.bias):
            validate(x, self.weight, self.bias, self.rank)
            return super().forward(x)
        seed = layer_seed(self.sketch_name)
        return sketched_linear(
            x, self.weight, self.bias, rank=self.rank, seed=seed, estimator=self.estimator
        )

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, rank={self.rank}, name={self.sketch_name!r}, "
            f"estimator={self.estimator!r}"
        )


def sketch_model(
    model: nn.Module,
    *,
    rank: int | Mapping[str, int] | None = None,
    include: Include = None,
    estimator: str = "centered",
    memory_budget: int | None = None,
    rows: int | None = None,
) -> list[str]:
    """Swap the selected `nn.Linear`s of `model` for `SketchedLinear`s; return their names.

    Give either `rank` or `memory_budget` (bytes of sketches per microbatch of `rows` rows,
    shared out by `policy.ranks_for_budget`)."""
    check_estimator(estimator)
    if (rank is None) == (memory_budget is None):
        raise ValueError("sketch_model: give exactly one of rank= and memory_budget=")
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
