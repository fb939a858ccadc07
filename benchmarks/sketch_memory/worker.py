"""The fresh processes of `benchmarks/sketch_memory/run.py`: one measures memory, one times steps.

    python -m benchmarks.sketch_memory.worker memory '[SPEC, ...]'
    python -m benchmarks.sketch_memory.worker time '{"specs": [...], "rounds": R,
                                                     "clock": "wall"|"cpu", "profile_top": K}'

Each prints one JSON line: per spec {saved_bytes, peak_bytes} (memory) or {step_s, time_ratio,
time_ratio_range[, profile]} (time; specs[0] is the reference of the ratios). The driver runs
`memory` under `common.malloc_env` and one spec per process on CPU (the resident set is the
measure), all specs in one process on CUDA (the allocator's counters are).
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

import torch

from benchmarks.common import ratios, reset_peak_rss, status_bytes, worker_main
from benchmarks.common_training import Trainee


def measure_memory_each(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`measure_memory` of each spec in turn, in this process."""
    results = []
    for spec in specs:
        print(f"  memory: {spec['name']}", file=sys.stderr, flush=True)
        results.append(measure_memory(spec))
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # the last trainee is gone: give its blocks back
    return results


def measure_memory(spec: dict[str, Any]) -> dict[str, Any]:
    """Saved bytes (census of the warm-up step) and the next step's peak above the memory
    in use just before it: CUDA's allocator counters, or the process's VmHWM after a reset."""
    trainee = Trainee(spec)
    saved: dict[int, int] = {}
    trainee.step(saved)  # warm-up, and the saved-bytes census
    if trainee.device.type == "cuda":
        baseline = torch.cuda.memory_allocated(trainee.device)
        torch.cuda.reset_peak_memory_stats(trainee.device)
        trainee.step()
        peak = torch.cuda.max_memory_allocated(trainee.device) - baseline
        return {"saved_bytes": sum(saved.values()), "peak_bytes": peak}
    baseline = status_bytes("VmRSS")
    reset_peak_rss()
    trainee.step()
    return {"saved_bytes": sum(saved.values()), "peak_bytes": status_bytes("VmHWM") - baseline}


def measure_time(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Every spec built here, timed in round-robin (one step of each per round, after a
    warm-up round); per spec the median step and its ratio to specs[0] in the same round."""
    specs, rounds, clock = payload["specs"], payload["rounds"], payload["clock"]
    profile_top = payload.get("profile_top", 0)
    if clock == "cpu":
        torch.set_num_threads(1)  # one thread: process CPU time is then the step's work
    trainees = [Trainee(spec) for spec in specs]
    for trainee in trainees:
        trainee.step()  # warm-up round
    times = [[trainee.step(clock=clock) for trainee in trainees] for _ in range(rounds)]
    # After the timed rounds: the profiler's own overhead must not touch the timings.
    profiles = [profile_step(t, profile_top) if profile_top else None for t in trainees]
    results = []
    for i in range(len(specs)):
        r = ratios([row[i] for row in times], [row[0] for row in times])
        results.append(
            {
                "step_s": statistics.median(row[i] for row in times),
                "time_ratio": r["median"],
                "time_ratio_range": [r["min"], r["max"]],
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


if __name__ == "__main__":
    raise SystemExit(worker_main({"memory": measure_memory_each, "time": measure_time}))
