"""The run's model and loss, built the same way on every rank, restart and world size.

Contract: `build_model(cfg, device)` is the same initial model on every rank (seeded by
`cfg.seed`): the Python API's `model_factory`, a Hugging Face model (`[model] hf_config` /
`init_from`) or the built-in GPT, with BASIS layers when sketching is on. `loss_function(cfg)`
is the run's loss; `next_token_loss` the built-in GPT's. `probe_args` and `speed_args` are
what `sketch.include = "auto"` measures with (the same on every rank, so P1 holds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from elastic.errors import FatalRunError
from sketch_ops import sketch_model
from trainer.config import ConfigError, FitConfig
from trainer.train.hf import build_hf_model, causal_lm_loss, dataset_vocab_size
from trainer.train.model import GPT, SKETCH_LAYERS
from trainer.train.precision import autocast


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting `tokens[:, 1:]` from `tokens[:, :-1]`."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def loss_function(cfg: FitConfig) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """The run's loss: the Python API's `loss_fn`, a Hugging Face model's own causal-LM loss,
    or the built-in GPT's `next_token_loss` (the same quantity for each)."""
    if cfg.loss_fn is not None:
        return cfg.loss_fn
    return causal_lm_loss if cfg.model.is_hf else next_token_loss


def build_model(cfg: FitConfig, device: torch.device | None = None) -> nn.Module:
    """The same initial model on every rank (seeded), on `device` (default: where it was
    built), with BASIS layers when sketching is on: the Python API's `model_factory`, a Hugging
    Face model (`[model] hf_config` / `init_from`, `trainer.train.hf`) or the built-in GPT. Layers
    are chosen by `sketch.include`: the built-in GPT's default is `SKETCH_LAYERS`, any other
    model's "auto" (`sketch_ops.probe`: one probe step on a microbatch of zeros, the same on
    every rank, so P1 holds)."""
    torch.manual_seed(cfg.seed)
    if cfg.model_factory is not None:
        model = cfg.model_factory()
    elif cfg.model.is_hf:
        try:  # the model's vocabulary must hold every token id of the data
            model = build_hf_model(cfg.model, dataset_vocab=dataset_vocab_size(cfg.data.uri))
        except ConfigError as err:  # the same on every restart: fail the run once
            raise FatalRunError(str(err)) from err
    else:
        model = GPT(cfg.model, seq_len=cfg.data.seq_len)
    if device is not None:
        model = model.to(device)
    sketch = cfg.sketch
    if sketch.enabled:
        builtin = cfg.model_factory is None and not cfg.model.is_hf
        include = sketch.include or (SKETCH_LAYERS if builtin else "auto")
        probe = probe_args(cfg, model) if include == "auto" else {}
        if sketch.rank:
            sketch_model(model, rank=sketch.rank, include=include, estimator=sketch.estimator,
                         **probe)
        else:
            sketch_model(
                model,
                memory_budget=int(sketch.memory_budget_mib * 2**20),
                rows=cfg.data.microbatch_size * (cfg.data.seq_len - 1),  # inputs per microbatch
                include=include,
                estimator=sketch.estimator,
                **probe,
            )
    return model


def probe_args(cfg: FitConfig, model: nn.Module) -> dict[str, Any]:
    """`sketch_model`'s probe for `include="auto"`: one microbatch of token id 0 (what is saved
    for backward depends on shapes, not values) through the run's loss, under its autocast,
    and the recipe's `sketch.min_saving` / `sketch.keep_gate` (and `max_quality_cost`'s
    `speed_args` when it is set)."""
    device = next(model.parameters()).device
    tokens = torch.zeros(cfg.data.microbatch_size, cfg.data.seq_len, dtype=torch.long,
                         device=device)
    run_loss = loss_function(cfg)

    def probe_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        with autocast(model, cfg.precision.dtype, device):
            return run_loss(model, batch)

    args = {"probe_batch": tokens, "loss_fn": probe_loss,
                "min_saving": cfg.sketch.min_saving, "keep_gate": cfg.sketch.keep_gate}
    if cfg.sketch.max_quality_cost > 0:
        args.update(speed_args(cfg, model, tokens.shape))
    return args


def speed_args(cfg: FitConfig, model: nn.Module, shape: torch.Size) -> dict[str, Any]:
    """auto's speed rule (`sketch.max_quality_cost`): the device's rates, modelled (never timed:
    every rank and restart decides alike) for the run's dtype, and random token ids (seeded by
    the run's seed) to measure gradient errors on, all-zero tokens being degenerate there."""
    from sketch_ops import device_rates

    device = next(model.parameters()).device
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision.dtype,
                                                                 torch.float32)
    vocab = min((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)),
                default=1)
    generator = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, vocab, tuple(shape), generator=generator).to(device)
    return {"max_quality_cost": cfg.sketch.max_quality_cost, "quality_batch": tokens,
            "rates": device_rates(device, dtype, measure=False)}
