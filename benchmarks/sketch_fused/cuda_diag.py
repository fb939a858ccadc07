"""Where a sketched CUDA step's time goes: host vs device, plan drawing, the kernels.

Diagnostic for the GPU machine (not part of the suite). On the built-in GPT of
`benchmarks/sketch_memory/run.py` (`common_training.Trainee`: d 256, 4 layers, seq 2048,
batch 8, fp32), in one process:

1. Host cost of the sketch plans (`make_plan` on the CPU and on the device, `row_blocks`,
   `SketchPlan.to`) at n = 16 384.
2. The Triton bucket sum alone (CUDA events) on the shapes a step uses, against F.linear.
3. Steps of exact, exact-recompute and BASIS configurations in round-robin: wall time
   (synchronised) and host time (until the step's last call returns, before synchronising).
   Ablations: `+nodraw` memoises plans and fixes the seeds, so no plan is drawn after the
   warm-up step; `+block=K` runs the fused MLP in row blocks of K rows (default:
   `blocked.block_size`); `bf16-` under bf16 autocast (ratios to bf16 exact); `d1024-` a wider
   GPT (d 1024, bf16 on CUDA; `d1024-fp32-` in fp32).
4. A profile of one step of each BASIS configuration: top ops by CPU and device self time,
   synchronisations.

    python -m benchmarks.sketch_fused.cuda_diag --out OUT.json
"""

from __future__ import annotations

import contextlib
import json
import re
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import sketch_ops.blocked as blocked
import sketch_ops.function as function
import sketch_ops.seeds as seeds
from benchmarks.common import arg_parser, ratios, write_json
from benchmarks.common_training import Trainee


def median_ms(fn: Any, repeat: int = 30) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def cuda_ms(fn: Any, repeat: int = 30) -> float:
    if not torch.cuda.is_available():
        return median_ms(fn, repeat)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


@contextlib.contextmanager
def plan_cache(plans: dict[Any, Any], blocks: dict[Any, Any]) -> Iterator[None]:
    """Memoise make_plan and block_plan in the dicts given (an ablation, not the product)."""
    original_make = seeds.make_plan
    original_block = blocked.BlockInputSketch.block_plan

    def make(n: int, rank: int, seed: int, *, balanced: bool = True, device: Any = None) -> Any:
        key = (n, rank, seed, balanced, str(device))
        if key not in plans:
            plans[key] = original_make(n, rank, seed, balanced=balanced, device=device)
        return plans[key]

    def block_plan(self: Any, start: int, end: int) -> Any:
        key = (id(self.plan), start, end)
        if key not in blocks:
            blocks[key] = original_block(self, start, end)
        return blocks[key]

    function.make_plan = blocked.make_plan = make  # type: ignore[assignment]
    blocked.BlockInputSketch.block_plan = block_plan  # type: ignore[method-assign]
    try:
        yield
    finally:
        function.make_plan = blocked.make_plan = original_make  # type: ignore[assignment]
        blocked.BlockInputSketch.block_plan = original_block  # type: ignore[method-assign]


class Timed:
    """A Trainee with its step timed on the host (enqueue) and on the wall (synchronised)."""

    def __init__(self, name: str, spec: dict[str, Any], mode: str = "") -> None:
        self.name, self.mode = name, mode
        self.trainee = Trainee(spec)
        self.plans: dict[Any, Any] = {}
        self.blocks: dict[Any, Any] = {}

    def step(self) -> tuple[float, float]:
        from sketch_ops import sketch_seed

        t = self.trainee
        t.synchronize()
        step = 0 if self.mode == "nodraw" else t.num_steps
        cache = (plan_cache(self.plans, self.blocks) if self.mode == "nodraw"
                 else contextlib.nullcontext())
        # block=K: the fused MLP in blocks of K rows whatever the device (default: block_size)
        blocked.GPU_BLOCK_BYTES = 0 if self.mode.startswith("block=") else (64 << 20)
        blocked.BLOCK_ROWS = int(self.mode[6:]) if self.mode.startswith("block=") else 2048
        start = time.perf_counter()
        autocast = torch.autocast(t.device.type, dtype=torch.bfloat16,
                                  enabled=self.mode == "bf16")
        with cache, sketch_seed(0, step):
            with autocast:
                loss = t.model.loss(t.tokens)
            loss.backward()
        t.opt.step()
        t.opt.zero_grad(set_to_none=True)
        host = time.perf_counter() - start
        t.synchronize()
        wall = time.perf_counter() - start
        t.num_steps += 1
        return host, wall


def plan_costs(dev: torch.device) -> dict[str, float]:
    """1. Host cost of drawing and moving the sketch plans at n = 16 384 (ms)."""
    n = 16384
    result: dict[str, float] = {}
    plans = {}
    for rank in (64, 256):
        plans[rank] = seeds.make_plan(n, rank, 123)
        result[f"make_plan_ms_R{rank}"] = median_ms(lambda r=rank: seeds.make_plan(n, r, 123))
        result[f"row_blocks_ms_R{rank}"] = median_ms(lambda r=rank: plans[r].row_blocks(2048))
        result[f"plan_to_device_ms_R{rank}"] = median_ms(lambda r=rank: plans[r].to(dev))
        on_dev = seeds.make_plan(n, rank, 123, device=dev)
        result[f"make_plan_on_device_host_ms_R{rank}"] = median_ms(
            lambda r=rank: seeds.make_plan(n, r, 123, device=dev))
        result[f"row_blocks_on_device_host_ms_R{rank}"] = median_ms(
            lambda p=on_dev: p.row_blocks(2048))
    return result


def kernel_times(dev: torch.device) -> dict[str, float]:
    """2. The bucket sum alone against F.linear on the shapes a step uses (ms)."""
    from sketch_ops import dispatch

    kernels: dict[str, float] = {}
    for rows, width, rank in ((16384, 1024, 64), (2048, 1024, 64), (16384, 256, 256),
                              (16384, 1024, 256)):
        mat = torch.randn(rows, width, device=dev)
        plan = seeds.make_plan(rows, rank, 7, device=dev)
        kernels[f"bucket_sum {rows}x{width} R{rank}"] = cuda_ms(
            lambda m=mat, p=plan: dispatch.bucket_sum(m, p))
        weight = torch.randn(width, width, device=dev)
        kernels[f"F.linear {rows}x{width}x{width}"] = cuda_ms(
            lambda m=mat, w=weight: torch.nn.functional.linear(m, w))
        kernels[f"bucket_sum host_ms {rows}x{width} R{rank}"] = median_ms(
            lambda m=mat, p=plan: dispatch.bucket_sum(m, p))
    return kernels


def step_runners(dev: torch.device) -> list[Timed]:
    """3. The configurations whose steps are timed, with their ablations."""
    from trainer.train.model import SKETCH_LAYERS

    seq = 2048 if dev.type == "cuda" else 128
    base = {"checkpoint": False, "seq_len": seq, "batch": 8, "device": dev.type}
    policy = {**base, "include": list(SKETCH_LAYERS)}
    speed = {**base, "include": ["blocks.*.attn.*", "blocks.*.mlp.*"], "mlp_recompute": "never"}
    recompute = {**base, "rank": 0, "mlp_recompute": "always"}
    runners = [
        Timed("exact", {**base, "rank": 0}),
        Timed("exact-recompute", recompute),
        Timed("exact-recompute+block=2048", recompute, "block=2048"),
    ]
    for name, spec in (("basis-R64", {**policy, "rank": 64}),
                       ("speed-R256", {**speed, "rank": 256})):
        for mode in ("", "nodraw", "block=2048"):
            if name.startswith("speed") and mode.startswith("block"):
                continue  # nothing row-blocked in the speed mode
            runners.append(Timed(name + (f"+{mode}" if mode else ""), spec, mode))
    for bf16_name, spec in (("bf16-exact", {**base, "rank": 0}),
                            ("bf16-exact-recompute", recompute),
                            ("bf16-basis-R64", {**policy, "rank": 64})):
        runners.append(Timed(bf16_name, spec, "bf16"))
    # A wider model (d 1024, 16 heads): more GPU work per launch.
    wide = {"d_model": 1024, "n_heads": 16}
    for wide_name, spec in (("d1024-exact", {**base, **wide, "rank": 0}),
                            ("d1024-exact-recompute", {**recompute, **wide}),
                            ("d1024-basis-R64", {**policy, **wide, "rank": 64}),
                            ("d1024-basis-R256", {**policy, **wide, "rank": 256})):
        runners.append(Timed(wide_name, spec, "bf16" if dev.type == "cuda" else ""))
    for wide_name, spec in (("d1024-fp32-exact", {**base, **wide, "rank": 0}),
                            ("d1024-fp32-basis-R64", {**policy, **wide, "rank": 64})):
        runners.append(Timed(wide_name, spec))
    return runners


def step_times(runners: list[Timed], rounds: int) -> dict[str, dict[str, Any]]:
    """Two warm-up steps each, then `rounds` rounds of one step each in round-robin: host and
    wall time, and the wall-time ratio to its family's exact (bf16-, d1024-, ...) per round."""
    for r in runners:
        r.step()
        r.step()
    rows = [[r.step() for r in runners] for _ in range(rounds)]
    steps = {}
    for i, r in enumerate(runners):
        host = [row[i][0] for row in rows]
        wall = [row[i][1] for row in rows]
        family = re.match(r"(.*?)(exact|basis|speed)", r.name).group(1)  # type: ignore[union-attr]
        reference = next(j for j, q in enumerate(runners) if q.name == family + "exact")
        ratio = ratios(wall, [row[reference][1] for row in rows])
        steps[r.name] = {"host_ms": statistics.median(host) * 1e3,
                         "wall_ms": statistics.median(wall) * 1e3,
                         "ratio": ratio["median"],
                         "ratio_range": [ratio["min"], ratio["max"]]}
        print(r.name, {k: (round(v, 2) if isinstance(v, float) else v)
                       for k, v in steps[r.name].items()}, flush=True)
    return steps


def profiles(runners: list[Timed], dev: torch.device) -> dict[str, Any]:
    """4. One profiled step of three BASIS configurations: top ops by CPU and device self
    time, and the counts of synchronisations, copies and launches."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for r in runners:
        if r.name not in ("basis-R64", "bf16-basis-R64", "d1024-basis-R64"):
            continue
        r.trainee.synchronize()
        activities = [ProfilerActivity.CPU]
        if dev.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            r.step()
        events = prof.key_averages()
        by_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
        by_dev = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:20]
        out[r.name] = {
            "cpu": [[e.key, round(e.self_cpu_time_total / 1e3, 2), e.count] for e in by_cpu],
            "device": [[e.key, round(e.self_device_time_total / 1e3, 2), e.count]
                       for e in by_dev],
            "counts": {e.key: e.count for e in events
                       if "ynchron" in e.key or "Memcpy" in e.key or "local_scalar" in e.key
                       or "Launch" in e.key or "HostAlloc" in e.key or "pin" in e.key},
        }
        print(r.name, json.dumps(out[r.name])[:4000], flush=True)
    return out


def main() -> int:
    parser = arg_parser(__doc__, __spec__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    dev = torch.device(args.device)
    gpu = torch.cuda.get_device_name(0) if dev.type == "cuda" else ""
    result: dict[str, Any] = {"gpu": gpu, "torch": torch.__version__,
                              "threads": torch.get_num_threads()}
    result.update(plan_costs(dev))
    print(json.dumps(result), flush=True)
    result["kernels_ms"] = kernel_times(dev)
    print(json.dumps(result["kernels_ms"]), flush=True)
    runners = step_runners(dev)
    result["steps"] = step_times(runners, args.rounds)
    result["profiles"] = profiles(runners, dev)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
