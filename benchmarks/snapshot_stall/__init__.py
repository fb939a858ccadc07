"""How long a snapshot stops training: Baton against torch.save and DCP's async_save, and what
the replica checks and checksums add.

- `run`: the benchmark (`python -m benchmarks.snapshot_stall.run --help`);
- `replicas`: its part (e), the cost of the full replica checksums.

Reports: benchmarks/reports/2026-12-02-snapshot-stall.md,
benchmarks/reports/2026-12-06-replica-check.md, benchmarks/reports/2026-12-07-replica-checksums.md.
"""
