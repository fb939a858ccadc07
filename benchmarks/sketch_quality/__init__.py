"""BASIS's quality on real text: the validation loss sketching costs, the memory and time it
buys, and the gradient error of each estimator, on the built-in GPT.

- `run`: the benchmark (`python -m benchmarks.sketch_quality.run --help`), resumable;
- `variants`: the configurations; `worker`: the fresh processes (memory, time, training);
- `grad`: the gradient-error table; `report`: the table and the plot from the saved runs.

Report: benchmarks/reports/2026-12-03-sketch-quality.md.
"""
