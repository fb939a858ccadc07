"""Baton at real size on one GPU: snapshots of a ~1B Llama's state against torch.save / load
and DCP, BASIS at d 2048 and 4096, and BASIS's quality at 16k tokens a microbatch.

- `run`: the benchmark (`python -m benchmarks.gpu_scale.run --help`; the `gpu_scale` step of
  benchmarks/gpu_check.sh; `--tiny --device cpu` is a dry run);
- `snapshot`: the snapshot part; `basis`: the BASIS parts;
- `llama_3b.json`: the 3.0B Llama of `--large`.

Expected time on one H100 (≤ 8 minutes in all, `gpu_check.sh --only gpu_scale` gives it 480
s): building the 1.1B model ~20 s, snapshot part ~3–4 min at 1–2 GB/s of disk (each round
writes the state four times; rounds stop early within `--snapshot-budget-s`), basis ~1 min
(Triton's compilation included), quality ~1.5 min (300 steps × 6 runs), plus preparing the
corpus once (~20 s).
"""
