"""Which Flax module and layout map a run's model has: the built-in GPT or a Llama.

Contract: ``for_run(run_info, model_tensors, layout=None)`` reads ``run.json`` (``run_info``)
and the snapshot's model tensor names (``model_tensors``: fqn -> array) and returns a
``ModelSpec``: its ``layout`` (``trainer.on_jax.layout_map``), ``module(params)`` (the Flax
module for a params tree, or None: the caller brings its own) and ``loss_fn(module, params,
tokens)``.

* A run of the built-in GPT (no Hugging Face config in ``run.json``) gets ``gpt_map`` and
  ``FlaxGPT`` (heads from the recipe's ``model.n_heads``, the rest from the shapes); a run of
  a Hugging Face model whose config says ``model_type = "llama"`` gets ``llama_map_for`` and
  ``FlaxLlama``. A ``layout`` given replaces the ready map; the ready module stays.
* The user's own model — a ``model_factory`` run, or a Hugging Face family without a ready
  map (Qwen2, Mistral, ...) — needs ``layout``: with it, the spec has that map and no module
  (``module`` None); without it, ``ValueError`` in one line naming the model, what is
  supported and what to pass. The model is looked at before its optimizer state, so a tied
  Qwen2 is named as such, not as a parameter without a gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax

from trainer.on_jax.gpt import FlaxGPT, next_token_loss
from trainer.on_jax.layout_map import LayoutMap, gpt_map
from trainer.on_jax.llama import FlaxLlama, llama_map_for
from trainer.train import HF_MODEL_CONFIG_KEY

_READY = ("the ready maps are the built-in GPT's and a Hugging Face Llama's (model_type "
          "'llama')")
_FIX = ("pass layout= with a LayoutMap for its parameters (an alias such as a tied lm_head "
        "in tied=) and model= with its Flax module (trainer.on_jax.layout_map, docs/jax.md)")


@dataclass(frozen=True)
class ModelSpec:
    layout: LayoutMap
    module: Callable[[Any], nn.Module] | None
    loss_fn: Callable[[nn.Module, Any, jax.Array], jax.Array] = next_token_loss


def for_run(run_info: dict[str, Any], model_tensors: dict[str, Any],
            layout: LayoutMap | None = None) -> ModelSpec:
    """The run's model: ready, or the caller's ``layout`` (module contract)."""
    config = run_info.get("config") or {}
    hf = run_info.get(HF_MODEL_CONFIG_KEY)
    if config.get("model_factory"):
        if layout is not None:
            return ModelSpec(layout, None)
        raise ValueError(f"the run's model comes from model_factory "
                         f"{config['model_factory']!r}; {_READY}: {_FIX}")
    if isinstance(hf, dict):
        if hf.get("model_type") != "llama":
            if layout is not None:
                return ModelSpec(layout, None)
            tied = " with tied embeddings" if hf.get("tie_word_embeddings") else ""
            raise ValueError(f"the run's model is a Hugging Face {hf.get('model_type')!r}"
                             f"{tied}, which has no ready map; {_READY}: {_FIX}")
        return ModelSpec(layout or llama_map_for(hf),
                         lambda params: FlaxLlama.from_hf_config(hf))
    n_layers = len({k.split(".")[1] for k in model_tensors if k.startswith("blocks.")})
    n_heads = int((config.get("model") or {}).get("n_heads", 0))
    if n_heads < 1:
        raise ValueError("run.json: field config.model.n_heads is missing; the built-in GPT "
                         "needs it")
    return ModelSpec(layout or gpt_map(n_layers),
                     lambda params: FlaxGPT.for_params(params, n_heads))
