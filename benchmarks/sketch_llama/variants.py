"""The configurations of `benchmarks/sketch_llama/run.py`: the model sizes, the variants, and how
each variant's Llama is built (fusions and sketches applied).

Contract: `FULL` / `QUICK` sizes, `VARIANTS`, `variant(name)`; `missing_pieces(v)` says why a
variant cannot be built with this checkout's sketch_ops; `build(...)` returns its model (seen
through `loss(tokens)`), optimizer and schedule.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from benchmarks.common import ROOT

LLAMA_TINY = ROOT / "recipes" / "llama-tiny" / "config.json"
SEEDS = (0, 1, 2)
RANK_DIVISOR = 16  # R = n / 16
QUALITY_TARGET_PCT, MEMORY_TARGET, TIME_TARGET = 2.0, 0.55, 1.0  # issue 16, point 4


@dataclasses.dataclass(frozen=True)
class Size:
    """The model and the workload; FULL is the issue's, QUICK a smoke run's."""

    d_model: int = 256
    intermediate: int = 688
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    probe_microbatch: int = 16  # × seq predicted tokens: memory and time
    train_microbatch: int = 4  # × seq predicted tokens: the quality runs
    steps: int = 300
    lr: float = 1e-3
    warmup: int = 30
    eval_every: int = 50
    eval_seqs: int = 64
    final_eval_seqs: int = 512
    time_rounds: int = 8


FULL = Size()
QUICK = Size(
    d_model=32,
    intermediate=64,
    layers=1,
    heads=2,
    kv_heads=1,
    probe_microbatch=4,
    train_microbatch=2,
    steps=4,
    warmup=1,
    eval_every=2,
    eval_seqs=4,
    final_eval_seqs=8,
    time_rounds=2,
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One configuration. sketched False = exact gradients."""

    name: str
    label: str
    sketched: bool = False
    include: str | tuple[str, ...] | None = None  # sketch_model's include; None = every linear
    fuse: bool = False  # apply the SwiGLU MLP and RMSNorm fusions ("auto" applies them itself)
    recompute: bool | None = None  # the fused MLP's mode: True recomputes around a plain down
    # The fused MLP keeps gate's output and recomputes only up (True) or keeps only its input
    # (False); None = the library's default (sketch_ops.swiglu.KEEP_GATE).
    keep_gate: bool | None = None
    min_saving: float | None = None  # "auto"'s threshold; None = its default (probe.MIN_SAVING)
    train: bool = True  # False: probed only (exact gradients, or a contrast not worth the time)


VARIANTS = [
    Variant("exact", "exact backprop"),
    Variant(
        "exact-recompute",
        "exact, MLP recomputed + norms fused",
        fuse=True,
        recompute=True,
        keep_gate=False,  # exact gradients at the least memory: keeps only the MLP input
        train=False,
    ),
    Variant("auto", 'BASIS R=n/16, include="auto" (fusions + probe)', sketched=True,
            include="auto"),
    # The same, the fused MLP keeping only its input: one n x I tensor less per MLP, one matmul
    # more (its gradients are "auto"'s up to rounding: tests/sketch/test_sketch_swiglu.py).
    Variant("auto-keep-x", 'BASIS R=n/16, include="auto", keep_gate=False', sketched=True,
            include="auto", keep_gate=False, train=False),
    # What "auto" should choose on this Llama, by name: the built-in GPT's policy carried over
    # (the fusions, and only the down-projections sketched; the MLP recomputes around them).
    Variant("fused-down", "BASIS R=n/16, down_proj only + fusions (by name)", sketched=True,
            include=("*down_proj",), fuse=True, train=False),
    # "auto" without its threshold: every class that frees anything (q/k/v, the LM head too).
    Variant("auto-all", 'BASIS R=n/16, include="auto", min_saving=0', sketched=True,
            include="auto", min_saving=0.0),
    Variant("down-proj", "BASIS R=n/16, down_proj only, no fusion", sketched=True,
            include=("*down_proj",), train=False),
    Variant("all-linears", "BASIS R=n/16, every nn.Linear, no fusion (old default)",
            sketched=True, train=False),
]


def variant(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    known = ", ".join(v.name for v in VARIANTS)
    raise SystemExit(f"--only: unknown variant {name!r}; known: {known}")


# --------------------------------------------------------------------------- the model


class CausalLM:
    """A Hugging Face causal LM seen through the built-in GPT's `loss(tokens)`, so the shared
    `train_step`, `evaluate` and `saved_bytes_of` (benchmarks/common_training.py) apply."""

    def __init__(self, hf_model: Any) -> None:
        self.hf = hf_model

    def loss(self, tokens: Any) -> Any:
        from trainer.train.hf import causal_lm_loss

        return causal_lm_loss(self.hf, tokens)

    def __getattr__(self, name: str) -> Any:  # parameters(), train(), eval(), zero_grad()
        return getattr(self.hf, name)


def llama(size: Size, vocab: int, seq: int) -> Any:
    """recipes/llama-tiny/config.json at `size`, random init from torch's global RNG."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    raw = json.loads(LLAMA_TINY.read_text())
    raw.update(
        hidden_size=size.d_model,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.d_model // size.heads,
        vocab_size=vocab,
        max_position_embeddings=seq + 1,
        use_cache=False,
    )
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["llama"].from_dict(raw))
    return model.float()


def missing_pieces(v: Variant) -> str | None:
    """Why `v` cannot be built with the sketch_ops of this checkout (None: it can)."""
    import importlib.util

    needs = []
    if v.fuse or v.include == "auto":  # "auto" applies the fusions itself, when they exist
        needs += ["sketch_ops.swiglu", "sketch_ops.rms_norm"]
    if v.include == "auto":
        needs.append("sketch_ops.probe")
    absent = [name for name in needs if importlib.util.find_spec(name) is None]
    return f"needs {', '.join(absent)}" if absent else None


def build(v: Variant, size: Size, vocab: int, seq: int, microbatch: int, seed: int,
          probe_tokens: Any) -> tuple[CausalLM, Any, Any]:
    """Model (fusions and sketches applied), optimizer and schedule of `v`, from `seed`.
    `probe_tokens` is the microbatch `include="auto"` probes (random tokens: what is saved
    for backward does not depend on their values)."""
    import torch

    from sketch_ops import sketch_model
    from trainer.config import OptimConfig
    from trainer.train.hf import causal_lm_loss
    from trainer.train.optim import WarmupCosine, build_optimizer

    torch.manual_seed(seed)
    hf = llama(size, vocab, seq)
    if v.fuse:
        from sketch_ops.rms_norm import fuse_rms_norms
        from sketch_ops.swiglu_find import fuse_swiglu_mlps

        mode = {} if v.keep_gate is None else {"keep_gate": v.keep_gate}
        fuse_swiglu_mlps(hf, recompute=v.recompute, **mode)
        fuse_rms_norms(hf)
    if v.sketched:
        rank = microbatch * (seq + 1) // RANK_DIVISOR  # n = rows of every linear layer
        include = list(v.include) if isinstance(v.include, tuple) else v.include
        auto: dict[str, Any] = {}
        if include == "auto":
            auto = {"probe_batch": probe_tokens, "loss_fn": causal_lm_loss}
            if v.keep_gate is not None:
                auto["keep_gate"] = v.keep_gate
            if v.min_saving is not None:
                auto["min_saving"] = v.min_saving
        sketched = sketch_model(hf, rank=rank, include=include, **auto)
        if os.environ.get("SKETCH_LLAMA_VERBOSE"):
            print(f"{v.name}: R={rank}, sketched {sketched}", file=sys.stderr)
    model = CausalLM(hf)
    cfg = OptimConfig(lr=size.lr, warmup_steps=size.warmup)
    optimizer = build_optimizer(hf, cfg)
    return model, optimizer, WarmupCosine(optimizer, cfg, size.steps)


def random_tokens(vocab: int, microbatch: int, seq: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (microbatch, seq + 1), generator=gen)
