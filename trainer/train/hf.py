"""Hugging Face causal LMs from a recipe, and snapshots back to a Hugging Face model directory.

Contract:
- A recipe names a model as data (P8, docs/design.md): `[model] hf_config = PATH` (a local
  `config.json` or a model directory holding one: random initialisation, seeded by the
  caller like the built-in GPT, so every rank builds the same model) or `init_from = PATH`
  (a local model directory with `config.json` and safetensors weights: fine-tuning). Only
  model types built into `transformers` are accepted: nothing from a model directory is ever
  imported or run (`trust_remote_code` is never set, `auto_map` is dropped), nothing is
  downloaded (`check_local_source` refuses hub names and URLs), and `.bin` (pickle) weights
  are never read. `transformers` is the optional extra `baton-train[hf]`; without it every
  entry point is one `ConfigError` naming `pip install baton-train[hf]`.
- The recipe's checks (local path, extra installed, `model.vocab_size` filled from the
  config's) are `trainer.config.ModelConfig`'s, which needs no `transformers` to run them.
- `build_hf_model(model_cfg, dataset_vocab=)` builds the model in fp32 (master weights)
  with `model_cfg.vocab_size` token ids (`hf_config` only; `init_from` keeps its weights'),
  after refusing a vocabulary smaller than the dataset's (the message names both numbers).
- `causal_lm_loss(model, tokens)` is the model's own causal-LM loss (`labels=tokens`: the
  mean cross-entropy of predicting `tokens[:, 1:]`), the same quantity as the built-in
  `next_token_loss`, so the loop's microbatch weighting (P1) applies unchanged.
- `export_hf(store, step, out)` writes snapshot `step` of an HF run as a model directory
  (`config.json`, `model.safetensors` with tied weights stored once, `generation_config.json`)
  plus the dataset's tokenizer (`tokenizer.json`, `tokenizer_config.json`), loadable with
  `AutoModelForCausalLM.from_pretrained(out)` / `AutoTokenizer.from_pretrained(out)`. The byte
  tokenizer is written as an equivalent byte-level `tokenizers` file (id = byte value).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer.config import (
    ConfigError,
    ModelConfig,
    check_local_source,
    hf_source_field,
    raw_hf_config,
    require_transformers,
)

if TYPE_CHECKING:
    from elastic.store import SnapshotStore

def source_field(model_cfg: ModelConfig) -> tuple[str, str]:
    """(`model.hf_config` or `model.init_from`, its path) of an HF recipe."""
    return hf_source_field(model_cfg.hf_config, model_cfg.init_from)


def load_config(model_cfg: ModelConfig) -> Any:
    """The model's `PretrainedConfig`, built from the JSON by a class `transformers` ships
    (looked up by `model_type`; never a class named by the directory)."""
    field, path = source_field(model_cfg)
    transformers = require_transformers(field)
    raw = raw_hf_config(path, field)
    model_type = raw.get("model_type")
    from transformers import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ConfigError(
            f"{field}: {path} has model_type {model_type!r}, which transformers "
            f"{transformers.__version__} does not ship; Baton never runs code from a model "
            "directory (trust_remote_code), so use a built-in model type"
        )
    raw.pop("auto_map", None)  # remote-code pointers: never followed
    config = CONFIG_MAPPING[model_type].from_dict(raw)
    if not model_cfg.init_from:
        config.vocab_size = model_cfg.vocab_size or config.vocab_size
    return config


def causal_lm_class(config: Any, field: str) -> Any:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ConfigError(f"{field}: model_type {config.model_type!r} has no causal-LM class in "
                          "transformers (AutoModelForCausalLM); give a decoder LM config") from None


def build_hf_model(model_cfg: ModelConfig, *, dataset_vocab: int | None = None) -> nn.Module:
    """The recipe's Hugging Face model in fp32 (random init draws from torch's global RNG:
    seed it first). `dataset_vocab` (the data's token ids) must fit the model's vocabulary."""
    field, path = source_field(model_cfg)
    check_local_source(path, field, weights=bool(model_cfg.init_from))
    config = load_config(model_cfg)
    if dataset_vocab is not None and config.vocab_size < dataset_vocab:
        fix = ("use a model whose vocab_size is at least that" if model_cfg.init_from else
               f"set model.vocab_size = {dataset_vocab} (or more), or vocab_size in {path}")
        raise ConfigError(f"{field}: the model has {config.vocab_size} token ids but the "
                          f"dataset's vocabulary has {dataset_vocab}; {fix}")
    cls = causal_lm_class(config, field)
    if model_cfg.init_from:
        model = cls.from_pretrained(path, config=config, dtype=torch.float32,
                                    local_files_only=True, use_safetensors=True)
    else:
        model = cls._from_config(config, dtype=torch.float32)
    model.config.use_cache = False  # training: no KV cache
    return model


def dataset_vocab_size(uri: str) -> int | None:
    """The vocabulary of the prepared dataset at `uri` (None: no dataset, or unreadable: the
    dataset's own checks report that)."""
    if not uri:
        return None
    from data_state import read_manifest

    try:
        return read_manifest(uri).vocab_size
    except (ValueError, OSError):
        return None


def causal_lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model's own causal-LM loss: mean cross-entropy of `tokens[:, 1:]` given the prefix."""
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


# --- export --------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_json() -> tuple[bytes, str]:
    """A `tokenizers` file equal to Baton's byte tokenizer (token id = UTF-8 byte value, no
    merges), and the text of its end-of-document token (byte 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str().encode(), chars[0]


def _write_tokenizer(data_uri: str, out: Path) -> tuple[str, int]:
    """Write the dataset's tokenizer into `out`; returns its name and end-of-document id."""
    from data_state import load_stored_tokenizer, read_manifest, resolve_uri

    manifest = read_manifest(data_uri)
    fs, root = resolve_uri(data_uri)
    tokenizer = load_stored_tokenizer(fs, root, manifest)
    if tokenizer.file_bytes is None:  # the byte tokenizer
        file_bytes, eos = byte_tokenizer_json()
    else:
        file_bytes = tokenizer.file_bytes
        eos = next(t for t, i in tokenizer.special_tokens.items() if i == tokenizer.eos_id)
    (out / "tokenizer.json").write_bytes(file_bytes)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
        "model_max_length": manifest.seq_len,
    }, indent=1) + "\n")
    return str(tokenizer.name), int(tokenizer.eos_id)


def export_hf(store: SnapshotStore, step: int, out: str) -> tuple[int, str]:
    """Write snapshot `step` of the run in `store` to the directory `out` as a Hugging Face
    model with the dataset's tokenizer; returns (tensors read, tokenizer name)."""
    from safetensors.torch import load_file

    from elastic.catalog import export_model
    from trainer.config import from_dict

    run_json = store.read_run_json() or {}
    saved_config = run_json.get("config")
    saved: dict[str, Any] = saved_config if isinstance(saved_config, dict) else {}
    model_raw = saved.get("model")
    if not isinstance(model_raw, dict) or not (model_raw.get("hf_config")
                                               or model_raw.get("init_from")):
        raise ValueError(f"--format hf: {store.root} is not a run of a Hugging Face model "
                         "([model] hf_config or init_from); export its weights without "
                         "--format (one FILE.safetensors)")
    model_cfg = from_dict({"model": model_raw, "snapshots": {"run_uri": store.root}}).model
    field, _ = source_field(model_cfg)
    config = load_config(model_cfg)
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target) as scratch:
        weights = os.path.join(scratch, "weights.safetensors")
        export_model(store, step, weights)
        state = load_file(weights)
    model = causal_lm_class(config, field)._from_config(config, dtype=torch.float32)
    # strict: the snapshot must hold exactly this model's tensors (a changed config fails here)
    model.load_state_dict(state, strict=True)
    data = saved.get("data")
    data_uri = data.get("uri", "") if isinstance(data, dict) else ""
    tokenizer = "none"
    if data_uri:
        tokenizer, eos_id = _write_tokenizer(data_uri, target)
        model.config.eos_token_id = eos_id
        model.generation_config.eos_token_id = eos_id
    model.config.use_cache = True  # for generation with the exported model
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the CLI prints one line
    # save_pretrained stores tied weights (embeddings / lm_head) once
    model.save_pretrained(target, safe_serialization=True)
    return len(state), tokenizer
