"""`SketchedLinear`, a drop-in `nn.Linear` trained with BASIS.

Contract:
- `SketchedLinear(in_features, out_features, bias=True, *, rank, name="", estimator=...)`
  subclasses `nn.Linear`: same parameters, same `state_dict` keys (`weight`, `bias`), same
  init, same output. Only its weight gradient differs (see `function.py`). Its sketch seed is
  `layer_seed(name)`: inside `sketch_seed(...)` a pure function of (seed, step, microbatch,
  name); outside, fresh randomness per call. Layers that share a name share their sketch, so
  give each layer its own (`sketch_model` uses the module's qualified name).

`sketch_model` (`model.py`) swaps a model's selected `nn.Linear`s for these layers.
"""

from __future__ import annotations

import torch
from torch import nn

from .function import check_estimator, check_rank, needs_sketch, sketched_linear, validate
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

