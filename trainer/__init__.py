"""Baton's public API: `trainer.fit(config)` and its configuration.

    from trainer import FitConfig, fit, load_recipe
    result = fit(load_recipe("recipes/tiny.toml", ["snapshots.run_uri=runs/tiny"]))

`fit` imports Ray only when called, so configs can be built and validated without it.

For your own Ray Train loop (docs/ray-train-loop.md): `trainer.Session` in the
`train_func`, `trainer.ElasticTorchTrainer` on the driver. Both are loaded on first use, so
`import trainer` stays free of Ray.
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
    from trainer.on_ray import ElasticTorchTrainer, FitResult
    from trainer.train import Session

# Public names loaded on first use: the room whose face holds each.
_LAZY = {"Session": "trainer.train", "ElasticTorchTrainer": "trainer.on_ray"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")


def fit(config: FitConfig, **kwargs: Any) -> FitResult:
    """Train `config` on Ray (see `trainer.on_ray.ray_fit.fit`)."""
    from trainer.on_ray import fit as _fit

    return _fit(config, **kwargs)


__all__ = [
    "ConfigError",
    "DataConfig",
    "ElasticTorchTrainer",
    "EvalConfig",
    "FitConfig",
    "ModelConfig",
    "OptimConfig",
    "ScalingSettings",
    "Session",
    "SketchConfig",
    "SnapshotConfig",
    "fit",
    "load_recipe",
]
