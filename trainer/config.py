"""Run configuration: `FitConfig` and its sections, loaded from TOML recipes.

Contract:
- Every section is a dataclass documented per field and validated in `__post_init__`; a bad
  value raises `ConfigError` (a `ValueError`) naming the dotted field (`optim.lr`) and the fix.
  Types are checked first, for every field, from the dataclass annotations (`_check_types`):
  `steps = "10"`, `steps = true` or `d_model = 32.0` is one `ConfigError`, never a `TypeError`.
- `load_recipe(path, overrides)` reads a TOML recipe, applies `key=value` overrides
  (`optim.lr=3e-4`; the value is parsed as TOML, else taken as a string) and returns a
  validated `FitConfig`. Unknown sections or keys are errors that list the valid ones.
- Recipes are data: loading one never imports or executes anything named in it. A custom
  model is only possible from Python (`FitConfig(model_factory=..., loss_fn=...)`).
- `to_dict()` gives the plain-JSON form stored in the run directory (`run.json`).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import json
import math
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


class ConfigError(ValueError):
    """A recipe or config value is invalid; the message names the field and the fix."""


def _require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{field_name}: {message}")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    # Annotations are strings here (`from __future__ import annotations`): resolve them once.
    return typing.get_type_hints(cls)


def _check_types(obj: Any, section: str = "") -> None:
    """Refuse any field of dataclass `obj` whose value does not match its annotation.

    The one type check for every config section (each `__post_init__` calls it first, so a
    field added later is covered without more code). TOML and `--set` give the wrong type
    easily (`steps = "10"`, `--set optim.lr=abc`), and Python would otherwise fail later with
    a `TypeError` traceback, or silently accept `true` as 1. Rules: `bool` is not an integer;
    an integer field refuses floats (`32.0` too); a float field takes integers (stored as
    float) but not nan or infinity; `list[str]` wants a list of strings. Raises `ConfigError`
    naming the dotted field, what it must be and what it got.
    """
    prefix = f"{section}." if section else ""
    for f in dataclasses.fields(obj):
        cls: type = type(obj)
        expected = _field_types(cls)[f.name]
        value = getattr(obj, f.name)
        wanted = _type_mismatch(value, expected)
        if wanted is not None:
            raise ConfigError(f"{prefix}{f.name}: must be {wanted}, got {_describe(value)}")
        if expected is float and type(value) is int:
            setattr(obj, f.name, float(value))  # to_dict()/run.json then show one type


def _type_mismatch(value: Any, expected: Any) -> str | None:
    """None if `value` fits the annotation `expected`, else what it must be (in words)."""
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(expected)
        misses = [_type_mismatch(value, option) for option in options]
        return None if None in misses else " or ".join(m for m in misses if m)
    if expected is type(None):
        return None if value is None else "unset (None)"
    if expected is bool:
        return None if isinstance(value, bool) else "true or false"
    if expected is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if expected is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "a number"
        return None if math.isfinite(value) else "a finite number"
    if expected is str:
        return None if isinstance(value, str) else "a string (in quotes)"
    if origin is list:
        (item,) = typing.get_args(expected) or (Any,)
        if isinstance(value, list) and all(_type_mismatch(v, item) is None for v in value):
            return None
        return "a list of strings, e.g. ['a', 'b']" if item is str else "a list"
    if origin is collections.abc.Callable:
        return None if callable(value) else "a callable"
    if isinstance(expected, type) and dataclasses.is_dataclass(expected):
        return None if isinstance(value, expected) else f"a {expected.__name__}"
    return None  # Any and other annotations are not checked


def _describe(value: Any) -> str:
    """How a wrong value reads in an error, with the likely fix when there is one."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            return f"the string {value!r}"
        if isinstance(parsed, int | float | bool):
            return f"the string {value!r} (remove the quotes)"
        return f"the string {value!r}"
    if isinstance(value, float) and value.is_integer():
        return f"{value!r} (write {int(value)})"
    if isinstance(value, dict):
        return "a table"
    return f"{value!r} ({type(value).__name__})"


# The values of ModelConfig.mlp_recompute.
MLP_RECOMPUTE = ("auto", "always", "never")


# --- Hugging Face model sources ([model] hf_config / init_from; the model itself: trainer.hf)
HF_INSTALL_HINT = "pip install baton-train[hf]"


def require_transformers(field_name: str) -> Any:
    """The `transformers` module, or one `ConfigError` naming the extra to install."""
    import importlib.util  # locates the package without importing it

    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(f"{field_name}: Hugging Face models need transformers: "
                          f"{HF_INSTALL_HINT}")
    import transformers

    return transformers


def config_file(path: Path) -> Path:
    """A model directory's config.json, or `path` itself (a config file)."""
    return path / "config.json" if path.is_dir() else path


def check_local_source(path: str, field_name: str, *, weights: bool) -> Path:
    """`path` as a local config file or model directory, or one `ConfigError`: a hub name,
    URL or missing path (nothing is downloaded), a directory without config.json, or, for
    `weights` (init_from), one without safetensors weights (pickled .bin is never read)."""
    local = Path(path)
    if "://" in path or not local.exists():
        raise ConfigError(f"{field_name}: {path!r} is not a local file or directory; nothing "
                          "is downloaded: save the model locally (e.g. `hf download NAME "
                          "--local-dir DIR`) and give that directory")
    if weights and not (local.is_dir() and any(local.glob("*.safetensors"))):
        raise ConfigError(f"{field_name}: {path} must be a model directory with *.safetensors "
                          "weights (pickled .bin weights are never loaded)")
    if not config_file(local).is_file():
        raise ConfigError(f"{field_name}: {path} has no config.json")
    return local


def raw_hf_config(path: str, field_name: str) -> dict[str, Any]:
    """The JSON object of the model's config.json (plain data: nothing is imported)."""
    try:
        raw = json.loads(config_file(Path(path)).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{field_name}: {path} is not a readable JSON config "
                          f"({' '.join(str(err).split())})") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{field_name}: {path} must hold a JSON object")
    return raw


def hf_source_field(hf_config: str, init_from: str) -> tuple[str, str]:
    """(the dotted field, its path) of a Hugging Face recipe."""
    return ("model.init_from", init_from) if init_from else ("model.hf_config", hf_config)


@dataclass
class ModelConfig:
    """Shape and memory options of the built-in GPT (`trainer.model.GPT`), validated once.

    The recipe's `[model]` section. The context length is not here: `GPT(config, seq_len=)`
    takes it, from `data.seq_len` in a fit (a sequence's length is the data's to say).
    Defaults are the tiny CPU model used by tests."""

    # Token ids the model has. 0 (the default) = the dataset's vocabulary: the driver reads it
    # from dataset.json before the model is built (`trainer.run_dir.with_dataset_vocab`);
    # a model built from a recipe alone, with no dataset, gets the byte vocabulary (256).
    vocab_size: int = 0
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    checkpoint_blocks: bool = False  # recompute each block in backward (activation checkpointing)
    # When the MLP recomputes its hidden activations in backward instead of keeping them
    # (`sketch_ops.gelu_mlp`): "auto" when its proj is sketched (the sketch's memory saving
    # needs it), "always" (selective recomputation: exact gradients in less memory), "never"
    # (keep GELU's input: sketched layers then save time rather than memory).
    mlp_recompute: str = "auto"
    # Fuse each LayerNorm into the linear layer it feeds (`sketch_ops.norm_linear`): the same
    # values and gradients, one n × d tensor less kept per norm. False runs them as separate
    # modules, so forward hooks on those linear layers fire (for analysis).
    fuse_norms: bool = True
    # A Hugging Face causal LM instead of the built-in GPT (`trainer.hf`; needs
    # `pip install baton-train[hf]`; then d_model, n_layers, n_heads and the two options above
    # are not used). `hf_config`: a local config.json or model directory, randomly initialised
    # from `seed`; `model.vocab_size` 0 takes the config's, a set value replaces it.
    # `init_from`: a local model directory with safetensors weights (fine-tuning); its config
    # and vocabulary are the model's. Relative paths in a recipe are relative to the recipe.
    hf_config: str = ""
    init_from: str = ""

    def __post_init__(self) -> None:
        _check_types(self, "model")
        if self.hf_config or self.init_from:
            self._check_hf()
        _require(self.vocab_size >= 0, "model.vocab_size", "must be >= 0 (0: from the dataset)")
        for name in ("d_model", "n_layers", "n_heads"):
            _require(getattr(self, name) >= 1, f"model.{name}", "must be >= 1")
        _require(
            self.mlp_recompute in MLP_RECOMPUTE,
            "model.mlp_recompute",
            f"must be one of {', '.join(MLP_RECOMPUTE)}, got {self.mlp_recompute!r}",
        )
        _require(
            self.d_model % self.n_heads == 0,
            "model.d_model",
            f"must be divisible by model.n_heads ({self.n_heads})",
        )

    @property
    def is_hf(self) -> bool:
        """A Hugging Face model (`trainer.hf`) rather than the built-in GPT."""
        return bool(self.hf_config or self.init_from)

    def _check_hf(self) -> None:
        """The HF source is a local path (nothing is downloaded), transformers is installed,
        and `vocab_size` is the model's (read from its config.json)."""
        _require(not (self.hf_config and self.init_from), "model.init_from",
                 "cannot be set together with model.hf_config (init_from's config is used)")
        field_name, path = hf_source_field(self.hf_config, self.init_from)
        require_transformers(field_name)
        check_local_source(path, field_name, weights=bool(self.init_from))
        vocab = raw_hf_config(path, field_name).get("vocab_size")
        _require(isinstance(vocab, int) and not isinstance(vocab, bool) and vocab >= 1,
                 field_name, f"{path} has no positive integer vocab_size")
        assert isinstance(vocab, int)
        _require(not self.init_from or self.vocab_size in (0, vocab), "model.vocab_size",
                 f"init_from's weights have {vocab} token ids; leave model.vocab_size out")
        self.vocab_size = self.vocab_size or vocab


@dataclass
class DataConfig:
    """Where the tokens come from and how a global step is cut into microbatches."""

    uri: str = ""  # prepared dataset (local path or s3://); "" = the embedded default corpus
    seq_len: int = 64  # tokens per stored sequence (the model predicts seq_len - 1 of them)
    global_batch: int = 16  # sequences per optimizer step, the same for any world size
    microbatch_size: int = 4  # sequences per forward/backward; global_batch / this = microbatches
    max_corpus_bytes: int = 0  # cap on text read when preparing the default corpus (0 = all)

    def __post_init__(self) -> None:
        _check_types(self, "data")
        _require(self.seq_len >= 2, "data.seq_len", "must be >= 2 (a prediction needs 2 tokens)")
        _require(self.microbatch_size >= 1, "data.microbatch_size", "must be >= 1")
        _require(self.global_batch >= 1, "data.global_batch", "must be >= 1")
        _require(
            self.global_batch % self.microbatch_size == 0,
            "data.global_batch",
            f"must be a multiple of data.microbatch_size ({self.microbatch_size}); "
            f"got {self.global_batch}",
        )
        _require(self.max_corpus_bytes >= 0, "data.max_corpus_bytes", "must be >= 0")

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // self.microbatch_size


# The values of OptimConfig.name and OptimConfig.schedule (trainer.optim builds them).
OPTIMIZERS = ("adamw", "sgd", "adafactor")
SCHEDULES = ("cosine", "linear", "constant", "wsd")
# Fields that only one optimizer (or schedule) uses: set away from their default for another
# one, they are refused rather than silently ignored.
_OPTIMIZER_FIELDS = {"beta1": "adamw", "beta2": "adamw", "eps": "adamw", "momentum": "sgd",
                     "nesterov": "sgd", "beta2_decay": "adafactor"}
_SCHEDULE_FIELDS = {"decay_fraction": "wsd"}


@dataclass
class OptimConfig:
    """The optimizer and its learning-rate schedule (`trainer.optim`): linear warmup over
    `warmup_steps`, then `schedule`. The schedule is a function of these fields and the run's
    `steps` only, so stopping early never changes it."""

    name: str = "adamw"  # one of OPTIMIZERS: "adamw", "sgd" or "adafactor" (torch.optim's)
    lr: float = 3e-3  # peak learning rate (adafactor: the cap of its relative step size)
    weight_decay: float = 0.1  # on matrices only (2-D+ parameters)
    beta1: float = 0.9  # adamw only
    beta2: float = 0.95  # adamw only
    eps: float = 1e-8  # adamw only
    momentum: float = 0.9  # sgd only, in [0, 1); 0 = plain SGD (no optimizer state)
    nesterov: bool = False  # sgd only
    beta2_decay: float = -0.8  # adafactor only: its second-moment decay exponent (<= 0)
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    # One of SCHEDULES after warmup: "cosine" (to min_lr_ratio * lr at `steps`), "linear" (the
    # same, linearly), "constant" (lr), "wsd" (warmup-stable-decay: lr, then linear to
    # min_lr_ratio * lr over the last decay_fraction of the steps).
    schedule: str = "cosine"
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # the floor of cosine, linear and wsd (constant has none)
    decay_fraction: float = 0.2  # wsd only: the share of `steps` spent decaying

    def __post_init__(self) -> None:
        _check_types(self, "optim")
        for name, choices in (("name", OPTIMIZERS), ("schedule", SCHEDULES)):
            _require(getattr(self, name) in choices, f"optim.{name}",
                     f"must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        _require(self.lr > 0, "optim.lr", "must be > 0")
        _require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        for name in ("beta1", "beta2"):
            _require(0 <= getattr(self, name) < 1, f"optim.{name}", "must be in [0, 1)")
        _require(self.eps > 0, "optim.eps", "must be > 0")
        _require(0 <= self.momentum < 1, "optim.momentum", "must be in [0, 1) (0: plain SGD)")
        _require(not self.nesterov or self.momentum > 0, "optim.nesterov",
                 "needs optim.momentum > 0 (Nesterov momentum without momentum is plain SGD)")
        _require(self.beta2_decay <= 0, "optim.beta2_decay", "must be <= 0 (e.g. -0.8)")
        _require(self.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        _require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        _require(0 < self.decay_fraction <= 1, "optim.decay_fraction", "must be in (0, 1]")
        for fields, chosen, what in ((_OPTIMIZER_FIELDS, self.name, "name"),
                                     (_SCHEDULE_FIELDS, self.schedule, "schedule")):
            for name, owner in fields.items():
                _require(owner == chosen or getattr(self, name) == _default(self, name),
                         f"optim.{name}", f'applies to optim.{what} = "{owner}" only (the recipe '
                         f'has "{chosen}"); remove it, or set optim.{what} = "{owner}"')

    def custom_fields(self) -> list[str]:
        """The optimizer-building fields set away from their defaults (what an
        `optimizer_factory` replaces)."""
        return [n for n in ("name", "weight_decay", *_OPTIMIZER_FIELDS)
                if getattr(self, n) != _default(self, n)]


def _default(obj: Any, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(obj) if f.name == name)


_AUTO_ONLY_FIELDS = ("min_saving", "keep_gate")  # SketchConfig fields read by "auto" only


@dataclass
class SketchConfig:
    """BASIS sketched linear layers: one `rank` for every selected layer, or per-layer ranks
    from `memory_budget_mib` (sketch memory per microbatch). Neither set: exact backprop."""

    rank: int = 0
    memory_budget_mib: float = 0.0
    # Module-name globs, or "auto" (a probe step picks the layers whose sketch frees memory:
    # sketch_ops.probe); [] = the built-in GPT's policy (trainer.model.SKETCH_LAYERS), "auto"
    # for any other model.
    include: list[str] | str = field(default_factory=list)
    estimator: str = "centered"  # or "basis" (sketch_ops.function)
    # Read by "auto" only (a value other than the default is refused where layers are chosen
    # by name): the least share of the probed step's activation bytes a kind of layers (e.g.
    # every block's q/k/v) must free to be sketched, in [0, 1) (`sketch_ops.probe.MIN_SAVING`;
    # 0 sketches whatever frees anything), and whether a fused SwiGLU MLP also keeps gate's
    # output and recomputes only up in backward (one n x I tensor more per MLP, one matmul
    # less: `sketch_ops.swiglu`).
    min_saving: float = 0.10
    keep_gate: bool = False

    def __post_init__(self) -> None:
        _check_types(self, "sketch")
        from sketch_ops.function import ESTIMATORS

        _require(self.rank >= 0, "sketch.rank", "must be >= 0 (0 turns sketching off)")
        _require(self.memory_budget_mib >= 0, "sketch.memory_budget_mib", "must be >= 0")
        _require(
            not (self.rank and self.memory_budget_mib),
            "sketch.memory_budget_mib",
            "cannot be set together with sketch.rank; set one of them (the other to 0)",
        )
        _require(
            not isinstance(self.include, str) or self.include == "auto",
            "sketch.include",
            f'must be "auto" or a list of strings (module-name globs, e.g. '
            f'["*.mlp.down_proj"]), got {self.include!r}',
        )
        _require(
            self.estimator in ESTIMATORS,
            "sketch.estimator",
            f"must be one of {', '.join(ESTIMATORS)}, got {self.estimator!r}",
        )
        _require(0 <= self.min_saving < 1, "sketch.min_saving",
                 f"must be a share of the step's activation bytes in [0, 1), got "
                 f"{self.min_saving!r} (e.g. 0.1; 0 sketches whatever frees anything)")

    def auto_only_fields(self) -> list[str]:
        """The fields only include = "auto" reads that are set away from their defaults."""
        return [n for n in _AUTO_ONLY_FIELDS if getattr(self, n) != _default(self, n)]

    @property
    def enabled(self) -> bool:
        return self.rank > 0 or self.memory_budget_mib > 0


@dataclass
class SnapshotConfig:
    """Where the run lives and how often its state is snapshotted."""

    run_uri: str = ""  # run directory (local path or s3://bucket/prefix/NAME); required
    snapshot_every: int = 10  # steps between snapshots (plus on preemption or resize)
    keep_last: int = 3  # committed snapshots kept; older ones are deleted
    # Cap on each node's RAM store (MiB; 0 turns the RAM copies off): it holds copies of
    # other nodes' shards of the newest snapshot (plus one in flight). A shard that does not
    # fit is storage-only.
    ram_copy_mib: float = 4096.0
    # How many other nodes hold a RAM copy of each shard (the next ones in the sorted list of
    # live nodes; 0 = none). On a one-node cluster the copy is on that node.
    ram_replicas: int = 1
    # An in-flight snapshot not complete after this long is aborted and its files removed.
    pending_timeout_s: float = 600.0
    # S3: the total deadline of one storage call (a black-holed endpoint fails within it),
    # and how long transient errors (HTTP 5xx, throttling, timeouts) are retried in all.
    storage_timeout_s: float = 30.0
    storage_retry_s: float = 120.0

    def __post_init__(self) -> None:
        _check_types(self, "snapshots")
        _require(self.snapshot_every >= 1, "snapshots.snapshot_every", "must be >= 1")
        _require(self.keep_last >= 1, "snapshots.keep_last", "must be >= 1")
        _require(self.ram_copy_mib >= 0, "snapshots.ram_copy_mib", "must be >= 0 (0 = off)")
        _require(self.ram_replicas >= 0, "snapshots.ram_replicas", "must be >= 0 (0 = off)")
        _require(self.pending_timeout_s > 0, "snapshots.pending_timeout_s", "must be > 0")
        _require(self.storage_timeout_s > 0, "snapshots.storage_timeout_s", "must be > 0")
        _require(self.storage_retry_s >= self.storage_timeout_s, "snapshots.storage_retry_s",
                 f"must be >= snapshots.storage_timeout_s ({self.storage_timeout_s})")


@dataclass
class ScalingSettings:
    """How many Ray Train workers, and what each reserves."""

    min_workers: int = 1
    max_workers: int = 2
    cpus_per_worker: float = 1.0
    use_gpu: bool = False  # one GPU per worker, NCCL; otherwise CPU and gloo
    resize_interval_s: float = 5.0  # how often Ray Train checks whether the group can grow
    # Worker-group restarts allowed after errors (-1 = unlimited). Finite by default: an
    # error that keeps coming back must end the run, not retry it forever. Preemptions
    # that committed their snapshot and node losses Ray Train sees as preemptions are
    # not counted (see trainer.on_ray.scaling).
    max_failures: int = 10

    def __post_init__(self) -> None:
        _check_types(self, "scaling")
        _require(self.min_workers >= 1, "scaling.min_workers", "must be >= 1")
        _require(
            self.max_workers >= self.min_workers,
            "scaling.max_workers",
            f"must be >= scaling.min_workers ({self.min_workers})",
        )
        _require(self.cpus_per_worker > 0, "scaling.cpus_per_worker", "must be > 0")
        _require(self.resize_interval_s > 0, "scaling.resize_interval_s", "must be > 0")
        _require(self.max_failures >= -1, "scaling.max_failures", "must be >= -1")


@dataclass
class EvalConfig:
    """Validation loss on the held-out split every `every` steps (0 = never)."""

    every: int = 20
    batches: int = 4  # microbatches of the val split per evaluation

    def __post_init__(self) -> None:
        _check_types(self, "eval")
        _require(self.every >= 0, "eval.every", "must be >= 0 (0 disables evaluation)")
        _require(self.batches >= 1, "eval.batches", "must be >= 1")


@dataclass
class LoggingConfig:
    """Optional metrics sinks fed with rank 0's per-step records on the driver
    (`trainer.sinks`). Each needs its extra: `pip install baton-train[tensorboard]`,
    `baton-train[mlflow]`. They write under RUN/`dir`, so they need a local run directory."""

    tensorboard: bool = False  # TensorBoard event files in RUN/<dir>/tensorboard
    mlflow: bool = False  # an MLflow file store in RUN/<dir>/mlflow (one MLflow run per run)
    dir: str = "logs"  # relative to the run directory; also holds ray.log (Ray's messages)

    def __post_init__(self) -> None:
        _check_types(self, "logging")
        parts = Path(self.dir).parts
        _require(
            bool(self.dir) and not Path(self.dir).is_absolute() and ".." not in parts
            and "://" not in self.dir,
            "logging.dir",
            f"must be a relative path inside the run directory (e.g. \"logs\"), got {self.dir!r}",
        )
        import importlib.util  # locates the package without importing it

        for sink in ("tensorboard", "mlflow"):
            _require(
                not getattr(self, sink) or importlib.util.find_spec(sink) is not None,
                f"logging.{sink}",
                f"needs the {sink} extra: pip install baton-train[{sink}] "
                f"(or set logging.{sink} = false)",
            )

    @property
    def any_sink(self) -> bool:
        return self.tensorboard or self.mlflow


# The values of PrecisionConfig.dtype (trainer.precision maps them to torch dtypes).
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class PrecisionConfig:
    """The dtype forward and backward compute in (`trainer.precision`). Master weights,
    optimizer state and snapshots stay fp32 in every dtype, so a run may be continued in
    another one."""

    # "fp32" (no casts), "bf16" (autocast under DDP, FSDP2's MixedPrecisionPolicy under
    # FSDP; gradients reduced in fp32) or "fp16" (the same, plus a dynamic loss scaler whose
    # state is in the snapshot). All three run on CPU and CUDA.
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        _check_types(self, "precision")
        _require(self.dtype in PRECISIONS, "precision.dtype",
                 f"must be one of {', '.join(PRECISIONS)}, got {self.dtype!r}")


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
    parallelism: str = "ddp"  # "ddp" (replicated) or "fsdp" (FSDP2 fully_shard)
    seed: int = 0
    steps: int = 100  # optimizer steps in the whole run (a resumed run continues to this)
    name: str = ""  # Ray Train run name; "" = derived from snapshots.run_uri
    # Python API only: build your own model / loss instead of the built-in GPT.
    model_factory: Callable[[], torch.nn.Module] | None = None
    loss_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None
    # Python API only: build your own optimizer from the (wrapped) model instead of
    # optim.name's; optim.lr and the schedule still set its learning rate (trainer.optim).
    optimizer_factory: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None

    def __post_init__(self) -> None:
        _check_types(self)
        _require(
            self.parallelism in _PARALLELISMS,
            "parallelism",
            f"must be one of {', '.join(_PARALLELISMS)}; got {self.parallelism!r}",
        )
        _require(self.steps >= 1, "steps", "must be >= 1")
        _require(self.seed >= 0, "seed", "must be >= 0")
        _require(
            bool(self.snapshots.run_uri),
            "snapshots.run_uri",
            "is required: a local directory or s3://bucket/prefix/NAME (--run-dir on the CLI)",
        )
        _require(
            self.scaling.max_workers <= self.data.num_microbatches,
            "scaling.max_workers",
            f"must be <= the number of microbatches per step "
            f"(data.global_batch / data.microbatch_size = {self.data.num_microbatches}), "
            "or some workers would have nothing to train on",
        )
        _require(
            not self.logging.any_sink or "://" not in self.snapshots.run_uri
            or self.snapshots.run_uri.startswith("file://"),
            "logging.tensorboard" if self.logging.tensorboard else "logging.mlflow",
            "metrics sinks write local files under the run directory; turn them off for an "
            f"s3:// run ({self.snapshots.run_uri}) or use a local run directory",
        )
        _require(
            (self.model_factory is None) == (self.loss_fn is None),
            "model_factory",
            "model_factory and loss_fn must be given together",
        )
        _require(
            not (self.optim.name == "adafactor" and self.parallelism == "fsdp"
                 and self.optimizer_factory is None),
            "optim.name",
            "adafactor does not run on FSDP2 sharded parameters in this torch (its factored "
            'moments need whole rows and columns); use parallelism = "ddp" or another optimizer',
        )
        auto_only = [] if self.sketch_is_auto else self.sketch.auto_only_fields()
        _require(not auto_only, f"sketch.{auto_only[0] if auto_only else ''}",
                 'applies to sketch.include = "auto" only (this recipe picks layers by name: '
                 f"{self.sketch.include or 'the built-in GPT default'}); remove it, or set "
                 'sketch.include = "auto"')
        custom = self.optim.custom_fields() if self.optimizer_factory is not None else []
        _require(not custom, f"optim.{custom[0] if custom else ''}",
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
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"recipe {path}: not valid TOML: {err}") from err
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
