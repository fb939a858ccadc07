"""Baton's public API: `trainer.fit(config)` and its configuration.

    from trainer import FitConfig, fit, load_recipe
    result = fit(load_recipe("recipes/tiny.toml", ["snapshots.run_uri=runs/tiny"]))

`fit` imports Ray only when called, so configs can be built and validated without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.config import (
    ConfigError,
    DataConfig,
    EvalConfig,
    FitConfig,
    ModelConfig,
    OptimConfig,
    ScalingSettings,
    SketchConfig,
    SnapshotConfig,
    load_recipe,
)

if TYPE_CHECKING:
    from trainer.ray_fit import FitResult


def fit(config: FitConfig, **kwargs: Any) -> FitResult:
    """Train `config` on Ray (see `trainer.ray_fit.fit`)."""
    from trainer.ray_fit import fit as _fit

    return _fit(config, **kwargs)


__all__ = [
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "FitConfig",
    "ModelConfig",
    "OptimConfig",
    "ScalingSettings",
    "SketchConfig",
    "SnapshotConfig",
    "fit",
    "load_recipe",
]
