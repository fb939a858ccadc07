"""Memory and speed of BASIS sketched layers against exact backprop and activation checkpointing.

One training step (forward, backward, AdamW update) of the built-in GPT (d_model 256, 4 layers, 4
heads, vocab 256, microbatch of 8 sequences, fp32, CPU) at several sequence lengths, for: exact
backprop (the built-in GPT, norms fused into the linear layers they feed); the same with plain
modules (no fusion); full per-block checkpointing; exact backprop with the MLP recomputed; BASIS
with the default policy (`trainer.train.model.SKETCH_LAYERS`) at each rank; BASIS in every linear
layer (docs/design.md §4 as written); the speed mode (every block linear sketched, nothing
recomputed); BASIS with checkpointing.

Memory, each configuration in a fresh process (`benchmarks/sketch_memory/worker.py`; on CUDA, all in
one): saved bytes (distinct storages packed for backward during one forward, parameters excluded)
and peak memory (the step's peak resident set, VmHWM reset through /proc/self/clear_refs, minus the
resident set just before it, after a warm-up step), under a fixed `MALLOC_MMAP_THRESHOLD_`
(`common.malloc_env`) so that the resident set follows live tensors.

Time: one more fresh process per sequence length builds every configuration and times them in
round-robin (after a warm-up round), under glibc's default settings; the ratio is the median over
rounds of (step time / exact's in the same round). Expect ±10–20 % noise between runs anyway.
`--clock cpu` times single-threaded steps by process CPU time instead, for a heavily loaded machine.

`--device cuda` runs the same on the GPU (the Triton kernels on the sketched layers): peak memory is
`torch.cuda.max_memory_allocated()` during the step minus the memory allocated just before it, steps
timed between `torch.cuda.synchronize()` calls; `benchmarks/gpu_check.sh` runs it so. Why it
measures so: benchmarks/reports/2026-12-03-sketch-memory-cpu.md.

    python -m benchmarks.sketch_memory.run            # full run, writes benchmarks/results/...
    python -m benchmarks.sketch_memory.run --quick    # smoke run (seq 128, one rank, 1 round)
    python -m benchmarks.sketch_memory.run --device cuda --out OUT.json  # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, arg_parser, malloc_env, run_worker, utc_now, write_json

DEFAULT_OUT = RESULTS / "sketch_memory.json"
MMAP_THRESHOLD = 1 << 20  # 1 MiB: every activation of this model is mapped on its own


def configurations(ranks: list[int], combined_ranks: list[int]) -> list[dict[str, Any]]:
    """The measured configurations; the first is exact backprop, the reference of the ratios.
    `ranks` are run with the default policy, the last of them also in every linear layer and
    in the speed mode; `combined_ranks` with checkpointing."""
    from trainer.train.model import SKETCH_LAYERS

    exact = {"rank": 0, "checkpoint": False}
    policy = {"checkpoint": False, "include": list(SKETCH_LAYERS)}
    configs = [
        {"name": "exact", **exact},
        {"name": "exact-unfused", **exact, "fuse_norms": False, "mlp_recompute": "never"},
        {"name": "checkpoint", "rank": 0, "checkpoint": True},
        {"name": "exact-recompute", **exact, "mlp_recompute": "always"},
    ]
    configs += [{"name": f"basis-R{r}", "rank": r, **policy} for r in ranks]
    if ranks:
        r = ranks[-1]
        configs.append({"name": f"basis-all-R{r}", "rank": r, "checkpoint": False})
        configs.append(
            {
                "name": f"speed-R{r}",
                "rank": r,
                "checkpoint": False,
                "include": ["blocks.*.attn.*", "blocks.*.mlp.*"],
                "mlp_recompute": "never",
            }
        )
    configs += [
        {"name": f"basis-R{r}+ckpt", "rank": r, **policy, "checkpoint": True}
        for r in combined_ranks
    ]
    return configs



def spawn(mode: str, payload: Any) -> Any:
    """`mode` ("memory" or "time") in a fresh `sketch_memory.worker` process; its result.
    Only memory runs with `malloc_env`: mapping every large tensor on its own makes each
    allocation fault in fresh pages, which would charge memory-heavy configurations extra
    time. The worker's stderr (progress, errors) goes straight to ours."""
    env = malloc_env(MMAP_THRESHOLD) if mode == "memory" else {}
    return run_worker("sketch_memory.worker", mode, json.dumps(payload), env=env, what=mode)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'seq':>5} {'config':<16} {'saved MB':>9} {'peak MB':>8} {'step s':>7} "
        f"{'saved/ex':>9} {'peak/ex':>8} {'time/ex':>8}  {'time/ex range':<13}"
    )
    for r in rows:
        low, high = r["time_ratio_range"]
        print(
            f"{r['seq_len']:>5} {r['name']:<16} {r['saved_bytes'] / 1e6:>9.1f} "
            f"{r['peak_bytes'] / 1e6:>8.1f} {r['step_s']:>7.2f} {r['saved_ratio']:>9.3f} "
            f"{r['peak_ratio']:>8.3f} {r['time_ratio']:>8.3f}  {low:.2f}-{high:.2f}"
        )


def print_profiles(rows: list[dict[str, Any]]) -> None:
    """Per configuration: op calls, kernel launches, synchronisations, the top three ops."""
    for r in rows:
        prof = r.get("profile")
        if not prof:
            continue
        top = ", ".join(f"{name} {us / 1e3:.1f} ms" for name, us, _ in prof["top_self_us"][:3])
        syncs = " ".join(f"{k}={v}" for k, v in prof["sync_and_copy_calls"].items()) or "none"
        print(f"{r['seq_len']:>5} {r['name']:<16} ops {prof['op_calls']}, launches "
              f"{prof['kernel_launches']}, syncs/copies: {syncs}; top ({prof['clock']}): {top}")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for seq_len in args.seq_lens:
        specs = [
            {**config, "seq_len": seq_len, "batch": args.batch, "device": args.device}
            for config in configurations(args.ranks, args.combined_ranks)
        ]
        print(f"seq {seq_len}: {len(specs)} configurations", flush=True)
        if args.device == "cuda":  # one process: CUDA start-up and Triton's JIT once
            memory = spawn("memory", specs)
        else:
            memory = [spawn("memory", [spec])[0] for spec in specs]
        payload = {"specs": specs, "rounds": args.rounds, "clock": args.clock,
                   "profile_top": args.profile}
        print(f"seq {seq_len}: timing, {args.rounds} rounds", flush=True)
        timing = spawn("time", payload)
        exact = memory[0]
        for spec, mem, tim in zip(specs, memory, timing, strict=True):
            row = {**spec, **mem, **tim}
            row["saved_ratio"] = mem["saved_bytes"] / exact["saved_bytes"]
            row["peak_ratio"] = mem["peak_bytes"] / exact["peak_bytes"]
            rows.append(row)
        print(f"seq {seq_len} done", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__, __spec__)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--combined-ranks", type=int, nargs="*", default=[64],
                        help="ranks also run with per-block checkpointing")
    parser.add_argument("--batch", type=int, default=8, help="sequences per microbatch")
    parser.add_argument("--rounds", type=int, default=3, help="timed round-robin rounds")
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="wall: wall-clock with torch's default threads; cpu: process CPU time of "
        "single-threaded steps (stable when other processes load the machine)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the steps run (cuda: GPU memory and synchronized timing)")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="after timing, profile one step of each configuration: its TOP "
                        "ops by self time, synchronisations and copies (into the JSON)")
    parser.add_argument("--quick", action="store_true", help="smoke run: seq 128, R 16, 1 round")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.device == "cuda" and args.clock == "cpu":
        parser.error("--clock cpu measures CPU work; with --device cuda use the wall clock")
    if args.quick:
        args.seq_lens, args.ranks, args.combined_ranks, args.rounds = [128], [16], [16], 1
    rows = run(args)
    print_table(rows)
    print_profiles(rows)
    import torch

    meta = {
        "date_utc": utc_now(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "argv": sys.argv[1:] if argv is None else argv,
        "clock": args.clock,
        "device": args.device,
        **({"gpu": torch.cuda.get_device_name(0)} if args.device == "cuda" else {}),
    }
    write_json(args.out, {"meta": meta, "results": rows}, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
