"""The fresh processes of `benchmarks/sketch_quality/run.py`: a memory probe, a time probe and a
training run of one variant, each on one compute thread.

    python -m benchmarks.sketch_quality.worker probe VARIANT_JSON   # run with MALLOC_ENV
    python -m benchmarks.sketch_quality.worker time VARIANT_JSON
    python -m benchmarks.sketch_quality.worker train '{"variant": VARIANT_JSON, "seed": S}'

Each prints one JSON line. `build(v, seed)` (model, optimizer, schedule of a variant) is also
what the gradient-error measurement and the tests use.
"""

from __future__ import annotations

import fnmatch
import statistics
import time
from typing import Any

import torch
from torch import nn

from benchmarks.common import alternating, reset_peak_rss, status_bytes, worker_main
from benchmarks.common_training import evaluate, saved_bytes_of, train_step, val_indices
from benchmarks.sketch_quality.variants import (
    D_MODEL,
    DATA,
    EVAL_EVERY,
    EVAL_SEQS,
    FINAL_EVAL_SEQS,
    LR,
    N_HEADS,
    N_LAYERS,
    N_ROWS,
    SEQ,
    STEPS,
    TIME_ROUNDS,
    WARMUP,
    Variant,
    variant,
)


def build(v: Variant, seed: int) -> tuple[Any, Any, Any]:
    """Model, optimizer and schedule for `v`, initialised from `seed`."""
    from sketch_ops import sketch_model
    from trainer.config import ModelConfig, OptimConfig
    from trainer.train.model import GPT
    from trainer.train.optim import WarmupCosine, build_optimizer

    torch.manual_seed(seed)
    model = GPT(
        ModelConfig(
            d_model=D_MODEL,
            n_layers=N_LAYERS,
            n_heads=N_HEADS,
            checkpoint_blocks=v.checkpoint,
            mlp_recompute=v.mlp_recompute,
            fuse_norms=v.fuse_norms,
        ),
        seq_len=SEQ,
    )
    include = list(v.include) if v.include else None
    if v.rank:
        sketch_model(model, rank=v.rank, include=include, estimator=v.estimator)
    elif v.budget_rank:
        # The bytes uniform R = budget_rank would spend on the same layers, shared out per layer.
        widths = [m.in_features for n, m in model.named_modules() if selected(n, m, include)]
        budget = v.budget_rank * sum(widths) * 4
        sketch_model(
            model, memory_budget=budget, rows=N_ROWS, include=include, estimator=v.estimator
        )
    # The warmup is the same fraction of every run (runs of the memory comparison are shorter).
    warmup = max(1, round(WARMUP * v.steps / STEPS))
    optim_cfg = OptimConfig(lr=LR * v.lr_scale, warmup_steps=warmup)
    optimizer = build_optimizer(model, optim_cfg)
    return model, optimizer, WarmupCosine(optimizer, optim_cfg, v.steps)


def selected(name: str, module: Any, include: list[str] | None) -> bool:
    """Whether `sketch_model(include=include)` would select the module `name`."""
    return (
        type(module) is nn.Linear
        and bool(name)
        and (include is None or any(fnmatch.fnmatchcase(name, p) for p in include))
    )


def probe(v: Variant) -> dict[str, Any]:
    """Step peak memory and saved bytes of `v` (random tokens, seed 0). Run with MALLOC_ENV."""
    torch.set_num_threads(1)
    model, optimizer, schedule = build(v, 0)
    tokens = _probe_tokens(v)
    saved = saved_bytes_of(model, tokens, 0)
    for step in range(2):  # optimizer state and lazy buffers exist after this
        train_step(model, optimizer, schedule, tokens, 0, step)
    rest = status_bytes("VmRSS")
    reset_peak_rss()
    for step in range(2, 4):
        train_step(model, optimizer, schedule, tokens, 0, step)
    return {"step_peak_mib": (status_bytes("VmHWM") - rest) / 2**20, "saved_mib": saved / 2**20}


def time_probe(v: Variant) -> dict[str, Any]:
    """`v`'s step time and exact backprop's, measured in one process, alternating steps, as CPU
    time of the one compute thread (steadier than wall time on a shared machine). Their ratio
    is what equal-wall-time runs are sized by."""
    torch.set_num_threads(1)
    runs = [(*build(spec, 0), _probe_tokens(spec)) for spec in (v, variant("exact"))]
    times: list[list[float]] = [[], []]
    for step in range(2 + TIME_ROUNDS):
        for i in alternating((1, 0), step):  # ABBA: neither always runs first
            model, optimizer, schedule, tokens = runs[i]
            start = time.thread_time()
            train_step(model, optimizer, schedule, tokens, 0, step)
            if step >= 2:  # the first two steps create optimizer state and lazy buffers
                times[i].append(time.thread_time() - start)
    step_s, exact_s = (statistics.median(t) for t in times)
    return {"step_s": step_s, "exact_step_s": exact_s, "step_time_ratio": step_s / exact_s}


def _probe_tokens(v: Variant) -> Any:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (v.microbatch, SEQ + 1), generator=gen)


def train(v: Variant, seed: int) -> dict[str, Any]:
    """Train `v` from `seed`; the validation curve, final loss, peak memory and timing."""
    from data_state import ResumableLoader, TokenDataset

    torch.set_num_threads(1)
    train_set, val_set = TokenDataset(str(DATA), "train"), TokenDataset(str(DATA), "val")
    curve_idx = val_indices(len(val_set), EVAL_SEQS)
    final_idx = val_indices(len(val_set), FINAL_EVAL_SEQS)
    model, optimizer, schedule = build(v, seed)
    loader = ResumableLoader(
        train_set, global_batch=v.microbatch, microbatch_size=v.microbatch, seed=seed
    )
    curve: list[tuple[int, float]] = [(0, evaluate(model, val_set, curve_idx))]
    losses: list[float] = []
    train_s = 0.0
    reset_peak_rss()
    for step in range(v.steps):
        (mb,) = loader.next_step()
        start = time.perf_counter()
        losses.append(train_step(model, optimizer, schedule, mb.tokens, seed, step))
        train_s += time.perf_counter() - start
        loader.advance()
        if (step + 1) % EVAL_EVERY == 0 or step + 1 == v.steps:
            curve.append((step + 1, evaluate(model, val_set, curve_idx)))
    loader.close()
    return {
        "variant": v.name,
        "seed": seed,
        "steps": v.steps,
        "microbatch": v.microbatch,
        "tokens": v.steps * v.microbatch * SEQ,
        "val_curve": curve,
        "train_loss": losses,
        "final_val": evaluate(model, val_set, final_idx),
        "peak_rss_mib": status_bytes("VmHWM") / 2**20,
        "train_s": train_s,
    }


def _train(payload: dict[str, Any]) -> dict[str, Any]:
    return train(Variant(**payload["variant"]), payload["seed"])


if __name__ == "__main__":
    raise SystemExit(worker_main({
        "probe": lambda fields: probe(Variant(**fields)),
        "time": lambda fields: time_probe(Variant(**fields)),
        "train": _train,
    }))
