"""What a node loss, or a node that arrives, costs, on a local multi-node Ray cluster.

- `run`: Baton's recovery against Ray Train's standard checkpoint recipe (`standard`), each
  tool in each failure-detection setting in a fresh process (`worker`)
  (`python -m benchmarks.recovery.run --help`);
- `survivors`: what the survivors lose, in-process recovery against a group restart and
  torchft (`python -m benchmarks.recovery.survivors --help`); its loops are in
  `survivors_loops`, each run in a fresh process (`survivors_worker`);
- `growth`: what a node added costs the running workers, in-place growth against a restart
  (`python -m benchmarks.recovery.growth --help`), on `survivors_worker`.

Reports: benchmarks/reports/2026-12-02-recovery.md,
benchmarks/reports/2026-12-07-recovery-survivors.md,
benchmarks/reports/2026-12-07-recovery-growth.md.
"""
