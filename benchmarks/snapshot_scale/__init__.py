"""What a snapshot costs at real sizes: Baton's persist and restore against torch.save /
torch.load and DCP, side by side, on one GPT + AdamW state of 0.3 to 3.4 GB.

- `run`: the benchmark (`python -m benchmarks.snapshot_scale.run --help`);
- `sides`: the state and the sides compared; `s3`: the same on a local S3 API;
- `fresh`: a restarted worker's restore, in fresh processes (`worker`);
- `report`: the summary and the projection to cluster sizes.

Reports: benchmarks/reports/2026-12-04-snapshot-scale.md,
benchmarks/reports/2026-12-05-snapshot-scale.md, benchmarks/reports/2026-12-06-restore-in-place.md.
"""
