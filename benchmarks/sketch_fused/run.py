"""Step time of the fused sketch path on one GPU: BASIS's plans against exact backprop, in bf16.

For each width (`--d-models`, default 1024 and 2048) the built-in GPT (`--layers` blocks,
d/128 heads, byte vocabulary) takes training steps (forward, backward, AdamW) under bf16
autocast (Baton's `precision.dtype = "bf16"`: fp32 master weights) on `--batch` sequences of
`--seq` tokens, in five configurations:
- `exact`: exact backprop (norms fused into the linears they feed);
- `exact-recompute`: exact backprop with the MLP recomputed (`mlp_recompute = "always"`), the
  exact way to the memory BASIS's default saves;
- `basis-default`: `trainer.train.model.SKETCH_LAYERS` (the MLP's down-projection, recomputed MLP);
- `basis-all`: every linear layer sketched (the MLP recomputed, since its proj is sketched);
- `basis-all-norecompute`: every linear sketched, nothing recomputed (the speed mode).
Sketches have R = n / `--rank-share` rows (n = batch x seq tokens). Steps are timed between
`torch.cuda.synchronize()` calls in round-robin (one step of each configuration per round,
after two warm-up rounds), and each configuration's ratio is the median over rounds of its step
time over exact's in the same round. Also per configuration: the step's peak CUDA memory above
what was allocated before it, and the device kernels and host syncs of one step
(`sketch_ops.launch_count.LaunchCounter`: aten ops and Triton launches).

    python -m benchmarks.sketch_fused.run --out benchmarks/results/sketch_fused.json    # a GPU
    python -m benchmarks.sketch_fused.run --device cpu --tiny --out /tmp/s.json  # dry run, CPU

`--tiny` (d 32, one layer, 2 x 16 tokens, one warm-up round and one timed) checks the script
anywhere; on the CPU the layers run the torch reference, so its figures say nothing about the
GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import arg_parser
from sketch_ops import sketch_model, sketch_seed
from sketch_ops.launch_count import LaunchCounter
from trainer.config import ModelConfig
from trainer.train.model import GPT, SKETCH_LAYERS

CONFIGS: list[dict[str, Any]] = [
    {"name": "exact", "include": None, "mlp_recompute": "auto"},
    {"name": "exact-recompute", "include": None, "mlp_recompute": "always"},
    {"name": "basis-default", "include": list(SKETCH_LAYERS), "mlp_recompute": "auto"},
    {"name": "basis-all", "include": ["blocks.*", "lm_head"], "mlp_recompute": "auto"},
    {"name": "basis-all-norecompute", "include": ["blocks.*", "lm_head"],
     "mlp_recompute": "never"},
]


class Trainee:
    """One configuration: model, AdamW and a fixed microbatch on `device`."""

    def __init__(self, config: dict[str, Any], args: argparse.Namespace, d_model: int) -> None:
        torch.manual_seed(0)
        self.device = torch.device(args.device)
        cfg = ModelConfig(vocab_size=256, d_model=d_model, n_layers=args.layers,
                          n_heads=max(1, d_model // 128), mlp_recompute=config["mlp_recompute"])
        self.model = GPT(cfg, seq_len=args.seq).to(self.device)
        self.rank = max(1, args.batch * args.seq // args.rank_share)
        self.sketched = config["name"] != "exact" and config["name"] != "exact-recompute"
        if self.sketched:
            sketch_model(self.model, rank=self.rank, include=config["include"])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4,
                                     fused=self.device.type == "cuda")
        self.tokens = torch.randint(0, 256, (args.batch, args.seq + 1), device=self.device)
        self.dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        self.steps = 0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> float:
        """One training step; its wall time to the end of the device's work."""
        self.sync()
        start = time.perf_counter()
        autocast = torch.autocast(self.device.type, dtype=self.dtype,
                                  enabled=self.dtype != torch.float32)
        with sketch_seed(0, self.steps), autocast:
            loss = self.model.loss(self.tokens)
        with sketch_seed(0, self.steps):
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        self.sync()
        return time.perf_counter() - start

    def peak_bytes(self) -> int:
        """Peak allocated memory of one step above what was allocated before it (CUDA)."""
        if self.device.type != "cuda":
            return 0
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.step()
        return int(torch.cuda.max_memory_allocated(self.device) - base)

    def launches(self) -> tuple[int, int]:
        """(device kernels, host syncs) of one step."""
        with LaunchCounter() as count:
            self.step()
        return count.total, sum(count.syncs.values())


def measure(args: argparse.Namespace, d_model: int) -> list[dict[str, Any]]:
    """Every configuration at one width, timed in round-robin (module docstring)."""
    trainees = [Trainee(config, args, d_model) for config in CONFIGS]
    for _ in range(1 if args.tiny else 2):
        for trainee in trainees:
            trainee.step()  # warm-up: Triton's compilation, cuBLAS heuristics, allocator
    times = [[trainee.step() for trainee in trainees] for _ in range(args.rounds)]
    rows = []
    for i, (config, trainee) in enumerate(zip(CONFIGS, trainees, strict=True)):
        ratios = [row[i] / row[0] for row in times]
        kernels, syncs = trainee.launches()
        rows.append({
            "d_model": d_model, "name": config["name"], "rank": trainee.rank if
            trainee.sketched else 0, "step_ms": 1e3 * statistics.median(r[i] for r in times),
            "time_ratio": statistics.median(ratios), "time_ratio_range": [min(ratios),
                                                                          max(ratios)],
            "peak_bytes": trainee.peak_bytes(), "kernels_per_step": kernels,
            "host_syncs_per_step": syncs})
        print(f"d {d_model} {config['name']:<22} {rows[-1]['step_ms']:8.2f} ms "
              f"x{rows[-1]['time_ratio']:.3f} exact, peak {rows[-1]['peak_bytes'] / 2**20:8.1f}"
              f" MiB, {kernels} kernels, {syncs} syncs", flush=True)
    exact_peak = rows[0]["peak_bytes"]
    for row in rows:
        row["peak_ratio"] = row["peak_bytes"] / exact_peak if exact_peak else None
    del trainees
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__, __spec__)
    parser.add_argument("--d-models", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank-share", type=int, default=16, help="R = n / this")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy size, one round (dry run)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.tiny:
        args.d_models, args.layers, args.seq, args.batch, args.rounds = [32], 1, 16, 2, 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device (use --device cpu --tiny for a dry run)", file=sys.stderr)
        return 2
    rows = [row for d_model in args.d_models for row in measure(args, d_model)]
    device = (torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
              or "cpu")
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    summary = {"device": device, "torch": torch.__version__, "triton": triton_version, "args": {
                   k: v for k, v in vars(args).items() if k != "out"}, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
