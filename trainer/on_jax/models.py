"""Which Flax module and layout map a run's model has: the built-in GPT or a Llama.

Contract: ``for_run(run_info, model_tensors)`` reads ``run.json`` (``run_info``) and the
snapshot's model tensor names (``model_tensors``: fqn -> array) and returns a ``ModelSpec``:
its ``layout`` (``trainer.on_jax.layout_map``), ``module(params)`` (the Flax module for a params
tree) and ``loss_fn(module, params, tokens)``. A run of the built-in GPT (no Hugging Face
config in ``run.json``) gets ``gpt_map`` and ``FlaxGPT`` (heads from the recipe's
``model.n_heads``, the rest from the shapes); a run of a Hugging Face model whose config says
``model_type = "llama"`` gets ``llama_map_for`` and ``FlaxLlama``. Anything else is
``ValueError`` saying which layout map to pass (a ``model_factory`` run, another HF family).
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
from trainer.train.continuation import HF_MODEL_CONFIG_KEY


@dataclass(frozen=True)
class ModelSpec:
    layout: LayoutMap
    module: Callable[[Any], nn.Module]
    loss_fn: Callable[[nn.Module, Any, jax.Array], jax.Array] = next_token_loss


def for_run(run_info: dict[str, Any], model_tensors: dict[str, Any]) -> ModelSpec:
    """The run's ready model (module contract)."""
    config = run_info.get("config") or {}
    hf = run_info.get(HF_MODEL_CONFIG_KEY)
    if config.get("model_factory"):
        raise ValueError(f"the run's model comes from model_factory "
                         f"{config['model_factory']!r}; pass layout= with a LayoutMap for it")
    if isinstance(hf, dict):
        if hf.get("model_type") != "llama":
            raise ValueError(f"the run's model is a Hugging Face {hf.get('model_type')!r}; "
                             "the ready maps are the built-in GPT's and Llama's: pass layout=")
        return ModelSpec(llama_map_for(hf), lambda params: FlaxLlama.from_hf_config(hf))
    n_layers = len({k.split(".")[1] for k in model_tensors if k.startswith("blocks.")})
    n_heads = int((config.get("model") or {}).get("n_heads", 0))
    if n_heads < 1:
        raise ValueError("run.json: field config.model.n_heads is missing; the built-in GPT "
                         "needs it")
    return ModelSpec(gpt_map(n_layers), lambda params: FlaxGPT.for_params(params, n_heads))
