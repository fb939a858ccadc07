"""How fast does `baton data prepare` tokenize, and does the loader keep up with uint16 tokens?

Measured in one run, on a prefix of the default corpus (Python's stdlib `.py` files):
- a byte-level BPE of 8,192 ids is trained once on that text (not timed) and saved;
- then, alternating, `rounds` times each: the `tokenizers` library's own `encode_batch` on
  the same documents already in memory (the reference: Rust, its own thread pool over every
  core; and its `encode_batch_fast`, no offsets, which Baton uses),
  `prepare_corpus(..., tokenizer=that file)` serial (reads the files, tokenizes with
  `encode_batch_fast` in this process, cuts sequences, writes zstd Parquet shards and the
  manifest) and with `workers=2` (two spawned processes; their start-up, about a torch import
  each, is inside the time; measured alone on one small file and also shown subtracted).
  MB/s = text bytes / seconds; medians and ranges; ratios of medians. Target: serial >= 0.8x
  the reference;
- the loader on the prepared uint16 dataset (seq_len 256), local and S3 (moto on 127.0.0.1,
  started here): tokens/s delivered to one worker (`ResumableLoader`, global batch 64 of
  microbatches of 8, default cache) against tokens/s the built-in GPT with that vocabulary
  (d_model 256, 4 layers, fp32 AdamW, microbatch 8) trains on. Target >= 20x;
- worker scaling, the tokenizer pinned to one thread per process: each run is a fresh
  interpreter (`benchmarks/data_prepare/worker.py`) started with RAYON_NUM_THREADS=1 (set before
  `tokenizers` loads, so the serial path cannot use a thread pool either), timing
  `prepare_corpus` serial (1 process x 1 thread) and with `workers=2` (2 processes x 1 thread,
  their spawn inside the time), alternating, on more text (8 MB by default) so start-up is
  amortized. Speed-up = ratio of medians; `os.cpu_count()` and the load average at start and end
  are recorded, since on a shared machine other jobs take cores from both sides.

The machine is small and shared: absolute numbers move between runs, ratios much less.

    python -m benchmarks.data_prepare.run            # writes benchmarks/results/data_prepare.json
    python -m benchmarks.data_prepare.run --quick    # smaller text, fewer rounds (smoke run)
    python -m benchmarks.data_prepare.run --scaling-only   # only scaling, merged into "scaling"
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

# Not `from data_state import TokenDataset` here: that loads torch, and the spawned workers of
# `workers=2` import this module again, so each would pay a torch import inside the timed runs.
# `benchmarks.common` imports only the standard library.
from benchmarks.common import RESULTS, arg_parser, moto_s3, read_json, spread, write_json
from benchmarks.data_prepare.scaling import SEQ_LEN, print_scaling, worker_scaling
from data_state.corpus import default_corpus_files, prepare_corpus
from data_state.discover import cap

DEFAULT_OUT = RESULTS / "data_prepare.json"
MICROBATCH, GLOBAL_BATCH, VOCAB = 8, 64, 8192


def corpus_prefix(max_bytes: int) -> tuple[list[str], list[str], int]:
    """(paths, texts, bytes) of the first UTF-8 default-corpus files up to `max_bytes` (a few
    stdlib files are Latin-1 test data: `prepare` would skip them, so they are left out here
    and every byte counted is a byte tokenized)."""
    from data_state.discover import InputFile

    inputs: list[InputFile] = []
    texts: list[str] = []
    for f in default_corpus_files():
        try:
            text = Path(f.path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        inputs.append(InputFile(f.name, f.path, "text", os.path.getsize(f.path)))
        texts.append(text)
    inputs = cap(inputs, max_bytes)
    texts = texts[: len(inputs)]
    return [f.uri for f in inputs], texts, sum(len(t.encode()) for t in texts)


def tokenize_rounds(paths: list[str], texts: list[str], nbytes: int, tokenizer_file: str,
                    rounds: int, tmp: str) -> dict[str, list[float]]:
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(tokenizer_file)
    runs: dict[str, list[float]] = {"encode_batch": [], "encode_batch_fast": [], "serial": [],
                                    "workers=2": []}
    for r in range(rounds):
        for method in ("encode_batch", "encode_batch_fast"):
            start = time.perf_counter()
            getattr(reference, method)(texts, add_special_tokens=False)
            runs[method].append(nbytes / 1e6 / (time.perf_counter() - start))
        for name, workers in (("serial", 1), ("workers=2", 2)):
            start = time.perf_counter()
            prepare_corpus(paths, f"{tmp}/{name}-{r}", seq_len=SEQ_LEN, val_fraction=0.0,
                           tokenizer=tokenizer_file, workers=workers, progress=False)
            runs[name].append(nbytes / 1e6 / (time.perf_counter() - start))
    return runs


def worker_start_s(path: str, tokenizer_file: str, tmp: str, rounds: int) -> float:
    """Median time of a `workers=2` run on one small file: mostly starting the processes."""
    times = []
    for r in range(rounds):
        start = time.perf_counter()
        prepare_corpus([path], f"{tmp}/start-{r}", seq_len=8, val_fraction=0.0,
                       tokenizer=tokenizer_file, workers=2, progress=False)
        times.append(time.perf_counter() - start)
    return spread(times)["median"]


def loader_tokens_per_s(uri: str, steps: int) -> float:
    from data_state.dataset import TokenDataset
    from data_state.loader import ResumableLoader

    with TokenDataset(uri) as ds, ResumableLoader(
        ds, global_batch=GLOBAL_BATCH, microbatch_size=MICROBATCH, seed=0
    ) as loader:
        start, tokens = time.perf_counter(), 0
        for _ in range(steps):
            tokens += sum(mb.tokens.numel() for mb in loader.next_step())
            loader.advance()
        return tokens / (time.perf_counter() - start)


def measure_prepare(paths: list[str], texts: list[str], nbytes: int, rounds: int,
                    tmp: str) -> dict[str, Any]:
    """Train the BPE (untimed), then the tokenize rounds and the worker start-up."""
    started = time.perf_counter()
    trained = prepare_corpus(paths, f"{tmp}/trained", seq_len=SEQ_LEN, val_fraction=0.0,
                             train_tokenizer=VOCAB, progress=False)
    train_s = time.perf_counter() - started
    tokenizer_file = f"{tmp}/trained/tokenizer.json"
    runs = tokenize_rounds(paths, texts, nbytes, tokenizer_file, rounds, tmp)
    stats = {name: spread(values) for name, values in runs.items()}
    startup = worker_start_s(paths[0], tokenizer_file, tmp, rounds)
    # workers=2 without its fixed start-up: what a corpus much larger than this one sees.
    steady = [nbytes / 1e6 / max(1e-9, nbytes / 1e6 / v - startup) for v in runs["workers=2"]]
    stats["workers=2, start-up excluded"] = spread(steady)
    return {"tokens": trained.splits["train"].num_tokens, "train_s": train_s,
            "tokenizer_file": tokenizer_file, "stats": stats, "startup": startup}


def measure_loader(paths: list[str], tokenizer_file: str, tmp: str,
                   quick: bool) -> dict[str, Any]:
    """The loader on the prepared uint16 dataset, local and on S3, against training."""
    from benchmarks.common_training import training_tokens_per_s
    from data_state.dataset import TokenDataset

    with moto_s3("baton-bench"):
        s3_uri = "s3://baton-bench/bpe"
        prepare_corpus(paths, s3_uri, seq_len=SEQ_LEN, val_fraction=0.0,
                       tokenizer=tokenizer_file, progress=False)
        local_uri = f"{tmp}/serial-0"
        with TokenDataset(local_uri) as ds:
            dtype, vocab = str(ds.dtype), ds.vocab_size
            train = training_tokens_per_s(ds, 3 if quick else 6)
        steps = 20 if quick else 100
        loader = {"local disk": loader_tokens_per_s(local_uri, steps),
                  "S3 (moto, 127.0.0.1)": loader_tokens_per_s(s3_uri, steps)}
    return {"dtype": dtype, "vocab": vocab, "train": train, "loader": loader}


def main() -> int:
    parser = arg_parser(__doc__, __spec__)
    parser.add_argument("--quick", action="store_true", help="smaller text, fewer rounds")
    parser.add_argument("--max-bytes", type=int, default=None, help="text to tokenize")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--scaling-bytes", type=int, default=None,
                        help="text for the worker-scaling part (default 8 MB, --quick 2 MB)")
    parser.add_argument("--scaling-only", action="store_true",
                        help="run only the worker-scaling part; update the JSON file's entry")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    max_bytes = args.max_bytes or (1_000_000 if args.quick else 6_000_000)
    rounds = args.rounds or (2 if args.quick else 3)
    scaling_bytes = args.scaling_bytes or (2_000_000 if args.quick else 8_000_000)
    if args.scaling_only:
        return scaling_only(scaling_bytes, rounds, args.out)
    paths, texts, nbytes = corpus_prefix(max_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        prep = measure_prepare(paths, texts, nbytes, rounds, tmp)
        load = measure_loader(paths, prep["tokenizer_file"], tmp, args.quick)
        scaling_paths, _, scaling_nbytes = corpus_prefix(scaling_bytes)
        scaling = worker_scaling(scaling_paths, scaling_nbytes, rounds, prep["tokenizer_file"],
                                 tmp)
    import tokenizers

    stats, train, loader = prep["stats"], load["train"], load["loader"]
    reference, serial = stats["encode_batch"]["median"], stats["serial"]["median"]
    result: dict[str, Any] = {
        "meta": {"python": platform.python_version(), "tokenizers": tokenizers.__version__,
                 "cpus": os.cpu_count(), "text_bytes": nbytes, "files": len(paths),
                 "bpe_vocab": VOCAB, "bpe_train_s": prep["train_s"], "rounds": rounds,
                 "worker_start_s": prep["startup"],
                 "tokens": prep["tokens"], "token_dtype": load["dtype"]},
        "prepare_mb_per_s": stats,
        "ratios": {"serial / encode_batch": serial / reference,
                   "workers=2 / encode_batch": stats["workers=2"]["median"] / reference,
                   "workers=2 / serial": stats["workers=2"]["median"] / serial,
                   "workers=2 (start-up excluded) / serial":
                   stats["workers=2, start-up excluded"]["median"] / serial},
        "training_tokens_per_s": train,
        "loader_tokens_per_s": loader,
        "loader_ratio_to_training": {k: v / train for k, v in loader.items()},
        "scaling": scaling,
    }
    write_json(args.out, result, indent=2)
    print_result(result, load["vocab"])
    print(f"wrote {args.out}")
    return 0


def print_result(result: dict[str, Any], vocab: int) -> None:
    meta, stats, ratios = result["meta"], result["prepare_mb_per_s"], result["ratios"]
    reference, train = stats["encode_batch"]["median"], result["training_tokens_per_s"]
    print(f"text: {meta['files']} stdlib files, {meta['text_bytes'] / 1e6:.1f} MB; BPE {VOCAB} "
          f"ids trained in {meta['bpe_train_s']:.1f} s (not timed below); {meta['rounds']} "
          "alternating rounds")
    print(f"{'path':<30} {'MB/s median':>12} {'range':>16} {'x encode_batch':>15}")
    for name, s in stats.items():
        print(f"{name:<30} {s['median']:>12.2f} {s['min']:>7.2f}-{s['max']:<8.2f} "
              f"{s['median'] / reference:>14.2f}x")
    print(f"worker processes start in {meta['worker_start_s']:.1f} s (median); workers=2 / "
          f"serial: {ratios['workers=2 / serial']:.2f}x, start-up excluded "
          f"{ratios['workers=2 (start-up excluded) / serial']:.2f}x")
    print(f"loader, {meta['token_dtype']} tokens (vocab {vocab}), against training at "
          f"{train:,.0f} tokens/s:")
    for name, rate in result["loader_tokens_per_s"].items():
        print(f"  {name:<22} {rate:>12,.0f} tokens/s {rate / train:>9.1f}x")
    print_scaling(result["scaling"])


def scaling_only(scaling_bytes: int, rounds: int, out: Path) -> int:
    """The worker-scaling part alone; the BPE it uses is trained on the first 1 MB (untimed)."""
    paths, _, _ = corpus_prefix(1_000_000)
    with tempfile.TemporaryDirectory() as tmp:
        prepare_corpus(paths, f"{tmp}/trained", seq_len=SEQ_LEN, val_fraction=0.0,
                       train_tokenizer=VOCAB, progress=False)
        scaling_paths, _, nbytes = corpus_prefix(scaling_bytes)
        scaling = worker_scaling(scaling_paths, nbytes, rounds, f"{tmp}/trained/tokenizer.json",
                                 tmp)
    result = read_json(out)
    result["scaling"] = scaling
    write_json(out, result, indent=2)
    print_scaling(scaling)
    print(f"wrote {out} (its \"scaling\" entry)")
    return 0


if __name__ == "__main__":  # spawned worker processes import this module: run only as main
    raise SystemExit(main())
