"""BASIS on a Hugging Face Llama: activation memory, step time and validation loss of each
variant (`include = "auto"` among them) against exact backprop.

- `run`: the benchmark (`python -m benchmarks.sketch_llama.run --help`; `--quick` is a smoke
  run in-process), resumable;
- `variants`: the model sizes and variants; `worker`: the fresh processes;
- `report`: the table from the saved probes and runs.

Report: benchmarks/reports/2026-12-05-sketch-llama.md.
"""
