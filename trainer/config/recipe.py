"""Run configuration: `FitConfig` and its sections, loaded from TOML recipes.

Contract:
- Every section is a dataclass documented per field and validated in `__post_init__`
  (`trainer/config/model.py`: `[model]`, `[sketch]`; `trainer/config/training.py`: the others;
  all importable from `trainer.config`); a bad value raises `ConfigError` (a `ValueError`)
  naming the dotted field (`optim.lr`) and the fix. Types are checked first, for every
  field, from the dataclass annotations (`checks.check_types`): `steps = "10"`,
  `steps = true` or `d_model = 32.0` is one `ConfigError`, never a `TypeError`.
- `load_recipe(path, overrides)` reads a TOML recipe, applies `key=value` overrides
  (`optim.lr=3e-4`; the value is parsed as TOML, else taken as a string) and returns a
  validated `FitConfig`. Unknown sections or keys are errors that list the valid ones.
- Recipes are data: loading one never imports or executes anything named in it. A custom
  model is only possible from Python (`FitConfig(model_factory=..., loss_fn=...)`).
- `to_dict()` gives the plain-JSON form stored in the run directory (`run.json`).
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.config.checks import ConfigError, check_types, require
from trainer.config.model import (
    ModelConfig,
    SketchConfig,
)
from trainer.config.recovery import RecoveryConfig
from trainer.config.training import (
    DataConfig,
    EvalConfig,
    LoggingConfig,
    OptimConfig,
    PrecisionConfig,
    ScalingSettings,
    SnapshotConfig,
)

_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "sketch": SketchConfig,
    "snapshots": SnapshotConfig,
    "scaling": ScalingSettings,
    "eval": EvalConfig,
    "logging": LoggingConfig,
    "precision": PrecisionConfig,
    "recovery": RecoveryConfig,
}
_PARALLELISMS = ("ddp", "fsdp")


@dataclass
class FitConfig:
    """Everything `trainer.fit` needs. The trajectory depends on it and `seed`, not on workers."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sketch: SketchConfig = field(default_factory=SketchConfig)
    snapshots: SnapshotConfig = field(default_factory=SnapshotConfig)
    scaling: ScalingSettings = field(default_factory=ScalingSettings)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    parallelism: str = "ddp"  # "ddp" (replicated) or "fsdp" (FSDP2 fully_shard)
    seed: int = 0  # model init, data order and sketches follow it (never the world size)
    steps: int = 100  # optimizer steps in the whole run (a resumed run continues to this)
    name: str = ""  # Ray Train run name; "" = derived from snapshots.run_uri
    # Python API only: build your own model / loss instead of the built-in GPT.
    model_factory: Callable[[], torch.nn.Module] | None = None
    # With model_factory: loss_fn(model, tokens) returns the microbatch's scalar loss.
    loss_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None
    # Python API only: build your own optimizer from the (wrapped) model instead of
    # optim.name's; optim.lr and the schedule still set its learning rate (trainer.train.optim).
    optimizer_factory: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None

    def __post_init__(self) -> None:
        check_types(self)
        require(
            self.parallelism in _PARALLELISMS,
            "parallelism",
            f"must be one of {', '.join(_PARALLELISMS)}; got {self.parallelism!r}",
        )
        require(self.steps >= 1, "steps", "must be >= 1")
        plain_name = self.name == "" or (
            "/" not in self.name and "\\" not in self.name and self.name not in (".", ".."))
        require(plain_name, "name", f"must be a plain name (no / or ..), got {self.name!r}: "
                                    "it names the run's log file and its Ray Train run")
        require(0 <= self.seed < 1 << 63, "seed", "must be in [0, 2**63)")
        require(
            bool(self.snapshots.run_uri),
            "snapshots.run_uri",
            "is required: a local directory or s3://bucket/prefix/NAME (--run-dir on the CLI)",
        )
        require(
            self.scaling.max_workers <= self.data.num_microbatches,
            "scaling.max_workers",
            f"must be <= the number of microbatches per step "
            f"(data.global_batch / data.microbatch_size = {self.data.num_microbatches}), "
            "or some workers would have nothing to train on",
        )
        require(
            not self.logging.any_sink or "://" not in self.snapshots.run_uri
            or self.snapshots.run_uri.startswith("file://"),
            "logging.tensorboard" if self.logging.tensorboard else "logging.mlflow",
            "metrics sinks write local files under the run directory; turn them off for an "
            f"s3:// run ({self.snapshots.run_uri}) or use a local run directory",
        )
        require(
            (self.model_factory is None) == (self.loss_fn is None),
            "model_factory",
            "model_factory and loss_fn must be given together",
        )
        require(
            not (self.optim.name == "adafactor" and self.parallelism == "fsdp"
                 and self.optimizer_factory is None),
            "optim.name",
            "adafactor does not run on FSDP2 sharded parameters in this torch (its factored "
            'moments need whole rows and columns); use parallelism = "ddp" or another optimizer',
        )
        auto_only = [] if self.sketch_is_auto else self.sketch.auto_only_fields()
        require(not auto_only, f"sketch.{auto_only[0] if auto_only else ''}",
                 'applies to sketch.include = "auto" only (this recipe picks layers by name: '
                 f"{self.sketch.include or 'the built-in GPT default'}); remove it, or set "
                 'sketch.include = "auto"')
        custom = self.optim.custom_fields() if self.optimizer_factory is not None else []
        require(not custom, f"optim.{custom[0] if custom else ''}",
                 "does not apply with optimizer_factory (the factory builds the optimizer); "
                 "remove it")

    @property
    def sketch_is_auto(self) -> bool:
        """Whether a probe picks the sketched layers: `sketch.include = "auto"`, or unset for a
        Hugging Face or `model_factory` model (the built-in GPT's default is by name)."""
        return self.sketch.include == "auto" or (
            not self.sketch.include and (self.model.is_hf or self.model_factory is not None))

    @property
    def run_name(self) -> str:
        return self.name or Path(self.snapshots.run_uri.rstrip("/")).name or "baton-run"

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (custom callables are recorded by their qualified names only)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                out[f.name] = dataclasses.asdict(value)
            elif callable(value):
                out[f.name] = callable_name(value)
            else:
                out[f.name] = value
        return out


def callable_name(value: Any) -> str:
    """How run.json records a Python API callable (a partial or object has no __qualname__)."""
    name = getattr(value, "__qualname__", type(value).__qualname__)
    return f"{getattr(value, '__module__', type(value).__module__)}.{name}"


def from_dict(raw: Mapping[str, Any], *, source: str = "config") -> FitConfig:
    """Build a validated FitConfig from plain data (a parsed recipe)."""
    top_level = {f.name for f in dataclasses.fields(FitConfig)} - {
        "model_factory", "loss_fn", "optimizer_factory"}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in top_level:
            raise ConfigError(f"{source}: unknown key {key!r}; valid keys: {sorted(top_level)}")
        section = _SECTIONS.get(key)
        if section is None:
            kwargs[key] = value
            continue
        if not isinstance(value, Mapping):
            raise ConfigError(f"{source}: [{key}] must be a table, got {type(value).__name__}")
        valid = {f.name for f in dataclasses.fields(section)}
        unknown = sorted(set(value) - valid)
        if unknown:
            raise ConfigError(
                f"{source}: unknown key(s) {unknown} in [{key}]; valid keys: {sorted(valid)}"
            )
        try:
            kwargs[key] = section(**value)
        except TypeError as err:
            raise ConfigError(f"{source}: [{key}]: {err}") from err
    return FitConfig(**kwargs)


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one `section.key=value` override to parsed recipe data, in place."""
    path, sep, text = assignment.partition("=")
    if not sep or not path:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. optim.lr=3e-4")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # bare words are strings: --set snapshots.run_uri=runs/a
    except RecursionError:
        raise ConfigError(f"--set {path}: the value is nested too deeply") from None
    *parents, leaf = path.split(".")
    target = raw
    for part in parents:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise ConfigError(f"--set {assignment!r}: {part!r} is not a section")
    target[leaf] = value


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> FitConfig:
    """Read a TOML recipe, apply `key=value` overrides, and validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe {path}: no such file (see recipes/ for examples)")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"recipe {path}: not valid TOML: {err}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"recipe {path}: not UTF-8 text ({err.reason} at byte {err.start}); "
                          "a recipe is a TOML text file") from None
    except RecursionError:
        raise ConfigError(f"recipe {path}: not valid TOML: nested too deeply") from None
    _resolve_model_paths(raw, path.parent)
    for assignment in overrides:
        apply_override(raw, assignment)
    return from_dict(raw, source=f"recipe {path}")


def _resolve_model_paths(raw: dict[str, Any], recipe_dir: Path) -> None:
    """A recipe's relative `model.hf_config` / `model.init_from` are relative to the recipe
    (so it works from any directory); `--set` values stay relative to where you are."""
    model = raw.get("model")
    if not isinstance(model, dict):
        return
    for key in ("hf_config", "init_from"):
        value = model.get(key)
        if isinstance(value, str) and value and "://" not in value \
                and not Path(value).is_absolute() and (recipe_dir / value).exists():
            model[key] = str((recipe_dir / value).resolve())
