"""The recipe's model-side sections: `[model]` (`ModelConfig`: the built-in GPT's shape or a
Hugging Face causal LM from local files) and `[sketch]` (`SketchConfig`: BASIS layers).

Contract: each section is a dataclass documented per field and validated in `__post_init__`
(types first, `checks.check_types`); a bad value raises one `ConfigError` naming the
dotted field and the fix. The Hugging Face helpers (`require_transformers`,
`check_local_source`, `raw_hf_config`, `hf_source_field`) read local files only: nothing is
downloaded, imported from the model directory or executed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic.storage import Storage
from trainer.config.checks import ConfigError, check_types, default_of, require

# The values of ModelConfig.mlp_recompute.
MLP_RECOMPUTE = ("auto", "always", "never")


# --- Hugging Face model sources ([model] hf_config / init_from; the model itself: trainer.train.hf)
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
    file = config_file(Path(path))
    try:  # a person's file, maybe a link (a hub cache); never a FIFO; bounded like a run's
        raw = Storage(str(file), follow_links=True).read_json(str(file))
    except (OSError, ValueError) as err:
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
    """Shape and memory options of the built-in GPT (`trainer.train.model.GPT`), validated once.

    The recipe's `[model]` section. The context length is not here: `GPT(config, seq_len=)`
    takes it, from `data.seq_len` in a fit (a sequence's length is the data's to say).
    Defaults are the tiny CPU model used by tests."""

    # Token ids the model has. 0 (the default) = the dataset's vocabulary: the driver reads it
    # from dataset.json before the model is built (`trainer.run.preflight.with_dataset_vocab`);
    # a model built from a recipe alone, with no dataset, gets the byte vocabulary (256).
    vocab_size: int = 0
    d_model: int = 64  # the built-in GPT's width (a multiple of n_heads)
    n_layers: int = 2  # the built-in GPT's transformer blocks
    n_heads: int = 4  # the built-in GPT's attention heads
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
    # A Hugging Face causal LM instead of the built-in GPT (`trainer.train.hf`; needs
    # `pip install baton-train[hf]`; then d_model, n_layers, n_heads and the two options above
    # are not used): a local config.json or model directory, randomly initialised from `seed`;
    # `model.vocab_size` 0 takes the config's, a set value replaces it. Relative paths in a
    # recipe are relative to the recipe (here and in init_from).
    hf_config: str = ""
    # Instead of hf_config: a local model directory with safetensors weights (fine-tuning);
    # its config and vocabulary are the model's.
    init_from: str = ""

    def __post_init__(self) -> None:
        check_types(self, "model")
        if self.hf_config or self.init_from:
            self._check_hf()
        require(self.vocab_size >= 0, "model.vocab_size", "must be >= 0 (0: from the dataset)")
        for name in ("d_model", "n_layers", "n_heads"):
            require(getattr(self, name) >= 1, f"model.{name}", "must be >= 1")
        require(
            self.mlp_recompute in MLP_RECOMPUTE,
            "model.mlp_recompute",
            f"must be one of {', '.join(MLP_RECOMPUTE)}, got {self.mlp_recompute!r}",
        )
        require(
            self.d_model % self.n_heads == 0,
            "model.d_model",
            f"must be divisible by model.n_heads ({self.n_heads})",
        )

    @property
    def is_hf(self) -> bool:
        """A Hugging Face model (`trainer.train.hf`) rather than the built-in GPT."""
        return bool(self.hf_config or self.init_from)

    def _check_hf(self) -> None:
        """The HF source is a local path (nothing is downloaded), transformers is installed,
        and `vocab_size` is the model's (read from its config.json)."""
        require(not (self.hf_config and self.init_from), "model.init_from",
                 "cannot be set together with model.hf_config (init_from's config is used)")
        field_name, path = hf_source_field(self.hf_config, self.init_from)
        require_transformers(field_name)
        check_local_source(path, field_name, weights=bool(self.init_from))
        vocab = raw_hf_config(path, field_name).get("vocab_size")
        require(isinstance(vocab, int) and not isinstance(vocab, bool) and vocab >= 1,
                 field_name, f"{path} has no positive integer vocab_size")
        assert isinstance(vocab, int)
        require(not self.init_from or self.vocab_size in (0, vocab), "model.vocab_size",
                 f"init_from's weights have {vocab} token ids; leave model.vocab_size out")
        self.vocab_size = self.vocab_size or vocab


# SketchConfig fields read by "auto" only
_AUTO_ONLY_FIELDS = ("min_saving", "keep_gate", "max_quality_cost")


@dataclass
class SketchConfig:
    """BASIS sketched linear layers: one `rank` for every selected layer, or per-layer ranks
    from `memory_budget_mib` (sketch memory per microbatch). Neither set: exact backprop."""

    rank: int = 0  # R, the sketch's rows in every selected layer (0 and no budget: exact)
    # Sketch memory per microbatch (MiB) shared over the selected layers, R per layer
    # proportional to 1/sqrt(in_features) (sketch_ops.policy); not together with rank.
    memory_budget_mib: float = 0.0
    # Module-name globs, or "auto" (a probe step picks the layers whose sketch frees memory:
    # sketch_ops.probe); [] = the built-in GPT's policy (trainer.train.model.SKETCH_LAYERS), "auto"
    # for any other model.
    include: list[str] | str = field(default_factory=list)
    estimator: str = "centered"  # or "basis" (sketch_ops.function)
    # Read by "auto" only (a value other than the default is refused where layers are chosen
    # by name): the least share of the probed step's activation bytes a kind of layers (e.g.
    # every block's q/k/v) must free to be sketched, in [0, 1) (`sketch_ops.probe.MIN_SAVING`;
    # 0 sketches whatever frees anything).
    min_saving: float = 0.10
    # Read by "auto" only, as min_saving: whether a fused SwiGLU MLP also keeps gate's output
    # and recomputes only up in backward (the default, `sketch_ops.swiglu.KEEP_GATE`: one
    # n x I tensor more per MLP than keeping only its input, one matmul less).
    keep_gate: bool = True
    # Read by "auto" only, as min_saving: the largest gradient error a kind of layers may have
    # to be sketched for speed alone, when the cost model (sketch_ops.cost: the device's GEMM
    # rate and bandwidth) predicts the step gets faster. The error is a layer's relative RMS
    # error sqrt(E|dW_sketch - dW|^2) / |dW| at its R, measured on a probe batch of random
    # token ids (sketch_ops.speed_plan). 0 (the default) sketches for memory alone.
    max_quality_cost: float = 0.0

    def __post_init__(self) -> None:
        check_types(self, "sketch")
        from sketch_ops import ESTIMATORS

        require(self.rank >= 0, "sketch.rank", "must be >= 0 (0 turns sketching off)")
        require(self.memory_budget_mib >= 0, "sketch.memory_budget_mib", "must be >= 0")
        require(
            not (self.rank and self.memory_budget_mib),
            "sketch.memory_budget_mib",
            "cannot be set together with sketch.rank; set one of them (the other to 0)",
        )
        require(
            not isinstance(self.include, str) or self.include == "auto",
            "sketch.include",
            f'must be "auto" or a list of strings (module-name globs, e.g. '
            f'["*.mlp.down_proj"]), got {self.include!r}',
        )
        require(
            self.estimator in ESTIMATORS,
            "sketch.estimator",
            f"must be one of {', '.join(ESTIMATORS)}, got {self.estimator!r}",
        )
        require(0 <= self.min_saving < 1, "sketch.min_saving",
                 f"must be a share of the step's activation bytes in [0, 1), got "
                 f"{self.min_saving!r} (e.g. 0.1; 0 sketches whatever frees anything)")
        require(math.isfinite(self.max_quality_cost) and self.max_quality_cost >= 0,
                 "sketch.max_quality_cost",
                 f"must be a finite number >= 0 (a relative gradient error; 0 sketches for "
                 f"memory only), got {self.max_quality_cost!r}")

    def auto_only_fields(self) -> list[str]:
        """The fields only include = "auto" reads that are set away from their defaults."""
        return [n for n in _AUTO_ONLY_FIELDS if getattr(self, n) != default_of(self, n)]

    @property
    def enabled(self) -> bool:
        return self.rank > 0 or self.memory_budget_mib > 0
