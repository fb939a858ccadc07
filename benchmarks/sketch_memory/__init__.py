"""Memory and speed of BASIS's sketched layers against exact backprop and activation
checkpointing, on the built-in GPT (CPU or CUDA).

- `run`: the benchmark (`python -m benchmarks.sketch_memory.run --help`; the `sketch_memory`
  step of benchmarks/gpu_check.sh runs it on a GPU);
- `worker`: its fresh processes, one measuring memory, one timing steps.

Reports: benchmarks/reports/2026-12-03-sketch-memory-cpu.md,
benchmarks/reports/2026-12-04-gpu-check.md.
"""
