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
  interpreter started with RAYON_NUM_THREADS=1 (set before `tokenizers` loads, so the serial
  path cannot use a thread pool either), timing `prepare_corpus` serial (1 process x 1 thread)
  and with `workers=2` (2 processes x 1 thread, their spawn inside the time), alternating,
  on more text (8 MB by default) so start-up is amortized. Speed-up = ratio of medians;
  `os.cpu_count()` and the load average at start and end are recorded, since on a shared
  machine other jobs take cores from both sides.

The machine is small and shared: absolute numbers move between runs, ratios much less.

    python benchmarks/data_prepare.py            # writes benchmarks/results/data_prepare.json
    python benchmarks/data_prepare.py --quick    # smaller text, fewer rounds (smoke run)
    python benchmarks/data_prepare.py --scaling-only   # only the scaling part, merged into
                                                       # the JSON file's "scaling" entry
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Not `from data_state import TokenDataset`: that loads torch, and spawned workers re-import
# this file, so each would pay a torch import inside the timed `workers=2` runs.
from data_state.corpus import default_corpus_files, prepare_corpus  # noqa: E402
from data_state.discover import cap  # noqa: E402

if TYPE_CHECKING:
    from data_state.dataset import TokenDataset

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "data_prepare.json"
SEQ_LEN, MICROBATCH, GLOBAL_BATCH, VOCAB = 256, 8, 64, 8192


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


def summary(mb_per_s: list[float]) -> dict[str, float]:
    return {"median": statistics.median(mb_per_s), "min": min(mb_per_s), "max": max(mb_per_s)}


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
    return statistics.median(times)


def training_tokens_per_s(ds: TokenDataset, steps: int) -> float:
    """The data-throughput benchmark's training rate (same model, microbatch and seq_len), on
    this dataset's vocabulary; imported here, not at the top: spawned workers import this file
    and must not load torch."""
    from data_throughput import training_tokens_per_s as measure

    return measure(ds, steps)


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


# Run in a fresh interpreter (`-c`: spawned workers then re-import nothing of this file), so
# RAYON_NUM_THREADS=1 is in the environment before `tokenizers` is loaded.
_SCALING_CHILD = """
import json, sys, time
args = json.load(sys.stdin)
from data_state.corpus import prepare_corpus
start, wall_start = time.perf_counter(), time.time()
prepare_corpus(args["paths"], args["out"], seq_len=args["seq_len"], val_fraction=0.0,
               tokenizer=args["tokenizer"], workers=args["workers"], progress=False)
print(json.dumps({"seconds": time.perf_counter() - start, "start": wall_start,
                  "end": time.time()}))
"""


def _start_pinned(paths: list[str], out: str, tokenizer_file: str,
                  workers: int) -> subprocess.Popen[str]:
    env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    child = subprocess.Popen([sys.executable, "-c", _SCALING_CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT,
                             text=True)
    assert child.stdin is not None
    child.stdin.write(json.dumps({"paths": paths, "out": out, "seq_len": SEQ_LEN,
                                  "tokenizer": tokenizer_file, "workers": workers}))
    child.stdin.close()
    return child


def _finish_pinned(child: subprocess.Popen[str], what: str) -> dict[str, float]:
    assert child.stdout is not None and child.stderr is not None
    stdout, stderr = child.stdout.read(), child.stderr.read()
    if child.wait() != 0:
        raise RuntimeError(f"scaling run ({what}) failed:\n{stderr}")
    return {k: float(v) for k, v in json.loads(stdout.strip().splitlines()[-1]).items()}


def pinned_prepare_s(paths: list[str], out: str, tokenizer_file: str, workers: int) -> float:
    """Seconds `prepare_corpus` takes in a fresh process whose tokenizer uses one thread."""
    child = _start_pinned(paths, out, tokenizer_file, workers)
    return _finish_pinned(child, f"workers={workers}")["seconds"]


def two_independent_s(paths: list[str], out: str, tokenizer_file: str) -> float:
    """The machine's own ceiling for two single-threaded processes: two independent serial
    prepares at once, each on every other file (half the text), timed from the first one's
    start to the last one's end. Nothing is shared between them, so their speed-up over one
    serial prepare is what two processes can get from these cores — on a VM whose two vCPUs
    are hyperthreads of one core, or on a loaded machine, that is well below 2x."""
    children = [_start_pinned(paths[i::2], f"{out}-{i}", tokenizer_file, 1) for i in (0, 1)]
    times = [_finish_pinned(c, "two independent") for c in children]
    return max(t["end"] for t in times) - min(t["start"] for t in times)


CEILING = "two independent serial, 1 thread each"


def worker_scaling(max_bytes: int, rounds: int, tokenizer_file: str, tmp: str) -> dict[str, Any]:
    """Serial (1 process x 1 thread) against workers=2 (2 x 1 thread), alternating."""
    load_start = os.getloadavg()
    paths, _, nbytes = corpus_prefix(max_bytes)
    runs: dict[str, list[float]] = {"serial, 1 thread": [], "workers=2, 1 thread each": [],
                                    CEILING: []}
    for r in range(rounds):
        for name, workers in (("serial, 1 thread", 1), ("workers=2, 1 thread each", 2)):
            seconds = pinned_prepare_s(paths, f"{tmp}/scaling-{workers}-{r}", tokenizer_file,
                                       workers)
            runs[name].append(nbytes / 1e6 / seconds)
        runs[CEILING].append(nbytes / 1e6 / two_independent_s(paths, f"{tmp}/two-{r}",
                                                               tokenizer_file))
    # One workers=2 run on one small file: mostly the two processes starting.
    startup = pinned_prepare_s(paths[:1], f"{tmp}/scaling-start", tokenizer_file, 2)
    stats = {name: summary(values) for name, values in runs.items()}
    return {
        "cpu_count": os.cpu_count(), "text_bytes": nbytes, "files": len(paths),
        "rounds": rounds, "worker_start_s": startup,
        "load_average_start": list(load_start), "load_average_end": list(os.getloadavg()),
        "mb_per_s": stats, "mb_per_s_runs": runs,
        "speedup_workers2_over_serial": stats["workers=2, 1 thread each"]["median"]
        / stats["serial, 1 thread"]["median"],
        "speedup_two_independent_over_serial": stats[CEILING]["median"]
        / stats["serial, 1 thread"]["median"],
        "workers2_over_two_independent": stats["workers=2, 1 thread each"]["median"]
        / stats[CEILING]["median"],
    }


def print_scaling(s: dict[str, Any]) -> None:
    print(f"worker scaling, tokenizer pinned to 1 thread per process (RAYON_NUM_THREADS=1): "
          f"{s['text_bytes'] / 1e6:.1f} MB, {s['files']} files, {s['rounds']} alternating rounds; "
          f"os.cpu_count() = {s['cpu_count']}")
    print("  load average (1, 5, 15 min) at start "
          + ", ".join(f"{x:.2f}" for x in s["load_average_start"]) + "; at end "
          + ", ".join(f"{x:.2f}" for x in s["load_average_end"])
          + ("  (other jobs were running)" if max(s["load_average_start"]) > 0.5 else ""))
    for name, st in s["mb_per_s"].items():
        print(f"  {name:<28} {st['median']:>8.2f} MB/s median  ({st['min']:.2f}-{st['max']:.2f})")
    print(f"  speed-up workers=2 / serial: {s['speedup_workers2_over_serial']:.2f}x "
          f"(ideal 2.00x; worker start-up {s['worker_start_s']:.1f} s is inside the time)")
    print(f"  what two processes get from these cores (two independent serial prepares at "
          f"once, half the text each): {s['speedup_two_independent_over_serial']:.2f}x")
    print(f"  --workers 2 / two independent prepares: {s['workers2_over_two_independent']:.2f} "
          f"(1.00 = linear in what the cores give)")


def _moto() -> object:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint,
                      AWS_ENDPOINT_URL_S3=endpoint)
    import boto3

    boto3.client("s3").create_bucket(Bucket="baton-bench")
    return server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
        started = time.perf_counter()
        trained = prepare_corpus(paths, f"{tmp}/trained", seq_len=SEQ_LEN, val_fraction=0.0,
                                 train_tokenizer=VOCAB, progress=False)
        train_s = time.perf_counter() - started
        tokenizer_file = f"{tmp}/trained/tokenizer.json"
        runs = tokenize_rounds(paths, texts, nbytes, tokenizer_file, rounds, tmp)
        stats = {name: summary(values) for name, values in runs.items()}
        reference = stats["encode_batch"]["median"]
        startup = worker_start_s(paths[0], tokenizer_file, tmp, rounds)
        # workers=2 without its fixed start-up: what a corpus much larger than this one sees.
        steady = [nbytes / 1e6 / max(1e-9, nbytes / 1e6 / v - startup) for v in runs["workers=2"]]
        stats["workers=2, start-up excluded"] = summary(steady)

        server = _moto()
        try:
            s3_uri = "s3://baton-bench/bpe"
            prepare_corpus(paths, s3_uri, seq_len=SEQ_LEN, val_fraction=0.0,
                           tokenizer=tokenizer_file, progress=False)
            local_uri = f"{tmp}/serial-0"
            with TokenDataset(local_uri) as ds:
                dtype, vocab = str(ds.dtype), ds.vocab_size
                train = training_tokens_per_s(ds, 3 if args.quick else 6)
            steps = 20 if args.quick else 100
            loader = {"local disk": loader_tokens_per_s(local_uri, steps),
                      "S3 (moto, 127.0.0.1)": loader_tokens_per_s(s3_uri, steps)}
        finally:
            server.stop()  # type: ignore[attr-defined]
        scaling = worker_scaling(scaling_bytes, rounds, tokenizer_file, tmp)

    import tokenizers

    result: dict[str, Any] = {
        "meta": {"python": platform.python_version(), "tokenizers": tokenizers.__version__,
                 "cpus": os.cpu_count(), "text_bytes": nbytes, "files": len(paths),
                 "bpe_vocab": VOCAB, "bpe_train_s": train_s, "rounds": rounds,
                 "worker_start_s": startup,
                 "tokens": trained.splits["train"].num_tokens, "token_dtype": dtype},
        "prepare_mb_per_s": stats,
        "ratios": {"serial / encode_batch": stats["serial"]["median"] / reference,
                   "workers=2 / encode_batch": stats["workers=2"]["median"] / reference,
                   "workers=2 / serial": stats["workers=2"]["median"]
                   / stats["serial"]["median"],
                   "workers=2 (start-up excluded) / serial":
                   stats["workers=2, start-up excluded"]["median"] / stats["serial"]["median"]},
        "training_tokens_per_s": train,
        "loader_tokens_per_s": loader,
        "loader_ratio_to_training": {k: v / train for k, v in loader.items()},
        "scaling": scaling,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"text: {len(paths)} stdlib files, {nbytes / 1e6:.1f} MB; BPE {VOCAB} ids trained in "
          f"{train_s:.1f} s (not timed below); {rounds} alternating rounds")
    print(f"{'path':<30} {'MB/s median':>12} {'range':>16} {'x encode_batch':>15}")
    for name, s in stats.items():
        print(f"{name:<30} {s['median']:>12.2f} {s['min']:>7.2f}-{s['max']:<8.2f} "
              f"{s['median'] / reference:>14.2f}x")
    print(f"worker processes start in {startup:.1f} s (median); workers=2 / serial: "
          f"{result['ratios']['workers=2 / serial']:.2f}x, start-up excluded "
          f"{result['ratios']['workers=2 (start-up excluded) / serial']:.2f}x")
    print(f"loader, {dtype} tokens (vocab {vocab}), against training at {train:,.0f} tokens/s:")
    for name, rate in loader.items():
        print(f"  {name:<22} {rate:>12,.0f} tokens/s {rate / train:>9.1f}x")
    print_scaling(scaling)
    print(f"wrote {args.out}")
    return 0


def scaling_only(scaling_bytes: int, rounds: int, out: Path) -> int:
    """The worker-scaling part alone; the BPE it uses is trained on the first 1 MB (untimed)."""
    paths, _, _ = corpus_prefix(1_000_000)
    with tempfile.TemporaryDirectory() as tmp:
        prepare_corpus(paths, f"{tmp}/trained", seq_len=SEQ_LEN, val_fraction=0.0,
                       train_tokenizer=VOCAB, progress=False)
        scaling = worker_scaling(scaling_bytes, rounds, f"{tmp}/trained/tokenizer.json", tmp)
    result = json.loads(out.read_text()) if out.exists() else {}
    result["scaling"] = scaling
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_scaling(scaling)
    print(f"wrote {out} (its \"scaling\" entry)")
    return 0


if __name__ == "__main__":  # spawned worker processes import this file: run only as a script
    sys.exit(main())
