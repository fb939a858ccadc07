"""The fresh processes of `benchmarks/sketch_llama/run.py`, each on one compute thread:

    python -m benchmarks.sketch_llama.worker memory '{"size": ..., "data": ..., "variant": ...}'
    python -m benchmarks.sketch_llama.worker time '{"size": ..., "data": ..., "variants": [...]}'
    python -m benchmarks.sketch_llama.worker train '{"size": ..., "data": ..., "variant": ...,
                                                    "seed": S}'

Each prints one JSON line. The driver runs `memory` under `common.malloc_env` (64 KiB, trim),
the others under glibc's defaults; its `--quick` smoke run calls `MODES` in its own process.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import ratios, reset_peak_rss, rotated, status_bytes, worker_main
from benchmarks.common_training import evaluate, saved_bytes_of, train_step, val_indices
from benchmarks.sketch_llama.variants import Size, Variant, build, random_tokens


def memory_probe(v: Variant, size: Size, vocab: int, seq: int) -> dict[str, Any]:
    """Saved-for-backward bytes and the step's peak resident memory above the resting process,
    at the probe microbatch. Run in a fresh process under `common.malloc_env`."""
    torch.set_num_threads(1)
    tokens = random_tokens(vocab, size.probe_microbatch, seq)
    model, optimizer, schedule = build(v, size, vocab, seq, size.probe_microbatch, 0, tokens)
    saved = saved_bytes_of(model, tokens, 0)
    for step in range(2):  # optimizer state and lazy buffers exist after this
        train_step(model, optimizer, schedule, tokens, 0, step)
    rest = status_bytes("VmRSS")
    reset_peak_rss()
    for step in range(2, 4):
        train_step(model, optimizer, schedule, tokens, 0, step)
    return {"saved_bytes": saved, "step_peak_bytes": status_bytes("VmHWM") - rest}


def time_probe(variants: list[Variant], size: Size, vocab: int, seq: int) -> dict[str, Any]:
    """Every variant's step time as CPU time of one compute thread, one step of each per round
    in rotating order (none always first), after two warm-up rounds; per variant the median
    step and the median and range over rounds of its ratio to exact (variants[0])."""
    torch.set_num_threads(1)
    tokens = random_tokens(vocab, size.probe_microbatch, seq)
    runs = [build(v, size, vocab, seq, size.probe_microbatch, 0, tokens) for v in variants]
    times: list[list[float]] = [[] for _ in variants]
    for step in range(2 + size.time_rounds):
        for i in rotated(range(len(variants)), step):
            model, optimizer, schedule = runs[i]
            start = time.thread_time()
            train_step(model, optimizer, schedule, tokens, 0, step)
            if step >= 2:
                times[i].append(time.thread_time() - start)
    result = {}
    for v, row in zip(variants, times, strict=True):
        r = ratios(row, times[0])
        result[v.name] = {
            "step_s": statistics.median(row),
            "time_ratio": r["median"],
            "time_ratio_range": [r["min"], r["max"]],
        }
    return result


def train(v: Variant, size: Size, data: str, seed: int) -> dict[str, Any]:
    """Train `v` from `seed` for size.steps microbatches of the corpus; the validation curve
    and the final validation loss over a fixed subset of the val split."""
    from data_state import ResumableLoader, TokenDataset

    torch.set_num_threads(1)
    train_set, val_set = TokenDataset(data, "train"), TokenDataset(data, "val")
    seq = train_set.seq_len - 1
    mb = size.train_microbatch
    model, optimizer, schedule = build(
        v, size, train_set.vocab_size, seq, mb, seed, random_tokens(train_set.vocab_size, mb, seq)
    )
    curve_idx = val_indices(len(val_set), size.eval_seqs)
    loader = ResumableLoader(train_set, global_batch=mb, microbatch_size=mb, seed=seed)
    curve = [(0, evaluate(model, val_set, curve_idx))]
    train_s = 0.0
    for step in range(size.steps):
        (batch,) = loader.next_step()
        start = time.perf_counter()
        train_step(model, optimizer, schedule, batch.tokens, seed, step)
        train_s += time.perf_counter() - start
        loader.advance()
        if (step + 1) % size.eval_every == 0 or step + 1 == size.steps:
            curve.append((step + 1, evaluate(model, val_set, curve_idx)))
    loader.close()
    final_idx = val_indices(len(val_set), size.final_eval_seqs)
    return {
        "variant": v.name,
        "seed": seed,
        "steps": size.steps,
        "tokens_per_step": mb * seq,
        "val_curve": curve,
        "final_val": evaluate(model, val_set, final_idx),
        "train_s": train_s,
    }


def _payload_parts(p: dict[str, Any]) -> tuple[Size, int, int]:
    """The size, and the vocabulary and predicted tokens per sequence of the prepared data."""
    from data_state.dataset import read_manifest

    manifest = read_manifest(p["data"])
    return Size(**p["size"]), manifest.vocab_size, manifest.seq_len - 1


def _memory_child(p: dict[str, Any]) -> Any:
    size, vocab, seq = _payload_parts(p)
    return memory_probe(Variant(**_variant_fields(p["variant"])), size, vocab, seq)


def _time_child(p: dict[str, Any]) -> Any:
    size, vocab, seq = _payload_parts(p)
    return time_probe([Variant(**_variant_fields(v)) for v in p["variants"]], size, vocab, seq)


def _train_child(p: dict[str, Any]) -> Any:
    return train(Variant(**_variant_fields(p["variant"])), Size(**p["size"]), p["data"], p["seed"])


def _variant_fields(fields: dict[str, Any]) -> dict[str, Any]:
    include = fields.get("include")  # JSON turned the glob tuple into a list
    return {**fields, "include": tuple(include) if isinstance(include, list) else include}


MODES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "memory": _memory_child,
    "time": _time_child,
    "train": _train_child,
}


if __name__ == "__main__":
    raise SystemExit(worker_main(MODES))
