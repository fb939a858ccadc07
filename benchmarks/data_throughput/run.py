"""Is the data pipeline ever the bottleneck? Loader throughput against training consumption.

Measured in one run, on the default corpus (Python's stdlib, byte tokens, seq_len 256):
- training consumption: tokens/s the built-in GPT (d_model 256, 4 layers, 4 heads, vocab 256,
  microbatch 8 x 256 tokens, fp32, AdamW) trains on this machine, median step time after a
  warm-up step, measured before and after the loader runs (the faster is used);
- loader delivery: tokens/s `ResumableLoader` hands to one worker (world size 1, global batch
  64 = 8 microbatches of 8, `next_step()` + `advance()` with nothing else running), from local
  disk and from an S3 API on 127.0.0.1 (moto's ThreadedMotoServer, started here, in this
  process), each with the default 64 MiB row-group cache and with the cache off (every sample
  decodes its row group again: the worst case of a dataset far larger than the cache), and on
  S3 once more with hole merging off (one request per row group: the request-bound case);
- the stall: a short training run fed by the S3 loader, and the share of its time spent
  waiting in `next_step()` (prefetch hides the loading behind training).

The ratio delivery / consumption is the figure of merit (target >= 20). The machine is small
and shared: absolute numbers vary by tens of percent between runs, ratios much less.

    python -m benchmarks.data_throughput.run  # writes benchmarks/results/data_throughput.json
    python -m benchmarks.data_throughput.run --quick  # fewer steps (smoke run)
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, arg_parser, moto_s3, write_json
from benchmarks.common_training import training_tokens_per_s
from data_state import ResumableLoader, TokenDataset, prepare_corpus
from trainer.config import ModelConfig
from trainer.train.model import GPT

DEFAULT_OUT = RESULTS / "data_throughput.json"
SEQ_LEN, MICROBATCH, GLOBAL_BATCH = 256, 8, 64
CASES = [  # (source, uri: "local" or "s3", cache, hole limit: None = the default for the store)
    ("local disk", "local", 64 << 20, None),
    ("local disk", "local", 0, None),
    ("S3 (moto, 127.0.0.1)", "s3", 64 << 20, None),
    ("S3 (moto, 127.0.0.1)", "s3", 0, None),
    ("S3 (moto, 127.0.0.1)", "s3", 0, 0),  # one request per row group
]


def loader_tokens_per_s(uri: str, steps: int, *, cache_bytes: int, hole_limit: int | None) -> dict:
    with TokenDataset(uri, cache_bytes=cache_bytes, hole_limit=hole_limit) as ds:
        with ResumableLoader(
            ds, global_batch=GLOBAL_BATCH, microbatch_size=MICROBATCH, seed=0
        ) as loader:
            start = time.perf_counter()
            tokens = 0
            for _ in range(steps):
                tokens += sum(mb.tokens.numel() for mb in loader.next_step())
                loader.advance()
            elapsed = time.perf_counter() - start
        # Bytes read from storage (compressed) per token delivered: what random access costs.
        amplification = ds.stats["bytes_fetched"] / tokens
        return {
            "tokens_per_s": tokens / elapsed,
            "samples": steps * GLOBAL_BATCH,
            "dataset_samples": len(ds),
            "read_amplification": amplification,
            **ds.stats,
        }


def stall_share(uri: str, steps: int) -> float:
    """Share of a training run's time spent waiting for data (one worker, S3, prefetch on)."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=256, d_model=256, n_layers=4, n_heads=4), seq_len=SEQ_LEN)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    waited = 0.0
    with (
        TokenDataset(uri) as ds,
        ResumableLoader(ds, global_batch=MICROBATCH, microbatch_size=MICROBATCH, seed=1) as loader,
    ):
        loader.next_step()  # start the prefetcher before the clock, as a running job would have
        start = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            (mb,) = loader.next_step()
            waited += time.perf_counter() - t0
            model.loss(mb.tokens).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loader.advance()
        total = time.perf_counter() - start
    return waited / total


def measure(tmp: str, train_steps: int, loader_steps: int) -> dict[str, Any]:
    """Prepare the corpus locally and on S3, then training consumption (before and after),
    every loader case and the stall of training fed from S3."""
    started = time.perf_counter()
    manifest = prepare_corpus(None, tmp, seq_len=SEQ_LEN, progress=False)
    prepare_s = time.perf_counter() - started
    s3_uri = "s3://baton-bench/corpus"
    started = time.perf_counter()
    prepare_corpus(None, s3_uri, seq_len=SEQ_LEN, progress=False)
    prepare_s3_s = time.perf_counter() - started
    with TokenDataset(tmp) as ds:
        train = training_tokens_per_s(ds, train_steps)
    rows = []
    for source, where, cache_bytes, hole_limit in CASES:
        uri = tmp if where == "local" else s3_uri
        result = loader_tokens_per_s(uri, loader_steps, cache_bytes=cache_bytes,
                                     hole_limit=hole_limit)
        rows.append({"source": source, "cache_mib": cache_bytes >> 20,
                     "hole_limit": "default" if hole_limit is None else hole_limit,
                     **result, "ratio_to_training": result["tokens_per_s"] / train})
    stall = stall_share(s3_uri, max(3, train_steps))
    # Measured again at the end; the faster of the two is used, which is the conservative
    # choice for the ratio when other work shares the CPU meanwhile.
    with TokenDataset(tmp) as ds:
        train_again = training_tokens_per_s(ds, train_steps)
    for row in rows:
        row["ratio_to_training"] = row["tokens_per_s"] / max(train, train_again)
    return {"manifest": manifest, "prepare_s": prepare_s, "prepare_s3_s": prepare_s3_s,
            "rows": rows, "stall": stall, "train_runs": [train, train_again]}


def main() -> int:
    parser = arg_parser(__doc__, __spec__)
    parser.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    train_steps, loader_steps = (3, 20) if args.quick else (8, 150)
    with moto_s3("baton-bench"), tempfile.TemporaryDirectory() as tmp:
        got = measure(tmp, train_steps, loader_steps)
    manifest, rows, train = got["manifest"], got["rows"], max(got["train_runs"])
    corpus_tokens = sum(s.num_tokens for s in manifest.splits.values())
    meta = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "corpus_files": len(manifest.sources["files"]),
        "corpus_tokens": corpus_tokens,
        "prepare_local_s": got["prepare_s"],
        "prepare_s3_s": got["prepare_s3_s"],
        "training_tokens_per_s": train,
        "training_tokens_per_s_runs": got["train_runs"],
        "stall_share_s3": got["stall"],
        "model": "GPT d_model 256, 4 layers, 4 heads, seq 256, microbatch 8, fp32 AdamW",
        "loader": f"world size 1, global batch {GLOBAL_BATCH}, microbatch {MICROBATCH}",
    }
    write_json(args.out, {"meta": meta, "results": rows}, indent=2)
    print_result(meta, rows)
    print(f"wrote {args.out}")
    return 0


def print_result(meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    train = meta["training_tokens_per_s"]
    print(
        f"default corpus: {meta['corpus_files']} files, {meta['corpus_tokens'] / 1e6:.1f} M "
        f"tokens; prepared in {meta['prepare_local_s']:.1f} s (local), "
        f"{meta['prepare_s3_s']:.1f} s (S3)"
    )
    print(
        f"training consumes {train:,.0f} tokens/s ({meta['model']}; runs: "
        + ", ".join(f"{t:,.0f}" for t in meta["training_tokens_per_s_runs"])
        + ")"
    )
    print(
        f"{'source':<22} {'cache':>6} {'holes':>8} {'tokens/s':>11} {'x training':>11} "
        f"{'requests':>9} {'bytes read/token':>17}"
    )
    for r in rows:
        print(
            f"{r['source']:<22} {r['cache_mib']:>4}Mi {r['hole_limit']!s:>8} "
            f"{r['tokens_per_s']:>11,.0f} {r['ratio_to_training']:>10.1f}x {r['requests']:>9} "
            f"{r['read_amplification']:>17.2f}"
        )
    print(f"training fed from S3: {100 * meta['stall_share_s3']:.1f}% of the time waiting for data")


if __name__ == "__main__":
    raise SystemExit(main())
