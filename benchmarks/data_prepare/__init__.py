"""How fast `baton data prepare` tokenizes, how it scales with workers, and whether the loader
keeps up with its uint16 tokens.

- `run`: the benchmark (`python -m benchmarks.data_prepare.run --help`);
- `scaling`: its worker-scaling part, each run in a fresh `worker` process.

Reports: benchmarks/reports/2026-12-03-data-prepare.md,
benchmarks/reports/2026-12-04-data-prepare-workers.md.
"""
