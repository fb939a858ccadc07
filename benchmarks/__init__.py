"""Baton's benchmarks, one package per family: each family's `__init__` says what it measures,
and each runs from the repository root as a module, `python -m benchmarks.<family>.<script>`
(`run` for the family's main script; see benchmarks/reports/README.md for what each measured).
A family holds its script, the sides it compares and its `worker` (the fresh processes it
starts). What they share lives here: `common.py` (timing, alternation, RSS, result files, fresh
processes, a local S3) and `common_training.py` (the model steps they time). Results go to
`benchmarks/results/` (not kept in git)."""
