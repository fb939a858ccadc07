"""BASIS quality on real text: what sketching costs in validation loss, and what it buys (issue 6).

The built-in GPT (d_model 256, 4 layers, 4 heads, seq_len 256) trains on the embedded corpus
(Python's standard library, `data_state.prepare_corpus`) through the project's loader, AdamW and
warmup-cosine schedule; a microbatch of 8 × 256 predicted tokens gives n = 2048 rows per linear
layer. Every configuration runs with several seeds (model init, data order and sketches follow the
seed): mean ± std of the final validation loss over a fixed held-out set.

Configurations (`VARIANTS` in `benchmarks/sketch_quality/variants.py`): exact backprop, full
checkpointing, exact with the MLP recomputed, BASIS as docs/design.md §4 writes it at several R, the
ways of closing the gap (which layers, per-layer R from a memory budget, the mean-centred estimator,
the learning rate) and a speed mode (every block linear sketched, nothing recomputed). Compared at
equal steps and batch, and at equal peak memory and exact's wall time (`derived_variants`: the
default on a larger microbatch, the speed mode on more steps, exact given those steps).

Phases, each resumable (a finished run is a JSON file and is not redone): probe (per variant, fresh
single-thread processes of `benchmarks/sketch_quality/worker.py`: step peak memory, saved bytes,
step time against exact's), train ((variant, seed) runs, two at a time on one thread each; then the
gradient error of each estimator, `benchmarks/sketch_quality/grad.py`), report
(`benchmarks/sketch_quality/report.py`: `benchmarks/results/sketch_quality.json`,
`sketch_quality.png` and Markdown tables on stdout). How each phase measures, and the results:
benchmarks/reports/2026-12-03-sketch-quality.md.

    python -m benchmarks.sketch_quality.run              # everything (~3 h on 2 cores)
    python -m benchmarks.sketch_quality.run --only exact,basis-r128 --seeds 0
    python -m benchmarks.sketch_quality.run --only speed-r128-time   # a derived run, once probed
    python -m benchmarks.sketch_quality.run --report     # re-print from the saved runs

Runs hold `/tmp/baton_cpu.lock` (flock) a batch at a time, so other timing-sensitive benchmarks on
the same machine do not overlap them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from benchmarks.common import (
    CpuLock,
    WorkerFailed,
    arg_parser,
    read_json,
    start_worker,
    worker_result,
    write_json,
)
from benchmarks.common_training import ensure_quality_corpus
from benchmarks.sketch_quality.report import report
from benchmarks.sketch_quality.variants import (
    HEADLINE,
    MALLOC_ENV,
    MEMORY_BASE,
    MEMORY_CANDIDATES,
    MEMORY_TOLERANCE,
    PROBE_ONLY,
    RUNS,
    SEEDS,
    VARIANTS,
    Variant,
    derived_variants,
    probe_key,
    variant,
)

ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _start(mode: str, payload: Any, *, exact_rss: bool = False) -> Any:
    """A `sketch_quality.worker` process on one thread (with MALLOC_ENV if `exact_rss`)."""
    env = {**ONE_THREAD, **(MALLOC_ENV if exact_rss else {})}
    return start_worker("sketch_quality.worker", mode, json.dumps(payload), env=env)


def run_probes(variants: list[Variant]) -> dict[str, dict[str, Any]]:
    """Memory and time probes of every variant not probed yet, each in a fresh process."""
    path = RUNS / "probe.json"
    probes: dict[str, dict[str, Any]] = read_json(path)
    todo = [v for v in variants if v.name not in probes and probe_key(v) == v.name]
    with CpuLock():
        for v in todo:
            fields = dataclasses.asdict(v)
            # Memory with glibc giving memory back at once (which slows steps), time without.
            memory = worker_result(_start("probe", fields, exact_rss=True), f"probe {v.name}")
            timing = worker_result(_start("time", fields), f"time probe {v.name}")
            probes[v.name] = {**memory, **timing}
            print(f"probe {v.name}: {probes[v.name]}", flush=True)
            write_json(path, probes)
    return probes


def run_training(variants: list[Variant], seeds: tuple[int, ...] | None = None) -> None:
    """Train every (variant, seed) not on disk yet, two at a time: `seeds`, or each
    variant's own. A failed run is reported and left for the next call."""
    jobs = [
        (v, s)
        for v in variants
        for s in (seeds if seeds is not None else SEEDS[: v.seeds])
        if not (RUNS / f"{v.name}-s{s}.json").exists()
    ]
    for i in range(0, len(jobs), 2):
        batch = jobs[i : i + 2]
        with CpuLock():
            procs = [(v, s, _start("train", {"variant": dataclasses.asdict(v), "seed": s}))
                     for v, s in batch]
            for v, s, proc in procs:
                try:
                    result = worker_result(proc, f"run {v.name} seed {s}")
                except WorkerFailed as err:
                    print(err, flush=True)
                    continue
                (RUNS / f"{v.name}-s{s}.json").write_text(json.dumps(result))
                print(
                    f"[{i + len(batch)}/{len(jobs)}] {v.name} seed {s}: "
                    f"val {result['final_val']:.4f} ({result['train_s']:.0f} s)",
                    flush=True,
                )


def probe_candidates() -> dict[str, dict[str, Any]]:
    """Probe MEMORY_BASE at growing MEMORY_CANDIDATES microbatches until one no longer fits
    under exact backprop's step peak; the probes, with those candidates added."""
    base = variant(MEMORY_BASE)
    probes = run_probes([])
    for m in MEMORY_CANDIDATES:
        probes = run_probes([dataclasses.replace(base, name=f"{MEMORY_BASE}-mb{m}", microbatch=m)])
        if probes[f"{MEMORY_BASE}-mb{m}"]["step_peak_mib"] > (
            probes["exact"]["step_peak_mib"] * MEMORY_TOLERANCE
        ):
            break
    return probes


def run_all(chosen: list[Variant], seeds: tuple[int, ...] | None, only: bool) -> None:
    """Probes, then training, headline figures first (the two targets) and refinements
    after; every phase resumes from what is on disk."""
    ensure_quality_corpus()
    run_probes(chosen + ([] if only else PROBE_ONLY))
    run_training([v for v in chosen if v.name in HEADLINE], seeds)
    if not only:
        run_training(derived_variants(probe_candidates()), seeds)
    run_training([v for v in chosen if v.group != "learning rate"], seeds)
    grad_path = RUNS / "grad_error.json"
    if not only and not grad_path.exists():
        from benchmarks.sketch_quality.grad import grad_error

        with CpuLock():
            write_json(grad_path, grad_error())
    run_training([v for v in chosen if v.group == "learning rate"], seeds)


def main() -> None:
    parser = arg_parser(__doc__, __spec__)
    parser.add_argument("--only", default="", help="comma-separated variant names")
    parser.add_argument("--seeds", default="", help="comma-separated; default: each variant's")
    parser.add_argument("--report", action="store_true", help="only aggregate saved runs")
    args = parser.parse_args()
    RUNS.mkdir(parents=True, exist_ok=True)
    probe_path = RUNS / "probe.json"
    if args.only:  # derived variants can be named too, once the probes that shape them exist
        saved = read_json(probe_path)
        derived = {v.name: v for v in derived_variants(saved)} if "exact" in saved else {}
        chosen = [derived[n] if n in derived else variant(n) for n in args.only.split(",") if n]
    else:
        chosen = VARIANTS
    seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else None
    if not args.report:
        run_all(chosen, seeds, bool(args.only))
    report(json.loads(probe_path.read_text()))


if __name__ == "__main__":
    main()
