"""Baton at real size on one GPU: snapshots of a ~1B Llama's state against torch.save / load
and DCP, BASIS at d 2048 and 4096, and BASIS's quality at 16k tokens a microbatch.

- `run`: the benchmark (`python -m benchmarks.gpu_scale.run --help`; the `gpu_scale` step of
  benchmarks/gpu_check.sh; `--tiny --device cpu` is a dry run);
- `snapshot`: the snapshot part; `basis`: the BASIS parts;
- `llama_3b.json`: the 3.0B Llama of `--large`.
"""
