"""The BASIS parts of `benchmarks/gpu_scale/run.py`: step time and memory at real widths, and
quality on the GPU.

Contract:
- `measure_steps(widths, layers, seq, batch, rounds, device, dtype)`: the built-in GPT at
  each width (`layers[i]` blocks, d/128 heads, byte vocabulary) in four configurations —
  `exact`, `exact-recompute` (the MLP recomputed: exact gradients at BASIS's memory),
  `checkpoint` (every block recomputed) and `basis-default` (`trainer.train.model.SKETCH_LAYERS`,
  R = n/16, the MLP recomputed) — built side by side (`benchmarks.common_training.Trainee`,
  fused AdamW on CUDA, bf16 autocast), two warm-up rounds, then `rounds` rounds of one step
  each in turns; per configuration the median step time and its ratio to exact's in the
  same round, the step's peak memory above what it held before (CUDA) and the bytes autograd
  saves for backward, each over exact's.
- `measure_quality(corpus, seeds, steps, microbatch, model, device, dtype)`: exact backprop
  and the default plan trained from each seed on the embedded corpus (the project's loader,
  AdamW and warmup-cosine schedule) with `microbatch` sequences of 256 tokens per step; the
  final validation loss of each run and the default's mean over exact's.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from benchmarks.common_training import (
    QUALITY_SEQ,
    Trainee,
    autocast,
    evaluate,
    saved_bytes_of,
    train_step,
    val_indices,
)

CONFIGS: list[dict[str, Any]] = [
    {"name": "exact", "checkpoint": False, "mlp_recompute": "auto"},
    {"name": "exact-recompute", "checkpoint": False, "mlp_recompute": "always"},
    {"name": "checkpoint", "checkpoint": True, "mlp_recompute": "auto"},
    {"name": "basis-default", "checkpoint": False, "mlp_recompute": "auto", "sketched": True},
]
RANK_SHARE = 16  # R = n / 16, the rank the quality reports call the default
LR, WARMUP_SHARE, FINAL_EVAL_SEQS = 1e-3, 0.1, 256


def measure_steps(widths: list[int], layers: list[int], seq: int, batch: int, rounds: int,
                  device: torch.device, dtype: str) -> list[dict[str, Any]]:
    """Every configuration at each width, in turns (module contract)."""
    from trainer.train.model import SKETCH_LAYERS

    rows: list[dict[str, Any]] = []
    for d_model, n_layers in zip(widths, layers, strict=True):
        rank = max(1, batch * seq // RANK_SHARE)
        trainees = [Trainee({
            "rank": rank if c.get("sketched") else 0, "include": list(SKETCH_LAYERS),
            "checkpoint": c["checkpoint"], "mlp_recompute": c["mlp_recompute"],
            "seq_len": seq, "batch": batch, "device": str(device), "d_model": d_model,
            "n_layers": n_layers, "n_heads": max(1, d_model // 128), "dtype": dtype,
            "fused": device.type == "cuda"}) for c in CONFIGS]
        for _ in range(2):
            for trainee in trainees:
                trainee.step()  # Triton's compilation, cuBLAS heuristics, the allocator
        times = [[trainee.step() for trainee in trainees] for _ in range(rounds)]
        for i, (config, trainee) in enumerate(zip(CONFIGS, trainees, strict=True)):
            ratios = [row[i] / row[0] for row in times]
            with autocast(device, dtype):
                saved = saved_bytes_of(trainee.model, trainee.tokens, 0)
            rows.append({"d_model": d_model, "n_layers": n_layers, "name": config["name"],
                         "rank": rank if config.get("sketched") else 0,
                         "step_ms": 1e3 * statistics.median(r[i] for r in times),
                         "time_ratio": statistics.median(ratios),
                         "time_ratio_range": [min(ratios), max(ratios)],
                         "peak_bytes": trainee.peak_bytes(), "saved_bytes": saved})
        for row in rows[-len(CONFIGS):]:
            exact = rows[-len(CONFIGS)]
            row["peak_ratio"] = row["peak_bytes"] / exact["peak_bytes"] \
                if exact["peak_bytes"] else None
            row["saved_ratio"] = row["saved_bytes"] / exact["saved_bytes"]
            print(f"d {d_model} {row['name']:<16} {row['step_ms']:9.2f} ms "
                  f"x{row['time_ratio']:.3f} exact, peak x{row['peak_ratio'] or 0:.2f}, "
                  f"saved x{row['saved_ratio']:.2f}", flush=True)
        del trainees
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _train_one(corpus: str, seed: int, sketched: bool, steps: int, microbatch: int,
               model_shape: dict[str, int], device: torch.device, dtype: str) -> float:
    """One run's final validation loss."""
    from data_state import ResumableLoader, TokenDataset
    from sketch_ops import sketch_model
    from trainer.config import ModelConfig, OptimConfig
    from trainer.train.model import GPT, SKETCH_LAYERS
    from trainer.train.optim import WarmupCosine, build_optimizer

    train_set, val_set = TokenDataset(corpus, "train"), TokenDataset(corpus, "val")
    torch.manual_seed(seed)
    model = GPT(ModelConfig(vocab_size=256, **model_shape), seq_len=QUALITY_SEQ).to(device)
    if sketched:
        sketch_model(model, rank=max(1, microbatch * QUALITY_SEQ // RANK_SHARE),
                     include=list(SKETCH_LAYERS))
    cfg = OptimConfig(lr=LR, warmup_steps=max(1, round(WARMUP_SHARE * steps)))
    optimizer = build_optimizer(model, cfg)
    schedule = WarmupCosine(optimizer, cfg, steps)
    loader = ResumableLoader(train_set, global_batch=microbatch, microbatch_size=microbatch,
                             seed=seed)
    for step in range(steps):
        (mb,) = loader.next_step()
        with autocast(device, dtype):
            train_step(model, optimizer, schedule, mb.tokens.to(device), seed, step)
        loader.advance()
    loader.close()

    class OnDevice:  # the validation batches, moved to the model's device
        def batch(self, indices: list[int]) -> torch.Tensor:
            return val_set.batch(indices).to(device)

    with autocast(device, dtype):
        return evaluate(model, OnDevice(), val_indices(len(val_set), FINAL_EVAL_SEQS))


def measure_quality(corpus: str, seeds: list[int], steps: int, microbatch: int,
                    model_shape: dict[str, int], device: torch.device,
                    dtype: str) -> dict[str, Any]:
    """Exact and the default from each seed (module contract)."""
    final: dict[str, list[float]] = {"exact": [], "basis-default": []}
    for seed in seeds:
        for name in final:
            final[name].append(_train_one(corpus, seed, name != "exact", steps, microbatch,
                                          model_shape, device, dtype))
            print(f"quality seed {seed} {name}: val {final[name][-1]:.4f}", flush=True)
    ratio = statistics.fmean(final["basis-default"]) / statistics.fmean(final["exact"])
    return {"steps": steps, "microbatch": microbatch, "tokens_per_microbatch":
            microbatch * QUALITY_SEQ, "model": model_shape, "seeds": seeds,
            "final_val": final, "default_over_exact": ratio}
