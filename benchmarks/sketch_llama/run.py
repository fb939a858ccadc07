"""BASIS on a Hugging Face Llama: activation memory, step time and validation loss (issue 16).

The model: `transformers`' `LlamaForCausalLM` from recipes/llama-tiny/config.json scaled to d_model
256, 4 layers, 4 query / 2 key-value heads (head_dim 64), intermediate 688 (Llama's 8/3·d rounded to
a multiple of 16), random init, fp32, on the byte-level corpus `benchmarks/sketch_quality/run.py`
trains on (`common_training.ensure_quality_corpus`), with its own causal-LM loss
(`trainer.train.hf.causal_lm_loss`).

Variants (`VARIANTS` in `benchmarks/sketch_llama/variants.py`), BASIS ones at R = n/16: exact
backprop; exact with the SwiGLU MLP recomputed and the RMSNorms fused (the selective-recompute
baseline at BASIS's memory); `include="auto"` with its defaults, with `keep_gate=False` and with
`min_saving=0`; the fusions with only the down-projections sketched, chosen by name; down_proj only
without fusions; every `nn.Linear` without fusions (the old default). Trained: exact, auto, auto
with min_saving=0; the rest probed only; a variant missing library pieces is skipped with a note.

Measured as `benchmarks/sketch_memory/run.py` and `benchmarks/sketch_quality/run.py` measure, with
their shared pieces (`benchmarks/common_training.py`), in fresh processes
(`benchmarks/sketch_llama/worker.py`): memory (saved-for-backward bytes, the step's peak resident
set; one single-thread process per variant) and step time (every variant in one process, rotating
order, ratio to exact per round) at one microbatch of 16 × 256 tokens; quality at equal steps over 3
seeds, on microbatches of 4 × 256 tokens unless `--train-microbatch 16` (~4x the time). How, and the
results: benchmarks/reports/2026-12-05-sketch-llama.md.

Resumable: probes and (variant, seed) runs are JSON files under benchmarks/results/sketch_llama/,
not redone; runs hold `/tmp/baton_cpu.lock` (flock), one training run at a time on one thread.

    python -m benchmarks.sketch_llama.run                 # everything (~45 min on 2 cores)
    python -m benchmarks.sketch_llama.run --only exact,auto --seeds 0
    python -m benchmarks.sketch_llama.run --report        # re-print from the saved runs
    python -m benchmarks.sketch_llama.run --quick --out /tmp/x.json   # smoke run, in-process
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS,
    CpuLock,
    WorkerFailed,
    arg_parser,
    malloc_env,
    read_json,
    run_worker,
    utc_now,
    write_json,
)
from benchmarks.common_training import QUALITY_CORPUS, ensure_quality_corpus
from benchmarks.sketch_llama.report import markdown, summarize, targets
from benchmarks.sketch_llama.variants import (
    FULL,
    QUICK,
    RANK_DIVISOR,
    SEEDS,
    VARIANTS,
    Size,
    Variant,
    missing_pieces,
    variant,
)
from benchmarks.sketch_llama.worker import MODES

DEFAULT_OUT = RESULTS / "sketch_llama.json"
DEFAULT_RUNS = RESULTS / "sketch_llama"
# As sketch_quality's probes: glibc maps every allocation above 64 KiB on its own and gives
# freed memory back at once, so VmHWM measures live tensors.
EXACT_RSS_ENV = malloc_env(65536, trim=True)


@dataclasses.dataclass
class Plan:
    size: Size
    data: str
    runs: Path
    in_process: bool  # --quick: no worker processes (a smoke run; its figures mean nothing)

    def child(self, mode: str, payload: dict[str, Any], *, exact_rss: bool) -> Any:
        """Run `mode` in a fresh single-thread `sketch_llama.worker` (or here, in-process)."""
        if self.in_process:
            return MODES[mode](payload)
        env = {"OMP_NUM_THREADS": "1", **(EXACT_RSS_ENV if exact_rss else {})}
        try:
            return run_worker("sketch_llama.worker", mode, json.dumps(payload), env=env,
                              what=f"{mode} {payload.get('variant', '')}")
        except WorkerFailed as err:
            raise SystemExit(str(err)) from None

    def payload(self, **more: Any) -> dict[str, Any]:
        return {"size": dataclasses.asdict(self.size), "data": self.data, **more}

    def lock(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if self.in_process else CpuLock()


def run_probes(plan: Plan, variants: list[Variant], *, retime: bool = False) -> dict[str, Any]:
    """Memory probes of variants not probed yet; then, if any has no step time yet (or
    `retime`), the time probe of all of them together (ratios come from one process), merged
    into the saved times of other variants."""
    path = plan.runs / "probe.json"
    probes = read_json(path)
    memory = probes.setdefault("memory", {})
    timing = probes.setdefault("time", {})
    todo = [v for v in variants if v.name not in memory]
    with plan.lock():
        for v in todo:
            fields = dataclasses.asdict(v)
            memory[v.name] = plan.child("memory", plan.payload(variant=fields), exact_rss=True)
            print(f"memory {v.name}: {memory[v.name]}", flush=True)
            write_json(path, probes)
        if retime or any(v.name not in timing for v in variants):
            payload = plan.payload(variants=[dataclasses.asdict(v) for v in variants])
            timing.update(plan.child("time", payload, exact_rss=False))
            probes["time_rounds"] = plan.size.time_rounds
            print(f"time: {timing}", flush=True)
            write_json(path, probes)
    return probes


def run_training(plan: Plan, variants: list[Variant], seeds: tuple[int, ...]) -> None:
    """Each (variant, seed) run not on disk yet, one at a time (one thread each)."""
    for v in variants:
        for seed in seeds:
            path = plan.runs / f"{v.name}-s{seed}.json"
            if path.exists():
                continue
            with plan.lock():
                payload = plan.payload(variant=dataclasses.asdict(v), seed=seed)
                result = plan.child("train", payload, exact_rss=False)
            path.write_text(json.dumps(result))
            print(f"{v.name} seed {seed}: val {result['final_val']:.4f} "
                  f"({result['train_s']:.0f} s)", flush=True)


@contextlib.contextmanager
def _quick_data(plan_runs: Path, data: str | None) -> Iterator[str]:
    """The smoke run's corpus: `data` if given, else a small slice prepared under its runs."""
    if data:
        yield data
        return
    from data_state import prepare_corpus

    out = plan_runs / "corpus"
    if not (out / "dataset.json").exists():
        prepare_corpus(None, str(out), seq_len=33, max_bytes=300_000, progress=False)
    yield str(out)


def full_plan(args: argparse.Namespace, runs: Path) -> Plan:
    """The measured run's plan: FULL with the flags' rounds and training microbatch."""
    if not args.data and not args.report:
        ensure_quality_corpus()
    rounds = FULL.time_rounds if args.rounds is None else args.rounds
    size = dataclasses.replace(FULL, time_rounds=rounds)
    if args.train_microbatch is not None:
        if args.train_microbatch < 1:
            raise SystemExit("--train-microbatch: must be >= 1 (sequences per step)")
        size = dataclasses.replace(size, train_microbatch=args.train_microbatch)
    return Plan(size, args.data or str(QUALITY_CORPUS), runs, in_process=False)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = arg_parser(__doc__, __spec__)
    parser.add_argument("--only", default="", help="comma-separated variant names")
    parser.add_argument("--seeds", default="", help="comma-separated; default 0,1,2")
    parser.add_argument("--report", action="store_true", help="only aggregate saved runs")
    parser.add_argument("--no-train", action="store_true", help="probes only")
    parser.add_argument("--retime", action="store_true",
                        help="redo the step-time probe (e.g. on a quieter machine)")
    parser.add_argument("--rounds", type=int, help=f"timed rounds (default {FULL.time_rounds})")
    parser.add_argument("--train-microbatch", type=int,
                        help=f"sequences per training step (default {FULL.train_microbatch}; "
                        "16 = the probes' 4 096 tokens, ~4x the time)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny model, 4 steps, 1 seed, in this process")
    parser.add_argument("--data", help="prepared dataset (default: sketch_quality's corpus)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--runs", type=Path, help="probe and run files (default beside --out)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    runs = args.runs or (DEFAULT_RUNS if args.out == DEFAULT_OUT else args.out.with_suffix(""))
    runs.mkdir(parents=True, exist_ok=True)
    chosen = [variant(n) for n in args.only.split(",") if n] or VARIANTS
    skipped = {v.name: why for v in chosen if (why := missing_pieces(v))}
    chosen = [v for v in chosen if v.name not in skipped]
    if "exact" not in {v.name for v in chosen}:
        chosen.insert(0, variant("exact"))  # the reference of every ratio
    seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else SEEDS
    with contextlib.ExitStack() as stack:
        if args.quick:
            data = stack.enter_context(_quick_data(runs, args.data))
            plan = Plan(QUICK, data, runs, in_process=True)
            seeds = seeds[:1]
        else:
            plan = full_plan(args, runs)
        if not args.report:
            run_probes(plan, chosen, retime=args.retime)
            if not args.no_train:
                run_training(plan, [v for v in chosen if v.train], seeds)
        probes = read_json(runs / "probe.json")
        rows = summarize(runs, chosen, probes)
    write_result(args, argv, plan, probes, rows, skipped)
    return 0


def write_result(args: argparse.Namespace, argv: list[str] | None, plan: Plan,
                 probes: dict[str, Any], rows: list[dict[str, Any]],
                 skipped: dict[str, str]) -> None:
    import torch
    import transformers

    result = {
        "setup": {
            **dataclasses.asdict(plan.size),
            "time_rounds": probes.get("time_rounds", plan.size.time_rounds),
            "rank_divisor": RANK_DIVISOR,
            "data": plan.data,
            "quick": args.quick,
            "note": "memory and time at probe_microbatch x seq tokens, quality at "
            "train_microbatch x seq tokens (a 4 096-token step is ~2 s on one CPU thread)",
        },
        "meta": {
            "date_utc": utc_now(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cpus": os.cpu_count(),
            "argv": sys.argv[1:] if argv is None else argv,
        },
        "skipped": skipped,
        "rows": rows,
        "targets": targets(rows),
    }
    write_json(args.out, result)
    print(markdown(rows))
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    print(f"targets (auto): {result['targets']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
