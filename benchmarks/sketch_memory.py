"""Memory and speed of BASIS sketched layers against exact backprop and activation checkpointing.

One training step (forward, backward, AdamW update) of the built-in GPT (d_model 256, 4 layers,
4 heads, vocab 256, microbatch of 8 sequences, fp32, CPU) at several sequence lengths, for:
exact backprop (the built-in GPT, norms fused into the linear layers they feed); the same with
plain modules (no fusion); full per-block checkpointing; exact backprop with the MLP recomputed;
BASIS with the default policy (`trainer.model.SKETCH_LAYERS`) at each rank; BASIS in every
linear layer (docs/design.md §4 as written); the speed mode (every block linear sketched, nothing
recomputed); BASIS with checkpointing.

Memory: each configuration runs in a fresh subprocess (on CUDA, all in one), which reports
- saved bytes: distinct storages packed for backward during one forward
  (`torch.autograd.graph.saved_tensors_hooks`), parameters excluded;
- peak memory: the process's peak resident set (VmHWM) during one step minus its resident set
  just before it, after a warm-up step (so model, optimizer state, data, thread pools and other
  one-time allocations already exist). The peak is reset there by writing 5 to
  /proc/self/clear_refs (Linux >= 4.0). The child runs with a fixed `MALLOC_MMAP_THRESHOLD_`,
  so glibc maps every large tensor on its own and unmaps it when freed; otherwise a freed block
  may stay in the heap and the resident set would measure the allocator's history rather than
  live tensors.

Time: one more subprocess per sequence length builds every configuration and times them in
round-robin (one step of each per round, after a warm-up round). The reported ratio is the
median over rounds of (configuration step time / exact step time in the same round): the
machine is shared, and pairing steps taken seconds apart cancels most of the load from other
processes. Expect ±10–20 % noise between runs anyway. The timing child runs with glibc's
default allocator settings (the memory children's would make every large allocation fault in
fresh pages and slow the memory-heavy configurations). When the machine is heavily loaded,
`--clock cpu` times single-threaded steps by process CPU time instead, which measures the
work of a step and hardly depends on the load.

`--device cuda` runs the same configurations on the GPU (the Triton kernels on the sketched
layers): peak memory is then `torch.cuda.max_memory_allocated()` during the step minus the
memory allocated just before it (after the warm-up step), and steps are timed between
`torch.cuda.synchronize()` calls. `benchmarks/gpu_check.sh` runs it so.

    python benchmarks/sketch_memory.py            # full run, writes benchmarks/results/...
    python benchmarks/sketch_memory.py --quick    # smoke run (seq 128, one rank, 1 round)
    python benchmarks/sketch_memory.py --device cuda --out OUT.json  # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "sketch_memory.json"
_MMAP_THRESHOLD = str(1 << 20)  # 1 MiB: every activation of this model is mapped on its own


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError as err:
        raise RuntimeError(
            "cannot reset the peak RSS (/proc/self/clear_refs, Linux >= 4.0)"
        ) from err


class Trainee:
    """One configuration's model, optimizer and fixed microbatch, ready to take steps."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch

        from sketch_ops import sketch_model
        from trainer.config import ModelConfig
        from trainer.model import GPT

        torch.manual_seed(0)
        cfg = ModelConfig(
            vocab_size=256,
            d_model=spec.get("d_model", 256),
            n_layers=spec.get("n_layers", 4),
            n_heads=spec.get("n_heads", 4),
            checkpoint_blocks=spec["checkpoint"],
            mlp_recompute=spec.get("mlp_recompute", "auto"),
            fuse_norms=spec.get("fuse_norms", True),
        )
        self.device = torch.device(spec.get("device", "cpu"))
        self.model = GPT(cfg, seq_len=spec["seq_len"]).to(self.device)
        if spec["rank"]:
            sketch_model(self.model, rank=spec["rank"], include=spec.get("include"))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.tokens = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq_len"] + 1),
                                    device=self.device)
        self.num_steps = 0

    def step(self, saved: dict[int, int] | None = None, clock: str = "wall") -> float:
        """One training step, timed; with `saved`, record the storages packed for backward."""
        import torch

        from sketch_ops import sketch_seed

        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if saved is not None and ptr not in params:
                saved[ptr] = t.untyped_storage().nbytes()
            return t

        census = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        timer = time.process_time if clock == "cpu" else time.perf_counter
        self.synchronize()
        start = timer()
        with sketch_seed(0, self.num_steps):
            with census if saved is not None else contextlib.nullcontext():
                loss = self.model.loss(self.tokens)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.num_steps += 1
        self.synchronize()
        return timer() - start

    def synchronize(self) -> None:
        """Wait for the GPU's queued work (a CUDA step is timed to its end, not its launch)."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)


def measure_memory_each(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`measure_memory` of each spec in turn, in this process. Several specs only on CUDA,
    where the allocator's own counters measure one step's peak whatever ran before; a CPU
    measurement reads the process's resident set, so `run` sends one spec per process."""
    import torch

    results = []
    for spec in specs:
        print(f"  memory: {spec['name']}", file=sys.stderr, flush=True)
        results.append(measure_memory(spec))
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # the last trainee is gone: give its blocks back
    return results


def measure_memory(spec: dict[str, Any]) -> dict[str, Any]:
    trainee = Trainee(spec)
    saved: dict[int, int] = {}
    trainee.step(saved)  # warm-up, and the saved-bytes census
    if trainee.device.type == "cuda":
        import torch

        baseline = torch.cuda.memory_allocated(trainee.device)
        torch.cuda.reset_peak_memory_stats(trainee.device)
        trainee.step()
        peak = torch.cuda.max_memory_allocated(trainee.device) - baseline
        return {"saved_bytes": sum(saved.values()), "peak_bytes": peak}
    baseline = _rss_bytes("VmRSS")
    _reset_peak()
    trainee.step()
    return {"saved_bytes": sum(saved.values()), "peak_bytes": _rss_bytes("VmHWM") - baseline}


def measure_time(
    specs: list[dict[str, Any]], rounds: int, clock: str, profile_top: int = 0
) -> list[dict[str, Any]]:
    if clock == "cpu":
        import torch

        torch.set_num_threads(1)  # one thread: process CPU time is then the step's work
    trainees = [Trainee(spec) for spec in specs]
    for trainee in trainees:
        trainee.step()  # warm-up round
    times = [[trainee.step(clock=clock) for trainee in trainees] for _ in range(rounds)]
    # After the timed rounds: the profiler's own overhead must not touch the timings.
    profiles = [profile_step(t, profile_top) if profile_top else None for t in trainees]
    results = []
    for i in range(len(specs)):
        ratios = [row[i] / row[0] for row in times]  # specs[0] is exact backprop
        results.append(
            {
                "step_s": statistics.median(row[i] for row in times),
                "time_ratio": statistics.median(ratios),
                "time_ratio_range": [min(ratios), max(ratios)],
                **({"profile": profiles[i]} if profiles[i] else {}),
            }
        )
    return results


def profile_step(trainee: Trainee, top: int) -> dict[str, Any]:
    """One step of `trainee` under torch.profiler: the `top` ops by self time on the device
    (CUDA) or the CPU, and how many device synchronisations and host-device copies the step
    made (each one stalls the host until the GPU's queue drains: on a launch-bound model
    the step then costs launch time plus GPU time instead of the larger of the two)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if trainee.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    trainee.synchronize()
    with profile(activities=activities) as prof:
        trainee.step()
    events = prof.key_averages()
    on_device = trainee.device.type == "cuda"

    def self_us(e: Any) -> float:
        return float(e.self_device_time_total if on_device else e.self_cpu_time_total)

    ranked = sorted((e for e in events if self_us(e) > 0), key=self_us, reverse=True)
    counts = {e.key: e.count for e in events}
    syncs = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense",
             "aten::nonzero", "cudaMemcpy", "cudaMemcpyAsync")
    return {
        "clock": "device" if on_device else "cpu",
        "top_self_us": [[e.key, round(self_us(e), 1), e.count] for e in ranked[:top]],
        "sync_and_copy_calls": {k: counts[k] for k in syncs if k in counts},
        "op_calls": sum(e.count for e in events if e.key.startswith("aten::")),
        "kernel_launches": counts.get("cudaLaunchKernel", 0) + counts.get("cuLaunchKernel", 0),
    }


def configurations(ranks: list[int], combined_ranks: list[int]) -> list[dict[str, Any]]:
    """The measured configurations; the first is exact backprop, the reference of the ratios.
    `ranks` are run with the default policy, the last of them also in every linear layer and
    in the speed mode; `combined_ranks` with checkpointing."""
    from trainer.model import SKETCH_LAYERS

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
    env = dict(os.environ)
    if mode == "--child-memory":
        # Only for memory: mapping every large tensor on its own makes each allocation fault in
        # fresh pages, which would charge memory-heavy configurations extra time.
        env["MALLOC_MMAP_THRESHOLD_"] = _MMAP_THRESHOLD
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, __file__, mode, json.dumps(payload)]
    # The child's stderr (progress, errors) goes straight to ours.
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed (exit {proc.returncode}); its errors are above")
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
            memory = spawn("--child-memory", specs)
        else:
            memory = [spawn("--child-memory", [spec])[0] for spec in specs]
        payload = {"specs": specs, "rounds": args.rounds, "clock": args.clock,
                   "profile_top": args.profile}
        print(f"seq {seq_len}: timing, {args.rounds} rounds", flush=True)
        timing = spawn("--child-time", payload)
        exact = memory[0]
        for spec, mem, tim in zip(specs, memory, timing, strict=True):
            row = {**spec, **mem, **tim}
            row["saved_ratio"] = mem["saved_bytes"] / exact["saved_bytes"]
            row["peak_ratio"] = mem["peak_bytes"] / exact["peak_bytes"]
            rows.append(row)
        print(f"seq {seq_len} done", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument(
        "--combined-ranks",
        type=int,
        nargs="*",
        default=[64],
        help="ranks also run with per-block checkpointing",
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences per microbatch")
    parser.add_argument("--rounds", type=int, default=3, help="timed round-robin rounds")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: wall-clock with torch's default threads; cpu: process CPU time of "
        "single-threaded steps (stable when other processes load the machine)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the steps run (cuda: GPU memory and synchronized timing)")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="after timing, profile one step of each configuration: its TOP "
                        "ops by self time, synchronisations and copies (into the JSON)")
    parser.add_argument("--quick", action="store_true", help="smoke run: seq 128, R 16, 1 round")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--child-memory", help=argparse.SUPPRESS)
    parser.add_argument("--child-time", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_memory:
        print(json.dumps(measure_memory_each(json.loads(args.child_memory))))
        return 0
    if args.child_time:
        payload = json.loads(args.child_time)
        print(json.dumps(measure_time(payload["specs"], payload["rounds"], payload["clock"],
                                      payload.get("profile_top", 0))))
        return 0
    if args.device == "cuda" and args.clock == "cpu":
        parser.error("--clock cpu measures CPU work; with --device cuda use the wall clock")
    if args.quick:
        args.seq_lens, args.ranks, args.combined_ranks, args.rounds = [128], [16], [16], 1
    rows = run(args)
    print_table(rows)
    print_profiles(rows)
    import torch

    meta = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "argv": sys.argv[1:] if argv is None else argv,
        "clock": args.clock,
        "device": args.device,
        **({"gpu": torch.cuda.get_device_name(0)} if args.device == "cuda" else {}),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
