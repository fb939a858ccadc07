"""Baton's benchmarks: run each from the repository root as a module, `python -m
benchmarks.<name>` (see benchmarks/reports/README.md for what each one measured). What they
share lives in `common.py` (timing, alternation, RSS, result files, fresh processes, a local S3)
and `common_training.py` (the model steps they time); a benchmark's worker processes run its
`*_worker` module. Results go to `benchmarks/results/` (not kept in git)."""
