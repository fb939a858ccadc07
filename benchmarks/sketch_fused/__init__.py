"""The sketch path's step time on one GPU: the fused kernels, and where a step's time goes.

- `run`: BASIS's plans through the fused sketch kernels against exact backprop in bf16
  (`python -m benchmarks.sketch_fused.run --help`; the `sketch_fused` step of
  benchmarks/gpu_check.sh; `--device cpu --tiny` is a dry run);
- `cuda_diag`: a diagnostic of a sketched CUDA step, host against device time, plan drawing
  and the kernels (`python -m benchmarks.sketch_fused.cuda_diag --out OUT.json`).

Reports: benchmarks/reports/2026-12-06-sketch-fused.md, benchmarks/reports/2026-12-04-gpu-check.md.
"""
