"""How close a JAX continuation of a Baton run lands to the PyTorch run, and the reverse, with
the wall time of the JAX load, steps and save.

- `run`: the benchmark (`python -m benchmarks.jax_continue.run --help`).

Report: benchmarks/reports/2026-12-06-jax-portability.md.
"""
